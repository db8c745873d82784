"""Run a training script stock or through ``hf-lsce run``, and write what happened to the LM head.

    python audited_run.py patched SCRIPT.py ARGS...   # = hf-lsce run SCRIPT.py ARGS...
    python audited_run.py patched -m MODULE ARGS...   # = hf-lsce run -m MODULE ARGS...
    python audited_run.py stock SCRIPT.py ARGS...     # = python SCRIPT.py ARGS...

Environment: AUDIT_VOCAB (the vocabulary size: a Linear with that many outputs is the LM head),
AUDIT_JSON (where to write {"lm_head_calls", "fused_calls", "smoothing"}). A global module forward hook
counts LM-head calls in every model the script builds, so the evidence does not depend on the script's
cooperation or on hf_lsce's own log.
"""
import atexit
import json
import os
import runpy
import sys

import torch

VOCAB = int(os.environ["AUDIT_VOCAB"])
calls = [0]


def _count(module, args, output):
    if isinstance(module, torch.nn.Linear) and module.out_features == VOCAB:
        calls[0] += 1


torch.nn.modules.module.register_module_forward_hook(_count)


def _dump():
    from hf_lsce.patching import ENGAGEMENT

    with open(os.environ["AUDIT_JSON"], "w") as f:
        json.dump({"lm_head_calls": calls[0], "fused_calls": ENGAGEMENT.fused_calls,
                   "smoothing": sorted(ENGAGEMENT.seen)}, f)


atexit.register(_dump)
mode, rest = sys.argv[1], sys.argv[2:]
if mode == "patched":
    from hf_lsce.cli import main

    main(["run", *rest])
elif rest[0] == "-m":
    sys.argv = [rest[1], *rest[2:]]
    runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
else:
    sys.argv = list(rest)
    sys.path.insert(0, os.path.dirname(os.path.abspath(rest[0])))
    runpy.run_path(rest[0], run_name="__main__")
