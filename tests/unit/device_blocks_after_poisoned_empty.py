"""Run by ``test_poisoned_empty.py`` in a fresh process (not collected on its
own): a test using ``poisoned_empty`` first, then one that needs
``with torch.device(...)`` to place ``torch.empty``, in this order."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.usefixtures("poisoned_empty")
def test_first_with_the_fixture() -> None:
    with torch.device("meta"):
        assert torch.isnan(torch.empty(2, device="cpu")).all()
        assert torch.empty(1).device.type == "meta"


def test_then_without_it() -> None:
    with torch.device("meta"):
        assert torch.empty(1).device.type == "meta"
