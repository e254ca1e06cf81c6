"""The Responses API: ``POST /v1/responses`` and ``GET /v1/responses/{id}``.

A Responses request is served as the chat completion it amounts to
(``ResponsesRequest.chat_fields``): the same prompt, sampling parameters,
tool calling and structured output, the same admission, disconnect and
abort handling (``OpenAIServing``); only the request's spelling and the
output differ. The output is a list of items: a ``message`` with one
``output_text`` part, then a ``function_call`` item per tool call. A
stream is the typed events OpenAI sends (``event: <type>`` +
``data: <json>``, numbered by ``sequence_number``), ending with
``response.completed`` (or ``response.incomplete`` when
``max_output_tokens`` cut it), or an ``error`` event.

``previous_response_id`` continues a stored conversation: the stored
history (inputs and outputs, not ``instructions``, as OpenAI does) goes
before the new input. Responses with ``store`` (the default) are kept in
memory, least recently used first out, within a count and a character
bound; an unknown or evicted id is a 404 naming the field.
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.server.protocol import APIError, ChatCompletionRequest, validation_error
from kvserve.server.responses_protocol import ResponsesRequest, input_items, input_messages
from kvserve.server.serving import Job, OpenAIServing, SSEWriter, read_body
from kvserve.server.state import ServerState
from kvserve.server.tool_parsers import ToolCall

MAX_STORED_RESPONSES = 1024
MAX_STORED_CHARS = 64 * 1024 * 1024
# chat-completions field -> the Responses field that asked for it (for errors)
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens",
           "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


@dataclass
class _Stored:
    response: dict[str, Any]
    history: list[dict[str, Any]]  # chat messages: every input and output so far
    input_items: list[dict[str, Any]]  # this response's input, as listed back
    num_chars: int


class ResponseStore:
    """Stored responses by id: LRU, bounded by count and by characters."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES,
                 max_chars: int = MAX_STORED_CHARS) -> None:
        self.max_responses = max_responses
        self.max_chars = max_chars
        self.num_chars = 0
        self._entries: OrderedDict[str, _Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], history: list[dict[str, Any]],
            input_items: list[dict[str, Any]]) -> None:
        num_chars = sum(len(json.dumps(value)) for value in (response, history, input_items))
        if num_chars > self.max_chars:
            return
        self._entries[response["id"]] = _Stored(response, history, input_items, num_chars)
        self.num_chars += num_chars
        while len(self._entries) > self.max_responses or self.num_chars > self.max_chars:
            _, evicted = self._entries.popitem(last=False)
            self.num_chars -= evicted.num_chars

    def get(self, response_id: str) -> _Stored | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.num_chars -= entry.num_chars
        return entry is not None


@dataclass
class ResponsesJob(Job):
    """A job with what its Response object needs."""

    request: ResponsesRequest | None = None
    history: list[dict[str, Any]] = field(default_factory=list)  # before this response
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")

    @property
    def spec(self) -> ResponsesRequest:
        assert self.request is not None
        return self.request


def _mapped_param(param: str | None) -> str | None:
    if param is None:
        return None
    for chat, ours in _PARAMS.items():
        if param == chat or param.startswith((chat + ".", chat + "[")):
            return ours
    return param


def responses_error(error: APIError) -> APIError:
    """A chat path's error spelled with the Responses field names."""
    param = _mapped_param(error.param)
    message = error.message
    if error.param is not None and param != error.param and message.startswith(error.param):
        message = param + message[len(error.param):] if param else message
    return APIError(error.status, message, param, error.headers, error.code)


def _usage(job: Job, output: RequestOutput | None, num_output_tokens: int) -> dict[str, Any]:
    num_input = len(job.prompts[0].token_ids)
    return {"input_tokens": num_input,
            "input_tokens_details": {"cached_tokens": output.num_cached_tokens if output else 0},
            "output_tokens": num_output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": num_input + num_output_tokens}


def _call_item(call: ToolCall, status: str, arguments: str | None = None) -> dict[str, Any]:
    return {"id": "fc_" + call.id.removeprefix("call_"), "type": "function_call",
            "call_id": call.id, "name": call.name,
            "arguments": call.arguments if arguments is None else arguments, "status": status}


def _message_item(job: ResponsesJob, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"id": job.message_id, "type": "message", "role": "assistant", "status": status,
            "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def envelope(job: ResponsesJob, status: str, output: list[dict[str, Any]],
             usage: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Response object around ``output``."""
    spec = job.spec
    tools = [tool.model_dump(exclude_none=True) for tool in spec.tools or []]
    choice = spec.tool_choice
    return {
        "id": job.request_id, "object": "response", "created_at": job.created,
        "model": job.model, "status": status, "output": output, "usage": usage,
        "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                               else None),
        "error": None, "instructions": spec.instructions,
        "max_output_tokens": spec.max_output_tokens,
        "previous_response_id": spec.previous_response_id, "temperature": spec.temperature,
        "top_p": spec.top_p, "tools": tools,
        "tool_choice": (choice.model_dump() if choice is not None and not isinstance(choice, str)
                        else choice or "auto"),
        "parallel_tool_calls": spec.parallel_tool_calls, "text": spec.text_config(),
        "store": spec.store, "metadata": spec.metadata, "user": spec.user,
    }


def _status(completion: CompletionOutput) -> str:
    return {"length": "incomplete", "abort": "cancelled"}.get(
        completion.finish_reason or "", "completed")


def split_output(job: ResponsesJob, completion: CompletionOutput) -> tuple[str | None,
                                                                           list[ToolCall]]:
    """The message text (None: no message item) and the tool calls."""
    if job.tools is None:
        return completion.text, []
    content, calls = job.tools.extract(completion.text)
    return (content if calls else completion.text), calls


def output_items(job: ResponsesJob, completion: CompletionOutput,
                 with_message: bool = False) -> list[dict[str, Any]]:
    """The finished output: a message (when there is text, no call, or a
    stream opened one), then the function calls."""
    text, calls = split_output(job, completion)
    item_status = "incomplete" if _status(completion) == "incomplete" else "completed"
    items = []
    if text or not calls or with_message:
        items.append(_message_item(job, text or "", item_status))
    return items + [_call_item(call, "completed") for call in calls]


def history_after(job: ResponsesJob, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation a later ``previous_response_id`` continues: the
    history so far, this input, and this output as one assistant message."""
    text = "".join(part["text"] for item in items if item["type"] == "message"
                   for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    reply: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        reply["tool_calls"] = calls
    return [*job.history, *input_messages(job.spec.input), reply]


class ResponsesServing(OpenAIServing):
    """``/v1/responses``: the chat path with the Responses spelling."""

    def __init__(self, state: ServerState, store: ResponseStore | None = None) -> None:
        super().__init__(state)
        self.store = store if store is not None else ResponseStore()

    async def create(self, request: Request) -> Response:
        body = ResponsesRequest.parse(
            await read_body(request, self.state.config.max_request_body_bytes))
        body.check()
        model = self.check_model(body.model)
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            stored = self.store.get(body.previous_response_id)
            if stored is None:
                raise APIError(404, f"previous_response_id={body.previous_response_id!r}: no "
                               "such stored response (unknown, stored with store=false, or "
                               "evicted)", "previous_response_id")
            history = stored.history
        messages = input_messages(body.input)
        processor = self.state.require_engine().processor
        system = ([{"role": "system", "content": body.instructions}]
                  if body.instructions is not None else [])
        try:
            chat = ChatCompletionRequest.model_validate(
                body.chat_fields([*system, *history, *messages]))
            chat.check()
            prompt = self._chat_prompt(processor, chat)
            job = self._job(chat, [prompt], model, chat=True, top_logprobs=None)
            self._tool_calling(chat, job)
            values = {f.name: getattr(job, f.name) for f in fields(Job)}
            values["request_id"] = f"resp_{uuid.uuid4().hex}"  # before the engine requests
            response_job = ResponsesJob(**values, request=body, history=history)
            await self._process(processor, response_job)
        except ValidationError as exc:
            raise responses_error(validation_error(exc)) from None
        except APIError as exc:
            raise responses_error(exc) from None
        return await self._serve(request, response_job)

    def _stored(self, response_id: str) -> _Stored:
        stored = self.store.get(response_id)
        if stored is None:
            raise APIError(404, f"response_id={response_id!r}: no such stored response "
                           "(unknown, stored with store=false, deleted or evicted)",
                           "response_id")
        return stored

    async def retrieve(self, response_id: str) -> Response:
        return JSONResponse(self._stored(response_id).response)

    async def delete(self, response_id: str) -> Response:
        self._stored(response_id)
        self.store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def cancel(self, response_id: str) -> Response:
        """Only background responses can be cancelled (as OpenAI answers), and
        kvserve runs none: a stored response has finished."""
        self._stored(response_id)
        raise APIError(400, f"response_id={response_id!r}: only responses created with "
                       "background=true can be cancelled, and this server does not run "
                       "background responses (this one has finished)", "response_id")

    async def list_input_items(self, response_id: str, request: Request) -> Response:
        """One page of a stored response's input items (OpenAI's cursor paging:
        ``limit`` 1-100, default 20; ``order`` desc (default) or asc;
        ``after`` an item id)."""
        items = self._stored(response_id).input_items
        query = request.query_params
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order={order!r}: use 'asc' or 'desc'", "order")
        raw_limit = query.get("limit", "20")
        try:
            limit = int(raw_limit)
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise APIError(400, f"limit={raw_limit!r}: use an integer from 1 to 100", "limit")
        ordered = items if order == "asc" else items[::-1]
        after = query.get("after")
        if after is not None:
            ids = [item["id"] for item in ordered]
            if after not in ids:
                raise APIError(400, f"after={after!r}: not an input item of {response_id}",
                               "after")
            ordered = ordered[ids.index(after) + 1:]
        page = ordered[:limit]
        return JSONResponse({"object": "list", "data": page,
                             "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None,
                             "has_more": len(ordered) > limit})

    # ------------------------------------------------------------ hooks

    def _finish(self, job: ResponsesJob, response: dict[str, Any]) -> dict[str, Any]:
        if job.spec.store:
            self.store.put(response, history_after(job, response["output"]),
                           input_items(job.spec.input))
        return response

    def _final_response(self, job: Job, outputs: dict[int, RequestOutput]) -> dict[str, Any]:
        assert isinstance(job, ResponsesJob)
        output = outputs[0]
        completion = output.outputs[0]
        return self._finish(job, envelope(job, _status(completion), output_items(job, completion),
                                          _usage(job, output, len(completion.token_ids))))

    def _api_error(self, exc: Exception, job: Job) -> APIError:
        return responses_error(super()._api_error(exc, job))

    def _writer(self, job: Job) -> SSEWriter:
        assert isinstance(job, ResponsesJob)
        return ResponseEvents(job, lambda response: self._finish(job, response))


class ResponseEvents:
    """A response's stream events: text as it comes (held back while it may
    be the start of a tool call), calls and the closing events at the end."""

    def __init__(self, job: ResponsesJob,
                 finish: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self.job = job
        self.finish = finish  # stores the final response
        self.sequence_number = 0
        self.num_sent_chars = 0
        self.message_open = False
        self.response: dict[str, Any] | None = None  # the final one, once finished

    def event(self, kind: str, **payload: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number, **payload}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    def opening(self) -> list[str]:
        response = envelope(self.job, "in_progress", [])
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def _open_message(self) -> list[str]:
        if self.message_open:
            return []
        self.message_open = True
        ids = {"item_id": self.job.message_id, "output_index": 0}
        return [self.event("response.output_item.added", output_index=0,
                           item=_message_item(self.job, None, "in_progress")),
                self.event("response.content_part.added", **ids, content_index=0,
                           part=_text_part(""))]

    def _text(self, text: str) -> list[str]:
        if not text:
            return []
        self.num_sent_chars += len(text)
        return [*self._open_message(), self.event(
            "response.output_text.delta", item_id=self.job.message_id, output_index=0,
            content_index=0, delta=text, logprobs=[])]

    def closing(self) -> list[str]:
        assert self.response is not None, "the engine ended a request without finishing"
        self.finish(self.response)
        return []

    def error(self, error: APIError) -> list[str]:
        return [self.event("error", message=error.message, code=error.body()["error"]["code"],
                           param=error.param)]

    def frames(self, prompt_index: int, output: RequestOutput) -> list[str]:
        completion = output.outputs[0]
        text = completion.text
        if completion.finish_reason is None:
            tools = self.job.tools
            end = len(text) if tools is None else tools.streamable(text)
            return self._text(text[self.num_sent_chars:end])
        return self._closing(output, completion)

    def _closing(self, output: RequestOutput, completion: CompletionOutput) -> list[str]:
        job, frames = self.job, []
        text, _ = split_output(job, completion)
        frames += self._text((text or "")[self.num_sent_chars:])
        items = output_items(job, completion, with_message=self.message_open)
        for index, item in enumerate(items):
            if item["type"] == "message":
                frames += self._open_message()
                part = item["content"][0]
                ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
                frames += [self.event("response.output_text.done", **ids, text=part["text"],
                                      logprobs=[]),
                           self.event("response.content_part.done", **ids, part=part)]
            else:
                ids = {"item_id": item["id"], "output_index": index}
                frames += [
                    self.event("response.output_item.added", output_index=index,
                               item={**item, "arguments": "", "status": "in_progress"}),
                    self.event("response.function_call_arguments.delta", **ids,
                               delta=item["arguments"]),
                    self.event("response.function_call_arguments.done", **ids,
                               arguments=item["arguments"])]
            frames.append(self.event("response.output_item.done", output_index=index, item=item))
        status = _status(completion)
        self.response = envelope(job, status, items,
                                 _usage(job, output, len(completion.token_ids)))
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        frames.append(self.event(kind, response=self.response))
        return frames


def add_routes(app: Any, state: ServerState) -> ResponsesServing:
    """``POST /v1/responses``; ``GET`` and ``DELETE /v1/responses/{response_id}``,
    its ``input_items`` and ``cancel``, on ``app``."""
    serving = ResponsesServing(state)
    app.add_api_route("/v1/responses", serving.create, methods=["POST"])

    async def retrieve(response_id: str) -> Response:
        return await serving.retrieve(response_id)

    async def delete(response_id: str) -> Response:
        return await serving.delete(response_id)

    async def cancel(response_id: str) -> Response:
        return await serving.cancel(response_id)

    async def input_items(response_id: str, request: Request) -> Response:
        return await serving.list_input_items(response_id, request)

    app.add_api_route("/v1/responses/{response_id}", retrieve, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", delete, methods=["DELETE"])
    app.add_api_route("/v1/responses/{response_id}/cancel", cancel, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}/input_items", input_items, methods=["GET"])
    return serving

