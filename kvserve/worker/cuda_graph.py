"""CUDA graphs of whole steps: decode steps by batch size, prefill and mixed
steps by token count, speculative verify steps by token count.

A step launches a few hundred small kernels; replaying them as one graph
removes the host's launch cost (a Triton launch costs the host 15-50 µs), which
dominates decode at small batch and is most of the host's time in a large
mixed step. All graphs read the persistent ``StepBuffers`` at fixed addresses
and share one memory pool, captured from the largest down, so together they
take about as much memory as the largest.

- Decode graphs run the model, the logits matmul and the greedy argmax
  (the sampler's, for a batch whose rows are all ``argmax_only``), keeping
  the hidden states too (a speculative proposer reads them), for
  ``size`` requests of one new token each. A step of ``n`` requests replays the smallest captured
  size ``>= n``; the extra rows are padding that writes no KV and attends to
  nothing (see ``StepBuffers.fill``). Attention runs with ``max_seq_len =
  max_model_len``: the split-K decode grid is frozen at capture and must
  cover every later context.
- Token graphs run the model for steps of any mix of prefills, chunks and
  decodes, over ``num_tokens`` tokens and ``max_num_seqs`` request slots; a
  step of ``t`` tokens replays the smallest size ``>= t``, its padding tokens
  belonging to no request, its padding requests having no tokens. Their
  attention is the prefill kernel, whose grid depends on those two numbers
  only. They return hidden states; the runner computes logits for the
  sampled rows alone, as in an eager step.
- Verify graphs (with speculative decoding) run the model for a verify step
  laid out one query token per row (``worker/verify_layout.py``): ``size``
  rows, each a decode of one token with its request's block table, gathered
  on the device inside the graph from the step's request block table. A
  step of ``t`` tokens (every request its last token and its proposals)
  replays the smallest size ``>= t``; the extra rows are padding (a
  zero-length query, slot -1). Attention is the split-K decode kernel, its
  grid frozen as the decode graphs' (``max_seq_len = max_model_len``).
  Like token graphs they return hidden states: the runner computes the
  logits of the step's rows (all of them verify).

With LoRA (the batched kernels of ``kernels/lora.py``) every graph runs
each wrapped linear's shrink and expand, which read the step's
token-to-slot tensors from ``LoRABatch``'s fixed buffers (the gathered
form up to ``GATHER_MAX_TOKENS`` tokens, the segmented one above). So
steps with adapters, any mix of them and none, replay graphs too; a step
without adapters pays the launches of programs that return at once.

With tensor parallelism the graphs capture the TP collectives (NCCL, or
the one-shot all-reduce): every size is first run on a side stream, so
each communicator is initialised and warm before capture. A pipeline stage
captures its own layers only: a later stage's graphs read the previous
stage's hidden states from a fixed ``intermediate`` buffer (the runner
receives into it before a replay), and a stage before the last computes no
logits and returns its ``[size, 2, hidden_size]`` output for the runner to
send on.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.lora.layers import LoRABatch
from kvserve.models.registry import CausalLM
from kvserve.worker.input_batch import StepBuffers
from kvserve.worker.verify_layout import VerifyBuffers

logger = logging.getLogger(__name__)
T = TypeVar("T")


def _smallest_at_least(sizes: list[int], n: int) -> int | None:
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class CudaGraphs:
    """Captured decode and token graphs, and their static outputs."""

    def __init__(
        self, model: CausalLM, buffers: StepBuffers, decode_sizes: tuple[int, ...],
        token_sizes: tuple[int, ...], max_model_len: int,
        argmax: Callable[[torch.Tensor], torch.Tensor] | None,
        intermediate: torch.Tensor | None = None, collectives: bool = False,
        lora_batch: LoRABatch | None = None,
        verify: VerifyBuffers | None = None, verify_sizes: tuple[int, ...] = (),
    ) -> None:
        self.model = model
        # the LoRA kernels' step state, when the model's linears run them
        self.lora_batch = lora_batch if lora_batch is not None and lora_batch.use_kernels \
            else None
        # the forward runs TP collectives: capture in thread-local mode, so that
        # NCCL's watchdog thread querying its events cannot invalidate a capture
        self.capture_mode = "thread_local" if collectives else "global"
        self.buffers = buffers
        # [R, vocab] logits -> [R] greedy token ids; None: no logits (not the last stage)
        self.argmax = argmax
        # [max_num_tokens, 2, hidden_size]: a later pipeline stage's input
        self.intermediate = intermediate
        self.decode_sizes = sorted(decode_sizes)
        self.token_sizes = sorted(token_sizes)
        self.max_model_len = max_model_len
        self.decode_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # size -> ([size, vocab_size] float32 logits, [size] int64 greedy ids), or
        # before the last pipeline stage ([size, 2, hidden_size], None)
        self.logits: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.decode_hidden: dict[int, torch.Tensor] = {}  # size -> [size, hidden_size]
        self.token_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # size -> [size, hidden_size]
        # the verify layout's buffers, and its graphs by row count
        self.verify = verify
        self.verify_sizes = sorted(verify_sizes) if verify is not None else []
        self.verify_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.verify_hidden: dict[int, torch.Tensor] = {}  # size -> [size, hidden_size]
        self.pool_bytes = 0

    def decode_size(self, num_reqs: int) -> int | None:
        """The captured size a decode step of ``num_reqs`` requests replays, if any."""
        return _smallest_at_least(self.decode_sizes, num_reqs)

    def token_size(self, num_tokens: int) -> int | None:
        """The captured size a step of ``num_tokens`` tokens replays, if any."""
        return _smallest_at_least(self.token_sizes, num_tokens)

    def verify_size(self, num_tokens: int) -> int | None:
        """The captured size a verify step of ``num_tokens`` tokens replays, if any."""
        return _smallest_at_least(self.verify_sizes, num_tokens)

    def verify_metadata(self, size: int) -> AttentionMetadata:
        """A verify graph's metadata over the first ``size`` rows of the
        verify buffers (their block table as the graph's gather left it)."""
        assert self.verify is not None, "verify graphs need the verify buffers"
        return self.verify.metadata(size, self.buffers.slot_mapping, self.max_model_len)

    def decode_metadata(self, size: int) -> AttentionMetadata:
        """Decode metadata over the first ``size`` rows of the buffers."""
        return self._metadata(size, size, max_query_len=1)

    def token_metadata(self, size: int) -> AttentionMetadata:
        """Metadata of a ``size``-token step over every request slot of the buffers."""
        return self._metadata(self.buffers.max_num_reqs, size, max_query_len=size)

    def _metadata(self, num_reqs: int, num_tokens: int, max_query_len: int) -> AttentionMetadata:
        b = self.buffers
        return AttentionMetadata(
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            max_query_len=max_query_len,
            max_seq_len=self.max_model_len,  # any later context must fit the captured grids
            query_start_loc=b.query_start_loc[: num_reqs + 1],
            seq_lens=b.seq_lens[:num_reqs],
            block_table=b.block_table[:num_reqs],
            slot_mapping=b.slot_mapping[:num_tokens],
            # host copies would be stale on replay: only backends that never
            # read them (supports_cuda_graphs) are captured
            query_start_loc_cpu=[],
            seq_lens_cpu=[],
        )

    def _stage_input(self, size: int) -> torch.Tensor | None:
        return None if self.intermediate is None else self.intermediate[:size]

    def _decode_forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits, greedy_ids, _ = self._decode_forward_hidden(size)
        return logits, greedy_ids

    def _decode_forward_hidden(
        self, size: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        b = self.buffers
        hidden = self.model(b.input_ids[:size], b.positions[:size], self.decode_metadata(size),
                            self._stage_input(size))
        if self.argmax is None:  # a stage before the last: its hidden states
            return hidden, None, hidden
        logits = self.model.compute_logits(hidden)
        return logits, self.argmax(logits), hidden

    def _token_forward(self, size: int) -> torch.Tensor:
        b = self.buffers
        return self.model(b.input_ids[:size], b.positions[:size], self.token_metadata(size),
                          self._stage_input(size))

    def _verify_forward(self, size: int) -> torch.Tensor:
        b = self.buffers
        assert self.verify is not None, "verify graphs need the verify buffers"
        self.verify.gather(b.block_table, size)
        return self.model(b.input_ids[:size], b.positions[:size], self.verify_metadata(size),
                          self._stage_input(size))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, into one shared pool.

        The buffers hold padding while capturing (zero-length queries, slot
        -1), so the warm-up and captured runs write no KV.
        """
        if not self.decode_sizes and not self.token_sizes and not self.verify_sizes:
            return
        b = self.buffers
        b.query_start_loc.zero_()
        b.seq_lens.zero_()
        b.slot_mapping.fill_(-1)
        b.input_ids.zero_()
        b.positions.zero_()
        if self.verify is not None:
            self.verify.zero()
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        self._set_lora_active(True)
        for size in reversed(self.token_sizes):
            self.token_graphs[size], self.hidden[size] = _capture(self._token_forward, size, pool,
                                                                  self.capture_mode)
        for size in reversed(self.verify_sizes):
            self.verify_graphs[size], self.verify_hidden[size] = _capture(
                self._verify_forward, size, pool, self.capture_mode)
        for size in reversed(self.decode_sizes):
            graph, (logits, greedy_ids, hidden) = _capture(self._decode_forward_hidden, size,
                                                           pool, self.capture_mode)
            self.decode_graphs[size], self.logits[size] = graph, (logits, greedy_ids)
            self.decode_hidden[size] = hidden
        self._set_lora_active(False)
        torch.cuda.synchronize()
        self.pool_bytes = max(0, free_before - torch.cuda.mem_get_info()[0])
        logger.info(
            "CUDA graphs: %d decode sizes (%s), %d token sizes (%s), %d verify sizes (%s) "
            "captured in %.1f s, %.2f GB",
            len(self.decode_sizes), _span(self.decode_sizes), len(self.token_sizes),
            _span(self.token_sizes), len(self.verify_sizes), _span(self.verify_sizes),
            time.perf_counter() - start, self.pool_bytes / 1e9,
        )

    def _set_lora_active(self, active: bool) -> None:
        """Capture the LoRA kernels (their indices hold -1 meanwhile: no token
        has an adapter, so capturing writes nothing)."""
        if self.lora_batch is not None:
            self.lora_batch.active = active

    def replay_decode(self, size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the decode graph of ``size`` on the buffers' contents; its logits
        and greedy token ids (before the last pipeline stage: its output, None)."""
        self.decode_graphs[size].replay()
        return self.logits[size]

    def replay_tokens(self, size: int) -> torch.Tensor:
        """Run the token graph of ``size`` on the buffers' contents; its hidden states."""
        self.token_graphs[size].replay()
        return self.hidden[size]

    def replay_verify(self, size: int) -> torch.Tensor:
        """Run the verify graph of ``size`` on the buffers' contents (the step's
        inputs and the verify rows); its hidden states."""
        self.verify_graphs[size].replay()
        return self.verify_hidden[size]


def _capture(forward: Callable[[int], T], size: int, pool: Any,
             capture_mode: str = "global") -> tuple[torch.cuda.CUDAGraph, T]:
    """A graph of ``forward(size)`` in ``pool`` (a ``torch.cuda.graph_pool_handle()``),
    and its static output."""
    # compiles and autotunes kernels outside the capture, and warms the
    # collectives up on a side stream (NCCL captured without it can hang)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward(size)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode=capture_mode):
        output = forward(size)
    return graph, output


def _span(sizes: list[int]) -> str:
    return f"{sizes[0]}..{sizes[-1]}" if sizes else "none"
