"""Triton kernels, each beside the Python launcher that checks its inputs and
computes its grid: paged attention and the KV write (used by the ``triton``
attention backend), the fused small ops (RMSNorm with residual add,
SiLU-and-mul, rotary embedding) and the skinny GEMM of one-row projections,
used by the layers once ``set_triton_ops`` turns them on, and the sampler's
row argmax. Modules here import
only torch and triton, and are imported lazily, so CPU runs without Triton
never load them.
"""
