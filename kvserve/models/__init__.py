"""Model definitions (``llama.py``, ``qwen.py``), the architecture registry
(``registry.py``), the checkpoint loader (``loader.py``) and built-in presets
(``presets.py``, pure data: importing it pulls in no torch).

Models import only ``kvserve.layers``, ``kvserve.attention`` (metadata type)
and ``kvserve.config``; they know nothing of scheduling or the KV allocator.
"""
