"""GPU tests share one process: each test starts with the memory of the
previous ones released (engines hold KV caches and CUDA graph pools until
collected), so memory-sizing tests see only what they allocate."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def release_device_memory() -> Iterator[None]:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    yield
