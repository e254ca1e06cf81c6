"""The skinny GEMM ``skinny_matmul``: ``x[M, K] @ W[N, K].T (+ bias)`` for a
few rows (``1 <= M <= SKINNY_MAX_M``), the weight GEMMs of a small decode
step, whose whole cost is reading ``W`` once from HBM.

Grid ``(cdiv(N, BLOCK_N),)``: a program owns ``BLOCK_N`` output columns
(rows of ``W``) for all ``M`` rows of ``x`` and walks the whole of ``K`` in
``BLOCK_K`` chunks, so each weight byte is read once, by one program, and
each output written once, in ONE launch: no split-K partials, no zero-init
or reduce kernel, nothing read back to the host, the output a fresh
``torch.empty`` (CUDA-graph capturable). Instead of splitting K, ``BLOCK_N``
is small enough for several programs per SM (one row: 8, so N = 4096 gives
512 programs on 132 SMs), all resident at once, so every SM keeps several
weight tiles in flight. The K loop is a ``tl.range(...,
num_stages)``: Triton software-pipelines its loads (cp.async into shared
memory) for both inner products below. Columns past ``N`` re-read the last
row of ``W`` and rows past ``M`` are masked, both dropped at the store; only
a ``K`` that ``BLOCK_K`` does not divide masks ``K``, so the weight loads
stay unmasked, 16-byte vectors.

Two inner products, chosen by ``SkinnyConfig.use_dot``:

- FMA (the default for ``M == 1``): float32 multiply-adds of each weight
  tile with ``x``'s ``BLOCK_M = next_pow2(M)`` rows into an accumulator of
  the tile's shape (``[BLOCK_N, BLOCK_K]`` at ``M == 1``, a 3-D one above),
  summed over ``BLOCK_K`` once after the loop.
- dot (the default for ``M > 1``): swap-AB ``acc[BLOCK_N, 16] += W_tile @
  x_tile.T`` with ``tl.dot``, ``M`` padded to 16 (its minimum): ``W`` is the
  MMA's M side, so ``BLOCK_N`` 16 or 32 gives mma.sync tiles and 64 with 4
  warps wgmma.

With ``GATED`` the input is ``silu(gate) * up`` of a ``[M, 2K]`` gate-and-up
product, computed in registers as each chunk is loaded (the down projection
of an MLP without the separate SiLU-and-mul kernel).

With ``NORMED`` (one row, FMA; ``skinny_norm_matmul``) the input is the
RMSNorm of ``h = x + residual`` (or of ``x``): the residual add and RMSNorm
before a projection, fused in as a prologue. Every program needs the whole
normalised row, so every program recomputes it, reading ``x`` and
``residual`` (16 KB at hidden 4096) three times, from L2 or L1 after the
first program, beside the 64 KB of weights (8 rows of 4096) it streams
from HBM: a first pass over K finds the largest ``h²`` (and program 0
writes ``h``, the next residual, into a new tensor; ``x`` and ``residual``
are never written, the other programs still read them), a second sums the
squares exactly with the shared code of ``kernels/rms_norm.py`` (exact, so
its chunked order gives ``add_rms_norm``'s bits), and the K loop normalises
each chunk of ``h`` as it loads it, with ``add_rms_norm``'s roundings: the
product equals that kernel followed by this one, bit for bit. The norm's
arguments come last and every ``NORMED`` line is behind the constexpr, so
the other forms compile to the code they had before.

Rounding is cuBLAS's: products and sums in float32, the bias added in
float32, one rounding to the output dtype. ``default_config(m, n, k)`` is a
fixed heuristic (no autotuning, which would time candidates at start-up and
could pick differently from run to run); ``benchmarks/skinny_gemm.py``
sweeps alternatives through ``skinny_matmul(..., config=)``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve.kernels.rms_norm import MAX_HIDDEN, inv_rms, quantize_squares, square_scale

DTYPES = (torch.bfloat16, torch.float16)
SKINNY_MAX_M = 16
# The layers send only one-row inputs (a batch-1 decode step) here: on an H200
# the one-row config below beats cuBLAS by 5-27% on Llama-3-8B's qkv, o_proj
# and down projections and ties on gate_up and the LM head, while the 2-16 row
# defaults lost to cuBLAS (benchmarks/skinny_gemm.py, docs/benchmarks.md).
LAYER_MAX_M = 1
DOT_BLOCK_M = 16  # tl.dot's smallest tile side
PROGRAMS_PER_SM = 4  # as many as fit an SM at once (FMA default: 4 x 128 threads x ~120 regs)
DEFAULT_NUM_SMS = 132
DOT_TILE_ELEMENTS = 4096  # BLOCK_N * BLOCK_K: an 8 KB 16-bit weight tile a stage


@dataclass(frozen=True)
class SkinnyConfig:
    """Tile sizes and launch parameters of one ``skinny_matmul`` call."""

    block_n: int  # output columns (rows of W) a program owns
    block_k: int  # K chunk a loop iteration loads
    num_warps: int
    num_stages: int  # software-pipeline depth of the K loop (1: none)
    use_dot: bool  # tl.dot with M padded to 16, else float32 FMAs

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name}={value}; must be a power of two")
        if self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages}; must be >= 1")
        if self.use_dot and min(self.block_n, self.block_k) < 16:
            raise ValueError(
                f"block_n={self.block_n}, block_k={self.block_k}; use_dot needs both >= 16"
            )


@triton.jit
def summed_chunk(x_ptr, residual_ptr, offs, K, EVEN_K: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr):
    """``x + residual`` (or ``x``) of one row at columns ``offs``, rounded as
    ``add_rms_norm`` rounds it: added in float32, rounded once."""
    if EVEN_K:
        h = tl.load(x_ptr + offs)
        if HAS_RESIDUAL:
            residual = tl.load(residual_ptr + offs)
    else:
        h = tl.load(x_ptr + offs, mask=offs < K, other=0.0)
        if HAS_RESIDUAL:
            residual = tl.load(residual_ptr + offs, mask=offs < K, other=0.0)
    if HAS_RESIDUAL:
        h = (h.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return h


@triton.jit
def row_inv_rms(x_ptr, residual_ptr, summed_ptr, eps, K, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """The norm prologue: ``1 / rms(h)`` of the one row, ``h`` written to
    ``summed_ptr`` by program 0; ``add_rms_norm``'s exact sum of squares."""
    offs = tl.arange(0, BLOCK_K)[None, :]
    max_sq = tl.zeros((1, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        h = summed_chunk(x_ptr, residual_ptr, k + offs, K, EVEN_K, HAS_RESIDUAL)
        if HAS_RESIDUAL and tl.program_id(0) == 0:
            tl.store(summed_ptr + k + offs, h, mask=k + offs < K)
        h32 = h.to(tl.float32)
        max_sq = tl.maximum(max_sq, h32 * h32)
    scale, inv_scale = square_scale(tl.max(max_sq))
    total = tl.zeros((1, BLOCK_K), dtype=tl.int64)
    for k in range(0, K, BLOCK_K):
        h32 = summed_chunk(x_ptr, residual_ptr, k + offs, K, EVEN_K, HAS_RESIDUAL).to(tl.float32)
        total += quantize_squares(h32 * h32, scale)
    return inv_rms(tl.sum(total), inv_scale, K * 1.0, eps)


@triton.jit
def normed_chunk(x_ptr, residual_ptr, norm_weight_ptr, offs, K, rstd, EVEN_K: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr):
    """``norm_weight * (h * rstd)`` at columns ``offs``, ``add_rms_norm``'s output."""
    h = summed_chunk(x_ptr, residual_ptr, offs, K, EVEN_K, HAS_RESIDUAL)
    if EVEN_K:
        norm_weight = tl.load(norm_weight_ptr + offs)
    else:
        norm_weight = tl.load(norm_weight_ptr + offs, mask=offs < K, other=0.0)
    normed = (h.to(tl.float32) * rstd).to(x_ptr.dtype.element_ty)
    return (norm_weight.to(tl.float32) * normed.to(tl.float32)).to(x_ptr.dtype.element_ty)


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every row count of a BLOCK_M
def skinny_matmul_kernel(
    x_ptr,  # [M, K] ([M, 2K] gate | up when GATED), row stride stride_xm, unit last stride
    w_ptr,  # [N, K] contiguous
    bias_ptr,  # [N], read only when HAS_BIAS
    out_ptr,  # [M, N] contiguous
    M,
    N,
    K,
    stride_xm,
    # last, so the plain kernel's parameters keep their offsets (and its code)
    residual_ptr,  # [1, K] unit stride, read only when NORMED and HAS_RESIDUAL
    norm_weight_ptr,  # [K] contiguous, read only when NORMED
    summed_ptr,  # [1, K] contiguous, x + residual, written only when NORMED and HAS_RESIDUAL
    eps,  # the norm's, read only when NORMED
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no mask on any load
    HAS_BIAS: tl.constexpr,
    USE_DOT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    GATED: tl.constexpr,  # x = silu(gate) * up, computed from gate_up as it is loaded
    NORMED: tl.constexpr,  # x = rmsnorm(x + residual) of one row, computed as it is loaded
    HAS_RESIDUAL: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns = rows of W
    rows = tl.arange(0, BLOCK_M)  # rows of x and of the output
    ks = tl.arange(0, BLOCK_K)
    # columns past N re-read row N - 1 of W (no mask, so loads stay vectorised);
    # rows past M are masked (no traffic); the store drops both
    w_ptrs = w_ptr + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * K + ks[None, :]
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]  # [BLOCK_M, BLOCK_K]
    x_mask = (rows < M)[:, None]
    if USE_DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    elif BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    if NORMED:
        tl.static_assert(BLOCK_M == 1 and not USE_DOT and not GATED)
        rstd = row_inv_rms(x_ptr, residual_ptr, summed_ptr, eps, K, BLOCK_K, EVEN_K, HAS_RESIDUAL)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            w = tl.load(w_ptrs + k)
            chunk_mask = x_mask
        else:
            k_mask = (ks + k < K)[None, :]
            w = tl.load(w_ptrs + k, mask=k_mask, other=0.0)
            chunk_mask = x_mask & k_mask
        if NORMED:
            x = normed_chunk(x_ptr, residual_ptr, norm_weight_ptr, k + ks[None, :], K, rstd,
                             EVEN_K, HAS_RESIDUAL)
        else:
            x = tl.load(x_ptrs + k, mask=chunk_mask, other=0.0)
        if GATED:
            up = tl.load(x_ptrs + K + k, mask=chunk_mask, other=0.0)
        if GATED:  # kernels/activation.py's rounding: silu rounded, then the product
            gate = x.to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty)
            x = (silu.to(tl.float32) * up.to(tl.float32)).to(x_ptr.dtype.element_ty)
        if USE_DOT:
            acc = tl.dot(w, tl.trans(x), acc)  # swap-AB: W is the MMA's M side
        elif BLOCK_M == 1:
            acc += x.to(tl.float32) * w.to(tl.float32)  # x [1, BLOCK_K] broadcast over W's rows
        else:
            acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    if USE_DOT:
        out = tl.trans(acc)
    elif BLOCK_M == 1:
        out = tl.sum(acc, axis=1)[None, :]
    else:
        out = tl.sum(acc, axis=2)
    # out: [BLOCK_M, BLOCK_N] float32
    if HAS_BIAS:
        bias = tl.load(bias_ptr + tl.minimum(cols, N - 1))
        out += bias.to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows[:, None] * N + cols[None, :]
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


@functools.lru_cache(maxsize=256)  # a decode step asks for the same few shapes every time
def default_config(m: int, n: int, k: int, num_sms: int = DEFAULT_NUM_SMS) -> SkinnyConfig:
    """The configuration ``skinny_matmul`` uses for an ``[m, k] @ [n, k].T`` product.

    One row: FMA, ``block_n`` 8, ``block_k`` 512, 4 warps, 4 stages (the sweep
    of ``benchmarks/skinny_gemm.py`` on an H200: best or within 2% of the best
    on all five Llama-3-8B shapes). More rows: ``tl.dot`` with ``block_n`` the
    largest of 64, 32, 16 that still gives ``PROGRAMS_PER_SM * num_sms``
    programs (small ``n`` gets more, thinner programs instead of a split-K),
    ``block_k`` a tile of ``DOT_TILE_ELEMENTS`` weights, a warp per 16 rows of
    W so no warp repeats another's MMA, 4 stages; never wider than ``k`` needs.
    """
    if m == 1:
        return SkinnyConfig(8, max(16, min(512, triton.next_power_of_2(k))), 4, 4, False)
    block_n = 64
    while block_n > 16 and triton.cdiv(n, block_n) < PROGRAMS_PER_SM * num_sms:
        block_n //= 2
    block_k = max(16, min(DOT_TILE_ELEMENTS // block_n, triton.next_power_of_2(k)))
    return SkinnyConfig(block_n, block_k, block_n // 16, 4, True)


def skinny_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the layers send ``x @ weight.T`` here (up to ``LAYER_MAX_M`` rows,
    16-bit, unit last stride, contiguous weight; ``x`` may be a gated input of
    twice the columns); ``F.linear`` serves the rest."""
    return (x.dim() == 2 and 1 <= x.shape[0] <= LAYER_MAX_M and x.stride(1) == 1
            and x.dtype in DTYPES and weight.dtype == x.dtype and weight.is_contiguous())


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool) -> None:
    if weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"weight: shape {tuple(weight.shape)}, strides {weight.stride()}; "
                         "expected a contiguous [N, K] tensor")
    if weight.dtype not in DTYPES:
        raise ValueError(f"weight: dtype {weight.dtype}; allowed: {DTYPES}")
    if x.dim() != 2 or not 1 <= x.shape[0] <= SKINNY_MAX_M:
        raise ValueError(f"x: shape {tuple(x.shape)}; expected [M, K] with "
                         f"1 <= M <= SKINNY_MAX_M={SKINNY_MAX_M}")
    x_cols = (2 if gated else 1) * weight.shape[1]
    if x.shape[1] != x_cols:
        raise ValueError(f"x: shape {tuple(x.shape)}; expected {x_cols} columns "
                         f"({'2K, gate and up, ' if gated else ''}the weight's [N, K] = "
                         f"{list(weight.shape)})")
    if x.stride(1) != 1:
        raise ValueError(f"x: last-dimension stride {x.stride(1)}; must be 1")
    tensors = [("x", x)] if bias is None else [("x", x), ("bias", bias)]
    for name, tensor in tensors:
        if tensor.dtype != weight.dtype or tensor.device != weight.device:
            raise ValueError(f"{name}: {tensor.dtype} on {tensor.device}; expected "
                             f"{weight.dtype} on {weight.device} (the weight's)")
    if bias is not None and (bias.shape != weight.shape[:1] or not bias.is_contiguous()):
        raise ValueError(f"bias: shape {tuple(bias.shape)}, strides {bias.stride()}; "
                         f"expected a contiguous [N={weight.shape[0]}] tensor")


def _launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    config: SkinnyConfig | None, gated: bool = False, residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None, eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    m, (n, k) = x.shape[0], weight.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    summed = None if residual is None else torch.empty((m, k), dtype=x.dtype, device=x.device)
    if n == 0:
        return out, summed
    if config is None:
        config = default_config(m, n, k, _num_sms(x.device))
    skinny_matmul_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, weight if bias is None else bias, out,
        m, n, k, x.stride(0),
        x if residual is None else residual, weight if norm_weight is None else norm_weight,
        out if summed is None else summed, eps,
        BLOCK_M=DOT_BLOCK_M if config.use_dot else triton.next_power_of_2(m),
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0,
        HAS_BIAS=bias is not None,
        USE_DOT=config.use_dot,
        NUM_STAGES=config.num_stages,
        GATED=gated,
        NORMED=norm_weight is not None,
        HAS_RESIDUAL=residual is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out, summed


def skinny_matmul(
    x: torch.Tensor,  # [M, K] ([M, 2K] when gated), 1 <= M <= SKINNY_MAX_M, unit last stride
    weight: torch.Tensor,  # [N, K] contiguous, x's dtype
    bias: torch.Tensor | None = None,  # [N] contiguous, x's dtype
    config: SkinnyConfig | None = None,  # default_config(M, N, K) when None
    gated: bool = False,
) -> torch.Tensor:  # [M, N] contiguous, x's dtype
    """``x @ weight.T + bias`` (``F.linear``) in one launch, into a new tensor.

    With ``gated``, ``x`` is a gate-and-up product ``[M, 2K]`` and the GEMM's
    input is ``silu(x[:, :K]) * x[:, K:]``, computed as it is loaded with the
    rounding of ``kernels/activation.py`` (so equal to running that kernel
    first), one launch instead of two.
    """
    _check(x, weight, bias, gated)
    out, _ = _launch(x, weight, bias, config, gated)
    return out


def skinny_norm_supported(x: torch.Tensor, residual: torch.Tensor | None,
                          norm_weight: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the layers send ``rmsnorm(x (+ residual)) @ weight.T`` here: what
    ``skinny_supported`` takes, one row, and a norm of ``x``'s size and dtype."""
    k = weight.shape[-1]
    return (skinny_supported(x, weight) and x.shape == (1, k) and weight.shape[0] >= 1
            and k <= MAX_HIDDEN and norm_weight.shape == (k,) and norm_weight.is_contiguous()
            and norm_weight.dtype == x.dtype
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                      and residual.stride(1) == 1)))


def _check_normed(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                  weight: torch.Tensor, config: SkinnyConfig | None) -> None:
    if x.shape[0] != 1:
        raise ValueError(f"x: shape {tuple(x.shape)}; the norm prologue takes one row")
    if weight.shape[0] == 0:
        raise ValueError("weight: no rows; program 0 writes the residual, so N must be >= 1")
    k = weight.shape[1]
    if k > MAX_HIDDEN:
        raise ValueError(f"weight: K={k} columns; the norm takes at most MAX_HIDDEN={MAX_HIDDEN}")
    if norm_weight.shape != (k,) or not norm_weight.is_contiguous():
        raise ValueError(f"norm_weight: shape {tuple(norm_weight.shape)}, strides "
                         f"{norm_weight.stride()}; expected a contiguous [K={k}] tensor")
    tensors = [("norm_weight", norm_weight)]
    if residual is not None:
        if residual.shape != x.shape or residual.stride(1) != 1:
            raise ValueError(f"residual: shape {tuple(residual.shape)}, strides "
                             f"{residual.stride()}; expected x's shape {tuple(x.shape)} "
                             "and a unit last stride")
        tensors.append(("residual", residual))
    for name, tensor in tensors:
        if tensor.dtype != x.dtype or tensor.device != x.device:
            raise ValueError(f"{name}: {tensor.dtype} on {tensor.device}; expected "
                             f"{x.dtype} on {x.device} (x's)")
    if config is not None and config.use_dot:
        raise ValueError("config: use_dot; the norm prologue runs with FMA only")


def skinny_norm_matmul(
    x: torch.Tensor,  # [1, K], unit last stride
    residual: torch.Tensor | None,  # [1, K], x's dtype, unit last stride
    norm_weight: torch.Tensor,  # [K] contiguous, x's dtype
    eps: float,
    weight: torch.Tensor,  # [N, K] contiguous, x's dtype, N >= 1
    bias: torch.Tensor | None = None,  # [N] contiguous, x's dtype
    config: SkinnyConfig | None = None,  # default_config(1, N, K) when None; FMA only
) -> tuple[torch.Tensor, torch.Tensor | None]:  # out [1, N], summed [1, K] (None without residual)
    """``normed, summed = add_rms_norm(x, residual, norm_weight, eps)`` (or
    ``normed = rms_norm(x, norm_weight, eps)`` without ``residual``), then
    ``skinny_matmul(normed, weight, bias)``, in one launch: the same bits, both
    outputs new tensors, ``x`` and ``residual`` untouched.
    """
    _check(x, weight, bias, gated=False)
    _check_normed(x, residual, norm_weight, weight, config)
    return _launch(x, weight, bias, config, residual=residual, norm_weight=norm_weight, eps=eps)
