#!/bin/bash
# The frameworks' runs on the device machine (tools/frameworks_gpu.py), one step per device call, back to back
# (the staged parts last while the machine is warm):
#   bash tools/gpu/fw_session.sh put K        # call K (0, 1, 2): one part of .gpu/stage/fw_wheels.tar (carry it)
#   bash tools/gpu/fw_session.sh go CMD ...   # join the parts, install the wheels and .gpu/extra's into /tmp/site
#                                             # (once per warm machine), then CMD with /tmp/site first on PATH and
#                                             # PYTHONPATH (axolotl starts accelerate from PATH)
set -euo pipefail
case "$1" in
  put)
    python3 tools/gpu/gpu_stage.py put ".gpu/stage/fw_wheels.tar.part0$2" --to /tmp/stage ;;
  go)
    shift
    if [ ! -f /tmp/site/.installed ]; then
      tar_file=$(python3 tools/gpu/gpu_stage.py join fw_wheels.tar --to /tmp/stage | tail -1)
      mkdir -p /tmp/wheels && tar -xf "$tar_file" -C /tmp/wheels
      python3 -m pip install -q --no-deps --target /tmp/site /tmp/wheels/whl/*.whl .gpu/extra/*.whl
      touch /tmp/site/.installed
    fi
    export PATH="/tmp/site/bin:$PATH" PYTHONPATH="/tmp/site"
    "$@" ;;
  *)
    echo "usage: fw_session.sh put K | go CMD ..." >&2; exit 2 ;;
esac
