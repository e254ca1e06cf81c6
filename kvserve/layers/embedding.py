"""Token embedding and the LM head (optionally tied to the embedding), split
over the vocabulary with tensor parallelism.

The head stores and multiplies its weight through a linear method as
``Linear`` does (``quant/methods.py``: 16-bit, or weight-only quantised when
the checkpoint or ``--quantization`` says so), and follows the same
``use_triton`` switch (the skinny Triton GEMM for one row, a batch-1 decode
step's logits).

With a TP group of ``tp`` ranks (read once, in the constructor) each rank
holds ``ceil(vocab_size / tp)`` rows of the table (``sharding.vocab_shard``;
the last rank's rows past the vocabulary are zero padding). The embedding
looks up the ids in its rows, zeroes the others and all-reduces; the head
computes the logits of its rows and all-gathers them, so every rank samples
from the same full logits. Loaders copy the rank's rows of the whole
checkpoint tensor as it streams.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.distributed.parallel_state import building_state
from kvserve.distributed.sharding import vocab_shard
from kvserve.quant.methods import UNQUANTIZED, LinearMethod

ShardId = str | int | None


def _load_rows(param: nn.Parameter, loaded: torch.Tensor, start: int, vocab_size: int,
               shard_id: ShardId) -> None:
    """Copy rows ``[start, start + len(param))`` of the ``[vocab_size, ...]`` tensor
    ``loaded`` into ``param``, zeroing the rows past the vocabulary."""
    if shard_id is not None:
        raise ValueError(f"parameter is not packed but got shard '{shard_id}'")
    if loaded.shape[0] != vocab_size or tuple(loaded.shape[1:]) != tuple(param.shape[1:]):
        raise ValueError(f"shape {tuple(loaded.shape)} does not match the parameter's "
                         f"({vocab_size}, {', '.join(map(str, param.shape[1:]))})")
    rows = max(0, min(param.shape[0], vocab_size - start))
    with torch.no_grad():
        param[:rows].copy_(loaded[start:start + rows])
        param[rows:].zero_()


class VocabEmbedding(nn.Module):
    """Looks up ``[num_tokens]`` ids in a ``[vocab_size, hidden_size]`` table
    (this rank's rows of it)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp = building_state().tp
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.vocab_start, num_rows = vocab_shard(vocab_size, self.tp.size, self.tp.rank)
        self.weight = nn.Parameter(torch.empty(num_rows, hidden_size), requires_grad=False)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        _load_rows(param, loaded, self.vocab_start, self.vocab_size, shard_id)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)  # [num_tokens, hidden_size]
        local = input_ids - self.vocab_start
        elsewhere = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        out.masked_fill_(elsewhere.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)  # [num_tokens, hidden_size]


class LMHead(nn.Module):
    """Projects hidden states to float32 logits over the vocab.

    With ``tied_to`` the head reuses the embedding's parameter (no copy, and
    the checkpoint needs no ``lm_head.weight``); a tied head stays 16-bit. A
    tied head on a later pipeline stage than the embedding (``tied`` without
    ``tied_to``) holds its own copy, loaded from the embedding's tensor.
    """

    def __init__(
        self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None,
        quant_method: LinearMethod = UNQUANTIZED, tied: bool = False,
    ) -> None:
        super().__init__()
        self.tp = building_state().tp
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.vocab_start, num_rows = vocab_shard(vocab_size, self.tp.size, self.tp.rank)
        # the linear method's names for them (this rank's rows)
        self.input_size, self.output_size = hidden_size, num_rows
        self.tied = tied_to is not None
        self.copies_embedding = tied and tied_to is None
        self.use_triton = False
        self.quant_method = quant_method
        if (self.tied or tied) and quant_method.quantized:
            raise ValueError(
                "quantization: lm_head is tied to the token embedding, which stays 16-bit, "
                "so it cannot be quantised; keep lm_head unquantised"
            )
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            quant_method.create_weights(self)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        if param is getattr(self, "perm", None):  # act-order: over the input, whole
            if tuple(loaded.shape) != tuple(param.shape):
                raise ValueError(f"shape {tuple(loaded.shape)} does not match the "
                                 f"parameter's {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(loaded)
            return
        _load_rows(param, loaded, self.vocab_start, self.vocab_size, shard_id)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # matmul in the model dtype, logits in float32 for the sampler
        logits = self.quant_method.apply(self, hidden_states, None)
        if self.tp.size > 1:
            logits = self.tp.all_gather(logits)[:, : self.vocab_size].contiguous()
        return logits.float()  # [num_tokens, vocab_size]
