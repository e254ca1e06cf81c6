"""GPTQ for one linear: quantise ``W [N, K]`` column by column, spreading each
column's rounding error over the columns not yet quantised so that the
layer's output on the calibration inputs moves least (Frantar et al., 2022).

The input statistics are the Hessian of the layer's squared output error,
``H = 2 X^T X / n`` over the ``n`` calibration rows ``X [n, K]``
(``HessianAccumulator``, summed in float64). ``gptq_quantize`` then:

- zeroes dead input columns (``diag(H) == 0``: never active, nothing to fit);
- adds ``dampening * mean(diag(H))`` to the diagonal, and where the Cholesky
  factorisation still fails retries with ten times more (the caller is told
  the dampening used); the factorisations run in float64;
- takes ``U``, the upper Cholesky factor of ``H^-1``: the error of column
  ``j`` divided by ``U[j, j]`` times row ``j`` of ``U`` is the optimal update
  of the later columns;
- walks the columns in blocks of 128: inside a block the updates are applied
  column by column, to the later blocks once per block ("lazy batch" updates);
- computes each group's scale and zero point when the walk reaches the
  group, from the weights as updated so far (groups lie inside one block);
  per-channel scales are fixed from the whole row before the walk.

With ``act_order`` the columns are walked by decreasing ``diag(H)``, the
most active inputs first, while each group's scale and zero point are fixed
from the original weights before the walk (compressed-tensors'
``actorder: weight``): the groups stay consecutive columns, so the written
checkpoint needs no ``g_idx`` and runs on the plain kernels. Rounding follows
``quant/packing.py``'s ``quantize_rtn`` (scales stored in ``scale_dtype``
before they are used). Nothing here knows about models or files.
"""

from __future__ import annotations

import torch

from kvserve.quant.packing import QuantizedWeight, pack_int4, zero_points
from kvserve.quantize.rtn import WeightScheme, rtn_quantize

BLOCK_SIZE = 128  # a multiple of every group size, so a group never straddles two blocks
MAX_DAMPENING_RETRIES = 4


class HessianAccumulator:
    """``2 X^T X / n`` over every row passed to ``add``, summed in float64."""

    def __init__(self, size: int, device: torch.device | str) -> None:
        self.sum = torch.zeros(size, size, dtype=torch.float64, device=device)
        self.num_rows = 0

    def add(self, x: torch.Tensor) -> None:
        """Add the rows of ``x [..., size]``."""
        rows = x.reshape(-1, x.shape[-1]).float()
        self.sum += (rows.T @ rows).double()
        self.num_rows += rows.shape[0]

    def hessian(self) -> torch.Tensor:
        if self.num_rows == 0:
            raise ValueError("GPTQ: no calibration rows reached this linear")
        return self.sum * (2.0 / self.num_rows)


def group_params(weight: torch.Tensor, scheme: WeightScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``(scales, zero points)`` ``[N, K // group]`` of ``weight [N, K]``
    exactly as ``quantize_rtn`` computes them (scales rounded to the scheme's dtype)."""
    qw = rtn_quantize(weight, scheme)
    return qw.scales.float(), zero_points(qw).float()


def inverse_cholesky(hessian: torch.Tensor, dampening: float) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of ``(H + d * mean(diag H) * I)^-1`` in float32, and
    the ``d`` used: ``dampening``, or ten times more per failed factorisation."""
    eye = torch.eye(hessian.shape[0], dtype=torch.float64, device=hessian.device)
    mean_diag = float(hessian.diagonal().mean())
    damp = dampening
    for _ in range(MAX_DAMPENING_RETRIES + 1):
        lower, info = torch.linalg.cholesky_ex(hessian + damp * mean_diag * eye)
        if int(info) == 0:
            upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
            if int(info) == 0:
                return upper.float(), damp
        damp *= 10.0
    raise ValueError(f"GPTQ: the Hessian is not positive definite even with dampening "
                     f"{damp / 10.0:g}; the calibration inputs are degenerate")


def gptq_quantize(
    weight: torch.Tensor, hessian: torch.Tensor, scheme: WeightScheme,
    act_order: bool = False, dampening: float = 0.01,
) -> tuple[QuantizedWeight, float]:
    """``weight [N, K]`` quantised by GPTQ against ``hessian [K, K]`` (float64);
    returns the layout and the dampening actually used (see the module docstring)."""
    n, k = weight.shape
    group = scheme.group(k)
    w = weight.detach().to(hessian.device, torch.float32).clone()
    h = hessian.clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    static_groups = act_order or scheme.group_size == -1
    if static_groups:
        scales, zeros = group_params(w, scheme)
    else:
        scales = torch.zeros(n, k // group, device=w.device)
        zeros = torch.zeros_like(scales)
    perm = torch.argsort(h.diagonal(), descending=True, stable=True) if act_order else None
    if perm is not None:
        w, h = w[:, perm], h[perm][:, perm]
    hinv, damp_used = inverse_cholesky(h, dampening)
    group_of = None
    if static_groups:
        columns = perm if perm is not None else torch.arange(k, device=w.device)
        group_of = (columns // group).tolist()
    q = _quantize_columns(w, hinv, scales, zeros, group_of, scheme)
    if perm is not None:
        q = q[:, torch.argsort(perm)]
    return QuantizedWeight(
        qweight=pack_int4(q) if scheme.bits == 4 else q,
        scales=scales.to(scheme.scale_dtype),
        zeros=None if scheme.symmetric else zeros.to(scheme.scale_dtype),
        bits=scheme.bits,
        group_size=group,
    ), damp_used


def _quantize_columns(
    weight: torch.Tensor, hinv: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    group_of: list[int] | None, scheme: WeightScheme,
) -> torch.Tensor:
    """The GPTQ walk over ``weight``'s columns (updated in place); returns the
    integer values ``[N, K]`` uint8. ``group_of[j]``: column ``j``'s fixed group;
    None: each group's ``scales`` / ``zeros`` are filled when the walk reaches it."""
    n, k = weight.shape
    group = scheme.group(k)
    max_q = 2**scheme.bits - 1
    q_all = torch.zeros(n, k, dtype=torch.uint8, device=weight.device)
    for i1 in range(0, k, BLOCK_SIZE):
        i2 = min(i1 + BLOCK_SIZE, k)
        block = weight[:, i1:i2].clone()  # [N, B], updated column by column
        errors = torch.zeros_like(block)
        hinv_block = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            column = i1 + i
            if group_of is None and column % group == 0:
                g = column // group
                scales[:, g:g + 1], zeros[:, g:g + 1] = group_params(
                    block[:, i:i + group], scheme)
            g = column // group if group_of is None else group_of[column]
            scale, zero = scales[:, g], zeros[:, g]
            w = block[:, i]
            q = torch.clamp(torch.round(w / scale + zero), 0, max_q)
            q_all[:, column] = q.to(torch.uint8)
            err = (w - (q - zero) * scale) / hinv_block[i, i]
            block[:, i:] -= err[:, None] * hinv_block[i, i:][None, :]
            errors[:, i] = err
        weight[:, i2:] -= errors @ hinv[i1:i2, i2:]
    return q_all
