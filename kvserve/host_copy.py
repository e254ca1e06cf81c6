"""Small host lists to device tensors without waiting for the device.

A plain ``torch.tensor(values, device="cuda")`` copies from pageable memory
and then synchronises the stream, so it waits for every kernel queued before
it: a whole forward pass when the next step is being prepared while the
current one runs. Going through pinned memory with a non-blocking copy
queues the copy instead; the caching host allocator keeps the pinned buffer
alive until the copy is done.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def to_device(
    values: Sequence[Any] | np.ndarray, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """``values`` (a list, a list of equal-length lists or a numpy array) as a
    tensor on ``device``."""
    tensor = torch.tensor(values, dtype=dtype)  # a copy, also of an array
    if torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
