#!/usr/bin/env bash
# The GPU fast-path figures (issue "GPU fast path", item 5) on the llama-3-8b preset with random
# bf16 weights: `kvserve bench latency` (W1 prompt 128 and 4096, W6) and `kvserve bench
# throughput` (W2) with the default engine, W1 with --enforce-eager (no CUDA graphs), W1 and W2
# with --no-async-scheduling, W1 and the first 200 W2 requests with the torch reference
# attention (the oracle), then the peers
# (benchmarks/peers.py) on the same requests, then one summary table of every JSON in OUT_DIR.
#   benchmarks/fastpath_gpu.sh OUT_DIR [STAGE...]
# Stages, in order (default: all): latency throughput no-token-graphs no-async reference
# reference-w2 gptfast hf-static hf-batch summary. REFERENCE_W2_PROMPTS (default 200) sizes reference-w2.
# Run from the repository root on the GPU machine; gptfast needs .peers/gpt-fast (carry it).
# `summary` needs only Python: it also runs on a folder of JSON gathered from several calls.
set -euo pipefail
out=${1:?output directory}
shift
stages=${*:-latency throughput no-token-graphs no-async reference reference-w2 gptfast hf-static hf-batch summary}
REFERENCE_W2_PROMPTS=${REFERENCE_W2_PROMPTS:-200}
mkdir -p "$out"
source benchmarks/gpu_lib.sh
engine=(--model llama-3-8b --load-format dummy --dtype bfloat16 --disable-tqdm)

bench() {  # latency|throughput NAME FLAGS...: a failed run is reported and the others go on
    local command=$1 name=$2
    shift 2
    run "$name" python -m kvserve.cli bench "$command" "${engine[@]}" "$@" \
        --output-json "$out/$name.json"
}

for stage in $stages; do
    echo "== $stage" >&2
    case $stage in
        latency)
            bench latency w1-p128 --input-len 128 --output-len 256 --num-iters 5
            bench latency w1-p4096 --input-len 4096 --output-len 256 --num-iters 3
            bench latency w6 --input-len 2048 --output-len 1 --num-iters 10 --num-iters-warmup 2
            bench latency w1-p128-eager --enforce-eager --input-len 128 --output-len 256 \
                --num-iters 3
            ;;
        throughput)
            bench throughput w2 --workload w2
            bench throughput w2-first200 --workload w2 --num-prompts 200
            ;;
        no-token-graphs)  # prefill and mixed steps run eagerly (decision 0010)
            bench throughput w2-no-token-graphs --cuda-graph-token-sizes --workload w2
            ;;
        no-async)  # the host's work between steps is not overlapped with the device's
            bench latency w1-p128-no-async --no-async-scheduling --input-len 128 \
                --output-len 256 --num-iters 5
            bench throughput w2-no-async --no-async-scheduling --workload w2
            ;;
        reference)
            bench latency w1-p128-torch --attention-backend torch --input-len 128 \
                --output-len 256 --num-iters 3
            ;;
        reference-w2)  # slow: every decode step loops over the requests in Python
            bench throughput "w2-first${REFERENCE_W2_PROMPTS}-torch" --attention-backend torch \
                --workload w2 --num-prompts "$REFERENCE_W2_PROMPTS"
            ;;
        gptfast | hf-static | hf-batch)  # one process each: compiled state and memory stay apart
            run "$stage" python benchmarks/peers.py "$stage" --num-prompts 200 \
                --output-json "$out/peer-$stage.json"
            ;;
        summary)
            python - "$out" <<'EOF'
import json, sys
from pathlib import Path

def host(r):
    """The device's idle share (waiting for the host) and the host's busy share."""
    stats = r.get("engine_stats")  # older JSON has none
    if stats is None:
        return ""
    text = f", device idle {100 * stats['host_share']:.1f}%"
    if "host_busy_share" in stats:
        text += f", host busy {100 * stats['host_busy_share']:.1f}%"
    return text


rows = []
for path in sorted(Path(sys.argv[1]).glob("*.json")):
    r = json.loads(path.read_text())
    rates = f"{r['copy_gb_s']:,.0f} | {r['matmul_tflop_s']:,.0f}"
    if r["benchmark"] == "latency":
        decode = r["decode_tok_s"]
        figure = f"TTFT {r['mean_ttft_ms']:.1f} ms" + ("" if decode is None else (
            f", {decode:.1f} decode tok/s, TPOT {r['mean_tpot_ms']:.2f} ms, "
            f"MBU {100 * r['mbu_vs_copy']:.1f}% of copy"))
        figure += f", prefill MFU {100 * r['prefill_mfu']:.1f}%"
        figure += host(r)
        rows.append((path.stem, r["card"], f"latency: batch {r['batch_size']}, prompt "
                     f"{r['input_len']}, {r['output_len']} new", figure, rates))
    elif r["benchmark"] == "throughput":
        rows.append((path.stem, r["card"], f"throughput: {r['workload']}, {r['num_requests']} "
                     "requests", f"{r['output_tok_s']:,.0f} output tok/s, {r['total_tok_s']:,.0f} "
                     f"total tok/s, {r['requests_per_s']:.2f} req/s, {r['elapsed_s']:.1f} s, "
                     f"{100 * r['compute_roofline_share']:.1f}% of matmul{host(r)}", rates))
    else:
        for name, p in r["peers"].items():
            if "error" in p:
                figure, what = f"failed: {p['error'][:120]}", name
            elif p["workload"] == "w1":
                what = f"{name}: batch 1, prompt {p['input_len']}, {p['output_len']} new"
                figure = (f"TTFT {p['ttft_ms']:.1f} ms, {p['decode_tok_s']:.1f} decode tok/s, "
                          f"MBU {100 * p['mbu_vs_copy']:.1f}% of copy")
            else:
                what = f"{name}: {p['workload']}, {p['num_requests']} requests ({p['attention']})"
                figure = (f"{p['output_tok_s']:,.0f} output tok/s, {p['total_tok_s']:,.0f} total "
                          f"tok/s, {p['requests_per_s']:.2f} req/s, {p['elapsed_s']:.1f} s")
            rows.append((path.stem, r["card"], what, figure, rates))
commits = sorted({str(json.loads(p.read_text()).get("commit")) for p in Path(sys.argv[1]).glob("*.json")})
print(f"commit(s): {', '.join(commits)}\n")
print("| run | card | workload | figure | copy GB/s | matmul TFLOP/s |\n|---|---|---|---|---|---|")
for row in rows:
    print("| " + " | ".join(row) + " |")
EOF
            ;;
        *)
            echo "unknown stage '$stage'; known: latency throughput no-async reference reference-w2" \
                "gptfast hf-static hf-batch summary" >&2
            exit 2
            ;;
    esac
done
exit $failed
