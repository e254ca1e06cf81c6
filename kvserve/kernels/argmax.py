"""Row-wise argmax ``argmax_rows(x)``: ``torch.argmax(x, dim=-1)`` of a
``[R, V]`` tensor (float32, bfloat16 or float16) in two passes over many
programs, for greedy decoding's argmax over a large vocabulary (torch reduces
a row with one thread block, so a one-row argmax uses one SM).

Each value (upcast to float32, which is exact) maps to an int32 key ordered
as torch.argmax compares floats: NaN above everything (all NaNs equal),
``-0.0`` equal to ``+0.0``, otherwise the float order. The key and the
column's complement ``INT32_MAX - col`` pack into one int64 whose maximum
over a row is its argmax with the FIRST column winning ties, so each pass is
one integer ``tl.max`` (``tl.argmax`` compares floats, where NaN loses every
comparison, so it cannot give torch's NaN rule):

- pass 1, grid ``(R, cdiv(V, chunk))``: each program packs ``chunk`` columns
  of one row and writes their maximum into a scratch ``[R, num_chunks]``
  int64 buffer;
- pass 2, grid ``(R,)``: one program reduces a row's chunk maxima, all in one
  tile, and unpacks the column (int64). Equal keys in two chunks go to the
  lower column, hence the lower chunk.

So the result is torch's exactly: the first maximum, the first NaN of a row
that has one, column 0 of a row of all ``-inf``. Outputs and scratch are
fresh ``torch.empty`` tensors (CUDA-graph capturable); nothing is read back
to the host. The launcher runs the kernels on whatever device ``x`` is on (a
CPU tensor only under ``TRITON_INTERPRET=1``, as the CPU tests run them);
choosing torch's argmax for CPU tensors is the caller's job
(``kvserve/sampling/sampler.py`` does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# columns a pass-1 program reduces: 63 programs for one 128,256-column row
CHUNK = 2048
MIN_CHUNK, MAX_CHUNK = 16, 1 << 16
# a row's chunk maxima must fit pass 2's one tile
MAX_CHUNKS = 4096
INT32_MAX = tl.constexpr(2**31 - 1)
INT64_MIN = tl.constexpr(-(2**63))


@triton.jit
def _packed_key(x, cols):
    """int64 ``key << 32 | (col ^ INT32_MAX)`` of float32 ``x`` at ``cols``: larger
    for the larger value in torch.argmax's order, then for the lower column
    (``col ^ INT32_MAX`` is ``INT32_MAX - col`` for ``0 <= col <= INT32_MAX``)."""
    bits = x.to(tl.int32, bitcast=True)
    # negative floats: flip the magnitude bits, so the int order is the float order
    key = bits ^ ((bits >> 31) & INT32_MAX)
    key = tl.where(x == 0.0, 0, key)  # -0.0 ties with +0.0
    key = tl.where(x != x, INT32_MAX, key)  # NaN above +inf
    return (key.to(tl.int64) << 32) | (cols ^ INT32_MAX).to(tl.int64)


@triton.jit
def argmax_chunks_kernel(
    x_ptr,  # [R, num_cols], row stride stride_x_row, unit last stride
    chunk_max_ptr,  # [R, num_chunks] int64 contiguous: packed maxima
    num_cols,
    num_chunks,
    stride_x_row,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    # padding is -inf at columns past the row's: it loses every tie to a real column
    x = tl.load(x_ptr + row * stride_x_row + cols, mask=cols < num_cols, other=float("-inf"))
    best = tl.max(_packed_key(x.to(tl.float32), cols), axis=0)
    tl.store(chunk_max_ptr + row * num_chunks + chunk, best)


@triton.jit
def argmax_reduce_kernel(
    chunk_max_ptr,  # [R, num_chunks] int64 contiguous: packed maxima
    out_ptr,  # [R] int64
    num_chunks,
    BLOCK: tl.constexpr,  # >= num_chunks
):
    row = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, BLOCK)
    packed = tl.load(chunk_max_ptr + row * num_chunks + slots, mask=slots < num_chunks,
                     other=INT64_MIN)
    best = tl.max(packed, axis=0)
    tl.store(out_ptr + row, (best & INT32_MAX) ^ INT32_MAX)


def _check(x: torch.Tensor, chunk: int) -> None:
    if x.dim() != 2:
        raise ValueError(f"x: shape {tuple(x.shape)}; expected a 2-D [R, V] tensor")
    if x.dtype not in DTYPES:
        raise ValueError(f"x: dtype {x.dtype}; expected one of {DTYPES}")
    if x.shape[1] == 0:
        raise ValueError(f"x: shape {tuple(x.shape)}; V (the last dim) must be at least 1")
    if x.stride(1) != 1:
        raise ValueError(f"x: last-dimension stride {x.stride(1)}; must be 1")
    if chunk < MIN_CHUNK or chunk > MAX_CHUNK or chunk & (chunk - 1):
        raise ValueError(
            f"chunk={chunk}; must be a power of two from {MIN_CHUNK} to {MAX_CHUNK}"
        )
    if triton.cdiv(x.shape[1], chunk) > MAX_CHUNKS:
        raise ValueError(
            f"x: V={x.shape[1]} columns; at most {MAX_CHUNKS * chunk} with chunk={chunk}"
        )


def argmax_rows(
    x: torch.Tensor,  # [R, V], unit last stride
    chunk: int = CHUNK,
) -> torch.Tensor:  # [R] int64
    """``torch.argmax(x, dim=-1)``, ties and NaN included, in two Triton passes;
    ``chunk`` (columns per pass-1 program) is for benchmarks to sweep."""
    _check(x, chunk)
    num_rows, num_cols = x.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=x.device)
    if num_rows == 0:
        return out
    num_chunks = triton.cdiv(num_cols, chunk)
    chunk_max = torch.empty(num_rows, num_chunks, dtype=torch.int64, device=x.device)
    argmax_chunks_kernel[(num_rows, num_chunks)](
        x, chunk_max, num_cols, num_chunks, x.stride(0),
        CHUNK=chunk,
        num_warps=min(max(chunk // 512, 1), 8),
    )
    block = triton.next_power_of_2(num_chunks)
    argmax_reduce_kernel[(num_rows,)](
        chunk_max, out, num_chunks,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 4),
    )
    return out
