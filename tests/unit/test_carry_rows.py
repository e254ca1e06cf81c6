"""The carry kernel (``kvserve/kernels/carry.py``) on CPU under
``TRITON_INTERPRET=1``, against the torch version
(``worker/input_batch.carry_rows``) exactly, on random cases
(``tests/carry_cases.py``): rows per token or per request, with and without
proposals; and the torch version against a direct loop over the rows.
Skipped like ``test_triton_kernels.py``: without Triton, with CUDA (see
``tests/gpu/test_carry_rows_gpu.py``), or when Triton was imported without
the interpreter."""

from __future__ import annotations

import pytest

from tests.triton_interpreter import require_interpreter

require_interpreter("tests/gpu/test_carry_rows_gpu.py")

from kvserve.worker.input_batch import carry_rows as carry_rows_torch  # noqa: E402
from tests.carry_cases import OUTPUTS, check_kernel_equals_torch, make_carry_case  # noqa: E402


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("per_row", [True, False])
@pytest.mark.parametrize("with_proposals", [True, False])
def test_kernel_equals_the_torch_version(seed: int, per_row: bool, with_proposals: bool) -> None:
    check_kernel_equals_torch(seed, per_row, with_proposals, "cpu")


@pytest.mark.parametrize("per_row", [True, False])
def test_torch_version_moves_each_row_back(per_row: bool) -> None:
    case = make_carry_case(7, per_row, True, "cpu")
    before = {name: case[name].clone() for name in OUTPUTS}
    carry_rows_torch(**case)
    index = case["index"].tolist()
    seen_requests = set()
    for row, request, source, proposal_row, offset in zip(*index, strict=True):
        back = int(case["rejected"][source])
        position = int(before["positions"][row]) - back
        assert int(case["positions"][row]) == position
        token = (case["tokens"][source] if offset == 0
                 else case["proposals"][proposal_row, offset - 1])
        assert int(case["input_ids"][row]) == int(token)
        block = int(case["block_table"][request, position // case["block_size"]])
        assert int(case["slot_mapping"][row]) == (block * case["block_size"]
                                                   + position % case["block_size"])
        if per_row:
            assert int(case["seq_lens"][row]) == position + 1
        elif request not in seen_requests:
            seen_requests.add(request)
            assert int(case["seq_lens"][request]) == int(before["seq_lens"][request]) - back
    untouched = set(range(len(before["positions"]))) - set(index[0])
    for row in untouched:
        assert int(case["positions"][row]) == int(before["positions"][row])
        assert int(case["input_ids"][row]) == int(before["input_ids"][row])
