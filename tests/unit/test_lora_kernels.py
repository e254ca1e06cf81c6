"""The batched LoRA kernels (``kernels/lora.py``) under the Triton interpreter.

Oracles: a per-token loop of ``(x[t] @ A[s, slot].T) @ B[slot, slice s].T``
for the kernels alone (gathered and segmented forms, packed slices of
different sizes, tokens without an adapter, padding), and ``LoRALinear``'s
torch path for a whole tiny model: the same float32 logits with the
kernels, for a mixed prefill and for a decode step, and the same greedy
tokens for a mixed batch as for each request alone through the engine."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.triton_interpreter import require_interpreter

require_interpreter("tests/gpu/test_lora_kernels_gpu.py")

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.config import LoRAConfig  # noqa: E402
from kvserve.kernels.lora import SPLIT_K, lora_expand, lora_shrink, num_tiles  # noqa: E402
from kvserve.lora import LoRARequest  # noqa: E402
from kvserve.lora.manager import LoRAManager, write_segments  # noqa: E402
from kvserve.models.loader import load_model  # noqa: E402
from kvserve.models.source import resolve_model_config  # noqa: E402
from kvserve.worker import model_runner  # noqa: E402
from tests.conftest import make_attention_metadata, make_lora_adapter  # noqa: E402
from tests.unit.test_lora import BLOCK_SIZE, PROMPTS  # noqa: E402


def reference_delta(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    sizes: list[int], slots: list[int]) -> torch.Tensor:
    """``[num_tokens, N]``: each token's delta through its own adapter, one by one."""
    out = torch.zeros(x.shape[0], lora_b.shape[1], dtype=torch.float64)
    starts = np.cumsum([0, *sizes])
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        for s, size in enumerate(sizes):
            rows = slice(int(starts[s]), int(starts[s]) + size)
            shrunk = x[t].double() @ lora_a[s, slot].double().T
            out[t, rows] = shrunk @ lora_b[slot, rows].double().T
    return out


def segmented_indices(slots: list[int], max_loras: int) -> dict[str, torch.Tensor]:
    sorted_ids = np.zeros(len(slots), dtype=np.int32)
    tiles = np.zeros((3, num_tiles(len(slots), max_loras)), dtype=np.int32)
    write_segments(np.asarray(slots, dtype=np.int32), max_loras, sorted_ids, tiles)
    return {"sorted_ids": torch.from_numpy(sorted_ids), "tiles": torch.from_numpy(tiles)}


CASES = [  # (slice sizes, input size, max rank, slots per token)
    ([24, 8, 8], 40, 8, [0, -1, 2, 0, 1, -1, 2, 2]),  # packed qkv, GQA-shaped
    ([20, 20], 33, 12, [1] * 5 + [-1] * 3 + [0] * 19),  # gate_up; a rank below a power of two
    ([48], 70, 16, [3, 3, 3, 1, -1]),  # one slice, K not a multiple of the tile
    ([16, 4, 4], 16, 4, [-1, -1, -1]),  # no adapter at all: nothing added
]


@pytest.mark.parametrize("form", ["gathered", "segmented"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_shrink_expand_equal_the_per_token_reference(form: str, case: int) -> None:
    sizes, k, rank, slots = CASES[case]
    generator = torch.Generator().manual_seed(case)
    max_loras, num_tokens, n = 4, len(slots), sum(sizes)
    x = torch.randn(num_tokens, k, generator=generator)
    lora_a = torch.randn(len(sizes), max_loras, rank, k, generator=generator)
    lora_b = torch.randn(max_loras, n, rank, generator=generator)
    base = torch.randn(num_tokens, n, generator=generator)
    indices = (segmented_indices(slots, max_loras) if form == "segmented"
               else {"token_slots": torch.tensor(slots, dtype=torch.int32)})
    # the buffers are larger than the step, as the runner's are
    shrunk = torch.full((SPLIT_K, 3, num_tokens + 5, rank), float("nan"))
    out = base.clone()
    slices = torch.tensor([np.cumsum([0, *sizes])[:-1].tolist(), sizes], dtype=torch.int32)
    lora_shrink(x, lora_a, shrunk, **indices)
    lora_expand(shrunk, lora_b, out, slices, max(sizes), **indices)
    expected = base.double() + reference_delta(x, lora_a, lora_b, sizes, slots)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)
    untouched = [t for t, slot in enumerate(slots) if slot < 0]
    assert torch.equal(out[untouched], base[untouched])


def test_bad_kernel_arguments_name_the_tensor() -> None:
    x, lora_a = torch.zeros(4, 8), torch.zeros(1, 2, 4, 8)
    slots = torch.zeros(4, dtype=torch.int32)
    buf = torch.zeros(SPLIT_K, 1, 4, 4)
    with pytest.raises(ValueError, match="buf float32"):
        lora_shrink(x, lora_a, buf.half(), token_slots=slots)
    with pytest.raises(ValueError, match="buf float32"):
        lora_shrink(x, lora_a, buf[0], token_slots=slots)
    with pytest.raises(ValueError, match="token_slots: int32"):
        lora_shrink(x, lora_a, buf, token_slots=slots.long())
    with pytest.raises(ValueError, match="not both"):
        lora_shrink(x, lora_a, buf, token_slots=slots, sorted_ids=slots,
                    tiles=slots[:3].view(3, 1))
    with pytest.raises(ValueError, match=r"tiles: int32 \[3, >= 3\]"):
        lora_shrink(x, lora_a, buf, sorted_ids=slots, tiles=slots[:3].view(3, 1))
    with pytest.raises(ValueError, match="slices int32"):
        lora_expand(buf, torch.zeros(2, 6, 4), torch.zeros(4, 6),
                    torch.zeros(2, 1, dtype=torch.int64), 6, token_slots=slots)


# ------------------------------------------------------------ through the model


@functools.cache
def _adapters(base: Path, root: Path) -> list[LoRARequest]:
    a = make_lora_adapter(base, root / "a", rank=8, alpha=16.0, seed=1)
    b = make_lora_adapter(base, root / "b", rank=4, alpha=8.0, seed=2, std=0.2,
                          target_modules=["q_proj", "v_proj", "down_proj"])
    return [LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))]


@pytest.fixture(scope="module")
def tiny_lora(tiny_checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[Path, list[LoRARequest]]:
    base = tiny_checkpoint("llama")
    return base, _adapters(base, tmp_path_factory.mktemp("lora-kernels"))


def _logits(base: Path, loras: list[LoRARequest], jobs: list[tuple[list[int], int]],
            use_kernels: bool, decode: bool) -> torch.Tensor:
    """Float32 logits of one step over ``jobs`` (prompt, lora id): the whole
    prompts, or (``decode``) their last tokens with the rest in the KV cache."""
    config, _ = resolve_model_config(str(base))
    model = load_model(config, base, "auto", torch.float32, "cpu")
    manager = LoRAManager(model, LoRAConfig(max_loras=2), torch.device("cpu"), 64,
                          use_kernels=use_kernels)
    for lora in loras:
        manager.add_lora(lora)
    from kvserve.attention.torch_ref import TorchRefAttentionBackend
    from kvserve.layers.attention import bind_kv_cache

    lens = [len(prompt) for prompt, _ in jobs]
    tables, next_block = [], 1
    for length in lens:
        num_blocks = -(-length // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + num_blocks)))
        next_block += num_blocks
    caches = [torch.zeros(2, next_block, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
              for _ in range(config.num_layers)]
    bind_kv_cache(model, caches, TorchRefAttentionBackend())
    ids = [lora_id for _, lora_id in jobs]
    with torch.inference_mode():
        if decode:  # the prompts but their last tokens fill the cache first
            prefix = [length - 1 for length in lens]
            manager.set_batch(ids, prefix)
            metadata, positions = make_attention_metadata(prefix, prefix, tables, BLOCK_SIZE)
            model(torch.tensor([t for prompt, _ in jobs for t in prompt[:-1]]), positions,
                  metadata)
            manager.set_batch(ids, [1] * len(jobs), num_padded_tokens=len(jobs) + 3)
            metadata, positions = make_attention_metadata([1] * len(jobs), lens, tables,
                                                          BLOCK_SIZE)
            return model.compute_logits(model(torch.tensor([p[-1] for p, _ in jobs]),
                                              positions, metadata))
        manager.set_batch(ids, lens)
        metadata, positions = make_attention_metadata(lens, lens, tables, BLOCK_SIZE)
        token_ids = torch.tensor([t for prompt, _ in jobs for t in prompt])
        return model.compute_logits(model(token_ids, positions, metadata))


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_kernels_equal_the_torch_path_in_a_model(
        tiny_lora: tuple[Path, list[LoRARequest]], decode: bool) -> None:
    base, loras = tiny_lora
    jobs = [(PROMPTS[0], 1), (PROMPTS[1], 0), (PROMPTS[2], 2), (PROMPTS[3], 1)]
    ours = _logits(base, loras, jobs, use_kernels=True, decode=decode)
    reference = _logits(base, loras, jobs, use_kernels=False, decode=decode)
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)
    without = _logits(base, [], [(p, 0) for p, _ in jobs], use_kernels=False, decode=decode)
    assert not torch.allclose(ours, without, atol=1e-2)  # the adapters do change the logits


@pytest.mark.slow
def test_engine_with_kernels_mixed_batch_equals_solo_runs(
        tiny_lora: tuple[Path, list[LoRARequest]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's kernel path (forced on the CPU): a batch mixing two adapters
    and none, prefill chunks and decodes, gives each request its solo tokens,
    and those equal the torch path's."""
    base, loras = tiny_lora
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    jobs = [(PROMPTS[i], lora) for i, lora in ((0, loras[0]), (1, None), (1, loras[1]))]

    def run(llm: LLM, batch: list[tuple[list[int], LoRARequest | None]]) -> list[list[int]]:
        outs = llm.generate([p for p, _ in batch], params, use_tqdm=False,
                            lora_request=[lora for _, lora in batch])
        return [o.outputs[0].token_ids for o in outs]

    kwargs = dict(model=str(base), enable_lora=True, max_loras=2, block_size=BLOCK_SIZE,
                  num_kv_blocks=128, max_num_batched_tokens=32)
    reference = run(LLM(**kwargs), jobs)  # type: ignore[arg-type]
    real = LoRAManager

    def with_kernels(*args: object, **kw: object) -> LoRAManager:
        kw["use_kernels"] = True
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(model_runner, "LoRAManager", with_kernels)
    llm = LLM(**kwargs)  # type: ignore[arg-type]
    assert llm.engine.core.executor.lora_manager.batch.use_kernels  # type: ignore[attr-defined]
    solo = [run(llm, [job])[0] for job in jobs]
    assert run(llm, jobs) == solo == reference
