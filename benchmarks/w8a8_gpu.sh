#!/usr/bin/env bash
# INT8 SmoothQuant W8A8 on one GPU (issue 18, item 2), llama-3-8b preset with random weights
# rounded at load: the GPU tests, the W8A8 GEMMs against bf16 (benchmarks/fp8_gemm.py, FP8 and
# INT8 paths), W2 (kvserve bench throughput --workload w2) for bf16 / w8a8-int8 / fp8 on the
# same machine, then a summary with W2's output tok/s against bf16 (target: w8a8-int8 >= 1.4x).
#   benchmarks/w8a8_gpu.sh OUT_DIR [STAGE...]
# Stages (default: all): tests gemm w2 summary. Run from the repository root on the GPU machine.
set -euo pipefail
out=${1:?output directory}
shift
stages=${*:-tests gemm w2 summary}
mkdir -p "$out"
source benchmarks/gpu_lib.sh
engine=(--model llama-3-8b --load-format dummy --dtype bfloat16 --disable-tqdm)

for stage in $stages; do
    case $stage in
        tests)
            run gpu-tests python -m pytest -q tests/gpu/test_int8_w8a8_gpu.py \
                tests/gpu/test_fp8_linear_gpu.py
            ;;
        gemm)
            run gemm python benchmarks/fp8_gemm.py --types fp8 w8a8-int8 \
                --output-json "$out/w8a8_gemm.json"
            ;;
        w2)
            for q in bf16 w8a8-int8 fp8; do
                flags=()
                [ "$q" = bf16 ] || flags=(--quantization "$q")
                run "w2-$q" python -m kvserve.cli bench throughput "${engine[@]}" "${flags[@]}" \
                    --workload w2 --output-json "$out/w2-$q.json"
            done
            ;;
        summary)
            python - "$out" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
runs = {q: json.loads((out / f"w2-{q}.json").read_text())
        for q in ("bf16", "w8a8-int8", "fp8") if (out / f"w2-{q}.json").is_file()}
base = runs.get("bf16")
print("| W2 (llama-3-8b, 1,000 requests) | output tok/s | total tok/s | vs bf16 (output) |")
print("|---|---:|---:|---:|")
for q, r in runs.items():
    ratio = f"{r['output_tok_s'] / base['output_tok_s']:.2f}x" if base else "-"
    print(f"| {q} | {r['output_tok_s']:,.0f} | {r['total_tok_s']:,.0f} | {ratio} |")
gemm = out / "w8a8_gemm.json"
if gemm.is_file():
    g = json.loads(gemm.read_text())
    print(f"\n{g['card']}: 8192^3 bf16 {g['bf16_tflop_s']:.0f} TFLOP/s, "
          f"fp8 {g.get('fp8_tflop_s', 0):.0f} TFLOP/s, int8 {g.get('int8_tops', 0):.0f} TOP/s")
    print("| linear | rows | bf16 µs | int8 µs | int8 vs bf16 | fp8 µs | fp8 vs bf16 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in g["rows"]:
        print(f"| {r['linear']} | {r['rows']} | {r['bf16_us']:.1f} | "
              f"{r.get('int8_us', float('nan')):.1f} | {r.get('int8_speedup', float('nan')):.2f}x"
              f" | {r.get('fp8_us', float('nan')):.1f} | {r.get('speedup', float('nan')):.2f}x |")
PY
            ;;
        *) echo "unknown stage $stage" >&2; exit 2 ;;
    esac
done
exit $failed
