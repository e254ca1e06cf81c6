"""The served OpenAPI document against the real server: it lists every
route the app has, and a bounded schemathesis run (fixed seed, a few
examples per operation, ``max_tokens`` and ``n`` clamped small) finds no
server error, no undocumented status or content type, and no response that
violates its schema; the same for the run-time adapter routes on a server
that has them (``--allow-runtime-lora-updating``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from kvserve.server.api import build_app
from kvserve.server.openapi import openapi_document
from kvserve.server.state import ServerConfig, ServerState
from tests.e2e.conftest import ServerProcess, launch

SCHEMA = schemathesis.openapi.from_dict(openapi_document())
LORA_SCHEMA = schemathesis.openapi.from_dict(openapi_document(lora_updating=True)).include(
    path_regex="lora_adapter")
EXAMPLES_PER_OPERATION = 12
SMALL = {"max_tokens": 4, "max_completion_tokens": 4, "max_output_tokens": 4, "n": 2,
         "min_tokens": 0}
MAX_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def test_the_document_is_served_and_covers_every_route(serve_tiny: ServerProcess) -> None:
    served = httpx.get(serve_tiny.url + "/openapi.json", timeout=10).json()
    assert served == openapi_document()
    app = build_app(ServerState(ServerConfig(served_model_names=["m"])))
    routes = {route.path.replace(":path", "") for route in app.routes}  # type: ignore[attr-defined]
    assert routes == set(served["paths"])
    lora_app = build_app(ServerState(ServerConfig(served_model_names=["m"],
                                                  allow_runtime_lora_updating=True)))
    lora_routes = {route.path.replace(":path", "")
                   for route in lora_app.routes}  # type: ignore[attr-defined]
    assert lora_routes - routes == {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
    assert lora_routes == set(openapi_document(lora_updating=True)["paths"])


@pytest.fixture(scope="module")
def serve_lora(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[ServerProcess]:
    """A server with the run-time adapter routes."""
    server = launch(tiny_model, tmp_path_factory.mktemp("serve-lora") / "server.log", [
        "--enable-lora", "--allow-runtime-lora-updating", "--num-kv-blocks", "64"])
    yield server
    server.stop()


def test_the_adapter_routes_are_served_in_the_document(serve_lora: ServerProcess) -> None:
    served = httpx.get(serve_lora.url + "/openapi.json", timeout=10).json()
    assert served == openapi_document(lora_updating=True)
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= set(served["paths"])


def _clamp(body: Any) -> None:
    """Keep generation cheap: small max_tokens / n, also when left out (a
    value above what is allowed stays, so the 400 paths are still reached)."""
    if not isinstance(body, dict):
        return
    if all(body.get(key) is None for key in MAX_TOKEN_FIELDS):
        # chat's and responses' default is the rest of the context (unknown fields are ignored)
        body["max_tokens"] = body["max_output_tokens"] = SMALL["max_tokens"]
    for key, small in SMALL.items():
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and small < value <= 100:
            body[key] = small


@SCHEMA.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, derandomize=True, deadline=None,
          suppress_health_check=list(HealthCheck))
@pytest.mark.slow
def test_fuzzed_requests_keep_the_contract(case: Any, serve_tiny: ServerProcess) -> None:
    _clamp(case.body)
    case.call_and_validate(base_url=serve_tiny.url, timeout=60, checks=[
        not_a_server_error, status_code_conformance, content_type_conformance,
        response_schema_conformance])


@LORA_SCHEMA.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, derandomize=True, deadline=None,
          suppress_health_check=list(HealthCheck))
@pytest.mark.slow
def test_fuzzed_adapter_calls_keep_the_contract(case: Any, serve_lora: ServerProcess) -> None:
    case.call_and_validate(base_url=serve_lora.url, timeout=60, checks=[
        not_a_server_error, status_code_conformance, content_type_conformance,
        response_schema_conformance])
