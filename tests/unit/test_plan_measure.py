"""``kvserve plan --measure`` / ``--sweep`` / ``--calibrate`` / ``--fit`` on the CPU
with a tiny random checkpoint: what was timed is what the plan describes
(every request of the batch in every timed step, the stated mean context,
the exact prompt), spreads, MBU and MFU by their formulas, and a measurement
that times a smaller batch fails. Speed is never asserted here."""

from __future__ import annotations

import gc
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvserve.bench.plan_cli import main
from kvserve.bench.plan_measure import MeasurementError, PlanMeasurer
from kvserve.bench.plan_runs import _engine_length
from kvserve.plan.compare import Comparison

BATCHES, CONTEXTS, PROMPTS, STEPS, REPEATS = (1, 3), (24, 40), (8, 33), 6, 2


@pytest.fixture(autouse=True)
def _thawed_heap() -> Iterator[None]:
    """The measurement freezes the heap of the process it runs in, pytest's here: thaw it."""
    gc.unfreeze()
    yield
    gc.unfreeze()


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def sweep(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("sweep") / "sweep.json"
    rc = main(["--model", str(checkpoint), "--gpu", "h100", "--measure", "--sweep",
               "--device", "cpu", "--sweep-batches", *map(str, BATCHES),
               "--sweep-contexts", *map(str, CONTEXTS), "--sweep-prompts", *map(str, PROMPTS),
               "--measure-steps", str(STEPS), "--measure-repeats", str(REPEATS),
               "--output-json", str(path)])
    gc.unfreeze()
    assert rc == 0
    data: dict[str, Any] = json.loads(path.read_text())
    data["path"] = str(path)
    return data


@pytest.mark.slow
def test_every_timed_step_decodes_the_whole_batch_at_the_stated_context(
    sweep: dict[str, Any]
) -> None:
    decode = [p for p in sweep["measured"] if p["kind"] == "decode"]
    assert {(p["batch"], p["context"]) for p in decode} == {
        (b, c) for b in BATCHES for c in CONTEXTS}
    for point in decode:
        measured = point["measured"]
        assert measured["batch_timed_min"] == measured["batch_timed_max"] == point["batch"]
        assert abs(measured["mean_context_timed"] - point["context"]) <= 1.0
        step = measured["step"]
        assert step["count"] == STEPS
        assert step["min"] <= step["p10"] <= step["median"] <= step["p90"] <= step["max"]
        assert point["measured_ms"] == step["median"]
        assert point["error"] == pytest.approx(point["predicted_ms"] / step["median"] - 1)


@pytest.mark.slow
def test_prefill_is_timed_at_the_stated_prompt(sweep: dict[str, Any]) -> None:
    prefill = [p for p in sweep["measured"] if p["kind"] == "prefill"]
    assert [p["context"] for p in prefill] == list(PROMPTS)
    for point in prefill:
        assert point["measured"]["prompt"] == point["context"]
        assert point["measured"]["ttft"]["count"] == REPEATS
    assert set(sweep["worst_error"]) == {"decode", "prefill"}


@pytest.mark.slow
def test_mbu_and_mfu_follow_their_formulas(sweep: dict[str, Any], checkpoint: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    run = sweep["run"]
    assert run["device"] == "cpu" and run["element_bytes"] == 4  # float32 on the CPU
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    kv_per_token = 4 * 2 * layers * config["num_key_value_heads"] * (
        hidden // config["num_attention_heads"])
    params = sweep["params"]
    weight_read = 4 * (params - config["vocab_size"] * hidden)  # untied: no embedding read
    for point in sweep["measured"]:
        if point["kind"] != "decode":
            continue
        step_s = point["measured_ms"] / 1e3
        context = round(point["measured"]["mean_context_timed"])
        step_bytes = weight_read + kv_per_token * point["batch"] * context
        assert point["mbu"] == pytest.approx(step_bytes / step_s / (run["copy_gb_s"] * 1e9))
        assert point["mfu"] == pytest.approx(
            2 * params * point["batch"] / step_s / (run["matmul_tflop_s"] * 1e12))
        assert point["mbu"] < 1.0


@pytest.mark.slow
def test_a_smaller_timed_batch_fails_the_measurement(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bug of issue 29: requests ending before the timed steps, so fewer
    than the plan's batch were timed. Here one request of four is aborted
    after the warm-up; the measurement must refuse to report."""
    measurer = PlanMeasurer.start(str(checkpoint), device="cpu", dtype="auto", max_batch=4,
                                  max_model_len=64, steps=STEPS, repeats=1)
    good = measurer.decode(4, 24)
    assert good.batch_timed_min == good.batch_timed_max == 4
    warm = PlanMeasurer._warm

    def warm_then_lose_one(self: PlanMeasurer, tracked: Any, batch: int, first: float) -> None:
        warm(self, tracked, batch, first)
        self.engine.abort_request(next(iter(tracked.tokens)))

    monkeypatch.setattr(PlanMeasurer, "_warm", warm_then_lose_one)
    with pytest.raises(MeasurementError, match="timed a batch of 3 to 3 requests"):
        measurer.decode(4, 24)
    monkeypatch.undo()
    assert measurer.decode_fits(5, 24) is not None  # more than max_num_seqs: skipped, not timed
    assert "does not fit" in (measurer.decode_fits(4, 60) or "")
    assert measurer.decode(2, 24).batch_timed_max == 2  # the engine is still usable


def test_the_engine_holds_requests_that_ran_ahead_during_admission() -> None:
    """Batch 128 at context 1,024: prefilling takes 16 steps of 8,192 tokens,
    and the first requests admitted decode through them, so they reach
    1,024 + 32 / 2 + 2 + 16 tokens. An engine sized for 1,024 + 32 / 2 + 4
    skipped the point as too big for its pool (the GPU test of issue 29)."""
    setup: Any = SimpleNamespace(model=SimpleNamespace(max_position_embeddings=32768))
    point: Any = SimpleNamespace(batch=128, context=1024)
    assert _engine_length(setup, [point], [], 32) == 1024 + 16 + 2 + 16
    small: Any = SimpleNamespace(batch=4, context=24)
    prefill: Any = SimpleNamespace(prompt=100)
    assert _engine_length(setup, [small], [prefill], 6) == 101


@pytest.mark.slow
def test_fit_reads_a_measured_sweep(sweep: dict[str, Any], tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--fit", sweep["path"]]) == 0
    out = capsys.readouterr().out
    assert "worst |error|" in out and '"h100-sxm": StepConstants(' in out
    assert main(["--fit", sweep["path"], "--json"]) == 0
    text = capsys.readouterr().out
    fitted = json.loads(text)
    assert fitted["cost_after"] <= fitted["cost_before"]  # never worse than the seeds
    fit_path = tmp_path / "fit.json"
    fit_path.write_text(text)
    assert main(["--model", "llama-3-8b", "--gpu", "h100", "--constants", str(fit_path),
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["inputs"]["constants"] == pytest.approx(fitted["constants"])
    assert str(fit_path) in plan["constants_source"]


@pytest.mark.slow
def test_sweep_plot_draws_predicted_against_measured(sweep: dict[str, Any],
                                                     tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from kvserve.plan.plot import write_sweep_plot

    points = [Comparison(**p) for p in sweep["measured"]]
    path = tmp_path / "sweep.png"
    write_sweep_plot(str(path), points, "tiny llama on the CPU")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_calibrate_caches_the_card_for_later_plans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["--calibrate", "--device", "cpu"]) == 0
    saved = json.loads((tmp_path / "kvserve" / "calibration.json").read_text())
    (entry,) = saved.values()
    assert entry["device"] == "cpu" and entry["gpu"] is None
    assert entry["copy_gb_s"] > 0 and entry["matmul_tflop_s"] > 0 and entry["memory_gb"] > 0
    capsys.readouterr()
    assert main(["--model", "llama-3-8b", "--gpu", "local", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["copy_gb_s"] == pytest.approx(entry["copy_gb_s"])
    assert "calibrated on this machine" in plan["rates_source"]


def test_measuring_what_cannot_run_names_the_flag(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv, flag in ((["--tp", "2"], "--tp"),
                       (["--context", "126"], "--context")):
        rc = main(["--model", str(checkpoint), "--gpu", "h100", "--measure", "--device", "cpu",
                   "--prompt", "8", *argv])
        captured = capsys.readouterr()
        assert rc == 2, argv
        assert flag in captured.err and captured.out == ""
