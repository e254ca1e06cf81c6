"""The model interface and the map from architecture name to model class.

``CausalLM`` is what the model runner calls on every model; ``get_model_class``
looks a class up by ``config.json``'s ``architectures[0]``, importing the
model's module lazily on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

import torch
from torch import nn

from kvserve.attention.metadata import AttentionMetadata
from kvserve.config import ModelConfig


class CausalLM(nn.Module):
    """Base of every model class: built from a ``ModelConfig``, run on a flattened batch."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        metadata: AttentionMetadata,
        # a later pipeline stage's input: the previous stage's output
        intermediate: torch.Tensor | None = None,  # [num_tokens, 2, hidden_size]
    ) -> torch.Tensor:
        """``[num_tokens, hidden_size]`` with the final norm applied; a pipeline
        stage before the last returns ``[num_tokens, 2, hidden_size]`` (hidden
        states and residual) for the next."""
        raise NotImplementedError

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[num_rows, hidden_size]`` -> ``[num_rows, vocab_size]`` float32 logits."""
        raise NotImplementedError

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[num_tokens]`` ids -> ``[num_tokens, hidden_size]`` input embeddings
        (an EAGLE head reads the target's)."""
        raise NotImplementedError

    def keep_aux_hidden_states(self, layer_ids: tuple[int, ...], max_tokens: int) -> None:
        """Have every forward keep the residual streams entering ``layer_ids``
        (an EAGLE head with aux layers reads them) for up to ``max_tokens`` rows."""
        raise NotImplementedError

    def aux_hidden_states(self, num_tokens: int) -> torch.Tensor | None:
        """``[num_tokens, len(layer_ids), hidden_size]`` of the last forward, or
        None when none are kept."""
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill every parameter from HF-named tensors; ValueError naming any bad tensor."""
        raise NotImplementedError

    def linear_module_names(self) -> set[str]:
        """The HF module names of every linear (a quantised checkpoint's layers)."""
        raise NotImplementedError


_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("kvserve.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("kvserve.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("kvserve.models.qwen", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("kvserve.models.qwen", "Qwen3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return list(_MODELS)


def get_model_class(architecture: str) -> type[CausalLM]:
    """The class implementing ``architecture``; ValueError listing the supported ones."""
    if architecture not in _MODELS:
        raise ValueError(
            f"architecture '{architecture}' is not supported; "
            f"supported: {', '.join(_MODELS)}"
        )
    module_name, class_name = _MODELS[architecture]
    model_cls: type[CausalLM] = getattr(importlib.import_module(module_name), class_name)
    return model_cls
