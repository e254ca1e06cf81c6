"""Dense projections of a decoder, each layer with a per-shard weight loader.

Owns ``Linear`` and its tensor-parallel roles (``ColumnLinear`` splits the
output dim, ``RowLinear`` the input dim, once TP exists), plus the packed
``QKVLinear`` and ``MergedColumnLinear`` that load Hugging Face's separate
``q_proj/k_proj/v_proj`` and ``gate_proj/up_proj`` tensors into one matmul.

Every layer has ``weight_loader(param, loaded, shard_id)`` for its parameters;
the model's ``load_weights`` routes checkpoint tensors through it (found via
``get_weight_loader``). With TP a loader will also narrow ``loaded`` to its
rank's slice; nothing else needs to change.
Quantized weights and TP communication are not handled here.

With ``use_triton`` (see ``layers/custom_ops.py``) a one-row forward in 16
bits, a batch-1 decode step's, runs the skinny GEMM of
``kernels/skinny_gemm.py`` (imported only then), the down projection with
the SiLU gate fused in (``forward_gated``); every other input, and every
input without the flag, runs ``F.linear``, the oracle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.layers.activation import SiluAndMul

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


def apply_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, use_triton: bool
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; with ``use_triton``, the skinny Triton GEMM
    where it applies (see ``skinny_supported``: one row, bfloat16 or float16)."""
    if use_triton:
        from kvserve.kernels.skinny_gemm import skinny_matmul, skinny_supported

        if skinny_supported(x, weight):
            return skinny_matmul(x, weight, bias)
    return F.linear(x, weight, bias)


def _new_param(*shape: int) -> nn.Parameter:
    # dtype and device come from the caller's defaults (the loader sets them)
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` of shape ``[output_size, input_size]``."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.use_triton = False
        self.weight = _new_param(output_size, input_size)  # [output_size, input_size]
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = _new_param(output_size)  # [output_size]

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        default_weight_loader(param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_linear(x, self.weight, self.bias, self.use_triton)

    def forward_gated(self, gate_up: torch.Tensor, act_fn: nn.Module) -> torch.Tensor:
        """``self(act_fn(gate_up))``. With ``use_triton`` and a SiLU gate, a
        one-row input runs the skinny GEMM with the activation computed as it
        loads ``gate_up``: one kernel instead of two, the same rounding."""
        if self.use_triton and isinstance(act_fn, SiluAndMul):
            from kvserve.kernels.skinny_gemm import skinny_matmul, skinny_supported

            if skinny_supported(gate_up, self.weight):
                return skinny_matmul(gate_up, self.weight, self.bias, gated=True)
        return self(act_fn(gate_up))

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class ColumnLinear(Linear):
    """A linear whose output dim TP will split; today it is replicated."""


class RowLinear(Linear):
    """A linear whose input dim TP will split (then all-reduce); today replicated."""


class _PackedColumnLinear(ColumnLinear):
    """Several column linears stacked along the output dim, loaded shard by shard."""

    def __init__(
        self, input_size: int, shard_sizes: dict[str | int, int], bias: bool = False
    ) -> None:
        super().__init__(input_size, sum(shard_sizes.values()), bias)
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
        offset, size = self.shard_offsets[shard_id]
        # weight: [size, input_size] rows of the packed matrix; bias: [size]
        _copy_checked(param.data.narrow(0, offset, size), loaded)


class QKVLinear(_PackedColumnLinear):
    """The q, k and v projections as one matmul; shards ``"q"``, ``"k"``, ``"v"``.

    Output layout: ``[q (num_heads * head_dim) | k (num_kv_heads * head_dim) | v (same)]``.
    """

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        sizes: dict[str | int, int] = {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}
        super().__init__(hidden_size, sizes, bias)


class MergedColumnLinear(_PackedColumnLinear):
    """Column linears of the given output sizes as one matmul; shards ``0, 1, ...``.

    Used for ``gate_up_proj`` (shard 0 = gate, shard 1 = up).
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        sizes: dict[str | int, int] = dict(enumerate(output_sizes))
        super().__init__(input_size, sizes, bias)
