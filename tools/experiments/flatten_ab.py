"""Does Triton's loop flattening (``tl.range(..., flatten=True)`` on the vocabulary loop) speed up the fused kernel's
pointer loads? Correctness here: the op with and without it, bitwise, on the pointer loads (HF_LSCE_TMA=0); timing:
``benchmarks/bench_linear_cross_entropy.py`` in two processes, HF_LSCE_FLATTEN=0 and 1.

    HF_LSCE_TMA=0 python tools/experiments/flatten_ab.py --out DIR
"""
import argparse
import json
import os

import torch

from hf_lsce.ops import linear_cross_entropy

ap = argparse.ArgumentParser()
ap.add_argument("--out", default="flatten_out")
args = ap.parse_args()
os.makedirs(args.out, exist_ok=True)
rows = []
for v, d, cap, frozen in ((262144, 640, None, False), (256000, 2304, 30.0, False), (128256, 4096, None, True),
                          (49152, 576, None, False)):
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(4096, d, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(v, d, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_(not frozen)
    y = torch.randint(0, v, (4096,), device="cuda", generator=g)
    out = {}
    for f in ("0", "1"):
        os.environ["HF_LSCE_FLATTEN"] = f
        h.grad = w.grad = None
        loss = linear_cross_entropy(h, w, y, label_smoothing=0.1, softcap=cap)
        loss.backward()
        out[f] = (loss.detach().clone(), h.grad.clone(), None if frozen else w.grad.clone())
    same = [bool(torch.equal(a, b)) for a, b in zip(out["0"], out["1"]) if a is not None]
    rows.append({"v": v, "d": d, "softcap": cap, "frozen": frozen, "bitwise_equal": same,
                 "loss": [float(out[f][0]) for f in "01"]})
    print(rows[-1], flush=True)
json.dump(rows, open(os.path.join(args.out, "flatten_correctness.json"), "w"), indent=1)
