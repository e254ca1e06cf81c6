"""Prompt logprobs: the log-probability of each prompt token given the tokens
before it, from the hidden states of the steps that compute the prompt.

The hidden state at prompt position ``j`` predicts token ``j + 1``, so a
step that runs positions ``[start, end)`` of a request gives the logprobs
of prompt tokens ``start + 1 .. min(end, num_prompt_tokens - 1)``: chunked
prefill delivers them chunk by chunk, and the last prompt position (which
predicts the first output token) is the sampler's. Like the sampler's
logprobs they are of the raw distribution (``log_softmax`` of the logits),
with the prompt token's rank and the top ``prompt_logprobs`` tokens.

``plan`` picks a step's rows (numpy on the host, only for requests that want
them), ``compute`` runs the logits in slices on the device (a prompt of
thousands of tokens never holds its whole ``[tokens, vocab]`` logits at
once) and queues the copies to the host, ``PromptLogprobsStep.read`` turns
them into ``PromptLogprobs`` once the step is done. Nothing here samples,
touches the KV cache or decides what runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.core.outputs import Logprobs, PromptLogprobs
from kvserve.host_copy import to_device
from kvserve.models.registry import CausalLM
from kvserve.sampling.sampler import gather_logprobs
from kvserve.worker.input_batch import PersistentBatch

# hidden rows turned into logits at once: the sampler's largest batch
# (max_num_seqs rows) is what the start-up profile measured
LOGITS_SLICE_ROWS = 256


@dataclass
class PromptLogprobsPlan:
    """Which of a step's hidden rows predict which prompt tokens."""

    request_ids: list[str]
    first_index: list[int]  # per request: the first prompt token its rows predict
    counts: list[int]  # per request: how many rows (consecutive in hidden_rows)
    num_top: list[int]  # per request: the top logprobs it wants
    hidden_rows: np.ndarray  # [N] int64: rows of the step's hidden states
    targets: np.ndarray  # [N] int64: the prompt tokens they predict


def plan(
    wanted: dict[str, int],
    request_ids: list[str],
    rows: np.ndarray,
    num_scheduled: np.ndarray,
    batch: PersistentBatch,
) -> PromptLogprobsPlan | None:
    """The plan of a step before its forward (``batch.num_computed_tokens``
    not yet advanced). ``wanted`` maps the held requests whose prompts are
    not done to their ``prompt_logprobs``; a request whose prompt this step
    completes is removed from it."""
    index = {request_id: i for i, request_id in enumerate(request_ids)}
    offsets = np.cumsum(num_scheduled) - num_scheduled
    out = PromptLogprobsPlan([], [], [], [], np.zeros(0, np.int64), np.zeros(0, np.int64))
    hidden_rows, targets = [], []
    for request_id, num_top in list(wanted.items()):
        i = index.get(request_id)
        if i is None:
            continue
        row = int(rows[i])
        start = int(batch.num_computed_tokens[row])
        end = start + int(num_scheduled[i])
        last = int(batch.num_prompt_tokens[row]) - 1  # the position that samples
        if end >= last:
            del wanted[request_id]
        if min(end, last) <= start:
            continue
        count = min(end, last) - start
        out.request_ids.append(request_id)
        out.first_index.append(start + 1)
        out.counts.append(count)
        out.num_top.append(num_top)
        hidden_rows.append(np.arange(count) + offsets[i])
        targets.append(batch.token_ids[row, start + 1:start + 1 + count])
    if not out.request_ids:
        return None
    out.hidden_rows = np.concatenate(hidden_rows).astype(np.int64)
    out.targets = np.concatenate(targets).astype(np.int64)
    return out


@dataclass
class PromptLogprobsStep:
    """A plan with its results queued to the host (valid once the step's end
    event is reached)."""

    plan: PromptLogprobsPlan
    token_ids: torch.Tensor  # [N, 1 + max_top] int64: the prompt token, then the top ones
    logprobs: torch.Tensor  # [N, 1 + max_top] float32
    ranks: torch.Tensor  # [N] int64: the prompt token's 1-based rank

    def read(self) -> dict[str, PromptLogprobs]:
        ids, values, ranks = self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        result = {}
        start = 0
        for request_id, first, count, num_top in zip(
                self.plan.request_ids, self.plan.first_index, self.plan.counts,
                self.plan.num_top, strict=True):
            width = num_top + 1
            result[request_id] = PromptLogprobs(first, [
                Logprobs(ids[k][:width], values[k][:width], int(ranks[k]))
                for k in range(start, start + count)])
            start += count
        return result


def compute(model: CausalLM, hidden: torch.Tensor, step_plan: PromptLogprobsPlan,
            device: torch.device) -> PromptLogprobsStep:
    """Queue the plan's logprobs on the device and their copies to the host."""
    rows = to_device(step_plan.hidden_rows, torch.int64, device)
    targets = to_device(step_plan.targets, torch.int64, device)
    max_top = max(step_plan.num_top)
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for s in range(0, len(step_plan.hidden_rows), LOGITS_SLICE_ROWS):
        logits = model.compute_logits(hidden[rows[s:s + LOGITS_SLICE_ROWS]]).float()
        out = gather_logprobs(torch.log_softmax(logits, dim=-1),
                              targets[s:s + LOGITS_SLICE_ROWS], max_top)
        assert out.logprob_token_ids is not None and out.logprobs is not None
        assert out.sampled_token_ranks is not None
        parts.append((out.logprob_token_ids, out.logprobs, out.sampled_token_ranks))
    tensors = [torch.cat([p[k] for p in parts]) for k in range(3)]
    if device.type == "cuda":
        tensors = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                   for t in tensors]
    return PromptLogprobsStep(step_plan, *tensors)
