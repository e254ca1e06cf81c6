"""The runner's state between steps as numpy columns, the step's flat inputs
built from it with numpy, and the persistent device buffers they go to.

``PersistentBatch`` keeps one row per request the runner holds: its token ids
(prompt and the outputs the host has read), token counts, block ids and
sampling settings. The scheduler's diffs update it (a new request fills a
row, new blocks are appended, a finished or preempted request frees its
row), so a step gathers its requests' columns with numpy instead of walking
Python objects; at batch 256 that per-request Python is most of the host's
time. ``StepBuffers`` owns fixed device tensors sized for the largest step,
packed into one buffer with a pinned host mirror: a step writes the host side
and copies it with one non-blocking copy (and the block table with another),
since each copy costs the host 10-30 µs. CUDA graphs read those device
tensors at fixed addresses, so the same buffers serve eager and graphed steps.

With async scheduling a step is prepared before the host has read the tokens
of the step still running; those tokens are *carried*: the host writes a
placeholder, and ``StepBuffers.carry`` holds (row of ``input_ids``, row of
the previous step's sampled tensor) pairs for the runner to copy on the
device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.core.block_pool import NULL_BLOCK_ID
from kvserve.core.sampling_params import SamplingParams
from kvserve.sampling.sampler import SamplingRows


class PersistentBatch:
    """Row ``r`` holds the state of the request using it, in numpy columns."""

    def __init__(
        self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, vocab_size: int
    ) -> None:
        # prompt + outputs; entries past num_tokens are stale
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # known to the host
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.full((max_num_reqs, max_blocks_per_req), NULL_BLOCK_ID,
                                   dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        self.sampling = SamplingRows(max_num_reqs, vocab_size)
        # bumped when a row is freed: a step read after its request left the
        # row (finished, aborted, preempted) must not write into it
        self.generation = np.zeros(max_num_reqs, dtype=np.int64)
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    @property
    def max_num_reqs(self) -> int:
        return len(self.num_tokens)

    def add(
        self, token_ids: Sequence[int], num_prompt_tokens: int, num_computed_tokens: int,
        block_ids: Sequence[int], params: SamplingParams,
    ) -> int:
        """Give a request a row; return the row."""
        if not self._free_rows:
            raise RuntimeError(
                f"PersistentBatch: all {self.max_num_reqs} rows are in use; the scheduler ran "
                "more requests than max_num_seqs"
            )
        if len(token_ids) > self.token_ids.shape[1]:
            raise RuntimeError(
                f"PersistentBatch: a request of {len(token_ids)} tokens exceeds "
                f"max_model_len={self.token_ids.shape[1]}"
            )
        row = self._free_rows.pop()
        self.token_ids[row, :len(token_ids)] = token_ids
        self.num_tokens[row] = len(token_ids)
        self.num_prompt_tokens[row] = num_prompt_tokens
        self.num_computed_tokens[row] = num_computed_tokens
        self.min_tokens[row] = params.min_tokens
        self.sampling.set(row, params)
        self.num_blocks[row] = 0
        self.append_blocks(row, block_ids)
        return row

    def append_blocks(self, row: int, block_ids: Sequence[int]) -> None:
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            raise RuntimeError(
                f"PersistentBatch: row {row} would hold {end} blocks; at most "
                f"{self.block_table.shape[1]} fit max_model_len"
            )
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def free(self, row: int) -> None:
        self.generation[row] += 1
        self._free_rows.append(row)

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Append one token to each of ``rows`` (distinct)."""
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1

    def extend_tokens(self, row: int, token_ids: Sequence[int]) -> None:
        """Append several tokens to one row (a speculative step's accepted ones)."""
        start = int(self.num_tokens[row])
        self.token_ids[row, start:start + len(token_ids)] = token_ids
        self.num_tokens[row] = start + len(token_ids)

    def output_token_ids(self, row: int) -> list[int]:
        return self.token_ids[row, self.num_prompt_tokens[row]:self.num_tokens[row]].tolist()

    def prompt_token_ids(self, row: int) -> list[int]:
        return self.token_ids[row, :self.num_prompt_tokens[row]].tolist()

    def needs_known_outputs(self, rows: np.ndarray) -> np.ndarray:
        """Per row: whether sampling reads its output tokens (penalties) or
        their exact count (still below ``min_tokens``), not just the last one."""
        num_outputs = self.num_tokens[rows] - self.num_prompt_tokens[rows]
        return self.sampling.has_penalties(rows) | (num_outputs < self.min_tokens[rows])


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
    sample_indices: np.ndarray  # [num_sample_reqs] int64: indices of requests that sample
    logits_indices: np.ndarray  # [num_sample_reqs] int64: their last token's row
    num_carried: int  # tokens to take from the previous step's sampled tensor


class StepBuffers:
    """Persistent device tensors of the step's inputs, with pinned host mirrors.

    All but the block table are views of one packed int64 buffer, laid out
    small arrays first, then ``input_ids``, ``positions`` and ``slot_mapping``
    (``max_num_tokens`` each), so a step copies one prefix of it.
    """

    def __init__(
        self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int,
        device: torch.device,
    ) -> None:
        self.device = device
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs
        pin = device.type == "cuda"
        num_tokens, num_reqs = max_num_tokens, max_num_reqs
        # int64 slots: logits_indices, carry, (query_start_loc, seq_lens as int32), then tokens
        num_int32_slots = -(-(2 * num_reqs + 1) // 2)
        self._tokens_start = 3 * num_reqs + num_int32_slots
        self._packed_cpu = torch.zeros(self._tokens_start + 3 * num_tokens, dtype=torch.int64,
                                       pin_memory=pin)
        self._packed = (self._packed_cpu if device.type == "cpu"
                        else torch.zeros_like(self._packed_cpu, device=device))
        self.block_table_cpu = torch.zeros((num_reqs, max_blocks_per_req), dtype=torch.int32,
                                           pin_memory=pin)
        self.block_table = (self.block_table_cpu if device.type == "cpu"
                            else torch.zeros_like(self.block_table_cpu, device=device))

        def views(packed: torch.Tensor) -> dict[str, torch.Tensor]:
            int32 = packed[3 * num_reqs:self._tokens_start].view(torch.int32)
            tokens = packed[self._tokens_start:].view(3, num_tokens)
            return {
                "logits_indices": packed[:num_reqs],
                # [0]: rows of input_ids, [1]: rows of the previous step's sampled tokens
                "carry": packed[num_reqs:3 * num_reqs].view(2, num_reqs),
                "query_start_loc": int32[:num_reqs + 1],
                "seq_lens": int32[num_reqs + 1:2 * num_reqs + 1],
                "input_ids": tokens[0],
                "positions": tokens[1],
                "slot_mapping": tokens[2],
            }

        host, dev = views(self._packed_cpu), views(self._packed)
        self.logits_indices_cpu, self.logits_indices = host["logits_indices"], dev["logits_indices"]
        self.carry_cpu, self.carry = host["carry"], dev["carry"]
        self.query_start_loc_cpu = host["query_start_loc"]
        self.query_start_loc = dev["query_start_loc"]
        self.seq_lens_cpu, self.seq_lens = host["seq_lens"], dev["seq_lens"]
        self.input_ids_cpu, self.input_ids = host["input_ids"], dev["input_ids"]
        self.positions_cpu, self.positions = host["positions"], dev["positions"]
        self.slot_mapping_cpu, self.slot_mapping = host["slot_mapping"], dev["slot_mapping"]
        # numpy views of the host side, made once (``Tensor.numpy`` costs µs a call)
        self._np = {name: tensor.numpy() for name, tensor in host.items()}
        self._np["block_table"] = self.block_table_cpu.numpy()
        # the last step's host-to-device copies: the host side may be rewritten
        # only once they are done (a step that samples nothing does not sync)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def fill(
        self,
        batch: PersistentBatch,
        rows: np.ndarray,  # [num_reqs] int64: the requests' rows in ``batch``
        num_scheduled: np.ndarray,  # [num_reqs] int64
        block_size: int,
        padded_num_reqs: int,
        padded_num_tokens: int,
        carried_reqs: np.ndarray | None = None,  # [num_carried] int64
        carried_src: np.ndarray | None = None,  # [num_carried] int64
    ) -> HostStep:
        """Write the step's inputs into the host buffers and copy them to the device.

        Request i runs ``num_scheduled[i]`` tokens of row ``rows[i]`` from its
        ``num_computed_tokens`` on. The tokens of request ``carried_reqs[j]``
        are not known on the host (their input ids are stale): the first is
        row ``carried_src[j]`` of the previous step's sampled tokens, and
        ``carry`` gets the pair (the request's first row, that index) for the
        runner (after a speculative step the rest are its proposals, and the
        runner moves the rows: ``ModelRunner._carry``). Requests ``num_reqs ..
        padded_num_reqs - 1`` are padding for a CUDA graph, with a zero-length
        query, which the attention kernels skip; so are tokens ``num_tokens ..
        padded_num_tokens - 1``, which belong to no request (id 0, position 0
        and slot -1, which the KV write skips).
        """
        if self._copied is not None:
            self._copied.synchronize()
        num_reqs = len(rows)
        cu = np.cumsum(num_scheduled)
        num_tokens = int(cu[-1])
        if padded_num_tokens > self.max_num_tokens or padded_num_reqs > self.max_num_reqs:
            raise RuntimeError(
                f"StepBuffers: a step of {padded_num_tokens} tokens / {padded_num_reqs} requests "
                f"exceeds the buffers ({self.max_num_tokens} / {self.max_num_reqs})"
            )
        num_computed = batch.num_computed_tokens[rows]
        ends = num_computed + num_scheduled
        query_start_loc = self._np["query_start_loc"][: padded_num_reqs + 1]
        query_start_loc[0] = 0
        query_start_loc[1 : num_reqs + 1] = cu
        query_start_loc[num_reqs + 1 :] = num_tokens
        seq_lens = self._np["seq_lens"][:padded_num_reqs]
        seq_lens[:num_reqs] = ends
        seq_lens[num_reqs:] = 0

        if num_tokens == num_reqs:  # one token each: a decode-shaped step
            token_rows = rows
            positions = num_computed
        else:
            token_req = np.repeat(np.arange(num_reqs), num_scheduled)
            token_rows = rows[token_req]
            positions = (np.arange(num_tokens) - np.repeat(cu - num_scheduled, num_scheduled)
                         + num_computed[token_req])
        block_ids = batch.block_table[token_rows, positions // block_size]
        slot_mapping = self._np["slot_mapping"][:padded_num_tokens]
        slot_mapping[:num_tokens] = block_ids.astype(np.int64) * block_size + positions % block_size
        slot_mapping[num_tokens:] = -1
        positions_out = self._np["positions"][:padded_num_tokens]
        positions_out[:num_tokens] = positions
        positions_out[num_tokens:] = 0
        input_ids = self._np["input_ids"][:padded_num_tokens]
        input_ids[:num_tokens] = batch.token_ids[token_rows, positions]
        input_ids[num_tokens:] = 0

        max_blocks = int(batch.num_blocks[rows].max())
        block_table = self._np["block_table"]
        block_table[:num_reqs, :max_blocks] = batch.block_table[rows, :max_blocks]

        # a request samples once its tokens are all computed (a carried one's too)
        sample_indices = np.flatnonzero(ends >= batch.num_tokens[rows])
        logits_indices = self._np["logits_indices"][: len(sample_indices)]
        logits_indices[:] = cu[sample_indices] - 1

        num_carried = 0 if carried_reqs is None else len(carried_reqs)
        if num_carried:
            carry = self._np["carry"]
            carry[0, :num_carried] = cu[carried_reqs] - num_scheduled[carried_reqs]
            carry[1, :num_carried] = carried_src

        if self.device.type != "cpu":
            n = self._tokens_start + 2 * self.max_num_tokens + padded_num_tokens
            self._packed[:n].copy_(self._packed_cpu[:n], non_blocking=True)
            # whole rows but the last: one contiguous copy (columns past a
            # row's blocks are stale and never read)
            n = (num_reqs - 1) * block_table.shape[1] + max_blocks
            self.block_table.view(-1)[:n].copy_(self.block_table_cpu.view(-1)[:n],
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
            sample_indices=sample_indices,
            logits_indices=logits_indices,
            num_carried=num_carried,
        )


def carry_rows(
    index: torch.Tensor,  # [5, T] int64: rows, requests, sources, proposal rows, offsets
    tokens: torch.Tensor,  # [N]: each source's token after its accepted proposals
    rejected: torch.Tensor,  # [N]: each source's rejected proposals
    proposals: torch.Tensor | None,  # [B, P]: the proposals made (None: none)
    input_ids: torch.Tensor,  # [>= rows] int64, written
    positions: torch.Tensor,  # [>= rows] int64, moved back
    slot_mapping: torch.Tensor,  # [>= rows] int64, written
    block_table: torch.Tensor,  # [>= requests, W] int32
    seq_lens: torch.Tensor,  # int32: per row (per_row) or per request, moved back
    block_size: int,
    per_row: bool,
) -> None:
    """Move the carried rows of ``index`` back by their source step's rejected
    proposals and fill in their tokens, in place: per carried row its row of
    the step's inputs, its request (its row of ``block_table``), its index in
    the source step's outputs (``tokens``, ``rejected``), its row of
    ``proposals`` and its offset among the request's rows (0: the token
    after the accepted proposals; ``j``: the ``j``-th proposal). Positions
    move back, slots follow the new positions, sequence lengths move back
    per row (``per_row``, the verify layout) or once per request.
    ``kernels/carry.py`` does the same in one launch."""
    rows, requests, sources, proposal_rows, offsets = index.unbind(0)
    moved_back = rejected.long()[sources]
    new_positions = positions[rows] - moved_back
    positions[rows] = new_positions
    token_ids = tokens.long()[sources]
    if proposals is not None:
        columns = (offsets - 1).clamp(min=0, max=proposals.shape[1] - 1)
        token_ids = torch.where(offsets == 0, token_ids, proposals.long()[proposal_rows, columns])
    input_ids[rows] = token_ids
    blocks = block_table[requests, new_positions // block_size]
    slot_mapping[rows] = blocks.long() * block_size + new_positions % block_size
    if per_row:
        seq_lens[rows] = (new_positions + 1).to(seq_lens.dtype)
    else:
        first = offsets == 0
        seq_lens[requests[first]] -= moved_back[first].to(seq_lens.dtype)
