"""AWQ for one decoder layer: activation-aware scales folded into the preceding
op, an optional clipping search, then round-to-nearest (Lin et al., 2023).

Each ``ScaleMapping`` scales the input channels of some linears up by ``s``
and the output of the op before them down by ``s``, so the 16-bit layer
computes the same function while the channels that see large activations
lose less to rounding:

- ``input_layernorm`` -> ``q_proj, k_proj, v_proj`` (error measured on ``self_attn``'s output);
- ``v_proj`` -> ``o_proj`` (on ``o_proj``'s output). With grouped-query
  attention the query heads that share a KV head share its scales, so a
  scale of ``v_proj``'s output row serves every ``o_proj`` column fed by it;
- ``post_attention_layernorm`` -> ``gate_proj, up_proj`` (on ``mlp``'s output);
- ``up_proj`` -> ``down_proj`` (on ``down_proj``'s output).

For each mapping ``s = mean|x|^a / mean_w^(1 - a)`` (``mean_w``: the mean over
output rows of ``|W|`` relative to its group's maximum), normalised so
``max(s) * min(s) = 1``, for ``a`` on a grid of ``GRID`` points in [0, 1); the
candidate whose rounded weights ``Q(W * s) / s`` give the least squared
error of the inspected module's output on the calibration inputs wins,
``s = 1`` (plain rounding) included as a candidate. The clipping search
then shrinks each group's range (``1 - i / GRID`` of its maximum magnitude,
``i < GRID / 2``) where that lowers the group's share of the output error on
``CLIP_TOKENS`` calibration rows; ``q_proj`` / ``k_proj`` are left out (their
error shows in attention scores, not in their own outputs). AWQ is asymmetric
by default (see ``options.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvserve.quantize.layer_runner import LayerRunner, weight_of
from kvserve.quantize.rtn import WeightScheme, fake_quantize

GRID = 20
CLIP_TOKENS = 512
CLIP_SKIPPED = ("self_attn.q_proj", "self_attn.k_proj")
# elements of the [tokens, rows, groups] partial outputs the clipping search holds at once
CLIP_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class ScaleMapping:
    """``prev``'s output channels feed the input channels of ``linears``; the
    search measures ``inspect``'s output (``inspect``'s input is ``linears[0]``'s)."""

    prev: str
    linears: tuple[str, ...]
    inspect: str


MAPPINGS = (
    ScaleMapping("input_layernorm",
                 ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
    ScaleMapping("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
    ScaleMapping("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    ScaleMapping("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
)


@dataclass(frozen=True)
class HeadSharing:
    """How ``o_proj``'s input columns map onto ``v_proj``'s output rows:
    ``num_heads`` query heads of ``head_dim``, ``num_heads // num_kv_heads`` per KV head."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    def reduce(self, per_column: torch.Tensor) -> torch.Tensor:
        """``[num_heads * head_dim]`` -> ``[num_kv_heads * head_dim]``: the mean over
        the query heads of each KV head."""
        rep = self.num_heads // self.num_kv_heads
        return per_column.view(self.num_kv_heads, rep, self.head_dim).mean(1).reshape(-1)

    def expand(self, per_row: torch.Tensor) -> torch.Tensor:
        """``[num_kv_heads * head_dim]`` -> ``[num_heads * head_dim]``."""
        rep = self.num_heads // self.num_kv_heads
        return (per_row.view(self.num_kv_heads, 1, self.head_dim)
                .expand(self.num_kv_heads, rep, self.head_dim).reshape(-1))


def activation_mean(inputs: list[torch.Tensor]) -> torch.Tensor:
    """Mean ``|x|`` per input channel over every calibration row."""
    total = sum(x.abs().reshape(-1, x.shape[-1]).sum(0) for x in inputs)
    return total / sum(x.numel() // x.shape[-1] for x in inputs)  # type: ignore[return-value]


def weight_mean(weights: list[torch.Tensor], group: int) -> torch.Tensor:
    """Mean over output rows of ``|W|`` relative to its group's maximum, per input channel."""
    w = torch.cat(weights).abs()
    grouped = w.view(-1, group)
    relative = grouped / grouped.amax(dim=1, keepdim=True).clamp(min=1e-12)
    return relative.view_as(w).mean(0)


def search_scales(
    runner: LayerRunner, mapping: ScaleMapping, scheme: WeightScheme,
    sharing: HeadSharing | None,
) -> torch.Tensor:
    """The best scales for ``mapping``, one per output channel of ``prev``."""
    inputs = runner.capture([mapping.linears[0]])[mapping.linears[0]]
    reference = [runner.call(mapping.inspect, x, b) for b, x in enumerate(inputs)]
    weights = [runner.weight(name) for name in mapping.linears]
    originals = [w.detach().clone() for w in weights]
    group = scheme.group(originals[0].shape[1])
    x_mean, w_mean = activation_mean(inputs), weight_mean(originals, group)
    if sharing is not None:
        x_mean, w_mean = sharing.reduce(x_mean), sharing.reduce(w_mean)
    candidates = [torch.ones_like(x_mean)]
    for i in range(GRID):
        alpha = i / GRID
        s = (x_mean.pow(alpha) / w_mean.pow(1 - alpha)).clamp(min=1e-4)
        candidates.append(s / (s.max() * s.min()).sqrt())
    best, best_loss = candidates[0], float("inf")
    try:
        for s in candidates:
            columns = sharing.expand(s) if sharing is not None else s
            for weight, w in zip(weights, originals, strict=True):
                weight.data.copy_(fake_quantize(w * columns, scheme) / columns)
            loss = sum(float((runner.call(mapping.inspect, x, b) - ref).pow(2).sum())
                       for b, (x, ref) in enumerate(zip(inputs, reference, strict=True)))
            if loss < best_loss:
                best, best_loss = s, loss
    finally:
        for weight, w in zip(weights, originals, strict=True):
            weight.data.copy_(w)
    return best


@torch.no_grad()
def fold_scales(
    layer: nn.Module, mapping: ScaleMapping, scales: torch.Tensor, sharing: HeadSharing | None
) -> None:
    """``prev``'s output divided by ``scales``, the linears' input columns multiplied:
    the unquantised layer computes the same function."""
    prev = weight_of(layer, mapping.prev)
    prev.div_(scales.view(-1, *([1] * (prev.dim() - 1))))
    bias = getattr(layer.get_submodule(mapping.prev), "bias", None)
    if bias is not None:
        bias.div_(scales)
    columns = sharing.expand(scales) if sharing is not None else scales
    for name in mapping.linears:
        weight_of(layer, name).mul_(columns)


@torch.no_grad()
def search_clip(weight: torch.Tensor, x: torch.Tensor, scheme: WeightScheme) -> torch.Tensor:
    """Per ``[row, group]`` the largest magnitude to keep, ``[N, K // group]``."""
    n, k = weight.shape
    group = scheme.group(k)
    w = weight.view(n, k // group, group)
    xg = x.view(x.shape[0], k // group, group)
    best_max = w.abs().amax(dim=-1)  # [N, groups]
    rows_per_chunk = max(1, CLIP_CHUNK_ELEMENTS // (x.shape[0] * (k // group)))
    for r0 in range(0, n, rows_per_chunk):
        chunk = w[r0:r0 + rows_per_chunk]
        original_max = chunk.abs().amax(dim=-1, keepdim=True)
        reference = torch.einsum("tgk,ngk->tng", xg, chunk)
        min_err = torch.full(original_max.shape[:2], float("inf"), device=w.device)
        for i in range(GRID // 2):
            max_val = original_max * (1 - i / GRID)
            clipped = torch.maximum(torch.minimum(chunk, max_val), -max_val)
            quantized = fake_quantize(clipped.reshape(-1, k), scheme).view_as(chunk)
            err = (torch.einsum("tgk,ngk->tng", xg, quantized) - reference).pow(2).mean(0)
            better = err < min_err
            min_err[better] = err[better]
            best_max[r0:r0 + rows_per_chunk][better] = max_val[..., 0][better]
    return best_max


@torch.no_grad()
def apply_clip(runner: LayerRunner, names: list[str], scheme: WeightScheme) -> None:
    """Clip each linear of ``names`` (q/k excepted) to its searched range."""
    names = [n for n in names if n not in CLIP_SKIPPED]
    captured = runner.capture(names)
    for name in names:
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in captured[name]])
        rows = torch.linspace(0, x.shape[0] - 1, min(CLIP_TOKENS, x.shape[0])).long()
        weight = runner.weight(name)
        max_val = search_clip(weight.detach().float(), x[rows].float(), scheme)
        limit = max_val.repeat_interleave(scheme.group(weight.shape[1]), dim=1)
        weight.copy_(torch.maximum(torch.minimum(weight, limit), -limit))
