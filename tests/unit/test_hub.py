"""Hugging Face hub ids, offline: a cache directory laid out as the hub's own
(``models--org--name/blobs``, ``snapshots/<commit>/`` links into the blobs,
``refs/main``) resolved through the real ``huggingface_hub``; the errors
when a model is not cached, a revision is missing, the hub cannot be
reached (an endpoint on a closed local port: refused at once) or refuses
access; and a generate and a quantize from the cache with ``HF_HOME`` and
``HF_HUB_OFFLINE=1``. No test can reach the network."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvserve.engine.args import EngineArgs
from kvserve.models import hub
from kvserve.models.hub import HubOptions, explain_failure, is_hub_id
from kvserve.models.source import resolve_model_config
from tests.unit.test_cli import REPO_ROOT, assert_one_line_error, cli_env, free_port

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO_ID = "org/tiny-llama"


def write_hub_cache(cache_dir: Path, repo_id: str, source: Path, commit: str = COMMIT,
                    ref: str = "main", skip: tuple[str, ...] = ()) -> Path:
    """Lay ``source``'s files out as ``huggingface_hub`` caches a download;
    returns the snapshot directory."""
    repo = cache_dir / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in sorted(source.iterdir()):
        if file.name in skip:
            continue
        data = file.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / digest).write_bytes(data)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", digest))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def offline_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The hub library in offline mode with an empty cache of its own."""
    from huggingface_hub import constants

    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def unreachable_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The hub library online, but its endpoint a closed local port (refused at once)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")
    return cache


@pytest.mark.parametrize(("text", "expected"), [
    ("Qwen/Qwen2.5-0.5B", True), ("gpt2", True), ("org/name.v1_x", True),
    ("org/name/extra", False), ("/abs/path", False), ("org--x/y", False), ("a/../b", False),
    ("org/", False), ("name-", False), ("", False),
])
def test_hub_id_spelling(text: str, expected: bool) -> None:
    assert is_hub_id(text) is expected


def test_a_cached_model_resolves_offline_to_its_snapshot(
        offline_hub: Path, tiny_checkpoint: Callable[..., Path]) -> None:
    snapshot = write_hub_cache(offline_hub, REPO_ID, tiny_checkpoint("llama", True))
    config, path = resolve_model_config(REPO_ID, HubOptions(), weights=True)
    assert path == snapshot and config.architecture == "LlamaForCausalLM"
    engine = EngineArgs(model=REPO_ID).create_engine_config()
    assert engine.model == REPO_ID and engine.model_path == str(snapshot)
    assert engine.tokenizer_path == str(snapshot)


def test_a_revision_is_a_commit_or_a_ref(offline_hub: Path,
                                         tiny_checkpoint: Callable[..., Path]) -> None:
    write_hub_cache(offline_hub, REPO_ID, tiny_checkpoint("llama", True), ref="v1")
    assert resolve_model_config(REPO_ID, HubOptions(revision="v1"))[1] is not None
    assert resolve_model_config(REPO_ID, HubOptions(revision=COMMIT))[1] is not None
    with pytest.raises(ValueError, match=r"revision 'main'\) is not in the Hugging Face cache"):
        resolve_model_config(REPO_ID)


def test_download_dir_is_the_cache_to_use(offline_hub: Path, tmp_path: Path,
                                          tiny_checkpoint: Callable[..., Path]) -> None:
    other = tmp_path / "elsewhere"
    snapshot = write_hub_cache(other, REPO_ID, tiny_checkpoint("llama", True))
    with pytest.raises(ValueError, match="not in the Hugging Face cache"):
        resolve_model_config(REPO_ID)
    config = EngineArgs(model=REPO_ID, download_dir=str(other)).create_engine_config()
    assert config.model_path == str(snapshot)


def test_not_cached_in_offline_mode_names_the_cache_and_the_variable(offline_hub: Path) -> None:
    with pytest.raises(ValueError) as info:
        EngineArgs(model="org/absent").create_engine_config()
    message = str(info.value)
    assert "'org/absent'" in message and str(offline_hub) in message
    assert "HF_HUB_OFFLINE=1 forbids downloading it" in message


def test_an_unreachable_hub_says_so_without_waiting(unreachable_hub: Path) -> None:
    with pytest.raises(ValueError) as info:
        resolve_model_config("org/absent")
    message = str(info.value)
    assert "could not be downloaded from the Hugging Face hub" in message
    assert "Connection refused" in message and "HF_HUB_OFFLINE=1" in message


def test_an_unreachable_hub_falls_back_to_the_cache(
        unreachable_hub: Path, tiny_checkpoint: Callable[..., Path]) -> None:
    snapshot = write_hub_cache(unreachable_hub, REPO_ID, tiny_checkpoint("llama", True))
    assert resolve_model_config(REPO_ID, weights=True)[1] == snapshot


def test_a_snapshot_without_weights_is_refused_unless_dummy(
        offline_hub: Path, tiny_checkpoint: Callable[..., Path]) -> None:
    write_hub_cache(offline_hub, REPO_ID, tiny_checkpoint("llama", True),
                    skip=("model.safetensors",))
    with pytest.raises(ValueError, match=r"no \*\.safetensors weights"):
        EngineArgs(model=REPO_ID).create_engine_config()
    assert EngineArgs(model=REPO_ID, load_format="dummy").create_engine_config().model_path


def test_a_hub_tokenizer_resolves_too(offline_hub: Path,
                                      tiny_checkpoint: Callable[..., Path]) -> None:
    snapshot = write_hub_cache(offline_hub, "org/tok", tiny_checkpoint("llama", True))
    config = EngineArgs(model=str(tiny_checkpoint("llama")),
                        tokenizer="org/tok").create_engine_config()
    assert config.tokenizer_path == str(snapshot)


def test_revision_token_and_cache_reach_snapshot_download(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        tiny_checkpoint: Callable[..., Path]) -> None:
    import huggingface_hub

    calls: list[dict[str, Any]] = []

    def recording_download(repo_id: str, **kwargs: Any) -> str:
        calls.append({"repo_id": repo_id, **kwargs})
        return str(tiny_checkpoint("llama", True))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording_download)
    EngineArgs(model=REPO_ID, revision="v2", hf_token="hf_secret",
               download_dir=str(tmp_path)).create_engine_config()
    [call] = calls
    assert call["repo_id"] == REPO_ID and call["revision"] == "v2"
    assert call["token"] == "hf_secret" and call["cache_dir"] == str(tmp_path)
    assert "config.json" in call["allow_patterns"] and "*.safetensors" in call["allow_patterns"]
    assert "*.bin" not in call["allow_patterns"]
    assert "hf_secret" not in repr(HubOptions(token="hf_secret"))


def _error(name: str, status: int | None = None) -> Exception:
    class Response:
        status_code = status

    error = type(name, (Exception,), {})("hub says no")
    error.response = Response()  # type: ignore[attr-defined]
    return error


@pytest.mark.parametrize(("error", "fragment"), [
    (_error("GatedRepoError"), "is gated on the Hugging Face hub"),
    (_error("RepositoryNotFoundError"), "a private model needs --hf-token or HF_TOKEN"),
    (_error("RevisionNotFoundError"), "revision 'main' does not exist"),
    (_error("HfHubHTTPError", 401), "refused the token (HTTP 401)"),
])
def test_hub_refusals_say_what_to_do(offline_hub: Path, error: Exception, fragment: str) -> None:
    assert fragment in explain_failure("org/x", HubOptions(), error)


@pytest.mark.slow
def test_generate_from_the_hub_cache_with_hf_home_offline(
        tmp_path: Path, tiny_checkpoint: Callable[..., Path]) -> None:
    env = cli_env(tmp_path)
    write_hub_cache(Path(env["HF_HOME"]) / "hub", REPO_ID, tiny_checkpoint("llama", True))
    command = [sys.executable, "-m", "kvserve.cli", "generate", "--model", REPO_ID,
               "--prompt", "hello", "--max-tokens", "3", "--ignore-eos"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=REPO_ROOT,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("hello") and f"model {REPO_ID}" in proc.stderr
    missing = subprocess.run([*command[:5], "org/absent"], capture_output=True, text=True,
                             timeout=180, cwd=REPO_ROOT, env=env)
    assert_one_line_error(missing, 2, "'org/absent'", "HF_HUB_OFFLINE=1")


@pytest.mark.slow
def test_quantize_reads_a_hub_model_from_the_cache(
        tmp_path: Path, tiny_checkpoint: Callable[..., Path]) -> None:
    env = cli_env(tmp_path)
    write_hub_cache(Path(env["HF_HOME"]) / "hub", REPO_ID, tiny_checkpoint("llama", True))
    output = tmp_path / "int4"
    command = [sys.executable, "-m", "kvserve.cli", "quantize", REPO_ID, "--method", "rtn",
               "--group-size", "32", "--output", str(output)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=REPO_ROOT,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (output / "config.json").is_file() and list(output.glob("*.safetensors"))
    command[4] = "org/absent"
    missing = subprocess.run(command, capture_output=True, text=True, timeout=180,
                             cwd=REPO_ROOT, env=env)
    assert_one_line_error(missing, 2, "'org/absent'", "HF_HUB_OFFLINE=1")


def test_hub_module_needs_no_torch() -> None:
    code = "import sys, kvserve.models.hub, kvserve.models.source; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, cwd=REPO_ROOT)
    assert result.stdout.strip() == "False"
    assert hub.CONFIG_FILES[0] == "config.json"
