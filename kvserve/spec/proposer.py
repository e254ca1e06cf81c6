"""What a proposer that runs its own network (a draft model, an EAGLE head)
shares: its KV in the target's paged pool, the view of a target step it
gets, and one-token chain steps over fixed buffers.

The proposer's KV lives in its own tensors but at the target's block ids:
one block of the pool holds the target's K/V for its tokens and the
proposer's K/V for the same tokens, so one block table, one allocator, one
prefix cache, preemption and rollback serve both (the pool is sized for
the sum of the two per-block sizes). For that the proposer sees every
token the target sees: ``run`` first catches up over each step's tokens with
the target's own attention metadata, speculative or not. A step that asks
for proposals then chains one-token steps from each request's last
accepted token; step ``j`` of a request that proposes ``P`` tokens writes
KV only while ``j < P`` (its lookahead slots), never into blocks it does
not own.

Chain steps read fixed device buffers (token ids, positions, slots,
sequence lengths, block table rows; features for EAGLE), so the GPU path
replays a CUDA graph per padded batch size; on the CPU they run eagerly on
the same buffers. No host synchronisation: positions and slots are
computed on the device from the verification's results, and the host's
few indices go over in one non-blocking copy.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.host_copy import to_device
from kvserve.layers.attention import bind_kv_cache, get_attention_layers

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProposerSetting:
    """What a device proposer takes from the target's runner: where it runs,
    its attention backend, the pool's block size and the batch limits."""

    backend: AttentionBackend
    device: torch.device
    dtype: torch.dtype
    block_size: int
    max_model_len: int
    max_rows: int
    graph_sizes: tuple[int, ...]
    use_triton: bool
    max_tokens: int  # the most rows a target step runs (its step buffers' size)

    def chain_kwargs(self) -> dict[str, Any]:
        """``ChainProposer``'s keyword arguments."""
        return {"backend": self.backend, "device": self.device, "dtype": self.dtype,
                "block_size": self.block_size, "max_model_len": self.max_model_len,
                "max_rows": self.max_rows, "graph_sizes": self.graph_sizes}


@dataclass
class ProposerStep:
    """One target step as a proposer sees it (device tensors unless noted)."""

    input_ids: torch.Tensor  # [T] int64: the target's inputs (padded to a graph's size)
    positions: torch.Tensor  # [T] int64
    metadata: AttentionMetadata  # the target's attention metadata over those rows
    hidden: torch.Tensor | None  # [T, hidden_size]: the target's final hidden states
    query_end: np.ndarray  # [num_reqs] host: each request's rows end here (exclusive)
    # [num_reqs] host: the token after each request's query when it does not
    # sample (the next prompt token; -1 past the prompt)
    next_token_ids: np.ndarray
    sample_indices: np.ndarray  # [N] host: the requests that sample
    last_index: torch.Tensor  # [N] int64: row of each sampling request's last kept token
    bonus_ids: torch.Tensor  # [N] int64: the token the step added after it
    block_table: torch.Tensor  # [num_reqs, W] int32: the step's block table rows
    num_draft: np.ndarray  # [N] host: tokens to propose per sampling request (0: none)


class ChainBuffers:
    """Fixed device buffers of one-token chain steps over up to ``max_rows`` requests."""

    def __init__(self, max_rows: int, max_blocks: int, hidden_size: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.max_rows = max_rows
        self.input_ids = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_rows,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_rows + 1, dtype=torch.int32, device=device)
        self.block_table = torch.zeros((max_rows, max_blocks), dtype=torch.int32, device=device)
        self.features = torch.zeros((max_rows, hidden_size), dtype=dtype, device=device)


class ChainProposer:
    """Base of proposers with their own network: KV binding, catch-up and
    chain-step plumbing; subclasses define the network's calls."""

    def __init__(self, network: torch.nn.Module, backend: AttentionBackend,
                 device: torch.device, dtype: torch.dtype, block_size: int, max_model_len: int,
                 max_rows: int, hidden_size: int, graph_sizes: tuple[int, ...] = ()) -> None:
        self.network = network
        self.backend = backend
        self.device, self.dtype = device, dtype
        self.block_size = block_size
        self.max_model_len = max_model_len
        max_blocks = -(-max_model_len // block_size)
        self.buffers = ChainBuffers(max_rows, max_blocks, hidden_size, device, dtype)
        self.kv_caches: list[torch.Tensor] = []
        self.graph_sizes = sorted(graph_sizes)
        self._graphs: dict[int, Any] = {}  # padded rows -> (graph, its static outputs)

    # ------------------------------------------------------------ KV

    def kv_bytes_per_block(self) -> int:
        """Bytes of the proposer's K and V for one block of the pool."""
        element_bytes = torch.empty((), dtype=self.dtype).element_size()
        return sum(2 * self.block_size * layer.num_kv_heads * layer.head_dim * element_bytes
                   for layer in get_attention_layers(self.network))

    def bind_kv_cache(self, num_blocks: int) -> None:
        """Allocate the proposer's KV at the pool's ``num_blocks`` block ids
        (the null block included) and bind it to its attention layers."""
        self.kv_caches = [
            torch.zeros((2, num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim),
                        dtype=self.dtype, device=self.device)
            for layer in get_attention_layers(self.network)
        ]
        bind_kv_cache(self.network, self.kv_caches, self.backend)

    # ------------------------------------------------------------ the step

    def run(self, step: ProposerStep) -> torch.Tensor | None:
        """Catch up on the step's tokens; then, if any request proposes,
        ``[B, P]`` proposals of the proposing requests (``step.num_draft > 0``,
        in order; row ``b`` valid up to its own count)."""
        raise NotImplementedError

    def chain_setup(self, step: ProposerStep, rows: np.ndarray
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Load the chain buffers' block table with the proposing requests'
        rows (``rows``: indices of the sampling requests that propose; the
        buffer rows past them, up to a graph's size, are padding: no KV
        write, nothing to attend to). Returns, on the device, ``rows``, each
        one's number of proposals and the position of its last kept token."""
        num = len(rows)
        b = self.buffers
        host = np.stack([rows, step.sample_indices[rows], step.num_draft[rows]])
        rows_t, index, limit = to_device(host, torch.int64, self.device).unbind(0)
        table = step.block_table.index_select(0, index)
        b.block_table[:num, :table.shape[1]] = table
        b.seq_lens[num:] = 0
        b.slot_mapping[num:] = -1
        last = step.last_index.index_select(0, rows_t)
        return rows_t, limit, step.positions.index_select(0, last)

    def chain_step(self, num_rows: int, positions: torch.Tensor, valid: torch.Tensor,
                   token_ids: torch.Tensor, features: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """One chain step: token ``token_ids[b]`` at ``positions[b]`` (KV written
        only where ``valid``), ``features`` for a head that reads them; the
        argmax tokens ``[num_rows]`` and output features. Replays the graph of
        the smallest captured size that fits, else runs eagerly."""
        b = self.buffers
        bs = self.block_size
        safe = torch.where(valid, positions, 0).clamp_(max=self.max_model_len - 1)
        b.input_ids[:num_rows] = token_ids
        b.positions[:num_rows] = safe
        blocks = b.block_table[:num_rows].gather(1, (safe // bs).unsqueeze(1)).squeeze(1)
        b.slot_mapping[:num_rows] = torch.where(valid, blocks.long() * bs + safe % bs, -1)
        b.seq_lens[:num_rows] = (safe + 1).to(torch.int32)
        if features is not None:
            b.features[:num_rows] = features
        size = self.padded_rows(num_rows)
        if size in self._graphs:
            graph, (tokens, out) = self._graphs[size]
            graph.replay()
            return tokens[:num_rows], out[:num_rows]
        return self.step_forward(num_rows, self.metadata(num_rows, host=True))

    def step_forward(self, num_rows: int, metadata: AttentionMetadata
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The network on the buffers' first ``num_rows`` rows: argmax tokens
        and output features (defined by each proposer; graphs capture it)."""
        raise NotImplementedError

    def metadata(self, num_rows: int, host: bool) -> AttentionMetadata:
        """Decode metadata over the buffers' first ``num_rows`` rows; the host
        copies only when ``host`` and the backend reads them (the reference)."""
        b = self.buffers
        host = host and not self.backend.supports_cuda_graphs
        return AttentionMetadata(
            num_reqs=num_rows, num_tokens=num_rows, max_query_len=1,
            max_seq_len=self.max_model_len,  # a captured split-K grid covers any context
            query_start_loc=b.query_start_loc[:num_rows + 1],
            seq_lens=b.seq_lens[:num_rows],
            block_table=b.block_table[:num_rows],
            slot_mapping=b.slot_mapping[:num_rows],
            query_start_loc_cpu=list(range(num_rows + 1)) if host else [],
            seq_lens_cpu=b.seq_lens[:num_rows].tolist() if host else [],
        )

    def padded_rows(self, num_rows: int) -> int:
        """The chain graph size a step of ``num_rows`` replays (``num_rows`` when eager)."""
        i = bisect.bisect_left(self.graph_sizes, num_rows)
        return self.graph_sizes[i] if i < len(self.graph_sizes) else num_rows

    @torch.inference_mode()
    def capture(self) -> None:
        """CUDA graphs of one chain step per size, largest first, in one pool
        (the buffers hold padding meanwhile: no KV is written)."""
        if not self.graph_sizes or self.device.type != "cuda":
            return
        b = self.buffers
        b.seq_lens.zero_()
        b.slot_mapping.fill_(-1)
        b.input_ids.zero_()
        b.positions.zero_()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.graph_sizes):
            self.step_forward(size, self.metadata(size, host=False))  # compile, autotune
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs = self.step_forward(size, self.metadata(size, host=False))
            self._graphs[size] = (graph, outputs)
        torch.cuda.synchronize()
        logger.info("speculative proposer: chain-step CUDA graphs for %d batch sizes",
                    len(self._graphs))
