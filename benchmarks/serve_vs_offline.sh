#!/usr/bin/env bash
# Issue 20's targets, one GPU, one call: offline `kvserve bench throughput` against
# `kvserve serve` + `kvserve bench serve` on the same shape (256 requests of ~1,000 prompt
# and 256 output tokens, ignore_eos, all at once), the server with its engine core in its
# own process and in the server's process; W2 (1,000 requests, the same token-id prompts)
# offline and through both servers; then TTFT / TPOT at 1 request/s for both.
#   benchmarks/serve_vs_offline.sh OUT_DIR [MODEL] [NUM_PROMPTS]
# Writes OUT_DIR/{offline,offline-w2,serve-<core>-{inf,w2,1}}.json and OUT_DIR/summary.json:
# serve / offline output tok/s per core mode, burst and W2 (target >= 0.95 for "process"),
# and the p50 TTFT / TPOT at 1 req/s per mode ("process" no worse than "inproc").
set -euo pipefail
out=${1:?output directory}; model=${2:-llama-3-8b}; num=${3:-256}
mkdir -p "$out"
port=8012
common=(--model "$model" --load-format dummy --dtype bfloat16 --max-model-len 4096)
source benchmarks/gpu_lib.sh

python -m kvserve.cli bench throughput "${common[@]}" --workload w3 --num-prompts "$num" \
    --max-output-len 256 --output-json "$out/offline.json" --disable-tqdm
python -m kvserve.cli bench throughput "${common[@]}" --workload w2 \
    --output-json "$out/offline-w2.json" --disable-tqdm

for core in process inproc; do
    start_server "$out/server-$core.log" "$port" "${common[@]}" --engine-core "$core"
    # the preset has no tokenizer: the byte tokenizer makes ~4 prompt tokens per
    # requested "token" of random words, so 256 here is about 1,000 prompt tokens
    bench=(python -m kvserve.cli bench serve --base-url "http://127.0.0.1:$port"
           --random-input-len 256 --random-output-len 256 --ignore-eos --seed 0
           --save-result --result-dir "$out" --disable-tqdm)
    "${bench[@]}" --num-prompts "$num" --request-rate inf --result-filename "serve-$core-inf.json"
    "${bench[@]}" --dataset-name w2 --workload-vocab-size 128000 --num-prompts 1000 \
        --request-rate inf --result-filename "serve-$core-w2.json"
    "${bench[@]}" --num-prompts 64 --request-rate 1 --result-filename "serve-$core-1.json"
    stop_server
done

python - "$out" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
load = lambda name: json.loads((out / name).read_text())
offline = load("offline.json")
offline_tok_s = offline["output_tok_s"]
w2_tok_s = load("offline-w2.json")["output_tok_s"]
summary = {"offline_output_tok_s": offline_tok_s, "offline_w2_output_tok_s": w2_tok_s}
for core in ("process", "inproc"):
    burst, slow = load(f"serve-{core}-inf.json"), load(f"serve-{core}-1.json")
    w2 = load(f"serve-{core}-w2.json")
    summary[core] = {"serve_output_tok_s": burst["output_throughput"],
                     "serve_over_offline": burst["output_throughput"] / offline_tok_s,
                     "serve_w2_output_tok_s": w2["output_throughput"],
                     "serve_w2_over_offline": w2["output_throughput"] / w2_tok_s,
                     "mean_ttft_ms_burst": burst["mean_ttft_ms"],
                     "p50_ttft_ms_at_1rps": slow["median_ttft_ms"],
                     "p50_tpot_ms_at_1rps": slow["median_tpot_ms"]}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=2))
EOF
