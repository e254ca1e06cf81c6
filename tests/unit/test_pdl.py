"""``kernels/pdl.py``'s switch: programmatic dependent launch only on a CUDA
device of compute capability 9.0 or later, and only while enabled."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import pdl


def test_pdl_is_off_on_cpu_and_follows_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not pdl.use_pdl(torch.device("cpu"))
    monkeypatch.setattr(pdl, "_supported", lambda device: True)
    assert pdl.use_pdl(torch.device("cuda"))
    pdl.set_pdl(False)
    try:
        assert not pdl.use_pdl(torch.device("cuda"))
    finally:
        pdl.set_pdl(True)
    assert pdl.use_pdl(torch.device("cuda"))
