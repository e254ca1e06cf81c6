"""The quantised KV cache in plain torch: its dtypes by name, and quantising and
dequantising a batch of head vectors. The torch backend stores and reads
its cache with these; they are also the oracle of the Triton kernels'
arithmetic (``kvserve/kernels/kv_quant.py``, whose docstring defines it), so
the two write bit-equal caches.

- ``fp8_e4m3``: ``torch.float8_e4m3fn`` values of x / scale[head], clamped to
  +-448, rounded to nearest even; the scales are fixed per layer and head.
- ``int8``: ``torch.int8`` values of round(x / scale) with one float32 scale,
  ``amax / 127``, per token and head, stored beside the cache.

It owns no memory and no policy: the worker allocates caches and scales
(``worker/kv_cache.py``) and the loader reads a checkpoint's scales
(``models/kv_scales.py``).
"""

from __future__ import annotations

import torch

from kvserve.quant.scales import absmax_scales

# ``--kv-cache-dtype`` names (besides "auto", the model's dtype) -> the cache dtype
KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "int8": torch.int8,
}
FP8_MAX = 448.0
INT8_MAX = 127.0


def is_quantised(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` is quantised (stores values with scales)."""
    return dtype in KV_CACHE_DTYPES.values()


def quantize_kv(
    x: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cache_dtype: torch.dtype,
    head_scales: torch.Tensor | None = None,  # fp8: [num_kv_heads] float32
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` as a cache of ``cache_dtype`` stores it: (values, and for int8 the
    ``[num_tokens, num_kv_heads]`` float32 scales); a 16- or 32-bit cache gets
    ``x`` cast and no scales."""
    if cache_dtype == torch.float8_e4m3fn:
        if head_scales is None:
            raise ValueError("quantize_kv: an fp8 cache needs its per-head scales")
        y = (x.float() / head_scales[None, :, None]).clamp(-FP8_MAX, FP8_MAX)
        return y.to(torch.float8_e4m3fn), None
    if cache_dtype == torch.int8:
        x = x.float()
        scales = absmax_scales(x, INT8_MAX)  # [num_tokens, num_kv_heads]
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        y = (x / safe[..., None]).clamp(-INT8_MAX, INT8_MAX)
        return torch.round(y).to(torch.int8), scales
    return x.to(cache_dtype), None


def dequantize_kv(
    values: torch.Tensor,  # [..., num_kv_heads, head_dim] as stored
    scales: torch.Tensor | None,  # fp8: [num_kv_heads]; int8: [..., num_kv_heads]
) -> torch.Tensor:  # float32, values' shape
    """Stored values back to float32: times the head's (fp8) or the vector's
    (int8) scale; a 16- or 32-bit cache's values only widened."""
    if values.dtype == torch.int8:
        assert scales is not None
        return values.float() * scales[..., None]
    if values.dtype == torch.float8_e4m3fn:
        assert scales is not None
        return values.float() * scales[:, None]
    return values.float()
