"""LLaMA-Factory under the probe: ``python lf_probe_run.py stock CONFIG.yaml`` runs LLaMA-Factory's own training
entry (``llamafactory.launcher``, as ``llamafactory-cli train`` does on one device); ``... lsce CONFIG.yaml`` runs
hf_lsce's route (``hf-lsce llamafactory train CONFIG.yaml``)."""
import runpy
import sys

import probe

probe.install_on_every_trainer()
mode, cfg = sys.argv[1], sys.argv[2]
if mode == "stock":
    sys.argv = ["llamafactory.launcher", cfg]
    runpy.run_module("llamafactory.launcher", run_name="__main__", alter_sys=True)
else:
    from hf_lsce.cli import main

    sys.exit(main(["llamafactory", "train", cfg]))
