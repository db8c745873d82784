#!/usr/bin/env bash
# Kernel v2 (issue 27) on one H100: correctness and sync checks, the op table, the Trainer rows with host syncs.
#   bash tools/gpu/kernel_v2.sh [check] [ops SHAPES] [e2e MODELS]      results under $OUT
#   e2e: E2E_REPEATS (3) interleaved runs of E2E_STEPS (20) timed steps per method, the median reported; E2E_BATCH
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
while [ $# -gt 0 ]; do
  case "$1" in
    check) timeout 150 python3 benchmarks/check_v2_gpu.py 2>&1 | tail -12; shift ;;
    ops) python3 benchmarks/bench_linear_cross_entropy.py --suite "${OPS_SUITE:-v2}" --only "$2" --out-dir "$OUT/bench" --stem "${OPS_STEM:-bench_v2}" \
           --deadline-s "${OPS_DEADLINE:-240}" 2>&1 | grep -v -i warn | grep "^|" ; shift 2 ;;
    e2e) python3 benchmarks/bench_trainer.py --models "$2" --methods "${E2E_METHODS:-hf:0.1,hf_lsce:0.1,hf:0.0,hf_lsce:0.0}" \
           --out-dir "$OUT/e2e" --deadline-s "${E2E_DEADLINE:-300}" \
           --repeats "${E2E_REPEATS:-3}" --steps "${E2E_STEPS:-20}" ${E2E_BATCH:+--batch "$E2E_BATCH"} 2>&1 | grep "^|" ; shift 2 ;;
    *) echo "unknown step $1"; exit 2 ;;
  esac
done
