"""The compiled carry kernel (``kvserve/kernels/carry.py``) on a CUDA
device (skipped without one), against the torch version
(``worker/input_batch.carry_rows``) exactly, on the random cases of
``tests/carry_cases.py``."""

from __future__ import annotations

import pytest
import torch

from tests.carry_cases import check_kernel_equals_torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("per_row", [True, False])
@pytest.mark.parametrize("with_proposals", [True, False])
def test_kernel_equals_the_torch_version(seed: int, per_row: bool, with_proposals: bool) -> None:
    check_kernel_equals_torch(seed, per_row, with_proposals, "cuda")
