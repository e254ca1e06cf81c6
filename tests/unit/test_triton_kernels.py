"""The Triton attention kernels on CPU under ``TRITON_INTERPRET=1``, against the
torch reference, on tiny shapes: ragged batches crossing block boundaries,
GQA / MQA / MHA, sliding windows, chunked prefill over a cached prefix,
split-K decode (merged by its last split, with counters every launch must
leave at 0), shuffled and reversed block tables. Outputs are poisoned
with NaN, and so is every cache slot no request owns, so an unwritten
output or a read past a request's context shows.

The interpreter has no bfloat16 matmul, so attention runs in float32 and
float16 here (bfloat16 only for the KV write); ``tests/gpu`` covers bfloat16.
Skipped without Triton, and on machines with CUDA, where the compiled
kernels are tested instead (the interpreter switch is process-wide); also
skipped, saying so, if Triton was imported earlier in the process without
the interpreter (set ``TRITON_INTERPRET=1`` in the environment then).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.triton_interpreter import require_interpreter

require_interpreter("tests/gpu/test_triton_attention_gpu.py")

from kvserve import LLM, SamplingParams
from kvserve.attention.backend import get_attention_backend
from kvserve.attention.torch_ref import paged_attention_ref, write_kv
from kvserve.engine.args import resolve_attention_backend
from kvserve.kernels import paged_attention, store_kv
from tests.attention_cases import Case, make_case

TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def reference(case: Case, scale: float, sliding_window: int | None) -> torch.Tensor:
    cache = case.kv_cache.clone()
    write_kv(case.k, case.v, cache, case.metadata.slot_mapping)
    return paged_attention_ref(case.q, cache, case.metadata, scale, sliding_window)


def stored_cache(case: Case) -> torch.Tensor:
    cache = case.kv_cache.clone()
    store_kv.store_kv(case.k, case.v, cache, case.metadata.slot_mapping)
    return cache


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert not out.isnan().any(), f"{int(out.isnan().sum())} output elements unwritten or NaN"
    error = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert error < TOLERANCE[out.dtype], f"relative error {error:.2e}"


def run_prefill(case: Case, sliding_window: int | None = None) -> None:
    scale = case.q.shape[-1] ** -0.5
    cache = stored_cache(case)
    out = torch.full_like(case.q, float("nan"))
    md = case.metadata
    paged_attention.prefill_attention(case.q, cache, md.query_start_loc, md.seq_lens,
                                      md.block_table, md.max_query_len, scale, sliding_window,
                                      out=out)
    assert_close(out, reference(case, scale, sliding_window))


def run_decode(case: Case, sliding_window: int | None = None,
               num_splits: int | None = None, min_split_tokens: int = 16) -> torch.Tensor:
    scale = case.q.shape[-1] ** -0.5
    cache = stored_cache(case)
    out = torch.full_like(case.q, float("nan"))
    md = case.metadata
    paged_attention.decode_attention(case.q, cache, md.query_start_loc, md.seq_lens,
                                     md.block_table, md.max_seq_len, scale, sliding_window,
                                     out=out, num_splits=num_splits,
                                     min_split_tokens=min_split_tokens)
    assert_close(out, reference(case, scale, sliding_window))
    return out


# a mixed batch: a fresh prefill, a decode, a chunk over a cached prefix
# ending mid-block, a one-token prefill, a long chunk crossing several blocks
MIXED_Q = [5, 1, 7, 1, 19]
MIXED_S = [5, 9, 30, 1, 37]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 16])
def test_store_kv_matches_reference_write(dtype: torch.dtype, block_size: int) -> None:
    case = make_case(MIXED_Q, MIXED_S, 4, 2, 16, block_size, dtype)
    expected = case.kv_cache.clone()
    write_kv(case.k, case.v, expected, case.metadata.slot_mapping)
    torch.testing.assert_close(stored_cache(case), expected, rtol=0, atol=0, equal_nan=True)


def test_store_kv_strided_inputs_cast_and_negative_slots() -> None:
    case = make_case([6], [6], 4, 2, 24, 4, torch.float16)
    # k and v as views into one packed [num_tokens, 2 * num_kv_heads * head_dim] tensor
    packed = torch.randn(6, 2 * 2 * 24)
    k, v = packed[:, :48].view(6, 2, 24), packed[:, 48:].view(6, 2, 24)
    slots = case.metadata.slot_mapping.clone()
    slots[2] = -1
    cache = case.kv_cache.clone()
    store_kv.store_kv(k, v, cache, slots)
    expected = case.kv_cache.clone()
    keep = slots >= 0
    write_kv(k[keep], v[keep], expected, slots[keep])
    torch.testing.assert_close(cache, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("head_dim", [16, 32])
@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (4, 4)], ids=["gqa", "mqa", "mha"])
def test_prefill_mixed_batch(
    dtype: torch.dtype, block_size: int, head_dim: int, heads: tuple[int, int]
) -> None:
    run_prefill(make_case(MIXED_Q, MIXED_S, *heads, head_dim, block_size, dtype))


@pytest.mark.parametrize("heads", [(6, 2), (8, 1), (3, 3)], ids=["group3", "group8", "mha3"])
def test_prefill_odd_groups_and_head_dim(heads: tuple[int, int]) -> None:
    run_prefill(make_case([9, 2, 4], [9, 20, 13], *heads, 24, 4, torch.float32))


@pytest.mark.parametrize("layout", ["reversed", "contiguous"])
def test_prefill_block_table_layouts(layout: str) -> None:
    run_prefill(make_case(MIXED_Q, MIXED_S, 4, 2, 16, 4, torch.float16, layout=layout))


@pytest.mark.parametrize("window", [1, 3, 6, 19, 100])
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_sliding_window(window: int, block_size: int) -> None:
    case = make_case([40, 1, 12, 3], [40, 33, 50, 3], 4, 2, 16, block_size, torch.float32)
    run_prefill(case, sliding_window=window)


def test_prefill_long_chunk_spans_several_q_blocks() -> None:
    # 70 query rows at group 2 -> BLOCK_M 128, BLOCK_Q 64 in fp16: two q-blocks, 3 key tiles
    run_prefill(make_case([70, 3], [150, 3], 4, 2, 16, 16, torch.float16))


def test_prefill_skips_requests_with_no_new_tokens() -> None:
    run_prefill(make_case([3, 0, 5], [7, 9, 5], 4, 2, 16, 4, torch.float32))


def test_prefill_kernel_handles_decode_only_batches() -> None:
    run_prefill(make_case([1, 1, 1], [1, 17, 40], 4, 2, 16, 4, torch.float16))


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_mixed_batch_splits_between_the_two_kernels(window: int | None, num_splits: int) -> None:
    """A mixed step: the prefill kernel told to skip one-token requests, then the
    decode kernel on the same output, equals the reference; each alone leaves the
    other's rows unwritten."""
    case = make_case([1, 7, 1, 0, 3, 1], [30, 9, 1, 4, 20, 70], 4, 2, 16, 4, torch.float16)
    scale = case.q.shape[-1] ** -0.5
    cache = stored_cache(case)
    md = case.metadata
    single = torch.zeros(case.q.shape[0], dtype=torch.bool)
    single[[0, 8, 12]] = True  # the rows of the one-token requests (query starts 0, 8, 12)
    out = torch.full_like(case.q, float("nan"))
    paged_attention.prefill_attention(case.q, cache, md.query_start_loc, md.seq_lens,
                                      md.block_table, md.max_query_len, scale, window,
                                      out=out, skip_decodes=True)
    assert out[single].isnan().all() and not out[~single].isnan().any()
    paged_attention.decode_attention(case.q, cache, md.query_start_loc, md.seq_lens,
                                     md.block_table, md.max_seq_len, scale, window, out=out,
                                     num_splits=num_splits, min_split_tokens=16)
    assert_close(out, reference(case, scale, window))
    alone = torch.full_like(case.q, float("nan"))
    paged_attention.decode_attention(case.q, cache, md.query_start_loc, md.seq_lens,
                                     md.block_table, md.max_seq_len, scale, window, out=alone,
                                     num_splits=num_splits, min_split_tokens=16)
    assert alone[~single].isnan().all() and torch.equal(alone[single], out[single])


@pytest.mark.parametrize("heads,num_splits", [
    ((4, 2), None), ((4, 2), 1), ((4, 2), 2), ((4, 2), 3), ((4, 2), 8), ((4, 1), 8),
    ((4, 4), 8), ((8, 1), 3),
])
def test_decode_splits(heads: tuple[int, int], num_splits: int | None) -> None:
    case = make_case([1] * 4, [1, 15, 70, 520], *heads, 16, 16, torch.float16)
    run_decode(case, num_splits=num_splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("head_dim", [16, 32])
def test_decode_dtypes_and_shapes(dtype: torch.dtype, block_size: int, head_dim: int) -> None:
    case = make_case([1] * 3, [4, 33, 130], 4, 2, head_dim, block_size, dtype, seed=1)
    run_decode(case, num_splits=2)


@pytest.mark.parametrize("window", [1, 5, 40, 1000])
def test_decode_sliding_window_empty_splits(window: int) -> None:
    # with 4 splits of 80 positions, windows under 240 leave early splits empty
    case = make_case([1] * 3, [3, 90, 300], 4, 2, 16, 4, torch.float32, layout="reversed")
    run_decode(case, sliding_window=window, num_splits=4)


def test_decode_uses_at_least_min_split_tokens_per_split() -> None:
    case = make_case([1] * 3, [20, 130, 700], 4, 2, 16, 16, torch.float32)
    run_decode(case, num_splits=8, min_split_tokens=128)
    run_decode(case, num_splits=8, min_split_tokens=1)


def test_decode_output_ignores_upper_bound_and_padding() -> None:
    """What a CUDA graph relies on: ``max_seq_len`` only an upper bound, and
    zero-length padding requests after the real ones, leave every real row
    bit-identical."""
    case = make_case([1] * 3, [9, 77, 300], 4, 2, 16, 4, torch.float32)
    exact = run_decode(case, num_splits=4)
    scale = case.q.shape[-1] ** -0.5
    md = case.metadata
    pad = 2
    q = torch.cat([case.q, torch.zeros((pad, *case.q.shape[1:]), dtype=case.q.dtype)])
    query_start_loc = torch.cat([md.query_start_loc, md.query_start_loc[-1:].repeat(pad)])
    seq_lens = torch.cat([md.seq_lens, torch.zeros(pad, dtype=md.seq_lens.dtype)])
    block_table = torch.cat([md.block_table, torch.zeros((pad, md.block_table.shape[1]),
                                                         dtype=md.block_table.dtype)])
    out = paged_attention.decode_attention(q, stored_cache(case), query_start_loc, seq_lens,
                                           block_table, 4096, scale, num_splits=4,
                                           min_split_tokens=16)
    assert torch.equal(out[:3], exact)
    assert not cpu_semaphores().any(), "padding rows left split counters nonzero"


def test_decode_skips_requests_with_no_new_token() -> None:
    run_decode(make_case([1, 0, 1], [5, 8, 70], 4, 2, 16, 4, torch.float32), num_splits=2)


def cpu_semaphores() -> torch.Tensor:
    """The split counters ``decode_attention`` uses on the CPU."""
    return paged_attention.decode_semaphores(torch.device("cpu"), 1)


# at min_split_tokens 4 these contexts use 1, 5, 10, 33 and 75 -> all the
# splits (fewer with fewer splits or a window); one request has no new token
# (padding rows without context: test_decode_output_ignores_upper_bound_and_padding)
RAGGED_Q = [1, 0, 1, 1, 1, 1]
RAGGED_S = [1, 8, 17, 40, 130, 300]
GROUPS = {1: (2, 2), 4: (8, 2), 8: (8, 1)}  # query heads per KV head -> (heads, KV heads)
MERGE_CASES = [(1, 4, None), (2, 4, None), (8, 4, None), (64, 4, None), (8, 1, None),
               (64, 1, None), (8, 8, None), (64, 8, None), (2, 4, 50), (64, 4, 50), (64, 8, 7)]


@pytest.mark.parametrize("num_splits,group,window", MERGE_CASES,
                         ids=[f"splits{s}-group{g}-window{w}" for s, g, w in MERGE_CASES])
def test_decode_last_split_merges_in_the_same_launch(
    num_splits: int, group: int, window: int | None
) -> None:
    semaphores = cpu_semaphores()
    case = make_case(RAGGED_Q, RAGGED_S, *GROUPS[group], 16, 4, torch.float32)
    run_decode(case, sliding_window=window, num_splits=num_splits, min_split_tokens=4)
    assert cpu_semaphores() is semaphores
    assert not semaphores.any(), "a launch left split counters nonzero"


@pytest.mark.parametrize("group", [4, 8])
def test_decode_merge_in_several_passes(group: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A merge tile too small for the whole GQA group reduces it a few heads
    per pass (one head per pass here), with the same result."""
    monkeypatch.setattr(paged_attention, "MERGE_TILE_ELEMENTS", 1)
    case = make_case(RAGGED_Q, RAGGED_S, *GROUPS[group], 16, 4, torch.float32)
    run_decode(case, num_splits=8, min_split_tokens=4)
    assert not cpu_semaphores().any()


def test_decode_semaphores_reset_for_the_next_launch() -> None:
    """One counter buffer serves launch after launch, as in a replayed CUDA
    graph: a counter left nonzero would keep the next launch's last split
    from recognising itself, and its output would stay NaN."""
    semaphores = cpu_semaphores()
    batches = [((4, 2), RAGGED_Q, RAGGED_S), ((8, 1), [1, 1, 1], [70, 5, 260]),
               ((4, 4), [0, 1], [9, 33])]
    for seed in range(2):
        for heads, query_lens, seq_lens in batches:
            case = make_case(query_lens, seq_lens, *heads, 16, 4, torch.float32, seed=seed)
            run_decode(case, num_splits=8, min_split_tokens=4)
            assert cpu_semaphores() is semaphores
            assert not semaphores.any()


def test_decode_semaphores_grow_and_keep_old_buffers() -> None:
    device = torch.device("cpu")
    old = paged_attention.decode_semaphores(device, 1)
    new = paged_attention.decode_semaphores(device, old.numel() + 1)
    assert new.numel() > old.numel() and not new.any()
    assert paged_attention.decode_semaphores(device, 1) is new
    # a CUDA graph may still hold the old address: it must stay allocated
    old_ref = weakref.ref(old)
    del old
    gc.collect()
    assert old_ref() is not None


def test_decode_num_splits_policy() -> None:
    splits = paged_attention.decode_num_splits
    assert splits(1, 8, 132) == paged_attention.MAX_SPLITS == 16
    assert splits(32, 8, 132) == 2
    assert splits(128, 8, 132) == 1
    # a batch splits like the CUDA graph size it is padded to
    assert splits(17, 8, 132) == splits(24, 8, 132) == splits(32, 8, 132)
    for num_reqs in (1, 3, 7, 64):
        value = splits(num_reqs, 2, 100)
        assert value & (value - 1) == 0 and 1 <= value <= paged_attention.MAX_SPLITS


@pytest.mark.parametrize("query_lens,seq_lens", [([1, 1, 1], [3, 20, 41]), (MIXED_Q, MIXED_S)],
                         ids=["decode", "mixed"])
def test_backend_matches_torch_backend(query_lens: list[int], seq_lens: list[int]) -> None:
    case = make_case(query_lens, seq_lens, 4, 2, 16, 4, torch.float16)
    triton_backend, torch_backend = get_attention_backend("triton"), get_attention_backend("torch")
    assert triton_backend.name == "triton"
    triton_cache, torch_cache = case.kv_cache.clone(), case.kv_cache.clone()
    args = (case.metadata, 0.25, 8)
    out = triton_backend.forward(case.q, case.k, case.v, triton_cache, *args)
    ref = torch_backend.forward(case.q, case.k, case.v, torch_cache, *args)
    assert_close(out, ref)
    torch.testing.assert_close(triton_cache, torch_cache, rtol=0, atol=0, equal_nan=True)


def test_launchers_reject_bad_inputs() -> None:
    case = make_case([2], [5], 4, 2, 16, 4, torch.float16)
    md = case.metadata
    cache = case.kv_cache

    def prefill(**override: object) -> None:
        kwargs: dict = dict(q=case.q, kv_cache=cache, query_start_loc=md.query_start_loc,
                            seq_lens=md.seq_lens, block_table=md.block_table,
                            max_query_len=2, scale=1.0)
        kwargs.update(override)
        paged_attention.prefill_attention(**kwargs)

    with pytest.raises(ValueError, match="q: dtype"):
        prefill(q=case.q.float())
    with pytest.raises(ValueError, match="num_kv_heads=2"):
        prefill(q=torch.zeros(2, 3, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="seq_lens"):
        prefill(seq_lens=md.seq_lens.long())
    with pytest.raises(ValueError, match="block_table"):
        prefill(block_table=md.block_table.long())
    with pytest.raises(ValueError, match="sliding_window"):
        prefill(sliding_window=0)
    with pytest.raises(ValueError, match="kv_cache"):
        prefill(kv_cache=cache[0])
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv.store_kv(case.k, case.v, cache, md.slot_mapping.int())
    with pytest.raises(ValueError, match="k has shape"):
        store_kv.store_kv(case.k[:, :1], case.v, cache, md.slot_mapping)


def test_auto_backend_is_torch_on_cpu() -> None:
    assert resolve_attention_backend("auto", "cpu") == "torch"
    assert resolve_attention_backend("triton", "cpu") == "triton"
    assert resolve_attention_backend("auto", "auto") == "torch"  # no CUDA here


def test_engine_greedy_tokens_match_torch_backend(tiny_checkpoint: Callable[[str], Path]) -> None:
    # mistral: GQA and a sliding window of 8; a budget of 16 tokens chunks the
    # 37-token prompt and mixes its chunks with the other requests' decodes
    path = tiny_checkpoint("mistral")
    prompts = [list(range(20, 57)), [5, 17, 99, 3, 250, 7, 42], [11, 12]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=str(path), dtype="float32", device="cpu", block_size=4,
                  attention_backend=backend, max_num_batched_tokens=16)
        tokens[backend] = [o.outputs[0].token_ids
                           for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["triton"] == tokens["torch"]
