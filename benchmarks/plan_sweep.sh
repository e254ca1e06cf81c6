#!/usr/bin/env bash
# Issue 29: `kvserve plan` predicted against measured on one card, in one device call.
# Calibrates the card (cached under OUT_DIR/cache), sweeps llama-3-8b (random bf16 weights)
# over decode batch {1,8,32,128,256} x context {512,2048,8192} and prefill {128,512,2048,8192},
# fits the step model's constants to that sweep, then sweeps qwen2.5-7b with those constants
# (the out-of-sample check). docs/plan.md says what to copy where.
#   benchmarks/plan_sweep.sh OUT_DIR [GPU]     GPU: the table name, h100 (default) or h200
# MODEL, CHECK_MODEL, DEVICE (auto) and EXTRA (more plan flags, e.g. a small grid) override.
set -euo pipefail
out=${1:?output directory}; gpu=${2:-h100}
model=${MODEL:-llama-3-8b}; check_model=${CHECK_MODEL:-qwen2.5-7b}; device=${DEVICE:-auto}
read -r -a extra <<< "${EXTRA:-}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XDG_CACHE_HOME="$out/cache"
plan=(python -m kvserve.cli plan)
status=0
"${plan[@]}" --calibrate --device "$device"
# a sweep with a FAILED point still writes its JSON and exits 1: keep going, report at the end
"${plan[@]}" --gpu "$gpu" --model "$model" --measure --sweep --device "$device" \
    "${extra[@]}" --output-json "$out/sweep-model.json" --plot "$out/sweep-model.png" \
    | tee "$out/sweep-model.md" || status=1
"${plan[@]}" --fit "$out/sweep-model.json" --json > "$out/fit.json"
"${plan[@]}" --fit "$out/sweep-model.json" | tee "$out/fit.txt"
"${plan[@]}" --gpu "$gpu" --model "$check_model" --measure --sweep --device "$device" \
    "${extra[@]}" --constants "$out/fit.json" --output-json "$out/sweep-check-model.json" \
    | tee "$out/sweep-check-model.md" || status=1
exit $status
