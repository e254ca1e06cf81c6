"""Run on an H100 (2026-11-27), output in divergence-diag.log: the failing GPU
tests diagnosed (int8 KV scales; where greedy runs diverge and how close the
two candidates were there; why plan --measure skipped decode)."""
import contextlib
import gc
import io
import json
import tempfile
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams
from kvserve.bench.plan_cli import main as plan_main
from tests.conftest import make_tiny_checkpoint
from tests.gpu.test_kv_quant_gpu import _prompts
from tests.gpu.test_lora_gpu import _adapters

print("== int8 scales")
x = torch.randn(4096, 8, 128, device="cuda", dtype=torch.bfloat16).float()
amax = x.abs().amax(dim=-1)
ref = amax / 127.0
true = amax / torch.full_like(amax, 127.0)
recip = amax * (1.0 / 127.0)
print("scalar vs tensor div differ:", int((ref != true).sum()), "of", ref.numel(),
      "; scalar div equals reciprocal mul:", bool(torch.equal(ref, recip)))
cpu = amax.cpu() / 127.0
print("cpu scalar div equals cuda tensor div:", bool(torch.equal(cpu, true.cpu())))

P = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)


def run(llm, prompts, **kw):
    out = llm.generate(prompts, P, use_tqdm=False, **kw)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in out]


def compare(name, a, b):
    gaps = []
    for n, ((ta, la), (tb, lb)) in enumerate(zip(a, b)):
        if ta == tb:
            continue
        i = next(j for j in range(len(ta)) if ta[j] != tb[j])
        def lp(d, t):
            return round(d[t].logprob, 4) if t in d else None
        gaps.append((n, i, ta[i], tb[i], lp(la[i], ta[i]), lp(la[i], tb[i]), lp(lb[i], ta[i]),
                     lp(lb[i], tb[i])))
    print(f"== {name}: {len(gaps)} of {len(a)} differ; (req, pos, tok a, tok b, a's lp of a, b; "
          "b's lp of a, b)")
    for g in gaps:
        print("  ", g)


root = Path(tempfile.mkdtemp())
mistral = make_tiny_checkpoint("mistral", root / "mistral")
llama = make_tiny_checkpoint("llama", root / "llama")
for kv in ("fp8_e4m3", "int8"):
    kw = dict(model=str(mistral), dtype="bfloat16", device="cuda", kv_cache_dtype=kv,
              gpu_memory_utilization=0.3, max_num_batched_tokens=64, enforce_eager=True)
    prompts = _prompts(12, seed=4)
    compare(f"kv {kv} triton vs torch", run(LLM(**kw), prompts),
            run(LLM(**kw, attention_backend="torch"), prompts))
kw = dict(model=str(llama), dtype="bfloat16", device="cuda", quantization="int8",
          max_num_seqs=16, gpu_memory_utilization=0.3)
prompts = _prompts(9)
compare("int8 weights graphs vs eager-sync", run(LLM(**kw), prompts),
        run(LLM(**kw, enforce_eager=True, async_scheduling=False), prompts))
adapters = _adapters(llama, root)
prompts = _prompts(9, seed=5)
loras = [[*adapters, None][i % 4] for i in range(len(prompts))]
llm = LLM(model=str(llama), dtype="bfloat16", device="cuda", enable_lora=True, max_loras=3,
          max_num_seqs=16, max_num_batched_tokens=48, gpu_memory_utilization=0.3)
solo = [llm.generate([p], P, use_tqdm=False, lora_request=[lo])[0] for p, lo in zip(prompts, loras)]
solo = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in solo]
compare("lora bf16 mixed vs solo", run(llm, prompts, lora_request=loras), solo)

buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    rc = plan_main(["--model", "qwen2.5-0.5b", "--gpu", "h100-sxm", "--batch", "128",
                    "--context", "1024", "--prompt", "512", "--measure", "--json"])
result = json.loads(buf.getvalue())
print("== plan rc", rc, "decode skipped:", result["measured"][0].get("skipped"),
      "prefill skipped:", result["measured"][1].get("skipped"))
