#!/usr/bin/env bash
# The CPU A/B of decision 0044: two EAGLE heads for the bundled target, 400 equal steps
# each (same seed, same windows), with and without aux layers 2, 4, 5. From the repository
# root: bash benchmarks/results/2026-11-27-cpu-eagle-aux/run.sh OUT_DIR (about 30 minutes).
OUT=${1:?output directory}
for v in none:"" aux:"2,4,5"; do
  name=${v%%:*}; aux=${v#*:}
  python scripts/train_eagle_head.py --target kvserve/assets/models/kvserve-code-14m --out $OUT/$name \
    --packages torch,numpy --packages-max-mb 32 --minutes 60 --max-steps 400 --log-every 50 --batch-size 8 --seq-len 256 --warmup 50 \
    --eval-batches 4 --eval-prompts 24 --eval-new-tokens 64 --device cpu --aux-layers "$aux" > $OUT/$name.log 2>&1
done
