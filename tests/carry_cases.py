"""Random cases of ``carry_rows`` (the rows of a step queued before the
speculative step it follows is read), shared by the CPU interpreter test
and the GPU test: requests of 1 + n carried rows each at random places in
a step's rows, sources with random rejections, proposals, block tables;
and the check that the kernel and the torch version agree on one (the
kernel module is imported inside it: see ``tests/triton_interpreter.py``)."""

from __future__ import annotations

from typing import Any

import torch

BLOCK_SIZE = 4


def make_carry_case(seed: int, per_row: bool, with_proposals: bool,
                    device: str) -> dict[str, Any]:
    """``carry_rows``'s arguments (fresh tensors each call)."""
    g = torch.Generator().manual_seed(seed)
    num_sources, num_requests, width = 6, 5, 12
    spec = [int(torch.randint(0, 5 if with_proposals else 1, (1,), generator=g))
            for _ in range(num_requests)]
    sources = torch.randperm(num_sources, generator=g)[:num_requests]
    rows, requests, srcs, offsets = [], [], [], []
    row = int(torch.randint(0, 3, (1,), generator=g))
    for request, (n, source) in enumerate(zip(spec, sources.tolist(), strict=True)):
        for j in range(1 + n):
            rows.append(row + j)
            requests.append(request)
            srcs.append(source)
            offsets.append(j)
        row += 1 + n + int(torch.randint(0, 3, (1,), generator=g))  # rows of other requests
    num_rows = row + 2
    proposal_rows = [source if offset else 0 for source, offset in zip(srcs, offsets, strict=True)]
    rejected = torch.randint(0, 5, (num_sources,), generator=g)
    positions = torch.randint(8, 30, (num_rows,), generator=g)
    seq_lens = (positions + 1 if per_row else torch.randint(20, 40, (num_requests + 1,),
                                                            generator=g)).to(torch.int32)
    block_table = torch.randperm(200, generator=g)[:(num_requests + 1) * width].view(
        num_requests + 1, width).to(torch.int32)
    return {
        "index": torch.tensor([rows, requests, srcs, proposal_rows, offsets],
                              dtype=torch.int64, device=device),
        "tokens": torch.randint(3, 500, (num_sources,), generator=g).to(device),
        "rejected": rejected.to(device),
        "proposals": (torch.randint(3, 500, (num_sources, 5), generator=g).to(device)
                      if with_proposals else None),
        "input_ids": torch.randint(0, 500, (num_rows,), generator=g).to(device),
        "positions": positions.to(device),
        "slot_mapping": torch.randint(0, 200, (num_rows,), generator=g).to(device),
        "block_table": block_table.to(device),
        "seq_lens": seq_lens.to(device),
        "block_size": BLOCK_SIZE,
        "per_row": per_row,
    }


OUTPUTS = ("input_ids", "positions", "slot_mapping", "seq_lens")


def check_kernel_equals_torch(seed: int, per_row: bool, with_proposals: bool,
                              device: str) -> None:
    """The kernel and the torch version on the same case: every output equal."""
    from kvserve.kernels.carry import carry_rows
    from kvserve.worker.input_batch import carry_rows as carry_rows_torch

    kernel = make_carry_case(seed, per_row, with_proposals, device)
    reference = make_carry_case(seed, per_row, with_proposals, device)
    carry_rows(**kernel)
    carry_rows_torch(**reference)
    for name in OUTPUTS:
        assert torch.equal(kernel[name], reference[name]), name
