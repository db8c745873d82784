"""Does the fused path's direct dW (R for every row, dW written by one matmul in the weight's dtype, the rank-one
smoothing term carried as extra rows) beat the chunked layout (dW accumulated in fp32 over row chunks, then cast),
and what does the matmul's K alignment and cuBLAS's reduced-precision reduction cost? (issue 27)

One process on the GPU, realistic bf16 inputs at N = 8192, CUDA-event medians:

* the dW matmul alone: fp32 output then the subtraction into bf16 (the chunked layout's last step with one chunk),
  against bf16 output at K = N + 2 and K padded to a multiple of 8, with cuBLAS's reduced-precision reduction off
  (what the pass does) and on (torch's default);
* the whole fused pass (forward statistics and all gradients), direct against chunked, with dW's error against an
  fp32 reference (softmax of fp32 logits).

Measured on an H100 (results/direct_dw.json; that run also timed the pass with K padded to a multiple of 8, then
dropped: 43.5 / 39.6 ms against 45.9 / 37.6 unpadded at the Gemma2-2B / Llama-3-8B shapes, no consistent gain, and the
matmul alone was 0-17% slower padded).

Prints a table and writes $OUT/direct_dw.json.

    python benchmarks/experiments/direct_dw.py [--shapes smollm2-135m,gemma3-270m,gemma2-2b,llama3-8b]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)
import hf_lsce.ops.fused_pass as fp  # noqa: E402
from profile_fused import SHAPES, pass_inputs, timed  # noqa: E402


def matmul_rows(name):
    n, d, v = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    r = torch.rand(n + 8, v, device="cuda", generator=g).bfloat16() * 1e-3
    hs = torch.randn(n + 8, d, device="cuda", generator=g).bfloat16()
    rvec = torch.randn(d, device="cuda", generator=g)
    m = torch.backends.cuda.matmul
    rows = {}

    def fp32_then_sub():
        acc = torch.mm(r[:n].T, hs[:n], out_dtype=torch.float32)
        torch.sub(acc, rvec[None, :], out=torch.empty(v, d, dtype=torch.bfloat16, device="cuda"))
    rows["fp32 out + sub"] = timed(fp32_then_sub)
    for k, label in ((n + 2, "K = N + 2"), (n + 8, "K = N + 8")):
        for reduced in (False, True):
            saved = m.allow_bf16_reduced_precision_reduction
            m.allow_bf16_reduced_precision_reduction = reduced
            try:
                rows[f"bf16 out, {label}, reduced-precision reduction {'on' if reduced else 'off'}"] = timed(
                    lambda: torch.mm(r[:k].T, hs[:k]))
            finally:
                m.allow_bf16_reduced_precision_reduction = saved
    return rows


def pass_rows(name):
    n, d, v = SHAPES[name]
    h, w, y, sm, scale, cfg = pass_inputs(name)
    out = {}
    saved = fp.DIRECT_DW_EXTRA_BYTES
    variants = {"direct": 1 << 40, "chunked": -(1 << 40)}
    dws = {}
    try:
        for label, extra in variants.items():
            fp.DIRECT_DW_EXTRA_BYTES = extra
            run = lambda: fp.triton_fused_pass(h, w, None, y, sm, scale, cfg)  # noqa: E731
            out[label] = timed(run)
            dws[label] = run()[2].float()
            torch.cuda.empty_cache()
    finally:
        fp.DIRECT_DW_EXTRA_BYTES = saved
    # dW's error: against an fp32 reference of the same math (softmax of the fp32 logits, smoothing, weights)
    ref = torch.zeros(v, d, device="cuda")
    for s0 in range(0, n, 1024):
        z = h[s0:s0 + 1024].float() @ w.float().T
        p = torch.softmax(z, -1)
        p[torch.arange(z.shape[0], device="cuda"), y[s0:s0 + 1024]] -= 0.9
        p -= 0.1 / v
        ref += (p * scale[s0:s0 + 1024, None]).T @ h[s0:s0 + 1024].float()
    errs = {k: float((dw - ref).norm() / ref.norm()) for k, dw in dws.items()}
    return out, errs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    print("| shape | what | ms | dW rel. error (fp32 ref.) |\n|---|---|---|---|")
    for name in args.shapes.split(","):
        mm = matmul_rows(name)
        whole, errs = pass_rows(name)
        res["shapes"][name] = {"dW matmul": mm, "fused pass": whole, "dW error": errs}
        for k, t in mm.items():
            print(f"| {name} | dW matmul: {k} | {t:.2f} | |", flush=True)
        for k, t in whole.items():
            print(f"| {name} | fused pass: {k} | {t:.2f} | {errs[k]:.1e} |", flush=True)
        torch.cuda.empty_cache()
    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "direct_dw.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
