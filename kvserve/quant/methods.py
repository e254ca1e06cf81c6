"""Linear methods: how a linear layer stores its weight and multiplies by it.

Every linear of ``layers/`` (``Linear`` and its packed subclasses, and
``LMHead``) owns one method, chosen when the model is built
(``linear_method``, from ``ModelConfig.quantization`` and the layer's HF
module names); the layer keeps its sizes, bias and ``use_triton`` flag and
delegates the rest:

- ``create_weights`` registers the parameters, every one with the output
  dimension first, so a packed ``qkv_proj`` / ``gate_up_proj`` stacks its
  shards by rows whatever the method;
- ``init_dummy`` fills them with seeded random weights (``load_format="dummy"``);
- ``process_weights_after_loading`` checks and finishes them once loaded;
- ``set_use_triton`` switches the layer between its torch reference and its
  Triton kernels (``layers/custom_ops.py``), rearranging the weights if the
  kernels want another layout;
- ``apply`` / ``apply_gated`` run the matmul.

``UnquantizedLinearMethod`` holds a 16-bit ``weight [N, K]`` (``F.linear``,
or the skinny Triton GEMM for one row). ``WeightOnlyLinearMethod`` holds
kvserve's packed layout (``quant/packing.py``: ``qweight``, ``scales``,
``zeros`` unless symmetric, ``perm`` with act-order); with ``use_triton`` it
holds them in the kernels' layout instead (``repack_for_kernels``: INT4
nibbles reordered, scales and zeros group-major) and runs the Triton kernels
of ``kernels/quant_matmul.py``, else the torch reference (dequantise, one
float32 matmul). ``Fp8LinearMethod`` holds FP8 W8A8 weights (e4m3
``qweight [N, K]``, float32 per-channel ``scales [N, 1]``) and quantises the
activations per token as it runs: with ``use_triton`` on CUDA through the
Triton quantiser and ``torch._scaled_mm``, else the torch reference
(``quant/fp8.py``). ``Int8W8A8LinearMethod`` is the same with int8 weights
and int8 per-token activations: with ``use_triton`` on CUDA the Triton
quantiser, ``torch._int_mm`` (int32 accumulation) and a Triton epilogue
(the scales and bias in float32, one pass), else the torch reference
(``quant/int8.py``). Loading checkpoints
of other layouts is not done here: ``quant/formats`` converts them first.
A method's parameters are set on the layer by name, so ``layer`` is typed
``Any`` here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.quant import fp8, int8
from kvserve.quant.config import QuantConfig
from kvserve.quant.packing import QuantizedWeight, quantize_rtn, quantized_linear_reference

# rows of random weight drawn at a time by a quantised layer's init_dummy
_DUMMY_CHUNK_ELEMENTS = 1 << 26


def _param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    # dtype (unless given) and device come from the caller's defaults (the loader sets them)
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class LinearMethod:
    """How a linear stores and applies its weight (see the module docstring)."""

    quantized = False
    # parameters the method registers, each [output_size, ...] except "perm"
    weight_names: tuple[str, ...] = ()

    def create_weights(self, layer: Any) -> None:
        raise NotImplementedError

    def init_dummy(self, layer: Any, generator: torch.Generator, std: float) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: Any) -> None:
        """Called once after every weight is loaded; nothing to do by default."""

    def input_shard(self, layer: Any, name: str, rank: int) -> tuple[int, int, int] | None:
        """Where rank ``rank`` of a row-parallel ``layer`` (whose ``input_size`` is
        its slice of the input columns) finds parameter ``name`` in the whole
        checkpoint tensor: ``(start, size, full size)`` along dim 1, or None when
        every rank takes it whole."""
        raise NotImplementedError

    def set_use_triton(self, layer: Any, enabled: bool) -> None:
        """Run ``layer`` on its Triton kernels (or its torch reference)."""
        layer.use_triton = enabled

    def apply(
        self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        raise NotImplementedError

    def apply_gated(
        self, layer: Any, gate_up: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """``apply`` of ``silu(gate) * up`` fused into one kernel, or None where
        this method has no fused path for ``gate_up`` (the caller then runs
        the activation first)."""
        return None


class UnquantizedLinearMethod(LinearMethod):
    """A 16-bit ``weight [output_size, input_size]`` in the model's dtype."""

    weight_names = ("weight",)

    def create_weights(self, layer: Any) -> None:
        layer.weight = _param(layer.output_size, layer.input_size)

    def init_dummy(self, layer: Any, generator: torch.Generator, std: float) -> None:
        layer.weight.normal_(0.0, std, generator=generator)

    def input_shard(self, layer: Any, name: str, rank: int) -> tuple[int, int, int] | None:
        k = layer.input_size
        return rank * k, k, k * layer.tp.size

    def apply(
        self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``F.linear``; with ``use_triton`` the skinny Triton GEMM where it
        applies (see ``skinny_supported``: up to 16 rows, bfloat16 or float16)."""
        if layer.use_triton:
            from kvserve.kernels.skinny_gemm import skinny_matmul, skinny_supported

            if skinny_supported(x, layer.weight):
                return skinny_matmul(x, layer.weight, bias)
        return F.linear(x, layer.weight, bias)

    def apply_gated(
        self, layer: Any, gate_up: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        if layer.use_triton:
            from kvserve.kernels.skinny_gemm import skinny_matmul, skinny_supported

            if skinny_supported(gate_up, layer.weight, gated=True):
                return skinny_matmul(gate_up, layer.weight, bias, gated=True)
        return None


class WeightOnlyLinearMethod(LinearMethod):
    """INT8 / INT4 weights in kvserve's packed layout, 16-bit activations."""

    quantized = True

    def __init__(self, config: QuantConfig) -> None:
        self.config = config
        self.bits = config.bits
        self.symmetric = config.symmetric
        self.act_order = config.act_order
        names = ["qweight", "scales"]
        names += [] if config.symmetric else ["zeros"]
        names += ["perm"] if config.act_order else []
        self.weight_names = tuple(names)

    def group_size(self, layer: Any) -> int:
        """The layer's group size, ``input_size`` for one group per output row."""
        return layer.input_size if self.config.group_size == -1 else self.config.group_size

    def create_weights(self, layer: Any) -> None:
        n, k = layer.output_size, layer.input_size
        group_size = self.group_size(layer)
        if k % group_size or (self.bits == 4 and k % 2):
            raise ValueError(
                f"quantization: {self.config.name} needs the input size of every quantised "
                f"linear to be a multiple of the group size {group_size}"
                f"{' and even' if self.bits == 4 else ''}; a linear has {k}"
            )
        layer.qweight = _param(n, k * self.bits // 8, dtype=torch.uint8)
        layer.scales = _param(n, k // group_size)
        layer.zeros = None if self.symmetric else _param(n, k // group_size)
        layer.perm = _param(k, dtype=torch.int64) if self.act_order else None

    def input_shard(self, layer: Any, name: str, rank: int) -> tuple[int, int, int] | None:
        """``qweight`` splits by packed bytes, ``scales`` / ``zeros`` by whole
        groups (the engine refuses a TP size that would split one), per-channel
        scales not at all; ``perm`` is the layer's to narrow."""
        k, tp_size = layer.input_size, layer.tp.size
        if name == "qweight":
            size = k * self.bits // 8
        elif name in ("scales", "zeros") and self.config.group_size != -1:
            size = k // self.config.group_size
        else:
            return None
        return rank * size, size, size * tp_size

    def quantized_weight(self, layer: Any) -> QuantizedWeight:
        return QuantizedWeight(layer.qweight, layer.scales, layer.zeros, self.bits,
                               self.group_size(layer), layer.perm)

    def init_dummy(self, layer: Any, generator: torch.Generator, std: float) -> None:
        """Random normal weights rounded to nearest, drawn a chunk of rows at a
        time (so a 70B model never holds a 16-bit layer); ``perm`` the identity."""
        n, k = layer.output_size, layer.input_size
        rows = max(1, _DUMMY_CHUNK_ELEMENTS // k)
        device = layer.qweight.device
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            weight = torch.randn(stop - start, k, generator=generator, device=device) * std
            qw = quantize_rtn(weight, self.bits, self.group_size(layer), self.symmetric,
                              scale_dtype=layer.scales.dtype)
            layer.qweight[start:stop].copy_(qw.qweight)
            layer.scales[start:stop].copy_(qw.scales)
            if layer.zeros is not None and qw.zeros is not None:
                layer.zeros[start:stop].copy_(qw.zeros)
        if layer.perm is not None:
            torch.arange(k, out=layer.perm.data)

    def process_weights_after_loading(self, layer: Any) -> None:
        """Validate the loaded layout; an identity ``perm`` is dropped (no gather)."""
        qw = self.quantized_weight(layer)
        if qw.perm is not None:
            identity = torch.arange(layer.input_size, device=qw.perm.device)
            if torch.equal(qw.perm, identity):
                layer.perm = None
            elif not torch.equal(qw.perm.sort().values, identity):
                raise ValueError("quantization: an act-order perm is not a permutation of "
                                 f"the {layer.input_size} input columns")

    def set_use_triton(self, layer: Any, enabled: bool) -> None:
        """Rearrange the weights into the kernels' layout (or back), in place."""
        if enabled != layer.use_triton:
            from kvserve.kernels import quant_matmul as kernels

            if enabled:
                tensors = kernels.repack_for_kernels(layer.qweight, layer.scales, layer.zeros,
                                                     self.bits, self.group_size(layer))
            else:
                tensors = kernels.unpack_from_kernels(layer.qweight, layer.scales, layer.zeros,
                                                      self.bits)
            for name, tensor in zip(("qweight", "scales", "zeros"), tensors, strict=True):
                if tensor is not None:
                    getattr(layer, name).data = tensor
        layer.use_triton = enabled

    def apply(
        self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if not layer.use_triton:
            return quantized_linear_reference(x, self.quantized_weight(layer), bias)
        from kvserve.kernels.quant_matmul import quant_matmul

        if layer.perm is not None:
            x = x.index_select(-1, layer.perm)
        return quant_matmul(x, layer.qweight, layer.scales, layer.zeros, self.bits,
                            self.group_size(layer), bias)

    def apply_gated(
        self, layer: Any, gate_up: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        if not layer.use_triton or layer.perm is not None:
            return None
        from kvserve.kernels.quant_matmul import quant_matmul

        return quant_matmul(gate_up, layer.qweight, layer.scales, layer.zeros, self.bits,
                            self.group_size(layer), bias, gated=True)


class Fp8LinearMethod(LinearMethod):
    """FP8 e4m3 weights with per-channel scales, FP8 activations with dynamic
    per-token scales (``quant/fp8.py`` defines the arithmetic)."""

    quantized = True
    weight_names = ("qweight", "scales")
    weight_dtype = torch.float8_e4m3fn

    def __init__(self, config: QuantConfig) -> None:
        self.config = config

    @staticmethod
    def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fp8.quantize_weight(weight)

    def create_weights(self, layer: Any) -> None:
        layer.qweight = _param(layer.output_size, layer.input_size, dtype=self.weight_dtype)
        layer.scales = _param(layer.output_size, 1, dtype=torch.float32)

    def input_shard(self, layer: Any, name: str, rank: int) -> tuple[int, int, int] | None:
        """``qweight`` splits by input columns; per-channel scales are whole."""
        if name != "qweight":
            return None
        k = layer.input_size
        return rank * k, k, k * layer.tp.size

    def init_dummy(self, layer: Any, generator: torch.Generator, std: float) -> None:
        n, k = layer.output_size, layer.input_size
        rows = max(1, _DUMMY_CHUNK_ELEMENTS // k)
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            weight = torch.randn(stop - start, k, generator=generator,
                                 device=layer.qweight.device) * std
            qweight, scales = self.quantize_weight(weight)
            layer.qweight[start:stop].copy_(qweight)
            layer.scales[start:stop].copy_(scales)

    def process_weights_after_loading(self, layer: Any) -> None:
        """Check the loaded scales: finite and >= 0 (a corrupt checkpoint fails here)."""
        if not bool(torch.isfinite(layer.scales).all()) or bool((layer.scales < 0).any()):
            raise ValueError(f"quantization: a {self.config.name} linear's weight scales are "
                             f"not all finite and >= 0 (output size {layer.output_size})")

    def apply(
        self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if layer.use_triton and _scaled_mm_supported(x, layer.qweight):
            from kvserve.kernels.fp8_quant import per_token_quant_fp8

            rows = x.reshape(-1, x.shape[-1])
            xq, x_scales = per_token_quant_fp8(rows.contiguous())
            out = torch._scaled_mm(xq, layer.qweight.t(), scale_a=x_scales,
                                   scale_b=layer.scales.t(), bias=bias, out_dtype=x.dtype)
            return out.reshape(*x.shape[:-1], layer.output_size)
        return fp8.fp8_linear_reference(x, layer.qweight, layer.scales, bias)


class Int8W8A8LinearMethod(Fp8LinearMethod):
    """INT8 weights with per-channel scales, INT8 activations with dynamic
    per-token scales (``quant/int8.py`` defines the arithmetic)."""

    weight_dtype = torch.int8

    @staticmethod
    def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return int8.quantize_weight(weight)

    def apply(
        self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if layer.use_triton and _int_mm_supported(x, layer.qweight):
            from kvserve.kernels.fp8_quant import per_token_quant_int8
            from kvserve.kernels.int8_scale import scale_int32

            rows = x.reshape(-1, x.shape[-1])
            # torch._int_mm wants more than 16 rows: a small batch gets zero rows (not read back)
            xq, x_scales = per_token_quant_int8(
                rows.contiguous(), INT_MM_MIN_ROWS if rows.shape[0] < INT_MM_MIN_ROWS else None)
            acc = torch._int_mm(xq, layer.qweight.t())
            out = scale_int32(acc, x_scales, layer.scales, bias, x.dtype, rows.shape[0])
            return out.reshape(*x.shape[:-1], layer.output_size)
        return int8.int8_linear_reference(x, layer.qweight, layer.scales, bias)


# the rows a small batch is padded to for torch._int_mm (which needs more than 16 on CUDA)
INT_MM_MIN_ROWS = 32


def _int_mm_supported(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether ``torch._int_mm`` runs this product on the GPU: CUDA, both sizes
    multiples of 8 (the rows are padded to ``INT_MM_MIN_ROWS``)."""
    n, k = qweight.shape
    return x.is_cuda and n % 8 == 0 and k % 8 == 0


def _scaled_mm_supported(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether ``torch._scaled_mm`` with row-wise scales runs this product: a
    CUDA device of compute capability 8.9 or newer, a bfloat16 output, both
    sizes multiples of 16."""
    n, k = qweight.shape
    return (x.is_cuda and x.dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0
            and torch.cuda.get_device_capability(x.device) >= (8, 9))


UNQUANTIZED = UnquantizedLinearMethod()


def linear_method(quantization: QuantConfig | None, module_names: list[str]) -> LinearMethod:
    """The method of a linear holding the HF modules ``module_names`` (several
    for a packed one): quantised unless the config leaves them in 16 bits; a
    packed linear whose parts disagree is a ValueError naming them."""
    if quantization is None:
        return UNQUANTIZED
    kept = [name for name in module_names if not quantization.quantizes(name)]
    if not kept:
        if quantization.weight_type == "fp8":
            return Fp8LinearMethod(quantization)
        if quantization.weight_type == "w8a8-int8":
            return Int8W8A8LinearMethod(quantization)
        return WeightOnlyLinearMethod(quantization)
    if len(kept) != len(module_names):
        raise ValueError(
            f"quantization: {', '.join(module_names)} run as one packed matmul, but the "
            f"checkpoint leaves only {', '.join(kept)} unquantised (ignore list "
            f"{list(quantization.ignore)}); quantise all of them or none"
        )
    return UNQUANTIZED
