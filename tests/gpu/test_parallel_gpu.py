"""Tensor and pipeline parallelism on CUDA devices (skipped with fewer than 2):
NCCL collectives captured in the CUDA graphs, the one-shot all-reduce, and
a worker killed mid-run.

Tiny checkpoints in float32 give one GPU's greedy tokens at TP=2, PP=2 (and
TP=2 x PP=2 with 4 devices), graphs replayed, under chunked prefill and
preemption; on 4 and 8 devices also TP=4, TP=2 x PP=2, PP=4, TP=8 and
TP=4 x PP=2, and the one-shot all-reduce over every GPU (``-k more_than_two``);
bf16 tokens are the same with graphs on and off, and with the one-shot
all-reduce as with NCCL; LoRA steps (eager) match one GPU; each
rank reports its own device and share; a model too large for the requested
sizes is refused naming the sizes that would fit. Every collective and
every wait is bounded (``distributed_timeout_s``), so a hang fails a test
rather than stalling the suite.

    python -m pytest -q tests/gpu/test_parallel_gpu.py    # on a 2-, 4- or 8-GPU machine
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve import LLM, LoRARequest, SamplingParams
from kvserve.worker.multiproc_executor import WorkerFailedError
from tests.conftest import make_lora_adapter

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
TIMEOUT_S = 120
# every engine takes at most this share of a device, so a reference engine
# not collected yet never starves the next one
MEMORY = 0.3
# chunks of 64 tokens and a small pool: preemption under 17 requests
STRESS = {"block_size": 16, "max_num_batched_tokens": 64, "num_kv_blocks": 40}


def _prompts(n: int = 17, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randint(2, 120))] for _ in range(n)]


PROMPTS = _prompts()


def _tokens(llm: LLM, params: SamplingParams = GREEDY, **kwargs: Any) -> list[list[int]]:
    outputs = llm.generate(PROMPTS, params, use_tqdm=False, **kwargs)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture
def engines() -> Iterator[list[LLM]]:
    """Parallel engines a test starts, stopped after it (GPU memory back)."""
    started: list[LLM] = []
    yield started
    for llm in started:
        llm.engine.core.shutdown()


def _split(path: Path, tp: int, pp: int, engines: list[LLM], **kwargs: Any) -> LLM:
    llm = LLM(model=str(path), device="cuda", tensor_parallel_size=tp,
              pipeline_parallel_size=pp, distributed_timeout_s=TIMEOUT_S,
              gpu_memory_utilization=MEMORY, **kwargs)
    engines.append(llm)
    return llm


@pytest.fixture(scope="module")
def one_gpu(tiny_checkpoint: Callable[[str], Path]) -> Callable[[str], list[list[int]]]:
    cache: dict[str, list[list[int]]] = {}

    def get(variant: str) -> list[list[int]]:
        if variant not in cache:
            llm = LLM(model=str(tiny_checkpoint(variant)), dtype="float32", device="cuda",
                      gpu_memory_utilization=MEMORY)
            cache[variant] = _tokens(llm)
        return cache[variant]

    return get


@pytest.mark.parametrize(("variant", "tp", "pp"), [
    ("llama", 2, 1), ("llama", 1, 2), ("llama_mqa", 2, 1), ("mistral", 1, 2),
    ("qwen2", 2, 1), ("qwen3", 2, 1), ("llama_tied", 1, 2),
    pytest.param("llama", 2, 2, marks=pytest.mark.skipif(
        torch.cuda.device_count() < 4, reason="needs 4 CUDA devices")),
])
def test_split_with_nccl_and_cuda_graphs_gives_one_gpus_tokens(
    variant: str, tp: int, pp: int, tiny_checkpoint: Callable[[str], Path],
    one_gpu: Callable[[str], list[list[int]]], engines: list[LLM],
) -> None:
    llm = _split(tiny_checkpoint(variant), tp, pp, engines, dtype="float32", **STRESS)
    assert _tokens(llm) == one_gpu(variant)
    stats = llm.stats()
    assert stats["num_graph_steps"] > 0 and stats["num_preemptions"] > 0, stats
    devices = [f["device"] for f in llm.engine.core.executor.figures]
    assert devices == [f"cuda:{i}" for i in range(tp * pp)]


def _needs(gpus: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(torch.cuda.device_count() < gpus,
                              reason=f"needs {gpus} CUDA devices")


@pytest.mark.parametrize(("tp", "pp"), [
    pytest.param(4, 1, marks=_needs(4)), pytest.param(2, 2, marks=_needs(4)),
    pytest.param(1, 4, marks=_needs(4)), pytest.param(8, 1, marks=_needs(8)),
    pytest.param(4, 2, marks=_needs(8)),
])
def test_more_than_two_gpus_give_one_gpus_tokens(
    tp: int, pp: int, tiny_checkpoint: Callable[[str], Path],
    one_gpu: Callable[[str], list[list[int]]], engines: list[LLM],
) -> None:
    """Issue 26's splits on a tiny model that divides 8 ways (8 query heads; 2 KV
    heads, each held by several ranks from TP=4 on; 4 layers, so 4 stages)."""
    llm = _split(tiny_checkpoint("llama_wide"), tp, pp, engines, dtype="float32", **STRESS)
    assert _tokens(llm) == one_gpu("llama_wide")
    stats = llm.stats()
    assert stats["num_graph_steps"] > 0 and stats["num_preemptions"] > 0, stats
    figures = llm.engine.core.executor.figures
    assert [f["device"] for f in figures] == [f"cuda:{i}" for i in range(tp * pp)]
    assert {f["num_kv_heads"] for f in figures} == {max(1, 2 // tp)}


@pytest.mark.parametrize("tp", [pytest.param(4, marks=_needs(4)),
                                pytest.param(8, marks=_needs(8))])
def test_more_than_two_gpus_one_shot_all_reduce_gives_one_gpus_tokens(
    tp: int, tiny_checkpoint: Callable[[str], Path],
    one_gpu: Callable[[str], list[list[int]]], engines: list[LLM],
) -> None:
    """The one-shot all-reduce over 4 and 8 peers, in float32: over more than
    two ranks its sum's order differs from NCCL's, so bf16 tokens may differ
    from NCCL's; float32's rounding leaves the tiny model's tokens alone."""
    llm = _split(tiny_checkpoint("llama_wide"), tp, 1, engines, dtype="float32",
                 all_reduce="one-shot")
    assert _tokens(llm) == one_gpu("llama_wide")
    assert llm.stats()["num_graph_steps"] > 0


def test_bf16_graphs_and_one_shot_all_reduce_match_eager_nccl(
    tiny_checkpoint: Callable[[str], Path], engines: list[LLM]
) -> None:
    path = tiny_checkpoint("llama")
    eager = _split(path, 2, 1, engines, dtype="bfloat16", enforce_eager=True)
    expected = _tokens(eager)
    graphs = _split(path, 2, 1, engines, dtype="bfloat16")
    assert _tokens(graphs) == expected
    one_shot = _split(path, 2, 1, engines, dtype="bfloat16", all_reduce="one-shot")
    assert _tokens(one_shot) == expected
    assert one_shot.stats()["num_graph_steps"] > 0


def test_lora_steps_match_one_gpu(tiny_checkpoint: Callable[[str], Path], tmp_path: Path,
                                  engines: list[LLM]) -> None:
    path = tiny_checkpoint("llama")
    adapter = LoRARequest("random", 1, str(make_lora_adapter(path, tmp_path / "adapter")))
    loras = [adapter if i % 2 else None for i in range(len(PROMPTS))]
    one = LLM(model=str(path), dtype="float32", device="cuda", enable_lora=True,
              gpu_memory_utilization=MEMORY)
    expected = _tokens(one, lora_request=loras)
    llm = _split(path, 2, 1, engines, dtype="float32", enable_lora=True)
    assert _tokens(llm, lora_request=loras) == expected


def test_too_large_for_the_sizes_names_what_would_fit() -> None:
    with pytest.raises(ValueError, match=r"per rank at tensor_parallel_size=2 .* would fit at"):
        LLM(model="llama-3-8b", load_format="dummy", dtype="bfloat16", device="cuda",
            tensor_parallel_size=2, gpu_memory_utilization=0.04, distributed_timeout_s=TIMEOUT_S)


def test_a_worker_killed_mid_run_fails_the_engine(
    tiny_checkpoint: Callable[[str], Path]
) -> None:
    llm = LLM(model=str(tiny_checkpoint("llama")), device="cuda", tensor_parallel_size=2,
              distributed_timeout_s=TIMEOUT_S, gpu_memory_utilization=MEMORY)
    executor = llm.engine.core.executor
    pids = [w.process.pid for w in executor.workers]
    engine = llm.engine
    for prompt in PROMPTS:
        engine.add_request(prompt, SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(5):
        engine.step()
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(WorkerFailedError, match="rank 1"):
        for _ in range(1000):
            engine.step()
    deadline = time.monotonic() + 15
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int | None) -> bool:
    """Whether ``pid`` is a live process (not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
