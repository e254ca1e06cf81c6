"""Triton kernels, each beside the Python launcher that checks its inputs and
computes its grid: paged attention and the KV write (used by the ``triton``
attention backend) and the fused small ops (RMSNorm with residual add,
SiLU-and-mul, rotary embedding; used by the layers once ``set_triton_ops``
turns them on). Modules here import only torch and triton, and are imported
lazily, so CPU runs without Triton never load them.
"""
