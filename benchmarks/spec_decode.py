"""Speculative decoding, measured (issue 19): one command, JSON per part under
``--out``, one markdown table last.

- ``oracle``: the llama-3-8b preset (``--load-format dummy``, bf16) at batch
  1 (prompt 128 random tokens, 256 new, greedy, ``ignore_eos``): plain
  decode, then the oracle proposer in ``forced_acceptance`` mode (each
  proposal counts as correct with probability alpha, independently; replay
  of a recorded continuation leaves the recording within a few steps on
  random bf16 weights, see ``spec/oracle.py``) for alpha in {0.6, 0.8, 0.95}
  x k in {2, 4, 6}. Decode tok/s (1 / TPOT) against plain decode and against the i.i.d. theory
  ``(1 - alpha^(k+1)) / (1 - alpha)`` (target: >= 0.85 of it), with the
  acceptance measured and ``kvserve plan --spec-*``'s prediction beside.
  Per step (``LLM.stats`` over the timed runs): wall ms (the engine's
  step time), device ms (first to last kernel) and the share of steps that
  replayed a CUDA graph; ``verify / plain`` is a speculative run's wall ms
  per step over plain decode's, the cost of a verify step in plain steps
  (a share of theory >= 0.85 needs it <= ~1.15 at k = 4). ``--oracle-ks``,
  ``--oracle-alphas`` pick a subset; ``--no-async-scheduling`` runs both
  sides synchronously (speculative steps then read before the next is
  planned and output processing no longer overlaps); ``--no-plan-ahead``
  keeps async scheduling but reads each speculative step before planning
  the next (``speculative_config.plan_ahead``); ``--skinny-max-m`` sends
  the layers' GEMMs of up to that many rows to the skinny Triton GEMM
  (``kernels/skinny_gemm.LAYER_MAX_M``) for the whole run.
- ``real``: the bundled target at batch 1 on held-out stdlib code (the
  target's own split: never trained on), 64-token prompts, 128 new tokens:
  plain, ngram, draft_model (the bundled draft) and eagle (the bundled head
  or ``--eagle-head``): alpha (first proposal), acceptance rate, mean
  accepted length, decode tok/s and speed-up, and the plan's prediction
  with the proposer's parameter ratio as its cost ratio. Runs on the CPU
  too (``--device cpu``).
- ``w2``: ``kvserve bench throughput --workload w2`` on the llama-3-8b preset
  with speculation enabled (``--w2-spec``, ngram by default: the policy must
  switch it off where it does not pay; target >= 0.95x) and disabled, each
  in its own process.

    PYTHONPATH=. python benchmarks/spec_decode.py --out $OUT/spec-decode
    PYTHONPATH=. python benchmarks/spec_decode.py --out /tmp/sd --parts real --device cpu
    PYTHONPATH=. python benchmarks/spec_decode.py --out $OUT/sd --parts oracle \
        --oracle-ks 4 --oracle-alphas 0.8
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvserve.bench.report import run_parts

REPO = Path(__file__).resolve().parents[1]
ALPHAS = (0.6, 0.8, 0.95)
KS = (2, 4, 6)


def log(message: str) -> None:
    print(f"[spec_decode] {message}", flush=True)


def theory(alpha: float, k: int) -> float:
    """Expected tokens per step with i.i.d. acceptance alpha: (1 - a^(k+1)) / (1 - a)."""
    return float(k + 1) if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


def plan_prediction(model: str, k: int, alpha: float, cost_ratio: float) -> dict[str, float]:
    """``kvserve plan --spec-k --spec-alpha --spec-cost-ratio`` for the model."""
    from kvserve.models.source import resolve_model_config
    from kvserve.plan.gpus import get_gpu
    from kvserve.plan.planner import Hardware, PlanInputs, compute_plan

    plan = compute_plan(resolve_model_config(model)[0], Hardware.from_gpu(get_gpu("h100-sxm")),
                        PlanInputs(spec_k=k, spec_alpha=alpha, spec_cost_ratio=cost_ratio))
    return {"plan_tokens_per_step": float(plan.spec_tokens_per_step or 0.0),
            "plan_speedup": float(plan.spec_speedup or 0.0),
            "plan_speedup_iid": float(plan.spec_speedup_iid or 0.0)}


def release(llm: Any) -> None:
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def timed_decode(llm: Any, prompts: list[list[int]], max_tokens: int, iters: int
                 ) -> dict[str, Any]:
    """Greedy decode of ``prompts`` ``iters`` times; decode tok/s = 1 / mean TPOT."""
    from kvserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tpots, outputs = [], None
    before = llm.stats()
    for _ in range(iters):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tpots += [o.tpot_s for o in outputs if o.tpot_s is not None]
    stats = llm.stats()
    assert outputs is not None
    result = {"decode_tok_s": 1.0 / statistics.mean(tpots), "tpot_ms": 1e3 * statistics.mean(tpots),
              "token_ids": [o.outputs[0].token_ids for o in outputs], **step_times(before, stats)}
    if "spec_decode_num_drafts" in stats:
        drafted = stats["spec_decode_num_drafted_tokens_per_pos"]
        accepted = stats["spec_decode_num_accepted_tokens_per_pos"]
        result.update(
            acceptance_rate=stats["spec_decode_acceptance_rate"],
            mean_accepted_length=stats["spec_decode_mean_accepted_length"],
            alpha_first=accepted[0] / max(drafted[0], 1),
            accepted_per_position=[a / max(d, 1) for a, d in zip(accepted, drafted, strict=True)],
            spec_steps=stats["spec_decode_num_spec_steps"],
            plain_steps=stats["spec_decode_num_plain_steps"])
    return result


def step_times(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Per step of the runs between two ``LLM.stats()``: wall and device ms,
    and the share of steps that replayed a CUDA graph."""
    steps = max(after["num_steps"] - before["num_steps"], 1)
    return {"steps": float(steps),
            "step_ms": 1e3 * (after["step_s"] - before["step_s"]) / steps,
            "device_step_ms": 1e3 * (after["device_s"] - before["device_s"]) / steps,
            "graph_step_share": (after["num_graph_steps"] - before["num_graph_steps"]) / steps}


# --------------------------------------------------------------------------- parts


def oracle_part(args: argparse.Namespace) -> dict[str, Any]:
    from kvserve import LLM
    from kvserve.bench.workloads import w1

    engine: dict[str, Any] = {"model": args.oracle_model, "load_format": "dummy",
              "max_num_seqs": 1, "max_num_batched_tokens": 512, "device": args.device,
              "cuda_graph_token_sizes": [16, 32, 64, 128, 256, 512],
              "async_scheduling": args.async_scheduling}
    if args.device != "cpu":
        engine["dtype"] = "bfloat16"
    prompts = [r.prompt_token_ids for r in w1(128256, 128, args.output_len, 1, seed=0)]
    llm = LLM(**engine)
    timed_decode(llm, prompts, args.output_len, 1)  # warm-up
    plain = timed_decode(llm, prompts, args.output_len, args.iters)
    release(llm)
    log(f"oracle part: plain decode {plain['decode_tok_s']:.1f} tok/s")
    rows = []
    for k in args.oracle_ks:
        for alpha in args.oracle_alphas:
            llm = LLM(**engine, speculative_config={
                "method": "oracle", "num_speculative_tokens": k, "acceptance_rate": alpha,
                "forced_acceptance": True, "plan_ahead": args.plan_ahead,
                "auto_disable": False})
            timed_decode(llm, prompts, args.output_len, 1)  # warm-up
            spec = timed_decode(llm, prompts, args.output_len, args.iters)
            spec.pop("token_ids")  # forced acceptance: not the target's tokens
            release(llm)
            speedup = spec["decode_tok_s"] / plain["decode_tok_s"]
            row = {"k": k, "alpha": alpha, "theory": theory(alpha, k), "speedup": speedup,
                   "efficiency": speedup / theory(alpha, k),
                   "verify_over_plain": spec["step_ms"] / plain["step_ms"],
                   **spec, **plan_prediction(args.oracle_model, k, alpha, 0.0)}
            rows.append(row)
            log(f"oracle k={k} alpha={alpha}: {row['decode_tok_s']:.1f} tok/s, speed-up "
                f"{speedup:.2f}x of theory {row['theory']:.2f}x ({row['efficiency']:.2f}); "
                f"step {spec['step_ms']:.2f} ms (device {spec['device_step_ms']:.2f}) vs plain "
                f"{plain['step_ms']:.2f} ({plain['device_step_ms']:.2f}): "
                f"{row['verify_over_plain']:.2f}x")
    plain.pop("token_ids")
    return {"model": f"{args.oracle_model} (dummy, {engine.get('dtype', 'float32')})",
            "batch": 1, "prompt": 128,
            "output_len": args.output_len, "async_scheduling": args.async_scheduling,
            "plan_ahead": args.plan_ahead, "plain": plain, "rows": rows}


def heldout_prompts(num: int, prompt_len: int) -> list[list[int]]:
    """The first tokens of held-out stdlib files of the bundled model's split."""
    import importlib.util
    import sysconfig

    from tokenizers import Tokenizer

    from kvserve.assets import default_model_path

    spec = importlib.util.spec_from_file_location(
        "train_default_model", REPO / "scripts" / "train_default_model.py")
    assert spec is not None and spec.loader is not None
    tdm = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tdm
    spec.loader.exec_module(tdm)
    corpus = tdm.collect_corpus(Path(sysconfig.get_paths()["stdlib"]), 0, 0, [], 0)
    tokenizer = Tokenizer.from_file(str(default_model_path() / "tokenizer.json"))
    prompts = []
    for text in corpus.texts("heldout"):
        ids = tokenizer.encode(text).ids
        if len(ids) >= prompt_len:
            prompts.append([0, *ids[:prompt_len - 1]])  # <|bos|> first, as in training
    return prompts[:num]


def real_part(args: argparse.Namespace) -> dict[str, Any]:
    from kvserve import LLM
    from kvserve.assets import DEFAULT_MODEL, DRAFT_MODEL, MODELS_DIR
    from kvserve.engine.speculative import EAGLE_HEAD

    prompts = heldout_prompts(args.real_prompts, 64)
    engine: dict[str, Any] = {"max_num_seqs": 1, "device": args.device}
    if args.device != "cpu":
        engine["dtype"] = "bfloat16"
    head = Path(args.eagle_head) if args.eagle_head else MODELS_DIR / EAGLE_HEAD
    methods: dict[str, dict[str, Any] | None] = {
        "plain": None,
        "ngram": {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4},
        "draft_model": {"method": "draft_model"},
    }
    if (head / "config.json").is_file():
        methods["eagle"] = {"method": "eagle", "model": str(head)}
    else:
        log(f"real part: no EAGLE head at {head}; train one with scripts/train_eagle_head.py")
    methods = {name: config for name, config in methods.items()
               if name == "plain" or name in args.real_methods}
    target_params = _num_params(MODELS_DIR / DEFAULT_MODEL)
    ratios = {"ngram": 0.0, "draft_model": _num_params(MODELS_DIR / DRAFT_MODEL) / target_params,
              "eagle": _num_params(head) / target_params if "eagle" in methods else 0.0}
    results: dict[str, Any] = {"target": DEFAULT_MODEL, "device": args.device,
                               "num_prompts": len(prompts), "k": args.real_k}
    plain_tokens: list[list[int]] = []
    for name, config in methods.items():
        kwargs = dict(engine)
        if config is not None:
            kwargs["speculative_config"] = {**config, "num_speculative_tokens": args.real_k,
                                            "auto_disable": False,
                                            "plan_ahead": args.plan_ahead}
        llm = LLM(**kwargs)
        timed_decode(llm, prompts[:1], 16, 1)  # warm-up
        start = time.perf_counter()
        result = timed_decode(llm, prompts, args.real_new_tokens, 1)
        result["elapsed_s"] = time.perf_counter() - start
        release(llm)
        tokens = result.pop("token_ids")
        if name == "plain":
            plain_tokens = tokens
        else:
            result["same_tokens_as_plain"] = tokens == plain_tokens
            result["speedup"] = result["decode_tok_s"] / results["plain"]["decode_tok_s"]
            result["cost_ratio"] = ratios[name]
            result.update(plan_prediction(str(MODELS_DIR / DEFAULT_MODEL), args.real_k,
                                          result["alpha_first"], ratios[name]))
        results[name] = result
        log(f"real {name}: {result}")
    return results


def _num_params(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (a safetensors handle)
            numel = 1
            for dim in f.get_slice(name).get_shape():
                numel *= dim
            total += numel
    return total


def w2_part(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    results = {}
    for name, extra in (("disabled", []), ("enabled", ["--speculative-config", args.w2_spec])):
        path = out / f"w2_{name}.json"
        command = [sys.executable, "-m", "kvserve.cli", "bench", "throughput", "--model",
                   "llama-3-8b", "--load-format", "dummy", "--dtype", "bfloat16", "--workload",
                   "w2", "--disable-tqdm", "--output-json", str(path), *extra]
        log(f"w2 {name}: {' '.join(command)}")
        subprocess.run(command, check=True, cwd=REPO)
        results[name] = json.loads(path.read_text())
    results["ratio"] = results["enabled"]["output_tok_s"] / results["disabled"]["output_tok_s"]
    return results


# --------------------------------------------------------------------------- report


def table(results: dict[str, Any]) -> str:
    lines = ["| part | setting | tok/s | speed-up | theory / plan | α (1st) | accepted "
             "length | note |", "|---|---|---:|---:|---:|---:|---:|---|"]
    if "oracle" in results:
        oracle = results["oracle"]
        plain = oracle["plain"]
        lines.append(f"| oracle b1 | plain | {plain['decode_tok_s']:.1f} | 1.00 | | | | "
                     f"step {_step(plain)} |")
        for r in oracle["rows"]:
            lines.append(
                f"| oracle b1 | k={r['k']} α={r['alpha']} | {r['decode_tok_s']:.1f} | "
                f"{r['speedup']:.2f} | {r['theory']:.2f} / {r['plan_speedup']:.2f} | "
                f"{r['alpha_first']:.2f} | {r['mean_accepted_length']:.2f} | "
                f"{r['efficiency']:.2f} of theory{'' if r['efficiency'] >= 0.85 else ' (<0.85)'};"
                f" step {_step(r)}, verify / plain {r['verify_over_plain']:.2f} |")
    if "real" in results:
        real = results["real"]
        lines.append(f"| bundled {real['device']} | plain | {real['plain']['decode_tok_s']:.1f} "
                     "| 1.00 | | | | |")
        for name in ("ngram", "draft_model", "eagle"):
            if name in real:
                r = real[name]
                lines.append(
                    f"| bundled {real['device']} | {name} k={real['k']} | "
                    f"{r['decode_tok_s']:.1f} | {r['speedup']:.2f} | plan "
                    f"{r.get('plan_speedup_iid', 0.0):.2f} (≤ {r['plan_speedup']:.2f}) | "
                    f"{r['alpha_first']:.2f} | {r['mean_accepted_length']:.2f} | "
                    f"rate {r['acceptance_rate']:.2f}"
                    f"{'' if r['same_tokens_as_plain'] else ', TOKENS DIFFER'} |")
    if "w2" in results:
        w2 = results["w2"]
        lines.append(f"| W2 8B | spec enabled / disabled | "
                     f"{w2['enabled']['output_tok_s']:.0f} / {w2['disabled']['output_tok_s']:.0f}"
                     f" | {w2['ratio']:.3f} | | | | target >= 0.95 |")
    return "\n".join(lines)


def _step(r: dict[str, Any]) -> str:
    return (f"{r['step_ms']:.2f} ms (device {r['device_step_ms']:.2f}, "
            f"graphs {100 * r['graph_step_share']:.0f}%)")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for the JSON files")
    parser.add_argument("--parts", default="oracle,real,w2")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--oracle-model", default="llama-3-8b",
                        help="the oracle part's preset (random weights)")
    parser.add_argument("--oracle-ks", type=lambda t: [int(x) for x in _floats(t)],
                        default=list(KS), help="comma-separated k values of the oracle part")
    parser.add_argument("--oracle-alphas", type=_floats, default=list(ALPHAS),
                        help="comma-separated acceptance rates of the oracle part")
    parser.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                        help="oracle part: synchronous steps, plain and speculative")
    parser.add_argument("--no-plan-ahead", dest="plan_ahead", action="store_false",
                        help="read each speculative step before planning the next")
    parser.add_argument("--real-prompts", type=int, default=16)
    parser.add_argument("--real-new-tokens", type=int, default=128)
    parser.add_argument("--real-k", type=int, default=4)
    parser.add_argument("--eagle-head", default=None)
    parser.add_argument("--real-methods", type=lambda t: t.split(","),
                        default=["ngram", "draft_model", "eagle"],
                        help="real part: the proposers run beside plain decoding")
    parser.add_argument("--w2-spec", default='{"method": "ngram", "num_speculative_tokens": 4}')
    parser.add_argument("--skinny-max-m", type=int, default=None,
                        help="the layers' skinny-GEMM row limit for this run (LAYER_MAX_M)")
    args = parser.parse_args(argv)
    if args.skinny_max_m is not None:
        from kvserve.kernels import skinny_gemm

        skinny_gemm.LAYER_MAX_M = args.skinny_max_m
    return run_parts(Path(args.out), args.parts, {
        "oracle": lambda: oracle_part(args),
        "real": lambda: real_part(args),
        "w2": lambda: w2_part(args, Path(args.out))}, "speculative decoding", table)


if __name__ == "__main__":
    raise SystemExit(main())
