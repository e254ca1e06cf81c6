"""``LoRARequest``: the adapter a request runs with, under vLLM's names.

``lora_int_id`` is the adapter's identity inside the engine (its device
slot, its part of the prefix-cache key; 0 means "no adapter" there, so it
must be >= 1), ``lora_name`` the name users see (the server's model name),
``lora_path`` a local PEFT directory. Plain data: no torch here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """One PEFT LoRA adapter, identified by ``lora_int_id``."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if isinstance(self.lora_path, os.PathLike):
            object.__setattr__(self, "lora_path", os.fspath(self.lora_path))
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name={self.lora_name!r} is invalid: must be a non-empty string")
        if (isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int)
                or self.lora_int_id < 1):
            raise ValueError(f"lora_int_id={self.lora_int_id!r} is invalid: must be an integer "
                             ">= 1 (0 stands for no adapter)")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path={self.lora_path!r} is invalid: must be the path of a "
                             "PEFT adapter directory")
