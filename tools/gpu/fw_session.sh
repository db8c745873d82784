#!/bin/bash
# The frameworks' runs on the device machine (tools/frameworks_gpu.py), one step per device call, back to back
# (the staged parts last while the machine is warm). FW_ARCHIVE names the staged wheels: fw_wheels.tar (Axolotl 0.19's,
# the default), lf_wheels.tar (LLaMA-Factory's), ax21_wheels.tar (Axolotl 0.21's, with torch 2.13 and Triton 3.7) or
# ax21lite_wheels.tar (the same without torch, triton and nvidia_*: 3 parts instead of 21, the image's torch serves;
# `frameworks_gpu.py prepare --wheels DIR --archive ax21lite_wheels.tar` on a folder of those wheels);
# each installs into its own folder, /tmp/site_<name>, with the wheels of .gpu/extra and of .gpu/extra_<name> if there
# is one (carry them) that the archive does not hold itself. FW_SKIP="torch triton" installs the archive without those
# distributions (another folder: the image's own torch then serves; skipping torch skips the nvidia_* and torchvision
# wheels too, which go with a torch: Axolotl 0.21's hold NCCL 2.29.7, which torch 2.13 needs and the image lacks,
# and torchvision 0.28, since transformers imports the image's torchvision, built for the image's torch).
#   bash tools/gpu/fw_session.sh put K        # call K (0, 1, ...): one part of .gpu/stage/$FW_ARCHIVE (carry it)
#   bash tools/gpu/fw_session.sh go CMD ...   # join the parts, install the wheels (once per warm machine), then CMD
#                                             # with that folder first on PATH and PYTHONPATH (axolotl starts
#                                             # accelerate from PATH)
set -euo pipefail
archive="${FW_ARCHIVE:-fw_wheels.tar}"
name="${archive%.tar}"
skip="${FW_SKIP:-}"
site="/tmp/site_${name}${skip:+_without_${skip// /_}}"
dist() { basename "$1" | cut -d- -f1 | tr 'A-Z' 'a-z'; }   # a wheel's distribution name, lower case
# true for a distribution that goes with torch (its CUDA libraries, torchvision) when FW_SKIP leaves torch out
with_torch() { [[ " $skip " == *" torch "* && ( $1 == nvidia_* || $1 == torchvision ) ]]; }
case "$1" in
  put)
    python3 tools/gpu/gpu_stage.py put ".gpu/stage/${archive}.part$(printf %02d "$2")" --to /tmp/stage ;;
  go)
    shift
    if [ ! -f "$site/.installed" ]; then
      wheels="/tmp/wheels_${name}"
      if [ ! -d "$wheels/whl" ]; then
        tar_file=$(python3 tools/gpu/gpu_stage.py join "$archive" --to /tmp/stage | tail -1)
        rm -rf "$wheels" && mkdir -p "$wheels"
        tar -xf "$tar_file" -C "$wheels"
      fi
      held=$(for w in "$wheels"/whl/*.whl; do dist "$w"; done)
      install=()
      for w in "$wheels"/whl/*.whl; do
        d=$(dist "$w")
        [[ " $skip " == *" $d "* ]] || with_torch "$d" || install+=("$w")
      done
      for w in .gpu/extra/*.whl $(ls .gpu/extra_"$name"/*.whl 2>/dev/null); do
        d=$(dist "$w")
        grep -qx "$d" <<< "$held" || with_torch "$d" || install+=("$w")
      done
      python3 -m pip install -q --no-deps --target "$site" "${install[@]}"
      touch "$site/.installed"
    fi
    export PATH="$site/bin:$PATH" PYTHONPATH="$site"
    "$@" ;;
  *)
    echo "usage: [FW_ARCHIVE=NAME.tar] [FW_SKIP='torch triton'] fw_session.sh put K | go CMD ..." >&2; exit 2 ;;
esac
