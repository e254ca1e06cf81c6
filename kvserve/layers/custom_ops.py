"""The switch between the layers' torch code and their Triton kernels.

``RMSNorm``, ``SiluAndMul``, ``RotaryEmbedding``, ``Linear`` (and its
subclasses) and ``LMHead`` each carry a ``use_triton`` flag (False by
default, so CPU runs never import Triton);
``set_triton_ops`` sets it on every such module of a model (through a
linear's ``quant_method``, which may rearrange its weights for its kernels). The model runner
turns it on with the Triton attention backend on CUDA. This module owns only
the flag flipping, not the kernels (``kvserve/kernels``) nor the choice of
when to use them.
"""

from __future__ import annotations

import importlib

from torch import nn

from kvserve.layers.activation import SiluAndMul
from kvserve.layers.embedding import LMHead
from kvserve.layers.linear import Linear
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding

TRITON_LAYERS = (RMSNorm, SiluAndMul, RotaryEmbedding, Linear, LMHead)
TRITON_KERNEL_MODULES = (
    "kvserve.kernels.rms_norm", "kvserve.kernels.activation", "kvserve.kernels.rotary",
    "kvserve.kernels.skinny_gemm", "kvserve.kernels.quant_matmul",
)


def set_triton_ops(model: nn.Module, enabled: bool) -> int:
    """Set ``use_triton = enabled`` on every layer of ``model`` that has a Triton
    kernel; return how many modules were set (a shared module counts once).

    Enabling imports the kernel modules first, so a missing Triton fails here
    rather than in the middle of a forward pass.
    """
    if enabled:
        for kernel_module in TRITON_KERNEL_MODULES:
            importlib.import_module(kernel_module)
    count = 0
    for module in model.modules():
        if isinstance(module, TRITON_LAYERS):
            method = getattr(module, "quant_method", None)
            if method is not None:  # a linear may hold its weights as its kernels want
                method.set_use_triton(module, enabled)
            else:
                module.use_triton = enabled
            count += 1
    return count
