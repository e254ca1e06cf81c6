"""Dense projections of a decoder, each layer with a per-shard weight loader.

Owns ``Linear`` and its tensor-parallel roles, plus the packed ``QKVLinear``
and ``MergedColumnLinear`` that load Hugging Face's separate
``q_proj/k_proj/v_proj`` and ``gate_proj/up_proj`` tensors into one matmul.
With a TP group of ``tp`` ranks (``distributed/parallel_state.py``: read
once, in the constructor) a ``ColumnLinear`` holds ``1 / tp`` of the output
rows (q by query heads, k and v by KV heads, gate and up each by rows) and
needs no communication; a ``RowLinear`` holds ``1 / tp`` of the input
columns and sums its partial output over the ranks with one all-reduce,
adding the bias once. Of one rank, both are the plain linear.

How a linear stores and multiplies its weight is its ``quant_method``
(``quant/methods.py``): a 16-bit ``weight``, or a weight-only quantised one
(``qweight``, ``scales``, ...). Every parameter a method creates has the
output dim first, so a packed linear stacks its shards by rows whatever
the method.

Every layer has ``weight_loader(param, loaded, shard_id)`` for its parameters;
the model's ``load_weights`` routes checkpoint tensors through it (found via
``get_weight_loader``). A loader takes the whole checkpoint tensor as it
streams and copies only its rank's slice: rows of a column-parallel
parameter (the output dim is first in every method's layout), columns of a
row-parallel one where the method says (``LinearMethod.input_shard``:
quantised weights split by packed bytes and whole groups, per-channel scales
are whole on every rank).

With ``use_triton`` (see ``layers/custom_ops.py``) the method runs Triton
kernels where they apply: a one-row 16-bit forward, a batch-1 decode step's,
runs the skinny GEMM of ``kernels/skinny_gemm.py``, the down projection
with the SiLU gate fused in (``forward_gated``); quantised weights run
``kernels/quant_matmul.py``. Without the flag every input runs the torch
reference (``F.linear``, or a dequantised float32 matmul), the oracle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from kvserve.distributed.communicator import Communicator
from kvserve.distributed.parallel_state import building_state
from kvserve.distributed.sharding import split_heads
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


def narrow_checked(loaded: torch.Tensor, dim: int, start: int, size: int,
                   full_size: int) -> torch.Tensor:
    """``loaded.narrow(dim, start, size)`` once ``loaded`` is checked to have
    ``full_size`` along ``dim`` (a rank's slice of a whole checkpoint tensor)."""
    if loaded.dim() <= dim or loaded.shape[dim] != full_size:
        raise ValueError(f"shape {tuple(loaded.shape)} does not match the parameter's: "
                         f"expected {full_size} along dim {dim}")
    return loaded.narrow(dim, start, size)


def _check_divides(size: int, tp: Communicator, what: str) -> int:
    if size % tp.size:
        raise ValueError(f"tensor_parallel_size={tp.size} does not divide the {what} ({size})")
    return size // tp.size


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

    @property
    def local_bias(self) -> nn.Parameter | None:
        """The bias this rank adds before ``reduce`` (a row-parallel one: rank 0 only)."""
        return self.bias

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        default_weight_loader(param, loaded, shard_id)

    def forward_local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's output before ``reduce`` (a LoRA wrapper adds its delta here)."""
        return self.quant_method.apply(self, x, self.local_bias)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The layer's output from this rank's ``forward_local`` one (the identity
        but for a row-parallel linear, whose partial sums are all-reduced)."""
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def forward_gated(self, gate_up: torch.Tensor, act_fn: nn.Module) -> torch.Tensor:
        """``self(act_fn(gate_up))``. With ``use_triton`` and a SiLU gate, the
        method may compute the activation as it loads ``gate_up`` (a one-row
        16-bit input, a quantised one): one kernel instead of two, the same
        rounding."""
        if isinstance(act_fn, SiluAndMul):
            out = self.quant_method.apply_gated(self, gate_up, self.local_bias)
            if out is not None:
                return self.reduce(out)
        return self(act_fn(gate_up))

    def extra_repr(self) -> str:
        method = getattr(self.quant_method, "config", None)
        quant = f", quant={method.name}" if method is not None else ""
        return (f"in={self.input_size}, out={self.output_size}, "
                f"bias={self.bias is not None}{quant}")


class ColumnLinear(Linear):
    """A linear whose output rows are split over the TP ranks, by shards.

    ``shards`` maps each shard id (None for a plain linear; ``"q"``, ``"k"``,
    ``"v"`` or 0, 1 for a packed one) to a ``ColumnShard``: where its rows sit
    in this rank's output and where they start in the checkpoint tensor.
    """

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False,
        quant_method: LinearMethod = UNQUANTIZED,
    ) -> None:
        tp = building_state().tp
        rows = _check_divides(output_size, tp, "output size")
        self._init_shards(input_size, {None: (rows, tp.rank * rows, output_size)}, bias,
                          quant_method, tp)

    def _init_shards(
        self, input_size: int, shards: dict[ShardId, tuple[int, int, int]], bias: bool,
        quant_method: LinearMethod, tp: Communicator,
    ) -> None:
        """``shards``: id -> (rows on this rank, first row in the checkpoint
        tensor, the checkpoint tensor's rows), in output order."""
        self.tp = tp
        self.shards: dict[ShardId, ColumnShard] = {}
        offset = 0
        for shard_id, (rows, start, full_rows) in shards.items():
            self.shards[shard_id] = ColumnShard(offset, rows, start, full_rows)
            offset += rows
        self._perm_loaded = False
        Linear.__init__(self, input_size, offset, bias, quant_method)

    @property
    def shard_offsets(self) -> dict[ShardId, tuple[int, int]]:
        """Shard id -> (first row, rows) in this rank's output."""
        return {shard_id: (s.offset, s.size) for shard_id, s in self.shards.items()}

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        if shard_id is None and None not in self.shards:
            # an already packed checkpoint tensor: its shards' rows one after another
            if param is getattr(self, "perm", None):
                _copy_checked(param.data, loaded)
                self._perm_loaded = True
                return
            full_rows = sum(shard.full_size for shard in self.shards.values())
            start = 0
            for part_id, shard in self.shards.items():
                part = narrow_checked(loaded, 0, start, shard.full_size, full_rows)
                self.weight_loader(param, part, part_id)
                start += shard.full_size
            return
        if shard_id not in self.shards:
            raise ValueError(
                f"unknown shard '{shard_id}'; expected one of {list(self.shards)}"
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
        shard = self.shards[shard_id]
        # rows of the packed matrix: weight [size, input_size]; qweight, scales,
        # zeros [size, ...]; bias [size]
        _copy_checked(param.data.narrow(0, shard.offset, shard.size),
                      narrow_checked(loaded, 0, shard.start, shard.size, shard.full_size))


class ColumnShard(NamedTuple):
    """One shard of a column-parallel linear on this rank."""

    offset: int  # its first row in this rank's output
    size: int  # its rows on this rank
    start: int  # where they start in the checkpoint tensor
    full_size: int  # the checkpoint tensor's rows


class RowLinear(Linear):
    """A linear whose input columns are split over the TP ranks: each rank
    multiplies its slice of the input (the output of a column-parallel layer
    or of attention over its heads) and the partial outputs are summed with
    one all-reduce; the bias is added once, by rank 0, before it."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False,
        quant_method: LinearMethod = UNQUANTIZED,
    ) -> None:
        self.tp = building_state().tp
        self.full_input_size = input_size
        super().__init__(_check_divides(input_size, self.tp, "input size"), output_size, bias,
                         quant_method)

    @property
    def local_bias(self) -> nn.Parameter | None:
        return self.bias if self.tp.rank == 0 else None

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"parameter is not packed but got shard '{shard_id}'")
        if self.tp.size == 1 or param is self.bias:
            _copy_checked(param.data, loaded)
            return
        names = [n for n in self.quant_method.weight_names if getattr(self, n) is param]
        if not names:
            raise ValueError("not a parameter of this linear")
        name = names[0]
        if name == "perm":
            _copy_checked(param.data, self._local_perm(loaded))
            return
        shard = self.quant_method.input_shard(self, name, self.tp.rank)
        if shard is not None:
            start, size, full_size = shard
            loaded = narrow_checked(loaded, 1, start, size, full_size)
        _copy_checked(param.data, loaded)

    def _local_perm(self, loaded: torch.Tensor) -> torch.Tensor:
        """This rank's act-order permutation: positions ``[r*k, (r+1)*k)`` of the
        whole one, which must stay inside the rank's own input columns."""
        k = self.input_size
        start = self.tp.rank * k
        local = narrow_checked(loaded, 0, start, k, self.full_input_size) - start
        if bool(((local < 0) | (local >= k)).any()):
            raise ValueError(
                f"an act-order permutation (g_idx) that mixes input columns across the "
                f"{self.tp.size} tensor-parallel slices of {self.full_input_size} columns "
                "cannot run row-parallel; run this checkpoint with tensor_parallel_size=1 "
                "(or pipeline parallelism), or quantise it without act-order (desc_act)"
            )
        return local

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.quant_method.apply(self, x, self.local_bias))

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(y)


class QKVLinear(ColumnLinear):
    """The q, k and v projections as one matmul; shards ``"q"``, ``"k"``, ``"v"``.

    Output layout on each rank: ``[q (num_heads * head_dim) | k (num_kv_heads *
    head_dim) | v (same)]`` with this rank's heads (``distributed/sharding.py``:
    ``split_heads``; fewer KV heads than ranks are replicated).
    """

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
        bias: bool = False, quant_method: LinearMethod = UNQUANTIZED,
    ) -> None:
        tp = building_state().tp
        split = split_heads(num_heads, num_kv_heads, tp.size, tp.rank)
        self.head_dim = head_dim
        self.num_heads = split.num_heads
        self.num_kv_heads = split.num_kv_heads
        self.q_size = split.num_heads * head_dim
        self.kv_size = split.num_kv_heads * head_dim
        kv_start, kv_full = split.kv_head_start * head_dim, num_kv_heads * head_dim
        shards: dict[ShardId, tuple[int, int, int]] = {
            "q": (self.q_size, split.head_start * head_dim, num_heads * head_dim),
            "k": (self.kv_size, kv_start, kv_full),
            "v": (self.kv_size, kv_start, kv_full),
        }
        self._init_shards(hidden_size, shards, bias, quant_method, tp)


class MergedColumnLinear(ColumnLinear):
    """Column linears of the given output sizes as one matmul; shards ``0, 1, ...``,
    each split by rows over the TP ranks.

    Used for ``gate_up_proj`` (shard 0 = gate, shard 1 = up).
    """

    def __init__(
        self, input_size: int, output_sizes: Sequence[int], bias: bool = False,
        quant_method: LinearMethod = UNQUANTIZED,
    ) -> None:
        tp = building_state().tp
        self.output_sizes = list(output_sizes)
        shards: dict[ShardId, tuple[int, int, int]] = {}
        for i, size in enumerate(output_sizes):
            rows = _check_divides(size, tp, f"output size of shard {i}")
            shards[i] = (rows, tp.rank * rows, size)
        self._init_shards(input_size, shards, bias, quant_method, tp)
