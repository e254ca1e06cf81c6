"""The compiled carry kernel (``kvserve/kernels/carry.py``) on a CUDA
device (skipped without one), against the torch version
(``worker/input_batch.carry_rows``) exactly, on the random cases of
``tests/carry_cases.py``."""

from __future__ import annotations

import pytest
import torch

from tests.carry_cases import OUTPUTS, make_carry_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("per_row", [True, False])
@pytest.mark.parametrize("with_proposals", [True, False])
def test_kernel_equals_the_torch_version(seed: int, per_row: bool, with_proposals: bool) -> None:
    from kvserve.kernels.carry import carry_rows
    from kvserve.worker.input_batch import carry_rows as carry_rows_torch

    kernel = make_carry_case(seed, per_row, with_proposals, "cuda")
    reference = make_carry_case(seed, per_row, with_proposals, "cuda")
    carry_rows(**kernel)
    carry_rows_torch(**reference)
    for name in OUTPUTS:
        assert torch.equal(kernel[name], reference[name]), name
