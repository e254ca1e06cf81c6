"""The one-token-per-row layout of a speculative verify step, and its buffers.

A verify step gives each request ``1 + n`` new tokens: its last token and
``n`` proposals, at the end of its context. Laid out as a prefill (one
attention row per request, ``max_query_len = 1 + n``) it runs the prefill
kernel, which gives one program per KV head and walks the whole context in
it, and it replays a token graph padded to at least 16 tokens and
``max_num_seqs`` request slots. Laid out one query token per row
(``AttentionMetadata.verify``) it is a decode step of ``T = sum(1 + n)``
rows: row ``i`` is token ``i`` with ``seq_len = position + 1`` and its
request's block table, so the causal mask among a request's new tokens is
each row's context bound, and the split-K decode kernel runs it (every
backend writes the step's KV before it attends, so a row reads the new KV
of the rows before it). The layout needs nothing but the step's positions
and each token's request: ``VerifyBuffers`` holds them at fixed addresses
(the verify CUDA graphs read them) and expands the request block table to
one row per token on the device (``gather``, inside the graph).

Padding rows (a graph's size beyond ``T``) are zero-length queries with
``seq_len`` 0 and slot -1: they write no KV and read nothing.

This module owns the layout's buffers and metadata only; the runner decides
which steps use it (pure verify steps: every request's tokens are its last
known token and its proposals).
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.attention.metadata import AttentionMetadata

# verify graphs for decode batch sizes up to this: past it speculation
# seldom pays (core/spec_policy.py), and a larger verify step replays a
# token graph
VERIFY_GRAPH_MAX_BATCH = 64


def verify_graph_sizes(decode_sizes: tuple[int, ...], rows_per_request: int,
                       max_num_tokens: int) -> tuple[int, ...]:
    """The verify graphs' row counts: each decode graph batch size up to
    ``VERIFY_GRAPH_MAX_BATCH`` times ``1 + k`` rows, within the step buffers."""
    return tuple(size * rows_per_request for size in decode_sizes
                 if size <= VERIFY_GRAPH_MAX_BATCH
                 and size * rows_per_request <= max_num_tokens)


def is_verify_step(num_spec: np.ndarray, num_scheduled: np.ndarray, ends: np.ndarray,
                   num_tokens: np.ndarray) -> bool:
    """Whether a step (per request: its proposals, scheduled tokens, computed
    tokens after the step less its proposals, known tokens) verifies some
    proposals and every request's tokens are its last token and its
    proposals: no prompt, chunk or catch-up beside them."""
    return (bool(num_spec.any()) and bool((num_scheduled == num_spec + 1).all())
            and bool((ends == num_tokens).all()))


class VerifyBuffers:
    """Fixed device tensors of a verify step's one-token-per-row metadata,
    with a pinned host mirror; sized for ``max_rows`` rows."""

    def __init__(self, max_rows: int, max_blocks_per_req: int, device: torch.device) -> None:
        self.device = device
        self.max_rows = max_rows
        pin = device.type == "cuda"
        # int32: query_start_loc [max_rows + 1], seq_lens [max_rows], token -> request [max_rows]
        self._packed_cpu = torch.zeros(3 * max_rows + 1, dtype=torch.int32, pin_memory=pin)
        self._packed = (self._packed_cpu if device.type == "cpu"
                        else torch.zeros_like(self._packed_cpu, device=device))

        def views(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return (packed[:max_rows + 1], packed[max_rows + 1:2 * max_rows + 1],
                    packed[2 * max_rows + 1:])

        self.query_start_loc, self.seq_lens, self.request_index = views(self._packed)
        self._host = [t.numpy() for t in views(self._packed_cpu)]
        # [max_rows, max_blocks_per_req]: each row's request's block table row
        self.block_table = torch.zeros((max_rows, max_blocks_per_req), dtype=torch.int32,
                                       device=device)
        # the host side may be rewritten only once the last copy is done
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def fill(self, positions: np.ndarray, num_scheduled: np.ndarray,
             padded_rows: int) -> tuple[list[int], list[int]]:
        """Write the rows of a verify step whose tokens sit at ``positions``
        (``[T]``, the step's flat token order), ``num_scheduled[i]`` of them
        request ``i``'s, padded to ``padded_rows``, and queue their copy; the
        host copies of ``query_start_loc`` and ``seq_lens`` over the ``T``
        real rows (for a backend that reads them)."""
        num_rows = len(positions)
        if padded_rows > self.max_rows or padded_rows < num_rows:
            raise RuntimeError(f"VerifyBuffers: a verify step of {num_rows} rows padded to "
                               f"{padded_rows} does not fit {self.max_rows} rows")
        if self._copied is not None:
            self._copied.synchronize()
        query_start_loc, seq_lens, request_index = self._host
        query_start_loc[:num_rows + 1] = np.arange(num_rows + 1)
        query_start_loc[num_rows + 1:padded_rows + 1] = num_rows
        seq_lens[:num_rows] = positions + 1
        seq_lens[num_rows:padded_rows] = 0
        request_index[:num_rows] = np.repeat(np.arange(len(num_scheduled)), num_scheduled)
        request_index[num_rows:padded_rows] = 0
        if self.device.type != "cpu":
            # the three arrays lie apart in the packed buffer: copy it whole (a few KB)
            self._packed.copy_(self._packed_cpu, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return (query_start_loc[:num_rows + 1].tolist(), seq_lens[:num_rows].tolist())

    def zero(self) -> None:
        """Every row padding (for capturing: no KV write, nothing read)."""
        self._packed.zero_()

    def gather(self, request_block_table: torch.Tensor, num_rows: int) -> None:
        """Each of the first ``num_rows`` rows' block table row from its
        request's row of ``request_block_table`` (``[num_reqs, W]``, ``W`` the
        full width), on the device (a CUDA graph captures it)."""
        torch.index_select(request_block_table, 0, self.request_index[:num_rows],
                           out=self.block_table[:num_rows])

    def metadata(self, num_rows: int, slot_mapping: torch.Tensor, max_seq_len: int,
                 host: tuple[list[int], list[int]] | None = None) -> AttentionMetadata:
        """The step's metadata over the first ``num_rows`` rows (``gather``
        first). ``max_seq_len``: a bound of every row's context (a graph's is
        ``max_model_len``: its split-K grid must cover any later context);
        ``host``: ``fill``'s host copies (eager steps), else empty."""
        query_start_loc_cpu, seq_lens_cpu = host if host is not None else ([], [])
        return AttentionMetadata(
            num_reqs=num_rows,
            num_tokens=num_rows,
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_start_loc=self.query_start_loc[:num_rows + 1],
            seq_lens=self.seq_lens[:num_rows],
            block_table=self.block_table[:num_rows],
            slot_mapping=slot_mapping[:num_rows],
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens_cpu=seq_lens_cpu,
            verify=True,
        )
