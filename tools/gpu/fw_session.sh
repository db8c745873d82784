#!/bin/bash
# The frameworks' runs on the device machine (tools/frameworks_gpu.py), one step per device call, back to back
# (the staged parts last while the machine is warm). FW_ARCHIVE names the staged wheels: fw_wheels.tar (Axolotl's,
# the default) or lf_wheels.tar (LLaMA-Factory's); each installs into its own folder, /tmp/site_<name>, with
# .gpu/extra's wheels and those of .gpu/extra_<name> if there is one (carry it).
#   bash tools/gpu/fw_session.sh put K        # call K (0, 1, 2): one part of .gpu/stage/$FW_ARCHIVE (carry it)
#   bash tools/gpu/fw_session.sh go CMD ...   # join the parts, install the wheels and .gpu/extra's (once per warm
#                                             # machine), then CMD with that folder first on PATH and PYTHONPATH
#                                             # (axolotl starts accelerate from PATH)
set -euo pipefail
archive="${FW_ARCHIVE:-fw_wheels.tar}"
site="/tmp/site_${archive%.tar}"
case "$1" in
  put)
    python3 tools/gpu/gpu_stage.py put ".gpu/stage/${archive}.part0$2" --to /tmp/stage ;;
  go)
    shift
    if [ ! -f "$site/.installed" ]; then
      tar_file=$(python3 tools/gpu/gpu_stage.py join "$archive" --to /tmp/stage | tail -1)
      rm -rf "/tmp/wheels_${archive%.tar}" && mkdir -p "/tmp/wheels_${archive%.tar}"
      tar -xf "$tar_file" -C "/tmp/wheels_${archive%.tar}"
      python3 -m pip install -q --no-deps --target "$site" "/tmp/wheels_${archive%.tar}"/whl/*.whl .gpu/extra/*.whl \
        $(ls .gpu/extra_${archive%.tar}/*.whl 2>/dev/null)
      touch "$site/.installed"
    fi
    export PATH="$site/bin:$PATH" PYTHONPATH="$site"
    "$@" ;;
  *)
    echo "usage: [FW_ARCHIVE=NAME.tar] fw_session.sh put K | go CMD ..." >&2; exit 2 ;;
esac
