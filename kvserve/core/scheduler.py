"""Iteration-level scheduler: one token-budget rule for prefill, chunked
prefill, decode, prefix hits and preemption.

Each step every request is handed ``num_new_tokens`` so that
``num_computed_tokens`` catches up with ``num_tokens``, under a token budget
(``max_num_batched_tokens``) and a sequence budget (``max_num_seqs``).
Running requests (decodes, unfinished prefill chunks) are served first, then
waiting requests fill what is left; with LoRA, a waiting request whose
adapter would make the running requests use more than ``max_loras``
adapters is passed over until one of them finishes. When the pool runs dry,
the most recently admitted request (or the least important one under the
priority policy) is preempted: its blocks are freed and it restarts from its
prefix later.

With async scheduling the next step is planned while the previous one is
still on the device: a request whose next token is being sampled holds one
output placeholder, counted as a token it has (so it is scheduled to decode
that token) but not yet appended; ``update_from_output`` swaps the
placeholder for the token. A request whose in-flight token is its last
(``max_tokens``) is not scheduled again; one that turns out to have stopped
(EOS, stop string) wastes the one step already queued for it.

A request with ``report_every_step`` off (the engine wants its whole
completion at the end, nothing in between) gets an output at its first token
(for its time to first token) and when it finishes, with every token since;
at batch 256 the outputs of the steps between cost the host more than the
rest of their bookkeeping.

With ``pipeline_parallel_size`` stages the engine keeps that many steps in
flight, one per stage. A request's next step needs the token its last one
samples, so a request whose sampled token is in flight is not scheduled
again (no placeholder lookahead; a prompt's chunks may follow each other,
as every stage runs the steps in order), and each step takes at most
``1 / stages`` of the requests that could run, so the steps stay even.

With speculative decoding a decode is an assignment of ``1 + k`` tokens:
the request's last token and the ``k`` proposals waiting in
``Request.spec_token_ids``, verified by the step (a capped budget cuts
proposals first). A request that samples in a step is also told how many
tokens to propose for its next one (``SpecDecodePolicy`` picks that k per
step from the decode batch, 0 when speculation does not pay); when the
proposer writes KV for its proposals (a draft model, an EAGLE head) the
request gets that many lookahead slots too. ``update_from_output`` rolls
back ``num_computed_tokens`` by the rejected proposals and frees the whole
blocks past it, so only accepted tokens stay (and only blocks full of
accepted tokens are ever registered in the prefix cache). A step that
verifies or proposes must be read before the next one is planned
(``SchedulerOutput.is_spec_step``): the engine core reads it before it
calls ``schedule`` again; the runner learns which blocks a request kept
with the next step (``num_kept_blocks``).

Unless the step plans ahead (``config.plans_ahead``: async scheduling with
proposals made on the device). Then a speculative step in flight counts as
if it accepts every proposal: a request that samples in it holds ``1 + n``
output placeholders (its ``n`` verified proposals and the token after
them), and the proposals it makes there wait in ``spec_token_ids`` as
``CARRIED_TOKEN_ID``, so the next step is planned before this one is read:
the request's bonus token and those proposals, at the positions of full
acceptance, with slots for that worst case. The runner takes the tokens and
the positions' shift on the device. Reading the step rolls the computed
tokens back by its rejected proposals as above, which moves the step
planned after it onto the right positions; a request that stopped in it
wastes that step, as with plain async steps; a step is planned only for a
request that full acceptance would leave short of ``max_tokens``.

With ``step_token_sizes`` (the token counts the runner has CUDA graphs for)
the last prompt chunk admitted to a step is trimmed so that the step ends on
one of them: a padded step would spend a token's matmuls on each padding
token, a trimmed one only moves those prompt tokens to the next step.
Pure Python: no torch here.
"""

from __future__ import annotations

import bisect
import time
from typing import Any

from kvserve.config import (
    CacheConfig,
    LoRAConfig,
    SchedulerConfig,
    SpeculativeConfig,
    plans_ahead,
)
from kvserve.core.block_pool import KVBlock
from kvserve.core.kv_manager import KVCacheManager
from kvserve.core.outputs import (
    CARRIED_TOKEN_ID,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobs,
    SchedulerOutput,
)
from kvserve.core.request import Request, RequestStatus
from kvserve.core.spec_policy import SpecDecodePolicy
from kvserve.core.stop import check_stop


class Scheduler:
    """Decides, each step, which requests run and how many tokens each gets."""

    def __init__(
        self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_kv_blocks: int,
        lora_config: LoRAConfig | None = None, step_token_sizes: tuple[int, ...] = (),
        speculative_config: SpeculativeConfig | None = None, num_host_kv_blocks: int = 0,
    ) -> None:
        self.config = scheduler_config
        self.step_token_sizes = sorted(step_token_sizes)
        self.num_stages = scheduler_config.pipeline_parallel_size
        # the most distinct LoRA adapters the running requests may use (0: LoRA off)
        self.max_loras = lora_config.max_loras if lora_config is not None else 0
        self.block_size = cache_config.block_size
        self.kv_manager = KVCacheManager(
            num_kv_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
            num_host_kv_blocks,
        )
        self.swaps = cache_config.preemption_mode == "swap" and num_host_kv_blocks > 0
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._finished_ids: set[str] = set()
        # requests whose full data the runner must get at their next scheduling
        self._send_whole: set[str] = set()
        # requests given output placeholders by the step being scheduled -> how many
        self._sampling: dict[str, int] = {}
        # requests whose tail blocks were freed since the last step -> blocks kept
        self._kept_blocks: dict[str, int] = {}
        # requests whose prompt logprobs are all in, to go with their next output
        self._prompt_logprobs_ready: set[str] = set()
        self.num_preemptions = 0
        self.spec_policy = (SpecDecodePolicy(speculative_config)
                            if speculative_config is not None else None)
        self._uses_lookahead = (speculative_config is not None
                                and speculative_config.uses_lookahead_slots)
        self.plans_ahead = plans_ahead(scheduler_config, speculative_config)
        self._num_spec_step = 0  # tokens to propose per sampling request this step
        # adapters being read back into host memory: their waiting requests wait
        self.loras_loading: set[int] = set()
        # disaggregated prefill: finished requests whose blocks a decode engine pulls
        self.kv_pinned: dict[str, Request] = {}
        # disaggregated decode: waiting requests whose KV is being received,
        # with the tokens it covers (aborted ones stay until the pull ends)
        self.kv_receiving: dict[str, tuple[Request, int]] = {}

    # ---------------------------------------------------------------- admission

    def add_request(self, request: Request) -> None:
        """Queue a request, or raise ValueError if it could never run."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id='{request.request_id}' is already in use")
        if request.num_prompt_tokens == 0:
            raise ValueError("prompt: must contain at least 1 token")
        total = request.num_prompt_tokens + request.max_tokens
        if total > self.config.max_model_len:
            raise ValueError(
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens "
                f"({request.max_tokens}) = {total} exceeds max_model_len="
                f"{self.config.max_model_len}"
            )
        usable = self.kv_manager.pool.num_usable_blocks
        if self.kv_manager.num_blocks_needed(total) > usable:
            raise ValueError(
                f"prompt + max_tokens = {total} tokens needs "
                f"{self.kv_manager.num_blocks_needed(total)} KV blocks; the pool has {usable}"
            )
        request.max_num_tokens = total
        # logprobs and grammars are computed for sampled tokens only: such requests decode
        # one token a step (in a verifying step their row is sampled like a plain one)
        params = request.sampling_params
        if (self.spec_policy is not None and params.logprobs is None
                and params.structured_output is None):
            request.max_spec_tokens = self.spec_policy.max_k
        self.requests[request.request_id] = request
        if request.prompt_logprobs is not None and not request.awaits_prompt_logprobs:
            self._prompt_logprobs_ready.add(request.request_id)  # a 1-token prompt has none
        self._enqueue(request)
        self._send_whole.add(request.request_id)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        if self.config.policy == "priority":
            bisect.insort(self.waiting, request, key=_priority_key)
        elif front:
            self.waiting.insert(0, request)
        else:
            self.waiting.append(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """End requests from outside the step (abort, stop string): free their blocks."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            self._remove(request)
            request.status = status
            self._free(request)
            finished.append(request)
        return finished

    def _remove(self, request: Request) -> None:
        """Take a request out of whichever queue holds it."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def _free(self, request: Request) -> None:
        params = request.sampling_params.kv_transfer_params
        if request.request_id in self.kv_receiving:
            pass  # its blocks are being written: freed when the pull ends
        elif (params and params.get("do_remote_decode")
              and request.status is not RequestStatus.FINISHED_ABORTED):
            self.kv_pinned[request.request_id] = request  # until release_kv
        else:
            self.kv_manager.free(request)
        del self.requests[request.request_id]
        self._send_whole.discard(request.request_id)
        self._prompt_logprobs_ready.discard(request.request_id)
        self._finished_ids.add(request.request_id)

    # ---------------------------------------------------- disaggregated prefill / decode

    def release_kv(self, request_id: str) -> None:
        """A finished prefill's pinned blocks were pulled (or expired): free them."""
        request = self.kv_pinned.pop(request_id, None)
        if request is not None:
            self.kv_manager.free(request)

    def start_kv_receive(self, request_id: str, num_tokens: int) -> tuple[list[int], int] | None:
        """Give a waiting request the blocks for its first ``num_tokens``
        tokens' KV, to be received from a prefill engine; it is not scheduled
        until ``finish_kv_receive``. Returns the block ids to receive into and
        how many leading blocks the local prefix cache had already (those
        need no transfer), or None when the pool has no room (the request
        then computes its prompt as any other)."""
        request = self.requests[request_id]
        computed, num_hit = self.kv_manager.get_computed_blocks(request)
        new_blocks = self.kv_manager.allocate_for_receive(request, computed, num_tokens)
        if new_blocks is None:
            return None
        request.num_cached_tokens = num_hit
        request.times.first_scheduled_s = time.monotonic()
        if new_blocks:
            self.kv_receiving[request_id] = (request, num_tokens)
        else:  # all in the local prefix cache
            self.kv_manager.landing[request_id] = num_tokens
        return [block.block_id for block in new_blocks], len(computed)

    def finish_kv_receive(self, request_id: str, ok: bool) -> None:
        """The pull of a request's KV ended: it runs from the received tokens
        on (``ok``), or computes its prompt itself."""
        request, num_tokens = self.kv_receiving.pop(request_id, (None, 0))
        if request is None:
            return
        if ok and request_id in self.requests:
            self.kv_manager.landing[request_id] = num_tokens
        else:  # failed, or aborted meanwhile: the unregistered blocks go back
            self.kv_manager.free(request)

    # ---------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Plan one step under the token and sequence budgets."""
        out = SchedulerOutput(finished_request_ids=self._finished_ids,
                              num_kept_blocks=self._kept_blocks)
        self._finished_ids = set()
        self._kept_blocks = {}
        self.kv_manager.begin_step()
        budget = self.config.max_num_batched_tokens
        max_reqs = self._max_step_requests()
        if self.spec_policy is not None:  # the batch size the step will have, about
            batch_size = min(len(self.running) + len(self.waiting), self.config.max_num_seqs)
            self._num_spec_step = self.spec_policy.num_spec_tokens(batch_size)
        budget = self._schedule_running(out, budget, max_reqs)
        if not out.preempted_request_ids:
            self._schedule_waiting(out, budget, max_reqs)
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        out.kv_offloads, out.kv_onloads, out.wait_for_onloads = self.kv_manager.take_transfers()
        self._sampling.clear()
        return out

    def _max_step_requests(self) -> int:
        """Requests one step may run: all of them, or with pipeline stages a
        share of those that could run, so the steps in flight stay even."""
        if self.num_stages == 1:
            return self.config.max_num_seqs
        could_run = min(self.config.max_num_seqs, len(self.running) + len(self.waiting))
        return max(1, -(-could_run // self.num_stages))

    def _schedule_running(self, out: SchedulerOutput, budget: int, max_reqs: int) -> int:
        index = 0
        running = self.running
        allocate_slots = self.kv_manager.allocate_slots
        pipelined = self.num_stages > 1
        while index < len(running) and budget > 0 and len(out.num_scheduled_tokens) < max_reqs:
            request = running[index]
            # the tokens whose KV is not computed yet, the one in flight included
            # (per request per step: no properties, no calls)
            num_tokens = len(request.all_token_ids) + request.num_output_placeholders
            num_new = num_tokens - request.num_computed_tokens
            if num_new == 0 or (request.num_output_placeholders
                                and (pipelined or num_tokens >= request.max_num_tokens)):
                # nothing to compute, or its token in flight is its last (or, with
                # pipeline stages, is needed first)
                index += 1
                continue
            spec = request.spec_token_ids
            if spec:  # proposals go after the last token; a capped budget cuts them first
                assert self.plans_ahead or not request.num_output_placeholders, \
                    "proposals with a token in flight"
                # (made in flight: no more than full acceptance leaves room for)
                num_spec = min(len(spec), max(budget - num_new, 0),
                               request.max_num_tokens - num_tokens - 1)
                num_new += num_spec
            else:
                num_spec = 0
            if num_new > budget:
                num_new = budget
            num_computed = request.num_computed_tokens
            num_draft = self._num_draft(request, num_tokens, num_computed + num_new,
                                        num_new - num_spec == num_tokens - num_computed)
            lookahead = num_draft if self._uses_lookahead else 0
            new_blocks = allocate_slots(request, num_new + lookahead)
            while new_blocks is None:
                victim = self._pick_victim()
                if running.index(victim) < index:
                    index -= 1  # an already scheduled request gave way
                budget += self._preempt(victim, out)
                if victim is request:
                    break
                new_blocks = self.kv_manager.allocate_slots(request, num_new + lookahead)
            if new_blocks is None:  # the request preempted itself
                continue
            self._record(request, num_new, new_blocks, out, num_spec, num_draft)
            budget -= num_new
            index += 1
        return budget

    def _num_draft(self, request: Request, num_tokens: int, num_computed_after: int,
                   catches_up: bool) -> int:
        """Tokens a request with ``num_tokens`` tokens proposes after a step
        that leaves it ``num_computed_after`` computed ones: none unless the
        step samples it (``catches_up``) and speculation is on; no more than
        its next step could use (it ends with at least one more token, and
        the step after adds one beyond its proposals), and no proposer KV
        past what ``max_tokens`` lets it reach."""
        if not catches_up or not self._num_spec_step or not request.max_spec_tokens:
            return 0
        room = min(request.max_num_tokens - num_tokens - 2,
                   request.max_num_tokens - num_computed_after)
        return max(0, min(self._num_spec_step, request.max_spec_tokens, room))

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, max_reqs: int) -> None:
        running_loras = ({r.lora_int_id for r in self.running if r.lora_int_id}
                         if self.max_loras and self.waiting else set())
        index = 0
        while (index < len(self.waiting) and budget > 0
               and len(self.running) < self.config.max_num_seqs
               and len(out.num_scheduled_tokens) < max_reqs):
            request = self.waiting[index]
            if self.kv_receiving and request.request_id in self.kv_receiving:
                index += 1  # its KV is still on its way from a prefill engine
                continue
            if request.lora_int_id and (request.lora_int_id in self.loras_loading or (
                    request.lora_int_id not in running_loras
                    and len(running_loras) >= self.max_loras)):
                index += 1  # its adapter waits for a slot or a read; later requests may run
                continue
            if request.num_output_placeholders and self.num_stages > 1:
                index += 1  # preempted with a step in flight: it resumes once that is back
                continue
            # a request preempted with a token in flight waits a step, when it is known
            assert not request.num_output_placeholders, "resuming with a token in flight"
            computed: list[KVBlock] = []
            # tokens of blocks copied in from the host tier in an earlier step
            num_hit = self.kv_manager.landing.get(request.request_id, 0)
            if not num_hit and request.num_computed_tokens == 0:
                computed, num_hit = self.kv_manager.get_computed_blocks(request)
                if self.kv_manager.start_onload(request, computed, self._free_seats()):
                    index += 1  # its blocks are copied in during this step; it runs next
                    continue
            num_new = request.num_tokens - num_hit
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            last = (index == len(self.waiting) - 1 or num_new == budget
                    or len(self.running) + 1 == self.config.max_num_seqs)
            if last and self.config.enable_chunked_prefill:
                num_new = self._trim_to_step_size(num_new, budget)
            num_draft = self._num_draft(request, request.num_tokens, num_hit + num_new,
                                        num_hit + num_new == request.num_tokens)
            lookahead = num_draft if self._uses_lookahead else 0
            landed = request.request_id in self.kv_manager.landing
            if landed:  # its blocks are held already
                request.num_computed_tokens = num_hit
            if self.kv_manager.allocate_slots(request, num_new + lookahead, computed) is None:
                if landed:  # let go of the blocks copied in (they stay cached)
                    self.kv_manager.free(request)
                    request.num_computed_tokens = 0
                break
            self.kv_manager.landing.pop(request.request_id, None)
            self.waiting.pop(index)
            self.running.append(request)
            if request.lora_int_id:
                running_loras.add(request.lora_int_id)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
                request.times.first_scheduled_s = time.monotonic()
            self._record(request, num_new, [], out, 0, num_draft)
            budget -= num_new

    def waiting_lora_ids(self) -> list[int]:
        """The adapters of the waiting requests that no running request uses,
        in queue order, at most ``max_loras`` (those that could start next)."""
        running = {r.lora_int_id for r in self.running}
        wanted: list[int] = []
        for request in self.waiting:
            if len(wanted) == self.max_loras:
                break
            if request.lora_int_id and request.lora_int_id not in running | set(wanted):
                wanted.append(request.lora_int_id)
        return wanted

    def _free_seats(self) -> int:
        """Requests that may be landing (copies in from the host tier) at once:
        no more than the running batch could still take."""
        return self.config.max_num_seqs - len(self.running)

    def _trim_to_step_size(self, num_new: int, budget: int) -> int:
        """``num_new`` shortened so that the step's tokens end on the largest
        step size not above them, when that leaves at least one token."""
        scheduled = self.config.max_num_batched_tokens - budget
        i = bisect.bisect_right(self.step_token_sizes, scheduled + num_new)
        if i == 0 or self.step_token_sizes[i - 1] <= scheduled:
            return num_new
        return self.step_token_sizes[i - 1] - scheduled

    def _record(
        self, request: Request, num_new: int, new_blocks: list[KVBlock], out: SchedulerOutput,
        num_spec: int = 0, num_draft: int = 0,
    ) -> None:
        request_id = request.request_id
        if request_id in self._send_whole:
            self._send_whole.discard(request_id)
            out.new_requests.append(
                NewRequestData(
                    request_id=request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    all_token_ids=list(request.all_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=self.kv_manager.get_block_ids(request_id),
                    num_computed_tokens=request.num_computed_tokens,
                    resumed=request.num_preemptions > 0,
                    lora_int_id=request.lora_int_id,
                )
            )
        elif new_blocks:
            out.new_block_ids[request_id] = [block.block_id for block in new_blocks]
        out.num_scheduled_tokens[request_id] = num_new
        if request.spec_token_ids:  # proposals are for this step only
            if num_spec:
                out.scheduled_spec_token_ids[request_id] = request.spec_token_ids[:num_spec]
            request.spec_token_ids = []
        if num_draft:
            out.num_draft_tokens[request_id] = num_draft
        num_computed = request.num_computed_tokens + num_new
        request.num_computed_tokens = num_computed
        if (num_computed
                == len(request.all_token_ids) + request.num_output_placeholders + num_spec):
            # this step samples its next token (planning ahead: and accepts every proposal)
            num_placeholders = 1 + num_spec if self.plans_ahead else 1
            request.num_output_placeholders += num_placeholders
            self._sampling[request_id] = num_placeholders
            if self.plans_ahead and num_draft:
                request.spec_token_ids = [CARRIED_TOKEN_ID] * num_draft

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=_priority_key)
        return self.running[-1]

    def _preempt(self, victim: Request, out: SchedulerOutput) -> int:
        """Free the victim's blocks and requeue it; returns budget given back."""
        self.running.remove(victim)
        given_back = out.num_scheduled_tokens.pop(victim.request_id, 0)
        if victim.request_id in self._sampling:  # it samples nothing after all
            victim.num_output_placeholders -= self._sampling.pop(victim.request_id)
        out.new_requests = [r for r in out.new_requests if r.request_id != victim.request_id]
        out.new_block_ids.pop(victim.request_id, None)
        out.scheduled_spec_token_ids.pop(victim.request_id, None)
        out.num_draft_tokens.pop(victim.request_id, None)
        victim.spec_token_ids = []
        if self.swaps:  # the KV computed by the steps queued before this one
            self.kv_manager.swap_out(victim, min(victim.num_computed_tokens - given_back,
                                                 len(victim.all_token_ids)))
        self.kv_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._send_whole.add(victim.request_id)
        out.preempted_request_ids.add(victim.request_id)
        self._enqueue(victim, front=True)
        return given_back

    # ---------------------------------------------------------------- results

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop rules, free finished requests;
        with speculation, roll back rejected proposals and keep new ones."""
        outputs = []
        requests = self.requests
        logprobs = runner_output.logprobs
        if runner_output.prompt_logprobs:
            self._add_prompt_logprobs(runner_output.prompt_logprobs)
        prompt_logprobs_ready = self._prompt_logprobs_ready
        spec_step = scheduler_output.is_spec_step
        for request_id, token_ids in runner_output.sampled_token_ids.items():
            request = requests.get(request_id)
            if request is None or not token_ids:
                continue  # finished or aborted while its step was in flight
            if request.num_output_placeholders:
                request.num_output_placeholders -= 1 + (
                    len(scheduler_output.scheduled_spec_token_ids.get(request_id, ()))
                    if self.plans_ahead else 0)
            if spec_step:
                self._verified(request, scheduler_output, len(token_ids))
            all_token_ids = request.all_token_ids
            new_tokens = token_ids
            if len(token_ids) == 1:  # the usual step: no loop
                all_token_ids.append(token_ids[0])
                stopped = check_stop(request)
            else:
                stopped = False
                for i, token_id in enumerate(token_ids):
                    all_token_ids.append(token_id)
                    if check_stop(request):
                        new_tokens = token_ids[: i + 1]
                        stopped = True
                        break
            if spec_step and not stopped:
                self._keep_proposals(request, scheduler_output, runner_output)
            if not request.report_every_step:
                if request.num_reported_outputs and not stopped:
                    continue  # reported at its first token and when it finishes
                # everything since its first token
                new_tokens = all_token_ids[request.num_prompt_tokens
                                           + request.num_reported_outputs:]
                request.num_reported_outputs = len(all_token_ids) - request.num_prompt_tokens
            output = EngineCoreOutput(
                request_id=request_id,
                new_token_ids=new_tokens,
                new_logprobs=logprobs.get(request_id) if logprobs else None,
                num_cached_tokens=max(request.num_cached_tokens, 0),
            )
            if request.num_output_tokens == len(new_tokens):  # its first output
                output.first_scheduled_s = request.times.first_scheduled_s
            if prompt_logprobs_ready and request_id in prompt_logprobs_ready:
                prompt_logprobs_ready.discard(request_id)
                output.prompt_logprobs = request.prompt_logprobs
            if stopped:
                output.finish_reason = request.status.finish_reason
                output.stop_reason = request.stop_reason
                self._remove(request)  # a preempted request may finish from the waiting queue
                self._free(request)
            outputs.append(output)
        if self.spec_policy is not None and not scheduler_output.is_empty:
            self.spec_policy.observe_step(
                scheduler_output.total_num_scheduled_tokens,
                len(runner_output.sampled_token_ids),
                max(scheduler_output.num_draft_tokens.values(), default=0),
                runner_output.device_s, runner_output.proposer_s,
                bool(scheduler_output.scheduled_spec_token_ids))
        return outputs

    def _add_prompt_logprobs(self, chunks: dict[str, PromptLogprobs]) -> None:
        """Keep each request's prompt-logprob chunk; one whose prompt's are now
        all in is reported with its next output (its first token's)."""
        for request_id, chunk in chunks.items():
            request = self.requests.get(request_id)
            if request is None or not request.awaits_prompt_logprobs:
                continue  # finished, or a prompt computed again after preemption
            request.add_prompt_logprobs(chunk)
            if not request.awaits_prompt_logprobs:
                self._prompt_logprobs_ready.add(request_id)

    def _verified(self, request: Request, scheduler_output: SchedulerOutput,
                  num_sampled: int) -> None:
        """Roll back the KV of the request's rejected proposals: the step
        computed them, but only the accepted ones are the request's tokens."""
        spec = scheduler_output.scheduled_spec_token_ids.get(request.request_id)
        if not spec or request.status is RequestStatus.PREEMPTED:
            return  # (preempted while the step was in flight: nothing computed is kept)
        num_accepted = num_sampled - 1
        request.num_computed_tokens -= len(spec) - num_accepted
        if self.spec_policy is not None:
            self.spec_policy.observe_verification(len(spec), num_accepted)

    def _keep_proposals(self, request: Request, scheduler_output: SchedulerOutput,
                        runner_output: ModelRunnerOutput) -> None:
        """Free the blocks of rejected proposals and lookahead slots, and keep
        the proposals for the next step (as many as ``max_tokens`` can use).
        Planning ahead, the proposals are those in flight (the step planned
        after this one took them, or they wait as ``CARRIED_TOKEN_ID``), and
        their lookahead slots stay."""
        request_id = request.request_id
        if (request_id in scheduler_output.scheduled_spec_token_ids
                or request_id in scheduler_output.num_draft_tokens):
            num_tokens = request.num_computed_tokens
            if self.plans_ahead and self._uses_lookahead:
                num_tokens += len(request.spec_token_ids)
            kept = self.kv_manager.free_tail(request, num_tokens)
            if kept is not None:
                self._kept_blocks[request_id] = kept
        if self.plans_ahead:
            return
        proposals = runner_output.spec_token_ids.get(request_id)
        if proposals:
            room = request.max_num_tokens - len(request.all_token_ids) - 1
            request.spec_token_ids = proposals[:max(room, 0)]

    # ---------------------------------------------------------------- stats

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> dict[str, Any]:
        pool = self.kv_manager.pool
        return {
            "kv_blocks_total": pool.num_usable_blocks,
            "kv_blocks_free": pool.num_free_blocks,
            "kv_blocks_cached": pool.num_cached_blocks,
            "kv_cache_usage": pool.usage(),
            "prefix_cache_queries": self.kv_manager.prefix_cache_queries,
            "prefix_cache_hits": self.kv_manager.prefix_cache_hits,
            "num_preemptions": self.num_preemptions,
            "kv_pinned_requests": len(self.kv_pinned),
            "kv_receiving_requests": len(self.kv_receiving),
            **self._host_tier_stats(),
            "num_requests_running": len(self.running),
            "num_requests_waiting": len(self.waiting),
            **(self.spec_policy.stats() if self.spec_policy is not None else {}),
        }

    def _host_tier_stats(self) -> dict[str, int]:
        kv = self.kv_manager
        if kv.host is None:
            return {}
        return {"kv_host_blocks_total": kv.host.num_blocks,
                "kv_host_blocks_used": kv.host.num_used_blocks,
                "kv_host_cache_hits": kv.host_cache_hits,
                "kv_host_offloaded_blocks": kv.num_offloaded_blocks,
                "kv_host_onloaded_blocks": kv.num_onloaded_blocks,
                "kv_host_swapped_blocks": kv.num_swapped_blocks}


def _priority_key(request: Request) -> tuple[int, float]:
    """Lower priority value runs first; ties go to the earlier arrival."""
    return (request.priority, request.arrival_s)
