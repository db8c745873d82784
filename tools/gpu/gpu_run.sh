#!/usr/bin/env bash
# One device call, its steps in order (results under $OUT, or ./gpu_out):
#   bash tools/gpu/gpu_run.sh [env] [check [SECTIONS]] [ops SHAPES] [trainer MODELS]
#     env              hf-lsce env with TMA, under HF_LSCE_TMA=0, and as an A100 (sm80) and a T4 (sm75) compile for
#                      (TRITON_OVERRIDE_ARCH): the text of each, timed cold (Triton's cache empty) and warm, into
#                      env.log, and each --json report into env_MODE.json
#     check [SECTIONS] benchmarks/check_gpu.py: every training path, trainable and frozen head, against fp64;
#                      compiled and in CUDA graphs (SECTIONS: a comma-separated subset, e.g. behaviour,edge)
#     ops SHAPES       benchmarks/bench_linear_cross_entropy.py at those shapes (OPS_ARGS: more options)
#     trainer MODELS   benchmarks/bench_trainer.py (TRAINER_ARGS: more options, e.g. "--repeats 3 --methods ...")
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
while [ $# -gt 0 ]; do
  case "$1" in
    env) for mode in tma pointers sm80 sm75; do
           case $mode in tma) vars="";; pointers) vars="HF_LSCE_TMA=0";; *) vars="TRITON_OVERRIDE_ARCH=$mode";; esac
           rm -rf ~/.triton/cache
           echo "== hf-lsce env, $mode (${vars:-defaults}), Triton's cache empty" >> "$OUT/env.log"
           start=$(date +%s.%N); env $vars python3 -m hf_lsce.cli env >> "$OUT/env.log" 2>&1; rc=$?
           echo "exit $rc, $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $start}") s" >> "$OUT/env.log"
           start=$(date +%s.%N); env $vars python3 -m hf_lsce.cli env --json > "$OUT/env_$mode.json" 2>> "$OUT/env.log"
           echo "== the same, --json, Triton's cache warm: exit $?, $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $start}") s" >> "$OUT/env.log"
         done
         grep -a "^==\|^exit\|FAIL\|self-test:\|^  [bf][fp]" "$OUT/env.log"; shift ;;
    check) sections=""; case "${2:-}" in ""|env|check|ops|trainer) ;; *) sections="--sections $2";; esac
           python3 benchmarks/check_gpu.py --out-dir "$OUT" $sections > "$OUT/check_gpu.log" 2>&1
           grep -a "^|\|failed" "$OUT/check_gpu.log" | tail -60; [ -n "$sections" ] && shift; shift ;;
    ops) python3 benchmarks/bench_linear_cross_entropy.py --shapes "$2" --out-dir "$OUT" ${OPS_ARGS:-} > "$OUT/ops.log" 2>&1
         grep -a "^|" "$OUT/ops.log"; shift 2 ;;
    trainer) python3 benchmarks/bench_trainer.py --models "$2" --out-dir "$OUT" ${TRAINER_ARGS:-} > "$OUT/trainer.log" 2>&1
             grep -a "^|\|^{.*error" "$OUT/trainer.log" | cut -c1-400; shift 2 ;;
    *) echo "unknown step $1"; exit 2 ;;
  esac
done
