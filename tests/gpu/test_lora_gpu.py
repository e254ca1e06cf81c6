"""Batched LoRA on a CUDA device (skipped without one): the shrink and expand
kernels over a grid of shapes (llama-3-8b's packed qkv, gate_up and down),
ranks 8 / 16 / 32 / 64, dtypes, token counts and both forms against a
float64 per-token reference; then through the engine: steps with adapters
replay CUDA graphs (decode and token graphs) and give the same greedy
tokens as eager steps, a mixed batch gives each request its solo tokens,
and adapters evicted from their slot and from the host cache come back
with the same tokens."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from kvserve import LLM, LoRARequest, SamplingParams
from kvserve.worker.cuda_graph import CudaGraphs
from tests.conftest import make_lora_adapter
from tests.near_ties import GREEDY, assert_same_up_to_near_ties

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# (input size, slice sizes): llama-3-8b's qkv_proj, gate_up_proj, down_proj, o_proj
SHAPES = [(4096, [4096, 1024, 1024]), (4096, [14336, 14336]), (14336, [4096]), (4096, [4096])]
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def _indices(slots: np.ndarray, max_loras: int, form: str) -> dict[str, torch.Tensor]:
    if form == "gathered":
        return {"token_slots": torch.tensor(slots, dtype=torch.int32, device="cuda")}
    from kvserve.kernels.lora import num_tiles
    from kvserve.lora.manager import write_segments

    sorted_ids = np.zeros(len(slots), dtype=np.int32)
    tiles = np.zeros((3, num_tiles(len(slots), max_loras)), dtype=np.int32)
    write_segments(slots, max_loras, sorted_ids, tiles)
    return {"sorted_ids": torch.tensor(sorted_ids, device="cuda"),
            "tiles": torch.tensor(tiles, device="cuda")}


@pytest.mark.parametrize("form", ["gathered", "segmented"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rank", [8, 16, 32, 64])
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_kernels_equal_the_reference_over_a_grid(shape: int, rank: int, dtype: torch.dtype,
                                                 form: str) -> None:
    from kvserve.kernels.lora import SPLIT_K, lora_expand, lora_shrink

    k, sizes = SHAPES[shape]
    n, max_loras = sum(sizes), 8
    generator = torch.Generator(device="cuda").manual_seed(shape * 100 + rank)
    lora_a = (torch.randn(len(sizes), max_loras, rank, k, device="cuda", generator=generator)
              / k ** 0.5).to(dtype)
    lora_b = (torch.randn(max_loras, n, rank, device="cuda", generator=generator)
              / rank ** 0.5).to(dtype)
    slices = torch.tensor([np.cumsum([0, *sizes])[:-1].tolist(), sizes], dtype=torch.int32,
                          device="cuda")
    shrunk = torch.empty(SPLIT_K, 3, 1100, rank, device="cuda")
    rng = np.random.default_rng(rank)
    for num_tokens in (1, 5, 64, 257, 1024):
        x = torch.randn(num_tokens, k, device="cuda", generator=generator).to(dtype)
        base = torch.randn(num_tokens, n, device="cuda", generator=generator).to(dtype)
        slots = rng.integers(-1, max_loras, num_tokens).astype(np.int32)
        indices = _indices(slots, max_loras, form)
        out = base.clone()
        lora_shrink(x, lora_a, shrunk, **indices)
        lora_expand(shrunk, lora_b, out, slices, max(sizes), **indices)
        token_slots = torch.tensor(slots, device="cuda").long()
        has = token_slots >= 0
        a = lora_a.double()[:, token_slots.clamp(min=0)]  # [S, T, R, K]
        b = lora_b.double()[token_slots.clamp(min=0)]  # [T, N, R]
        expected = base.double().clone()
        start = 0
        for s, size in enumerate(sizes):
            mid = torch.einsum("tk,trk->tr", x.double(), a[s])
            delta = torch.einsum("tr,tnr->tn", mid, b[:, start:start + size])
            expected[:, start:start + size] += delta * has[:, None]
            start += size
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol,
                                   msg=f"{num_tokens} tokens")
        assert torch.equal(out[~has], base[~has])


# ------------------------------------------------------------ engine


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randint(2, 40))] for _ in range(n)]


@pytest.fixture
def replays(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    counts = {"replay_decode": 0, "replay_tokens": 0}
    for method in counts:
        original = getattr(CudaGraphs, method)

        def counting(self: CudaGraphs, size: int, _original=original, _method=method) -> object:
            counts[_method] += 1
            return _original(self, size)

        monkeypatch.setattr(CudaGraphs, method, counting)
    return counts


def _adapters(path: Path, root: Path) -> list[LoRARequest]:
    return [LoRARequest(f"a{i}", i + 1, str(make_lora_adapter(
        path, root / f"a{i}", rank=rank, alpha=2.0 * rank, seed=i,
        target_modules=targets)))
        for i, (rank, targets) in enumerate([
            (8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
            (16, ["q_proj", "v_proj"]), (4, ["down_proj", "o_proj"])])]


def _run(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None],
         max_tokens: int = 24) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_steps_replay_graphs_with_the_same_tokens_as_eager(
        tiny_checkpoint: Callable[[str], Path], tmp_path: Path, dtype: str,
        replays: dict[str, int]) -> None:
    path = tiny_checkpoint("llama")
    adapters = _adapters(path, tmp_path)
    prompts = _prompts(12, seed=3)
    loras: list[LoRARequest | None] = [[*adapters, None][i % 4] for i in range(len(prompts))]
    kwargs = dict(model=str(path), dtype=dtype, device="cuda", enable_lora=True, max_loras=3,
                  max_num_seqs=16, max_num_batched_tokens=64, gpu_memory_utilization=0.3)
    eager = _run(LLM(**kwargs, enforce_eager=True), prompts, loras)  # type: ignore[arg-type]
    graphs = LLM(**kwargs)  # type: ignore[arg-type]
    for key in replays:
        replays[key] = 0
    assert _run(graphs, prompts, loras) == eager
    assert replays["replay_decode"] > 0 and replays["replay_tokens"] > 0
    stats = graphs.stats()
    assert stats["num_graph_steps"] == stats["num_steps"]
    base = _run(graphs, prompts, [None] * len(prompts))
    assert all(base[i] != eager[i] for i in range(len(prompts)) if loras[i] is not None)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mixed_batch_equals_each_request_alone(
        tiny_checkpoint: Callable[[str], Path], tmp_path: Path, dtype: str) -> None:
    path = tiny_checkpoint("llama")
    adapters = _adapters(path, tmp_path)
    prompts = _prompts(9, seed=5)
    loras: list[LoRARequest | None] = [[*adapters, None][i % 4] for i in range(len(prompts))]
    llm = LLM(model=str(path), dtype=dtype, device="cuda", enable_lora=True, max_loras=3,
              max_num_seqs=16, max_num_batched_tokens=48, gpu_memory_utilization=0.3)
    solo = [llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=[lora])[0]
            for prompt, lora in zip(prompts, loras, strict=True)]
    together = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    if dtype == "float32":
        assert [o.outputs[0].token_ids for o in together] == [
            o.outputs[0].token_ids for o in solo]
    else:  # a lone request's one-row GEMMs sum in another order than a batch's
        assert_same_up_to_near_ties(together, solo)


def test_evicted_adapters_come_back_with_the_same_tokens(
        tiny_checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    path = tiny_checkpoint("llama")
    adapters = _adapters(path, tmp_path)
    prompt = _prompts(1, seed=7)
    kwargs = dict(model=str(path), dtype="bfloat16", device="cuda", enable_lora=True,
                  gpu_memory_utilization=0.3, enable_prefix_caching=False)
    roomy = LLM(**kwargs, max_loras=3)  # type: ignore[arg-type]
    expected = {lora.lora_int_id: _run(roomy, prompt, [lora]) for lora in adapters}
    del roomy
    tight = LLM(**kwargs, max_loras=1, max_cpu_loras=1)  # type: ignore[arg-type]
    for lora in [*adapters, *adapters[::-1]]:
        assert _run(tight, prompt, [lora]) == expected[lora.lora_int_id]
    manager = tight.engine.core.executor.lora_manager  # type: ignore[attr-defined]
    assert manager.num_disk_loads > len(adapters)


def test_slots_swapped_while_steps_run_keep_every_token(
        tiny_checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """Three adapters, two slots, async scheduling: slots are reloaded (on the
    side stream) while earlier steps still run; each request keeps its solo
    tokens."""
    path = tiny_checkpoint("llama")
    adapters = _adapters(path, tmp_path)
    prompts = _prompts(12, seed=11)
    loras: list[LoRARequest | None] = [[*adapters, None][i % 4] for i in range(len(prompts))]
    llm = LLM(model=str(path), dtype="float32", device="cuda", enable_lora=True, max_loras=2,
              max_num_seqs=8, max_num_batched_tokens=48, gpu_memory_utilization=0.3)
    solo = [_run(llm, [prompt], [lora])[0] for prompt, lora in zip(prompts, loras, strict=True)]
    manager = llm.engine.core.executor.lora_manager  # type: ignore[attr-defined]
    loads = manager.num_slot_loads
    assert _run(llm, prompts, loras) == solo
    assert manager.num_slot_loads > loads  # at least one slot reloaded in the mixed run
