#!/usr/bin/env bash
# W4 of ../shared/BENCHMARKS.md: kvserve serve on a preset with random weights, loaded over
# HTTP by `kvserve bench serve` with Poisson arrivals, one result JSON per request rate.
#   benchmarks/serving_w4.sh OUT_DIR "inf,16,4" [MODEL] [NUM_PROMPTS]
set -euo pipefail
out=${1:?output directory}; rates=${2:-"inf,16,4,1"}; model=${3:-llama-3-8b}; num=${4:-500}
port=8011
mkdir -p "$out"
source benchmarks/gpu_lib.sh
start_server "$out/server.log" "$port" --model "$model" --load-format dummy --dtype bfloat16 \
    --max-model-len 4096
# the preset has no tokenizer: the byte tokenizer makes ~4 prompt tokens per
# requested "token" of random words, so 256 here is about 1,000 prompt tokens
python -m kvserve.cli bench serve --base-url "http://127.0.0.1:$port" --num-prompts "$num" \
    --random-input-len 256 --random-output-len 128 --ignore-eos --request-rate "$rates" \
    --save-result --result-dir "$out" --disable-tqdm --seed 0
