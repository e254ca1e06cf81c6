"""The runner's persistent step inputs: ``PersistentBatch`` rows updated by diffs,
``StepBuffers.fill`` against a plain per-token construction (including the
padding rows a CUDA graph replays), and the decode-graph path of the runner
(padded batch, ``max_seq_len = max_model_len``, logits of every row) giving
the same greedy tokens as eager steps, run on CPU without the capture."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import SchedulerConfig
from kvserve.engine.args import EngineArgs, default_cuda_graph_sizes
from kvserve.worker.cuda_graph import CudaGraphs
from kvserve.worker.input_batch import PersistentBatch, StepBuffers
from kvserve.worker.model_runner import largest_step_query_lens


def test_batch_rows_are_reused_and_bounded() -> None:
    batch = PersistentBatch(max_num_reqs=2, max_model_len=6, max_blocks_per_req=3, vocab_size=50)
    a = batch.add([1, 2, 3], 2, 0, [5, 6], SamplingParams(temperature=0.0, min_tokens=4))
    b = batch.add([4], 1, 0, [7], SamplingParams(top_k=3, presence_penalty=0.5))
    assert a != b
    batch.append_blocks(b, [8, 9])
    assert batch.block_table[b].tolist() == [7, 8, 9] and batch.num_blocks[b] == 3
    with pytest.raises(RuntimeError, match="at most 3"):
        batch.append_blocks(a, [1, 2])
    with pytest.raises(RuntimeError, match="rows are in use"):
        batch.add([1], 1, 0, [1], SamplingParams())
    batch.append_tokens(np.array([b, a]), np.array([40, 30]))
    assert batch.prompt_token_ids(a) == [1, 2] and batch.output_token_ids(a) == [3, 30]
    assert batch.output_token_ids(b) == [40]
    # a: below min_tokens; b: a penalty
    assert batch.needs_known_outputs(np.array([a, b])).tolist() == [True, True]
    assert bool(batch.sampling.greedy[a]) and batch.sampling.top_k[b] == 3
    generation = batch.generation[a]
    batch.free(a)
    assert batch.generation[a] == generation + 1
    with pytest.raises(RuntimeError, match="max_model_len=6"):
        batch.add(list(range(7)), 7, 0, [4], SamplingParams())
    assert batch.add([9], 1, 0, [4], SamplingParams()) == a
    assert batch.block_table[a, 0] == 4 and batch.num_blocks[a] == 1
    assert batch.needs_known_outputs(np.array([a])).tolist() == [False]


@pytest.mark.parametrize("seed", range(6))
def test_fill_matches_per_token_construction(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])
    max_blocks, max_reqs = 12, 8
    batch = PersistentBatch(max_reqs, block_size * max_blocks, max_blocks, vocab_size=10_000)
    buffers = StepBuffers(256, max_reqs, max_blocks, torch.device("cpu"))
    # rows in use before the step, so the step's requests are not rows 0, 1, ...
    for _ in range(rng.randint(0, 2)):
        batch.add([1], 1, 0, [1], SamplingParams())
    num_reqs = rng.randint(1, 6)
    decode = seed % 2 == 0
    chunks, computed, scheduled, totals, rows, blocks = [], [], [], [], [], []
    for _ in range(num_reqs):
        total = rng.randint(1, block_size * max_blocks)
        done = total - 1 if decode else rng.randint(0, total - 1)
        n = 1 if decode else rng.randint(1, total - done)
        ids = rng.sample(range(1, 1000), -(-(done + n) // block_size))
        tokens = [rng.randrange(10_000) for _ in range(total)]
        row = batch.add(tokens, 1, done, ids[:1], SamplingParams())
        batch.append_blocks(row, ids[1:])
        chunks.append(tokens[done:done + n])
        computed.append(done)
        scheduled.append(n)
        totals.append(total)
        rows.append(row)
        blocks.append(ids)
    # decode graphs pad one token per padding request; token graphs pad both freely
    padded = num_reqs + rng.randint(0, 2)
    token_pad = padded - num_reqs if decode else rng.randint(0, 5)
    host = buffers.fill(batch, np.array(rows), np.array(scheduled), block_size, padded,
                        sum(scheduled) + token_pad)

    exp_ids, exp_pos, exp_slots, exp_logits, exp_sample = [], [], [], [], []
    for i in range(num_reqs):
        for j, pos in enumerate(range(computed[i], computed[i] + scheduled[i])):
            exp_ids.append(chunks[i][j])
            exp_pos.append(pos)
            exp_slots.append(blocks[i][pos // block_size] * block_size + pos % block_size)
        if computed[i] + scheduled[i] == totals[i]:
            exp_sample.append(i)
            exp_logits.append(len(exp_ids) - 1)
    n_tok = len(exp_ids)
    pad = padded - num_reqs
    assert host.num_tokens == n_tok
    assert buffers.input_ids[: n_tok + token_pad].tolist() == exp_ids + [0] * token_pad
    assert buffers.positions[: n_tok + token_pad].tolist() == exp_pos + [0] * token_pad
    assert buffers.slot_mapping[: n_tok + token_pad].tolist() == exp_slots + [-1] * token_pad
    qsl = [0, *np.cumsum(scheduled).tolist()]
    assert buffers.query_start_loc[: padded + 1].tolist() == qsl + [n_tok] * pad
    ends = [c + s for c, s in zip(computed, scheduled)]
    assert buffers.seq_lens[:padded].tolist() == ends + [0] * pad
    assert host.sample_indices.tolist() == exp_sample
    assert host.logits_indices.tolist() == exp_logits
    assert host.max_seq_len == max(ends) and host.max_query_len == max(scheduled)
    width = max(len(b) for b in blocks)
    assert host.max_blocks == width
    for i, ids in enumerate(blocks):
        assert buffers.block_table[i, : len(ids)].tolist() == ids
        assert width <= max_blocks


def test_default_cuda_graph_sizes_cover_every_batch() -> None:
    assert default_cuda_graph_sizes(1) == (1,)
    assert default_cuda_graph_sizes(20) == (1, 2, 4, 8, 16, 20)
    sizes = default_cuda_graph_sizes(256)
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-1] == 256
    assert all(b - a <= 8 for a, b in itertools.pairwise(sizes))
    assert default_cuda_graph_sizes(4096)[-1] == 512


def test_cuda_graph_sizes_flag_is_validated(tiny_checkpoint: Callable[[str], Path]) -> None:
    path = str(tiny_checkpoint("llama"))
    args = EngineArgs(model=path, attention_backend="triton", device="cuda", max_num_seqs=8,
                      cuda_graph_sizes=[1, 9])
    with pytest.raises(ValueError, match=r"cuda_graph_sizes=\[1, 9\].*max_num_seqs=8"):
        args.create_engine_config()
    args.cuda_graph_sizes = [4, 1, 4]
    assert args.create_engine_config().cuda_graph_sizes == (1, 4)
    args.enforce_eager = True
    assert args.create_engine_config().cuda_graph_sizes == ()
    eager = EngineArgs(model=path, attention_backend="torch", device="cuda")
    assert eager.create_engine_config().cuda_graph_sizes == ()


class _UncapturedGraphs(CudaGraphs):
    """The graph paths without the capture: each replay runs the same forward."""

    def replay_decode(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.replays.append(("decode", size))
        return self._decode_forward(size)

    def replay_tokens(self, size: int) -> torch.Tensor:
        self.replays.append(("tokens", size))
        return self._token_forward(size)

    replays: list[tuple[str, int]]


def test_padded_graph_paths_give_eager_tokens(tiny_checkpoint: Callable[[str], Path]) -> None:
    if torch.cuda.is_available():  # its Triton kernels run on CPU tensors, interpreted
        pytest.skip("CUDA present: tests/gpu/test_cuda_graphs_gpu.py replays captured graphs")
    pytest.importorskip("triton")
    path = str(tiny_checkpoint("llama"))
    prompts = [[5, 17, 99, 3], [300, 12, 8, 8, 8, 19, 77], [11, 12], list(range(20, 45)),
               [7] * 9]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kwargs = dict(model=path, block_size=4, attention_backend="triton", device="cpu",
                  max_num_seqs=8, max_num_batched_tokens=32)
    eager = [o.outputs[0].token_ids for o in LLM(**kwargs).generate(prompts, params,
                                                                    use_tqdm=False)]
    llm = LLM(**kwargs)
    runner = llm.engine.core.executor  # type: ignore[attr-defined]  # in-process runner
    graphs = _UncapturedGraphs(runner.model, runner.buffers, (2, 8), (16, 32),
                               llm.engine.config.scheduler_config.max_model_len,
                               runner.sampler.argmax)
    graphs.replays = []
    runner.graphs = graphs
    padded = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert padded == eager
    assert ("decode", 8) in graphs.replays  # five decoding requests padded to 8
    # 47 prompt tokens under a 32-token budget: 32, then 3 decodes + 15 prompt tokens -> 32
    assert graphs.replays[:2] == [("tokens", 32), ("tokens", 32)]
    stats = llm.stats()
    assert stats["num_graph_steps"] == len(graphs.replays)
    assert stats["num_padding_tokens"] >= 32 - 18


@pytest.mark.parametrize(
    ("seqs", "budget", "max_len"), [(256, 8192, 8192), (32, 8192, 128), (4, 100, 7), (1, 16, 4096)]
)
def test_profiled_step_is_the_largest_the_scheduler_can_form(
    seqs: int, budget: int, max_len: int
) -> None:
    sched = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget,
                            max_model_len=max_len)
    lens = largest_step_query_lens(sched)
    assert sum(lens) == min(budget, seqs * max_len)
    assert len(lens) <= seqs and max(lens) <= max_len and min(lens) >= 1
    assert max(lens) - min(lens) <= 1
