"""``kvserve plan``: the issue's worked examples, parameter counts, roofline
bounds, JSON / table / plot output and flag errors. CPU only, no weights."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvserve.bench.plan_cli import add_plan_parser, main
from kvserve.config import ModelConfig
from kvserve.models.presets import get_preset
from kvserve.param_count import count_params
from kvserve.plan import fit, step_model
from kvserve.plan import plot as plot_module
from kvserve.plan.counts import Hardware, PlanError, PlanInputs, decode_cost, weight_bytes
from kvserve.plan.gpus import COPY_SHARE_OF_SPEC, GPUS, get_gpu
from kvserve.plan.planner import compute_plan
from kvserve.plan.utilization import mbu, mfu

PLAN_KEYS = {
    "params", "weight_bytes", "kv_bytes_per_token", "kv_bytes_per_request", "kv_bytes_total",
    "fits", "max_batch_at_context", "max_context_at_batch", "kv_tokens_gpu", "kv_tokens_host",
    "decode_ms_per_step",
    "decode_tokens_per_s", "decode_tokens_per_s_per_request", "prefill_ms",
    "roofline_decode_ms_per_step", "roofline_prefill_ms", "decode_breakdown_ms",
    "prefill_breakdown_ms", "arithmetic_intensity_decode", "ridge_point", "bound", "e2e_ms",
    "copy_gb_s", "matmul_tflop_s", "rates_source", "constants_source",
    "spec_tokens_per_step", "spec_speedup", "spec_tokens_per_step_iid", "spec_speedup_iid",
    "notes",
}
SPEC_KEYS = {"spec_tokens_per_step", "spec_speedup", "spec_tokens_per_step_iid",
             "spec_speedup_iid"}


def _model(name: str) -> ModelConfig:
    return ModelConfig.from_hf_config(get_preset(name))


def _plan(name: str, gpu: str = "h100-sxm", **inputs: Any) -> Any:
    weights = inputs.get("weights", "bf16")
    hardware = Hardware.from_gpu(get_gpu(gpu), weights)
    return compute_plan(_model(name), hardware, PlanInputs(**inputs))


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse errors
        rc = int(e.code or 0)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _write_config(directory: Path, **overrides: Any) -> Path:
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
        "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
    }
    config.update(overrides)
    config = {k: v for k, v in config.items() if v is not None}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


# -- the worked examples ----------------------------------------------------------


def test_kv_32_layers_32_kv_heads_fp16_at_4096(tmp_path: Path) -> None:
    plan = _plan("llama-2-7b", context=4096, kv_dtype="fp16")
    assert plan.kv_bytes_per_request == pytest.approx(2_147_483_648, rel=0.01)
    model_dir = _write_config(tmp_path / "m")
    model = ModelConfig.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    hardware = Hardware.from_gpu(get_gpu("h100-sxm"))
    from_dir = compute_plan(model, hardware, PlanInputs(context=4096, kv_dtype="fp16"))
    assert from_dir.kv_bytes_per_request == 2_147_483_648


def test_kv_llama_2_70b_bf16() -> None:
    plan = _plan("llama-2-70b", context=4096)
    assert plan.kv_bytes_per_request == pytest.approx(1_342_177_280, rel=0.01)
    # 171.8 GB is batch 64 x 32,768 tokens per GPU at --tp 4 (the whole model needs
    # 4 x as much, 687.2 GB); the same bytes as batch 64 x 8,192 on one GPU.
    per_gpu = _plan("llama-2-70b", context=32768, batch=64, tp=4)
    assert per_gpu.kv_bytes_total / 1e9 == pytest.approx(171.8, rel=0.01)
    whole = _plan("llama-2-70b", context=32768, batch=64)
    assert whole.kv_bytes_total == 4 * per_gpu.kv_bytes_total
    assert _plan("llama-2-70b", context=8192, batch=64).kv_bytes_total / 1e9 == pytest.approx(
        171.8, rel=0.01)


def test_h100_sxm_ridge_point() -> None:
    assert _plan("llama-3-8b").ridge_point == pytest.approx(295, rel=0.01)


def test_speculative_tokens_and_speedup() -> None:
    plan = _plan("llama-3-8b", spec_k=4, spec_alpha=0.8, spec_cost_ratio=0.11)
    assert plan.spec_tokens_per_step == pytest.approx(4.2, rel=0.01)
    assert plan.spec_speedup == pytest.approx(2.92, rel=0.01)
    assert _plan("llama-3-8b").spec_speedup is None


# -- parameters and bytes -----------------------------------------------------------------


@pytest.mark.parametrize(("name", "expected"), [("llama-3-8b", 8.03e9), ("qwen2.5-7b", 7.62e9)])
def test_param_counts(name: str, expected: float) -> None:
    assert count_params(_model(name)).total == pytest.approx(expected, rel=0.01)


def test_int4_quantizes_only_the_decoder_linears() -> None:
    params = count_params(_model("llama-3-8b"))
    int4 = weight_bytes(params, PlanInputs(weights="int4"))
    assert int4 == params.linear * 0.5 + (params.total - params.linear) * 2
    assert weight_bytes(params, PlanInputs(weights="bf16")) == params.total * 2


def test_tp_splits_weights_and_replicates_kv_heads_below_tp() -> None:
    one = _plan("llama-3-8b")
    eight = _plan("llama-3-8b", tp=8)
    norms = (32 * 2 * 4096 + 4096) * 2  # whole on every GPU
    assert eight.weight_bytes == (one.weight_bytes - norms) / 8 + norms
    assert eight.kv_bytes_per_token == one.kv_bytes_per_token // 8
    # 8 KV heads on 16 GPUs: each keeps one whole head, of the cache and of
    # the k and v projections; the rest halves again
    sixteen = _plan("llama-3-8b", tp=16)
    assert sixteen.kv_bytes_per_token == eight.kv_bytes_per_token
    kv_proj = 32 * 2 * 4096 * 128 * 2
    assert sixteen.weight_bytes == (eight.weight_bytes - norms - kv_proj) / 2 + norms + kv_proj
    with pytest.raises(ValueError, match=r"tp=3 does not split this model: "
                       r"num_attention_heads=32 is not divisible by it"):
        count_params(_model("llama-3-8b"), 3)
    with pytest.raises(ValueError, match=r"tp=0 does not split this model: a size must be"):
        count_params(_model("llama-3-8b"), 0)
    with pytest.raises(ValueError, match=r"params counted for tp=1 but the plan is for --tp 8"):
        weight_bytes(count_params(_model("llama-3-8b")), PlanInputs(tp=8))


def test_moe_counts_all_experts_for_bytes_and_active_ones_for_flops() -> None:
    base = get_preset("llama-2-7b")
    dense = ModelConfig.from_hf_config(base)
    moe = ModelConfig.from_hf_config({**base, "num_local_experts": 8, "num_experts_per_tok": 2})
    mlp = 32 * 3 * 4096 * 11008
    assert count_params(moe).total - count_params(dense).total == 7 * mlp + 32 * 4096 * 8
    ratio = decode_cost(moe, PlanInputs(context=1)).flops / decode_cost(
        dense, PlanInputs(context=1)).flops
    assert 1.5 < ratio < 2.0  # two experts run, not eight


def test_compute_rate_follows_weights() -> None:
    h100, a100 = get_gpu("h100-sxm"), get_gpu("a100-80gb")
    assert Hardware.from_gpu(h100, "fp8").flops_s == 1979e12
    assert Hardware.from_gpu(a100, "fp8").flops_s == 312e12  # no FP8 on Ampere
    assert Hardware.from_gpu(a100, "int8").flops_s == 624e12
    assert Hardware.from_gpu(h100, "int4").flops_s == 989e12
    assert Hardware.from_gpu(h100, "bf16", flops_tflop_s=100).flops_s == 100e12


def test_gpu_table() -> None:
    for name in ("h100-sxm", "h100-pcie", "h200", "a100-80gb", "a100-40gb", "l40s",
                 "rtx-4090", "rtx-4000-ada", "rtx-3080", "b200"):
        assert name in GPUS
    assert get_gpu("A100-80GB").bandwidth_gb_s == 2039
    assert get_gpu("rtx-4000-ada").bandwidth_gb_s == 432
    assert get_gpu("rtx-3080").bandwidth_gb_s == 760


# -- roofline -----------------------------------------------------------------------------


def test_decode_memory_bound_at_batch_1_compute_bound_at_large_batch() -> None:
    small = _plan("llama-3-8b", batch=1, context=1024)
    assert small.bound == "memory"
    assert small.arithmetic_intensity_decode < small.ridge_point
    large = _plan("llama-3-8b", batch=1024, context=128)
    assert large.bound == "compute"
    assert large.arithmetic_intensity_decode > large.ridge_point
    assert large.decode_tokens_per_s > 100 * small.decode_tokens_per_s


def test_fit_and_limits_are_consistent() -> None:
    plan = _plan("llama-3-8b", batch=8, context=8192)
    assert plan.fits
    at_limit = _plan("llama-3-8b", batch=plan.max_batch_at_context, context=8192)
    assert at_limit.fits
    assert not _plan("llama-3-8b", batch=plan.max_batch_at_context + 1, context=8192).fits
    assert not _plan("llama-3-8b", batch=8, context=plan.max_context_at_batch + 1).fits
    assert not _plan("llama-2-70b", gpu="a100-40gb").fits


def test_host_kv_tier_adds_the_tokens_it_holds_per_gpu() -> None:
    plain = _plan("llama-3-8b")
    tiered = _plan("llama-3-8b", kv_offload_gb=128.0)
    per_token = 32 * 2 * 8 * 128 * 2  # layers x K,V x KV heads x head_dim x bf16
    assert plain.kv_tokens_host == 0 and tiered.kv_tokens_gpu == plain.kv_tokens_gpu
    assert tiered.kv_tokens_host == 128_000_000_000 // per_token
    # two GPUs: half the host memory each, for half of each token's KV heads
    assert _plan("llama-3-8b", kv_offload_gb=128.0, tp=2).kv_tokens_host == (
        64_000_000_000 // (per_token // 2))
    with pytest.raises(PlanError, match="--kv-offload-gb"):
        PlanInputs(kv_offload_gb=-1.0)


def test_e2e_is_prefill_plus_output_steps() -> None:
    plan = _plan("llama-3-8b", prompt=2048, output=100, context=2148)
    assert plan.e2e_ms == pytest.approx(plan.prefill_ms + 100 * plan.decode_ms_per_step)
    # a 2048-token prefill on an H100 is compute-bound: 2 x params x tokens / peak
    assert plan.roofline_prefill_ms == pytest.approx(2 * 8.03e9 * 2048 / 989e12 * 1e3, rel=0.1)
    assert plan.prefill_ms > plan.roofline_prefill_ms  # the engine never beats the bound


# -- the command --------------------------------------------------------------------------


def test_json_has_every_key_and_the_inputs(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(["--model", "llama-3-8b", "--gpu", "h100-sxm", "--json",
                       "--spec-k", "4", "--spec-alpha", "0.8", "--spec-cost-ratio", "0.11"], capsys)
    assert rc == 0
    data = json.loads(out)
    assert set(data) == PLAN_KEYS | {"inputs"}
    assert data["inputs"]["gpu"] == "h100-sxm"
    assert data["inputs"]["memory_utilization"] == 0.9
    assert data["bound"] in ("memory", "compute")
    assert isinstance(data["fits"], bool)
    assert data["spec_speedup"] == pytest.approx(2.92, rel=0.01)
    assert any(note.startswith("spec_tokens_per_step and spec_speedup are upper bounds")
               for note in data["notes"])


def test_table_shows_every_key(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    model_dir = _write_config(tmp_path / "m")
    rc, out, _ = _run(["--model", str(model_dir), "--gpu", "rtx-4090", "--context", "4096",
                       "--kv-dtype", "fp16"], capsys)
    assert rc == 0
    shown_otherwise = {"decode_breakdown_ms", "prefill_breakdown_ms", "copy_gb_s",
                       "matmul_tflop_s", "rates_source", "constants_source", "notes"}
    for key in PLAN_KEYS - SPEC_KEYS - shown_otherwise:
        assert key in out
    assert "device parts" in out and "prefill parts" in out
    assert "predicted at copy" in out and "step model constants" in out
    assert "2,147,483,648 B" in out


def test_runs_as_a_kvserve_subcommand() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "plan", "--model", "llama-3-8b", "--gpu", "h100",
         "--json"], capture_output=True, text=True, check=False, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert set(json.loads(result.stdout)) == PLAN_KEYS | {"inputs"}


def test_mounting_the_command_imports_neither_torch_nor_matplotlib() -> None:
    code = ("import sys, argparse, kvserve.bench.plan_cli as c; "
            "c.add_plan_parser(argparse.ArgumentParser().add_subparsers()); "
            "print(sorted({'torch', 'matplotlib'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=120)
    assert result.stdout.strip() == "[]"


def test_add_plan_parser_mounts_the_subcommand() -> None:
    parser = argparse.ArgumentParser(prog="kvserve")
    add_plan_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", "--model", "qwen3-8b", "--gpu", "l40s", "--json"])
    assert args.func.__name__ == "run_plan"
    assert args.command == "plan"


def test_plot_writes_a_png(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "plan.png"
    rc, _, err = _run(["--model", "llama-3-8b", "--gpu", "h100-sxm", "--batch", "16",
                       "--plot", str(path)], capsys)
    assert rc == 0, err
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plot_module.importlib.util, "find_spec", lambda name: None)
    rc, out, err = _run(["--model", "llama-3-8b", "--gpu", "h100-sxm",
                         "--plot", str(tmp_path / "x.png")], capsys)
    assert rc == 2
    assert out == ""
    assert "pip install matplotlib" in err


def test_measure_on_cuda_without_a_gpu_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    rc, out, err = _run(["--model", "llama-3-8b", "--gpu", "h100-sxm", "--measure",
                         "--device", "cuda"], capsys)
    assert rc == 2
    assert "--device" in err and "no CUDA device" in err
    assert out == ""


@pytest.mark.parametrize(("argv", "flag", "detail"), [
    (["--gpu", "h1000"], "--gpu", "h100-sxm"),
    (["--batch", "0"], "--batch", ">= 1"),
    (["--context=-5"], "--context", ">= 1"),
    (["--tp", "two"], "--tp", "integer"),
    (["--spec-k", "4", "--spec-alpha", "1.5", "--spec-cost-ratio", "0.1"], "--spec-alpha",
     "[0.0, 1.0]"),
    (["--spec-k", "4", "--spec-alpha", "0.8"], "--spec-cost-ratio", "go together"),
    (["--bandwidth", "0"], "--bandwidth", "> 0"),
    (["--weights", "int3"], "--weights", "int4"),
    (["--model", "no-such-model"], "--model", "llama-3-8b"),
])
def test_bad_input_names_the_flag(
    argv: list[str], flag: str, detail: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = {"--model": "llama-3-8b", "--gpu": "h100-sxm"}
    for key in list(base):
        if key in argv:
            del base[key]
    rc, out, err = _run([*argv, *[x for kv in base.items() for x in kv]], capsys)
    assert rc == 2
    assert flag in err
    assert detail in err
    assert out == ""


def test_config_without_a_needed_field(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    model_dir = _write_config(tmp_path / "m", vocab_size=None)
    rc, _, err = _run(["--model", str(model_dir), "--gpu", "h100-sxm"], capsys)
    assert rc == 2
    assert "--model" in err
    assert "vocab_size" in err


def test_plan_inputs_validate_without_the_cli() -> None:
    with pytest.raises(PlanError, match="--batch"):
        PlanInputs(batch=0)
    with pytest.raises(PlanError, match="--spec-k"):
        PlanInputs(spec_alpha=0.5, spec_cost_ratio=0.1)
    inputs = PlanInputs()
    assert dataclasses.replace(inputs, batch=4).batch == 4


# -- tensor parallelism and speculative labels (issue 27) ---------------------------------


def test_tp_that_cannot_split_the_heads_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(["--model", "llama-3-8b", "--gpu", "h100", "--tp", "3"], capsys)
    assert rc == 2 and out == ""
    assert "--tp: 3 does not split this model: num_attention_heads=32" in err
    assert "num_key_value_heads=8 neither divides it" in err
    assert "1, 2, 4, 8, 16, 32" in err  # what this model can use
    with pytest.raises(PlanError, match="--tp"):
        compute_plan(_model("llama-3-8b"), Hardware.from_gpu(get_gpu("h100")), PlanInputs(tp=3))
    # tp a multiple of the KV heads replicates them: allowed
    assert _plan("llama-3-8b", tp=16).kv_bytes_per_token == _plan("llama-3-8b", tp=8)\
        .kv_bytes_per_token


def test_speculative_figures_are_labelled_upper_bounds(
    capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = _run(["--model", "llama-3-8b", "--gpu", "h100", "--spec-k", "4",
                       "--spec-alpha", "0.8", "--spec-cost-ratio", "0.11"], capsys)
    assert rc == 0
    assert "<= 4.20" in out and "upper bound" in out
    assert "3.36" in out  # the i.i.d. expectation, (1 - 0.8^5) / (1 - 0.8)
    plan = _plan("llama-3-8b", spec_k=4, spec_alpha=0.8, spec_cost_ratio=0.11)
    assert plan.spec_tokens_per_step_iid == pytest.approx(3.3616, rel=1e-4)
    assert plan.spec_speedup_iid == pytest.approx(3.3616 / 1.44, rel=1e-4)
    help_text = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "plan", "--help"], capture_output=True,
        text=True, check=True, timeout=120).stdout
    assert "the figures are upper bounds: k*alpha + 1 counts every draft token" in help_text


# -- the step model -----------------------------------------------------------------------


def test_prediction_never_beats_the_roofline_and_grows_with_the_work() -> None:
    for context in (512, 2048, 8192):
        steps = [_plan("llama-3-8b", batch=b, context=context) for b in (1, 8, 32, 128, 256)]
        for plan in steps:
            assert plan.decode_ms_per_step > plan.roofline_decode_ms_per_step
        assert [p.decode_ms_per_step for p in steps] == sorted(p.decode_ms_per_step
                                                               for p in steps)
    prefills = [_plan("llama-3-8b", prompt=p) for p in (128, 512, 2048, 8192, 16384)]
    for plan in prefills:
        assert plan.prefill_ms > plan.roofline_prefill_ms
    assert [p.prefill_ms for p in prefills] == sorted(p.prefill_ms for p in prefills)


def test_decode_step_by_hand_at_batch_1() -> None:
    """At batch 1 the GEMMs stream every weight at the skinny kernel's share of
    the copy rate (their FLOPs add a little through the p-norm)."""
    model = _model("llama-3-8b")
    hardware = Hardware.from_gpu(get_gpu("h100"))
    k = step_model.constants_for("h100-sxm")
    inputs = PlanInputs(batch=1, context=1024)
    step = step_model.decode_step(model, inputs, hardware, k)
    weights = (count_params(model).total - 128256 * 4096) * 2  # the untied embedding is a gather
    memory_s = weights / (k.gemm_bandwidth_share * 3006e9)
    assert step.gemm_s == pytest.approx(memory_s, rel=0.01)
    assert step.gemm_s >= memory_s
    kv = 131072 * 1024
    streams = 8
    share = k.attention_bandwidth_share * streams / (streams + k.attention_half_streams)
    assert step.attention_s == pytest.approx(
        32 * (k.attention_layer_us + k.attention_request_us) * 1e-6 + kv / (share * 3006e9))
    assert step.fixed_s == pytest.approx((k.step_us + 32 * k.layer_us) * 1e-6)
    assert step.device_s == pytest.approx(
        step.gemm_s + step.attention_s + step.elementwise_s + step.fixed_s)
    assert step.total_s == max(step.device_s, step.host_s)
    # one row runs the skinny GEMM: the cuBLAS share moves batch 8, not batch 1
    slower = dataclasses.replace(k, gemm_batched_bandwidth_share=k.gemm_batched_bandwidth_share / 2)
    assert step_model.decode_step(model, inputs, hardware, slower).gemm_s == step.gemm_s
    eight = dataclasses.replace(inputs, batch=8)
    assert (step_model.decode_step(model, eight, hardware, slower).gemm_s
            > 1.5 * step_model.decode_step(model, eight, hardware, k).gemm_s)


def test_prefill_is_chunked_as_the_engine_does() -> None:
    model = _model("llama-3-8b")
    hardware = Hardware.from_gpu(get_gpu("h100"))
    k = step_model.constants_for("h100-sxm")
    one = step_model.prefill_time(model, PlanInputs(prompt=8192), hardware, k)
    two = step_model.prefill_time(model, PlanInputs(prompt=8193), hardware, k)
    per_chunk = (k.step_us + 32 * k.layer_us) * 1e-6
    assert two.fixed_s - one.fixed_s == pytest.approx(per_chunk)
    assert one.fixed_s == pytest.approx(per_chunk + k.prefill_us * 1e-6)
    # a second chunk streams the decoder's weights (not the logits matmul's) again:
    # its one row costs a weight read at the one-row kernel's share
    layer_bytes = (count_params(model).linear + 32 * 2 * 4096) * 2
    assert two.gemm_s - one.gemm_s == pytest.approx(
        layer_bytes / (k.gemm_bandwidth_share * 3006e9), rel=0.01)


def test_rates_come_from_the_measured_table_or_the_spec_sheet() -> None:
    h100 = Hardware.from_gpu(get_gpu("h100"))
    assert (h100.copy_bytes_s, h100.matmul_flops_s) == (3006e9, 785e12)
    assert "H100 80GB HBM3" in h100.rates_source
    assert Hardware.from_gpu(get_gpu("h100"), "fp8").matmul_flops_s == 1395e12
    h200_fp8 = Hardware.from_gpu(get_gpu("h200"), "fp8")  # not measured: bf16 x 1979/989
    assert h200_fp8.matmul_flops_s == pytest.approx(779e12 * 1979 / 989)
    l40s = Hardware.from_gpu(get_gpu("l40s"))
    assert l40s.copy_bytes_s == pytest.approx(864e9 * COPY_SHARE_OF_SPEC)
    assert "not measured" in l40s.rates_source
    given = Hardware.from_gpu(get_gpu("h100"), bandwidth_gb_s=1000)
    assert given.copy_bytes_s == given.bandwidth_bytes_s == 1000e9


def test_mbu_and_mfu_are_the_benchmarks_formulas() -> None:
    assert mbu(15e9, 5e-3, 3e12) == pytest.approx(1.0)
    assert mfu(8_000_000_000, 1000.0, 800e12) == pytest.approx(0.02)


def test_fit_recovers_the_constants_that_made_the_measurements() -> None:
    """Measurements made by the model itself with other constants: the fit
    must find predictions that match them (and did not before)."""
    model = _model("llama-3-8b")
    hardware = Hardware.from_gpu(get_gpu("h100"))
    seed = step_model.constants_for("h100-sxm")
    truth = dataclasses.replace(seed, gemm_batched_bandwidth_share=0.7, gemm_compute_share=0.75,
                                gemm_overlap=2.5, attention_bandwidth_share=0.85,
                                step_us=250.0, prefill_us=900.0, prefill_attention_share=0.4)
    decodes, prefills = [], []
    for context in (512, 2048, 8192):
        for batch in (1, 8, 32, 128):
            inputs = PlanInputs(batch=batch, context=context)
            decodes.append(fit.DecodeSample(batch, context, 1e3 * step_model.decode_step(
                model, inputs, hardware, truth).total_s))
    for prompt in (128, 512, 2048, 8192):
        prefills.append(fit.PrefillSample(prompt, 1e3 * step_model.prefill_time(
            model, PlanInputs(prompt=prompt), hardware, truth).total_s))
    result = fit.fit_constants(model, hardware, PlanInputs(), seed, decodes, prefills, "test")
    assert result.worst_before > 0.10
    assert result.worst_after < 0.02
    assert result.constants.source == "test"
    literal = fit.constants_literal("h100-sxm", result.constants)
    assert literal.startswith('    "h100-sxm": StepConstants(') and "gemm_overlap=" in literal


def test_sweep_without_measuring_predicts_the_grid(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(["--model", "llama-3-8b", "--gpu", "h100", "--sweep", "--json"], capsys)
    assert rc == 0
    sweep = json.loads(out)["sweep"]
    decode = [p for p in sweep if p["kind"] == "decode"]
    assert {(p["batch"], p["context"]) for p in decode} == {
        (b, c) for b in (1, 8, 32, 128, 256) for c in (512, 2048, 8172)}  # 8192 - 16 - 4
    assert [p["context"] for p in sweep if p["kind"] == "prefill"] == [128, 512, 2048, 8191]
    assert all(p["measured_ms"] is None and p["predicted_ms"] > 0 for p in sweep)


# -- calibration ---------------------------------------------------------------------------


def _write_calibration(cache: Path, **fields: Any) -> None:
    entry = {"card": "NVIDIA H100 80GB HBM3", "gpu": "h100-sxm", "device": "cuda",
             "memory_gb": 85.0, "copy_gb_s": 2900.0, "matmul_tflop_s": 700.0,
             "matmul_dtype": "bfloat16", "fp8_tflop_s": 1300.0,
             "measured_at": "2026-11-27T10:00:00", **fields}
    (cache / "kvserve").mkdir(parents=True, exist_ok=True)
    (cache / "kvserve" / "calibration.json").write_text(json.dumps({entry["card"]: entry}))


def test_a_calibrated_card_replaces_the_tables_rates(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    rc, _, err = _run(["--model", "llama-3-8b", "--gpu", "local"], capsys)
    assert rc == 2 and "--calibrate first" in err
    _write_calibration(tmp_path)
    rc, out, _ = _run(["--model", "llama-3-8b", "--gpu", "h100", "--json"], capsys)
    data = json.loads(out)
    assert (data["copy_gb_s"], data["matmul_tflop_s"]) == (2900.0, 700.0)
    assert "calibrated on this machine" in data["rates_source"]
    rc, out, _ = _run(["--model", "llama-3-8b", "--gpu", "h200", "--json"], capsys)
    assert json.loads(out)["copy_gb_s"] == 4257  # another card: the table's
    _write_calibration(tmp_path, card="NVIDIA H100 NVL", gpu=None)
    rc, out, _ = _run(["--model", "llama-3-8b", "--gpu", "local", "--json"], capsys)
    data = json.loads(out)
    assert rc == 0 and data["inputs"]["gpu"] == "local" and data["copy_gb_s"] == 2900.0
