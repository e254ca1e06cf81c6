#!/usr/bin/env bash
# The batched-LoRA figures (issue 22) on one GPU, llama-3-8b preset with random weights: the
# GPU tests and the kernel benchmark, then base vs LoRA in the same call: W2's first 200
# requests on the base model, with 8 rank-16 adapters on all seven projections (8 slots), and
# with 64 adapters over 16 slots and the host cache; W1 (batch 1, prompt 128, 256 new) on the
# base model and with one adapter; then the ratios.
#   benchmarks/lora_gpu.sh OUT_DIR [STAGE...]
# Stages (default: all): tests kernels w2 w1 summary. Run from the repository root on the GPU
# machine.
set -euo pipefail
out=${1:?output directory}
shift
stages=${*:-tests kernels w2 w1 summary}
mkdir -p "$out"
source benchmarks/gpu_lib.sh
engine=(--model llama-3-8b --load-format dummy --dtype bfloat16 --disable-tqdm)

for stage in $stages; do
    case $stage in
        tests)
            run gpu-tests python -m pytest -q tests/gpu/test_lora_gpu.py \
                tests/gpu/test_cuda_graphs_gpu.py
            ;;
        kernels)
            run kernels python benchmarks/lora_kernels.py --num-loras 8 --json "$out/kernels.json"
            ;;
        w2)
            w2=(python -m kvserve.cli bench throughput "${engine[@]}" --workload w2
                --num-prompts 200)
            run w2-base "${w2[@]}" --output-json "$out/w2-base.json"
            run w2-lora8 "${w2[@]}" --num-loras 8 --lora-rank 16 --max-loras 8 \
                --output-json "$out/w2-lora8.json"
            run w2-lora64 "${w2[@]}" --num-loras 64 --lora-rank 16 --max-loras 16 \
                --max-cpu-loras 64 --output-json "$out/w2-lora64.json"
            ;;
        w1)
            w1=(python -m kvserve.cli bench latency "${engine[@]}" --batch-size 1
                --input-len 128 --output-len 256 --num-iters 5)
            run w1-base "${w1[@]}" --output-json "$out/w1-base.json"
            run w1-lora1 "${w1[@]}" --num-loras 1 --lora-rank 16 --output-json "$out/w1-lora1.json"
            ;;
        summary)
            python - "$out" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None
summary = {}
base = load("w2-base")
for name in ("w2-lora8", "w2-lora64"):
    run = load(name)
    if base and run:
        summary[name] = {"output_tok_s": run["output_tok_s"],
                         "base_output_tok_s": base["output_tok_s"],
                         "vs_base": run["output_tok_s"] / base["output_tok_s"]}
base, run = load("w1-base"), load("w1-lora1")
if base and run:
    summary["w1-lora1"] = {"decode_tok_s": run["decode_tok_s"],
                           "base_decode_tok_s": base["decode_tok_s"],
                           "vs_base": run["decode_tok_s"] / base["decode_tok_s"]}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
EOF
            ;;
        *) echo "unknown stage '$stage'" >&2; exit 2 ;;
    esac
done
exit $failed
