"""kvserve: an LLM inference engine and OpenAI-compatible server.

The offline API mirrors vLLM's::

    from kvserve import LLM, SamplingParams
    llm = LLM()  # the bundled default model
    outputs = llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvserve.core.sampling_params import SamplingParams
from kvserve.inputs import TextPrompt, TokensPrompt
from kvserve.lora.request import LoRARequest

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "EngineArgs", "LoRARequest", "RequestOutput",
           "SamplingParams", "TextPrompt", "TokensPrompt"]

if TYPE_CHECKING:
    from kvserve.engine.args import EngineArgs
    from kvserve.engine.llm import LLM
    from kvserve.engine.outputs import CompletionOutput, RequestOutput


def __getattr__(name: str) -> Any:
    # torch-heavy names are imported on first use, so `import kvserve.core`
    # (and the CLI's --help) stay light
    if name == "LLM":
        from kvserve.engine.llm import LLM

        return LLM
    if name == "EngineArgs":
        from kvserve.engine.args import EngineArgs

        return EngineArgs
    if name in ("RequestOutput", "CompletionOutput"):
        from kvserve.engine import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'kvserve' has no attribute '{name}'")
