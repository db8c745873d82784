#!/usr/bin/env bash
# The device calls of one GPU session, one step per call (each carries what it needs: see docs/benchmarks.md).
#   bash tools/gpu/gpu_session.sh STEP [STAGE_PART]      (STEP: trainer-config, stage-only, real, table1, ats, sweep, probe)
# STAGE_PART (a file under .gpu/stage): checked and moved to /tmp/stage first (tools/gpu/gpu_stage.py).
# Every step writes under $OUT/STEP and packs it into $OUT/STEP.tar.gz (one file comes back).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
STEP=$1; PART=${2:-}
R=$OUT/$STEP; mkdir -p "$R"
[ -n "$PART" ] && python3 tools/gpu/gpu_stage.py put "$PART" --to /tmp/stage
# The tokenizer converted from Gemma-3's GGUF by the device's transformers differs from the one converted here (14.5
# against 33.4 MB; ' A' after "Answer:" is not one token there): carried as .gpu/tok/gemma (gzip), it replaces it.
# (carried in this call, or by an earlier call of this warm machine that ran with KEEP_TOK=1: kept in /tmp/tok)
[ -n "${KEEP_TOK:-}" ] && [ -d .gpu/tok/gemma ] && mkdir -p /tmp/tok && cp -r .gpu/tok/gemma /tmp/tok/
fix_gemma_tokenizer() {
  local D T=.gpu/tok/gemma; D=$(ls -d /tmp/hf_lsce_cache/models/gemma-3-270m*/ 2>/dev/null | head -1)
  [ -f $T/tokenizer.json.gz ] || T=/tmp/tok/gemma
  if [ -n "$D" ] && [ -f $T/tokenizer.json.gz ]; then
    zcat $T/tokenizer.json.gz > "$D/tokenizer.json" && cp $T/tokenizer_config.json "$D/" \
      && echo "gemma tokenizer replaced in $D"
  fi
}
# Table 1's steps: both staged checkpoints joined (G, S), Gemma's converted with its tokenizer replaced, /tmp/t1 made
both_checkpoints() {
  G=$(python3 tools/gpu/gpu_stage.py join gemma-3-270m-q4_k_m.gguf --to /tmp/stage | tail -1) || exit 3
  S=$(python3 tools/gpu/gpu_stage.py join SmolLM2-135M-Instruct.Q4_1.gguf --to /tmp/stage | tail -1) || exit 3
  mkdir -p /tmp/t1
  python3 -c "from hf_lsce.checkpoints import resolve_model_path as r; r('$G')" >/dev/null 2>&1; fix_gemma_tokenizer
}
case $STEP in
  trainer-config)  # Trainer bf16 throughput on a real configuration with random weights
    timeout 280 python3 benchmarks/bench_trainer.py --models llama3.2-1b --batch 8 --seq 1024 --steps 6 --deadline-s 200 \
      --out-dir "$R" 2>&1 | tee "$R/trainer.log"
    ;;
  stage-only)
    ls -la /tmp/stage | tee "$R/stage.txt"
    ;;
  real)  # the Trainer on the staged real checkpoints (Gemma-3-270m, SmolLM2-135M-Instruct), largest batch of Gemma's
    G=$(python3 tools/gpu/gpu_stage.py join gemma-3-270m-q4_k_m.gguf --to /tmp/stage | tail -1) || exit 3
    S=$(python3 tools/gpu/gpu_stage.py join SmolLM2-135M-Instruct.Q4_1.gguf --to /tmp/stage | tail -1) || S=""
    timeout ${TRAINER_S:-240} python3 benchmarks/bench_trainer.py --models "$G${S:+,$S}" --batch 8 --seq 1024 --steps 6 \
      --search "$G" --deadline-s $(( ${TRAINER_S:-240} - 50 )) --out-dir "$R" 2>&1 | tee "$R/trainer_real.log"
    ;;
  table1)  # the paper's Table 1 in miniature; resumable across calls (results kept in /tmp/t1 while the machine is warm)
    both_checkpoints
    # runs of an earlier machine, carried back as .gpu/t1 (table1.json, table1_probs.pt): resumed, not redone
    [ -f .gpu/t1/table1.json ] && [ ! -f /tmp/t1/table1.json ] && cp .gpu/t1/table1.json .gpu/t1/table1_probs.pt /tmp/t1/
    timeout ${TABLE1_S:-540} python3 benchmarks/table1.py --models "$G,$S" --resume ${LIMITS:+--limits "$LIMITS"} ${TABLE1_ARGS:-} \
      --deadline-s $(( ${TABLE1_S:-540} - 25 )) --out-dir /tmp/t1 2>&1 | tee -a /tmp/t1/table1.log
    cp /tmp/t1/table1* "$R"/ 2>/dev/null
    ;;
  ats)  # ATS and temperature scaling on SmolLM2-135M-Instruct
    S=$(python3 tools/gpu/gpu_stage.py join SmolLM2-135M-Instruct.Q4_1.gguf --to /tmp/stage | tail -1) || exit 3
    timeout ${ATS_S:-240} python3 benchmarks/table1.py --ats --ats-model "$S" --deadline-s $(( ${ATS_S:-240} - 40 )) \
      --out-dir "$R" 2>&1 | tee "$R/ats.log"
    ;;
  sweep)  # hf-lsce sweep on a staged GGUF (GGUF=..., default SmolLM2-135M-Instruct): short SFT runs over b
    S=$(python3 tools/gpu/gpu_stage.py join ${GGUF:-SmolLM2-135M-Instruct.Q4_1.gguf} --to /tmp/stage | tail -1) || exit 3
    python3 -c "from hf_lsce.checkpoints import resolve_model_path as r; r('$S')" >/dev/null 2>&1; fix_gemma_tokenizer
    timeout ${SWEEP_S:-560} python3 -m hf_lsce.cli sweep --model "$S" --budget gpu --b ${B:-0,0.05,0.1,0.2,0.3} \
      --dataset ${DATASET:-.gpu/data/shared/alpaca/alpaca_en_demo.json} --eval-tasks ${TASKS:-arc_easy,sciq,boolq,mmlu} \
      --limit ${LIMIT:-400} --steps ${STEPS:-60} --output-dir "$R/sweep" 2>&1 | grep -av "it/s\]\|s/it\]" | tail -40
    rm -rf "$R"/sweep/sft_b*
    ;;
  probe)  # hf-lsce diagnose --probe on a staged GGUF (GGUF=..., default SmolLM2): the state diagnosis, then the
          # measured probe (two short SFT runs at 0 and b on the Alpaca-style set), whose verdict is the prediction
    S=$(python3 tools/gpu/gpu_stage.py join ${GGUF:-SmolLM2-135M-Instruct.Q4_1.gguf} --to /tmp/stage | tail -1) || exit 3
    python3 -c "from hf_lsce.checkpoints import resolve_model_path as r; r('$S')" >/dev/null 2>&1; fix_gemma_tokenizer
    timeout ${PROBE_S:-560} python3 -m hf_lsce.cli diagnose "$S" --tasks ${TASKS:-arc_easy,sciq,boolq,mmlu} \
      --limit ${LIMIT:-400} --records 64 --probe gpu --probe-data ${DATASET:-.gpu/data/shared/alpaca/alpaca_en_demo.json} \
      --seed ${SEED:-0} --probe-dir "$R/probe" --json "$R/diagnose.json" --figure "$R/diagnose.png" > "$R/diagnose.log" 2>&1
    grep -av "it/s\]\|s/it\]\|examples/s" "$R/diagnose.log" | tail -45
    rm -rf "$R"/probe/sft_b*
    ;;
  *) echo "unknown step $STEP"; exit 2 ;;
esac
rm -rf "$R"/sft_tmp "$R"/ats_ATS "$R"/ats_temperature
tar -czf "$OUT/$STEP.tar.gz" -C "$OUT" "$STEP" && rm -rf "$R"
ls -la "$OUT"
