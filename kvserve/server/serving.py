"""OpenAI completions and chat completions on top of an ``EngineClient``.

One HTTP request goes through these stages, and everything that can be
known before the first byte is a real HTTP status:

1. parse and check the body (400), the model name (404), availability (503);
2. build the engine requests through the engine's ``InputProcessor``
   (a character pre-check first, so a huge string is refused before the
   tokenizer sees it): tokenized, validated, ``max_tokens`` resolved against
   the context, any grammar compiled (400 naming the field);
3. admission (503 + ``Retry-After`` when the bound is reached);
4. generate: one engine request per prompt, their outputs merged. A
   streaming response is "primed": its first output is awaited before the
   headers go out, so an error raised while queueing is still a 4xx/5xx;
5. while waiting, a watcher listens for the client's disconnect; when it
   comes (queued or running, streaming or not) the engine requests are
   aborted at once and their KV blocks freed.

Streams are ``data: <json>\\n\\n`` frames ending with ``data: [DONE]\\n\\n``,
also after an error sent as a ``data: {"error": {...}}`` frame.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvserve.core.sampling_params import SamplingParams
from kvserve.core.structured_output import StructuredOutputParams
from kvserve.engine.client import EngineDeadError
from kvserve.engine.input_processor import EngineRequest, InputProcessor
from kvserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from kvserve.engine.structured_output import GrammarError
from kvserve.lora.request import LoRARequest
from kvserve.server.metrics import RequestTimer
from kvserve.server.protocol import (
    INTERNAL_ERROR_MESSAGE,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
)
from kvserve.server.state import ServerState, Ticket
from kvserve.server.tool_parsers import ToolCalling, forced_calls_schema, get_tool_parser

logger = logging.getLogger(__name__)

# a prompt longer than max_model_len x this many characters is refused untokenized
MAX_CHARS_PER_TOKEN = 64
DONE_FRAME = "data: [DONE]\n\n"
_FIELD_RE = re.compile(r"^([A-Za-z_]+)")
T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client went away while its request was being served."""


async def read_body(request: Request, limit_bytes: int) -> bytes:
    """The request body, refusing non-JSON content types (400) and bodies above
    ``limit_bytes`` (413, checked on Content-Length and again while reading)."""
    content_type = request.headers.get("content-type", "application/json")
    if not content_type.lower().startswith("application/json"):
        raise APIError(400, f"Content-Type '{content_type}' is not supported: send "
                       "'application/json'", "body")
    too_large = APIError(413, f"the request body exceeds the server's limit of {limit_bytes} "
                         "bytes (--max-request-body-bytes)", "body", {"Connection": "close"})
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit_bytes:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` unless the client disconnects first (then it is
    cancelled and ``ClientDisconnected`` raised). Call after the body is read."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        raise ClientDisconnected
    return work.result()


_END = object()


class OutputMerger:
    """Merges the output streams of a request's prompts into one, tagged by
    prompt index. ``close()`` cancels the streams, which aborts their requests."""

    def __init__(self, streams: list[AsyncIterator[RequestOutput]]) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._open = len(streams)
        self._tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _pump(self, index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                self._queue.put_nowait((index, output))
        except Exception as exc:
            self._queue.put_nowait(exc)
        finally:
            self._queue.put_nowait(_END)

    async def next(self) -> tuple[int, RequestOutput] | None:
        """The next output of any prompt; None when all have finished."""
        while self._open:
            item = await self._queue.get()
            if item is _END:
                self._open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                return item
        return None

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response that always runs ``cleanup`` at the end,
    even when the client left before the body started."""

    def __init__(self, content: AsyncGenerator[str, None],
                 cleanup: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._generator = content
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._generator.aclose()
            await self._cleanup()


@dataclass
class PromptInput:
    token_ids: list[int]
    text: str | None = None  # for echo
    first_token_text: str = ""  # for echo with logprobs (the first token has no logprob)


@dataclass
class Job:
    """One validated generation request (possibly several prompts, n each)."""

    chat: bool
    request_id: str
    model: str
    prompts: list[PromptInput]
    params: SamplingParams  # as the body asks, before the input processor resolves them
    n: int
    body: SamplingRequest
    timer: RequestTimer
    echo: bool = False
    echo_only: bool = False  # echo with max_tokens 0: the one token sampled is left out
    # top logprobs per token (0 = only the sampled one); None = no logprobs
    top_logprobs: int | None = None
    lora_request: LoRARequest | None = None  # the adapter "model" named, if any
    structured_param: str | None = None  # the field that asked for structured output
    tools: ToolCalling | None = None  # chat with tools (tool_choice not "none")
    # one per prompt, from the input processor (``OpenAIServing._process``)
    requests: list[EngineRequest] = field(default_factory=list)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    @property
    def engine_request_ids(self) -> list[str]:
        return [f"{self.request_id}-{i}" for i in range(len(self.prompts))]

    def choice_index(self, prompt_index: int, sample_index: int) -> int:
        return prompt_index * self.n + sample_index

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        payload: dict[str, Any] = {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created, "model": self.model, "choices": choices,
        }
        if usage is not None:
            payload["usage"] = usage
        return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def usage_dict(num_prompt_tokens: int, num_completion_tokens: int,
               num_cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage; ``cached_tokens``: prompt tokens read from the prefix cache."""
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


def echo_logprobs(prompt: PromptInput, output: RequestOutput) -> dict[str, Any]:
    """The completions-API logprobs of the prompt (echo): the first token has
    none (``null``), each later one its logprob and the top ones."""
    entries = output.prompt_logprobs
    if entries is None or len(entries) != len(prompt.token_ids):
        raise RuntimeError(f"{output.request_id}: the prompt's logprobs are missing")
    result: dict[str, list[Any]] = {"tokens": [prompt.first_token_text],
                                    "token_logprobs": [None], "top_logprobs": [None],
                                    "text_offset": [0]}
    text_offset = len(prompt.first_token_text)
    for token_id, entry in zip(prompt.token_ids[1:], entries[1:]):
        assert entry is not None
        _add_token(result, entry, token_id, text_offset)
        text_offset += len(result["tokens"][-1])
    return result


def _add_token(result: dict[str, list[Any]], entry: dict[int, Logprob], token_id: int,
               text_offset: int) -> None:
    chosen = entry.get(token_id)
    result["tokens"].append((chosen.decoded_token if chosen else None) or "")
    result["token_logprobs"].append(chosen.logprob if chosen else None)
    ranked = sorted(entry.values(), key=lambda lp: lp.rank)
    result["top_logprobs"].append({(lp.decoded_token or ""): lp.logprob for lp in ranked})
    result["text_offset"].append(text_offset)


def join_logprobs(first: dict[str, list[Any]], second: dict[str, list[Any]]) -> dict[str, Any]:
    """Two completions-API logprobs objects as one (the prompt's, then the output's)."""
    return {key: first[key] + second[key] for key in first}


def completion_logprobs(completion: CompletionOutput, start: int,
                        text_offset: int) -> dict[str, Any]:
    """The completions-API logprobs of tokens ``start:`` of a completion."""
    result: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                    "text_offset": []}
    entries = completion.logprobs or []
    for token_id, entry in zip(completion.token_ids[start:], entries[start:]):
        _add_token(result, entry, token_id, text_offset)
        text_offset += len(result["tokens"][-1])
    return result


def _chat_token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(completion: CompletionOutput, start: int, top: int) -> dict[str, Any]:
    """The chat-API logprobs (``{"content": [...]}``) of tokens ``start:``."""
    content = []
    entries = completion.logprobs or []
    for token_id, entry in zip(completion.token_ids[start:], entries[start:]):
        sampled = entry.get(token_id)
        item = _chat_token((sampled.decoded_token if sampled else None) or "",
                           sampled.logprob if sampled else float("-inf"))
        ranked = sorted((lp for lp in entry.values() if lp.rank <= top), key=lambda lp: lp.rank)
        item["top_logprobs"] = [_chat_token(lp.decoded_token or "", lp.logprob)
                                for lp in ranked[:top]]
        content.append(item)
    return {"content": content}


def final_response(job: Job, outputs: dict[int, RequestOutput]) -> dict[str, Any]:
    """The non-streaming response body."""
    choices: list[dict[str, Any]] = []
    for prompt_index, output in sorted(outputs.items()):
        prompt = job.prompts[prompt_index]
        for completion in output.outputs:
            choice: dict[str, Any] = {"index": job.choice_index(prompt_index, completion.index)}
            logprobs = None
            finish_reason = completion.finish_reason
            if job.chat:
                choice["message"] = {"role": "assistant", "content": completion.text,
                                     "refusal": None}
                if job.tools is not None:
                    content, calls = job.tools.extract(completion.text)
                    choice["message"]["content"] = content
                    if calls:
                        choice["message"]["tool_calls"] = [c.to_openai() for c in calls]
                    finish_reason = job.tools.finish_reason(finish_reason, calls)
                if job.top_logprobs is not None:
                    logprobs = chat_logprobs(completion, 0, job.top_logprobs)
            else:
                echo = (prompt.text or "") if job.echo else ""
                choice["text"] = echo + ("" if job.echo_only else completion.text)
                if job.top_logprobs is not None:
                    logprobs = _text_logprobs(job, prompt, output, completion, len(echo))
            choice.update(logprobs=logprobs, finish_reason=finish_reason,
                          stop_reason=completion.stop_reason)
            if job.echo_only:
                choice.update(finish_reason="length", stop_reason=None)
            choices.append(choice)
    choices.sort(key=lambda c: c["index"])
    num_generated = (0 if job.echo_only else
                     sum(len(c.token_ids) for o in outputs.values() for c in o.outputs))
    response = {
        "id": job.request_id, "object": "chat.completion" if job.chat else "text_completion",
        "created": job.created, "model": job.model, "choices": choices,
        "usage": usage_dict(sum(len(p.token_ids) for p in job.prompts), num_generated,
                            sum(o.num_cached_tokens for o in outputs.values())),
    }
    kv_transfer = [o.kv_transfer_params for o in outputs.values() if o.kv_transfer_params]
    if kv_transfer:  # a prefill engine's answer: where the decode engine pulls the KV
        response["kv_transfer_params"] = kv_transfer[0] if len(kv_transfer) == 1 else kv_transfer
    return response


def _text_logprobs(job: Job, prompt: PromptInput, output: RequestOutput,
                   completion: CompletionOutput, text_offset: int) -> dict[str, Any]:
    """A whole completions-API choice's logprobs: the prompt's with echo, then
    the generated tokens' (none with ``echo_only``)."""
    generated = completion_logprobs(completion, len(completion.token_ids) if job.echo_only
                                    else 0, text_offset)
    return join_logprobs(echo_logprobs(prompt, output), generated) if job.echo else generated


@dataclass
class _ChoiceState:
    num_tokens: int = 0
    num_sent_logprobs: int = 0
    text_offset: int = 0
    echoed: bool = False
    finished: bool = False
    num_sent_chars: int = 0  # chat with tools: content characters sent


class SSEWriter(Protocol):
    """A streaming request's frames: its opening, one step's outputs, the
    end, or an error in place of the end."""

    def opening(self) -> list[str]: ...

    def frames(self, prompt_index: int, output: RequestOutput) -> list[str]: ...

    def closing(self) -> list[str]: ...

    def error(self, error: APIError) -> list[str]: ...


class StreamWriter:
    """Turns engine outputs into SSE frames, one choice per chunk."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.choices = [_ChoiceState() for _ in range(job.num_choices)]
        self.num_cached_tokens: dict[int, int] = {}  # per prompt index

    def usage(self) -> dict[str, Any]:
        return usage_dict(sum(len(p.token_ids) for p in self.job.prompts),
                          0 if self.job.echo_only else sum(c.num_tokens for c in self.choices),
                          sum(self.num_cached_tokens.values()))

    def opening(self) -> list[str]:
        """Chat: one ``delta.role`` chunk per choice (completions echo their
        prompt with their first output, which brings the prompt's logprobs)."""
        job = self.job
        if not job.chat:
            return []
        return [job.chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None}],
                          self._continuous_usage())
                for index in range(job.num_choices)]

    def closing(self) -> list[str]:
        """The usage chunk (when asked for) and ``[DONE]``."""
        usage = [self.job.chunk([], self.usage())] if self.job.body.include_usage else []
        return [*usage, DONE_FRAME]

    def error(self, error: APIError) -> list[str]:
        return [f"data: {json.dumps(error.body())}\n\n", DONE_FRAME]

    def _echo(self, index: int, prompt_index: int, output: RequestOutput) -> str:
        """The chunk echoing a completions choice's prompt (with its logprobs)."""
        prompt = self.job.prompts[prompt_index]
        text = prompt.text or ""
        state = self.choices[index]
        state.echoed, state.text_offset = True, len(text)
        logprobs = echo_logprobs(prompt, output) if self.job.top_logprobs is not None else None
        return self.job.chunk([{"index": index, "text": text, "logprobs": logprobs,
                                "finish_reason": None}], self._continuous_usage())

    def _continuous_usage(self) -> dict[str, Any] | None:
        return self.usage() if self.job.body.continuous_usage else None

    def frames(self, prompt_index: int, output: RequestOutput) -> list[str]:
        frames = []
        self.num_cached_tokens[prompt_index] = output.num_cached_tokens
        for completion in output.outputs:
            index = self.job.choice_index(prompt_index, completion.index)
            state = self.choices[index]
            if state.finished:
                continue
            if self.job.echo and not state.echoed:
                frames.append(self._echo(index, prompt_index, output))
            if self.job.echo_only:
                if completion.finish_reason is not None:
                    state.finished = True
                    frames.append(self.job.chunk([{
                        "index": index, "text": "", "logprobs": None, "finish_reason": "length",
                        "stop_reason": None}], self._continuous_usage()))
                continue
            state.num_tokens = len(completion.token_ids)
            if self.job.tools is not None:
                frames += self._tool_frames(index, completion, state)
                continue
            finishing = completion.finish_reason is not None
            wants_logprobs = (self.job.top_logprobs is not None
                              and state.num_tokens > state.num_sent_logprobs)
            if not (completion.delta_text or finishing or wants_logprobs):
                continue
            choice = self._choice(index, completion, state)
            state.finished = finishing
            frames.append(self.job.chunk([choice], self._continuous_usage()))
        return frames

    def _tool_frames(self, index: int, completion: CompletionOutput,
                     state: _ChoiceState) -> list[str]:
        """A chat choice with tools: content while it cannot be a call, the
        calls when the output ends (each: its id, type and name with empty
        arguments, then the arguments, as OpenAI streams them)."""
        tools, text = self.job.tools, completion.text
        assert tools is not None
        choices: list[dict[str, Any]] = []
        if completion.finish_reason is None:
            end = tools.streamable(text)
            if end > state.num_sent_chars:
                choices.append({"delta": {"content": text[state.num_sent_chars:end]}})
                state.num_sent_chars = end
        else:
            state.finished = True
            content, calls = tools.extract(text)
            rest = (content or "")[state.num_sent_chars:] if calls else text[
                state.num_sent_chars:]
            if rest:
                choices.append({"delta": {"content": rest}})
            for i, call in enumerate(calls):
                choices.append({"delta": {"tool_calls": [{
                    "index": i, "id": call.id, "type": "function",
                    "function": {"name": call.name, "arguments": ""}}]}})
                choices.append({"delta": {"tool_calls": [{
                    "index": i, "function": {"arguments": call.arguments}}]}})
            choices.append({"delta": {}, "finish_reason": tools.finish_reason(
                completion.finish_reason, calls), "stop_reason": completion.stop_reason})
        return [self.job.chunk([{"index": index, "logprobs": None, "finish_reason": None,
                                 **choice}], self._continuous_usage()) for choice in choices]

    def _choice(self, index: int, completion: CompletionOutput,
                state: _ChoiceState) -> dict[str, Any]:
        job, text = self.job, completion.delta_text
        logprobs = None
        if job.top_logprobs is not None:
            logprobs = (chat_logprobs(completion, state.num_sent_logprobs, job.top_logprobs)
                        if job.chat else
                        completion_logprobs(completion, state.num_sent_logprobs,
                                            state.text_offset))
            state.num_sent_logprobs = state.num_tokens
        state.text_offset += len(text)
        choice: dict[str, Any] = {"index": index}
        if job.chat:
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["text"] = text
        choice.update(logprobs=logprobs, finish_reason=completion.finish_reason)
        if completion.finish_reason is not None:
            choice["stop_reason"] = completion.stop_reason
        return choice


def _error_param(exc: ValueError, body: SamplingRequest, prompt_param: str) -> str | None:
    """The request field a ValueError from the engine or ``SamplingParams`` names."""
    match = _FIELD_RE.match(str(exc))
    name = match.group(1) if match else None
    if name == "prompt":
        return prompt_param
    if name == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
        return "max_completion_tokens"
    if name == "logprobs" and "top_logprobs" in type(body).model_fields:
        return "top_logprobs"  # a chat request's count; its logprobs is a flag
    return name if name in type(body).model_fields else None


def _bad_request(exc: ValueError, body: SamplingRequest, prompt_param: str) -> APIError:
    """A 400 for a ValueError from the engine or ``SamplingParams``, spelled
    with the request's field name."""
    param = _error_param(exc, body, prompt_param)
    message = str(exc)
    match = _FIELD_RE.match(message)
    if param is not None and match is not None and match.group(1) not in (param, "prompt"):
        message = param + message[match.end():]
    return APIError(400, message, param)


class OpenAIServing:
    """The completions and chat-completions routes."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def check_model(self, model: str | None) -> str:
        """The served name (of the model or a LoRA adapter) to report; 404
        (``param: "model"``) for an unknown one."""
        config = self.state.config
        names = config.served_model_names
        if model is None or model in names or config.lora_request(model) is not None:
            return names[0] if model is None else model
        served = [*names, *(lora.lora_name for lora in config.lora_requests)]
        raise APIError(404, f"The model `{model}` does not exist. Served: "
                       f"{', '.join(served)}.", "model", code="model_not_found")

    async def completions(self, request: Request) -> Response:
        body = CompletionRequest.parse(
            await read_body(request, self.state.config.max_request_body_bytes))
        body.check()
        model = self.check_model(body.model)
        processor = self.state.require_engine().processor
        prompts = [self._completion_prompt(processor, body, prompt) for prompt in body.prompt]
        job = self._job(body, prompts, model, chat=False, top_logprobs=body.logprobs)
        job.echo, job.echo_only = body.echo, body.echo_only
        await self._process(processor, job)
        return await self._serve(request, job)

    async def chat_completions(self, request: Request) -> Response:
        body = ChatCompletionRequest.parse(
            await read_body(request, self.state.config.max_request_body_bytes))
        body.check()
        model = self.check_model(body.model)
        processor = self.state.require_engine().processor
        prompt = self._chat_prompt(processor, body)
        job = self._job(body, [prompt], model, chat=True, top_logprobs=body.num_top_logprobs)
        self._tool_calling(body, job)
        await self._process(processor, job)
        return await self._serve(request, job)

    # ------------------------------------------------------------ preparing

    def _check_chars(self, processor: InputProcessor, text_len: int, param: str) -> None:
        limit = processor.max_model_len * MAX_CHARS_PER_TOKEN
        if text_len > limit:
            raise APIError(400, f"{param}: {text_len} characters cannot fit the model's "
                           f"context of {processor.max_model_len} tokens", param)

    def _completion_prompt(self, processor: InputProcessor, body: CompletionRequest,
                           prompt: str | list[int]) -> PromptInput:
        if isinstance(prompt, str):
            self._check_chars(processor, len(prompt), "prompt")
        try:
            text, token_ids = processor.tokenize(prompt)
        except ValueError as exc:
            raise APIError(400, str(exc), "prompt") from None
        if not body.echo:
            return PromptInput(token_ids, text)
        if text is None:
            text = processor.tokenizer.decode(token_ids)
        return PromptInput(token_ids, text, processor.tokenizer.decode(token_ids[:1]))

    def _chat_prompt(self, processor: InputProcessor, body: ChatCompletionRequest
                     ) -> PromptInput:
        self._check_chars(processor, sum(len(m.content or "") for m in body.messages),
                          "messages")
        messages = [m.to_template() for m in body.messages]
        kwargs = dict(body.chat_template_kwargs or {})
        if body.tools:
            kwargs["tools"] = body.tool_dicts()
        try:
            token_ids = processor.apply_chat_template(messages, body.add_generation_prompt, kwargs)
        except Exception as exc:
            raise APIError(400, f"the chat template could not render these messages: "
                           f"{str(exc)[:200]}", "messages") from None
        return PromptInput(token_ids)

    def _sampling_params(self, body: SamplingRequest, top_logprobs: int | None,
                         prompt_param: str, prompt_logprobs: int | None) -> SamplingParams:
        # the model's generation_config values stand in for unset fields
        client = self.state.client
        model = client.config.sampling_defaults if client is not None else {}

        def pick(value: Any, name: str, default: Any) -> Any:
            return model.get(name, default) if value is None else value

        try:
            return SamplingParams(
                n=body.n, temperature=pick(body.temperature, "temperature", 1.0),
                top_p=pick(body.top_p, "top_p", 1.0), top_k=pick(body.top_k, "top_k", 0),
                min_p=pick(body.min_p, "min_p", 0.0),
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=pick(body.repetition_penalty, "repetition_penalty", 1.0),
                dry_multiplier=pick(body.dry_multiplier, "dry_multiplier", 0.0),
                dry_base=pick(body.dry_base, "dry_base", 1.75),
                dry_allowed_length=pick(body.dry_allowed_length, "dry_allowed_length", 2),
                dry_penalty_last_n=pick(body.dry_penalty_last_n, "dry_penalty_last_n", -1),
                dry_sequence_breakers=pick(body.dry_sequence_breakers, "dry_sequence_breakers",
                                           None),
                seed=body.seed, stop=body.stop, stop_token_ids=body.stop_token_ids,
                ignore_eos=body.ignore_eos,
                max_tokens=body.requested_max_tokens(model.get("max_tokens")),
                min_tokens=body.min_tokens,
                logprobs=top_logprobs, prompt_logprobs=prompt_logprobs,
                skip_special_tokens=body.skip_special_tokens,
                include_stop_str_in_output=body.include_stop_str_in_output,
                logit_bias=body.token_logit_bias, kv_transfer_params=body.kv_transfer_params,
            )
        except ValueError as exc:
            raise _bad_request(exc, body, prompt_param) from None

    def _job(self, body: SamplingRequest, prompts: list[PromptInput], model: str, chat: bool,
             top_logprobs: int | None) -> Job:
        max_n = self.state.config.max_n
        if body.n > max_n:
            raise APIError(400, f"n={body.n} is invalid: must be <= {max_n} on this server", "n")
        prompt_param = "messages" if chat else "prompt"
        echo = isinstance(body, CompletionRequest) and body.echo
        base = self._sampling_params(body, top_logprobs, prompt_param,
                                     top_logprobs if echo else None)
        structured = body.structured_output()
        if structured is not None:
            base.structured_output = structured[0]
        prefix = "chatcmpl" if chat else "cmpl"
        lora = self.state.config.lora_request(model)
        return Job(chat=chat, request_id=f"{prefix}-{uuid.uuid4().hex}", model=model,
                   prompts=prompts, params=base, n=body.n, body=body,
                   timer=self.state.metrics.timer(len(prompts) * body.n,
                                                  lora.lora_name if lora else None),
                   top_logprobs=top_logprobs, lora_request=lora,
                   structured_param=structured[1] if structured is not None else None)

    def _tool_calling(self, body: ChatCompletionRequest, job: Job) -> None:
        """Set up the job's tool calls: "required" and named functions
        generate under a JSON schema (so the arguments always parse), "auto"
        parses with the server's --tool-call-parser."""
        mode = body.tool_mode
        if mode is None:
            return
        kind, name = mode
        parser = None
        if kind == "auto":
            if self.state.config.tool_call_parser is None:
                raise APIError(400, "tool_choice 'auto' needs the server started with "
                               "--tool-call-parser (hermes, llama3_json, mistral); "
                               "'required' and named functions work without", "tool_choice")
            parser = get_tool_parser(self.state.config.tool_call_parser)
        elif job.structured_param is not None:
            raise APIError(400, f"tool_choice '{kind}' constrains the output itself: drop "
                           f"{job.structured_param}", "tool_choice")
        else:
            schema = forced_calls_schema(body.tool_dicts(), name, body.parallel_tool_calls)
            job.params.structured_output = StructuredOutputParams(json=schema)
            job.structured_param = "tools"
        job.tools = ToolCalling(kind, name, parser, body.parallel_tool_calls)

    async def _process(self, processor: InputProcessor, job: Job) -> None:
        """One engine request per prompt, through the input processor: a 400
        naming the field when it refuses one. A grammar is compiled in a
        worker thread (not on the event loop; cached, so the later prompts
        find it)."""
        body, prompt_param = job.body, "messages" if job.chat else "prompt"
        lora_request = job.lora_request
        for prompt, request_id in zip(job.prompts, job.engine_request_ids):
            args = (prompt.text, prompt.token_ids, job.params, request_id, body.priority,
                    lora_request)
            try:
                job.requests.append(await asyncio.to_thread(processor.process_tokens, *args)
                                    if job.structured_param is not None
                                    else processor.process_tokens(*args))
            except GrammarError as exc:
                param = job.structured_param
                raise APIError(400, f"{param}: {exc}", param) from None
            except ValueError as exc:
                raise _bad_request(exc, body, prompt_param) from None

    # ------------------------------------------------------------ serving

    async def _serve(self, request: Request, job: Job) -> Response:
        ticket = Ticket(job.request_id, job.num_choices, job.engine_request_ids)
        self.state.admit(ticket)
        client = self.state.client
        assert client is not None
        merger = OutputMerger([client.generate(engine_request) for engine_request in job.requests])

        async def cleanup() -> None:
            await merger.close()
            self.state.admission.release(ticket)
            job.timer.close("abort")

        handed_off = False
        try:
            if not job.body.stream:
                outputs = await unless_disconnected(request, self._collect(job, merger))
                return JSONResponse(self._final_response(job, outputs))
            first = await unless_disconnected(request, merger.next())
            response = SSEResponse(self._stream(job, merger, first), cleanup)
            handed_off = True
            return response
        except ClientDisconnected:
            logger.info("%s: the client disconnected; request aborted", job.request_id)
            return Response(status_code=499)
        except Exception as exc:
            error = self._api_error(exc, job)
            job.timer.close("error" if error.status >= 500 else None)
            raise error from None
        finally:
            if not handed_off:
                await cleanup()

    def _final_response(self, job: Job, outputs: dict[int, RequestOutput]) -> dict[str, Any]:
        """The body of a finished non-streaming request (the Responses API's differs)."""
        return final_response(job, outputs)

    async def _collect(self, job: Job, merger: OutputMerger) -> dict[int, RequestOutput]:
        outputs: dict[int, RequestOutput] = {}
        while (item := await merger.next()) is not None:
            index, output = item
            job.timer.observe(output)
            outputs[index] = output
        return outputs

    def _writer(self, job: Job) -> SSEWriter:
        """The frames of a streaming request (the Responses API's differ)."""
        return StreamWriter(job)

    async def _stream(self, job: Job, merger: OutputMerger,
                      first: tuple[int, RequestOutput] | None) -> AsyncGenerator[str, None]:
        writer = self._writer(job)
        try:
            for frame in writer.opening():
                yield frame
            item = first
            while item is not None:
                index, output = item
                job.timer.observe(output)
                for frame in writer.frames(index, output):
                    yield frame
                item = await merger.next()
            for frame in writer.closing():
                yield frame
        except Exception as exc:
            error = self._api_error(exc, job)
            job.timer.close("error" if error.status >= 500 else None)
            for frame in writer.error(error):
                yield frame

    def _api_error(self, exc: Exception, job: Job) -> APIError:
        """An exception raised while serving, as the error to send."""
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, ValueError):
            return _bad_request(exc, job.body, "messages" if job.chat else "prompt")
        if isinstance(exc, EngineDeadError):
            logger.error("%s failed: %s", job.request_id, exc)
        else:
            logger.exception("%s failed", job.request_id)
        return APIError(500, INTERNAL_ERROR_MESSAGE)
