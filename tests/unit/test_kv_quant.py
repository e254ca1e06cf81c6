"""The quantised KV cache's kernels on CPU under ``TRITON_INTERPRET=1``, tiny
shapes, fp8_e4m3 and int8 caches:

- the writes (``store_kv``, ``rope_store_kv``, the decode kernel's fused
  write) quantise bit for bit as the torch reference (``attention/kv_quant.py``)
  does, scales included, and the fused ones as the unfused pair;
- the attention kernels read a quantised cache as the torch reference does
  reading the same cache (the 16-bit tests' tolerances), and stay within a
  looser, stated distance of attention over the cache before quantising.

Caches are poisoned where no request owns a slot (NaN fp8 bytes, NaN int8
scales), so a read past a context shows. Skipped like the other interpreter
tests (``tests/triton_interpreter.py``); ``tests/gpu`` covers the compiled
kernels.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.triton_interpreter import require_interpreter

require_interpreter("tests/gpu/test_kv_quant_gpu.py")

from kvserve.attention.backend import get_attention_backend  # noqa: E402 (after the interpreter switch)
from kvserve.attention.kv_quant import dequantize_kv, quantize_kv  # noqa: E402
from kvserve.attention.torch_ref import paged_attention_ref, write_kv  # noqa: E402
from kvserve.kernels import paged_attention  # noqa: E402
from kvserve.kernels.rope_store_kv import rope_store_kv  # noqa: E402
from kvserve.kernels.rotary import apply_rotary  # noqa: E402
from kvserve.kernels.store_kv import store_kv  # noqa: E402
from kvserve.layers.rotary import RotaryEmbedding  # noqa: E402
from tests.attention_cases import Case, make_case, quantise_case  # noqa: E402

CACHE_DTYPES = [torch.float8_e4m3fn, torch.int8]
CACHE_IDS = ["fp8", "int8"]
# kernel against the reference reading the same quantised cache: the 16-bit tests' bounds
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2}
# against attention over the cache before quantising (random normal K/V, head_dim 16):
# e4m3 keeps 3 mantissa bits (up to 6% per element), int8 a 127th of each vector's amax
QUANTISATION_ERROR = {torch.float8_e4m3fn: 0.06, torch.int8: 0.015}
MIXED_Q, MIXED_S = [5, 1, 7, 1, 19], [5, 9, 30, 1, 37]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN poison included)."""
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(as_int), b.view(as_int))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), f"{int(out.isnan().sum())} output elements unwritten or NaN"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def step_cache(case: Case, cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantised cache after the step's writes, by the reference."""
    cache, scales = quantise_case(case, cache_dtype)
    write_kv(case.k, case.v, cache, case.metadata.slot_mapping, scales)
    return cache, scales


def float_reference(case: Case, scale: float, window: int | None) -> torch.Tensor:
    """Attention over the cache before quantising (the 16-bit path's answer)."""
    cache = case.kv_cache.clone()
    write_kv(case.k, case.v, cache, case.metadata.slot_mapping)
    return paged_attention_ref(case.q, cache, case.metadata, scale, window)


# ---------------------------------------------------------------- writes


def test_reference_quantiser() -> None:
    """int8 within half a step of each vector's scale, exact zeros for a zero
    vector; fp8 rounds like torch's cast and saturates at 448 times the scale."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 16, generator=generator) * torch.tensor([0.01, 1.0, 50.0])[:, None]
    x[2, 1] = 0.0
    values, scales = quantize_kv(x, torch.int8)
    assert values.dtype == torch.int8 and scales is not None and scales.shape == (7, 3)
    assert int(values.abs().max()) == 127 and float(scales[2, 1]) == 0.0
    assert not values[2, 1].any()
    error = (dequantize_kv(values, scales) - x).abs()
    assert bool((error <= scales[..., None] * (0.5 + 1e-5)).all())
    head_scales = torch.tensor([0.5, 2.0, 0.01])
    values, none = quantize_kv(x, torch.float8_e4m3fn, head_scales)
    assert none is None and values.dtype == torch.float8_e4m3fn
    expected = (x / head_scales[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert same_bits(values, expected)
    assert float(dequantize_kv(values, head_scales)[..., 2, :].abs().max()) == pytest.approx(4.48)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_store_kv_quantises_like_the_reference(cache_dtype: torch.dtype, dtype: torch.dtype,
                                               block_size: int) -> None:
    case = make_case(MIXED_Q, MIXED_S, 4, 2, 16, block_size, dtype)
    slots = case.metadata.slot_mapping.clone()
    slots[3] = -1  # a padding row writes nothing
    expected, expected_scales = quantise_case(case, cache_dtype)
    cache, scales = expected.clone(), expected_scales.clone()
    write_kv(case.k, case.v, expected, slots, expected_scales)
    store_kv(case.k, case.v, cache, slots, scales)
    assert same_bits(cache, expected) and same_bits(scales, expected_scales)


def test_fp8_write_rounds_ties_subnormals_and_saturates_like_torch() -> None:
    """e4m3's rounding done in float32 by the kernel (the interpreter's own cast
    rounds wrongly): ties to even, a carry into the exponent, subnormals, -0,
    saturation, against torch's cast of the same quotient."""
    special = torch.tensor([
        7.9375, 7.999, 0.0625 * 1.0625, 0.0625 * 1.1875, 240.0, 232.0, 448.0, 460.0, 1e6,
        2.0**-6, 2.0**-7 * 1.5, 2.0**-9 * 0.5, 2.0**-9 * 1.5, 2.0**-9 * 2.5, 2.0**-10, 2.0**-11,
        1e-30, 0.0, -0.0, 0.3, 1.0 / 3.0, 17.5, 18.5, 19.0, 3.0 * 2.0**-8, 5.0 * 2.0**-9,
        -7.9375, -2.0**-9 * 0.5, -1e6, -232.0, 0.1, 123.456,
    ])
    generator = torch.Generator().manual_seed(1)
    wide = torch.randn(96, generator=generator) * 2.0 ** torch.randint(-12, 9, (96,),
                                                                         generator=generator)
    values = torch.cat([special, wide]).view(-1, 1, 16)  # [8 tokens, 1 head, 16 dims]
    num_tokens = values.shape[0]
    cache = torch.zeros((2, 2, num_tokens, 1, 16), dtype=torch.float8_e4m3fn)
    scales = torch.tensor([[1.0], [0.5]])
    slots = torch.arange(num_tokens) + num_tokens  # block 1
    expected = cache.clone()
    write_kv(values, values, expected, slots, scales)
    store_kv(values, values, cache, slots, scales)
    assert same_bits(cache, expected)
    # the reference is torch's cast of the clamped quotient
    assert same_bits(expected[0, 1].reshape(-1),
                     values.reshape(-1).clamp(-448, 448).to(torch.float8_e4m3fn))


def test_int8_write_of_zero_and_one_hot_vectors() -> None:
    k = torch.zeros(2, 1, 16)
    k[1, 0, 5] = -3.0  # one nonzero element: it becomes -127, the rest 0
    cache = torch.zeros((2, 2, 2, 1, 16), dtype=torch.int8)
    scales = torch.full((2, 2, 2, 1), float("nan"))
    store_kv(k, k, cache, torch.tensor([2, 3]), scales)
    assert float(scales[0, 1, 0, 0]) == 0.0 and not cache[:, 1, 0].any()
    assert float(scales[0, 1, 1, 0]) == pytest.approx(3.0 / 127)
    assert int(cache[0, 1, 1, 0, 5]) == -127 and int(cache[0, 1, 1, 0].abs().sum()) == 127
    assert scales[:, 0].isnan().all(), "block 0 was written"


def rope_inputs(case: Case, partial: float) -> tuple[RotaryEmbedding, torch.Tensor]:
    rope = RotaryEmbedding(case.q.shape[-1], 64,
                           {"rope_theta": 10000.0, "partial_rotary_factor": partial})
    md = case.metadata
    positions = torch.cat([torch.arange(s - q, s) for q, s in
                           zip(md.query_start_loc.diff().tolist(), md.seq_lens_cpu, strict=True)])
    return rope, positions


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim,partial", [(16, 1.0), (24, 0.5)])
def test_rope_store_kv_quantises_like_rotary_then_store_kv(
    cache_dtype: torch.dtype, dtype: torch.dtype, head_dim: int, partial: float
) -> None:
    case = make_case([3, 1, 6], [3, 10, 21], 4, 2, head_dim, 4, dtype)
    rope, positions = rope_inputs(case, partial)
    cache, scales = quantise_case(case, cache_dtype)
    pair_q, pair_k, pair_cache, pair_scales = (case.q.clone(), case.k.clone(), cache.clone(),
                                               scales.clone())
    apply_rotary(positions, pair_q, pair_k, rope.cos_sin_cache, head_dim, rope.rotary_dim)
    store_kv(pair_k, case.v, pair_cache, case.metadata.slot_mapping, pair_scales)
    q = case.q.clone()
    rope_store_kv(q, case.k, case.v, cache, case.metadata.slot_mapping, positions,
                  rope.cos_sin_cache, rope.rotary_dim, scales)
    assert same_bits(q, pair_q)
    assert same_bits(cache, pair_cache) and same_bits(scales, pair_scales)


# ---------------------------------------------------------------- attention


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("heads,window", [((4, 2), None), ((4, 1), 6), ((4, 4), None)],
                         ids=["gqa", "mqa-window", "mha"])
def test_prefill_reads_the_quantised_cache(cache_dtype: torch.dtype, dtype: torch.dtype,
                                           heads: tuple[int, int], window: int | None) -> None:
    case = make_case(MIXED_Q, MIXED_S, *heads, 16, 4, dtype)
    cache, scales = step_cache(case, cache_dtype)
    md = case.metadata
    out = torch.full_like(case.q, float("nan"))
    paged_attention.prefill_attention(case.q, cache, md.query_start_loc, md.seq_lens,
                                      md.block_table, md.max_query_len, 0.25, window, out=out,
                                      kv_scales=scales)
    ref = paged_attention_ref(case.q, cache, md, 0.25, window, scales)
    assert relative_error(out, ref) < TOLERANCE[dtype]
    assert relative_error(out, float_reference(case, 0.25, window)) < QUANTISATION_ERROR[
        cache_dtype]


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("num_splits,window", [(1, None), (4, None), (8, 20)])
def test_decode_reads_the_quantised_cache(cache_dtype: torch.dtype, dtype: torch.dtype,
                                          num_splits: int, window: int | None) -> None:
    case = make_case([1, 1, 0, 1, 1], [1, 9, 8, 40, 130], 8, 2, 16, 4, dtype)
    cache, scales = step_cache(case, cache_dtype)
    md = case.metadata
    out = torch.full_like(case.q, float("nan"))
    paged_attention.decode_attention(case.q, cache, md.query_start_loc, md.seq_lens,
                                     md.block_table, md.max_seq_len, 0.25, window, out=out,
                                     num_splits=num_splits, min_split_tokens=4, kv_scales=scales)
    rows = md.query_start_loc[:-1][md.query_start_loc.diff() > 0]
    ref = paged_attention_ref(case.q, cache, md, 0.25, window, scales)
    assert relative_error(out[rows], ref[rows]) < TOLERANCE[dtype]
    assert relative_error(out[rows], float_reference(case, 0.25, window)[rows]) < (
        QUANTISATION_ERROR[cache_dtype])
    assert not paged_attention.decode_semaphores(torch.device("cpu"), 1).any()


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
def test_mixed_step_splits_between_the_two_kernels(cache_dtype: torch.dtype) -> None:
    case = make_case([1, 7, 1, 0, 3, 1], [30, 9, 1, 4, 20, 70], 4, 2, 16, 4, torch.float16)
    cache, scales = step_cache(case, cache_dtype)
    md = case.metadata
    out = paged_attention.prefill_attention(case.q, cache, md.query_start_loc, md.seq_lens,
                                            md.block_table, md.max_query_len, 0.25, 5,
                                            skip_decodes=True, kv_scales=scales)
    paged_attention.decode_attention(case.q, cache, md.query_start_loc, md.seq_lens,
                                     md.block_table, md.max_seq_len, 0.25, 5, out=out,
                                     num_splits=4, min_split_tokens=4, kv_scales=scales)
    ref = paged_attention_ref(case.q, cache, md, 0.25, 5, scales)
    assert relative_error(out, ref) < TOLERANCE[torch.float16]


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_splits,window", [(1, None), (4, None), (8, 20)])
def test_decode_kernel_writes_new_kv_like_rope_store_kv(
    cache_dtype: torch.dtype, dtype: torch.dtype, num_splits: int, window: int | None
) -> None:
    """The decode kernel's own quantising write (``new_kv``): output, cache and
    scales bit-equal to ``rope_store_kv`` then ``decode_attention``, one split
    and several, with a padding row and a negative slot. (bfloat16 q makes
    the interpreter round its dots alike on both paths.)"""
    case = make_case([1, 1, 0, 1, 1], [1, 9, 8, 40, 130], 8, 2, 16, 4, dtype)
    md = case.metadata
    slots = md.slot_mapping.clone()
    slots[1] = -1
    rope, positions = rope_inputs(case, 1.0)
    cache, scales = quantise_case(case, cache_dtype)
    attend = functools.partial(paged_attention.decode_attention,
                               query_start_loc=md.query_start_loc, seq_lens=md.seq_lens,
                               block_table=md.block_table, max_seq_len=md.max_seq_len,
                               scale=0.25, sliding_window=window, num_splits=num_splits,
                               min_split_tokens=4)
    pair_q, pair_cache, pair_scales = case.q.clone(), cache.clone(), scales.clone()
    rope_store_kv(pair_q, case.k, case.v, pair_cache, slots, positions, rope.cos_sin_cache,
                  16, pair_scales)
    pair = attend(pair_q, pair_cache, kv_scales=pair_scales)
    fused = attend(case.q.clone(), cache, kv_scales=scales, new_kv=paged_attention.NewKV(
        case.k, case.v, slots, rope.cos_sin_cache))
    assert same_bits(fused, pair)
    assert same_bits(cache, pair_cache) and same_bits(scales, pair_scales)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
@pytest.mark.parametrize("query_lens,seq_lens", [([1, 1, 1], [3, 20, 41]), (MIXED_Q, MIXED_S)],
                         ids=["decode", "mixed"])
def test_triton_backend_matches_the_torch_backend(
    cache_dtype: torch.dtype, query_lens: list[int], seq_lens: list[int]
) -> None:
    """Both backends given a quantised cache: the same cache and scales bit for
    bit, close outputs."""
    case = make_case(query_lens, seq_lens, 4, 2, 16, 4, torch.float32)
    triton_backend, torch_backend = get_attention_backend("triton"), get_attention_backend("torch")
    cache, scales = quantise_case(case, cache_dtype)
    ref_cache, ref_scales = cache.clone(), scales.clone()
    out = triton_backend.forward(case.q, case.k, case.v, cache, case.metadata, 0.25, 8,
                                 kv_scales=scales)
    ref = torch_backend.forward(case.q, case.k, case.v, ref_cache, case.metadata, 0.25, 8,
                                kv_scales=ref_scales)
    assert relative_error(out, ref) < TOLERANCE[torch.float32]
    assert same_bits(cache, ref_cache) and same_bits(scales, ref_scales)


def test_launchers_check_the_scales() -> None:
    case = make_case([2], [5], 4, 2, 16, 4, torch.float16)
    md = case.metadata
    int8_cache, _ = quantise_case(case, torch.int8)
    fp8_cache, fp8_scales = quantise_case(case, torch.float8_e4m3fn)
    attend = functools.partial(paged_attention.prefill_attention, q=case.q,
                               query_start_loc=md.query_start_loc, seq_lens=md.seq_lens,
                               block_table=md.block_table, max_query_len=2, scale=0.25)
    with pytest.raises(ValueError, match=r"kv_scales: missing; a torch\.int8 cache needs"):
        attend(kv_cache=int8_cache)
    with pytest.raises(ValueError, match=r"kv_scales: torch\.float32 of shape \(2, 2\)"):
        attend(kv_cache=int8_cache, kv_scales=fp8_scales)
    with pytest.raises(ValueError, match=r"a torch\.float8_e4m3fn cache needs contiguous"):
        attend(kv_cache=fp8_cache, kv_scales=fp8_scales.half())
    with pytest.raises(ValueError, match=r"kv_scales: given for a torch\.float16 cache"):
        attend(kv_cache=case.kv_cache, kv_scales=fp8_scales)
    with pytest.raises(ValueError, match=r"q: dtype torch\.float64"):
        attend(kv_cache=fp8_cache, kv_scales=fp8_scales, q=case.q.double())
    with pytest.raises(ValueError, match="kv_scales: missing"):
        store_kv(case.k, case.v, fp8_cache, md.slot_mapping)
    with pytest.raises(ValueError, match="kv_scales: missing"):
        rope_store_kv(case.q, case.k, case.v, int8_cache, md.slot_mapping,
                      torch.arange(2), RotaryEmbedding(16, 8, {}).cos_sin_cache, 16)
