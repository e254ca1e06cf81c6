"""Proposals from a small draft model with the target's tokenizer
(registered as ``"draft_model"``).

The draft is an ordinary decoder (any architecture the registry loads) with
its KV in the target's paged pool (``proposer.py``): every step it runs
over the target's tokens with the target's metadata (the catch-up), so its
cache always holds the request's tokens, cached prefixes and resumed
requests included. A request that proposes ``P`` tokens then gets ``P``
one-token draft steps, batched over the proposing requests: the first on
the token the target just added, each next one on the previous step's
argmax. The proposals are the draft's greedy tokens (``q`` one-hot for the
verifier); the target's distribution is kept exactly either way.
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.layers.custom_ops import set_triton_ops
from kvserve.models.loader import load_model
from kvserve.models.registry import CausalLM
from kvserve.models.source import resolve_model_config
from kvserve.spec.proposer import ChainProposer, ProposerSetting, ProposerStep


class DraftModelProposer(ChainProposer):
    """A draft model running beside the target."""

    model: CausalLM

    def __init__(self, model: CausalLM, **kwargs: object) -> None:
        super().__init__(model, hidden_size=model.config.hidden_size, **kwargs)  # type: ignore[arg-type]
        self.model = model

    @torch.inference_mode()
    def run(self, step: ProposerStep) -> torch.Tensor | None:
        self.model(step.input_ids, step.positions, step.metadata)  # writes the draft's KV
        rows = np.flatnonzero(step.num_draft > 0)
        if not len(rows):
            return None
        num_rows, num_draft = len(rows), int(step.num_draft[rows].max())
        rows_t, limit, last_positions = self.chain_setup(step, rows)
        tokens = step.bonus_ids.index_select(0, rows_t)
        drafts = torch.empty((num_rows, num_draft), dtype=torch.int64, device=self.device)
        for j in range(num_draft):
            # the token at last + 1 + j: the target's addition, then the draft's own
            tokens, _ = self.chain_step(num_rows, last_positions + 1 + j, j < limit, tokens)
            drafts[:, j] = tokens
        return drafts

    def step_forward(self, num_rows: int, metadata: AttentionMetadata
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.buffers
        hidden = self.model(b.input_ids[:num_rows], b.positions[:num_rows], metadata)
        return self.model.compute_logits(hidden).argmax(dim=-1), hidden


def load_draft_proposer(setting: ProposerSetting, path: str, load_format: str
                        ) -> DraftModelProposer:
    """Load the draft (``path``: a checkpoint directory, or a preset with
    random weights) on the target's device and dtype, with its attention
    backend and Triton ops."""
    config, model_path = resolve_model_config(path)
    model = load_model(config, model_path, "dummy" if model_path is None else load_format,
                       setting.dtype, setting.device, seed=1)
    model.eval()
    if setting.use_triton:
        set_triton_ops(model, True)
    return DraftModelProposer(model, **setting.chain_kwargs())
