#!/usr/bin/env bash
# EAGLE head variants for the bundled target, trained and measured side by side: each runs
# scripts/train_eagle_head.py with its own flags (the script's engine evaluation included),
# then benchmarks/spec_decode.py's real part with that head beside plain decoding; a table
# comes last (benchmarks/eagle_table.py). Variants spread over the visible GPUs, one after
# another on each; each lands in OUT_DIR/NAME (head, log) and OUT_DIR/NAME-real (benchmark).
#   benchmarks/eagle_heads_gpu.sh OUT_DIR 'NAME[:FLAGS]' ...
#   benchmarks/eagle_heads_gpu.sh runs/h 'final-only:--aux-layers none' auto
# Variants on different GPUs run at once and share the host: compare their α and tokens per
# verification; the 14M target's tok/s is host time and moves with the load.
# CUDA_VISIBLE_DEVICES, when set, names the GPUs to use (e.g. 1 leaves GPU 0 to another job).
# EAGLE_MINUTES (default 6) sets each head's training time. A variant takes about
# EAGLE_MINUTES + 3 minutes on an H100: start the script with setsid nohup when a call is
# limited to 10 minutes.
set -euo pipefail
out=${1:?output directory}
shift
(($# > 0)) || { echo "give at least one variant: NAME[:FLAGS]" >&2; exit 2; }
source benchmarks/gpu_lib.sh
if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
    IFS=, read -ra gpus <<< "$CUDA_VISIBLE_DEVICES"
else
    mapfile -t gpus < <(seq 0 $(($(nvidia-smi -L | wc -l) - 1)))
fi
num_gpus=${#gpus[@]}
mkdir -p "$out"
variant_run() {  # NAME FLAGS: train, then benchmark the head
    local name=$1 flags=$2
    # shellcheck disable=SC2086  # the variant's flags split into words
    python scripts/train_eagle_head.py --out "$out/$name" \
        --minutes "${EAGLE_MINUTES:-6}" $flags > "$out/$name.log" 2>&1 || return 1
    python benchmarks/spec_decode.py --parts real --real-methods eagle \
        --eagle-head "$out/$name" --out "$out/$name-real" > "$out/$name-real.log" 2>&1
}
pids=()
for ((gpu = 0; gpu < num_gpus && gpu < $#; gpu++)); do
    (
        export CUDA_VISIBLE_DEVICES=${gpus[$gpu]}
        status=0
        index=0
        for variant in "$@"; do  # this GPU's share: every num_gpus-th variant
            if ((index % num_gpus == gpu)); then
                flags=
                [[ $variant == *:* ]] && flags=${variant#*:}
                variant_run "${variant%%:*}" "$flags" || status=1
            fi
            index=$((index + 1))
        done
        exit $status
    ) &
    pids+=($!)
done
for pid in "${pids[@]}"; do
    wait "$pid" || failed=1
done
names=()
for variant in "$@"; do names+=("$out/${variant%%:*}"); done
python benchmarks/eagle_table.py "${names[@]}" || failed=1
exit $failed
