#!/usr/bin/env bash
# The op and the patched forward under torch.compile(fullgraph=True) and CUDA graphs (issue 27), one step per call:
#   bash tools/gpu/compile.sh check     benchmarks/check_compile_gpu.py: the op at two head shapes (eager, compiled,
#                                       compiled in a CUDA graph) and a patched SmolLM2-135M-config model
#   bash tools/gpu/compile.sh trainer   the bf16 Trainer with and without torch_compile=True, random-weight
#                                       SmolLM2-135M and Gemma-3-270m configurations
# No staging: configurations with random weights. Results under $OUT/compile.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
STEP=$1
R=$OUT/compile; mkdir -p "$R"
case $STEP in
  check)
    nvidia-smi --query-gpu=name --format=csv,noheader | tee "$R/device.txt"
    timeout ${CHECK_S:-560} python3 benchmarks/check_compile_gpu.py --out-dir "$R" ${ARGS:-} 2>&1 | grep -v Warning | tail -40
    ;;
  trainer)
    timeout ${TRAINER_S:-560} python3 benchmarks/bench_trainer.py --models ${MODELS:-smollm2-135m-config,gemma3-270m-config} \
      --batch 8 --seq 1024 --steps ${STEPS:-10} \
      --methods ${METHODS:-hf:0.1,hf_lsce:0.1,hf+compile:0.1,hf_lsce+compile:0.1} --out-dir "$R" 2>&1 | tail -30
    ;;
  *) echo "unknown step $STEP"; exit 2 ;;
esac
ls -la "$R"
