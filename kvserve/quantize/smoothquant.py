"""SmoothQuant for one decoder layer (Xiao et al., 2022): move the activations'
outliers into the weights, then round the weights to int8 per channel for
INT8 W8A8 serving (``--quantization w8a8-int8`` / ``quant/int8.py``).

For each linear group that follows a norm (AWQ's mappings of the same name:
``input_layernorm`` -> ``q_proj, k_proj, v_proj``; ``post_attention_layernorm``
-> ``gate_proj, up_proj``) and each input channel ``j``::

    s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)

``max|X_j|`` over every calibration token, ``max|W_j|`` over the output rows
of all the group's linears; the norm's weight is divided by ``s`` and the
linears' columns multiplied by it (``awq.fold_scales``), which leaves the
16-bit layer's function unchanged while the per-token int8 rounding of the
smoothed activations loses less to the outlier channels. A channel where
either maximum is 0 keeps ``s = 1``. ``o_proj`` and ``down_proj`` take their
inputs from attention and SiLU-mul, which have no per-channel weight to fold
``1 / s`` into, so they stay unsmoothed (as in llm-compressor's default
mappings). llm-compressor measures ``max - min`` of X and ``2 max|W|``; this
follows the paper.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.quant import int8
from kvserve.quant.packing import QuantizedWeight
from kvserve.quantize import awq
from kvserve.quantize.layer_runner import LayerRunner

MAPPINGS = tuple(m for m in awq.MAPPINGS if m.prev.endswith("layernorm"))
MIN_SCALE = 1e-5


def activation_absmax(inputs: list[torch.Tensor]) -> torch.Tensor:
    """Largest ``|x|`` per input channel over every calibration row."""
    return torch.stack([x.abs().reshape(-1, x.shape[-1]).amax(0) for x in inputs]).amax(0)


def smoothing_scales(
    x_absmax: torch.Tensor, weights: Sequence[torch.Tensor], alpha: float
) -> torch.Tensor:
    """``s [K]`` for a group of linears ``weights`` (each ``[N_i, K]``) whose
    input's per-channel maxima are ``x_absmax [K]``."""
    w_absmax = torch.cat([w.detach().float() for w in weights]).abs().amax(0)
    x_absmax = x_absmax.float()
    scales = x_absmax.pow(alpha) / w_absmax.pow(1 - alpha)
    usable = (x_absmax > 0) & (w_absmax > 0)
    return torch.where(usable, scales, torch.ones_like(scales)).clamp(min=MIN_SCALE)


def to_quantized_weight(weight: torch.Tensor) -> QuantizedWeight:
    """``weight [N, K]`` rounded to int8 per output channel (``quant/int8.py``,
    float32 scales ``amax / 127``), held as an 8-bit per-channel
    ``QuantizedWeight`` (values offset by 128) so the pipeline handles every
    method's linears alike."""
    q, scales = int8.quantize_weight(weight)
    return QuantizedWeight(qweight=(q.to(torch.int16) + 128).to(torch.uint8), scales=scales,
                           zeros=None, bits=8, group_size=weight.shape[1])


@torch.no_grad()
def smooth_and_quantize(
    runner: LayerRunner, linears: tuple[str, ...], norms: tuple[str, ...], alpha: float,
    dtype: torch.dtype,
) -> dict[str, QuantizedWeight]:
    """Fold the smoothing scales of every mapping into ``runner.layer`` (the
    norms' weights then rounded to ``dtype``, as they will be stored), then
    round every linear of ``linears`` to int8."""
    heads = [m.linears[0] for m in MAPPINGS]
    captured = runner.capture(heads)
    for mapping, head in zip(MAPPINGS, heads, strict=True):
        weights = [runner.weight(name) for name in mapping.linears]
        scales = smoothing_scales(activation_absmax(captured[head]), weights, alpha)
        awq.fold_scales(runner.layer, mapping, scales, None)
    for name in norms:
        weight = runner.weight(name)
        weight.copy_(weight.to(dtype).float())
    return {name: to_quantized_weight(runner.weight(name)) for name in linears}
