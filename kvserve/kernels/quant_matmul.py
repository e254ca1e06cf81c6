"""Weight-only quantised GEMMs: ``quant_matmul(x, qweight, scales, zeros, bits,
group_size)`` is ``x[M, K] @ W'[N, K].T (+ bias)`` with ``W'`` the INT8 / INT4
weight of ``quant/packing.py`` dequantised on the fly, in x's dtype (bf16 or
fp16). Kernels and launchers only: the layers choose when to call it; this
module imports nothing but torch and Triton (and its sibling kernels).

Kernel layout (``repack_for_kernels``, applied once at load to the tensors of
``quant/packing.py``):

- ``qweight`` uint8 ``[N, K * bits / 8]``, the output dim first, as packed. INT8
  is unchanged. INT4 keeps two values a byte but orders them within each 32
  input columns (16 bytes): byte ``j`` holds column ``j`` in its low nibble and
  column ``16 + j`` in its high one (packing.py: columns ``2j`` / ``2j + 1``).
  So the low (high) nibbles of a 16-byte load are 16 consecutive columns, and
  the activations they multiply are two 16-element runs (16-byte loads, and
  ``tl.dot`` operands straight from shared memory) rather than every other
  column. K must be a multiple of 32 (INT8: 16).
- ``scales`` / ``zeros`` transposed to ``[K / group_size, N]`` (group-major,
  contiguous): a program's rows of one group are contiguous, and the shape
  tells a transposed tensor from packing.py's ``[N, K / group_size]``.
  Zeros stay optional (None: symmetric, zero point ``2**(bits - 1)``).
  ``group_size`` is K (one group per output row) or a power of two (>= 32,
  INT8 >= 16) dividing K. Act-order's ``perm`` is the layer's: it permutes x.

Paths, chosen by the row count M (``quant_matmul``; module constants, no
autotuning):

- **FMA** (M == 1, a batch-1 decode step; ``quant_fma_kernel``): modelled on
  ``skinny_gemm.py``. Grid ``cdiv(N, BLOCK_N)``; a program owns BLOCK_N rows
  of W and walks all of K once in BLOCK_K chunks, tiles ``[BLOCK_N, slots,
  16 bytes]`` (a slot: one 16-byte vector, 32 INT4 or 16 INT8 values, always
  inside one group) software-pipelined through shared memory. It dequantises
  in registers, sums each slot's products in float32, scales the slot sum by
  its group's scale once, and writes each output once: no split-K, nothing
  read back, a fresh ``torch.empty`` output (CUDA-graph capturable).
- **Dot** (M >= 2; ``quant_dot_kernel``): swap-AB ``acc[BLOCK_N, BLOCK_M] +=
  W'_tile @ x_tile.T`` with ``tl.dot``, W' dequantised in registers (on sm_90
  Triton feeds it to wgmma as the register operand; x comes from shared
  memory), a 2-D grid in grouped order (GROUP_M m-tiles side by side, for L2
  reuse). Decode batches (M <= SKINNY_MAX_M) pad M to one 16-row tile
  (``default_config``'s skinny tiles, programmatic dependent launch); larger
  M takes the tile configs.
- **Dequant + cuBLAS** (M >= DEQUANT_MIN_M; ``quant_dequant_kernel``):
  writes the 16-bit ``[N, K]`` weight into a fresh buffer (N * K * 2 bytes
  for the call) and runs ``F.linear``, where a compute-bound prefill wants
  cuBLAS's tiles.

``gated`` (the MLP's down projection): x is ``[M, 2K]`` gate | up and the
GEMM's input ``silu(gate) * up``, with ``kernels/activation.py``'s rounding.
The FMA and dot kernels compute it as they load x (no SiLU-and-mul launch);
the dequant path runs ``silu_and_mul`` first. Programmatic dependent launch
(``kernels/pdl.py``, Hopper): the FMA and skinny dot kernels load their first
``PRELOAD_TILES`` weight tiles (and their scales) before ``gdc_wait`` and let
the next kernel start after their K loop, as the bf16 skinny GEMM does.

Arithmetic. A code ``q`` becomes a float with integer ops only (no int ->
float conversion instruction): INT8 as the bits of ``2**23 + q`` (then
``- (2**23 + z)``, exact); INT4 as ``0.5 + q / 256`` (exact; one PRMT per
value on CUDA, inline PTX, with the same bits computed by plain integer ops
under the interpreter). Per slot the FMA path sums ``v * x`` and subtracts
``(0.5 + z / 256) * sum(x)`` (INT4) or sums ``(q - z) * x`` (INT8) in float32,
then multiplies by ``scale`` (x256 for INT4), so each weight costs a couple of
integer ops and one float FMA; the INT4 form cancels a few bits within a
32-term slot sum (relative error ~1e-6, far below bf16's 4e-3). Everything
then accumulates in float32, the bias is added in float32, and the output is
rounded once. The dot and dequant paths round the weight to x's dtype before
the product: ``(q - z) * scale`` is exact in float32 and rounded once (per
group), or ``q - z`` exactly with the per-row scale applied to the float32
accumulator (one group per row). References: ``quant/packing.py``'s
``quantized_linear_reference`` and ``dequantize``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvserve.kernels.activation import silu_and_mul
from kvserve.kernels.pdl import use_pdl

DTYPES = (torch.bfloat16, torch.float16)
QUANT_BITS = (4, 8)
SLOT_BYTES = 16  # one 16-byte vector of packed codes
SKINNY_MAX_M = 16  # up to this many rows: FMA (one row) or the 16-row dot tile
DEQUANT_MIN_M = 4096  # from this many rows: dequantise, then cuBLAS (to tune on the GPU)
DOT_BLOCK_M = 16  # tl.dot's smallest tile side: the skinny dot tile's rows
PROGRAMS_PER_SM = 4  # skinny dot: thinner programs until this many per SM
DEFAULT_NUM_SMS = 132
PRELOAD_TILES = 2  # weight tiles a decode program loads before its PDL wait (1 or 2)
INT4_VALUE_SCALE = 256.0  # INT4 codes are decoded as 0.5 + q / 256


@dataclass(frozen=True)
class FmaConfig:
    """Tiles of the one-row FMA path (``block_k`` in input columns)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        _check_powers_of_two(self, ("block_n", "block_k", "num_warps"))
        if self.block_k < 32 or self.num_stages < 1:
            raise ValueError(f"block_k={self.block_k}, num_stages={self.num_stages}; "
                             "need block_k >= 32 and num_stages >= 1")


@dataclass(frozen=True)
class DotConfig:
    """Tiles of the dot path: ``block_m`` rows of x, ``block_n`` of W, ``block_k`` columns."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8  # m-tiles side by side in the program order (L2 reuse of W)

    def __post_init__(self) -> None:
        _check_powers_of_two(self, ("block_m", "block_n", "block_k", "num_warps"))
        if min(self.block_m, self.block_n) < 16 or self.block_k < 32:
            raise ValueError(f"block_m={self.block_m}, block_n={self.block_n}, "
                             f"block_k={self.block_k}; need block_m, block_n >= 16 "
                             "and block_k >= 32")
        if self.num_stages < 1 or self.group_m < 1:
            raise ValueError(f"num_stages={self.num_stages}, group_m={self.group_m}; "
                             "both must be >= 1")


@dataclass(frozen=True)
class DequantConfig:
    """Tiles of the dequantise kernel (then ``F.linear``)."""

    block_n: int
    block_k: int
    num_warps: int

    def __post_init__(self) -> None:
        _check_powers_of_two(self, ("block_n", "block_k", "num_warps"))
        if self.block_k < 32:
            raise ValueError(f"block_k={self.block_k}; must be >= 32")


QuantGemmConfig = FmaConfig | DotConfig | DequantConfig


def _check_powers_of_two(config: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(config, name)
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name}={value}; must be a power of two")


# ---------------------------------------------------------------- jit helpers


@triton.jit
def _int4_values(w, HIGH: tl.constexpr, ASM: tl.constexpr):
    """uint8 codes -> float32 ``0.5 + q / 256`` of their low (or ``HIGH``) nibbles, exactly."""
    if ASM:  # per 4 bytes: one mask (and shift), then one byte permute per value
        if HIGH:
            bits = tl.inline_asm_elementwise(
                "{ .reg .b32 m, t; mov.b32 m, 0x3F000000; shr.b32 t, $4, 4;"
                " and.b32 t, t, 0x0F0F0F0F; prmt.b32 $0, t, m, 0x7054; prmt.b32 $1, t, m, 0x7154;"
                " prmt.b32 $2, t, m, 0x7254; prmt.b32 $3, t, m, 0x7354; }",
                "=r,=r,=r,=r,r", [w], dtype=tl.int32, is_pure=True, pack=4)
        else:
            bits = tl.inline_asm_elementwise(
                "{ .reg .b32 m, t; mov.b32 m, 0x3F000000;"
                " and.b32 t, $4, 0x0F0F0F0F; prmt.b32 $0, t, m, 0x7054; prmt.b32 $1, t, m, 0x7154;"
                " prmt.b32 $2, t, m, 0x7254; prmt.b32 $3, t, m, 0x7354; }",
                "=r,=r,=r,=r,r", [w], dtype=tl.int32, is_pure=True, pack=4)
    else:
        q = w.to(tl.int32)
        q = (q >> 4) if HIGH else (q & 0xF)
        bits = (q << 16) | 0x3F000000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _int8_values(w, ASM: tl.constexpr):
    """uint8 codes -> float32 ``2**23 + q``, exactly."""
    if ASM:
        bits = tl.inline_asm_elementwise(
            "{ .reg .b32 m; mov.b32 m, 0x4B000000;"
            " prmt.b32 $0, $4, m, 0x7540; prmt.b32 $1, $4, m, 0x7541;"
            " prmt.b32 $2, $4, m, 0x7542; prmt.b32 $3, $4, m, 0x7543; }",
            "=r,=r,=r,=r,r", [w], dtype=tl.int32, is_pure=True, pack=4)
    else:
        bits = w.to(tl.int32) | 0x4B000000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _masked_load(ptrs, mask):
    """``ptrs`` loaded, zero where ``mask`` is false (no mask: ``mask`` None)."""
    if mask is None:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask, other=0)


@triton.jit
def _group_params(s_ptr, z_ptr, offsets, mask, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """``(scale, offset)`` in float32 at ``offsets`` of the ``[groups, N]`` scales /
    zeros: INT4 ``(256 * s, 0.5 + z / 256)``, INT8 ``(s, 2**23 + z)`` (the
    offset the decoded values subtract; symmetric: the midpoint's)."""
    s = _masked_load(s_ptr + offsets, mask).to(tl.float32)
    if HAS_ZEROS:
        z = _masked_load(z_ptr + offsets, mask).to(tl.float32)
    else:
        z = tl.full(s.shape, 2 ** (BITS - 1), tl.float32)
    if BITS == 4:
        return s * INT4_VALUE_SCALE, 0.5 + z * (1.0 / INT4_VALUE_SCALE)
    return s, z + 8388608.0


@triton.jit
def _load_input(ptrs, mask, K, GATED: tl.constexpr):
    """x at ``ptrs``; with ``GATED``, ``silu(gate) * up`` of the gate at ``ptrs``
    and the up K columns on, rounded as ``kernels/activation.py`` rounds."""
    x = _masked_load(ptrs, mask)
    if GATED:
        up = _masked_load(ptrs + K, mask)
        gate = x.to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(x.dtype)
        x = (silu.to(tl.float32) * up.to(tl.float32)).to(x.dtype)
    return x


# ------------------------------------------------------------ one row: FMA


@triton.jit
def _fma_weights(w_ptrs, s_ptr, z_ptr, rows, slot, k, N, K, BITS: tl.constexpr,
                 GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_ZEROS: tl.constexpr,
                 EVEN_K: tl.constexpr):
    """The packed ``[BLOCK_N, SLOTS, 16]`` tile at column ``k`` and, per group,
    its ``[BLOCK_N, SLOTS]`` scale and offset (per channel: dummies)."""
    VALS: tl.constexpr = 8 * SLOT_BYTES // BITS
    slot_ok = k + slot * VALS < K
    w = _masked_load(w_ptrs + k * BITS // 8, None if EVEN_K else slot_ok[None, :, None])
    if PER_CHANNEL:
        s = tl.zeros((1, 1), dtype=tl.float32)
        c = s
    else:
        offsets = ((k + slot * VALS) // GROUP)[None, :] * N + rows[:, None]
        s, c = _group_params(s_ptr, z_ptr, offsets, None if EVEN_K else slot_ok[None, :],
                             BITS, HAS_ZEROS)
    return w, s, c


@triton.jit
def _fma_accumulate(acc, w, s, c, x_ptrs, slot, k, K, BITS: tl.constexpr,
                    PER_CHANNEL: tl.constexpr, GATED: tl.constexpr, EVEN_K: tl.constexpr,
                    ASM: tl.constexpr):
    """``acc[BLOCK_N, SLOTS]`` plus each slot's ``sum((q - z) * x)`` (INT4: / 256),
    times its group's scale unless ``PER_CHANNEL`` (applied once at the end)."""
    VALS: tl.constexpr = 8 * SLOT_BYTES // BITS
    x_mask = None if EVEN_K else (k + slot * VALS < K)[:, None]
    if BITS == 4:  # low nibbles: the slot's first 16 columns, high nibbles: the next 16
        x_lo = _load_input(x_ptrs + k, x_mask, K, GATED).to(tl.float32)[None, :, :]
        x_hi = _load_input(x_ptrs + k + 16, x_mask, K, GATED).to(tl.float32)[None, :, :]
        dot = tl.sum(_int4_values(w, False, ASM) * x_lo + _int4_values(w, True, ASM) * x_hi,
                     axis=2)
        part = dot - c * tl.sum(x_lo + x_hi, axis=2)  # sum((v - 0.5 - z / 256) * x)
    else:
        x = _load_input(x_ptrs + k, x_mask, K, GATED).to(tl.float32)[None, :, :]
        part = tl.sum((_int8_values(w, ASM) - c[:, :, None]) * x, axis=2)
    if PER_CHANNEL:
        return acc + part
    return acc + part * s


@triton.jit
def quant_fma_kernel(
    x_ptr,  # [1, K] ([1, 2K] gate | up when GATED), unit last stride
    qw_ptr,  # uint8 [N, K * BITS / 8], kernel layout, row stride stride_qn
    s_ptr,  # [K / GROUP, N] contiguous, x's dtype
    z_ptr,  # like s_ptr, read only when HAS_ZEROS
    bias_ptr,  # [N], read only when HAS_BIAS
    out_ptr,  # [1, N]
    N,
    K,
    stride_qn,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,  # group size (unused when PER_CHANNEL)
    PER_CHANNEL: tl.constexpr,  # one group per row: scale and zero loaded once
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no mask on any load
    NUM_STAGES: tl.constexpr,
    GATED: tl.constexpr,
    PDL: tl.constexpr,
    PRELOAD: tl.constexpr,  # with PDL: tiles loaded before the wait (1 or 2, <= K's)
    ASM: tl.constexpr,  # inline PTX unpacking (compiled CUDA; not the interpreter)
):
    VALS: tl.constexpr = 8 * SLOT_BYTES // BITS  # values in a slot
    SLOTS: tl.constexpr = BLOCK_K // VALS
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_c = tl.minimum(rows, N - 1)  # rows past N re-read row N - 1; the store drops them
    slot = tl.arange(0, SLOTS)
    byte = tl.arange(0, SLOT_BYTES)
    w_ptrs = (qw_ptr + rows_c.to(tl.int64)[:, None, None] * stride_qn
              + slot[None, :, None] * SLOT_BYTES + byte[None, None, :])
    x_ptrs = x_ptr + slot[:, None] * VALS + byte[None, :]  # [SLOTS, 16]
    acc = tl.zeros((BLOCK_N, SLOTS), dtype=tl.float32)
    if PER_CHANNEL:
        s_row, c_row = _group_params(s_ptr, z_ptr, rows_c, None, BITS, HAS_ZEROS)
        c_row = c_row[:, None]
    else:
        c_row = tl.zeros((1, 1), dtype=tl.float32)
    first_k = 0
    if PDL:  # W is constant: its first tiles stream during the previous kernel's tail
        w, s, c = _fma_weights(w_ptrs, s_ptr, z_ptr, rows_c, slot, 0, N, K, BITS, GROUP,
                               PER_CHANNEL, HAS_ZEROS, EVEN_K)
        if PRELOAD == 2:
            w2, s2, c2 = _fma_weights(w_ptrs, s_ptr, z_ptr, rows_c, slot, BLOCK_K, N, K, BITS,
                                      GROUP, PER_CHANNEL, HAS_ZEROS, EVEN_K)
        gdc_wait()
        acc = _fma_accumulate(acc, w, s, c_row if PER_CHANNEL else c, x_ptrs, slot, 0, K,
                              BITS, PER_CHANNEL, GATED, EVEN_K, ASM)
        if PRELOAD == 2:
            acc = _fma_accumulate(acc, w2, s2, c_row if PER_CHANNEL else c2, x_ptrs, slot,
                                  BLOCK_K, K, BITS, PER_CHANNEL, GATED, EVEN_K, ASM)
        first_k = PRELOAD * BLOCK_K
    for k in tl.range(first_k, K, BLOCK_K, num_stages=NUM_STAGES):
        w, s, c = _fma_weights(w_ptrs, s_ptr, z_ptr, rows_c, slot, k, N, K, BITS, GROUP,
                               PER_CHANNEL, HAS_ZEROS, EVEN_K)
        acc = _fma_accumulate(acc, w, s, c_row if PER_CHANNEL else c, x_ptrs, slot, k, K,
                              BITS, PER_CHANNEL, GATED, EVEN_K, ASM)
    if PDL:  # the next kernel may start loading its own weights
        gdc_launch_dependents()
    out = tl.sum(acc, axis=1)  # [BLOCK_N]
    if PER_CHANNEL:
        out = out * s_row
    if HAS_BIAS:
        out += tl.load(bias_ptr + rows_c).to(tl.float32)
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=rows < N)


# ------------------------------------------------------- tiles: swap-AB dot


@triton.jit
def _dot_weights(w_ptrs, s_ptr, z_ptr, rows, gi, byte, k, N, K, BITS: tl.constexpr,
                 GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_ZEROS: tl.constexpr,
                 EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr):
    """The packed ``[BLOCK_N, GROUPS, bytes]`` tile at column ``k`` (GROUPS
    groups side by side, or a part of one group) and its ``[BLOCK_N, GROUPS, 1]``
    scale and offset (per channel: dummies, the caller holds the row's)."""
    SUB: tl.constexpr = BLOCK_K // GROUPS  # columns of one group in the tile
    VALS: tl.constexpr = 8 * SLOT_BYTES // BITS
    first = k + gi * SUB  # [GROUPS] first column of each part
    slot_first = first[None, :, None] + (byte // SLOT_BYTES * VALS)[None, None, :]
    w = _masked_load(w_ptrs + k * BITS // 8, None if EVEN_K else slot_first < K)
    if PER_CHANNEL:
        s = tl.zeros((1, 1, 1), dtype=tl.float32)
        c = s
    else:
        offsets = (first // GROUP)[None, :] * N + rows[:, None]
        s, c = _group_params(s_ptr, z_ptr, offsets, None if EVEN_K else (first < K)[None, :],
                             BITS, HAS_ZEROS)
        s, c = s[:, :, None], c[:, :, None]
    return w, s, c


@triton.jit
def _dot_operand(w, s, c, HIGH: tl.constexpr, BITS: tl.constexpr, PER_CHANNEL: tl.constexpr,
                 ASM: tl.constexpr, dtype: tl.constexpr):
    """The dequantised ``[BLOCK_N, bytes]`` operand in x's dtype: ``(q - z) * s``
    rounded once (INT4 per channel: ``(q - z) / 256`` exactly, the scale left
    for the accumulator)."""
    if BITS == 4:
        v = _int4_values(w, HIGH, ASM)
        if PER_CHANNEL:
            d = v - c
        else:  # (v - c) * s in one exact FMA: both products fit float32
            d = v * s - c * s
    else:
        d = _int8_values(w, ASM) - c
        if not PER_CHANNEL:
            d = d * s
    d = d.to(dtype)
    return tl.reshape(d, (d.shape[0], d.shape[1] * d.shape[2]))


@triton.jit
def _dot_accumulate(acc, w, s, c, x_ptrs, x_rows_ok, cols, k, K, BITS: tl.constexpr,
                    PER_CHANNEL: tl.constexpr, GATED: tl.constexpr, EVEN_K: tl.constexpr,
                    ASM: tl.constexpr):
    """``acc[BLOCK_N, BLOCK_M]`` plus the dequantised tile times x's columns at ``k``."""
    mask = x_rows_ok if EVEN_K else x_rows_ok & (k + cols < K)[None, :]
    x = _load_input(x_ptrs + k, mask, K, GATED)
    acc = tl.dot(_dot_operand(w, s, c, False, BITS, PER_CHANNEL, ASM, x.dtype), tl.trans(x), acc)
    if BITS == 4:  # high nibbles: the columns 16 on in each run of 32
        x = _load_input(x_ptrs + k + 16, mask, K, GATED)
        acc = tl.dot(_dot_operand(w, s, c, True, BITS, PER_CHANNEL, ASM, x.dtype), tl.trans(x),
                     acc)
    return acc


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every row count
def quant_dot_kernel(
    x_ptr,  # [M, K] ([M, 2K] gate | up when GATED), row stride stride_xm, unit last stride
    qw_ptr,  # uint8 [N, K * BITS / 8], kernel layout, row stride stride_qn
    s_ptr,  # [K / GROUP, N] contiguous, x's dtype
    z_ptr,  # like s_ptr, read only when HAS_ZEROS
    bias_ptr,  # [N], read only when HAS_BIAS
    out_ptr,  # [M, N] contiguous
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    GATED: tl.constexpr,
    PDL: tl.constexpr,
    PRELOAD: tl.constexpr,
    ASM: tl.constexpr,
):
    TILE_BYTES: tl.constexpr = BLOCK_K * BITS // 8  # a row's packed bytes per K step
    GROUPS: tl.constexpr = 1 if PER_CHANNEL or BLOCK_K <= GROUP else BLOCK_K // GROUP
    # grouped program order: GROUP_M m-tiles side by side share W tiles in L2
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # rows of W = output columns
    rows_c = tl.minimum(rows, N - 1)
    xs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of x = output rows
    gi = tl.arange(0, GROUPS)
    byte = tl.arange(0, TILE_BYTES // GROUPS)
    w_ptrs = (qw_ptr + rows_c.to(tl.int64)[:, None, None] * stride_qn
              + gi[None, :, None] * (TILE_BYTES // GROUPS) + byte[None, None, :])
    # x's columns for each packed byte of the tile: INT4 low nibbles (high: +16)
    tile_byte = tl.arange(0, TILE_BYTES)
    cols = (tile_byte // 16) * 32 + tile_byte % 16 if BITS == 4 else tile_byte
    x_ptrs = x_ptr + xs.to(tl.int64)[:, None] * stride_xm + cols[None, :]
    x_rows_ok = (xs < M)[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if PER_CHANNEL:
        s_row, c_row = _group_params(s_ptr, z_ptr, rows_c, None, BITS, HAS_ZEROS)
        c_row = c_row[:, None, None]
    else:
        c_row = tl.zeros((1, 1, 1), dtype=tl.float32)
    first_k = 0
    if PDL:
        w, s, c = _dot_weights(w_ptrs, s_ptr, z_ptr, rows_c, gi, byte, 0, N, K, BITS, GROUP,
                               PER_CHANNEL, HAS_ZEROS, EVEN_K, BLOCK_K, GROUPS)
        if PRELOAD == 2:
            w2, s2, c2 = _dot_weights(w_ptrs, s_ptr, z_ptr, rows_c, gi, byte, BLOCK_K, N, K,
                                      BITS, GROUP, PER_CHANNEL, HAS_ZEROS, EVEN_K, BLOCK_K,
                                      GROUPS)
        gdc_wait()
        acc = _dot_accumulate(acc, w, s, c_row if PER_CHANNEL else c, x_ptrs, x_rows_ok, cols,
                              0, K, BITS, PER_CHANNEL, GATED, EVEN_K, ASM)
        if PRELOAD == 2:
            acc = _dot_accumulate(acc, w2, s2, c_row if PER_CHANNEL else c2, x_ptrs, x_rows_ok,
                                  cols, BLOCK_K, K, BITS, PER_CHANNEL, GATED, EVEN_K, ASM)
        first_k = PRELOAD * BLOCK_K
    for k in tl.range(first_k, K, BLOCK_K, num_stages=NUM_STAGES):
        w, s, c = _dot_weights(w_ptrs, s_ptr, z_ptr, rows_c, gi, byte, k, N, K, BITS, GROUP,
                               PER_CHANNEL, HAS_ZEROS, EVEN_K, BLOCK_K, GROUPS)
        acc = _dot_accumulate(acc, w, s, c_row if PER_CHANNEL else c, x_ptrs, x_rows_ok, cols,
                              k, K, BITS, PER_CHANNEL, GATED, EVEN_K, ASM)
    if PDL:
        gdc_launch_dependents()
    if PER_CHANNEL:
        acc = acc * s_row[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows_c).to(tl.float32)[:, None]
    out_ptrs = out_ptr + xs.to(tl.int64)[None, :] * N + rows[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
             mask=(rows < N)[:, None] & (xs < M)[None, :])


# ------------------------------------------------------------------ dequant


@triton.jit
def quant_dequant_kernel(
    qw_ptr,  # uint8 [N, K * BITS / 8], kernel layout, row stride stride_qn
    s_ptr,  # [K / GROUP, N] contiguous
    z_ptr,  # like s_ptr, read only when HAS_ZEROS
    out_ptr,  # [N, K] contiguous, the scales' dtype
    N,
    K,
    stride_qn,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    ASM: tl.constexpr,
):
    VALS: tl.constexpr = 8 * SLOT_BYTES // BITS
    SLOTS: tl.constexpr = BLOCK_K // VALS
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_c = tl.minimum(rows, N - 1)
    k = tl.program_id(1) * BLOCK_K
    slot = tl.arange(0, SLOTS)
    byte = tl.arange(0, SLOT_BYTES)
    w_ptrs = (qw_ptr + rows_c.to(tl.int64)[:, None, None] * stride_qn
              + slot[None, :, None] * SLOT_BYTES + byte[None, None, :])
    w, s, c = _fma_weights(w_ptrs, s_ptr, z_ptr, rows_c, slot, k, N, K, BITS, GROUP,
                           PER_CHANNEL, HAS_ZEROS, EVEN_K)
    if PER_CHANNEL:
        s, c = _group_params(s_ptr, z_ptr, rows_c, None, BITS, HAS_ZEROS)
        s, c = s[:, None, None], c[:, None, None]
    else:
        s, c = s[:, :, None], c[:, :, None]
    out_ptrs = (out_ptr + rows.to(tl.int64)[:, None, None] * K + k
                + slot[None, :, None] * VALS + byte[None, None, :])
    mask = (rows < N)[:, None, None] & (k + slot * VALS < K)[None, :, None]
    dtype = out_ptr.dtype.element_ty
    if BITS == 4:  # (v - c) * s in one exact FMA, rounded once
        tl.store(out_ptrs, (_int4_values(w, False, ASM) * s - c * s).to(dtype), mask=mask)
        tl.store(out_ptrs + 16, (_int4_values(w, True, ASM) * s - c * s).to(dtype), mask=mask)
    else:
        tl.store(out_ptrs, ((_int8_values(w, ASM) - c) * s).to(dtype), mask=mask)


# ---------------------------------------------------------------- launchers


def _slot_values(bits: int) -> int:
    return 8 * SLOT_BYTES // bits


def _check_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                  bits: int, group_size: int, transposed: bool = True) -> tuple[int, int]:
    """``(N, K)`` of a packed weight, after checking its tensors (``transposed``:
    scales in the kernel layout ``[K / group_size, N]``, else packing.py's)."""
    if bits not in QUANT_BITS:
        raise ValueError(f"bits={bits}; allowed: {QUANT_BITS}")
    if qweight.dim() != 2 or qweight.dtype != torch.uint8 or not qweight.is_contiguous():
        raise ValueError(f"qweight: {qweight.dtype} of shape {tuple(qweight.shape)}, strides "
                         f"{qweight.stride()}; expected a contiguous 2-D uint8 tensor")
    n, k = qweight.shape[0], qweight.shape[1] * 8 // bits
    vals = _slot_values(bits)
    if k == 0 or k % vals:
        raise ValueError(f"qweight: shape {tuple(qweight.shape)}, {k} input columns at "
                         f"{bits} bits; the kernels need a positive multiple of {vals}")
    pow2 = group_size > 0 and group_size & (group_size - 1) == 0
    if group_size != k and not (pow2 and group_size >= vals and k % group_size == 0):
        raise ValueError(f"group_size={group_size}; allowed: K={k} (one group per row) or a "
                         f"power of two >= {vals} that divides K")
    groups = (k // group_size, n) if transposed else (n, k // group_size)
    layout = "the kernel layout (repack_for_kernels)" if transposed else "packing.py's layout"
    for name, tensor in (("scales", scales), ("zeros", zeros)):
        if tensor is None:
            continue
        if (tuple(tensor.shape) != groups or tensor.dtype not in DTYPES
                or not tensor.is_contiguous() or tensor.device != qweight.device):
            raise ValueError(f"{name}: {tensor.dtype} of shape {tuple(tensor.shape)} on "
                             f"{tensor.device}; expected a contiguous {groups} tensor of "
                             f"{DTYPES} on {qweight.device}, {layout}")
    if zeros is not None and zeros.dtype != scales.dtype:
        raise ValueError(f"zeros: {zeros.dtype}; expected the scales' {scales.dtype}")
    return n, k


def _check_input(x: torch.Tensor, k: int, n: int, scales: torch.Tensor,
                 bias: torch.Tensor | None, gated: bool) -> int:
    """M of ``x`` after checking it and ``bias`` against a weight of ``[n, k]``."""
    if x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError(f"x: {x.dtype} of shape {tuple(x.shape)}; expected a 2-D tensor "
                         f"of {DTYPES}")
    cols = (2 if gated else 1) * k
    if x.shape[1] != cols:
        raise ValueError(f"x: shape {tuple(x.shape)}; expected {cols} columns "
                         f"({'2K, gate and up, ' if gated else ''}K={k} of the weight)")
    if x.stride(1) != 1:
        raise ValueError(f"x: last-dimension stride {x.stride(1)}; must be 1")
    if x.dtype != scales.dtype or x.device != scales.device:
        raise ValueError(f"x: {x.dtype} on {x.device}; expected the scales' {scales.dtype} "
                         f"on {scales.device}")
    if bias is not None and (tuple(bias.shape) != (n,) or bias.dtype != x.dtype
                             or not bias.is_contiguous() or bias.device != x.device):
        raise ValueError(f"bias: {bias.dtype} of shape {tuple(bias.shape)} on {bias.device}; "
                         f"expected a contiguous ({n},) tensor of {x.dtype} on {x.device}")
    return x.shape[0]


def _use_asm(device: torch.device) -> bool:
    """Inline PTX for the unpacking: compiled CUDA kernels (not the interpreter, not ROCm)."""
    return device.type == "cuda" and torch.version.cuda is not None


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _cap_block_k(block_k: int, k: int, minimum: int = 32) -> int:
    return max(minimum, min(block_k, triton.next_power_of_2(k)))


@functools.lru_cache(maxsize=256)
def default_fma_config(bits: int, n: int, k: int) -> FmaConfig:
    """One row: programs of 8 rows of W walking 512 packed bytes of each per
    step (INT4 1,024 columns, INT8 512), 2 warps (4 rows a thread), 3 stages."""
    return FmaConfig(8, _cap_block_k(1024 if bits == 4 else 512, k), 2, 3)


@functools.lru_cache(maxsize=256)
def default_dot_config(bits: int, m: int, n: int, k: int,
                       num_sms: int = DEFAULT_NUM_SMS) -> DotConfig:
    """Decode batches (``m <= SKINNY_MAX_M``): one 16-row tile of x, ``block_n``
    the largest of 64 / 32 / 16 that still gives ``PROGRAMS_PER_SM`` programs an
    SM (a warp per 16 rows of W), 128 packed bytes a row per step, 4 stages.
    More rows: 128 rows of W by 64 (``m <= 64``) or 128 rows of x, 64 packed
    bytes a row per step, 8 warps, 3 stages, 8 m-tiles side by side."""
    if m <= SKINNY_MAX_M:
        block_n = 64
        while block_n > 16 and triton.cdiv(n, block_n) < PROGRAMS_PER_SM * num_sms:
            block_n //= 2
        block_k = _cap_block_k(256 if bits == 4 else 128, k)
        return DotConfig(DOT_BLOCK_M, block_n, block_k, block_n // 16, 4)
    block_k = _cap_block_k(128 if bits == 4 else 64, k)
    return DotConfig(64 if m <= 64 else 128, 128, block_k, 8, 3)


def default_dequant_config(bits: int, k: int) -> DequantConfig:
    """16 rows of W by 512 packed bytes a program, 4 warps."""
    return DequantConfig(16, _cap_block_k(1024 if bits == 4 else 512, k), 4)


def _constexprs(bits: int, group_size: int, k: int, zeros: torch.Tensor | None,
                device: torch.device) -> dict[str, object]:
    per_channel = group_size == k
    return dict(BITS=bits, GROUP=1 if per_channel else group_size, PER_CHANNEL=per_channel,
                HAS_ZEROS=zeros is not None, ASM=_use_asm(device))


def quant_matmul_fma(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
    bits: int, group_size: int, bias: torch.Tensor | None = None, gated: bool = False,
    config: FmaConfig | None = None,
) -> torch.Tensor:
    """The one-row FMA path of ``quant_matmul`` (``x`` has exactly one row)."""
    n, k = _check_weight(qweight, scales, zeros, bits, group_size)
    m = _check_input(x, k, n, scales, bias, gated)
    if m != 1:
        raise ValueError(f"x: shape {tuple(x.shape)}; the FMA path takes exactly one row")
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    config = config or default_fma_config(bits, n, k)
    pdl = use_pdl(x.device)
    quant_fma_kernel[(triton.cdiv(n, config.block_n),)](
        x, qweight, scales, scales if zeros is None else zeros,
        scales if bias is None else bias, out, n, k, qweight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0, NUM_STAGES=config.num_stages, GATED=gated, PDL=pdl,
        PRELOAD=min(PRELOAD_TILES, triton.cdiv(k, config.block_k)) if pdl else 1,
        num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl,
        **_constexprs(bits, group_size, k, zeros, x.device),
    )
    return out


def quant_matmul_dot(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
    bits: int, group_size: int, bias: torch.Tensor | None = None, gated: bool = False,
    config: DotConfig | None = None,
) -> torch.Tensor:
    """The ``tl.dot`` path of ``quant_matmul``: the skinny tile for decode
    batches (with programmatic dependent launch), the tile GEMM above."""
    n, k = _check_weight(qweight, scales, zeros, bits, group_size)
    m = _check_input(x, k, n, scales, bias, gated)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    config = config or default_dot_config(bits, m, n, k, _num_sms(x.device))
    pdl = use_pdl(x.device) and m <= SKINNY_MAX_M
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    quant_dot_kernel[grid](
        x, qweight, scales, scales if zeros is None else zeros,
        scales if bias is None else bias, out, m, n, k, x.stride(0), qweight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, GROUP_M=config.group_m, EVEN_K=k % config.block_k == 0,
        NUM_STAGES=config.num_stages, GATED=gated, PDL=pdl,
        PRELOAD=min(PRELOAD_TILES, triton.cdiv(k, config.block_k)) if pdl else 1,
        num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl,
        **_constexprs(bits, group_size, k, zeros, x.device),
    )
    return out


def dequantize_weight(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
    group_size: int, config: DequantConfig | None = None,
) -> torch.Tensor:  # [N, K] contiguous, the scales' dtype
    """The 16-bit weight ``(q - z) * scale`` (rounded once) of kernel-layout tensors."""
    n, k = _check_weight(qweight, scales, zeros, bits, group_size)
    out = torch.empty((n, k), dtype=scales.dtype, device=qweight.device)
    config = config or default_dequant_config(bits, k)
    quant_dequant_kernel[(triton.cdiv(n, config.block_n), triton.cdiv(k, config.block_k))](
        qweight, scales, scales if zeros is None else zeros, out, n, k, qweight.stride(0),
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_K=k % config.block_k == 0,
        num_warps=config.num_warps, **_constexprs(bits, group_size, k, zeros, qweight.device),
    )
    return out


def quant_matmul_dequant(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
    bits: int, group_size: int, bias: torch.Tensor | None = None, gated: bool = False,
    config: DequantConfig | None = None,
) -> torch.Tensor:
    """The dequantise-then-cuBLAS path of ``quant_matmul`` (a transient N * K
    16-bit weight; gated inputs go through ``silu_and_mul`` first)."""
    n, k = _check_weight(qweight, scales, zeros, bits, group_size)
    _check_input(x, k, n, scales, bias, gated)
    weight = dequantize_weight(qweight, scales, zeros, bits, group_size, config)
    return F.linear(silu_and_mul(x) if gated else x, weight, bias)


def quant_matmul(
    x: torch.Tensor,  # [M, K] ([M, 2K] gate | up when gated), unit last stride, bf16 / fp16
    qweight: torch.Tensor,  # uint8 [N, K * bits / 8], kernel layout (repack_for_kernels)
    scales: torch.Tensor,  # [K / group_size, N] contiguous, x's dtype
    zeros: torch.Tensor | None,  # like scales, or None (symmetric)
    bits: int,  # 4 or 8
    group_size: int,  # K (one group per row) or a power of two dividing K
    bias: torch.Tensor | None = None,  # [N] contiguous, x's dtype
    gated: bool = False,  # x is gate | up; the GEMM's input is silu(gate) * up
    config: QuantGemmConfig | None = None,  # forces a path and its tiles
) -> torch.Tensor:  # [M, N] contiguous, x's dtype
    """``x @ W'.T + bias`` of a weight-only quantised linear, into a new tensor.

    The path follows M: one row FMA, up to ``DEQUANT_MIN_M - 1`` rows the dot
    kernel (skinny tile to ``SKINNY_MAX_M`` rows), more rows dequantise then
    cuBLAS; a ``config`` of a path's type forces that path."""
    m = x.shape[0] if x.dim() == 2 else -1
    if isinstance(config, FmaConfig) or (config is None and m == 1):
        return quant_matmul_fma(x, qweight, scales, zeros, bits, group_size, bias, gated,
                                config if isinstance(config, FmaConfig) else None)
    if isinstance(config, DequantConfig) or (config is None and m >= DEQUANT_MIN_M):
        return quant_matmul_dequant(x, qweight, scales, zeros, bits, group_size, bias, gated,
                                    config if isinstance(config, DequantConfig) else None)
    return quant_matmul_dot(x, qweight, scales, zeros, bits, group_size, bias, gated,
                            config if isinstance(config, DotConfig) else None)


def repack_for_kernels(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
    group_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``quant/packing.py``'s ``(qweight, scales, zeros)`` -> the kernels' layout
    on the same device: INT4 nibbles reordered within each 32 columns (a new
    tensor; INT8 ``qweight`` is returned as it is), scales and zeros transposed
    to ``[K / group_size, N]`` (module docstring)."""
    n, k = _check_weight(qweight, scales, zeros, bits, group_size, transposed=False)
    if bits == 4:
        packed = torch.empty_like(qweight)
        for start in range(0, n, 4096):  # bounded temporaries for large weights
            rows = qweight[start:start + 4096]
            # column 2i low, 2i + 1 high -> [rows, K / 32, 32] codes in column order
            codes = torch.stack((rows & 0xF, rows >> 4), dim=-1).reshape(rows.shape[0], -1, 32)
            packed[start:start + 4096] = (codes[..., :16] | (codes[..., 16:] << 4)).flatten(1)
        qweight = packed
    return (qweight, scales.t().contiguous(),
            None if zeros is None else zeros.t().contiguous())
