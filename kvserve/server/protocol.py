"""The HTTP contract: OpenAI request models, the error envelope, and how a
pydantic validation failure becomes a 400 whose ``param`` names the field.

Requests are parsed by the server itself (``APIRequest.parse``), never by
FastAPI's body injection, so a bad body is always a 400 with the OpenAI
envelope ``{"error": {"message", "type", "param", "code"}}``, never a 422.
Field names and defaults are OpenAI's and vLLM's. Fields that would change
the meaning of a request but that kvserve does not implement (tools, JSON
mode, logit bias, ``suffix``) are rejected with a 400
instead of being silently ignored; unknown fields are ignored, as vLLM does.
Responses are built as plain dicts in ``serving.py``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvserve.core.sampling_params import MAX_LOGPROBS

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


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error envelope (vLLM's type names, numeric ``code``)."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "APIError"),
                      "param": param, "code": status}}


class APIError(Exception):
    """An error to send as an HTTP status with the OpenAI envelope."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)


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
    """Base of the request models: unknown fields ignored, NaN and inf rejected."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

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
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    priority: int = 0

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
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by kvserve", "logit_bias")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.default_max_tokens


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``."""

    default_max_tokens: ClassVar[int | None] = 16

    prompt: list[str] | list[list[int]]
    # 0 only with echo: the prompt (and its logprobs) back, nothing generated
    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
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

    def requested_max_tokens(self) -> int | None:
        # echo only: the engine samples the one token that ends its prefill
        # (no extra forward), and the response leaves it out
        return 1 if self.echo_only else super().requested_max_tokens()


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class ChatMessage(APIRequest):
    """One chat message; content may be a string or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None
    name: str | None = None

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
        message: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        if self.tools:
            raise APIError(400, "tools are not supported by kvserve", "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise APIError(400, f"response_format type "
                           f"'{self.response_format.get('type')}' is not supported by "
                           "kvserve (only 'text')", "response_format")

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

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
