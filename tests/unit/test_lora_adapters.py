"""Many adapters on CPU: the host cache (``max_cpu_loras``) and the device slots
evict and reload adapters without changing a token; adapters are removed
only when no request uses them and their ids are never handed to another
adapter; the server loads and unloads adapters at run time (vLLM's routes,
off unless enabled, behind the API key) and counts requests and tokens per
adapter in /metrics."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import LoRAConfig
from kvserve.engine.args import EngineArgs
from kvserve.engine.client import ThreadedEngineClient
from kvserve.engine.llm_engine import LLMEngine
from kvserve.envs import FaultInjection
from kvserve.lora import LoRARequest
from kvserve.server.api import build_app
from kvserve.server.faults import inject_faults
from kvserve.server.state import ServerConfig, ServerState
from tests.conftest import make_lora_adapter
from tests.unit.test_lora import BLOCK_SIZE, COMPLETION, PROMPTS, _offline_text, call, token_ids

GREEDY_8 = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[Path, list[LoRARequest]]:
    """A tiny Llama (with a tokenizer) and three random adapters of different ranks."""
    base = tiny_checkpoint("llama", with_tokenizer=True)
    root = tmp_path_factory.mktemp("adapters")
    loras = [LoRARequest(f"ad{i}", i + 1, str(make_lora_adapter(
        base, root / f"ad{i}", rank=rank, alpha=2.0 * rank, seed=10 + i)))
        for i, rank in enumerate((8, 4, 2))]
    return base, loras


def test_max_cpu_loras_below_max_loras_is_refused() -> None:
    with pytest.raises(ValueError, match=r"max_cpu_loras=1 must be >= max_loras=2"):
        LoRAConfig(max_loras=2, max_cpu_loras=1)


def test_evicted_and_reloaded_adapters_give_the_same_tokens(
        adapters: tuple[Path, list[LoRARequest]]) -> None:
    base, loras = adapters
    roomy = LLM(model=str(base), enable_lora=True, max_loras=3, block_size=BLOCK_SIZE,
                num_kv_blocks=128, enable_prefix_caching=False)
    expected = {lora.lora_int_id: token_ids(roomy, [PROMPTS[1]], lora, GREEDY_8)[0]
                for lora in loras}
    tight = LLM(model=str(base), enable_lora=True, max_loras=1, max_cpu_loras=1,
                block_size=BLOCK_SIZE, num_kv_blocks=128, enable_prefix_caching=False)
    manager = tight.engine.core.executor.lora_manager  # type: ignore[attr-defined]
    order = [loras[0], loras[1], loras[0], loras[2], loras[1], loras[0]]
    for lora in order:
        assert token_ids(tight, [PROMPTS[1]], lora, GREEDY_8)[0] == expected[lora.lora_int_id]
    assert manager.num_slot_loads == len(order)  # one slot: every switch loads
    assert manager.num_disk_loads > len(loras)  # one host copy: read again from disk
    assert len(manager.host) == 1
    # all three together need three slots: they run one adapter at a time, same tokens
    together = token_ids(tight, [PROMPTS[1]] * 3, loras, GREEDY_8)
    assert together == [expected[lora.lora_int_id] for lora in loras]


def test_an_adapter_read_again_from_disk_does_not_block_the_steps(
        adapters: tuple[Path, list[LoRARequest]], monkeypatch: pytest.MonkeyPatch) -> None:
    """An adapter the host cache dropped is read on the loader thread: while
    the (slow) read runs, another request keeps getting a token each step and
    the adapter's request waits; once it lands the request gets its tokens."""
    base, loras = adapters
    roomy = LLM(model=str(base), enable_lora=True, max_loras=1, block_size=BLOCK_SIZE,
                num_kv_blocks=128, enable_prefix_caching=False)
    expected = token_ids(roomy, [PROMPTS[1]], loras[0], GREEDY_8)[0]
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(base), enable_lora=True, max_loras=1, max_cpu_loras=1, block_size=BLOCK_SIZE,
        num_kv_blocks=128, enable_prefix_caching=False))
    manager = engine.core.executor.lora_manager  # type: ignore[attr-defined]
    engine.add_lora(loras[0])
    engine.add_lora(loras[1])  # the host cache keeps this one only
    assert list(manager.host) == [loras[1].lora_int_id]
    started, disk_ready = threading.Event(), threading.Event()
    read = manager._read

    def slow_read(request: LoRARequest) -> object:
        started.set()
        assert disk_ready.wait(10)
        return read(request)

    monkeypatch.setattr(manager, "_read", slow_read)
    other = engine.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=40,
                                                          ignore_eos=True))
    waiting = engine.add_request(PROMPTS[1], GREEDY_8, lora_request=loras[0])
    produced: dict[str, list[int]] = {other: [], waiting: []}
    for _ in range(5):
        start = time.perf_counter()
        for output in engine.step():
            produced[output.request_id] = output.outputs[0].token_ids
        assert time.perf_counter() - start < 5  # no step waits for the disk
    assert started.is_set() and len(produced[other]) == 5 and produced[waiting] == []
    disk_ready.set()
    while engine.has_unfinished_requests():
        for output in engine.step():
            produced[output.request_id] = output.outputs[0].token_ids
    assert produced[waiting] == expected
    assert manager.num_blocking_reads == 0


def test_remove_lora_frees_the_adapter_and_retires_its_id(
        adapters: tuple[Path, list[LoRARequest]]) -> None:
    base, loras = adapters
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(base), enable_lora=True,
                                                   max_loras=2, num_kv_blocks=64))
    engine.add_lora(loras[0])
    request_id = engine.add_request(PROMPTS[0], GREEDY_8, lora_request=loras[0])
    with pytest.raises(ValueError, match=r"lora_int_id=1: 1 unfinished requests use"):
        engine.remove_lora(loras[0].lora_int_id)
    engine.abort_request(request_id)
    assert engine.remove_lora(loras[0].lora_int_id)
    assert not engine.remove_lora(loras[0].lora_int_id)  # unknown now
    manager = engine.core.executor.lora_manager  # type: ignore[attr-defined]
    assert loras[0].lora_int_id not in manager.requests and not manager.slots
    other = LoRARequest("other", loras[0].lora_int_id, loras[1].lora_path)
    with pytest.raises(ValueError, match=r"lora_int_id=1 belonged to the removed adapter 'ad0'"):
        engine.add_lora(other)
    engine.add_lora(loras[0])  # the same adapter may come back under its id


# ------------------------------------------------------------ server


@dataclass
class Server:
    state: ServerState
    engine: LLMEngine
    loras: list[LoRARequest]


def _server(base: Path, loras: list[LoRARequest], allow: bool, api_keys: list[str],
            faults: FaultInjection | None = None
            ) -> tuple[ServerState, ThreadedEngineClient, LLMEngine]:
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(base), enable_lora=True,
                                                   max_loras=2, max_num_seqs=4,
                                                   num_kv_blocks=64, max_lora_rank=8))
    inject_faults(engine.core.executor, faults or FaultInjection())
    client = ThreadedEngineClient(engine)
    config = ServerConfig(["tiny"], lora_requests=list(loras), api_keys=api_keys,
                          allow_runtime_lora_updating=allow)
    return ServerState(config, client=client), client, engine


@pytest.fixture(scope="module")
def server(adapters: tuple[Path, list[LoRARequest]]) -> Iterator[Server]:
    base, loras = adapters
    state, client, engine = _server(base, [], allow=True, api_keys=[])
    yield Server(state, engine, loras)
    client.shutdown()


def _load(state: ServerState, name: str, path: str, **kwargs: object) -> tuple[int, str]:
    response = call(state, "POST", "/v1/load_lora_adapter",
                    json={"lora_name": name, "lora_path": path}, **kwargs)
    return response.status_code, response.text


def test_server_loads_serves_and_unloads_adapters(server: Server) -> None:
    state, lora = server.state, server.loras[1]
    expected = _offline_text(LLMEngine.from_engine_args(EngineArgs(
        model=str(server.engine.config.model_path), enable_lora=True,
        num_kv_blocks=64)), LoRARequest("x", 9, lora.lora_path))
    assert _load(state, "mine", lora.lora_path) == (
        200, "Success: LoRA adapter 'mine' added successfully.")
    cards = call(state, "GET", "/v1/models").json()["data"]
    assert [c["id"] for c in cards] == ["tiny", "mine"] and cards[1]["parent"] == "tiny"
    result = call(state, "POST", "/v1/completions", json={**COMPLETION, "model": "mine"})
    assert result.status_code == 200 and result.json()["choices"][0]["text"] == expected
    status, text = _load(state, "mine", lora.lora_path)
    assert status == 400 and "The lora adapter 'mine' has already been loaded." in text
    metrics = call(state, "GET", "/metrics").text
    assert 'kvserve:lora_requests_total{lora_name="mine",model_name="tiny"} 1.0' in metrics
    assert (f'kvserve:lora_generation_tokens_total{{lora_name="mine",model_name="tiny"}} '
            f'{COMPLETION["max_tokens"]}.0') in metrics
    assert (f'kvserve:lora_prompt_tokens_total{{lora_name="mine",model_name="tiny"}} '
            f'{len(COMPLETION["prompt"])}.0') in metrics

    unload = call(state, "POST", "/v1/unload_lora_adapter", json={"lora_name": "mine"})
    assert unload.status_code == 200
    assert unload.text == "Success: LoRA adapter 'mine' removed successfully."
    gone = call(state, "POST", "/v1/completions", json={**COMPLETION, "model": "mine"})
    assert gone.status_code == 404
    again = call(state, "POST", "/v1/unload_lora_adapter", json={"lora_name": "mine"})
    assert again.status_code == 404
    assert again.json()["error"]["message"] == "The lora adapter 'mine' cannot be found."
    # loaded again: a fresh id, the same tokens
    assert _load(state, "mine", lora.lora_path)[0] == 200
    assert state.config.lora_request("mine").lora_int_id > 1  # type: ignore[union-attr]
    result = call(state, "POST", "/v1/completions", json={**COMPLETION, "model": "mine"})
    assert result.json()["choices"][0]["text"] == expected


def test_server_refuses_bad_adapters_and_keeps_serving(server: Server, tmp_path: Path) -> None:
    state = server.state
    big = make_lora_adapter(Path(server.engine.config.model_path), tmp_path / "big",
                            rank=16)
    status, text = _load(state, "big", str(big))
    assert status == 400 and "r=16 exceeds max_lora_rank=8" in text
    status, text = _load(state, "nowhere", str(tmp_path / "missing"))
    assert status == 400 and "is not a directory" in text
    missing = call(state, "POST", "/v1/load_lora_adapter", json={"lora_name": "x"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
    assert call(state, "GET", "/v1/models").json()["data"][0]["id"] == "tiny"
    assert "big" not in [c["id"] for c in call(state, "GET", "/v1/models").json()["data"]]
    result = call(state, "POST", "/v1/completions", json={**COMPLETION, "model": "tiny"})
    assert result.status_code == 200


def test_runtime_loading_is_off_unless_enabled_and_needs_the_api_key(
        adapters: tuple[Path, list[LoRARequest]]) -> None:
    base, loras = adapters
    state, client, _ = _server(base, [], allow=False, api_keys=[])
    try:
        assert _load(state, "a", loras[0].lora_path)[0] == 404
    finally:
        client.shutdown()
    state, client, _ = _server(base, [], allow=True, api_keys=["secret"])
    try:
        assert _load(state, "a", loras[0].lora_path)[0] == 401
        assert _load(state, "a", loras[0].lora_path,
                     headers={"Authorization": "Bearer secret"})[0] == 200
    finally:
        client.shutdown()


@pytest.mark.parametrize("route", ["load", "unload"])
def test_adapter_calls_queued_when_the_engine_dies_fail_at_once(
        adapters: tuple[Path, list[LoRARequest]], route: str) -> None:
    """A load or unload queued behind a step that raises gets a 503 naming the
    failure (it used to wait forever: the dead loop never ran it)."""
    base, loras = adapters
    state, client, _ = _server(base, [], allow=True, api_keys=[],
                               faults=FaultInjection(raise_on_step=1, step_delay_s=1.0))
    if route == "unload":
        state.config.lora_requests.append(loras[0])
    body = ({"lora_name": "late", "lora_path": loras[1].lora_path} if route == "load"
            else {"lora_name": loras[0].lora_name})

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_app(state), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvserve") as http:
            completion = asyncio.create_task(http.post("/v1/completions", json=COMPLETION))
            while client.engine.core.num_steps == 0 and not client.engine.has_unfinished_requests():
                await asyncio.sleep(0.01)  # the first (slow, then failing) step is under way
            response = await http.post(f"/v1/{route}_lora_adapter", json=body, timeout=30)
            assert (await completion).status_code == 500
            return response

    try:
        response = asyncio.run(asyncio.wait_for(go(), 20))
    finally:
        client.shutdown(timeout_s=1)
    assert response.status_code == 503
    message = response.json()["error"]["message"]
    assert "the engine failed" in message and "injected fault: forward 1 raised" in message
    assert [lora.lora_name for lora in state.config.lora_requests] == (
        [] if route == "load" else [loras[0].lora_name])


# ------------------------------------------------------------ benchmark


def _bench(argv: list[str], tmp_path: Path) -> dict[str, object]:
    import gc
    import json

    from kvserve.cli import main

    path = tmp_path / "result.json"
    try:
        assert main(["bench", *argv, "--device", "cpu", "--disable-tqdm",
                     "--output-json", str(path)]) == 0
    finally:
        gc.unfreeze()  # a benchmark freezes the heap of its process, pytest's here
    result: dict[str, object] = json.loads(path.read_text())
    return result


def test_bench_runs_random_adapters_round_robin(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve.bench import lora as bench_lora

    made: list[list[LoRARequest]] = []
    original = bench_lora.round_robin

    def recording(loras: list[LoRARequest], num: int) -> list[LoRARequest | None] | None:
        made.append(list(loras))
        return original(loras, num)

    monkeypatch.setattr(bench_lora, "round_robin", recording)
    result = _bench(["throughput", "--num-prompts", "3", "--max-input-len", "16",
                     "--max-output-len", "4", "--num-loras", "2", "--lora-rank", "24"], tmp_path)
    assert result["num_loras"] == 2 and result["lora_rank"] == 24
    assert result["total_output_tokens"] == 12
    engine_args = result["engine_args"]
    assert isinstance(engine_args, dict)
    assert engine_args["enable_lora"] and engine_args["max_lora_rank"] == 24
    assert [lora.lora_name for lora in made[0]] == ["bench-lora-0", "bench-lora-1"]
    assert not Path(made[0][0].lora_path).exists()  # the temporary adapters are gone
    result = _bench(["latency", "--input-len", "8", "--output-len", "4", "--batch-size", "2",
                     "--num-iters", "1", "--num-iters-warmup", "0", "--num-loras", "1",
                     "--lora-rank", "4", "--lora-targets", "q_proj", "v_proj"], tmp_path)
    assert result["num_loras"] == 1 and result["lora_targets"] == ["q_proj", "v_proj"]


def test_bench_lora_flags_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    from kvserve.cli import main

    for flags, message in ((["--num-loras", "-1"], "--num-loras=-1 is invalid"),
                           (["--lora-rank", "0"], "--lora-rank=0 is invalid")):
        assert main(["bench", "throughput", "--device", "cpu", *flags]) == 2
        assert message in capsys.readouterr().err
