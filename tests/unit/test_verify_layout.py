"""A speculative verify step laid out one query token per row
(``worker/verify_layout.py``) against the same step laid out per request, on
the torch reference backend and the Triton backend under the interpreter:
the same attention output and the same cache, with and without the
backend's fused rotary, with padding rows (a verify graph's), GQA and a
sliding window. The new tokens' slots are poisoned first, so a row that
attends before every row's KV is written shows as NaN."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.triton_interpreter import require_interpreter

require_interpreter("tests/gpu/test_spec_decode_gpu.py")

from kvserve.attention import triton_backend as triton_backend_module  # noqa: E402
from kvserve.attention.backend import FusedRope, get_attention_backend  # noqa: E402
from kvserve.layers.rotary import RotaryEmbedding  # noqa: E402
from kvserve.worker.verify_layout import VerifyBuffers  # noqa: E402
from tests.attention_cases import Case, make_case, verify_layout  # noqa: E402

# four requests verifying 4, 2, 0 and 3 proposals; the second's new tokens
# cross a block boundary, the last one's context is its new tokens and one more
QUERY_LENS = [5, 3, 1, 4]
SEQ_LENS = [13, 10, 21, 5]


def poisoned(case: Case) -> torch.Tensor:
    """The case's cache with the new tokens' slots NaN (the step writes them)."""
    cache = case.kv_cache.clone()
    _, num_blocks, block_size, heads, dim = cache.shape
    cache.view(2, num_blocks * block_size, heads, dim)[:, case.metadata.slot_mapping] = (
        float("nan"))
    return cache


def close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any()
    error = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert error < (1e-5 if dtype == torch.float32 else 1e-2), f"relative error {error:.2e}"


@pytest.mark.parametrize("window", [None, 6])
def test_torch_backend_same_output_one_row_per_token(window: int | None) -> None:
    case = make_case(QUERY_LENS, SEQ_LENS, 4, 2, 16, 4, torch.float32)
    backend = get_attention_backend("torch")
    per_request, per_token = poisoned(case), poisoned(case)
    ref = backend.forward(case.q, case.k, case.v, per_request, case.metadata, 0.25, window)
    metadata, _ = verify_layout(case)
    assert metadata.verify and metadata.num_reqs == metadata.num_tokens == sum(QUERY_LENS)
    out = backend.forward(case.q, case.k, case.v, per_token, metadata, 0.25, window)
    close(out, ref, torch.float32)
    assert torch.equal(per_request.nan_to_num(), per_token.nan_to_num())


@pytest.mark.parametrize("dtype,fused_rope,num_padding_rows", [
    (torch.float32, False, 0), (torch.float16, True, 0), (torch.float32, True, 3)])
def test_triton_backend_same_output_one_row_per_token(
        dtype: torch.dtype, fused_rope: bool, num_padding_rows: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode kernel over the verify rows equals the torch reference over
    the per-request layout; with ``rope`` the backend must not take the decode
    kernel's fused KV write (each row would miss the rows before it)."""
    case = make_case(QUERY_LENS, SEQ_LENS, 8, 2, 16, 4, dtype)
    triton_backend, torch_backend = get_attention_backend("triton"), get_attention_backend("torch")
    metadata, positions = verify_layout(case, num_padding_rows)
    num_tokens = case.metadata.num_tokens
    pad = torch.zeros((num_padding_rows, *case.q.shape[1:]), dtype=dtype)
    q, k, v = (torch.cat([t, pad[:, :t.shape[1]]]) for t in (case.q, case.k, case.v))
    rope = RotaryEmbedding(16, 64, {})
    if fused_rope:
        # the interpreter runs programs one after another, so a fused write
        # would pass the comparison below: check the dispatch itself
        calls: list[bool] = []
        decode = triton_backend_module.decode_attention

        def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
            calls.append(kwargs.get("new_kv") is not None)
            return decode(*args, **kwargs)

        monkeypatch.setattr(triton_backend_module, "decode_attention", spy)
        out = triton_backend.forward(q.clone(), k, v, cache := poisoned(case), metadata, 0.25,
                                     None, FusedRope(positions, rope.cos_sin_cache, 16))
        ref_q, ref_k = rope(positions[:num_tokens], case.q, case.k)
        assert calls == [False], "a verify step took the decode kernel's fused KV write"
    else:
        out = triton_backend.forward(q, k, v, cache := poisoned(case), metadata, 0.25, None)
        ref_q, ref_k = case.q, case.k
    ref_cache = poisoned(case)
    ref = torch_backend.forward(ref_q, ref_k, case.v, ref_cache, case.metadata, 0.25, None)
    close(out[:num_tokens], ref, dtype)
    close(cache.nan_to_num(), ref_cache.nan_to_num(), dtype)


def test_fill_lays_out_rows_and_padding() -> None:
    buffers = VerifyBuffers(8, 3, torch.device("cpu"))
    host = buffers.fill(torch.tensor([7, 8, 9, 3, 4]).numpy(), torch.tensor([3, 2]).numpy(), 7)
    assert host == ([0, 1, 2, 3, 4, 5], [8, 9, 10, 4, 5])
    assert buffers.query_start_loc[:8].tolist() == [0, 1, 2, 3, 4, 5, 5, 5]
    assert buffers.seq_lens[:7].tolist() == [8, 9, 10, 4, 5, 0, 0]
    table = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32)
    buffers.gather(table, 7)
    assert buffers.block_table[:7].tolist() == [[1, 2, 3]] * 3 + [[4, 5, 6]] * 2 + [[1, 2, 3]] * 2
    with pytest.raises(RuntimeError, match="does not fit 8 rows"):
        buffers.fill(torch.arange(5).numpy(), torch.tensor([5]).numpy(), 9)
