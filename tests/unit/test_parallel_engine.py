"""The whole engine split over worker processes on CPU, with gloo.

``LLM(tensor_parallel_size=..., pipeline_parallel_size=...)`` must give one
process's greedy tokens on tiny checkpoints of every architecture (odd and
replicated KV heads, a tied head, a sliding window, q/k/v bias, q/k norm),
under stress: prefill chunks of a few tokens, a KV pool small enough to
preempt, prompts sharing a prefix (cache hits), async scheduling on and off
(on is the default with workers), INT8 and INT4 weights (FP8 W8A8: near one
process), an fp8 or int8 KV cache, LoRA adapters, seeded
sampling. Also: the split is checked before any process starts, a worker's
ValueError at start-up is the engine's, a worker killed with SIGKILL
fails the engine (every later call too) and leaves no process behind, and
two "nodes" on this machine (``kvserve serve --node-rank 1`` beside the
engine) give the same tokens.
The first engine of a session waits ~10 s for the forkserver to import
torch; later ones start in about a second.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve import LLM, LoRARequest, SamplingParams
from kvserve.worker.multiproc_executor import WorkerFailedError
from tests.conftest import make_lora_adapter, process_alive

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SHARED = list(range(20, 45))  # a prefix of 25 tokens: 6 full blocks of 4
PROMPTS = [
    [5, 17, 99, 3, 250, 7, 42],
    [*SHARED, 300, 12, 8],
    [11, 12],
    [*SHARED, 9, 9],
    list(range(100, 133)),
]
# chunks of at most 12 tokens, and a pool of 24 blocks: five requests of up
# to 45 tokens (12 blocks) cannot all hold their blocks, so some are preempted
STRESS = {"block_size": 4, "max_num_batched_tokens": 12, "num_kv_blocks": 24}


def token_ids(llm: LLM, params: SamplingParams = GREEDY,
              prompts: list[list[int]] | None = None, **kwargs: Any) -> list[list[int]]:
    outputs = llm.generate(prompts or PROMPTS, params, use_tqdm=False, **kwargs)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Callable[[str], Path]) -> Callable[[str], list[list[int]]]:
    """variant -> one process's greedy tokens (roomy pool, no chunking)."""
    cache: dict[str, list[list[int]]] = {}

    def get(variant: str) -> list[list[int]]:
        if variant not in cache:
            llm = LLM(model=str(tiny_checkpoint(variant)), device="cpu", block_size=4,
                      enable_chunked_prefill=False, max_num_batched_tokens=512)
            cache[variant] = token_ids(llm)
        return cache[variant]

    return get


def parallel_llm(path: Path, tp: int, pp: int, **kwargs: Any) -> LLM:
    return LLM(model=str(path), device="cpu", tensor_parallel_size=tp,
               pipeline_parallel_size=pp, distributed_timeout_s=60, **kwargs)


@pytest.fixture
def started() -> Iterator[list[LLM]]:
    """Engines a test starts, shut down (their workers stopped) after it."""
    engines: list[LLM] = []
    yield engines
    for llm in engines:
        llm.engine.core.shutdown()


def check_split_engine(path: Path, tp: int, pp: int, expected: list[list[int]],
                       engines: list[LLM], **kwargs: Any) -> LLM:
    llm = parallel_llm(path, tp, pp, **{**STRESS, **kwargs})
    engines.append(llm)
    # each rank reports its share: its stage's layers, its KV heads
    figures = llm.engine.core.executor.figures
    config = llm.engine.config.model_config
    assert sum(f["num_layers"] for f in figures) == config.num_layers * tp
    assert {f["num_kv_heads"] for f in figures} == {max(1, config.num_kv_heads // tp)}
    assert token_ids(llm) == expected
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
    return llm


@pytest.mark.parametrize(("variant", "tp", "pp"), [
    ("llama", 2, 1),
    ("llama", 1, 2),
    ("llama", 2, 2),
    pytest.param("llama_mqa", 2, 1, marks=pytest.mark.slow),  # 1 KV head, replicated
    pytest.param("llama_tied", 1, 2, marks=pytest.mark.slow),  # the last stage copies the table
    pytest.param("mistral", 2, 2, marks=pytest.mark.slow),  # sliding window
    pytest.param("qwen2", 2, 1, marks=pytest.mark.slow),  # q/k/v bias
    pytest.param("qwen3", 2, 2, marks=pytest.mark.slow),  # q/k norm, 3 layers over 2 stages
    pytest.param("llama_mha", 4, 1, marks=pytest.mark.slow),  # 4 processes, 1 KV head each
    pytest.param("llama", 4, 1, marks=pytest.mark.slow),  # 2 KV heads over 4 ranks
    # more than two ranks a dimension (issue 26): stages between the first and the
    # last; 8 processes as the 70B's TP=4 x PP=2 and TP=8 (2 KV heads, each held by
    # 2 and 4 ranks); replicated KV heads in a pipeline
    pytest.param("llama_wide", 1, 4, marks=pytest.mark.slow),
    pytest.param("llama_wide", 4, 2, marks=pytest.mark.slow),
    pytest.param("llama_wide", 8, 1, marks=pytest.mark.slow),
    pytest.param("llama_mqa", 2, 2, marks=pytest.mark.slow),
])
def test_split_engine_gives_one_process_tokens(
    variant: str, tp: int, pp: int, tiny_checkpoint: Callable[[str], Path],
    reference: Callable[[str], list[list[int]]], started: list[LLM],
) -> None:
    check_split_engine(tiny_checkpoint(variant), tp, pp, reference(variant), started)


def test_synchronous_scheduling_and_seeded_sampling(
    tiny_checkpoint: Callable[[str], Path], reference: Callable[[str], list[list[int]]],
    started: list[LLM],
) -> None:
    path = tiny_checkpoint("llama")
    llm = check_split_engine(path, 2, 1, reference("llama"), started, async_scheduling=False)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
    one = LLM(model=str(path), device="cpu", block_size=4)
    assert token_ids(llm, sampled) == token_ids(one, sampled)


@pytest.mark.parametrize("quantization", ["int8", "int4-g32"])
def test_quantised_weights_split_like_one_process(
    quantization: str, tiny_checkpoint: Callable[[str], Path], started: list[LLM]
) -> None:
    path = tiny_checkpoint("llama")  # o_proj / down_proj inputs: 32 / 64 columns a rank
    one = LLM(model=str(path), device="cpu", block_size=4, quantization=quantization)
    check_split_engine(path, 2, 1, token_ids(one), started, quantization=quantization)


@pytest.mark.parametrize("quantization", ["fp8", pytest.param("w8a8-int8", marks=pytest.mark.slow)])
def test_w8a8_linears_split_near_one_process(
    quantization: str, tiny_checkpoint: Callable[[str], Path], started: list[LLM]
) -> None:
    """A row-parallel linear quantises each rank's slice of the activations
    with its own per-token scale (as vLLM does), so the split's logits are
    near one process's, not equal: each first token the split picks is
    within 0.2 nats of one process's best (this random model's top
    candidates lie ~0.05 apart; a wrongly sharded weight lands far off)."""
    path = tiny_checkpoint("llama")
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20, ignore_eos=True)
    one = LLM(model=str(path), device="cpu", block_size=4, quantization=quantization).generate(
        PROMPTS, params, use_tqdm=False)
    llm = parallel_llm(path, 2, 1, **STRESS, quantization=quantization)
    started.append(llm)
    for single, split in zip(one, llm.generate(PROMPTS, params, use_tqdm=False), strict=True):
        assert single.outputs[0].logprobs is not None
        logprobs = single.outputs[0].logprobs[0]
        chosen = split.outputs[0].token_ids[0]
        assert chosen in logprobs
        assert logprobs[chosen].logprob > max(v.logprob for v in logprobs.values()) - 0.2
    assert len(token_ids(llm)[0]) == GREEDY.max_tokens  # decoding under stress runs


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
def test_quantised_kv_cache_splits_like_one_process(
    kv_cache_dtype: str, tiny_checkpoint: Callable[[str], Path], tmp_path: Path,
    started: list[LLM],
) -> None:
    """Each rank quantises its own KV heads into its own pool; an fp8 cache
    takes its heads' share of the checkpoint's per-head scales."""
    path = tiny_checkpoint("llama")  # 2 KV heads: one a rank
    if kv_cache_dtype == "fp8_e4m3":
        target = tmp_path / "scaled"
        shutil.copytree(path, target)
        tensors = load_file(str(path / "model.safetensors"))
        for layer in range(2):
            # far apart, so a rank given the other head's scales would change the tokens
            tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor([1.0, 0.002])
            tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor([0.002, 1.0])
        save_file(tensors, str(target / "model.safetensors"))
        path = target
    one = LLM(model=str(path), device="cpu", block_size=4, kv_cache_dtype=kv_cache_dtype)
    check_split_engine(path, 2, 1, token_ids(one), started, kv_cache_dtype=kv_cache_dtype)


def test_lora_adapters_split_like_one_process(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path, started: list[LLM]
) -> None:
    path = tiny_checkpoint("llama")
    adapter = LoRARequest("random", 1, str(make_lora_adapter(path, tmp_path / "adapter")))
    loras = [adapter, None, adapter, None, None]
    one = LLM(model=str(path), device="cpu", block_size=4, enable_lora=True)
    expected = token_ids(one, lora_request=loras)
    assert expected != token_ids(one)  # the adapter changes the output
    llm = parallel_llm(path, 2, 2, block_size=4, enable_lora=True)
    started.append(llm)
    assert token_ids(llm, lora_request=loras) == expected
    bad = LoRARequest("missing", 2, str(tmp_path / "nothing-here"))
    with pytest.raises(ValueError, match="is not a directory"):
        llm.generate([[1, 2]], GREEDY, lora_request=bad, use_tqdm=False)


def test_sizes_are_checked_before_any_process_starts(
    tiny_checkpoint: Callable[[str], Path]
) -> None:
    path = tiny_checkpoint("llama")  # 4 heads, 2 layers
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not split"):
        parallel_llm(path, 3, 1)
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 is invalid"):
        parallel_llm(path, 1, 3)
    with pytest.raises(ValueError, match="nnodes=2 needs an explicit master_port"):
        parallel_llm(path, 2, 1, nnodes=2, node_rank=0)


def test_a_worker_value_error_at_start_up_is_the_engines(
    tiny_checkpoint: Callable[[str], Path]
) -> None:
    # attention backends are looked up where the model runs
    with pytest.raises(ValueError, match="attention_backend: unknown backend 'nope'"):
        parallel_llm(tiny_checkpoint("llama"), 2, 1, attention_backend="nope")



def test_a_killed_worker_fails_the_engine_and_leaves_no_process(
    tiny_checkpoint: Callable[[str], Path]
) -> None:
    llm = parallel_llm(tiny_checkpoint("llama"), 2, 1)
    executor = llm.engine.core.executor
    pids = [worker.process.pid for worker in executor.workers]
    assert token_ids(llm, prompts=PROMPTS[:1])
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(WorkerFailedError, match="rank 1"):
        token_ids(llm)
    with pytest.raises(WorkerFailedError):
        token_ids(llm, prompts=PROMPTS[:1])
    deadline = time.monotonic() + 10
    while any(process_alive(pid) for pid in pids if pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(process_alive(pid) for pid in pids if pid)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
def test_two_nodes_on_one_machine(
    tiny_checkpoint: Callable[[str], Path], reference: Callable[[str], list[list[int]]],
    tmp_path: Path, started: list[LLM],
) -> None:
    path, port = tiny_checkpoint("llama"), _free_port()
    nodes = {"nnodes": 2, "master_addr": "127.0.0.1", "master_port": port}
    flags = ["--model", str(path), "--device", "cpu", "--tensor-parallel-size", "2",
             "--distributed-timeout-s", "60", "--node-rank", "1"]
    for key, value in {**nodes, **STRESS}.items():
        flags += [f"--{key.replace('_', '-')}", str(value)]
    root = Path(__file__).resolve().parents[2]
    with open(tmp_path / "node1.log", "wb") as log:
        node1 = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", *flags],
                                 stdout=log, stderr=subprocess.STDOUT, cwd=root,
                                 env={**os.environ, "PYTHONPATH": str(root)},
                                 start_new_session=True)
    try:
        llm = parallel_llm(path, 2, 1, node_rank=0, **nodes, **STRESS)
        started.append(llm)
        assert [w.rank for w in llm.engine.core.executor.workers] == [0]  # rank 1 is node 1's
        assert token_ids(llm) == reference("llama")
        llm.engine.core.shutdown()
        assert node1.wait(timeout=30) == 0, (tmp_path / "node1.log").read_text()
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
            node1.wait(10)


def test_host_kv_tier_copies_are_reported_over_every_rank(
        tiny_checkpoint: Callable[[str], Path], started: list[LLM]) -> None:
    """TP=2 with the host KV tier: the ranks' bytes add up to one process's
    (each moves its half of every block), and copy times are reported."""
    from tests.unit.test_kv_offload import PROMPTS as TURNS
    from tests.unit.test_kv_offload import TINY_POOL, generate_each

    path = tiny_checkpoint("llama")
    options = {**TINY_POOL, "kv_offload_gb": 0.001, "async_scheduling": False}
    one = LLM(model=str(path), device="cpu", **options)
    expected = generate_each(one, TURNS)
    llm = parallel_llm(path, 2, 1, **options)
    started.append(llm)
    assert generate_each(llm, TURNS) == expected
    stats, reference = llm.stats(), one.stats()
    keys = ("kv_host_block_bytes", "kv_host_bytes_to_host", "kv_host_bytes_to_device")
    assert reference["kv_host_bytes_to_device"] > 0
    assert {key: stats[key] for key in keys} == {key: reference[key] for key in keys}
    assert stats["kv_host_copy_to_host_s"] > 0 and stats["kv_host_copy_to_device_s"] > 0
