"""The compiled Triton attention kernels on a CUDA device (skipped without
one), against the torch reference: bfloat16 and float16, head_dim 64 and
128, block sizes 16 and 32, ragged batches up to 64 requests with contexts
up to 8k crossing block boundaries, GQA / MQA / MHA and a group of 7,
sliding windows, split-K decode (also launched many times in a row and
replayed in a CUDA graph over new batches, which its split semaphores must
survive); the fused rope + KV write bit-equal to ``apply_rotary`` then
``store_kv`` (bfloat16, float16, float32; head_dim 64, 128 and 80, partial
rotary, groups of 1, 4, 7 and 8; decode and mixed steps with padding rows
and out-of-range positions) and replayed in a CUDA graph; then whole-engine
greedy tokens equal between ``attention_backend="triton"`` and ``"torch"``
(which fuses rope there: the runner turns the Triton ops on with it).

Outputs are poisoned with NaN, and so is every cache slot no request owns;
inputs are fresh random numbers each run. Kernel modules are imported
inside the tests, so collecting this file on a CPU machine never decorates
them before the CPU interpreter tests switch the interpreter on.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention.torch_ref import paged_attention_ref, write_kv
from kvserve.layers.rotary import RotaryEmbedding
from tests.attention_cases import Case
from tests.attention_cases import make_case as make_shared_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MAX_ERROR = 1e-2
DTYPES = [torch.bfloat16, torch.float16]


# shuffled block tables, fresh random values every time
make_case = functools.partial(make_shared_case, device="cuda", seed=None)


def check(case: Case, sliding_window: int | None = None, num_splits: int | None = None,
          decode: bool = False) -> None:
    """Run store_kv + the chosen kernel and compare with the torch reference."""
    from kvserve.kernels.paged_attention import decode_attention, prefill_attention
    from kvserve.kernels.store_kv import store_kv

    md = case.metadata
    scale = case.q.shape[-1] ** -0.5
    expected_cache = case.kv_cache.clone()
    write_kv(case.k, case.v, expected_cache, md.slot_mapping)
    cache = case.kv_cache.clone()
    store_kv(case.k, case.v, cache, md.slot_mapping)
    torch.testing.assert_close(cache, expected_cache, rtol=0, atol=0, equal_nan=True)
    out = torch.full_like(case.q, float("nan"))
    if decode:
        decode_attention(case.q, cache, md.query_start_loc, md.seq_lens, md.block_table,
                         md.max_seq_len, scale, sliding_window, out=out, num_splits=num_splits)
    else:
        prefill_attention(case.q, cache, md.query_start_loc, md.seq_lens, md.block_table,
                          md.max_query_len, scale, sliding_window, out=out)
    ref = paged_attention_ref(case.q, expected_cache, md, scale, sliding_window).float()
    assert not out.isnan().any(), f"{int(out.isnan().sum())} output elements NaN or unwritten"
    error = ((out.float() - ref).norm() / ref.norm()).item()
    assert error < MAX_ERROR, f"relative error {error:.2e}"


def ragged_seq_lens(rng: random.Random, count: int, block_size: int, longest: int) -> list[int]:
    """Context lengths on, just before and just after block boundaries, and random ones."""
    edges = [1, block_size - 1, block_size, block_size + 1, longest]
    lens = edges + [rng.randint(1, longest) for _ in range(count - len(edges))]
    return lens[:count]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_reference(dtype: torch.dtype, head_dim: int, block_size: int) -> None:
    rng = random.Random(head_dim * block_size)
    for batch, longest, splits in ((64, 8192, None), (1, 8192, None), (7, 3000, 5), (13, 900, 1)):
        seq_lens = ragged_seq_lens(rng, batch, block_size, longest)
        case = make_case([1] * batch, seq_lens, 32, 8, head_dim, block_size, dtype)
        check(case, num_splits=splits, decode=True)
    case = make_case([1] * 9, ragged_seq_lens(rng, 9, block_size, 6000), 32, 8, head_dim,
                     block_size, dtype)
    check(case, sliding_window=1000, decode=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_matches_reference(dtype: torch.dtype, head_dim: int, block_size: int) -> None:
    # fresh prefills, chunks over cached prefixes (ending mid-block and on a
    # boundary), decodes and a one-token prompt in one batch
    query_lens = [1000, 1, 300, 17, 1, 1, block_size, 129, 2048]
    seq_lens = [1000, 4000, 3300, 17, 8192, 1, 4 * block_size, 129 + 5 * block_size, 2048]
    case = make_case(query_lens, seq_lens, 32, 8, head_dim, block_size, dtype)
    check(case)
    check(case, sliding_window=777)
    # 64 requests with 3 new tokens each (speculative-decode shaped), contexts 40..6151
    check(make_case([3] * 64, list(range(40, 40 + 64 * 97, 97)), 32, 8, head_dim, block_size,
                    dtype))


@pytest.mark.parametrize("heads", [(8, 1), (8, 8), (14, 2)], ids=["mqa", "mha", "group7"])
def test_head_layouts(heads: tuple[int, int]) -> None:
    rng = random.Random(0)
    decode_lens = ragged_seq_lens(rng, 16, 16, 5000)
    check(make_case([1] * 16, decode_lens, *heads, 64, 16, torch.bfloat16), decode=True)
    check(make_case([1] * 16, decode_lens, *heads, 64, 16, torch.bfloat16), sliding_window=300,
          decode=True)
    case = make_case([700, 1, 45, 5], [700, 2000, 1045, 5], *heads, 64, 16, torch.bfloat16)
    check(case)
    check(case, sliding_window=100)


class StaticDecode:
    """Decode inputs and output at fixed addresses, as a CUDA graph reads them,
    refilled with a fresh random batch before each launch or replay."""

    MAX_CONTEXT, BLOCK_SIZE, HEAD_DIM = 4096, 16, 128

    def __init__(self, num_reqs: int, num_heads: int, num_kv_heads: int) -> None:
        max_blocks = -(-self.MAX_CONTEXT // self.BLOCK_SIZE)
        self.heads = (num_heads, num_kv_heads)
        self.q = torch.zeros(num_reqs, num_heads, self.HEAD_DIM, dtype=torch.bfloat16,
                             device="cuda")
        self.out = torch.zeros_like(self.q)
        self.kv_cache = torch.zeros(2, num_reqs * max_blocks + 3, self.BLOCK_SIZE,
                                    num_kv_heads, self.HEAD_DIM, dtype=torch.bfloat16,
                                    device="cuda")
        self.query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32, device="cuda")
        self.seq_lens = torch.zeros(num_reqs, dtype=torch.int32, device="cuda")
        self.block_table = torch.zeros(num_reqs, max_blocks, dtype=torch.int32, device="cuda")

    def refill(self, rng: random.Random, sliding_window: int | None) -> torch.Tensor:
        """Write a new batch (from 4 rows on, one request without a new token
        and a padding row last); poison the output; return the reference
        output of its tokens."""
        num_reqs = self.seq_lens.shape[0]
        num_real = num_reqs - 1 if num_reqs >= 4 else num_reqs
        query_lens = [0 if i == 1 and num_reqs >= 4 else 1 for i in range(num_real)]
        seq_lens = [rng.randint(1, self.MAX_CONTEXT) for _ in range(num_real)]
        case = make_case(query_lens, seq_lens, *self.heads, self.HEAD_DIM, self.BLOCK_SIZE,
                         torch.bfloat16)
        md = case.metadata
        write_kv(case.k, case.v, case.kv_cache, md.slot_mapping)
        num_tokens, num_blocks = md.num_tokens, case.kv_cache.shape[1]
        self.q.fill_(float("nan"))
        self.q[:num_tokens] = case.q
        self.kv_cache.fill_(float("nan"))
        self.kv_cache[:, :num_blocks] = case.kv_cache
        self.query_start_loc.fill_(num_tokens)
        self.query_start_loc[: num_real + 1] = md.query_start_loc
        self.seq_lens.zero_()
        self.seq_lens[:num_real] = md.seq_lens
        self.block_table.zero_()
        self.block_table[:num_real, : md.block_table.shape[1]] = md.block_table
        self.out.fill_(float("nan"))
        scale = self.HEAD_DIM ** -0.5
        return paged_attention_ref(case.q, case.kv_cache, md, scale, sliding_window).float()

    def decode(self, sliding_window: int | None, out: torch.Tensor | None) -> torch.Tensor:
        from kvserve.kernels.paged_attention import decode_attention

        return decode_attention(self.q, self.kv_cache, self.query_start_loc, self.seq_lens,
                                self.block_table, self.MAX_CONTEXT, self.HEAD_DIM ** -0.5,
                                sliding_window, out=out)


def check_tokens(out: torch.Tensor, ref: torch.Tensor) -> None:
    """The first ``len(ref)`` rows of ``out`` (the real tokens) match ``ref``."""
    out = out[: ref.shape[0]].float()
    assert not out.isnan().any(), f"{int(out.isnan().sum())} output elements NaN or unwritten"
    error = ((out - ref).norm() / ref.norm()).item()
    assert error < MAX_ERROR, f"relative error {error:.2e}"


SEMAPHORE_CASES = [(1, 32, 8, None), (5, 32, 8, None), (16, 32, 8, None), (1, 64, 8, None),
                   (5, 8, 8, None), (5, 32, 8, 700), (1, 32, 8, 700)]


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize(
    "num_reqs,num_heads,num_kv_heads,sliding_window", SEMAPHORE_CASES,
    ids=[f"reqs{r}-group{h // k}-window{w}" for r, h, k, w in SEMAPHORE_CASES],
)
def test_decode_semaphores_over_repeated_launches_and_graph_replays(
    num_reqs: int, num_heads: int, num_kv_heads: int, sliding_window: int | None
) -> None:
    """The last split of each (request, KV head) merges in the same launch and
    resets its semaphore: 64, 8 and 4 splits (batch 1, 5, 16 at 8 KV heads),
    launched many times in a row and replayed in a CUDA graph over new
    batches; every output poisoned, every result equal to the eager one."""
    from kvserve.kernels.paged_attention import decode_semaphores

    rng = random.Random(num_reqs * num_heads)
    static = StaticDecode(num_reqs, num_heads, num_kv_heads)
    ref = static.refill(rng, sliding_window)
    # back-to-back launches on the same batch, each into a fresh poisoned output
    outputs = [static.decode(sliding_window, None) for _ in range(30)]
    check_tokens(outputs[0], ref)
    for out in outputs[1:]:
        assert torch.equal(out[: ref.shape[0]], outputs[0][: ref.shape[0]])
    for _ in range(5):
        ref = static.refill(rng, sliding_window)
        check_tokens(static.decode(sliding_window, None), ref)

    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static.decode(sliding_window, static.out)
    for _ in range(8):
        ref = static.refill(rng, sliding_window)
        graph.replay()
        check_tokens(static.out, ref)
        eager = static.decode(sliding_window, None)
        assert torch.equal(static.out[: ref.shape[0]], eager[: ref.shape[0]])
    torch.cuda.synchronize()
    assert not decode_semaphores(static.q.device, 1).any(), "split counters left nonzero"


ROPE_MAX_POSITION = 8192
# (query_lens, seq_lens): batch-1 decode, 64 ragged decodes, a mixed prefill step
ROPE_STEPS = [([1], [8000]), ([1] * 64, list(range(1, 8192, 128))),
              ([1000, 1, 300, 17, 1, 129], [1000, 4000, 3300, 17, 8191, 129 + 5 * 16])]
ROPE_LAYOUTS = [(32, 8, 128, 1.0), (32, 8, 128, 0.5), (32, 8, 64, 1.0), (8, 1, 128, 1.0),
                (14, 2, 80, 1.0), (14, 2, 80, 0.5), (8, 8, 64, 0.5)]


def rope_step(query_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int,
              head_dim: int, dtype: torch.dtype) -> tuple[Case, torch.Tensor, torch.Tensor,
                                                          torch.Tensor, int]:
    """A step with its last real token (if not its only one) at an out-of-range
    position and 5 CUDA-graph padding rows (slot -1) at positions in and out of
    range; q, k, v packed in one qkv whose last columns are NaN (from the
    poisoned ``torch.empty``).

    Returns the case (its cache), positions, slots, the packed qkv and q's width.
    """
    case = make_case(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, 16, dtype)
    positions = torch.cat([torch.arange(s - q, s, device="cuda")
                           for q, s in zip(query_lens, seq_lens, strict=True)])
    if len(positions) > 1:
        positions[-1] = ROPE_MAX_POSITION
    pad = torch.tensor([0, 17, ROPE_MAX_POSITION - 1, -1, 10**9], device="cuda")
    positions = torch.cat([positions, pad])
    slots = torch.cat([case.metadata.slot_mapping, torch.full_like(pad, -1)])
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.empty(len(positions), q_size + 2 * kv_size + 8, dtype=dtype, device="cuda")
    qkv[:, : q_size + 2 * kv_size] = torch.randn(len(positions), q_size + 2 * kv_size,
                                                 device="cuda").to(dtype)
    assert qkv[:, q_size + 2 * kv_size :].isnan().all()
    return case, positions, slots, qkv, q_size


def split_qkv(qkv: torch.Tensor, q_size: int, head_dim: int) -> list[torch.Tensor]:
    kv_size = (qkv.shape[1] - 8 - q_size) // 2
    return [t.unflatten(1, (-1, head_dim)) for t in qkv[:, : q_size + 2 * kv_size]
            .split([q_size, kv_size, kv_size], dim=-1)]


def same_bits(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Equal bit for bit, NaNs (the poison) included."""
    as_int = {2: torch.int16, 4: torch.int32}[out.element_size()]
    return out.shape == ref.shape and torch.equal(out.view(as_int), ref.view(as_int))


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,partial", ROPE_LAYOUTS,
    ids=[f"{h}q{k}kv-d{d}-rot{p}" for h, k, d, p in ROPE_LAYOUTS],
)
def test_rope_store_kv_equals_rotary_then_store_kv(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, partial: float
) -> None:
    """The fused launch leaves q and the cache bit-equal to ``apply_rotary`` then
    ``store_kv`` (same float32 expression, one rounding), k, v and the NaN columns
    untouched; and close to the torch oracle (float32 rope, one rounding, then
    ``write_kv``): relative error under 1e-2 and, in 16 bits, 99 % of q bit-equal
    (the kernel may fuse a multiply-add where torch rounds the product)."""
    from kvserve.kernels.rope_store_kv import rope_store_kv
    from kvserve.kernels.rotary import apply_rotary
    from kvserve.kernels.store_kv import store_kv

    rope = RotaryEmbedding(head_dim, ROPE_MAX_POSITION, {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        "partial_rotary_factor": partial}).cuda()
    for query_lens, seq_lens in ROPE_STEPS:
        case, positions, slots, qkv, q_size = rope_step(query_lens, seq_lens, num_heads,
                                                        num_kv_heads, head_dim, dtype)
        pair_qkv, pair_cache = qkv.clone(), case.kv_cache.clone()
        pair_q, pair_k, pair_v = split_qkv(pair_qkv, q_size, head_dim)
        apply_rotary(positions, pair_q, pair_k, rope.cos_sin_cache, head_dim, rope.rotary_dim)
        store_kv(pair_k, pair_v, pair_cache, slots)
        qkv_before = qkv.clone()
        q, k, v = split_qkv(qkv, q_size, head_dim)
        rope_store_kv(q, k, v, case.kv_cache, slots, positions, rope.cos_sin_cache,
                      rope.rotary_dim)
        assert same_bits(q, pair_q), f"q differs in {int((q != pair_q).sum())} elements"
        assert same_bits(case.kv_cache, pair_cache), "the cache differs"
        assert same_bits(qkv[:, q_size:], qkv_before[:, q_size:]), "k, v or padding written"
        # the torch oracle on the real tokens at in-range positions
        real = (slots >= 0) & (positions < ROPE_MAX_POSITION)
        ref_q, ref_k = (t.to(dtype) for t in rope(positions[real], split_qkv(
            qkv_before, q_size, head_dim)[0][real].float(), k[real].float()))
        ref_cache = torch.zeros_like(case.kv_cache)
        write_kv(ref_k, v[real], ref_cache, slots[real])
        written = case.kv_cache.flatten(1, 2)[:, slots[real]]
        for out, ref in ((q[real], ref_q), (written, ref_cache.flatten(1, 2)[:, slots[real]])):
            assert not out.isnan().any(), "NaN in a rotated q or a written slot"
            error = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            assert error < MAX_ERROR, f"relative error {error:.2e}"
        if dtype != torch.float32:
            assert (q[real] == ref_q).float().mean().item() >= 0.99


@pytest.mark.usefixtures("poisoned_empty")
def test_rope_store_kv_replays_in_a_cuda_graph() -> None:
    """Captured once at a batch of 8 decode rows, replayed over new positions,
    slots and qkv: q and the cache equal to an eager launch on the same inputs."""
    from kvserve.kernels.rope_store_kv import rope_store_kv

    dtype, head_dim = torch.bfloat16, 128
    rope = RotaryEmbedding(head_dim, ROPE_MAX_POSITION, {"rope_theta": 500000.0}).cuda()
    case, positions, slots, qkv, q_size = rope_step([1] * 8, [9, 100, 1000, 4096, 8000, 1, 2,
                                                              17], 32, 8, head_dim, dtype)
    q, k, v = split_qkv(qkv, q_size, head_dim)
    cache = case.kv_cache

    def launch() -> None:
        rope_store_kv(q, k, v, cache, slots, positions, rope.cos_sin_cache, rope.rotary_dim)

    launch()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for seed in range(4):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        qkv_input = torch.randn(qkv.shape, generator=generator, device="cuda").to(dtype)
        positions.random_(-2, ROPE_MAX_POSITION + 2, generator=generator)
        slots.copy_(torch.randperm(cache.shape[1] * cache.shape[2], generator=generator,
                                   device="cuda")[: slots.shape[0]])
        slots[::3] = -1
        cache_before = cache.clone()
        qkv.copy_(qkv_input)
        graph.replay()
        graph_qkv, graph_cache = qkv.clone(), cache.clone()
        qkv.copy_(qkv_input)
        cache.copy_(cache_before)
        launch()
        assert same_bits(graph_qkv, qkv) and same_bits(graph_cache, cache)


PROMPTS = [[5, 17, 99, 3, 250, 7, 42], list(range(20, 57)), [11, 12], list(range(100, 190))]


@pytest.mark.parametrize("variant", ["llama", "mistral", "qwen3"])
def test_engine_greedy_tokens_match_torch_backend(
    variant: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    # batch 1 (prefill then decode steps) and a batch with chunked prefill
    # (a 16-token budget mixes prefill chunks with decodes)
    path = str(tiny_checkpoint(variant))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for block_size, budget, prompts in ((16, None, PROMPTS[1:2]), (4, 16, PROMPTS)):
        tokens = {}
        for backend in ("torch", "triton"):
            llm = LLM(model=path, dtype="float32", device="cuda", block_size=block_size,
                      attention_backend=backend, max_num_batched_tokens=budget)
            tokens[backend] = [o.outputs[0].token_ids
                               for o in llm.generate(prompts, params, use_tqdm=False)]
        assert tokens["triton"] == tokens["torch"], (variant, block_size)


def test_auto_backend_is_triton_on_cuda() -> None:
    from kvserve.engine.args import resolve_attention_backend

    assert resolve_attention_backend("auto", "cuda") == "triton"
    assert resolve_attention_backend("auto", "cpu") == "torch"
