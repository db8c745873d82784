"""Experiment (issue 41): soft-capped logits on the fused path (R = exp(z - cap), G formed over R in place with the
cap's derivative from log R) against the path each case took before (one-pass above D = 1,024, two-pass at or below
it), in one process, b = 0.1, N = 8192, realistic inputs; trainable and frozen heads; the floor and torch.compile's
soft-capped loss beside them; dh (and dW) errors against fp64.

    python tools/gpu/softcap_fused.py
"""
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, "benchmarks")
from bench_linear_cross_entropy import SHAPES, errors, floor_ms, fp64_reference, measure, torch_loss  # noqa: E402
from real_inputs import fitted_params, realistic_batch  # noqa: E402

import hf_lsce.ops.config as config  # noqa: E402
from hf_lsce import linear_cross_entropy  # noqa: E402


def ours(h, w, y, b, cap):
    return linear_cross_entropy(h, w, y, label_smoothing=b, softcap=cap)


rows = []
CAP = 30.0
for name in ("gemma2-2b", "gemma3-270m", "smollm2-135m", "llama3-8b"):
    n = 8192
    _, d, v = SHAPES[name]
    h, w, y = realistic_batch(n, d, v, seed=0, device="cuda", **fitted_params())
    ref = {}
    for frozen in (False, True):
        res = dict(shape=name, head="frozen" if frozen else "trainable", N=n, softcap=CAP)
        old = "one-pass" if d > config.TWO_PASS_MAX_D else "two-pass"
        if name in ("gemma2-2b", "smollm2-135m"):
            ref = fp64_reference(h, w, y, 0.1, CAP)
        for label, path in (("fused (new default)", "fused"), (f"{old} (before)", old)):
            config.TRAIN_PATH = path
            res[label] = measure(ours, h, w, y, 0.1, CAP, frozen, do_bench, True)
            if name in ("gemma2-2b", "smollm2-135m"):
                res[label].update(errors(ours, h, w, y, 0.1, CAP, frozen, ref))
            config.TRAIN_PATH = None
        if name == "gemma2-2b":
            torch._dynamo.reset()
            comp = torch.compile(torch_loss, dynamic=False)
            res["torch.compile"] = measure(comp, h, w, y, 0.1, CAP, frozen, do_bench, True)
        res["floor"] = floor_ms(h, w, frozen, do_bench)
        rows.append(res)
        print(json.dumps(res), flush=True)
    del h, w, y, ref
    torch.cuda.empty_cache()
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "softcap_fused.json"), "w"), indent=1)
