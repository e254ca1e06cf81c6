#!/usr/bin/env bash
# Decision 0046's figures: the shipped EAGLE head as it is and restricted to the 2,048 and
# 4,096 most frequent training tokens (no retraining), each measured by the script's engine
# evaluation on 24 held-out prompts, k = 4, on a CPU. Run from the repository root.
set -euo pipefail
out=$(dirname "$0")
export PYTHONPATH=$PWD
head=kvserve/assets/models/kvserve-code-eagle-head
for vocab in 0 2048 4096; do
    name=$([[ $vocab == 0 ]] && echo full || echo "$vocab")
    python scripts/train_eagle_head.py --from-head "$head" --draft-vocab "$vocab" \
        --out "runs/eagle-draft-vocab-$name" --device cpu --eval-batches 2 --eval-prompts 24 \
        2>&1 | grep "^\[train_eagle_head\]" > "$out/head-$name.log"
    cp "runs/eagle-draft-vocab-$name/train_log.json" "$out/train_log-$name.json"
done
