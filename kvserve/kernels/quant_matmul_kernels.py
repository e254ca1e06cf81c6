"""The Triton kernels behind ``kernels/quant_matmul.py`` (read its docstring
for the layout, the paths and the arithmetic): ``quant_fma_kernel`` (one
row), ``quant_dot_kernel`` (swap-AB ``tl.dot`` tiles, decode batches and
larger M) and ``quant_dequant_kernel`` (the 16-bit weight for cuBLAS), with
their shared jit helpers. No launcher, no checks: call them through
``quant_matmul.py``'s launchers. Imports only Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

SLOT_BYTES = 16  # one 16-byte vector of packed codes; a slot never straddles a group
INT4_VALUE_SCALE = 256.0  # INT4 codes are decoded as 0.5 + q / 256
# the same constants as the jit functions see them
_SLOT_BYTES = tl.constexpr(SLOT_BYTES)
_INT4_VALUE_SCALE = tl.constexpr(INT4_VALUE_SCALE)


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
def _masked_load(ptrs, mask, UNMASKED: tl.constexpr):
    """``ptrs`` loaded, zero where ``mask`` is false (``UNMASKED``: all loaded)."""
    if UNMASKED:  # noqa: SIM108 (a statement: the compiler then builds only this branch)
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=mask, other=0)
    return x


@triton.jit
def _group_params(s_ptr, z_ptr, offsets, mask, UNMASKED: tl.constexpr, BITS: tl.constexpr,
                  HAS_ZEROS: tl.constexpr):
    """``(scale, offset)`` in float32 at ``offsets`` of the ``[groups, N]`` scales /
    zeros: INT4 ``(256 * s, 0.5 + z / 256)``, INT8 ``(s, 2**23 + z)`` (the
    offset the decoded values subtract; symmetric: the midpoint's)."""
    s = _masked_load(s_ptr + offsets, mask, UNMASKED).to(tl.float32)
    if HAS_ZEROS:
        z = _masked_load(z_ptr + offsets, mask, UNMASKED).to(tl.float32)
    else:
        z = tl.full(s.shape, 2 ** (BITS - 1), tl.float32)
    if BITS == 4:
        s, c = s * _INT4_VALUE_SCALE, 0.5 + z * (1.0 / _INT4_VALUE_SCALE)
    else:
        c = z + 8388608.0
    return s, c


@triton.jit
def _load_input(ptrs, mask, UNMASKED: tl.constexpr, K, GATED: tl.constexpr):
    """x at ``ptrs``; with ``GATED``, ``silu(gate) * up`` of the gate at ``ptrs``
    and the up K columns on, rounded as ``kernels/activation.py`` rounds."""
    x = _masked_load(ptrs, mask, UNMASKED)
    if GATED:
        up = _masked_load(ptrs + K, mask, UNMASKED)
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
    VALS: tl.constexpr = 8 * _SLOT_BYTES // BITS
    slot_ok = k + slot * VALS < K
    w = _masked_load(w_ptrs + k * BITS // 8, slot_ok[None, :, None], EVEN_K)
    if PER_CHANNEL:
        s = tl.zeros((1, 1), dtype=tl.float32)
        c = s
    else:
        offsets = ((k + slot * VALS) // GROUP)[None, :] * N + rows[:, None]
        s, c = _group_params(s_ptr, z_ptr, offsets, slot_ok[None, :], EVEN_K, BITS, HAS_ZEROS)
    return w, s, c


@triton.jit
def _fma_accumulate(acc, w, s, c, x_ptrs, slot, k, K, BITS: tl.constexpr,
                    PER_CHANNEL: tl.constexpr, GATED: tl.constexpr, EVEN_K: tl.constexpr,
                    ASM: tl.constexpr):
    """``acc[BLOCK_N, SLOTS]`` plus each slot's ``sum((q - z) * x)`` (INT4: / 256),
    times its group's scale unless ``PER_CHANNEL`` (applied once at the end)."""
    VALS: tl.constexpr = 8 * _SLOT_BYTES // BITS
    x_mask = (k + slot * VALS < K)[:, None]
    if BITS == 4:  # low nibbles: the slot's first 16 columns, high nibbles: the next 16
        x_lo = _load_input(x_ptrs + k, x_mask, EVEN_K, K, GATED).to(tl.float32)
        x_hi = _load_input(x_ptrs + k + 16, x_mask, EVEN_K, K, GATED).to(tl.float32)
        dot = tl.sum(_int4_values(w, False, ASM) * x_lo[None, :, :]
                     + _int4_values(w, True, ASM) * x_hi[None, :, :], axis=2)
        part = dot - c * tl.sum(x_lo + x_hi, axis=1)[None, :]  # sum((v - 0.5 - z / 256) * x)
    else:
        x = _load_input(x_ptrs + k, x_mask, EVEN_K, K, GATED).to(tl.float32)[None, :, :]
        part = tl.sum((_int8_values(w, ASM) - c[:, :, None]) * x, axis=2)
    if PER_CHANNEL:
        acc += part
    else:
        acc += part * s
    return acc


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
    VALS: tl.constexpr = 8 * _SLOT_BYTES // BITS  # values in a slot
    SLOTS: tl.constexpr = BLOCK_K // VALS
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_c = tl.minimum(rows, N - 1)  # rows past N re-read row N - 1; the store drops them
    slot = tl.arange(0, SLOTS)
    byte = tl.arange(0, _SLOT_BYTES)
    w_ptrs = (qw_ptr + rows_c.to(tl.int64)[:, None, None] * stride_qn
              + slot[None, :, None] * _SLOT_BYTES + byte[None, None, :])
    x_ptrs = x_ptr + slot[:, None] * VALS + byte[None, :]  # [SLOTS, 16]
    acc = tl.zeros((BLOCK_N, SLOTS), dtype=tl.float32)
    if PER_CHANNEL:
        s_row, c_row = _group_params(s_ptr, z_ptr, rows_c, rows_c, True, BITS, HAS_ZEROS)
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
    VALS: tl.constexpr = 8 * _SLOT_BYTES // BITS
    first = k + gi * SUB  # [GROUPS] first column of each part
    slot_first = first[None, :, None] + (byte // _SLOT_BYTES * VALS)[None, None, :]
    w = _masked_load(w_ptrs + k * BITS // 8, slot_first < K, EVEN_K)
    if PER_CHANNEL:
        s = tl.zeros((1, 1, 1), dtype=tl.float32)
        c = s
    else:
        offsets = (first // GROUP)[None, :] * N + rows[:, None]
        s, c = _group_params(s_ptr, z_ptr, offsets, (first < K)[None, :], EVEN_K, BITS,
                             HAS_ZEROS)
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
        # (v - c) * s in one exact FMA: both products fit float32
        d = v - c if PER_CHANNEL else v * s - c * s
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
    x = _load_input(x_ptrs + k, mask, False, K, GATED)
    acc = tl.dot(_dot_operand(w, s, c, False, BITS, PER_CHANNEL, ASM, x.dtype), tl.trans(x), acc)
    if BITS == 4:  # high nibbles: the columns 16 on in each run of 32
        x = _load_input(x_ptrs + k + 16, mask, False, K, GATED)
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
        s_row, c_row = _group_params(s_ptr, z_ptr, rows_c, rows_c, True, BITS, HAS_ZEROS)
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
    VALS: tl.constexpr = 8 * _SLOT_BYTES // BITS
    SLOTS: tl.constexpr = BLOCK_K // VALS
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_c = tl.minimum(rows, N - 1)
    k = tl.program_id(1) * BLOCK_K
    slot = tl.arange(0, SLOTS)
    byte = tl.arange(0, _SLOT_BYTES)
    w_ptrs = (qw_ptr + rows_c.to(tl.int64)[:, None, None] * stride_qn
              + slot[None, :, None] * _SLOT_BYTES + byte[None, None, :])
    w, s, c = _fma_weights(w_ptrs, s_ptr, z_ptr, rows_c, slot, k, N, K, BITS, GROUP,
                           PER_CHANNEL, HAS_ZEROS, EVEN_K)
    if PER_CHANNEL:
        s, c = _group_params(s_ptr, z_ptr, rows_c, rows_c, True, BITS, HAS_ZEROS)
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
