"""Run on an H100 (2026-11-27), output in first-token-diag.txt: first-token
logprobs of the engine (bf16, skinny on/off, w8a8-int8, fp8, KV fp8/int8)
against HF transformers in float32, on the tiny llama of the GPU tests."""
import gc
import tempfile
from pathlib import Path

import torch
import transformers

from kvserve import LLM, SamplingParams
from kvserve.kernels import skinny_gemm
from tests.conftest import make_tiny_checkpoint
from tests.quant_cases import random_prompts

root = Path(tempfile.mkdtemp())
path = make_tiny_checkpoint("llama", root / "llama")
prompts = random_prompts(64, seed=2)
hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
ref = []
with torch.no_grad():
    for p in prompts:
        logits = hf(torch.tensor([p], device="cuda")).logits[0, -1].double()
        ref.append(torch.log_softmax(logits, -1).cpu())
del hf
gaps = sorted(float(r.topk(2).values[0] - r.topk(2).values[1]) for r in ref)
print(f"HF top1-top2 gap: min {gaps[0]:.4f} p10 {gaps[6]:.4f} median {gaps[32]:.4f}")
P = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
base = dict(model=str(path), dtype="bfloat16", device="cuda", max_num_seqs=64,
            gpu_memory_utilization=0.3)
for name, kw, skinny in [("bf16", {}, True), ("bf16 no-skinny", {}, False),
                         ("bf16 eager", {"enforce_eager": True}, True),
                         ("float32", {"dtype": "float32"}, True),
                         ("w8a8-int8", {"quantization": "w8a8-int8"}, False),
                         ("fp8", {"quantization": "fp8"}, True),
                         ("kv fp8", {"kv_cache_dtype": "fp8_e4m3"}, True),
                         ("kv int8", {"kv_cache_dtype": "int8"}, True)]:
    skinny_gemm.LAYER_MAX_M = 16 if skinny else 0
    llm = LLM(**{**base, **kw})
    outs = llm.generate(prompts, P, use_tqdm=False)
    worst, flips, errs = 0.0, 0, []
    for o, r in zip(outs, ref):
        lp = o.outputs[0].logprobs[0]
        d = max(abs(v.logprob - float(r[t])) for t, v in lp.items())
        errs.append(d)
        flips += int(o.outputs[0].token_ids[0] != int(r.argmax()))
    errs.sort()
    print(f"{name:16s} max |lp - hf| over top5: median {errs[32]:.4f} max {errs[-1]:.4f}; "
          f"first token != HF argmax: {flips}/64")
    del llm, outs
    gc.collect()
    torch.cuda.empty_cache()
