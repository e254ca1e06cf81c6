"""The HTTP contract: OpenAI request models, the error envelope, and how a
pydantic validation failure becomes a 400 whose ``param`` names the field.

Requests are parsed by the server itself (``APIRequest.parse``), never by
FastAPI's body injection, so a bad body is always a 400 with the OpenAI
envelope ``{"error": {"message", "type", "param", "code"}}``, never a 422.
Field names and defaults are OpenAI's and vLLM's. Fields that would change
the meaning of a request but that kvserve does not implement (``suffix``,
``best_of`` other than ``n``) are rejected with a 400 instead of being
silently ignored; unknown fields are ignored, as vLLM does. An explicit
``null`` means "the default" for every field (OpenAI's spec allows ``null``
for its optional fields, and clients send it for unset ones); the JSON
schema says so. Responses are built as plain dicts in ``serving.py``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue, WithJsonSchema
from pydantic_core import CoreSchema

from kvserve.core.structured_output import StructuredOutputParams

MAX_STOP_STRINGS = 4
MAX_PROMPTS_PER_REQUEST = 128
# validation messages echo at most this much of a bad value, and this many errors
MAX_ECHO_CHARS = 200
MAX_ERRORS_REPORTED = 10
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
INTERNAL_ERROR_MESSAGE = "The server had an error while processing your request."


# OpenAI's error codes (a string or null) where OpenAI has one for the case
ERROR_CODES = {401: "invalid_api_key", 404: "not_found", 413: "request_too_large",
               503: "service_unavailable"}


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error envelope: vLLM's type names; ``code`` a string or
    null as OpenAI types it (the HTTP status is the response's own)."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "APIError"),
                      "param": param, "code": code or ERROR_CODES.get(status)}}


class APIError(Exception):
    """An error to send as an HTTP status with the OpenAI envelope."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: Mapping[str, str] | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = dict(headers or {})
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_ECHO_CHARS else text[:MAX_ECHO_CHARS] + "..."


def loc_to_param(loc: tuple[int | str, ...]) -> str | None:
    """``("messages", 0, "content")`` -> ``"messages[0].content"``."""
    param = ""
    for part in loc:
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else part)
    return param or None


def validation_error(exc: ValidationError) -> APIError:
    """A 400 naming the first bad field; the message lists (a bounded number of) them."""
    errors = exc.errors(include_url=False)
    param = loc_to_param(tuple(errors[0]["loc"])) if errors else None
    lines = []
    for error in errors[:MAX_ERRORS_REPORTED]:
        name = loc_to_param(tuple(error["loc"])) or "body"
        message = str(error["msg"]).removeprefix("Value error, ")
        if error["type"] == "missing":
            lines.append(f"{name}: field required")
        else:
            lines.append(f"{name}={_short(error.get('input'))} is invalid: {message}")
    if len(errors) > MAX_ERRORS_REPORTED:
        lines.append(f"... and {len(errors) - MAX_ERRORS_REPORTED} more errors")
    return APIError(400, "; ".join(lines) or "invalid request body", param)


def _defaulted(model: type[BaseModel]) -> frozenset[str]:
    """The fields of ``model`` with a default other than None."""
    return frozenset(name for name, info in model.model_fields.items()
                     if not info.is_required() and info.get_default(call_default_factory=True)
                     is not None)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(body: bytes) -> Any:
    """Decode a JSON body (NaN and Infinity rejected); 400 when it is malformed."""
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", "body") from None


RequestT = TypeVar("RequestT", bound="APIRequest")


class APIRequest(BaseModel):
    """Base of the request models: unknown fields ignored, NaN and inf
    rejected, ``null`` taken as the field's default."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items()
                    if value is not None or key not in _defaulted(cls)}
        return data

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        schema = handler.resolve_ref_schema(handler(core_schema))
        properties = schema.get("properties", {})
        for name in _defaulted(cls):
            prop = properties.get(name)
            if prop is None:
                continue
            kept = {k: prop.pop(k) for k in ("title", "default", "description") if k in prop}
            options = prop.pop("anyOf", None) or [prop]
            properties[name] = {"anyOf": [*options, {"type": "null"}], **kept}
        return schema

    @classmethod
    def parse(cls: type[RequestT], body: bytes) -> RequestT:
        data = parse_json(body)
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object", "body")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc) from None


class StreamOptions(APIRequest):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(APIRequest):
    """``response_format.json_schema``: the output always matches ``schema``
    (``strict`` or not, as in vLLM)."""

    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(APIRequest):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(APIRequest):
    """vLLM's ``structured_outputs``: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


# vLLM's older request fields for the same, each one kind
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


class SamplingRequest(APIRequest):
    """Fields shared by completions and chat completions."""

    # completions default 16; chat None = the rest of the context
    default_max_tokens: ClassVar[int | None] = None

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    n: int = Field(1, ge=1)
    stop: Annotated[list[str] | None, WithJsonSchema(
        {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}},
                   {"type": "null"}]})] = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    # llama.cpp's DRY penalty (kvserve/sampling/dry.py)
    dry_multiplier: float | None = Field(None, ge=0, le=100)
    dry_base: float | None = Field(None, gt=1, le=10)
    dry_allowed_length: int | None = Field(None, ge=1)
    dry_penalty_last_n: int | None = Field(None, ge=-1)
    dry_sequence_breakers: list[str] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # token id (as a string, JSON keys are strings) -> bias in [-100, 100]
    logit_bias: dict[str, float] | None = None
    priority: int = 0
    # structured output: OpenAI's response_format, or vLLM's structured_outputs / guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # disaggregated prefill / decode, vLLM's field: {"do_remote_decode": true} to a
    # prefill engine; its answer (the response's kv_transfer_params) to a decode engine
    kv_transfer_params: dict[str, Any] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError("must be a non-empty string or a list of non-empty strings")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, "
                             f"got {len(stops)}")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"key {key!r} is not a token id: keys must be integers >= 0")
            if not -100 <= bias <= 100:
                raise ValueError(f"the bias of token {key} is {bias}: must be in [-100, 100]")
        return value

    @property
    def token_logit_bias(self) -> dict[int, float] | None:
        """``logit_bias`` with integer token ids."""
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(token_id < 0 for token_id in value):
            raise ValueError("token ids must be >= 0")
        return value

    def check(self) -> None:
        """Cross-field checks pydantic cannot tie to one field; 400 naming it."""
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true",
                           "stream_options")

    def structured_output(self) -> tuple[StructuredOutputParams, str] | None:
        """What the output must match and the field that asked for it (400
        naming the field when it is malformed or given twice)."""
        given: list[tuple[dict[str, Any], str]] = []
        if self.response_format is not None and self.response_format.type != "text":
            given.append((self._response_format_spec(), "response_format"))
        if self.structured_outputs is not None:
            given.append((self.structured_outputs.model_dump(by_alias=True, exclude_none=True),
                          "structured_outputs"))
        for name, kind in GUIDED_FIELDS.items():
            if getattr(self, name) is not None:
                given.append(({kind: getattr(self, name)}, name))
        if not given:
            return None
        if len(given) > 1:
            raise APIError(400, "give only one of " + ", ".join(p for _, p in given)
                           + ": each constrains the whole output", given[1][1])
        spec, param = given[0]
        try:
            return StructuredOutputParams(**spec), param
        except (ValueError, TypeError) as exc:
            raise APIError(400, f"{param}: {exc}", param) from None

    def _response_format_spec(self) -> dict[str, Any]:
        assert self.response_format is not None
        if self.response_format.type == "json_object":
            return {"json_object": True}
        json_schema = self.response_format.json_schema
        if json_schema is None or json_schema.schema_ is None:
            raise APIError(400, "response_format.json_schema.schema: a json_schema response "
                           "format needs a schema", "response_format.json_schema")
        return {"json": json_schema.schema_}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def requested_max_tokens(self, model_default: int | None = None) -> int | None:
        """The request's max_tokens; unset: the model's default (its
        generation_config), else the route's."""
        if self.max_tokens is not None:
            return self.max_tokens
        return model_default if model_default is not None else self.default_max_tokens


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``."""

    default_max_tokens: ClassVar[int | None] = 16

    prompt: Annotated[list[str] | list[list[int]], WithJsonSchema({"anyOf": [
        {"type": "string"}, {"type": "array", "items": {"type": "string"}},
        {"type": "array", "items": {"type": "integer"}},
        {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}]})]
    # 0 only with echo: the prompt (and its logprobs) back, nothing generated
    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0)  # the engine's --max-logprobs decides
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        """Normalise str | list[str] | list[int] | list[list[int]] to a list of prompts."""
        single_ids = isinstance(value, list) and value and all(_is_token_id(v) for v in value)
        if isinstance(value, str) or single_ids:
            value = [value]
        if not isinstance(value, list) or not value:
            raise ValueError("must be a non-empty string, a list of token ids, or a "
                             "non-empty list of either")
        if len(value) > MAX_PROMPTS_PER_REQUEST:
            raise ValueError(f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request, "
                             f"got {len(value)}")
        if all(isinstance(v, str) for v in value):
            if not all(value):
                raise ValueError("prompts must not be empty")
        elif not all(isinstance(v, list) and v and all(_is_token_id(t) for t in v)
                     for v in value):
            raise ValueError("must be a non-empty string, a list of token ids, or a "
                             "non-empty list of either (not a mix)")
        return value

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise APIError(400, "suffix is not supported by kvserve", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, f"best_of={self.best_of} is invalid: kvserve supports only "
                           f"best_of equal to n ({self.n})", "best_of")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens=0 is invalid without echo=true: must be >= 1",
                           "max_tokens")

    @property
    def echo_only(self) -> bool:
        """True for ``max_tokens: 0`` with echo: score the prompt, generate nothing."""
        return self.echo and self.max_tokens == 0

    def requested_max_tokens(self, model_default: int | None = None) -> int | None:
        # echo only: the engine samples the one token that ends its prefill
        # (no extra forward), and the response leaves it out
        return 1 if self.echo_only else super().requested_max_tokens(model_default)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class FunctionCall(APIRequest):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(APIRequest):
    """A call an assistant message made (in the history a client sends back)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(APIRequest):
    """One chat message; content may be a string or a list of text parts.
    ``developer`` is OpenAI's new name for ``system`` and reaches the chat
    template as ``system``; ``tool`` messages answer an assistant's
    ``tool_calls`` (``tool_call_id`` names the call)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | None, WithJsonSchema({"anyOf": [
        {"type": "string"}, {"type": "null"},
        {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                    "properties": {"type": {"const": "text"},
                                                   "text": {"type": "string"}}}}]})] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_content(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ValueError("only text content parts ({'type': 'text', 'text': ...}) "
                                 "are supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError("a text content part needs a string 'text'")
            texts.append(text)
        return "".join(texts)

    def to_template(self) -> dict[str, Any]:
        """The message as HF chat templates read it: a tool call's arguments
        as a dict (templates write them with ``tojson``), as vLLM passes them."""
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [{
                "id": call.id, "type": "function",
                "function": {"name": call.function.name,
                             "arguments": _json_or_text(call.function.arguments)},
            } for call in self.tool_calls]
        return message


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDefinition(APIRequest):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(APIRequest):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(APIRequest):
    name: str


class NamedToolChoice(APIRequest):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)  # the engine's --max-logprobs decides
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # the deprecated spelling of tools: refused rather than ignored
    functions: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        if self.functions is not None:
            raise APIError(400, "functions is deprecated and not supported: send tools",
                           "functions")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise APIError(400, "tool_choice 'required' or a named function needs tools",
                           "tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {
                tool.function.name for tool in self.tools or []}:
            raise APIError(400, f"tool_choice names function '{choice.function.name}', "
                           "which is not in tools", "tool_choice")

    @property
    def tool_mode(self) -> tuple[str, str | None] | None:
        """("auto" | "required" | "named", the named function) when the
        output may hold tool calls; None without tools or with "none"."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named", self.tool_choice.function.name
        return ("required" if self.tool_choice == "required" else "auto"), None

    def tool_dicts(self) -> list[dict[str, Any]]:
        """The tools as the chat template and the schema builder read them."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools or []]

    def requested_max_tokens(self, model_default: int | None = None) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super().requested_max_tokens(model_default)

    @property
    def num_top_logprobs(self) -> int | None:
        """The engine's ``logprobs`` (top alternatives per token) for this request."""
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(APIRequest):
    """``POST /tokenize``: a prompt, or chat messages rendered with the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")


class DetokenizeRequest(APIRequest):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]

    def check(self) -> None:
        return None
