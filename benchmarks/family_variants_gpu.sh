#!/usr/bin/env bash
# Variants of the bundled family trained side by side, one per GPU (decision 0042's table):
# each runs scripts/train_default_model.py with the family's packages plus its own flags,
# then scripts/train_eagle_head.py for its target; a table of issue 28's figures comes last
# (benchmarks/family_table.py). Run from the repository root on a machine with a GPU per
# variant; each variant's directory, log and head land in OUT_DIR/NAME.
#   benchmarks/family_variants_gpu.sh OUT_DIR 'NAME[:FLAGS]' ...
#   benchmarks/family_variants_gpu.sh runs/v shipped 'short-chat:--sft-max-chars 1000' \
#       'long-chat:--sft-minutes 1.5'
# EAGLE_MINUTES (default 6; 0 skips the heads) sets each head's training time and EAGLE_FLAGS
# adds flags to its training (e.g. --aux-layers none). A variant's
# whole run takes about 12 + EAGLE_MINUTES minutes on an H100: start the script with
# setsid nohup when a call is limited to 10 minutes.
set -euo pipefail
out=${1:?output directory}
shift
(($# > 0)) || { echo "give at least one variant: NAME[:FLAGS]" >&2; exit 2; }
source benchmarks/gpu_lib.sh
packages=$(python -c "import sys; sys.path.insert(0, 'scripts'); \
import train_default_model as t; print(t.FAMILY_PACKAGES)")
mkdir -p "$out"
gpu=0
pids=()
for variant in "$@"; do
    name=${variant%%:*}
    flags=
    [[ $variant == *:* ]] && flags=${variant#*:}
    (
        export CUDA_VISIBLE_DEVICES=$gpu
        # shellcheck disable=SC2086  # the variant's flags split into words
        python scripts/train_default_model.py --out "$out/$name" --packages "$packages" \
            $flags > "$out/$name.log" 2>&1
        if [[ ${EAGLE_MINUTES:-6} != 0 ]]; then
            # shellcheck disable=SC2086  # EAGLE_FLAGS split into words
            python scripts/train_eagle_head.py --target "$(ls -d "$out/$name"/kvserve-code-[0-9]*)" \
                --out "$out/$name/kvserve-code-eagle-head" --minutes "${EAGLE_MINUTES:-6}" \
                ${EAGLE_FLAGS:-} \
                > "$out/$name-eagle.log" 2>&1
        fi
    ) &
    pids+=($!)
    gpu=$((gpu + 1))
done
for pid in "${pids[@]}"; do
    wait "$pid" || failed=1
done
python benchmarks/family_table.py "$out"/*/
exit $failed
