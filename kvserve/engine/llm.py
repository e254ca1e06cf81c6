"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, params)``.

It owns an ``LLMEngine`` and steps it until every submitted request is done,
with a progress bar; ``chat`` goes through the tokenizer's chat template.
With ``enable_lora=True``, ``lora_request`` runs prompts with PEFT adapters.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

from tqdm import tqdm

from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.args import EngineArgs
from kvserve.engine.input_processor import RequestOutputKind
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.tokenizer import Tokenizer
from kvserve.inputs import Prompt
from kvserve.lora.request import LoRARequest

Message = dict[str, str]
T = TypeVar("T")
# seconds between two redraws of the progress bar
PROGRESS_REFRESH_S = 0.5


class LLM:
    """Generate for a batch of prompts, offline.

    ``LLM(model=PATH_OR_PRESET, dtype="auto", block_size=16, num_kv_blocks=None,
    max_num_seqs=256, max_num_batched_tokens=None, enable_prefix_caching=True,
    max_model_len=None, load_format="auto", seed=0, ...)``: every keyword of
    ``EngineArgs``. With no model, the bundled default model is used.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` uses without ``sampling_params``: the engine's
        defaults, with the model's recommended values from its
        ``generation_config.json`` (``generation_config``, as vLLM's)."""
        return SamplingParams(**self.engine.config.sampling_defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in the order given.

        A prompt is a string, a list of token ids, or vLLM's dict forms
        ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``
        (``kvserve.inputs``); ``sampling_params`` and
        ``lora_request`` (an adapter, or None for the base model) are one for
        all or one per prompt. Every prompt and adapter is validated before
        any runs, so a bad one raises ValueError and nothing is queued.
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast(sampling_params, len(prompt_list),
                                 self.get_default_sampling_params)
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        loras = _broadcast_loras(lora_request, len(prompt_list))
        processor = self.engine.processor
        requests = [
            processor.process(prompt, params, self.engine.new_request_id(), prio, lora,
                              RequestOutputKind.FINAL_ONLY)
            for prompt, params, prio, lora in zip(prompt_list, params_list, priorities, loras)
        ]
        for lora in {lora for lora in loras if lora is not None}:
            self.engine.add_lora(lora)  # every adapter loads before anything is queued
        return self._run([self.engine.add_engine_request(r) for r in requests], use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them."""
        conversations = cast(
            "list[list[Message]]",
            [messages] if messages and isinstance(messages[0], dict) else messages,
        )
        prompts: list[Prompt] = [
            self.engine.processor.apply_chat_template(conversation, add_generation_prompt)
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step until every request is done. The bar counts output tokens
        against the requests' ``max_tokens`` (a finished request counts its
        whole budget), redrawn every ``PROGRESS_REFRESH_S``, so it moves
        while long requests decode instead of only when they end."""
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        budgets = {r: (self.engine.progress(r) or (0, 0))[1] for r in request_ids}
        bar = tqdm(total=sum(budgets.values()), desc="Generating", unit="tok",
                   disable=not use_tqdm, dynamic_ncols=True)
        num_output_tokens = finished_budget = 0
        next_refresh_s = time.monotonic() + PROGRESS_REFRESH_S
        while len(finished) < len(wanted) and self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished and output.request_id in wanted:
                    finished[output.request_id] = output
                    num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
                    finished_budget += budgets[output.request_id]
            if use_tqdm and (time.monotonic() >= next_refresh_s or len(finished) == len(wanted)):
                next_refresh_s = time.monotonic() + PROGRESS_REFRESH_S
                running = sum((self.engine.progress(r) or (0, 0))[0]
                              for r in wanted if r not in finished)
                elapsed = bar.format_dict["elapsed"] or 1e-9
                bar.set_postfix_str(f"{len(finished)}/{len(wanted)} prompts, output "
                                    f"{(num_output_tokens + running) / elapsed:.1f} tok/s",
                                    refresh=False)
                bar.update(finished_budget + running - bar.n)
        bar.close()
        return [finished[r] for r in request_ids]

    def stats(self) -> dict[str, Any]:
        """KV blocks (total, free, cached), prefix-cache counters, preemptions,
        running and waiting requests, steps and their host/device time split;
        with ``kv_offload_gb`` the host tier's ``kv_host_*`` blocks, hits (tokens),
        blocks and bytes copied each way and the copies' seconds;
        with ``speculative_config`` the ``spec_decode_*`` counters, the
        acceptance rate (accepted / proposed tokens) and the mean accepted
        length (tokens per verification, the target's own token included)."""
        return self.engine.stats()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [cast("Prompt", prompts)]
    items = list(prompts)
    if items and all(isinstance(p, int) for p in items):
        return [cast("list[int]", items)]
    return cast("list[Prompt]", items)


def _broadcast(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int,
    default: Callable[[], SamplingParams],
) -> list[SamplingParams]:
    if params is None:
        return [default() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    return _one_per_prompt(list(params), count, "sampling_params")


def _broadcast_loras(
    loras: LoRARequest | Sequence[LoRARequest | None] | None, count: int
) -> list[LoRARequest | None]:
    if loras is None or isinstance(loras, LoRARequest):
        return [loras] * count
    return _one_per_prompt(list(loras), count, "lora_request")


def _one_per_prompt(values: list[T], count: int, field: str) -> list[T]:
    if len(values) != count:
        raise ValueError(
            f"{field}: {len(values)} given for {count} prompts; pass one or one per prompt"
        )
    return values
