"""The served OpenAPI document (``GET /openapi.json``): every route, its
request body, and every status it answers with, with the response's schema.

The request schemas are the request models of ``protocol.py`` themselves
(what the server validates); the response models here describe the plain
dicts ``serving.py`` and ``api.py`` build (the e2e schemathesis run checks
real responses against them). Streams are ``text/event-stream`` of
``data: <chunk JSON>`` frames, described by the chunk models. The document
is built once, without the engine. It is OpenAPI 3.2, whose ``itemSchema``
describes each server-sent event (3.1 has no way to). The adapter routes
(``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``) are in it only when
the server has them (``--allow-runtime-lora-updating``). Nothing here
handles a request.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from kvserve import __version__
from kvserve.server.lora_routes import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from kvserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kvserve.server.responses_protocol import (
    STREAM_EVENTS,
    DeletedResponse,
    InputItemList,
    ResponseObject,
    ResponsesRequest,
)

REF = "#/components/schemas/{model}"
FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope."""

    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    """Per token: its text, logprob, top alternatives and text offset; the
    first echoed prompt token has no logprob (null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # streamed chunks: only on the last one, with include_usage
    # a prefill engine's answer (--kv-role prefill): where a decode engine pulls the KV
    kv_transfer_params: dict[str, Any] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    refusal: None
    tool_calls: list[ToolCallOut] | None = None


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A streamed call: first its id, type and name, then its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kv_transfer_params: dict[str, Any] | None = None  # as CompletionResponse's


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    """One ``data:`` frame of a chat stream (``[DONE]`` ends it)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str | None
    parent: str | None
    max_model_len: int | None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Status(BaseModel):
    status: Literal["ok"]


class Version(BaseModel):
    version: str


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel, extra="allow"):
    """The tokenizer's configuration (further keys as its config has them)."""

    tokenizer_class: str
    model_max_length: int
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    chat_template: str | None


_MODELS: list[type[BaseModel]] = [
    CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest,
    ErrorResponse, CompletionResponse, ChatCompletionResponse, ChatCompletionChunk, ModelList,
    ModelCard, Status, Version, TokenizeResponse, DetokenizeResponse, TokenizerInfo,
    ResponsesRequest, ResponseObject, DeletedResponse, InputItemList, *STREAM_EVENTS,
]
_ERRORS = {400: "invalid request (the error's param names the field)",
           401: "missing or wrong API key (when the server has keys)",
           404: "unknown model (or stored response)", 413: "body above the server's limit",
           503: "loading, draining, or the queue is full (Retry-After)"}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _json(model: type[BaseModel], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(model)}}}


def _operation(summary: str, ok: dict[str, Any], body: type[BaseModel] | None = None,
               errors: tuple[int, ...] = (401, 503)) -> dict[str, Any]:
    responses = {"200": ok}
    for status in errors:
        responses[str(status)] = _json(ErrorResponse, _ERRORS[status])
    operation: dict[str, Any] = {"summary": summary, "responses": responses}
    if body is not None:
        operation["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": _ref(body)}}}
    return operation


def _generation(summary: str, body: type[BaseModel], response: type[BaseModel],
                chunk: type[BaseModel]) -> dict[str, Any]:
    # each event's data: a chunk (or an error, after the headers went out),
    # then the closing [DONE]
    data = {"anyOf": [{"const": "[DONE]"}, {
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}}]}
    ok = {"description": "the completion; with stream=true, server-sent events "
                         "`data: <chunk>` ending with `data: [DONE]`",
          "content": {"application/json": {"schema": _ref(response)},
                      "text/event-stream": {"itemSchema": {
                          "type": "object", "required": ["data"],
                          "properties": {"data": data}}}}}
    return {"post": _operation(summary, ok, body, (400, 401, 404, 413, 503))}


def _responses_paths() -> dict[str, Any]:
    """``/v1/responses``: a Response object, or typed events (``event:``
    names the type its ``data`` carries; no ``[DONE]``); GET one stored."""
    events = {"anyOf": [_ref(model) for model in STREAM_EVENTS]}
    ok = {"description": "the response; with stream=true, server-sent events "
                         "`event: <type>` + `data: <event>`",
          "content": {"application/json": {"schema": _ref(ResponseObject)},
                      "text/event-stream": {"itemSchema": {
                          "type": "object", "required": ["data"],
                          "properties": {"event": {"type": "string"}, "data": {
                              "contentMediaType": "application/json",
                              "contentSchema": events}}}}}}
    path_id = {"name": "response_id", "in": "path", "required": True,
               "schema": {"type": "string"}}
    retrieve = _operation("a stored response", _json(ResponseObject, "the response"),
                          errors=(401, 404))
    delete = _operation("forget a stored response", _json(DeletedResponse, "deleted"),
                        errors=(401, 404))
    cancel = _operation("cancel a background response (kvserve runs none: always 400 or "
                        "404)", _json(ResponseObject, "the cancelled response"),
                        errors=(400, 401, 404))
    items = _operation("a page of a stored response's input items",
                       _json(InputItemList, "the page"), errors=(400, 401, 404))
    items["parameters"] = [path_id, *(
        {"name": name, "in": "query", "required": False, "schema": schema}
        for name, schema in (("limit", {"type": "integer", "minimum": 1, "maximum": 100}),
                             ("order", {"enum": ["asc", "desc"]}),
                             ("after", {"type": "string"})))]
    for operation in (retrieve, delete, cancel):
        operation["parameters"] = [path_id]
    return {"/v1/responses": {"post": _operation("a response (OpenAI's Responses API)", ok,
                                                 ResponsesRequest, (400, 401, 404, 413, 503))},
            "/v1/responses/{response_id}": {"get": retrieve, "delete": delete},
            "/v1/responses/{response_id}/cancel": {"post": cancel},
            "/v1/responses/{response_id}/input_items": {"get": items}}


def _lora_paths() -> dict[str, Any]:
    """The run-time adapter routes: a plain-text ``Success: ...`` line, or an error."""
    def operation(summary: str, body: type[BaseModel], errors: dict[int, str]
                  ) -> dict[str, Any]:
        ok = {"description": "`Success: LoRA adapter '<name>' ...` (plain text)",
              "content": {"text/plain": {"schema": {"type": "string"}}}}
        responses = {"200": ok, **{str(status): _json(ErrorResponse, text)
                                   for status, text in errors.items()}}
        return {"post": {"summary": summary, "responses": responses, "requestBody": {
            "required": True, "content": {"application/json": {"schema": _ref(body)}}}}}

    common = {401: _ERRORS[401], 413: _ERRORS[413],
              503: "loading, draining, or the engine failed during the call"}
    return {
        "/v1/load_lora_adapter": operation(
            "load a PEFT LoRA adapter, served under lora_name", LoadLoRAAdapterRequest,
            {400: "invalid body, a name already served, or an adapter that does not fit "
                  "(the message names the problem)", **common}),
        "/v1/unload_lora_adapter": operation(
            "forget a loaded adapter", UnloadLoRAAdapterRequest,
            {400: "invalid body, or requests still use the adapter",
             404: "no adapter of that name", **common}),
    }


@functools.cache
def openapi_document(lora_updating: bool = False) -> dict[str, Any]:
    """The whole document (built once per form); ``lora_updating``: with the
    adapter routes (``--allow-runtime-lora-updating``)."""
    models = [*_MODELS, *((LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest)
                          if lora_updating else ())]
    _, definitions = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    text = {"description": "", "content": {"text/plain": {"schema": {"type": "string"}}}}
    paths: dict[str, Any] = {
        "/v1/completions": _generation("text completion", CompletionRequest,
                                       CompletionResponse, CompletionResponse),
        "/v1/chat/completions": _generation("chat completion", ChatCompletionRequest,
                                            ChatCompletionResponse, ChatCompletionChunk),
        **_responses_paths(),
        "/v1/models": {"get": _operation("served models and LoRA adapters",
                                         _json(ModelList, "the models"), errors=(401,))},
        "/v1/models/{model_id}": {"get": {
            **_operation("one served model", _json(ModelCard, "the model"), errors=(401, 404)),
            "parameters": [{"name": "model_id", "in": "path", "required": True,
                            "schema": {"type": "string"}}]}},
        "/health": {"get": _operation("liveness: the engine loop runs", _json(Status, "ok"),
                                      errors=(503,))},
        "/ready": {"get": _operation("readiness: loaded, not draining, not stalled",
                                     _json(Status, "ok"), errors=(503,))},
        "/metrics": {"get": {"summary": "Prometheus metrics",
                             "responses": {"200": {**text, "description": "exposition"}}}},
        "/version": {"get": _operation("kvserve's version", _json(Version, "the version"),
                                       errors=(401,))},
        "/tokenize": {"post": _operation("token ids of a prompt or chat",
                                         _json(TokenizeResponse, "the tokens"), TokenizeRequest,
                                         (400, 401, 404, 413, 503))},
        "/detokenize": {"post": _operation("text of token ids",
                                           _json(DetokenizeResponse, "the text"),
                                           DetokenizeRequest, (400, 401, 404, 413, 503))},
        "/tokenizer_info": {"get": _operation("the tokenizer's configuration",
                                              _json(TokenizerInfo, "the configuration"))},
        "/openapi.json": {"get": {"summary": "this document", "responses": {"200": {
            "description": "OpenAPI 3.2", "content": {"application/json": {
                "schema": {"type": "object"}}}}, "401": _json(ErrorResponse, _ERRORS[401])}}},
        **(_lora_paths() if lora_updating else {}),
    }
    return {
        "openapi": "3.2.0",
        "info": {"title": "kvserve", "version": __version__,
                 "description": "OpenAI-compatible completions, chat completions "
                                "and responses"},
        "paths": paths,
        "components": {"schemas": definitions["$defs"], "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}, {}],
    }
