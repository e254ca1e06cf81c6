"""Peers on the GPU, on the same requests as kvserve's benchmarks (``kvserve.bench.workloads``).

    python benchmarks/peers.py gptfast hf-static hf-batch --output-json peers.json

Run it from the repository root with kvserve importable (``PYTHONPATH=.``).
Every peer runs the llama-3-8b preset's shapes with random bf16 weights
(speed depends on shapes, not values). The copy and bf16 matmul rates are
measured first, in the same process, and MBU uses kvserve's formula
(``kvserve.bench.offline.ModelFigures``: every weight but the embedding table
plus the KV at the mean decode context, per decode step).

- ``gptfast``: gpt-fast's own ``generate`` (static KV cache; the decode step
  compiled with ``torch.compile(mode="reduce-overhead", fullgraph=True)``,
  which captures CUDA graphs; its default sampling, temperature 0.8, top-k
  200) on W1 at batch 1. gpt-fast's files must be in ``.peers/gpt-fast/``
  (git-ignored: never commit them).
- ``gptfast-int8``: the same with gpt-fast's own int8 weight-only
  quantisation (``WeightOnlyInt8QuantHandler``: every linear, the output head
  included, per-channel scales); its MBU counts int8 linears and their scales.
- ``hf-static``: transformers ``generate`` with ``cache_implementation="static"``
  (which compiles the decode step), greedy, on W1 at batch 1.
- ``hf-batch``: transformers' continuous batching (the manager behind
  ``generate_batch``, used directly so each request keeps its own output
  length) with paged SDPA attention (paged eager where SDPA is refused), on
  the first ``--num-prompts`` requests of W2, all submitted at once; CUDA
  graph warm-up happens before the clock starts.

W1 figures: E2E is one ``generate`` call for ``--output-len`` new tokens, TTFT
the prefill alone (gpt-fast's ``prefill`` on the caches ``generate`` set up;
transformers' ``generate`` for one token), each the mean of ``--num-iters``
calls after ``--num-iters-warmup`` (compilation happens there); decode tok/s
= (output_len - 1) / (E2E - TTFT), the same definition as
``kvserve bench latency``. A peer that fails is reported with its error and
the others still run; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kvserve.bench.device_rates import DeviceRates, measure_rates
from kvserve.bench.offline import ModelFigures, mean_decode_context
from kvserve.bench.report import environment, print_table, write_json
from kvserve.bench.workloads import w1, w2
from kvserve.config import ModelConfig
from kvserve.models.presets import get_preset
from kvserve.quant.config import QuantConfig

MODEL = "llama-3-8b"  # kvserve's preset and gpt-fast's config of the same name
DEVICE = "cuda"
GPT_FAST_DIR = Path(__file__).resolve().parents[1] / ".peers" / "gpt-fast"
GPT_FAST_FILES = ("model.py", "generate.py", "quantize.py", "tokenizer.py", "tp.py", "GPTQ.py")


@dataclasses.dataclass(frozen=True)
class PeerRun:
    """What every peer needs: the flags, the model's shapes and counts, the rates."""

    args: argparse.Namespace
    config: ModelConfig
    figures: ModelFigures
    rates: DeviceRates


@contextmanager
def _on_gpu_in_bf16() -> Iterator[None]:
    """Build modules on the GPU in bf16, with seeded random weights."""
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEVICE):
            yield
    finally:
        torch.set_default_dtype(previous)


def _timed(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def time_w1(generate: Callable[[], object], prefill: Callable[[], object],
            run: PeerRun) -> dict[str, Any]:
    """TTFT, E2E and decode rate of a peer on the W1 prompt: ``generate()`` makes
    ``--output-len`` new tokens, ``prefill()`` only the first."""
    args = run.args
    for _ in range(args.num_iters_warmup):
        generate()
    e2e = [_timed(generate) for _ in range(args.num_iters)]
    ttft = [_timed(prefill) for _ in range(args.num_iters)]
    e2e_s, ttft_s = statistics.mean(e2e), statistics.mean(ttft)
    decode_tok_s = (args.output_len - 1) / (e2e_s - ttft_s)
    mean_context = mean_decode_context(args.input_len, args.output_len)
    spec = run.rates.spec_bandwidth_gb_s
    return {
        "workload": "w1", "input_len": args.input_len, "output_len": args.output_len,
        "batch_size": 1, "ttft_ms": ttft_s * 1e3, "e2e_ms": e2e_s * 1e3,
        "output_tok_s": args.output_len / e2e_s, "decode_tok_s": decode_tok_s,
        "mean_context": mean_context,
        "mbu_vs_copy": run.figures.mbu(1, mean_context, decode_tok_s, run.rates.copy_gb_s),
        "mbu_vs_spec": run.figures.mbu(1, mean_context, decode_tok_s, spec) if spec else None,
        "e2e_runs_s": e2e, "ttft_runs_s": ttft,
    }


def _w1_prompt(run: PeerRun) -> list[int]:
    [request] = w1(run.config.vocab_size, run.args.input_len, run.args.output_len)
    return request.prompt_token_ids


def gptfast(run: PeerRun, int8: bool = False) -> dict[str, Any]:
    """gpt-fast's ``generate`` with its compiled decode step, W1 batch 1
    (``int8``: its weight-only int8 linears)."""
    missing = [name for name in GPT_FAST_FILES if not (GPT_FAST_DIR / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{GPT_FAST_DIR} lacks {', '.join(missing)}: copy them from "
                                "github.com/meta-pytorch/gpt-fast (and never commit them)")
    sys.path.insert(0, str(GPT_FAST_DIR))
    import generate as gpt_fast  # gpt-fast's generate.py
    from model import Transformer  # gpt-fast's model.py

    with _on_gpu_in_bf16():
        model = Transformer.from_name(MODEL).eval()
    if int8:
        from quantize import WeightOnlyInt8QuantHandler  # gpt-fast's quantize.py

        handler = WeightOnlyInt8QuantHandler(model)
        state = handler.create_quantized_state_dict()
        model = handler.convert_for_runtime()
        model.load_state_dict(state, assign=True)
        model = model.to(DEVICE).eval()
    gpt_fast.decode_one_token = torch.compile(gpt_fast.decode_one_token, mode="reduce-overhead",
                                              fullgraph=True)
    prompt = torch.tensor(_w1_prompt(run), dtype=torch.int, device=DEVICE)
    sampling = {"temperature": 0.8, "top_k": 200}  # gpt-fast's defaults

    def generate() -> object:
        return gpt_fast.generate(model, prompt, run.args.output_len, batch_size=1,
                                 interactive=False, draft_model=None, **sampling)

    @torch.no_grad()
    def prefill() -> object:  # the first step of generate, on the caches it set up
        positions = torch.arange(0, prompt.numel(), device=DEVICE)
        return gpt_fast.prefill(model, prompt.view(1, -1), positions, **sampling)

    if int8:  # its MBU counts what it reads: int8 linears (LM head too), bf16 scales
        quant = QuantConfig(bits=8, group_size=-1, ignore=())
        config = dataclasses.replace(run.config, quantization=quant)
        run = dataclasses.replace(run, figures=ModelFigures.of(config, element_bytes=2))
    return time_w1(generate, prefill, run)


def _hf_model() -> Any:
    import transformers

    config = transformers.AutoConfig.for_model(**get_preset(MODEL))
    with _on_gpu_in_bf16():
        return transformers.AutoModelForCausalLM.from_config(config).eval()


def hf_static(run: PeerRun) -> dict[str, Any]:
    """transformers ``generate`` with a static cache, greedy, W1 batch 1."""
    model = _hf_model()
    ids = torch.tensor([_w1_prompt(run)], device=DEVICE)
    mask = torch.ones_like(ids)

    def generate(num_new_tokens: int) -> object:
        return model.generate(ids, attention_mask=mask, max_new_tokens=num_new_tokens,
                              min_new_tokens=num_new_tokens, do_sample=False,
                              cache_implementation="static", pad_token_id=0)

    return time_w1(lambda: generate(run.args.output_len), lambda: generate(1), run)


def _set_paged_attention(model: Any) -> str:
    errors = []
    for implementation in ("paged|sdpa", "paged|eager"):
        try:
            model.set_attn_implementation(implementation)
            return implementation
        except Exception as exc:  # transformers refuses an implementation with varied errors
            errors.append(f"{implementation}: {exc!r}")
    raise RuntimeError(f"no paged attention implementation: {'; '.join(errors)}")


def hf_batch(run: PeerRun) -> dict[str, Any]:
    """transformers' continuous batching on the first --num-prompts requests of W2."""
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model = _hf_model()
    attention = _set_paged_attention(model)
    requests = w2(run.config.vocab_size, num_requests=run.args.num_prompts)
    max_output_len = max(r.output_len for r in requests)
    generation = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                                  max_new_tokens=max_output_len)
    hints = WorkloadHints(max_prompt_length=max(len(r.prompt_token_ids) for r in requests),
                          max_generated_length=max_output_len, num_requests=len(requests))
    with model.continuous_batching_context_manager(generation_config=generation, block=True,
                                                   timeout=5, workload_hints=hints) as manager:
        start = time.perf_counter()
        for request in requests:
            manager.add_request(request.prompt_token_ids, max_new_tokens=request.output_len)
        finished: dict[str, Any] = {}
        while len(finished) < len(requests):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                finished[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError(f"the generation loop stopped after {len(finished)} requests")
        elapsed_s = time.perf_counter() - start
    errors = [r.error for r in finished.values() if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    num_input = sum(len(r.prompt_token_ids) for r in requests)
    num_output = sum(len(r.generated_tokens) for r in finished.values())
    return {"workload": "w2", "num_requests": len(requests), "attention": attention,
            "total_input_tokens": num_input, "total_output_tokens": num_output,
            "elapsed_s": elapsed_s, "requests_per_s": len(requests) / elapsed_s,
            "output_tok_s": num_output / elapsed_s,
            "total_tok_s": (num_input + num_output) / elapsed_s}


PEERS: dict[str, Callable[[PeerRun], dict[str, Any]]] = {
    "gptfast": gptfast, "gptfast-int8": lambda run: gptfast(run, int8=True),
    "hf-static": hf_static, "hf-batch": hf_batch,
}


def _row(name: str, result: dict[str, Any]) -> tuple[str, str]:
    if "error" in result:
        return name, f"failed: {result['error']}"
    if result["workload"] == "w1":
        return (f"{name}: W1 batch 1, prompt {result['input_len']}, {result['output_len']} new",
                f"TTFT {result['ttft_ms']:.1f} ms, {result['decode_tok_s']:.1f} decode tok/s "
                f"({result['output_tok_s']:.1f} incl. prefill), "
                f"MBU {100 * result['mbu_vs_copy']:.1f}% of copy")
    return (f"{name}: W2 first {result['num_requests']} requests ({result['attention']})",
            f"{result['output_tok_s']:,.0f} output tok/s, {result['total_tok_s']:,.0f} total "
            f"tok/s, {result['elapsed_s']:.1f} s")


def _release_gpu() -> None:
    gc.collect()
    torch._dynamo.reset()
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("peers", nargs="+", choices=list(PEERS))
    parser.add_argument("--input-len", type=int, default=128, help="W1 prompt tokens")
    parser.add_argument("--output-len", type=int, default=256, help="W1 new tokens")
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=200, help="W2 requests for hf-batch")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("peers.py needs a CUDA device", file=sys.stderr)
        return 2
    config = ModelConfig.from_hf_config(get_preset(MODEL))
    rates = measure_rates(DEVICE, torch.bfloat16)
    run = PeerRun(args, config, ModelFigures.of(config, element_bytes=2), rates)
    results: dict[str, dict[str, Any]] = {}
    for name in args.peers:
        try:
            results[name] = PEERS[name](run)
        except Exception as exc:  # a peer's failure is a result; the others still run
            traceback.print_exc()
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        _release_gpu()
    print_table(f"peers on {rates.card}: {MODEL}, random bf16 weights", [
        ("copy / matmul", f"{rates.copy_gb_s:,.0f} GB/s / {rates.matmul_tflop_s:,.0f} TFLOP/s"),
        *(_row(name, result) for name, result in results.items()),
    ])
    write_json(args.output_json, {
        "benchmark": "peers", **environment(), "model": MODEL, **rates.to_dict(),
        **dataclasses.asdict(run.figures), "args": vars(args), "peers": results,
    })
    return 1 if any("error" in result for result in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
