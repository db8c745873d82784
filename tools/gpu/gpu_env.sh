# Sourced by the device scripts: unbuffered output, $OUT, carried peer wheels on PYTHONPATH (installed once per
# warm machine), the repo importable, and where the carried data and the checkpoint cache live.
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  if [ ! -f /tmp/site/.installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && touch /tmp/site/.installed
  fi
fi
# installed by an earlier call of this warm machine, or by this one
[ -f /tmp/site/.installed ] && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export HF_LSCE_CACHE=/tmp/hf_lsce_cache                        # converted checkpoints, kept while warm
[ -d .gpu/data/shared ] && export HF_LSCE_SHARED_DATA=$PWD/.gpu/data/shared HF_LSCE_ALPACA=$PWD/.gpu/data/shared/alpaca/alpaca_en_demo.json
if [ -d .gpu/data/hf_datasets ]; then export HF_LSCE_HUB_DATA=$PWD/.gpu/data/hf_datasets; fi
true  # sourcing succeeds without staged data, so `source gpu_env.sh && ...` runs
