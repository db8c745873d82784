#!/usr/bin/env bash
# One device call: install carried peer wheels (if any), GPU correctness check, benchmark suite.
#   bash tools/gpu/gpu_run.sh [SUITE]      (SUITE: quick | main | full; results under $OUT or ./gpu_out)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
if [ "${SKIP_CHECK:-0}" != 1 ]; then
  python3 benchmarks/check_correctness_gpu.py --out "$OUT/correctness_gpu.json" 2>&1 | tee "$OUT/correctness_gpu.log"
fi
python3 benchmarks/bench_linear_cross_entropy.py --suite "${1:-main}" --out-dir "$OUT/bench" 2>&1 | tee "$OUT/bench.log"
