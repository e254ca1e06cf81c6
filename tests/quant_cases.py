"""Random weight-only quantised linears for the quantised GEMM tests
(``tests/unit/test_quant_kernels.py``, ``tests/gpu/test_quant_matmul_gpu.py``):
codes drawn uniformly over the whole range (0 and the maximum included),
random positive scales, zero points anywhere in the code range, so every
nibble position, group boundary and zero point is exercised, not only the
codes a round-to-nearest quantiser of a smooth weight would produce."""

from __future__ import annotations

import torch

from kvserve.quant.packing import QuantizedWeight, pack_int4


def random_quantized_weight(
    n: int, k: int, bits: int, group_size: int, symmetric: bool, dtype: torch.dtype,
    seed: int, device: str | torch.device = "cpu", scale: float = 0.02,
) -> QuantizedWeight:
    """A ``[n, k]`` weight in ``quant/packing.py``'s layout (``group_size`` -1:
    one group per row), its scales ~``scale`` so outputs stay O(1)."""
    generator = torch.Generator().manual_seed(seed)
    group_size = k if group_size == -1 else group_size
    codes = torch.randint(0, 2**bits, (n, k), generator=generator, dtype=torch.uint8)
    groups = (n, k // group_size)
    scales = scale * (0.5 + torch.rand(groups, generator=generator))
    zeros = None
    if not symmetric:
        zeros = torch.randint(0, 2**bits, groups, generator=generator).to(dtype).to(device)
    return QuantizedWeight(
        qweight=(pack_int4(codes) if bits == 4 else codes).to(device),
        scales=scales.to(dtype).to(device), zeros=zeros, bits=bits, group_size=group_size)


def kernel_tensors(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor,
                                                 torch.Tensor | None]:
    """``qw``'s tensors in the kernels' layout (``repack_for_kernels``, imported
    here so that collecting the GPU tests on a CPU machine decorates no kernel
    before the interpreter tests switch the interpreter on)."""
    from kvserve.kernels.quant_matmul import repack_for_kernels

    return repack_for_kernels(qw.qweight, qw.scales, qw.zeros, qw.bits, qw.group_size)
