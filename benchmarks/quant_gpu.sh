#!/usr/bin/env bash
# The weight-only quantisation figures (issue 17) on one GPU, llama-3-8b preset with random
# weights rounded at load: the kernels' GPU tests and GEMM benchmark, W1 (batch 1, prompt 128,
# 256 new) for bf16 / int8 / int4 g128 (LM head quantised or not), the decode batch sweep
# (1 / 4 / 16 / 64 / 256) and its plot, W2 for bf16 / int8 / int4, the llama-3-70b preset in int4
# on one card (W1), and gpt-fast bf16 / int8 (benchmarks/peers.py) as the peer, then a summary.
#   benchmarks/quant_gpu.sh OUT_DIR [STAGE...]
# Stages (default: all): kernels w1 sweep w2 70b peers summary. Run from the repository root on
# the GPU machine; peers needs .peers/gpt-fast (carry it).
set -euo pipefail
out=${1:?output directory}
shift
stages=${*:-kernels w1 sweep w2 70b peers summary}
mkdir -p "$out"
source benchmarks/gpu_lib.sh
engine=(--model llama-3-8b --load-format dummy --dtype bfloat16 --disable-tqdm)

latency() {  # NAME FLAGS...: W1 with the engine flags
    local name=$1
    shift
    run "$name" python -m kvserve.cli bench latency "${engine[@]}" --input-len 128 \
        --output-len 256 --num-iters 5 "$@" --output-json "$out/$name.json"
}

for stage in $stages; do
    case $stage in
        kernels)
            run gpu-tests python -m pytest -q -x tests/gpu/test_quant_matmul_gpu.py
            run gemm python benchmarks/quant_gemm.py --json "$out/quant_gemm.json"
            ;;
        w1)
            latency w1-bf16
            latency w1-int8 --quantization int8
            latency w1-int8-head --quantization int8 --quantize-lm-head
            latency w1-int4 --quantization int4
            latency w1-int4-head --quantization int4 --quantize-lm-head
            ;;
        sweep)
            for q in bf16 int8 int4; do
                flags=()
                [ "$q" = bf16 ] || flags=(--quantization "$q")
                run "sweep-$q" python benchmarks/decode_batch_sweep.py "${engine[@]}" \
                    "${flags[@]}" --input-len 128 --output-len 128 --num-iters 2 \
                    --batch-sizes 1 4 16 64 256 --output-json "$out/sweep-$q.json"
            done
            run sweep-plot python benchmarks/decode_batch_sweep.py --plot "$out"/sweep-bf16.json \
                "$out"/sweep-int8.json "$out"/sweep-int4.json --out "$out/decode_batch_sweep.png"
            ;;
        w2)
            for q in bf16 int8 int4; do
                flags=()
                [ "$q" = bf16 ] || flags=(--quantization "$q")
                run "w2-$q" python -m kvserve.cli bench throughput "${engine[@]}" "${flags[@]}" \
                    --workload w2 --output-json "$out/w2-$q.json"
            done
            ;;
        70b)
            run w1-70b-int4 python -m kvserve.cli bench latency --model llama-3-70b \
                --load-format dummy --dtype bfloat16 --disable-tqdm --quantization int4 \
                --max-model-len 4096 --input-len 128 --output-len 256 --num-iters 3 \
                --output-json "$out/w1-70b-int4.json"
            ;;
        peers)
            run peers python benchmarks/peers.py gptfast gptfast-int8 \
                --output-json "$out/peer-gptfast.json"
            ;;
        summary)
            python - "$out" <<'EOF'
import json, sys
from pathlib import Path

rows = []
for path in sorted(Path(sys.argv[1]).glob("*.json")):
    r = json.loads(path.read_text())
    if r.get("benchmark") == "latency" and r.get("decode_tok_s"):
        rows.append(f"| {path.stem} | {r['decode_tok_s']:.1f} decode tok/s, TPOT "
                    f"{r['mean_tpot_ms']:.2f} ms, MBU {100 * r['mbu_vs_copy']:.1f}% of copy, "
                    f"weights read {r['weight_read_bytes'] / 1e9:.2f} GB |")
    elif r.get("benchmark") == "throughput":
        rows.append(f"| {path.stem} | {r['output_tok_s']:,.0f} output tok/s, "
                    f"{r['total_tok_s']:,.0f} total tok/s |")
    elif r.get("benchmark") == "peers":
        for name, p in r["peers"].items():
            rows.append(f"| {name} | " + (p["error"] if "error" in p else
                        f"{p['decode_tok_s']:.1f} decode tok/s, MBU "
                        f"{100 * p['mbu_vs_copy']:.1f}% of copy") + " |")
    elif r.get("benchmark") == "decode_batch_sweep":
        for s in r["results"]:
            rows.append(f"| {path.stem} batch {s['batch_size']} | "
                        f"{s['decode_tok_s']:,.1f} decode tok/s |")
print("| run | figure |\n|---|---|")
print("\n".join(rows))
EOF
            ;;
        *) echo "unknown stage $stage" >&2; exit 2 ;;
    esac
done
exit $failed
