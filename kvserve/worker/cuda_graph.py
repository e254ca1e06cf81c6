"""CUDA graphs of the decode step, one per batch-size bucket.

A decode step launches a few hundred small kernels; replaying them as one
graph removes the host's launch cost, which dominates at small batch. Each
graph runs the model and the logits matmul for ``size`` requests of one new
token each, reading the persistent ``StepBuffers`` at fixed addresses. A step
of ``n`` requests replays the smallest captured size ``>= n``, the extra rows
being padding that writes no KV and attends to nothing (see
``StepBuffers.fill``). All graphs share one memory pool, captured from the
largest down, so they together take about as much memory as the largest.

Attention runs with ``max_seq_len = max_model_len``: the split-K decode grid
and partition size are frozen at capture and must cover every later context.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.models.registry import CausalLM
from kvserve.worker.input_batch import StepBuffers

logger = logging.getLogger(__name__)


class DecodeGraphs:
    """Captured decode graphs by batch size, and their static logits outputs."""

    def __init__(
        self, model: CausalLM, buffers: StepBuffers, sizes: tuple[int, ...], max_model_len: int
    ) -> None:
        self.model = model
        self.buffers = buffers
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # size -> [size, vocab_size] float32
        self.pool_bytes = 0

    @property
    def max_size(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def padded_size(self, num_reqs: int) -> int | None:
        """The captured size a decode step of ``num_reqs`` requests replays, if any."""
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def metadata(self, size: int) -> AttentionMetadata:
        """Decode metadata over the first ``size`` rows of the buffers."""
        b = self.buffers
        return AttentionMetadata(
            num_reqs=size,
            num_tokens=size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc=b.query_start_loc[: size + 1],
            seq_lens=b.seq_lens[:size],
            block_table=b.block_table[:size],
            slot_mapping=b.slot_mapping[:size],
            # host copies would be stale on replay: only backends that never
            # read them (supports_cuda_graphs) are captured
            query_start_loc_cpu=[],
            seq_lens_cpu=[],
        )

    def _forward(self, size: int) -> torch.Tensor:
        b = self.buffers
        hidden = self.model(b.input_ids[:size], b.positions[:size], self.metadata(size))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, into one shared pool.

        The buffers hold padding while capturing (zero-length queries, slot
        -1), so the warm-up and captured runs write no KV.
        """
        if not self.sizes:
            return
        b = self.buffers
        b.query_start_loc.zero_()
        b.seq_lens.zero_()
        b.slot_mapping.fill_(-1)
        b.input_ids.zero_()
        b.positions.zero_()
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._forward(size)  # compiles and autotunes kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        self.pool_bytes = max(0, free_before - torch.cuda.mem_get_info()[0])
        logger.info(
            "CUDA graphs: %d decode sizes (%d..%d) captured in %.1f s, %.2f GB",
            len(self.sizes), self.sizes[0], self.sizes[-1], time.perf_counter() - start,
            self.pool_bytes / 1e9,
        )

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of ``size`` on the buffers' current contents; its logits."""
        self.graphs[size].replay()
        return self.logits[size]
