"""Multi-LoRA serving: PEFT adapters applied on top of unmerged base weights.

``request.py`` (``LoRARequest``) and ``peft.py`` (reading an adapter's
config) are plain Python, so the engine, the server and this package's
import stay free of torch; ``layers.py`` and ``manager.py`` are the device
side, used by the model runner only.
"""

from __future__ import annotations

from kvserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
