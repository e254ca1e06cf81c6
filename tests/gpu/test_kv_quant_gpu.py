"""The quantised KV cache (fp8_e4m3, int8) on a CUDA device (skipped without
one): the compiled kernels against the torch reference, then the whole
engine.

- Writes (``store_kv``, ``rope_store_kv``, the decode kernel's fused write)
  bit-equal to the reference's quantisation, scales included, over bfloat16
  and float16, head_dim 64 and 128, block sizes 16 and 32.
- Prefill and split-K decode over ragged batches of up to 64 requests with
  contexts up to 8k, GQA / MQA / MHA, sliding windows: within the 16-bit
  tests' bound of the reference reading the same quantised cache, and within
  a stated distance of attention over the cache before quantising.
- The engine (tiny random llama): greedy tokens identical with CUDA graphs on
  and off, batch 1 equal to batch 64, speculative decoding on and off, the
  Triton backend equal to the torch one; and close to the bfloat16 cache.

Inputs are fresh random numbers each run; unowned cache slots are poisoned
(``tests/attention_cases.quantise_case``). Kernel modules are imported inside
the tests (see ``test_triton_attention_gpu.py``).
"""

from __future__ import annotations

import functools
import gc
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention.torch_ref import paged_attention_ref, write_kv
from kvserve.layers.rotary import RotaryEmbedding
from tests import near_ties
from tests.attention_cases import Case, quantise_case
from tests.attention_cases import make_case as make_shared_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CACHE_DTYPES = [torch.float8_e4m3fn, torch.int8]
CACHE_IDS = ["fp8", "int8"]
KV_CACHE_DTYPES = ["fp8_e4m3", "int8"]
MAX_ERROR = 1e-2  # kernel vs the reference on the same cache (the 16-bit tests' bound)
# vs attention over the 16-bit cache, random normal K/V: e4m3 keeps 3 mantissa
# bits, int8 a 127th of each vector's largest element
QUANTISATION_ERROR = {torch.float8_e4m3fn: 0.06, torch.int8: 0.02}
# the engine's first-token logprobs against the 16-bit cache's (tests/near_ties.py):
# about twice what an H100 measured against float32 on the tiny llama
FIRST_TOKEN_ERROR = {"fp8_e4m3": 0.25, "int8": 0.1}

make_case = functools.partial(make_shared_case, device="cuda", seed=None)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(as_int), b.view(as_int))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), f"{int(out.isnan().sum())} output elements unwritten or NaN"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def ragged(num_reqs: int, max_context: int, decode: bool, seed: int) -> tuple[list[int],
                                                                              list[int]]:
    rng = random.Random(seed)
    seq_lens = [rng.randint(1, max_context) for _ in range(num_reqs)]
    query_lens = [1 if decode else rng.randint(1, min(s, 300)) for s in seq_lens]
    return query_lens, seq_lens


def float_reference(case: Case, scale: float, window: int | None) -> torch.Tensor:
    cache = case.kv_cache.clone()
    write_kv(case.k, case.v, cache, case.metadata.slot_mapping)
    return paged_attention_ref(case.q, cache, case.metadata, scale, window)


# ---------------------------------------------------------------- writes


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 16), (128, 32)])
def test_writes_quantise_like_the_reference(cache_dtype: torch.dtype, dtype: torch.dtype,
                                            head_dim: int, block_size: int) -> None:
    from kvserve.kernels.rope_store_kv import rope_store_kv
    from kvserve.kernels.rotary import apply_rotary
    from kvserve.kernels.store_kv import store_kv

    query_lens, seq_lens = ragged(24, 600, False, seed=head_dim + block_size)
    case = make_case(query_lens, seq_lens, 8, 2, head_dim, block_size, dtype)
    md = case.metadata
    slots = md.slot_mapping.clone()
    slots[::7] = -1  # padding rows write nothing
    expected, expected_scales = quantise_case(case, cache_dtype)
    cache, scales = expected.clone(), expected_scales.clone()
    write_kv(case.k, case.v, expected, slots, expected_scales)
    store_kv(case.k, case.v, cache, slots, scales)
    assert same_bits(cache, expected) and same_bits(scales, expected_scales)
    # the fused rope + write equals rotating then writing
    rope = RotaryEmbedding(head_dim, 1024, {"rope_theta": 10000.0})
    positions = torch.cat([torch.arange(s - q, s, device="cuda")
                           for q, s in zip(query_lens, seq_lens, strict=True)])
    fused, fused_scales = quantise_case(case, cache_dtype)
    pair, pair_scales = fused.clone(), fused_scales.clone()
    q, k = case.q.clone(), case.k.clone()
    apply_rotary(positions, q, k, rope.cos_sin_cache.cuda(), head_dim, head_dim)
    store_kv(k, case.v, pair, slots, pair_scales)
    fused_q = case.q.clone()
    rope_store_kv(fused_q, case.k, case.v, fused, slots, positions, rope.cos_sin_cache.cuda(),
                  head_dim, fused_scales)
    assert same_bits(fused_q, q)
    assert same_bits(fused, pair) and same_bits(fused_scales, pair_scales)


# ---------------------------------------------------------------- attention


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads,head_dim,block_size,window", [
    ((32, 8), 128, 16, None), ((32, 8), 128, 32, 1000), ((8, 1), 64, 16, None),
    ((16, 16), 64, 16, None), ((28, 4), 128, 16, None),
], ids=["gqa", "gqa-b32-window", "mqa", "mha", "group7"])
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_attention_reads_the_quantised_cache(
    cache_dtype: torch.dtype, dtype: torch.dtype, heads: tuple[int, int], head_dim: int,
    block_size: int, window: int | None, decode: bool,
) -> None:
    from kvserve.kernels import paged_attention

    query_lens, seq_lens = ragged(64 if decode else 12, 8192 if decode else 2048, decode,
                                  seed=heads[0] + head_dim + block_size)
    case = make_case(query_lens, seq_lens, *heads, head_dim, block_size, dtype)
    cache, scales = quantise_case(case, cache_dtype)
    write_kv(case.k, case.v, cache, case.metadata.slot_mapping, scales)
    md, scale = case.metadata, head_dim ** -0.5
    out = torch.full_like(case.q, float("nan"))
    if decode:
        paged_attention.decode_attention(case.q, cache, md.query_start_loc, md.seq_lens,
                                         md.block_table, md.max_seq_len, scale, window,
                                         out=out, kv_scales=scales)
    else:
        paged_attention.prefill_attention(case.q, cache, md.query_start_loc, md.seq_lens,
                                          md.block_table, md.max_query_len, scale, window,
                                          out=out, kv_scales=scales)
    ref = paged_attention_ref(case.q, cache, md, scale, window, scales)
    assert relative_error(out, ref) < MAX_ERROR
    assert relative_error(out, float_reference(case, scale, window)) < QUANTISATION_ERROR[
        cache_dtype]


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
def test_fused_decode_write_in_a_cuda_graph(cache_dtype: torch.dtype) -> None:
    """The decode kernel's own quantising write, captured once and replayed
    over new K/V: cache, scales and output as the unfused pair's."""
    from kvserve.kernels import paged_attention
    from kvserve.kernels.rope_store_kv import rope_store_kv

    query_lens, seq_lens = ragged(32, 4000, True, seed=3)
    case = make_case(query_lens, seq_lens, 32, 8, 128, 16, torch.bfloat16)
    md = case.metadata
    rope = RotaryEmbedding(128, 8192, {"rope_theta": 500000.0})
    cos_sin = rope.cos_sin_cache.cuda()
    positions = md.seq_lens.long() - 1
    cache, scales = quantise_case(case, cache_dtype)
    q, k, v = case.q.clone(), case.k.clone(), case.v.clone()
    attend = functools.partial(paged_attention.decode_attention,
                               query_start_loc=md.query_start_loc, seq_lens=md.seq_lens,
                               block_table=md.block_table, max_seq_len=md.max_seq_len,
                               scale=128 ** -0.5, sliding_window=None, kv_scales=scales)
    q_in = q.clone()
    attend(q_in.clone(), cache, new_kv=paged_attention.NewKV(k, v, md.slot_mapping, cos_sin))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend(q_in, cache, new_kv=paged_attention.NewKV(k, v, md.slot_mapping, cos_sin))
    for _ in range(3):
        fresh = make_case(query_lens, seq_lens, 32, 8, 128, 16, torch.bfloat16)
        q.copy_(fresh.q)
        k.copy_(fresh.k)
        v.copy_(fresh.v)
        q_in.copy_(q)
        graph.replay()
        pair_cache, pair_scales = cache.clone(), scales.clone()
        pair_q = q.clone()
        rope_store_kv(pair_q, k, v, pair_cache, md.slot_mapping, positions, cos_sin, 128,
                      pair_scales)
        expected = paged_attention.decode_attention(
            pair_q, pair_cache, md.query_start_loc, md.seq_lens, md.block_table,
            md.max_seq_len, 128 ** -0.5, None, kv_scales=pair_scales)
        torch.cuda.synchronize()
        assert same_bits(cache, pair_cache) and same_bits(scales, pair_scales)
        assert relative_error(out, expected) < 1e-3


# ---------------------------------------------------------------- the engine


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randint(2, 40))] for _ in range(n)]


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _engine(path: Path, kv_cache_dtype: str, **kwargs: Any) -> LLM:
    return LLM(model=str(path), dtype="bfloat16", device="cuda", kv_cache_dtype=kv_cache_dtype,
               gpu_memory_utilization=0.3, **kwargs)


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_graphs_batching_and_speculation_change_no_token(
    kv_cache_dtype: str, tiny_checkpoint: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Greedy tokens identical: CUDA graphs on and off, a request alone and in
    a batch of 64 (the one-row skinny GEMM off, as in
    ``test_cuda_graphs_gpu.py``), speculative decoding (ngram) on and off."""
    from kvserve.kernels import skinny_gemm

    monkeypatch.setattr(skinny_gemm, "LAYER_MAX_M", 0)
    path = tiny_checkpoint("llama")
    prompts = _prompts(64, seed=1)
    graphs = _engine(path, kv_cache_dtype, max_num_seqs=64)
    assert graphs.engine.core.executor.graphs is not None  # type: ignore[attr-defined]
    together = _tokens(graphs, prompts, GREEDY)
    assert graphs.stats()["num_graph_steps"] > 0
    assert [_tokens(graphs, [p], GREEDY)[0] for p in prompts[:16]] == together[:16]
    eager = _engine(path, kv_cache_dtype, max_num_seqs=64, enforce_eager=True)
    assert _tokens(eager, prompts, GREEDY) == together
    del graphs, eager
    spec = _engine(path, kv_cache_dtype, max_num_seqs=64, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "auto_disable": False})
    assert _tokens(spec, prompts, GREEDY) == together
    assert spec.stats()["spec_decode_num_draft_tokens"] > 0


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_triton_equals_torch_backend_and_stays_near_bf16(
    kv_cache_dtype: str, tiny_checkpoint: Callable[[str], Path],
) -> None:
    """The kernels read and write the cache as the torch reference does (the
    writes bit-equal, above); attention and the layers sum in other orders,
    so the greedy tokens agree up to a near-tie (``tests/near_ties.py``). The
    first token's logprobs stay within ``FIRST_TOKEN_ERROR`` of the 16-bit
    cache's."""
    path = tiny_checkpoint("mistral")  # GQA and a sliding window
    prompts = _prompts(12, seed=4)
    kwargs: dict[str, Any] = dict(max_num_batched_tokens=64, enforce_eager=True)
    outputs = _engine(path, kv_cache_dtype, **kwargs).generate(prompts, near_ties.GREEDY,
                                                               use_tqdm=False)
    reference = _engine(path, kv_cache_dtype, attention_backend="torch", **kwargs).generate(
        prompts, near_ties.GREEDY, use_tqdm=False)
    near_ties.assert_same_up_to_near_ties(outputs, reference)
    bf16 = _engine(path, "auto", **kwargs).generate(prompts, near_ties.GREEDY, use_tqdm=False)
    assert near_ties.first_token_error(outputs, bf16) < FIRST_TOKEN_ERROR[kv_cache_dtype]


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_pool_holds_about_twice_the_tokens(kv_cache_dtype: str) -> None:
    # max_model_len x max_num_seqs far above what fits: the pool is the budget's
    kwargs: dict[str, Any] = dict(model="qwen2.5-0.5b", load_format="dummy", dtype="bfloat16",
                                  device="cuda", max_model_len=32768, gpu_memory_utilization=0.3)
    blocks = {}
    for name in ("auto", kv_cache_dtype):
        llm = LLM(**kwargs, kv_cache_dtype=name)
        blocks[name] = llm.stats()["kv_blocks_total"]
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    bf16, quantised = blocks["auto"], blocks[kv_cache_dtype]
    # head_dim 64: an int8 scale costs 4 bytes beside 64 values
    expected = 2.0 if kv_cache_dtype == "fp8_e4m3" else 2 * 64 / 68
    assert quantised / bf16 == pytest.approx(expected, rel=0.05)
