"""Would the TMA kernel's flattened loop over (vocabulary tile, D step) speed up the pointer loads now that they read
unmasked tiles (e2621ae)? Correctness: the op with and without it (HF_LSCE_FLAT_POINTERS), bitwise, under
HF_LSCE_TMA=0; timing: bench_linear_cross_entropy.py in alternating processes.

    HF_LSCE_TMA=0 python tools/experiments/flat_pointers_ab.py --out DIR
"""
import argparse
import json
import os

import torch

from hf_lsce.ops import linear_cross_entropy

ap = argparse.ArgumentParser()
ap.add_argument("--out", default="flat_out")
args = ap.parse_args()
os.makedirs(args.out, exist_ok=True)
rows = []
for v, d, frozen in ((262144, 640, False), (256000, 2304, True), (49152, 576, False)):
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(4096, d, device="cuda", generator=g) * 0.5).bfloat16()
    w = (torch.randn(v, d, device="cuda", generator=g) * 0.02).bfloat16()
    y = torch.randint(0, v, (4096,), device="cuda", generator=g)
    out = []
    for f in ("0", "1"):
        os.environ["HF_LSCE_FLAT_POINTERS"] = f
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_(not frozen)
        loss = linear_cross_entropy(hh, ww, y, label_smoothing=0.1)
        loss.backward()
        out.append([loss.detach(), hh.grad] + ([] if frozen else [ww.grad]))
    rows.append({"v": v, "d": d, "frozen": frozen, "bitwise_equal": [bool(torch.equal(a, b)) for a, b in zip(*out)]})
    print(rows[-1], flush=True)
json.dump(rows, open(os.path.join(args.out, "flat_pointers_correctness.json"), "w"), indent=1)
