"""Dense projections of a decoder, each layer with a per-shard weight loader.

Owns ``Linear`` and its tensor-parallel roles (``ColumnLinear`` splits the
output dim, ``RowLinear`` the input dim, once TP exists), plus the packed
``QKVLinear`` and ``MergedColumnLinear`` that load Hugging Face's separate
``q_proj/k_proj/v_proj`` and ``gate_proj/up_proj`` tensors into one matmul.

How a linear stores and multiplies its weight is its ``quant_method``
(``quant/methods.py``): a 16-bit ``weight``, or a weight-only quantised one
(``qweight``, ``scales``, ...). Every parameter a method creates has the
output dim first, so a packed linear stacks its shards by rows whatever
the method.

Every layer has ``weight_loader(param, loaded, shard_id)`` for its parameters;
the model's ``load_weights`` routes checkpoint tensors through it (found via
``get_weight_loader``). With TP a loader will also narrow ``loaded`` to its
rank's slice; nothing else needs to change. TP communication is not handled here.

With ``use_triton`` (see ``layers/custom_ops.py``) the method runs Triton
kernels where they apply: a one-row 16-bit forward, a batch-1 decode step's,
runs the skinny GEMM of ``kernels/skinny_gemm.py``, the down projection
with the SiLU gate fused in (``forward_gated``); quantised weights run
``kernels/quant_matmul.py``. Without the flag every input runs the torch
reference (``F.linear``, or a dequantised float32 matmul), the oracle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from kvserve.layers.activation import SiluAndMul
from kvserve.quant.methods import UNQUANTIZED, LinearMethod
from kvserve.quant.methods import linear_method as linear_method

ShardId = str | int | None
WeightLoader = Callable[[nn.Parameter, torch.Tensor, ShardId], None]


def get_weight_loader(model: nn.Module, param_name: str) -> WeightLoader:
    """The loader for ``model``'s parameter ``param_name``: its owning module's
    ``weight_loader`` method, else a plain shape-checked copy.

    Loaders are looked up through the module rather than stored on the
    parameter, so no parameter -> bound method -> module -> parameter cycle
    keeps device memory alive after the model is dropped.
    """
    module_name = param_name.rpartition(".")[0]
    module = model.get_submodule(module_name) if module_name else model
    loader: WeightLoader = getattr(module, "weight_loader", default_weight_loader)
    return loader


def _copy_checked(dst: torch.Tensor, loaded: torch.Tensor) -> None:
    if tuple(dst.shape) != tuple(loaded.shape):
        raise ValueError(
            f"shape {tuple(loaded.shape)} does not match the parameter's {tuple(dst.shape)}"
        )
    with torch.no_grad():
        dst.copy_(loaded)


def default_weight_loader(
    param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None
) -> None:
    """Copy a whole tensor into ``param``, casting dtype and moving device."""
    if shard_id is not None:
        raise ValueError(f"parameter is not packed but got shard '{shard_id}'")
    _copy_checked(param.data, loaded)


def _new_param(*shape: int) -> nn.Parameter:
    # dtype and device come from the caller's defaults (the loader sets them)
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` of shape ``[output_size, input_size]``,
    stored as its ``quant_method`` says (16-bit unless given one)."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False,
        quant_method: LinearMethod = UNQUANTIZED,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.use_triton = False
        self.quant_method = quant_method
        quant_method.create_weights(self)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = _new_param(output_size)  # [output_size]

    @property
    def params_dtype(self) -> torch.dtype:
        """The model dtype the layer computes in (its scales' if quantised)."""
        name = "scales" if self.quant_method.quantized else "weight"
        param: torch.Tensor = getattr(self, name)
        return param.dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        default_weight_loader(param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def forward_gated(self, gate_up: torch.Tensor, act_fn: nn.Module) -> torch.Tensor:
        """``self(act_fn(gate_up))``. With ``use_triton`` and a SiLU gate, the
        method may compute the activation as it loads ``gate_up`` (a one-row
        16-bit input, a quantised one): one kernel instead of two, the same
        rounding."""
        if isinstance(act_fn, SiluAndMul):
            out = self.quant_method.apply_gated(self, gate_up, self.bias)
            if out is not None:
                return out
        return self(act_fn(gate_up))

    def extra_repr(self) -> str:
        method = getattr(self.quant_method, "config", None)
        quant = f", quant={method.name}" if method is not None else ""
        return (f"in={self.input_size}, out={self.output_size}, "
                f"bias={self.bias is not None}{quant}")


class ColumnLinear(Linear):
    """A linear whose output dim TP will split; today it is replicated."""


class RowLinear(Linear):
    """A linear whose input dim TP will split (then all-reduce); today replicated."""


class _PackedColumnLinear(ColumnLinear):
    """Several column linears stacked along the output dim, loaded shard by shard."""

    def __init__(
        self, input_size: int, shard_sizes: dict[str | int, int], bias: bool = False,
        quant_method: LinearMethod = UNQUANTIZED,
    ) -> None:
        super().__init__(input_size, sum(shard_sizes.values()), bias, quant_method)
        self._perm_loaded = False
        self.shard_offsets: dict[str | int, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        if shard_id is None:
            # an already packed checkpoint tensor
            _copy_checked(param.data, loaded)
            return
        if shard_id not in self.shard_offsets:
            raise ValueError(
                f"unknown shard '{shard_id}'; expected one of {list(self.shard_offsets)}"
            )
        if param is getattr(self, "perm", None):
            # act-order: the shards share their input, so one permutation of it
            if self._perm_loaded and not torch.equal(param.data, loaded.to(param.device)):
                raise ValueError(
                    f"shard '{shard_id}' has another act-order permutation (g_idx) than the "
                    "shards loaded before it; a packed linear needs one input order"
                )
            _copy_checked(param.data, loaded)
            self._perm_loaded = True
            return
        offset, size = self.shard_offsets[shard_id]
        # rows of the packed matrix: weight [size, input_size]; qweight, scales,
        # zeros [size, ...]; bias [size]
        _copy_checked(param.data.narrow(0, offset, size), loaded)


class QKVLinear(_PackedColumnLinear):
    """The q, k and v projections as one matmul; shards ``"q"``, ``"k"``, ``"v"``.

    Output layout: ``[q (num_heads * head_dim) | k (num_kv_heads * head_dim) | v (same)]``.
    """

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
        bias: bool = False, quant_method: LinearMethod = UNQUANTIZED,
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        sizes: dict[str | int, int] = {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}
        super().__init__(hidden_size, sizes, bias, quant_method)


class MergedColumnLinear(_PackedColumnLinear):
    """Column linears of the given output sizes as one matmul; shards ``0, 1, ...``.

    Used for ``gate_up_proj`` (shard 0 = gate, shard 1 = up).
    """

    def __init__(
        self, input_size: int, output_sizes: Sequence[int], bias: bool = False,
        quant_method: LinearMethod = UNQUANTIZED,
    ) -> None:
        self.output_sizes = list(output_sizes)
        sizes: dict[str | int, int] = dict(enumerate(output_sizes))
        super().__init__(input_size, sizes, bias, quant_method)
