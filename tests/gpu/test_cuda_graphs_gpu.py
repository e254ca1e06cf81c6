"""CUDA graphs and start-up memory sizing on a CUDA device (skipped without
one): greedy and seeded tokens identical with graphs on and off, with
async scheduling on and off and with programmatic dependent launch on and
off, batch 1 equal to batch 64, graphs actually
replayed, the KV pool sized from a profiled step, and models or contexts that
cannot fit refused at once."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.worker.cuda_graph import CudaGraphs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randint(2, 40))] for _ in range(n)]


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture
def count_replays(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Sizes of the decode graphs replayed (token graphs: ``count_token_replays``)."""
    return _count(monkeypatch, "replay_decode")


@pytest.fixture
def count_token_replays(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    return _count(monkeypatch, "replay_tokens")


def _count(monkeypatch: pytest.MonkeyPatch, method: str) -> list[int]:
    sizes: list[int] = []
    original = getattr(CudaGraphs, method)

    def counting(self: CudaGraphs, size: int) -> torch.Tensor:
        sizes.append(size)
        return original(self, size)  # type: ignore[no-any-return]

    monkeypatch.setattr(CudaGraphs, method, counting)
    return sizes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_prompts", [1, 3, 17])
def test_graphs_on_and_off_give_identical_tokens(
    dtype: str, num_prompts: int, tiny_checkpoint: Callable[[str], Path],
    count_replays: list[int], count_token_replays: list[int],
) -> None:
    path = str(tiny_checkpoint("llama"))
    prompts = _prompts(num_prompts)
    kwargs = dict(model=path, dtype=dtype, device="cuda", block_size=16, max_num_seqs=32,
                  gpu_memory_utilization=0.3)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    eager = LLM(**kwargs, enforce_eager=True)
    graphs = LLM(**kwargs)
    assert graphs.engine.core.executor.graphs is not None  # type: ignore[attr-defined]
    assert _tokens(graphs, prompts, greedy) == _tokens(eager, prompts, greedy)
    assert count_replays and max(count_replays) >= num_prompts
    assert count_token_replays  # the prefill steps replayed token graphs
    assert _tokens(graphs, prompts, seeded) == _tokens(eager, prompts, seeded)


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_pdl_on_and_off_give_identical_tokens(
    enforce_eager: bool, tiny_checkpoint: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Programmatic dependent launch (kernels/pdl.py) changes when kernels
    start, not what they compute: the same greedy tokens with it on and off,
    at batch 1 (the skinny GEMM, RMSNorm and decode attention all launched
    with it) and at batch 5, in graphs (captured with it on or off) and eager."""
    from kvserve.kernels import pdl

    path = str(tiny_checkpoint("llama"))
    kwargs = dict(model=path, dtype="bfloat16", device="cuda", max_num_seqs=8,
                  gpu_memory_utilization=0.3, enforce_eager=enforce_eager)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for enabled in (True, False):
        monkeypatch.setattr(pdl, "_enabled", enabled)
        assert pdl.use_pdl(torch.device("cuda")) == (
            enabled and torch.cuda.get_device_capability() >= (9, 0))
        llm = LLM(**kwargs)
        tokens[enabled] = [_tokens(llm, _prompts(1, seed=3), greedy),
                           _tokens(llm, _prompts(5, seed=4), greedy)]
        del llm
    assert tokens[True] == tokens[False]


def test_mixed_chunked_steps_replay_token_graphs_with_eager_tokens(
    tiny_checkpoint: Callable[[str], Path], count_token_replays: list[int],
) -> None:
    """Prefill chunks beside decodes under a small token budget: token graphs
    (padded and trimmed steps) give the tokens of eager steps."""
    path = str(tiny_checkpoint("llama"))
    rng = random.Random(5)
    # the tiny checkpoint's context is 128 positions: prompt + 24 new tokens fit
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(20, 100))] for _ in range(12)]
    kwargs = dict(model=path, dtype="bfloat16", device="cuda", max_num_seqs=8,
                  max_num_batched_tokens=96, gpu_memory_utilization=0.3)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    eager = _tokens(LLM(**kwargs, enforce_eager=True), prompts, greedy)
    assert _tokens(LLM(**kwargs), prompts, greedy) == eager
    assert len(count_token_replays) >= 5


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_async_scheduling_on_and_off_give_identical_tokens(
    enforce_eager: bool, tiny_checkpoint: Callable[[str], Path],
) -> None:
    path = str(tiny_checkpoint("llama"))
    prompts = _prompts(17, seed=2)
    kwargs = dict(model=path, dtype="bfloat16", device="cuda", max_num_seqs=32,
                  gpu_memory_utilization=0.3, enforce_eager=enforce_eager)
    sync = LLM(**kwargs, async_scheduling=False)
    overlapped = LLM(**kwargs, async_scheduling=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    expected = _tokens(sync, prompts, greedy)
    assert _tokens(overlapped, prompts, greedy) == expected
    # stops at different steps: each request ends on its own 5th token
    stopping = [SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=[t[4]])
                for t in expected]
    stopped = [o.outputs[0].token_ids
               for o in overlapped.generate(prompts, stopping, use_tqdm=False)]
    assert stopped == [t[: t.index(t[4]) + 1] for t in expected]
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    assert _tokens(overlapped, prompts, seeded) == _tokens(sync, prompts, seeded)
    stats = overlapped.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_batch_1_equals_batch_64_with_graphs(tiny_checkpoint: Callable[[str], Path],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A request alone gets the tokens it gets in a batch of 64: padding, block
    tables, split-K decode and graphs keep requests apart and compute each row
    alike. The one-row skinny GEMM is switched off: a batch-1 step runs it
    where a batch runs cuBLAS, and the two sum in different orders (decision
    0009), which can flip a bfloat16 near-tie of these peaked tiny models."""
    from kvserve.kernels import skinny_gemm

    monkeypatch.setattr(skinny_gemm, "LAYER_MAX_M", 0)
    llm = LLM(model=str(tiny_checkpoint("llama")), dtype="bfloat16", device="cuda",
              max_num_seqs=64, gpu_memory_utilization=0.3)
    prompts = _prompts(64, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    together = _tokens(llm, prompts, params)
    alone = [_tokens(llm, [p], params)[0] for p in prompts]
    assert together == alone


def test_kv_pool_is_sized_from_a_profiled_step(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvserve")
    kwargs = dict(model="qwen2.5-0.5b", load_format="dummy", dtype="bfloat16", device="cuda",
                  max_model_len=32768)
    small = LLM(**kwargs, gpu_memory_utilization=0.2)
    blocks_small = small.stats()["kv_blocks_total"]
    del small
    torch.cuda.empty_cache()
    large = LLM(**kwargs, gpu_memory_utilization=0.4)
    assert large.stats()["kv_blocks_total"] > blocks_small
    text = caplog.text
    for needle in ("profiled peak step", "KV cache:", "weights:", "CUDA graphs:", "startup"):
        assert needle in text, needle


def test_a_model_that_cannot_fit_fails_at_once() -> None:
    with pytest.raises(ValueError, match=r"weights need .* GB .*gpu_memory_utilization=0.01"):
        LLM(model="qwen2.5-7b", load_format="dummy", dtype="bfloat16", device="cuda",
            gpu_memory_utilization=0.01)


def test_a_context_that_cannot_fit_names_the_largest_that_would() -> None:
    free, total = torch.cuda.mem_get_info()
    # room for the weights (about 1 GB) and a little more, not for 32k tokens of KV (0.4 GB)
    utilization = (total - free + 1.2e9) / total
    with pytest.raises(ValueError, match=r"max_model_len=32768 needs 2048\. Lower max_model_len"):
        LLM(model="qwen2.5-0.5b", load_format="dummy", dtype="bfloat16", device="cuda",
            max_model_len=32768, gpu_memory_utilization=utilization)
