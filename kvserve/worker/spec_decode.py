"""The model runner's side of speculative decoding: a step that verifies
proposals or makes them (``SchedulerOutput.is_spec_step``).

``write_proposals`` writes each request's scheduled proposals into its row
of the ``PersistentBatch`` past its known tokens (entries there are stale by
definition), so the step's inputs are gathered as for any step: the last
token, then the proposals. ``execute`` runs the target, takes the logits at
each verifying request's last ``1 + n`` rows, gets the target's
distributions from ``Sampler.process`` over one row per position (each
row's penalties count the proposals before it as outputs, ``min_tokens``
masks per position), verifies (``sampling/rejection.py``) the proposals it
reads from the step's input ids, and lets a device proposer (draft model,
EAGLE head) catch up and chain its next proposals, all queued without
waiting for the device. ``_read`` appends each request's accepted tokens to
its row, rolls back the computed tokens of the rejected ones and, for host
proposers (n-gram, oracle), proposes from the tokens now known.

When the engine plans ahead (``config.plans_ahead``) the next step is
queued before this one is read: the step leaves its kept tokens, rejected
counts and proposals on the device (``SampledTokens``) for the runner to
carry into it. A proposal the step in flight made reaches the scheduler as
``CARRIED_TOKEN_ID``; if that step has been read by the time it is
verified, ``write_proposals`` takes it from what ``_read`` kept.

``observe`` lets a device proposer see the tokens of every other step too,
so its KV in the shared pool stays complete.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvserve.config import SpeculativeConfig
from kvserve.core.outputs import CARRIED_TOKEN_ID, ModelRunnerOutput, SchedulerOutput
from kvserve.host_copy import to_device
from kvserve.sampling.rejection import verify_proposals
from kvserve.sampling.sampler import (
    SamplerOutput,
    SamplingBatch,
    forbidden_token_ids,
    logit_bias_triples,
)
from kvserve.spec.ngram import NgramProposer
from kvserve.spec.oracle import OracleProposer
from kvserve.spec.proposer import ChainProposer, ProposerSetting, ProposerStep

if TYPE_CHECKING:
    from kvserve.worker.model_runner import ModelRunner, PendingStep, StepInputs


@dataclass
class SpecRecord:
    """What reading a speculative step needs besides its host tensors."""

    num_spec: np.ndarray  # [N] proposals verified per sampling request
    num_draft: np.ndarray  # [N] proposals to make per sampling request
    proposal_row: np.ndarray  # [N] each one's row of the proposals made (-1: none)
    proposer_start: Any  # marks around the device proposer (None without one)
    proposer_end: Any


class SpecDecodeRunner:
    """Verification and proposals for one ``ModelRunner``."""

    def __init__(self, runner: ModelRunner, config: SpeculativeConfig,
                 device_proposer: ChainProposer | None) -> None:
        self.runner = runner
        self.config = config
        self.device_proposer = device_proposer
        self.ngram = (NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
                      if config.method == "ngram" else None)
        self.oracle = (OracleProposer(config.acceptance_rate, runner.model_config.vocab_size,
                                      config.seed) if config.method == "oracle" else None)
        # forced_acceptance: request id -> which of its next proposals count as correct
        self._forced: dict[str, list[bool]] = {}
        # request id -> the proposals of its last step read (for the next step)
        self._proposals: dict[str, list[int]] = {}

    @classmethod
    def create(cls, runner: ModelRunner, config: SpeculativeConfig, path: str | None,
               load_format: str) -> SpecDecodeRunner:
        """Load the method's network, if it has one, beside the runner's model."""
        proposer: ChainProposer | None = None
        if config.method == "draft_model":
            from kvserve.spec.draft_model import load_draft_proposer

            assert path is not None, "SpeculativeConfig checks that a draft has a path"
            proposer = load_draft_proposer(cls._setting(runner), path, load_format)
        elif config.method == "eagle":
            from kvserve.spec.eagle import load_eagle_proposer

            assert path is not None, "SpeculativeConfig checks that a head has a path"
            proposer = load_eagle_proposer(cls._setting(runner), runner.model, Path(path))
        return cls(runner, config, proposer)

    @staticmethod
    def _setting(runner: ModelRunner) -> ProposerSetting:
        return ProposerSetting(
            runner.backend, runner.device, runner.dtype, runner.block_size,
            runner.scheduler_config.max_model_len, runner.scheduler_config.max_num_seqs,
            runner.cuda_graph_sizes, runner.sampler.use_triton, len(runner.buffers.input_ids))

    # ------------------------------------------------------------ the pool

    def kv_bytes_per_block(self) -> int:
        return self.device_proposer.kv_bytes_per_block() if self.device_proposer else 0

    def bind_kv_cache(self, num_blocks: int) -> None:
        if self.device_proposer is not None:
            self.device_proposer.bind_kv_cache(num_blocks)

    def capture_graphs(self) -> None:
        """CUDA graphs of the device proposer's chain steps (decode batch sizes)."""
        if self.device_proposer is not None:
            self.device_proposer.capture()

    def on_finished(self, request_id: str, row: int) -> None:
        """A request finished in ``row``: the oracle records its output."""
        self._forced.pop(request_id, None)
        self._proposals.pop(request_id, None)
        if self.oracle is not None:
            batch = self.runner.batch
            self.oracle.record(batch.prompt_token_ids(row), batch.output_token_ids(row))

    # ------------------------------------------------------------ the step

    @staticmethod
    def num_spec(out: SchedulerOutput) -> np.ndarray:
        """The proposals each request verifies, in the step's order."""
        spec = out.scheduled_spec_token_ids
        return np.fromiter((len(spec.get(r, ())) for r in out.num_scheduled_tokens), np.int64,
                           len(out.num_scheduled_tokens))

    def write_proposals(self, out: SchedulerOutput, request_ids: list[str], rows: np.ndarray,
                        unknown: np.ndarray) -> None:
        """Write the scheduled proposals past each request's known tokens,
        except for requests whose tokens are carried (``unknown``): the
        runner takes theirs on the device. A ``CARRIED_TOKEN_ID`` proposal
        of a step read since is the one ``_read`` kept."""
        batch = self.runner.batch
        for i, request_id in enumerate(request_ids):
            proposals = out.scheduled_spec_token_ids.get(request_id)
            if not proposals or unknown[i]:
                continue
            if proposals[0] == CARRIED_TOKEN_ID:
                kept = self._proposals.get(request_id, [])
                if len(kept) < len(proposals):
                    raise RuntimeError(f"{request_id}: {len(proposals)} proposals scheduled, "
                                       f"{len(kept)} made")
                proposals = kept[:len(proposals)]
            row = rows[i]
            start = int(batch.num_tokens[row])
            batch.token_ids[row, start:start + len(proposals)] = proposals

    def execute(self, inputs: StepInputs, out: SchedulerOutput,
                num_spec: np.ndarray) -> PendingStep:
        """Queue the step: forward, verification, device proposals, copies."""
        from kvserve.worker.model_runner import PendingStep, SampledTokens

        runner, batch = self.runner, self.runner.batch
        sample_idx = inputs.sample_indices
        sample_rows = inputs.rows[sample_idx]
        n = num_spec[sample_idx]
        request_ids = inputs.sample_request_ids
        num_draft = np.array([out.num_draft_tokens.get(r, 0) for r in request_ids],
                             dtype=np.int64)
        # rows of each sampling request's last token and its proposals
        last = np.cumsum(inputs.num_scheduled)[sample_idx] - 1
        first = last - n
        counts = n + 1
        row_start = np.cumsum(counts) - counts
        flat = np.repeat(first - row_start, counts) + np.arange(int(counts.sum()))
        sampling = self._verify_batch(sample_rows, request_ids, n)
        start = runner._mark()
        hidden, decode_out = runner._forward(inputs)
        batch.num_computed_tokens[inputs.rows] += inputs.num_scheduled
        # the row indices (and the oracle's coins), in one host-to-device copy,
        # prepared while the device runs the forward (a pinned copy queued behind it)
        num_reqs, max_n = len(request_ids), int(n.max(initial=0))
        forced = np.zeros((num_reqs, max_n), dtype=np.int64) if self.config.forced_acceptance \
            else np.zeros((0, max_n), dtype=np.int64)
        for i, request_id in enumerate(request_ids if len(forced) else ()):
            correct = self._forced.pop(request_id, [])[:int(n[i])]
            forced[i, :len(correct)] = correct
        packed = to_device(np.concatenate([n, row_start, first, flat, forced.ravel()]),
                           torch.int64, runner.device)
        small = packed[:3 * num_reqs].view(3, num_reqs)
        flat_t = packed[3 * num_reqs:3 * num_reqs + len(flat)]
        forced_t = (packed[3 * num_reqs + len(flat):].view(num_reqs, max_n).bool()
                    if len(forced) else None)
        # the proposals are the step's inputs after each request's last token
        offsets = torch.arange(max_n, device=runner.device)
        input_rows = (small[2].unsqueeze(1) + 1 + offsets).clamp_(
            max=len(runner.buffers.input_ids) - 1)
        draft_ids = torch.where(offsets < small[0].unsqueeze(1),
                                runner.buffers.input_ids[input_rows], 0)
        if decode_out is not None:
            logits = decode_out[0][flat_t]
        else:
            assert hidden is not None, "a step without a decode graph has its hidden states"
            # a verify layout's rows are all verified, in order: no gather
            logits = runner.model.compute_logits(hidden[:len(flat)] if inputs.verify_layout
                                                 else hidden[flat_t])
        tokens, accepted_counts = self._verify(logits, sampling, sample_rows, draft_ids, small,
                                               forced_t)
        bonus = tokens.gather(1, (accepted_counts - 1).unsqueeze(1)).squeeze(1)
        proposer_start = proposer_end = None
        proposals = None
        proposing = np.flatnonzero(num_draft > 0)
        proposal_row = np.full(num_reqs, -1, dtype=np.int64)
        proposal_row[proposing] = np.arange(len(proposing))
        if self.device_proposer is not None:
            proposer_start = runner._mark()
            proposals = self.device_proposer.run(self._proposer_step(
                inputs, hidden, bonus, accepted_counts, small[2], num_draft))
            proposer_end = runner._mark()
        elif self.config.forced_acceptance and len(proposing):
            proposals = self._forced_proposals(bonus, request_ids, num_draft, proposing)
            proposal_row[proposing] = proposing
        runner._forget_sampled()
        runner._set_sampled(SampledTokens(bonus, sample_rows, n, small[0] - (accepted_counts - 1),
                                          proposals, proposal_row))
        # the kept tokens then their count per request: one device-to-host copy
        host = runner._copy_to_host(SamplerOutput(torch.cat([tokens, accepted_counts[:, None]],
                                                            dim=1)))
        if proposals is not None:
            host += runner._copy_to_host(SamplerOutput(proposals))
        record = SpecRecord(n, num_draft, proposal_row, proposer_start, proposer_end)
        step = PendingStep(request_ids, sample_rows, batch.generation[sample_rows],
                           batch.sampling.num_logprobs[sample_rows], host, start, runner._mark(),
                           runner._read_oldest_step,
                           inputs.decode_graph_size is not None
                           or inputs.token_graph_size is not None
                           or inputs.verify_graph_size is not None,
                           inputs.num_padding_tokens,
                           lambda pending, output: self._read(pending, output, record))
        runner._unread.append(step)
        return step

    def _verify(self, logits: torch.Tensor, sampling: SamplingBatch | None,
                sample_rows: np.ndarray, draft_ids: torch.Tensor, small: torch.Tensor,
                forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The verified tokens ``[N, 1 + max n]`` and their counts ``[N]``;
        ``forced`` (the oracle's ``forced_acceptance``) marks the greedy
        proposals to turn into the target's own tokens first."""
        runner = self.runner
        num_spec, row_start = small[0], small[1]
        if sampling is None:  # every row argmax_only: no processing changes the argmax
            greedy_ids = runner.sampler.argmax(logits)
            if forced is not None:
                draft_ids = _forced_drafts(draft_ids, row_start, greedy_ids, forced,
                                           runner.model_config.vocab_size)
            return verify_proposals(draft_ids, num_spec, row_start, greedy_ids, None)
        target_ids, target_probs = runner.sampler.process(logits.float(), sampling)
        if forced is not None and target_ids is not None:
            draft_ids = _forced_drafts(draft_ids, row_start, target_ids, forced,
                                       runner.model_config.vocab_size)
        greedy = runner.batch.sampling.greedy[sample_rows]
        greedy_mask = (to_device(greedy, torch.bool, runner.device)
                       if greedy.any() and not greedy.all() else None)
        generators = {}
        if runner._generators:
            index = {row: i for i, row in enumerate(sample_rows.tolist())}
            generators = {index[row]: g for row, g in runner._generators.items() if row in index}
        return verify_proposals(draft_ids, num_spec, row_start, target_ids, target_probs,
                                greedy_mask, generators, use_triton=runner.sampler.use_triton)

    def _verify_batch(self, sample_rows: np.ndarray, request_ids: list[str],
                      n: np.ndarray) -> SamplingBatch | None:
        """The sampling settings of one row per verified position (None when
        every request is ``argmax_only``): a position's penalties count the
        proposals before it as outputs (a request with penalties has its
        proposals on the host: ``ModelRunner._unknown_tokens``), and its
        ``min_tokens`` mask holds while the outputs before it are fewer than
        ``min_tokens``."""
        runner, batch = self.runner, self.runner.batch
        if bool(batch.sampling.argmax_only[sample_rows].all()):
            return None
        counts = n + 1
        prompts = outputs = None
        if batch.sampling.has_penalties(sample_rows).any():
            prompts, outputs = [], []
            for i, row in enumerate(sample_rows.tolist()):
                prompt, known = batch.prompt_token_ids(row), batch.output_token_ids(row)
                start = int(batch.num_tokens[row])
                proposals = batch.token_ids[row, start:start + int(n[i])].tolist()
                for j in range(int(counts[i])):
                    prompts.append(prompt)
                    outputs.append(known + proposals[:j])
        forbidden: list[tuple[int, int]] = []
        num_outputs = batch.num_tokens[sample_rows] - batch.num_prompt_tokens[sample_rows]
        first = np.cumsum(counts) - counts
        vocab_size = runner.model_config.vocab_size
        for i in np.flatnonzero(num_outputs < batch.min_tokens[sample_rows]).tolist():
            params = runner.states[request_ids[i]].sampling_params
            for j in range(int(counts[i])):
                forbidden += [(int(first[i]) + j, token_id) for token_id in forbidden_token_ids(
                    params, int(num_outputs[i]) + j, (), vocab_size)]
        return SamplingBatch.from_rows(batch.sampling.take(np.repeat(sample_rows, counts)),
                                       prompts, outputs, forbidden, {}, runner.device,
                                       self._biases(request_ids, first, counts),
                                       self._bitmask(request_ids, n, counts))

    def _biases(self, request_ids: list[str], first: np.ndarray,
                counts: np.ndarray) -> list[tuple[int, int, float]]:
        """``logit_bias`` on every verified position of the biased requests."""
        runner = self.runner
        if not runner._biased:
            return []
        return logit_bias_triples(
            (int(first[i]) + j, runner.states[request_id].sampling_params)
            for i, request_id in enumerate(request_ids) if request_id in runner._biased
            for j in range(int(counts[i])))

    def _bitmask(self, request_ids: list[str], n: np.ndarray,
                 counts: np.ndarray) -> torch.Tensor | None:
        """The grammar bitmask of the step's rows: a grammar request verifies
        no proposals (the scheduler gives it none), so its one row is masked
        by its matcher's state as in a plain step; other rows allow all."""
        matchers = self.runner.matchers
        if not matchers:
            return None
        row_ids: list[str] = []
        for i, request_id in enumerate(request_ids):
            if request_id in matchers and n[i]:
                raise RuntimeError(f"{request_id}: a structured-output request was scheduled "
                                   "with proposals")
            row_ids += [request_id] + [""] * int(n[i])
        return matchers.bitmask(row_ids)

    # ------------------------------------------------------------ proposers

    def _proposer_step(self, inputs: StepInputs, hidden: torch.Tensor | None,
                       bonus: torch.Tensor, counts: torch.Tensor, first: torch.Tensor,
                       num_draft: np.ndarray) -> ProposerStep:
        """A device proposer's view of the step: the target's rows and
        metadata, each sampling request's last kept row and the token after
        it (``bonus``), from its kept tokens' ``counts``."""
        batch = self.runner.batch
        input_ids, positions, metadata = self._step_rows(inputs)
        ends = batch.num_computed_tokens[inputs.rows]  # after the step, before any rollback
        next_ids = np.full(len(inputs.rows), -1, dtype=np.int64)
        inside = ends < batch.num_tokens[inputs.rows]
        next_ids[inside] = batch.token_ids[inputs.rows[inside], ends[inside]]
        accepted = counts - 1
        # one row per request (a verify step's metadata has one per token)
        block_table = (self.runner.buffers.block_table[:len(inputs.rows)] if metadata.verify
                       else metadata.block_table)
        return ProposerStep(
            input_ids=input_ids, positions=positions, metadata=metadata, hidden=hidden,
            query_end=np.cumsum(inputs.num_scheduled), next_token_ids=next_ids,
            sample_indices=inputs.sample_indices, last_index=first + accepted,
            bonus_ids=bonus,
            block_table=block_table, num_draft=num_draft)

    def _step_rows(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """The target step's input ids, positions and metadata (a graph's
        over the whole padded buffers; a verify step's one token per row)."""
        runner = self.runner
        if inputs.metadata is not None:
            assert inputs.input_ids is not None and inputs.positions is not None
            return inputs.input_ids, inputs.positions, inputs.metadata
        assert runner.graphs is not None, "a step without metadata replayed a graph"
        b = runner.buffers
        if inputs.decode_graph_size is not None:
            size = inputs.decode_graph_size
            return b.input_ids[:size], b.positions[:size], runner.graphs.decode_metadata(size)
        if inputs.verify_graph_size is not None:
            size = inputs.verify_graph_size
            return b.input_ids[:size], b.positions[:size], runner.graphs.verify_metadata(size)
        assert inputs.token_graph_size is not None
        size = inputs.token_graph_size
        return b.input_ids[:size], b.positions[:size], runner.graphs.token_metadata(size)

    def observe(self, inputs: StepInputs, hidden: torch.Tensor | None,
                sampled: SamplerOutput | None) -> None:
        """A plain step: a device proposer catches up on its tokens."""
        if self.device_proposer is None:
            return
        num_sample = len(inputs.sample_indices)
        last = to_device(np.cumsum(inputs.num_scheduled)[inputs.sample_indices] - 1,
                         torch.int64, self.runner.device)
        tokens = (sampled.sampled_token_ids if sampled is not None
                  else torch.zeros(0, dtype=torch.int64, device=self.runner.device))
        self.device_proposer.run(self._proposer_step(
            inputs, hidden, tokens,
            torch.ones(num_sample, dtype=torch.int64, device=self.runner.device),
            last, np.zeros(num_sample, dtype=np.int64)))

    # ------------------------------------------------------------ reading

    def _read(self, step: PendingStep, output: ModelRunnerOutput, record: SpecRecord) -> None:
        """Append each request's kept tokens, roll back its rejected ones and
        collect the next proposals."""
        batch = self.runner.batch
        tokens = step.host_tensors[0].numpy()  # [N, K + 2]: the tokens, then their count
        counts = tokens[:, -1]
        written = batch.generation[step.rows] == step.generations
        for i, request_id in enumerate(step.request_ids):
            kept = tokens[i, :int(counts[i])].tolist()
            output.sampled_token_ids[request_id] = kept
            if written[i]:
                row = int(step.rows[i])
                batch.extend_tokens(row, kept)
                # (the scheduler frees the blocks past them and says so with its next step)
                batch.num_computed_tokens[row] -= int(record.num_spec[i]) - (len(kept) - 1)
        if self.runner.matchers:
            self.runner.matchers.accept(output.sampled_token_ids)
        if len(step.host_tensors) > 1:
            proposals = step.host_tensors[1].numpy()
            for i in np.flatnonzero(record.num_draft > 0).tolist():
                made = proposals[record.proposal_row[i], :int(record.num_draft[i])].tolist()
                output.spec_token_ids[step.request_ids[i]] = made
                self._proposals[step.request_ids[i]] = made
        elif self.ngram is not None or self.oracle is not None:
            self._propose_on_host(step, record, written, output)
        if record.proposer_start is not None:
            output.proposer_s = _elapsed_s(record.proposer_start, record.proposer_end)
            if not isinstance(record.proposer_start, float):  # CUDA events: back to the pool
                self.runner._events += (record.proposer_start, record.proposer_end)

    def _forced_proposals(self, bonus: torch.Tensor, request_ids: list[str],
                          num_draft: np.ndarray, proposing: np.ndarray) -> torch.Tensor:
        """The oracle's placeholder proposals in ``forced_acceptance`` mode,
        ``[N, P]`` on the device: each request's last token repeated; and,
        for the step that verifies them, the coins that say which count as
        correct."""
        assert self.oracle is not None
        for i in proposing.tolist():
            self._forced[request_ids[i]] = self.oracle.forced_coins(int(num_draft[i]))
        return bonus.unsqueeze(1).expand(-1, int(num_draft.max())).contiguous()

    def _propose_on_host(self, step: PendingStep, record: SpecRecord, written: np.ndarray,
                         output: ModelRunnerOutput) -> None:
        batch = self.runner.batch
        start = time.perf_counter()
        for i in np.flatnonzero((record.num_draft > 0) & written).tolist():
            row, num = int(step.rows[i]), int(record.num_draft[i])
            if self.ngram is not None:
                proposals = self.ngram.propose(batch.token_ids[row, :batch.num_tokens[row]], num)
            else:
                assert self.oracle is not None
                proposals = self.oracle.propose(batch.prompt_token_ids(row),
                                                batch.output_token_ids(row), num)
            if proposals:
                output.spec_token_ids[step.request_ids[i]] = proposals
        output.proposer_s = time.perf_counter() - start


def _forced_drafts(draft_ids: torch.Tensor, row_start: torch.Tensor, target_ids: torch.Tensor,
                   forced: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Proposals ``[N, K]`` made right where ``forced`` says (the target's
    token at that row) and wrong elsewhere (the next token id)."""
    rows = (row_start.unsqueeze(1) + torch.arange(draft_ids.shape[1], device=draft_ids.device)
            ).clamp_(max=len(target_ids) - 1)
    target = target_ids[rows]
    return torch.where(forced, target, (target + 1) % vocab_size)


def _elapsed_s(start: Any, end: Any) -> float:
    """Seconds between two of the runner's marks (CUDA events or host clock)."""
    if isinstance(start, float):
        return end - start
    return float(start.elapsed_time(end)) / 1e3
