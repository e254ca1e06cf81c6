"""Token embedding and the LM head (optionally tied to the embedding).

The head's matmul follows ``Linear``'s ``use_triton`` switch (the skinny
Triton GEMM for one row, a batch-1 decode step's logits).
No vocab padding or TP vocab split yet; both would live here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.layers.linear import apply_linear


class VocabEmbedding(nn.Module):
    """Looks up ``[num_tokens]`` ids in a ``[vocab_size, hidden_size]`` table."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)  # [num_tokens, hidden_size]


class LMHead(nn.Module):
    """Projects hidden states to float32 logits over the vocab.

    With ``tied_to`` the head reuses the embedding's parameter (no copy, and
    the checkpoint needs no ``lm_head.weight``).
    """

    def __init__(
        self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.tied = tied_to is not None
        self.use_triton = False
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # matmul in the model dtype, logits in float32 for the sampler
        logits = apply_linear(hidden_states, self.weight, None, self.use_triton)
        return logits.float()  # [num_tokens, vocab_size]
