#!/usr/bin/env bash
# Decision 0045's table: the bundled model through kvserve on a CPU, greedy, repetition
# penalty 1.1, with DRY at several settings (no sequence breakers), then with the model's
# own generation_config defaults, offline and through `kvserve serve` (requests that send only
# their prompt or messages and max_tokens). Run from the repository root; about 3 minutes a setting
# on 2 cores (the last run, with bits per byte over 64 windows and the draft's α, longer).
set -euo pipefail
out=$(dirname "$0")
export PYTHONPATH=$PWD
for setting in "0.8 6" "0.8 8" "0.8 10" "1.2 8"; do
    read -r multiplier allowed <<< "$setting"
    python benchmarks/bundled_model_quality.py --device cpu --repetition-penalty 1.1 \
        --draft '' --heldout-windows 4 --out "$out/dry-$multiplier-$allowed.json" \
        --sampling "{\"dry_multiplier\": $multiplier, \"dry_allowed_length\": $allowed,
                     \"dry_sequence_breakers\": []}"
done
python benchmarks/bundled_model_quality.py --device cpu --model-defaults \
    --heldout-windows 64 --out "$out/model-defaults.json"
kvserve serve --port 8123 > "$out/serve.log" 2>&1 &
server=$!
trap 'kill $server' EXIT
until curl -sf http://127.0.0.1:8123/ready > /dev/null; do sleep 2; done
python benchmarks/bundled_model_quality.py --device cpu --url http://127.0.0.1:8123 \
    --draft '' --heldout-windows 4 --out "$out/server.json"
