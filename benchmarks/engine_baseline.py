"""The engine on a GPU with a chosen attention backend (torch reference or triton).

Measures, in one process: the device-to-device copy rate and the bf16
matmul rate of this card, then kvserve on a preset with random weights —
W1 (batch 1, prompt 128 / 4096, 256 new tokens) with TTFT, decode tok/s and
MBU, and a small offline batch for throughput. Prints a table and writes
JSON. Run it once per backend in the same device call to compare them.

    python benchmarks/engine_baseline.py --model llama-3-8b --attention-backend triton
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from kvserve import LLM, SamplingParams
from kvserve.bench.device_rates import copy_rate_gb_s, matmul_tflop_s


def decode_bytes_per_step(llm: LLM, context: int) -> int:
    """Weights read by one decode step (all but the embedding table) plus KV."""
    config = llm.engine.config.model_config
    model = llm.engine.core.executor.model  # type: ignore[attr-defined]  # in-process runner
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = config.vocab_size * config.hidden_size * 2
    weights = total - (0 if config.tie_word_embeddings else embed)
    kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2 * context
    return int(weights + kv)


def run_w1(llm: LLM, prompt_len: int, new_tokens: int, vocab: int) -> dict[str, float]:
    rng = random.Random(prompt_len)
    prompt = [rng.randrange(100, vocab) for _ in range(prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompt[:16]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    [out] = llm.generate([prompt], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    ttft = out.metrics.ttft_s or 0.0
    decode_tps = (new_tokens - 1) / (elapsed - ttft)
    return {"ttft_ms": ttft * 1e3, "decode_tok_s": decode_tps, "e2e_s": elapsed}


def run_batch(llm: LLM, num_requests: int, vocab: int) -> dict[str, float]:
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(128, 512))]
               for _ in range(num_requests)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(64, 128), ignore_eos=True)
              for _ in range(num_requests)]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(p) for p in prompts)
    return {"requests": num_requests, "output_tok_s": output_tokens / elapsed,
            "total_tok_s": (output_tokens + prompt_tokens) / elapsed, "elapsed_s": elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--attention-backend", default="torch")
    parser.add_argument("--batch-requests", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    card = torch.cuda.get_device_name()
    copy_gbs = copy_rate_gb_s()
    tflops = matmul_tflop_s()
    torch.cuda.empty_cache()
    start = time.perf_counter()
    llm = LLM(model=args.model, load_format="dummy", dtype="bfloat16", max_model_len=8192,
              attention_backend=args.attention_backend)
    startup_s = time.perf_counter() - start
    vocab = llm.engine.config.model_config.vocab_size
    w1: dict[str, dict[str, float]] = {}
    for prompt_len in (128, 4096):
        figures = run_w1(llm, prompt_len, 256, vocab)
        step_bytes = decode_bytes_per_step(llm, prompt_len + 128)
        figures["mbu_vs_copy"] = step_bytes * figures["decode_tok_s"] / (copy_gbs * 1e9)
        w1[f"prompt{prompt_len}"] = figures
    batch = run_batch(llm, args.batch_requests, vocab)
    result = {"card": card, "model": args.model, "attention_backend": args.attention_backend,
              "torch": torch.__version__, "copy_gbs": copy_gbs, "matmul_tflops": tflops,
              "startup_s": startup_s, "w1": w1, "batch": batch}
    print(json.dumps(result, indent=2))
    print("\n| card | workload | figure |\n|---|---|---|")
    print(f"| {card} | copy | {copy_gbs:.0f} GB/s |")
    print(f"| {card} | bf16 matmul 8192^3 | {tflops:.0f} TFLOP/s |")
    for name, figures in w1.items():
        print(f"| {card} | W1 {name}, 256 new | TTFT {figures['ttft_ms']:.1f} ms, "
              f"{figures['decode_tok_s']:.1f} tok/s, MBU {100 * figures['mbu_vs_copy']:.1f}% "
              "of copy |")
    print(f"| {card} | batch {batch['requests']:.0f} | {batch['output_tok_s']:.0f} output tok/s, "
          f"{batch['total_tok_s']:.0f} total tok/s |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
