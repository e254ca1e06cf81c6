#!/usr/bin/env bash
# The verify-step checks of decision 0038 on one GPU: the GPU tests of
# speculative decoding (verify graphs vs eager vs plain at batch 1 and 8, k in {1, 2, 4}; the
# verify layout with fused rotary; every method), then the oracle on the llama-3-8b preset at
# batch 1, k = 4, alpha = 0.8 with async scheduling and without (the verify / plain step ratio
# of each), then the full oracle grid (k in {2, 4, 6} x alpha in {0.6, 0.8, 0.95}); `profile`
# lists the kernels of plain and verify steps (oracle k = 4) and times the skinny GEMM at the
# row counts of a plain and a verify step (the down projection also with its SiLU gate fused).
#   benchmarks/spec_verify_gpu.sh OUT_DIR [STAGE...]
# Stages, in order (default: all but profile): tests oracle-k4 oracle-k4-read-first
# oracle-k4-sync oracle-grid profile (read-first: async steps, each speculative step read
# before the next is planned).
# Run from the repository root on the GPU machine; JSON and logs land in OUT_DIR.
set -euo pipefail
out=${1:?output directory}
shift
stages=${*:-tests oracle-k4 oracle-k4-read-first oracle-k4-sync oracle-grid}
mkdir -p "$out"
source benchmarks/gpu_lib.sh

for stage in $stages; do
    case $stage in
        tests)
            run tests python -m pytest -q -m gpu tests/gpu/test_spec_decode_gpu.py \
                tests/gpu/test_cuda_graphs_gpu.py > "$out/tests.log" 2>&1
            tail -15 "$out/tests.log"
            ;;
        oracle-k4)
            run oracle-k4 python benchmarks/spec_decode.py --out "$out/oracle-k4" \
                --parts oracle --oracle-ks 4 --oracle-alphas 0.8
            ;;
        oracle-k4-read-first)
            run oracle-k4-read-first python benchmarks/spec_decode.py \
                --out "$out/oracle-k4-read-first" --parts oracle --oracle-ks 4 \
                --oracle-alphas 0.8 --no-plan-ahead
            ;;
        oracle-k4-sync)
            run oracle-k4-sync python benchmarks/spec_decode.py --out "$out/oracle-k4-sync" \
                --parts oracle --oracle-ks 4 --oracle-alphas 0.8 --no-async-scheduling
            ;;
        oracle-grid)
            run oracle-grid python benchmarks/spec_decode.py --out "$out/oracle-grid" \
                --parts oracle
            ;;
        profile)
            preset=(--model llama-3-8b --load-format dummy --dtype bfloat16 --output-len 64)
            oracle='{"method": "oracle", "num_speculative_tokens": 4, "acceptance_rate": 0.8,
                "forced_acceptance": true, "auto_disable": false}'
            run profile-plain python benchmarks/profile_decode.py "${preset[@]}" \
                > "$out/profile-plain.txt"
            run profile-verify python benchmarks/profile_decode.py "${preset[@]}" \
                --speculative-config "$oracle" > "$out/profile-verify.txt"
            run skinny python benchmarks/skinny_gemm.py --no-sweep --gated --rows 1,5 \
                --json "$out/skinny.json" > "$out/skinny.txt"
            tail -n 30 "$out/profile-plain.txt" "$out/profile-verify.txt" "$out/skinny.txt"
            ;;
        *)
            echo "unknown stage: $stage" >&2
            exit 2
            ;;
    esac
done
exit $failed
