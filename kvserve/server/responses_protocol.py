"""The Responses API's HTTP contract (``POST /v1/responses``): the request
model, its input items, and the models of the Response object and of the
streamed events (for the OpenAPI document; responses are built as plain
dicts in ``responses.py``).

A request is checked here as a whole, each input item against its own
model, so a bad one is a 400 whose ``param`` names it
(``input[2].call_id``); ``ResponsesRequest.chat_fields`` then spells it as
the chat-completions request it amounts to, which the chat path serves.
Field names and defaults are OpenAI's; the sampling extras (``seed``,
``top_k``, ...) are vLLM's. Fields that would change the meaning of a
request but are not implemented (``background``, ``conversation``,
``prompt``, ``top_logprobs``, non-function tools) are refused, not ignored.
Nothing here generates.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator
from pydantic.json_schema import WithJsonSchema

from kvserve.server.protocol import APIError, APIRequest, loc_to_param

_TEXT_PART = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"enum": ["input_text", "output_text", "text"]}, "text": {"type": "string"}}}
_TEXT = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}
INPUT_SCHEMA: dict[str, Any] = {"anyOf": [{"type": "string"}, {"type": "array", "items": {
    "anyOf": [
        {"type": "object", "required": ["role", "content"], "properties": {
            "type": {"const": "message"},
            "role": {"enum": ["user", "system", "developer", "assistant"]}, "content": _TEXT}},
        {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
            "type": {"const": "function_call"}, "call_id": {"type": "string"},
            "name": {"type": "string"}, "arguments": {"type": "string"}}},
        {"type": "object", "required": ["type", "call_id", "output"], "properties": {
            "type": {"const": "function_call_output"}, "call_id": {"type": "string"},
            "output": _TEXT}}]}}]}


class TextPart(APIRequest):
    """A text content part: ``input_text`` (user side) or ``output_text``
    (an assistant message sent back)."""

    type: Literal["input_text", "output_text", "text"]
    text: str


def _parts(value: Any) -> Any:
    """A string as one text part (so a bad part's error names its index)."""
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


def _join(content: list[TextPart]) -> str:
    return "".join(part.text for part in content)


class MessageItem(APIRequest):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: list[TextPart]

    _content_parts = field_validator("content", mode="before")(_parts)

    def to_chat(self) -> dict[str, Any]:
        return {"role": self.role, "content": _join(self.content)}


class FunctionCallItem(APIRequest):
    """A call the model made earlier (sent back with its result)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str


class FunctionCallOutputItem(APIRequest):
    """The result of a call, answering the ``function_call`` with ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: list[TextPart]

    _output_parts = field_validator("output", mode="before")(_parts)

    def to_chat(self) -> dict[str, Any]:
        return {"role": "tool", "content": _join(self.output), "tool_call_id": self.call_id}


ITEM_MODELS: dict[str, type[APIRequest]] = {
    "message": MessageItem, "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}


def input_items(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as the items ``GET /v1/responses/{id}/input_items`` lists,
    each with an id (the client's where it gave one). Call after
    ``input_messages`` has checked it."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    listed = []
    for data in items:
        kind = data.get("type", "message")
        item = ITEM_MODELS[kind].model_validate(data)
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}[kind]
        value = {"id": data.get("id") or f"{prefix}_{uuid.uuid4().hex}", "status": "completed",
                 **item.model_dump(exclude_none=True)}
        value["type"] = kind
        if isinstance(item, FunctionCallOutputItem):
            value["output"] = _join(item.output)
        listed.append(value)
    return listed


def _item_error(exc: ValidationError, index: int) -> APIError:
    errors = exc.errors(include_url=False)
    loc = ("input", index, *errors[0]["loc"])
    message = str(errors[0]["msg"]).removeprefix("Value error, ")
    param = loc_to_param(loc)
    return APIError(400, f"{param}: {message}", param)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as chat messages: a string is one user message; items in
    order, a ``function_call`` joining the assistant message before it (one
    message carries all of a turn's calls), a ``function_call_output`` as a
    ``tool`` message. 400 naming the item for anything else."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for index, data in enumerate(items):
        kind = data.get("type", "message")
        model = ITEM_MODELS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise APIError(400, f"input[{index}].type={kind!r} is not supported: send "
                           f"{', '.join(ITEM_MODELS)} items", f"input[{index}].type")
        try:
            item = model.model_validate(data)
        except ValidationError as exc:
            raise _item_error(exc, index) from None
        if isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        else:
            assert isinstance(item, MessageItem | FunctionCallOutputItem)
            messages.append(item.to_chat())
    return messages


class FunctionTool(APIRequest):
    """A function the model may call (the Responses spelling: no nested
    ``function`` object)."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def to_chat(self) -> dict[str, Any]:
        return {"type": "function", "function": self.model_dump(exclude={"type"},
                                                                 exclude_none=True)}


class FunctionToolChoice(APIRequest):
    type: Literal["function"]
    name: str


class TextFormat(APIRequest):
    """``text.format``: plain text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(APIRequest):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(APIRequest):
    """``POST /v1/responses``."""

    model: str | None = None
    input: Annotated[str | list[dict[str, Any]], WithJsonSchema(INPUT_SCHEMA)]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM's sampling extras
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    priority: int = 0
    # refused when set: they would change what the request means
    background: bool = False
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    top_logprobs: int | None = Field(None, ge=0)

    def check(self) -> None:
        """Cross-field checks; 400 naming the field."""
        if isinstance(self.input, list) and not self.input:
            raise APIError(400, "input must not be an empty list", "input")
        if isinstance(self.input, list):
            for index, item in enumerate(self.input):
                if not isinstance(item, dict):
                    raise APIError(400, f"input[{index}] must be an object", f"input[{index}]")
        for name in ("background", "conversation", "prompt", "top_logprobs"):
            if getattr(self, name) not in (None, False, 0):
                raise APIError(400, f"{name} is not supported by kvserve", name)
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise APIError(400, "tool_choice 'required' or a function needs tools",
                           "tool_choice")
        if isinstance(self.tool_choice, FunctionToolChoice) and self.tool_choice.name not in {
                tool.name for tool in self.tools or []}:
            raise APIError(400, f"tool_choice names function '{self.tool_choice.name}', "
                           "which is not in tools", "tool_choice")
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema" and fmt.schema_ is None:
            raise APIError(400, "text.format.schema: a json_schema format needs a schema",
                           "text.format.schema")

    def chat_fields(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The body of the chat-completions request this one amounts to."""
        fields: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "stream": self.stream,
            "user": self.user, "seed": self.seed, "top_k": self.top_k, "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty, "priority": self.priority,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        if self.tools:
            fields["tools"] = [tool.to_chat() for tool in self.tools]
        choice = self.tool_choice
        fields["tool_choice"] = ({"type": "function", "function": {"name": choice.name}}
                                 if isinstance(choice, FunctionToolChoice) else choice)
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}}
        elif fmt is not None:
            fields["response_format"] = {"type": fmt.type}
        return {key: value for key, value in fields.items() if value is not None}

    def text_config(self) -> dict[str, Any]:
        """``text`` as the Response object reports it."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None:
            return {"format": {"type": "text"}}
        return {"format": fmt.model_dump(by_alias=True, exclude_none=True)}


# ---------------------------------------------------------------- responses


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any] | None = None


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | OutputFunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str | None
    message: str


class ResponseObject(BaseModel):
    """The Response object (``POST`` without streaming, ``GET`` by id, and
    inside the ``response.*`` lifecycle events)."""

    id: str
    object: Literal["response"]
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete", "cancelled", "failed"]
    output: list[OutputItem]
    usage: ResponseUsage | None
    incomplete_details: IncompleteDetails | None
    error: ResponseError | None
    instructions: str | None
    max_output_tokens: int | None
    previous_response_id: str | None
    temperature: float | None
    top_p: float | None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    text: dict[str, Any]
    store: bool
    metadata: dict[str, str] | None
    user: str | None


class InputItem(BaseModel):
    """An input item as listed back: a message, a function call or its output."""

    id: str
    type: Literal["message", "function_call", "function_call_output"]
    status: Literal["completed"]
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: list[dict[str, Any]] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None


class InputItemList(BaseModel):
    """``GET /v1/responses/{response_id}/input_items``: one page."""

    object: Literal["list"]
    data: list[InputItem]
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


class _Event(BaseModel):
    sequence_number: int


class LifecycleEvent(_Event):
    type: Literal["response.created", "response.in_progress", "response.completed",
                  "response.incomplete", "response.failed"]
    response: ResponseObject


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class TextDeltaEvent(_Event):
    type: Literal["response.output_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any]


class TextDoneEvent(_Event):
    type: Literal["response.output_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any]


class ArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"]
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"]
    item_id: str
    output_index: int
    arguments: str


class ErrorEvent(_Event):
    """An error after the stream started (the last event)."""

    type: Literal["error"]
    message: str
    code: str | None
    param: str | None


STREAM_EVENTS: list[type[BaseModel]] = [
    LifecycleEvent, OutputItemEvent, ContentPartEvent, TextDeltaEvent, TextDoneEvent,
    ArgumentsDeltaEvent, ArgumentsDoneEvent, ErrorEvent]
