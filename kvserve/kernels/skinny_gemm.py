"""The skinny GEMM ``skinny_matmul``: ``x[M, K] @ W[N, K].T (+ bias)`` for a
few rows (``1 <= M <= SKINNY_MAX_M``), the weight GEMMs of a small decode
step, whose whole cost is reading ``W`` once from HBM.

Grid ``(cdiv(N, BLOCK_N),)``: a program owns ``BLOCK_N`` output columns
(rows of ``W``) for all ``M`` rows of ``x`` and walks the whole of ``K`` in
``BLOCK_K`` chunks, so each weight byte is read once, by one program, and
each output written once, in ONE launch: no split-K partials, no zero-init
or reduce kernel, nothing read back to the host, the output a fresh
``torch.empty`` (CUDA-graph capturable). Instead of splitting K, ``BLOCK_N``
is small enough for several programs per SM (one row: 4 or 8, so N = 4096
gives 1,024 or 512 programs on 132 SMs), all resident at once, so every SM
keeps several weight tiles in flight. The K loop is a ``tl.range(...,
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

With programmatic dependent launch (``kernels/pdl.py``, Hopper) a program
loads its first ``PRELOAD_TILES`` weight tiles, waits for the kernel that
writes ``x``, and lets the next kernel start once its K loop is done: the
weight stream starts while the kernel before it finishes. (Two tiles beat
one and three; letting the next kernel start at once, or asking L2 for a
whole weight before the wait, measured slower in W1 on an H100; decision
0015.)

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
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvserve.kernels.pdl import use_pdl

DTYPES = (torch.bfloat16, torch.float16)
SKINNY_MAX_M = 16
# The layers send inputs of up to 16 rows here (decode and verify steps of
# small batches): on an H100 a batch-1 verify step of 5 rows took 6.15 ms
# against 6.29 with cuBLAS, and plain decode at batch 2-16 1-4% less time a
# step. A gated input (the down projection's SiLU-and-mul fused into its
# loads) only at one row: at 5 rows that path took 156 us on Llama-3-8B's
# down projection, against 47 for cuBLAS after the SiLU kernel (decision 0043).
LAYER_MAX_M = SKINNY_MAX_M
GATED_MAX_M = 1
DOT_BLOCK_M = 16  # tl.dot's smallest tile side
# shapes that take thinner programs at one row (Llama-3-8B's qkv, o_proj, gate_up;
# not its down projection, K = 14,336, nor its LM head, N = 128,256)
THIN_MAX_K = 8192
THIN_MAX_N = 32768
PRELOAD_TILES = 2  # weight tiles a program loads before its PDL wait (1 or 2)


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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no mask on any load
    HAS_BIAS: tl.constexpr,
    USE_DOT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    GATED: tl.constexpr,  # x = silu(gate) * up, computed from gate_up as it is loaded
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (kernels/pdl.py)
    PRELOAD: tl.constexpr,  # with PDL: weight tiles loaded before the wait (1 or 2, <= K's)
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
    first_k = 0
    if PDL:
        # W is constant: its first PRELOAD tiles load before the wait for the
        # kernel that writes x, so they stream during that kernel's tail
        w = _weight_tile(w_ptrs, ks, 0, K, EVEN_K)
        if PRELOAD == 2:
            w_second = _weight_tile(w_ptrs, ks, BLOCK_K, K, EVEN_K)
        gdc_wait()
        acc = _accumulate(acc, w, x_ptrs, x_mask, ks, 0, K, EVEN_K, GATED, USE_DOT, BLOCK_M)
        if PRELOAD == 2:
            acc = _accumulate(acc, w_second, x_ptrs, x_mask, ks, BLOCK_K, K, EVEN_K, GATED,
                              USE_DOT, BLOCK_M)
        first_k = PRELOAD * BLOCK_K
    for k in tl.range(first_k, K, BLOCK_K, num_stages=NUM_STAGES):
        w = _weight_tile(w_ptrs, ks, k, K, EVEN_K)
        acc = _accumulate(acc, w, x_ptrs, x_mask, ks, k, K, EVEN_K, GATED, USE_DOT, BLOCK_M)
    if PDL:  # the next kernel may start loading its own weights
        gdc_launch_dependents()
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


@triton.jit
def _weight_tile(w_ptrs, ks, k, K, EVEN_K: tl.constexpr):
    """The ``[BLOCK_N, BLOCK_K]`` weight tile at ``k``, unmasked when ``EVEN_K``."""
    if EVEN_K:
        w = tl.load(w_ptrs + k)
    else:
        w = tl.load(w_ptrs + k, mask=(ks + k < K)[None, :], other=0.0)
    return w


@triton.jit
def _accumulate(acc, w, x_ptrs, x_mask, ks, k, K, EVEN_K: tl.constexpr, GATED: tl.constexpr,
                USE_DOT: tl.constexpr, BLOCK_M: tl.constexpr):
    """``acc`` plus the weight tile ``w`` times x's chunk at ``k`` (loaded here)."""
    k_mask = x_mask if EVEN_K else x_mask & (ks + k < K)[None, :]
    x = tl.load(x_ptrs + k, mask=k_mask, other=0.0)
    if GATED:  # kernels/activation.py's rounding: silu rounded, then the product
        up = tl.load(x_ptrs + K + k, mask=k_mask, other=0.0)
        gate = x.to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(x.dtype)
        x = (silu.to(tl.float32) * up.to(tl.float32)).to(x.dtype)
    if USE_DOT:
        acc = tl.dot(w, tl.trans(x), acc)  # swap-AB: W is the MMA's M side
    elif BLOCK_M == 1:
        acc += x.to(tl.float32) * w.to(tl.float32)  # x [1, BLOCK_K] broadcast over W's rows
    else:
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    return acc


@functools.lru_cache(maxsize=256)  # a decode step asks for the same few shapes every time
def default_config(m: int, n: int, k: int) -> SkinnyConfig:
    """The configuration ``skinny_matmul`` uses for an ``[m, k] @ [n, k].T`` product.

    One row: FMA, ``block_n`` 8, ``block_k`` 512, 4 warps, 4 stages (the sweep
    of ``benchmarks/skinny_gemm.py`` on an H200: best or within 2% of the best
    on all five Llama-3-8B shapes), except for a ``k`` up to
    ``THIN_MAX_K`` and ``n`` up to ``THIN_MAX_N`` (qkv, o_proj, gate_up):
    ``block_n`` 4, ``block_k`` 1024, 2 warps, 3 stages, twice the programs of
    half the size, 1-4% faster on those shapes on an H100 (decision 0014).
    More rows: ``tl.dot`` with ``block_n`` 16 (thin programs, so even
    ``n`` = 4,096 gives two per SM), ``block_k`` 128, two warps and a
    six-stage pipeline for an ``n`` up to ``THIN_MAX_N``; the LM head keeps
    ``block_k`` 256, one warp, 4 stages (decision 0050: on an H100 the deeper
    pipeline took 1-3% off qkv and o_proj at 2-16 rows and left the other
    shapes within 1%; split-K, wgmma's ``block_n`` 64 and per-row FMA
    accumulators found nothing faster); never wider than ``k`` needs.
    """
    if m == 1:
        if k <= THIN_MAX_K and n <= THIN_MAX_N:
            return SkinnyConfig(4, max(16, min(1024, triton.next_power_of_2(k))), 2, 3, False)
        return SkinnyConfig(8, max(16, min(512, triton.next_power_of_2(k))), 4, 4, False)
    if n <= THIN_MAX_N:
        return SkinnyConfig(16, max(16, min(128, triton.next_power_of_2(k))), 2, 6, True)
    return SkinnyConfig(16, max(16, min(256, triton.next_power_of_2(k))), 1, 4, True)


def skinny_supported(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> bool:
    """Whether the layers send ``x @ weight.T`` here (up to ``LAYER_MAX_M`` rows,
    ``GATED_MAX_M`` for a gated input of twice the columns; 16-bit, unit last
    stride, contiguous weight); ``F.linear`` serves the rest."""
    max_m = min(GATED_MAX_M, LAYER_MAX_M) if gated else LAYER_MAX_M
    return (x.dim() == 2 and 1 <= x.shape[0] <= max_m and x.stride(1) == 1
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
    m, (n, k) = x.shape[0], weight.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    if config is None:
        config = default_config(m, n, k)
    pdl = use_pdl(x.device)
    skinny_matmul_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, weight if bias is None else bias, out,
        m, n, k, x.stride(0),
        BLOCK_M=DOT_BLOCK_M if config.use_dot else triton.next_power_of_2(m),
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0,
        HAS_BIAS=bias is not None,
        USE_DOT=config.use_dot,
        NUM_STAGES=config.num_stages,
        GATED=gated,
        PDL=pdl,
        # read only with PDL; a constant otherwise, so no build per K
        PRELOAD=min(PRELOAD_TILES, triton.cdiv(k, config.block_k)) if pdl else 1,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        launch_pdl=pdl,
    )
    return out
