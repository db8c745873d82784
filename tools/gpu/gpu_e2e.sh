#!/usr/bin/env bash
# One device call for the end-to-end GPU checks (issue 9): training curves on Alpaca-style data,
# then full training steps on real model shapes.
#   bash tools/gpu/gpu_e2e.sh [MODELS]     (data copied to .gpu/data; results under $OUT or ./gpu_out)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "${SKIP_CURVES:-0}" != 1 ]; then
  python3 benchmarks/train_curves_gpu.py --data .gpu/data/alpaca_en_demo.json --steps "${STEPS:-300}" --out-dir "$OUT" 2>&1 | grep -v "it/s\]" | tail -20
fi
python3 benchmarks/bench_training_step.py --models "${1:-llama3.2-1b,qwen3-1.7b,gemma2-2b}" --out-dir "$OUT" 2>&1 | grep -v Warning
