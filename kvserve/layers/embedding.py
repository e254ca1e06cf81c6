"""Token embedding and the LM head (optionally tied to the embedding).

The head stores and multiplies its weight through a linear method as
``Linear`` does (``quant/methods.py``: 16-bit, or weight-only quantised when
the checkpoint or ``--quantization`` says so), and follows the same
``use_triton`` switch (the skinny Triton GEMM for one row, a batch-1 decode
step's logits). No vocab padding or TP vocab split yet; both would live here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.quant.methods import UNQUANTIZED, LinearMethod


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
    the checkpoint needs no ``lm_head.weight``); a tied head stays 16-bit.
    """

    def __init__(
        self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None,
        quant_method: LinearMethod = UNQUANTIZED,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        # the linear method's names for them
        self.input_size, self.output_size = hidden_size, vocab_size
        self.tied = tied_to is not None
        self.use_triton = False
        self.quant_method = quant_method
        if tied_to is not None:
            if quant_method.quantized:
                raise ValueError(
                    "quantization: lm_head is tied to the token embedding, which stays 16-bit, "
                    "so it cannot be quantised; keep lm_head unquantised"
                )
            self.weight = tied_to.weight
        else:
            quant_method.create_weights(self)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # matmul in the model dtype, logits in float32 for the sampler
        logits = self.quant_method.apply(self, hidden_states, None)
        return logits.float()  # [num_tokens, vocab_size]
