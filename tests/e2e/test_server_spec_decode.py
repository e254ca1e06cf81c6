"""``kvserve serve --speculative-config``: the official client gets the same
greedy completion as from a server without speculation, and ``/metrics``
shows the speculative-decoding counters; a bad config stops the server at
start-up with the field named."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from tests.e2e.conftest import MODEL_NAME, ServerProcess

PROMPT = "the quick brown fox"


def complete(server: ServerProcess) -> str:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24,
                                         temperature=0.0, extra_body={"ignore_eos": True})
    return response.choices[0].text


@pytest.mark.slow
@pytest.mark.parametrize("core", ["inproc", "process"])
def test_speculative_server_matches_and_counts(
        start_server: Callable[..., ServerProcess], serve_tiny: ServerProcess,
        tiny_model: Path, core: str) -> None:
    """Also with the engine core in its own process (its counters reach /metrics)."""
    config = {"method": "draft_model", "model": str(tiny_model), "num_speculative_tokens": 3,
              "auto_disable": False}
    server = start_server(["--speculative-config", json.dumps(config), "--engine-core", core])
    assert complete(server) == complete(serve_tiny)
    drafted = server.metric("kvserve:spec_decode_num_draft_tokens_total")
    assert drafted > 0
    assert server.metric("kvserve:spec_decode_num_accepted_tokens_total") == drafted
    assert server.metric("kvserve:spec_decode_num_accepted_tokens_per_pos_total",
                         'position="0"') > 0


def test_bad_speculative_config_stops_the_server(
        start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(["--speculative-config",
                           '{"method": "ngram", "num_speculative_tokens": 99}'],
                          wait_ready=False)
    assert server.wait_exit(60) not in (None, 0)
    assert "num_speculative_tokens=99" in server.log()
