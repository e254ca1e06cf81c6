"""The step's flat inputs, built with numpy from state kept between steps,
and the persistent device buffers they are copied into.

``BlockTables`` keeps one host row of block ids per running request, updated
by the scheduler's diffs (new blocks are appended, a finished or preempted
request frees its row), so a step never rebuilds a table from Python lists.
``StepBuffers`` owns fixed device tensors sized for the largest step, plus
pinned host mirrors: a step writes the host side with vectorised numpy and
copies each buffer once, non-blocking. CUDA graphs read those device tensors
at fixed addresses, so the same buffers serve eager and graphed steps.

With async scheduling a step is prepared before the host has read the tokens
of the step still running; those tokens are *carried*: the host writes a
placeholder, and ``StepBuffers.carry`` holds (row of ``input_ids``, row of
the previous step's sampled tensor) pairs for the runner to copy on the
device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.core.block_pool import NULL_BLOCK_ID


class BlockTables:
    """Host block tables: row ``r`` holds the block ids of the request using it."""

    def __init__(self, max_num_reqs: int, max_blocks_per_req: int) -> None:
        self.table = np.full((max_num_reqs, max_blocks_per_req), NULL_BLOCK_ID, dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def add(self, block_ids: list[int]) -> int:
        """Give a request a row holding ``block_ids``; return the row."""
        if not self._free_rows:
            raise RuntimeError(
                f"BlockTables: all {self.table.shape[0]} rows are in use; the scheduler ran "
                "more requests than max_num_seqs"
            )
        row = self._free_rows.pop()
        self.num_blocks[row] = 0
        self.append(row, block_ids)
        return row

    def append(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            raise RuntimeError(
                f"BlockTables: row {row} would hold {end} blocks; at most {self.table.shape[1]} "
                "fit max_model_len"
            )
        self.table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def free(self, row: int) -> None:
        self._free_rows.append(row)


@dataclass
class HostStep:
    """One step's inputs on the host (numpy views of the pinned buffers)."""

    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    max_blocks: int  # width of the step's block table: the most blocks a request holds
    query_start_loc: np.ndarray  # [num_reqs + 1] int32
    seq_lens: np.ndarray  # [num_reqs] int32
    sample_rows: np.ndarray  # [num_sample_reqs] int64: indices of requests that sample
    logits_indices: np.ndarray  # [num_sample_reqs] int64: their last token's row
    num_carried: int  # tokens to take from the previous step's sampled tensor


class StepBuffers:
    """Persistent device tensors of the step's inputs, with pinned host mirrors."""

    def __init__(
        self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int,
        device: torch.device,
    ) -> None:
        self.device = device
        pin = device.type == "cuda"

        def pair(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            return host, (host if device.type == "cpu" else torch.zeros_like(host, device=device))

        self.input_ids_cpu, self.input_ids = pair((max_num_tokens,), torch.int64)
        self.positions_cpu, self.positions = pair((max_num_tokens,), torch.int64)
        self.slot_mapping_cpu, self.slot_mapping = pair((max_num_tokens,), torch.int64)
        self.query_start_loc_cpu, self.query_start_loc = pair((max_num_reqs + 1,), torch.int32)
        self.seq_lens_cpu, self.seq_lens = pair((max_num_reqs,), torch.int32)
        self.logits_indices_cpu, self.logits_indices = pair((max_num_reqs,), torch.int64)
        self.block_table_cpu, self.block_table = pair(
            (max_num_reqs, max_blocks_per_req), torch.int32
        )
        # [0]: rows of input_ids, [1]: rows of the previous step's sampled tokens
        self.carry_cpu, self.carry = pair((2, max_num_reqs), torch.int64)
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs
        # the last step's host-to-device copies: the host side may be rewritten
        # only once they are done (a step that samples nothing does not sync)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def fill(
        self,
        token_chunks: list[list[int]],
        num_computed: np.ndarray,  # [num_reqs] int64
        num_scheduled: np.ndarray,  # [num_reqs] int64
        num_total_tokens: np.ndarray,  # [num_reqs] int64: prompt + outputs so far
        rows: np.ndarray,  # [num_reqs] int64: the requests' rows in ``tables``
        tables: BlockTables,
        block_size: int,
        padded_num_reqs: int,
        padded_num_tokens: int,
        carried_reqs: np.ndarray | None = None,  # [num_carried] int64
        carried_src: np.ndarray | None = None,  # [num_carried] int64
    ) -> HostStep:
        """Write the step's inputs into the host buffers and copy them to the device.

        ``token_chunks[i]`` are request i's scheduled token ids. The last token
        of request ``carried_reqs[j]`` is not known on the host (its chunk holds
        a placeholder): it is row ``carried_src[j]`` of the previous step's
        sampled tokens, and ``carry`` gets the pair for the runner. Requests
        ``num_reqs .. padded_num_reqs - 1`` are padding for a CUDA graph, with a
        zero-length query, which the attention kernels skip; so are tokens
        ``num_tokens .. padded_num_tokens - 1``, which belong to no request
        (id 0, position 0 and slot -1, which the KV write skips).
        """
        if self._copied is not None:
            self._copied.synchronize()
        num_reqs = len(token_chunks)
        cu = np.cumsum(num_scheduled)
        num_tokens = int(cu[-1])
        if padded_num_tokens > self.max_num_tokens or padded_num_reqs > self.max_num_reqs:
            raise RuntimeError(
                f"StepBuffers: a step of {padded_num_tokens} tokens / {padded_num_reqs} requests "
                f"exceeds the buffers ({self.max_num_tokens} / {self.max_num_reqs})"
            )
        ends = num_computed + num_scheduled
        query_start_loc = self.query_start_loc_cpu.numpy()[: padded_num_reqs + 1]
        query_start_loc[0] = 0
        query_start_loc[1 : num_reqs + 1] = cu
        query_start_loc[num_reqs + 1 :] = num_tokens
        seq_lens = self.seq_lens_cpu.numpy()[:padded_num_reqs]
        seq_lens[:num_reqs] = ends
        seq_lens[num_reqs:] = 0

        if num_tokens == num_reqs:  # one token each: a decode-shaped step
            token_req = np.arange(num_reqs)
            positions = num_computed
        else:
            token_req = np.repeat(np.arange(num_reqs), num_scheduled)
            positions = (np.arange(num_tokens) - np.repeat(cu - num_scheduled, num_scheduled)
                         + num_computed[token_req])
        token_rows = rows[token_req]
        block_ids = tables.table[token_rows, positions // block_size]
        slot_mapping = self.slot_mapping_cpu.numpy()[:padded_num_tokens]
        slot_mapping[:num_tokens] = block_ids.astype(np.int64) * block_size + positions % block_size
        slot_mapping[num_tokens:] = -1
        positions_out = self.positions_cpu.numpy()[:padded_num_tokens]
        positions_out[:num_tokens] = positions
        positions_out[num_tokens:] = 0
        input_ids = self.input_ids_cpu.numpy()[:padded_num_tokens]
        input_ids[:num_tokens] = np.fromiter(
            (t for chunk in token_chunks for t in chunk), dtype=np.int64, count=num_tokens
        )
        input_ids[num_tokens:] = 0

        max_blocks = int(tables.num_blocks[rows].max())
        block_table = self.block_table_cpu.numpy()[:num_reqs, :max_blocks]
        block_table[:] = tables.table[rows, :max_blocks]

        sample_rows = np.flatnonzero(ends == num_total_tokens)
        logits_indices = self.logits_indices_cpu.numpy()[: len(sample_rows)]
        logits_indices[:] = cu[sample_rows] - 1

        num_carried = 0 if carried_reqs is None else len(carried_reqs)
        if num_carried:
            carry = self.carry_cpu.numpy()
            carry[0, :num_carried] = cu[carried_reqs] - 1
            carry[1, :num_carried] = carried_src

        if self.device.type != "cpu":
            self._copy(self.input_ids, self.input_ids_cpu, padded_num_tokens)
            self._copy(self.positions, self.positions_cpu, padded_num_tokens)
            self._copy(self.slot_mapping, self.slot_mapping_cpu, padded_num_tokens)
            self._copy(self.query_start_loc, self.query_start_loc_cpu, padded_num_reqs + 1)
            self._copy(self.seq_lens, self.seq_lens_cpu, padded_num_reqs)
            self._copy(self.logits_indices, self.logits_indices_cpu, len(sample_rows))
            self.block_table[:num_reqs, :max_blocks].copy_(
                self.block_table_cpu[:num_reqs, :max_blocks], non_blocking=True
            )
            if num_carried:
                self.carry[:, :num_carried].copy_(self.carry_cpu[:, :num_carried],
                                                  non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return HostStep(
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            max_query_len=int(num_scheduled.max()),
            max_seq_len=int(ends.max()),
            max_blocks=max_blocks,
            query_start_loc=query_start_loc[: num_reqs + 1],
            seq_lens=seq_lens[:num_reqs],
            sample_rows=sample_rows,
            logits_indices=logits_indices,
            num_carried=num_carried,
        )

    @staticmethod
    def _copy(device_buffer: torch.Tensor, host_buffer: torch.Tensor, n: int) -> None:
        device_buffer[:n].copy_(host_buffer[:n], non_blocking=True)
