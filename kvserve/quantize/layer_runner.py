"""One Hugging Face decoder layer run over the calibration batches.

The pipeline catches the inputs of the model's first decoder layer (hidden
states and the keyword arguments the model passes it: rotary embeddings,
attention mask, ...) once per batch; ``LayerRunner`` then runs any one layer
on those inputs, with forward pre-hooks that see (or keep) the input of
chosen submodules, or calls one submodule on a batch as the layer would
(``self_attn`` with the layer's keyword arguments). Float32 throughout;
nothing is quantised here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


def weight_of(module: nn.Module, name: str) -> nn.Parameter:
    """The ``weight`` parameter of ``module``'s submodule ``name``."""
    weight = getattr(module.get_submodule(name), "weight", None)
    if not isinstance(weight, nn.Parameter):
        raise ValueError(f"model: {name} has no weight parameter; this architecture cannot "
                         "be calibrated")
    return weight


class LayerRunner:
    """A decoder layer and its calibration inputs: ``inputs[b]`` ``[batch, seq, hidden]``
    and ``kwargs[b]``, the other arguments the model passes the layer."""

    def __init__(
        self, layer: nn.Module, inputs: list[torch.Tensor], kwargs: list[dict[str, Any]]
    ) -> None:
        self.layer = layer
        self.inputs = inputs
        self.kwargs = kwargs

    def submodule(self, name: str) -> nn.Module:
        return self.layer.get_submodule(name)

    def weight(self, name: str) -> nn.Parameter:
        return weight_of(self.layer, name)

    @torch.no_grad()
    def forward(self) -> list[torch.Tensor]:
        """The layer's output for every batch."""
        outputs = []
        for x, kwargs in zip(self.inputs, self.kwargs, strict=True):
            out = self.layer(x, **kwargs)
            outputs.append(out[0] if isinstance(out, tuple) else out)
        return outputs

    @contextmanager
    def observing(self, observers: dict[str, Callable[[torch.Tensor], None]]) -> Iterator[None]:
        """While open, ``observers[name](x)`` sees each input ``x`` of submodule ``name``."""
        handles = []
        for name, observe in observers.items():
            def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                     observe: Callable[[torch.Tensor], None] = observe) -> None:
                observe(args[0] if args else kwargs["hidden_states"])
            handles.append(self.submodule(name).register_forward_pre_hook(hook, with_kwargs=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def capture(self, names: list[str]) -> dict[str, list[torch.Tensor]]:
        """The inputs of submodules ``names``, one tensor per batch, from one forward."""
        captured: dict[str, list[torch.Tensor]] = {name: [] for name in names}
        with self.observing({name: captured[name].append for name in names}):
            self.forward()
        return captured

    @torch.no_grad()
    def call(self, name: str, x: torch.Tensor, batch: int) -> torch.Tensor:
        """Submodule ``name`` on ``x`` as the layer calls it for batch ``batch``."""
        module = self.submodule(name)
        if name == "self_attn":
            return module(hidden_states=x, **self.kwargs[batch])[0]
        return module(x)
