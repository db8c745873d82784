#!/usr/bin/env bash
# One device call, its steps in order (results under $OUT, or ./gpu_out):
#   bash tools/gpu/gpu_run.sh [check] [ops SHAPES] [trainer MODELS]
#     check            benchmarks/check_gpu.py: every training path, trainable and frozen head, against fp64;
#                      compiled and in CUDA graphs
#     ops SHAPES       benchmarks/bench_linear_cross_entropy.py at those shapes (OPS_ARGS: more options)
#     trainer MODELS   benchmarks/bench_trainer.py (TRAINER_ARGS: more options, e.g. "--repeats 3 --methods ...")
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
while [ $# -gt 0 ]; do
  case "$1" in
    check) python3 benchmarks/check_gpu.py --out-dir "$OUT" > "$OUT/check_gpu.log" 2>&1; grep -a "^|\|failed" "$OUT/check_gpu.log" | tail -60; shift ;;
    ops) python3 benchmarks/bench_linear_cross_entropy.py --shapes "$2" --out-dir "$OUT" ${OPS_ARGS:-} > "$OUT/ops.log" 2>&1
         grep -a "^|" "$OUT/ops.log"; shift 2 ;;
    trainer) python3 benchmarks/bench_trainer.py --models "$2" --out-dir "$OUT" ${TRAINER_ARGS:-} > "$OUT/trainer.log" 2>&1
             grep -a "^|\|^{.*error" "$OUT/trainer.log" | cut -c1-400; shift 2 ;;
    *) echo "unknown step $1"; exit 2 ;;
  esac
done
