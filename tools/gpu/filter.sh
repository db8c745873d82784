#!/usr/bin/env bash
# Gradient filtering with a per-row bound (issue 27) on the GPU, one step per call:
#   bash tools/gpu/filter.sh check [STAGE_PART]   the filtered op on both paths against fp64 and the generator's
#                                                  figures (nothing to skip there); stages a GGUF part first
#   bash tools/gpu/filter.sh stage STAGE_PART      only stage one part of the Gemma-3 GGUF (.gpu/stage)
#   bash tools/gpu/filter.sh real [STAGE_PART]     Gemma-3-270m's real hidden states and head: what the filter
#                                                  skips and costs, the sparse kernels' sweep, the op table
#   bash tools/gpu/filter.sh trainer [STAGE_PART]  the real Gemma-3-270m through the bf16 Trainer, exact and filtered
# Carry the part and its manifest; the first call of a machine also carries .whl/gguf-* and .whl/cut_cross_entropy-*
# (installed once per machine), the `real` call .gpu/data/shared/alpaca (the text). Results under $OUT/filter.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
STEP=$1; PART=${2:-}
R=$OUT/filter; mkdir -p "$R"
[ -n "$PART" ] && python3 tools/gpu/gpu_stage.py put "$PART" --to /tmp/stage && ls /tmp/stage
case $STEP in
  stage) ;;
  check)
    nvidia-smi --query-gpu=name --format=csv,noheader | tee "$R/device.txt"
    timeout ${CHECK_S:-400} python3 benchmarks/check_filter_gpu.py --check --regimes realistic --eps ${EPS:-4,8} \
      --out-dir "$R" 2>&1 | tail -40
    ;;
  real)
    G=$(python3 tools/gpu/gpu_stage.py join gemma-3-270m-q4_k_m.gguf --to /tmp/stage | tail -1) || exit 3
    [ -f /tmp/gemma_real.pt ] || python3 benchmarks/real_inputs.py capture --model "$G" --tokens 8192 \
      --out /tmp/gemma_real.pt --with-head 2>&1 | tail -3
    timeout ${CHECK_S:-200} python3 benchmarks/check_filter_gpu.py --real-inputs /tmp/gemma_real.pt --regimes real \
      ${SWEEP---sweep} --eps ${EPS:-6,8,10} --out-dir "$R" 2>&1 | tail -60
    timeout ${BENCH_S:-240} python3 benchmarks/bench_linear_cross_entropy.py --suite filter --real-inputs /tmp/gemma_real.pt \
      --stem bench_filter --out-dir "$R" 2>&1 | tail -40
    ;;
  trainer)
    G=$(python3 tools/gpu/gpu_stage.py join gemma-3-270m-q4_k_m.gguf --to /tmp/stage | tail -1) || exit 3
    timeout ${TRAINER_S:-400} python3 benchmarks/bench_trainer.py --models "$G" --batch 8 --seq 1024 --steps ${STEPS:-10} \
      --methods ${METHODS:-hf:0.1,hf_lsce:0.1,hf_lsce_f6:0.1,hf_lsce_f8:0.1,hf_lsce:0.1} --out-dir "$R" 2>&1 | tail -30
    ;;
  *) echo "unknown step $STEP"; exit 2 ;;
esac
ls -la "$R"
