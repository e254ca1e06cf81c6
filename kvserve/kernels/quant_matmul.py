"""Weight-only quantised GEMMs: ``quant_matmul(x, qweight, scales, zeros, bits,
group_size)`` is ``x[M, K] @ W'[N, K].T (+ bias)`` with ``W'`` the INT8 / INT4
weight of ``quant/packing.py`` dequantised on the fly, in x's dtype (bf16 or
fp16). Configs, checks, launchers, the path heuristic and the load-time
repack live here; the Triton kernels in ``quant_matmul_kernels.py``. The
layers decide when to call it; this module imports only torch and Triton
(and sibling kernels).

Kernel layout (``repack_for_kernels``, once at load, from packing.py's):

- ``qweight`` uint8 ``[N, K * bits / 8]``, output dim first. INT8 as packed.
  INT4 reorders the nibbles within each 32 input columns (16 bytes): byte
  ``j`` holds column ``j`` low and column ``16 + j`` high (packing.py: ``2j``
  / ``2j + 1``), so the low (high) nibbles of a 16-byte load meet 16
  consecutive activations: 16-byte loads of x and ``tl.dot`` operands
  straight from shared memory instead of every other column. K must be a
  multiple of 32 (INT8: 16).
- ``scales`` / ``zeros`` transposed to ``[K / group_size, N]``, contiguous: a
  program's rows of one group are adjacent, and the shape tells them from
  packing.py's ``[N, K / group_size]``. ``zeros`` None: symmetric, zero point
  ``2**(bits - 1)``. ``group_size``: K (one group per row) or a power of
  two >= 32 (INT8 >= 16) dividing K. Act-order's ``perm`` is the layer's.

Paths by row count M (``quant_matmul``; module constants, no autotuning):

- **FMA** (M == 1; ``quant_fma_kernel``), modelled on ``skinny_gemm.py``: grid
  ``cdiv(N, BLOCK_N)``, a program owns BLOCK_N rows of W and walks all of K
  once, software-pipelined tiles ``[BLOCK_N, slots, 16 bytes]`` (a slot: one
  16-byte load, 32 INT4 / 16 INT8 values, inside one group). It dequantises
  in registers, sums each slot in float32, scales the slot sum by its
  group's scale, writes each output once: no split-K, nothing read back, a
  fresh ``torch.empty`` output (CUDA-graph capturable).
- **Dot** (M >= 2; ``quant_dot_kernel``): swap-AB ``acc[BLOCK_N, BLOCK_M] +=
  W'_tile @ x_tile.T``, W' dequantised in registers (on sm_90 Triton feeds it
  to wgmma as the register operand, x from shared memory), a 2-D grid in
  grouped order (GROUP_M m-tiles side by side share W tiles in L2). Decode
  batches (M <= SKINNY_MAX_M) take one 16-row tile with programmatic
  dependent launch; larger M the tile configs (``default_dot_config``).
- **Dequant + cuBLAS** (M >= DEQUANT_MIN_M; ``quant_dequant_kernel``): the
  16-bit ``[N, K]`` weight into a fresh buffer (N * K * 2 bytes for the
  call), then ``F.linear``, for a compute-bound prefill.

``gated``: x is ``[M, 2K]`` gate | up and the GEMM's input ``silu(gate) *
up`` with ``kernels/activation.py``'s rounding. The FMA kernel computes it as
it loads x (no SiLU-and-mul launch); its exact float32 division costs ~10
instructions an activation, shared by the 8 rows a thread holds. The dot
kernel can too, but each of its N / BLOCK_N programs recomputes the gate of
all its rows, so above ``FUSED_GATE_MAX_M`` rows (and on the dequant path)
``silu_and_mul`` runs first; ``benchmarks/quant_gemm.py`` times both.

With programmatic dependent launch (``kernels/pdl.py``, Hopper) the FMA and
skinny dot kernels load their first weight tiles (and scales; a config's
``preload``) before ``gdc_wait`` and let the next kernel start after their K
loop, as the bf16 skinny GEMM does.

Arithmetic. Codes become floats with integer ops only (one PRMT a value,
inline PTX on CUDA; the same bits from plain integer ops under the
interpreter), never an int-to-float conversion: INT8 as ``2**23 + q``, minus
``2**23 + z`` exactly; INT4 as ``0.5 + q / 256``. The FMA path sums ``(q - z)
* x`` per slot in float32 (INT4: ``sum(v * x) - (0.5 + z / 256) * sum(x)``,
a few bits cancelled within 32 terms, ~1e-6 relative) and multiplies by the
scale; all sums float32, the bias added in float32, the output rounded once.
The dot and dequant paths round the weight to x's dtype before the product:
``(q - z) * scale``, exact in float32, rounded once; with one group per row
``q - z`` is exact and the scale multiplies the float32 accumulator.
Oracles: ``quant/packing.py``'s ``quantized_linear_reference`` and
``dequantize``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from kvserve.kernels.activation import silu_and_mul
from kvserve.kernels.pdl import use_pdl
from kvserve.kernels.quant_matmul_kernels import (
    SLOT_BYTES,
    quant_dequant_kernel,
    quant_dot_kernel,
    quant_fma_kernel,
)

DTYPES = (torch.bfloat16, torch.float16)
QUANT_BITS = (4, 8)
SKINNY_MAX_M = 16  # up to this many rows: FMA (one row) or the 16-row dot tile
# from this many rows: dequantise, then cuBLAS (on an H100 it beat the dot tiles at 256 rows and
# up on Llama-3-8B's shapes, and lost below; docs/benchmarks.md)
DEQUANT_MIN_M = 256
DOT_BLOCK_M = 16  # tl.dot's smallest tile side: the skinny dot tile's rows
PROGRAMS_PER_SM = 4  # skinny dot: thinner programs until this many per SM
# every program recomputes the gate for its rows of x: ~10 instructions an activation, times
# N / BLOCK_N programs, which only the one-row FMA path amortises (over 8 rows a thread)
FUSED_GATE_MAX_M = 1
DEFAULT_NUM_SMS = 132
# weight tiles a decode program loads before its PDL wait (1 or 2; configs may differ). Two
# beat one for the bf16 skinny GEMM; here two cost the FMA kernel ~250 registers against
# ~170 (sm_90 ptxas), so the sweep times both
PRELOAD_TILES = 2


@dataclass(frozen=True)
class FmaConfig:
    """Tiles of the one-row FMA path (``block_k`` in input columns)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    preload: int = PRELOAD_TILES  # with PDL: tiles loaded before the wait

    def __post_init__(self) -> None:
        _check_powers_of_two(self, ("block_n", "block_k", "num_warps"))
        if self.block_k < 32 or self.num_stages < 1:
            raise ValueError(f"block_k={self.block_k}, num_stages={self.num_stages}; "
                             "need block_k >= 32 and num_stages >= 1")
        _check_preload(self.preload)


@dataclass(frozen=True)
class DotConfig:
    """Tiles of the dot path: ``block_m`` rows of x, ``block_n`` of W, ``block_k`` columns."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8  # m-tiles side by side in the program order (L2 reuse of W)
    preload: int = PRELOAD_TILES  # decode batches with PDL: tiles loaded before the wait

    def __post_init__(self) -> None:
        _check_powers_of_two(self, ("block_m", "block_n", "block_k", "num_warps"))
        if min(self.block_m, self.block_n) < 16 or self.block_k < 32:
            raise ValueError(f"block_m={self.block_m}, block_n={self.block_n}, "
                             f"block_k={self.block_k}; need block_m, block_n >= 16 "
                             "and block_k >= 32")
        if self.num_stages < 1 or self.group_m < 1:
            raise ValueError(f"num_stages={self.num_stages}, group_m={self.group_m}; "
                             "both must be >= 1")
        _check_preload(self.preload)


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


def _check_preload(preload: int) -> None:
    if preload not in (1, 2):
        raise ValueError(f"preload={preload}; allowed: 1, 2")


def _check_powers_of_two(config: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(config, name)
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name}={value}; must be a power of two")


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
    if not isinstance(scales, torch.Tensor):
        raise ValueError(f"scales: {scales!r}; expected a {groups} tensor, {layout}")
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
    """One row, the fastest of ``benchmarks/quant_gemm.py --sweep`` on an H100
    over Llama-3-8B's five shapes: INT4 programs of 16 rows of W walking 256
    packed bytes (512 columns) a step, 2 warps, 4 stages; INT8 programs of 4
    rows, 1,024 columns a step, 1 warp, 3 stages (1.1-1.4x the first
    defaults; decision 0018)."""
    if bits == 4:
        return FmaConfig(16, _cap_block_k(512, k), 2, 4)
    return FmaConfig(4, _cap_block_k(1024, k), 1, 3)


@functools.lru_cache(maxsize=256)
def default_dot_config(bits: int, m: int, n: int, k: int,
                       num_sms: int = DEFAULT_NUM_SMS) -> DotConfig:
    """Decode batches (``m <= SKINNY_MAX_M``): one 16-row tile of x, a warp per
    16 rows of W. INT8: ``block_n`` the largest of 64 / 32 / 16 that still
    gives ``PROGRAMS_PER_SM`` programs an SM, then 64 columns a step over 6
    stages (16 rows) or 128 over 4. INT4: 64 rows of W from N = 6,144 up, else
    32, 256 columns a step, 4 stages (fewer, larger programs: its dequantisation
    costs more than its loads). Both from the H100 sweep of decision 0018.
    More rows: 128 rows of W by 64 (``m <= 64``, 4 stages) or 128 rows of x
    (3 stages), 64 packed bytes a row per step, 8 warps, 8 m-tiles side by side."""
    if m <= SKINNY_MAX_M:
        if bits == 4:
            block_n = 64 if n >= 6144 else 32
            return DotConfig(DOT_BLOCK_M, block_n, _cap_block_k(256, k), block_n // 16, 4)
        block_n = 64
        while block_n > 16 and triton.cdiv(n, block_n) < PROGRAMS_PER_SM * num_sms:
            block_n //= 2
        if block_n == 16:
            return DotConfig(DOT_BLOCK_M, 16, _cap_block_k(64, k), 1, 6)
        return DotConfig(DOT_BLOCK_M, block_n, _cap_block_k(128, k), block_n // 16, 4)
    block_k = _cap_block_k(128 if bits == 4 else 64, k)
    if m <= 64:
        return DotConfig(64, 128, block_k, 8, 4)
    return DotConfig(128, 128, block_k, 8, 3)


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
        PRELOAD=min(config.preload, triton.cdiv(k, config.block_k)) if pdl else 1,
        num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl,
        **_constexprs(bits, group_size, k, zeros, x.device),
    )
    return out


def quant_matmul_dot(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
    bits: int, group_size: int, bias: torch.Tensor | None = None, gated: bool = False,
    config: DotConfig | None = None, fuse_gate: bool | None = None,
) -> torch.Tensor:
    """The ``tl.dot`` path of ``quant_matmul``: the skinny tile for decode
    batches (with programmatic dependent launch), the tile GEMM above. A gated
    input is fused (``silu(gate) * up`` as x is loaded) when ``fuse_gate``,
    by default up to ``FUSED_GATE_MAX_M`` rows; else ``silu_and_mul`` runs first."""
    n, k = _check_weight(qweight, scales, zeros, bits, group_size)
    m = _check_input(x, k, n, scales, bias, gated)
    if gated and not (m <= FUSED_GATE_MAX_M if fuse_gate is None else fuse_gate):
        x, gated = silu_and_mul(x), False
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
        PRELOAD=min(config.preload, triton.cdiv(k, config.block_k)) if pdl else 1,
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
    n, _ = _check_weight(qweight, scales, zeros, bits, group_size, transposed=False)
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


def unpack_from_kernels(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The inverse of ``repack_for_kernels``: the kernels' layout -> packing.py's."""
    if bits == 4:
        unpacked = torch.empty_like(qweight)
        for start in range(0, qweight.shape[0], 4096):
            rows = qweight[start:start + 4096]
            slots = rows.reshape(rows.shape[0], -1, 16)  # [rows, K / 32, 16 bytes]
            codes = torch.cat((slots & 0xF, slots >> 4), dim=-1)  # columns in order
            unpacked[start:start + 4096] = (codes[..., 0::2] | (codes[..., 1::2] << 4)).flatten(1)
        qweight = unpacked
    return (qweight, scales.t().contiguous(),
            None if zeros is None else zeros.t().contiguous())
