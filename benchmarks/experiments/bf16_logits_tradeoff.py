"""What bf16 logits would buy the one-pass training path, and what they would cost (an experiment,
not a library option).

The library's training path (``hf_lsce/ops/train_pass.py``) has cuBLAS write each chunk's logits in
fp32 and the row kernel read them twice. This script runs the same chunk loop with the logits written
in bf16 (what Hugging Face, torch.compile of the materialising loss, and Liger-Kernel all compute
from), the same row kernel and the same cuBLAS gradient matmuls, and reports, in one process at the
Gemma2-2B shape (bf16, b = 0.1, peaked inputs as in ANCHORS.md):

- fwd+bwd median time of: the library's op; the bf16-logits variant; torch.compile of the
  materialising loss; Liger-Kernel (if installed); the three-matmul floor;
- relative error of the loss, dh and dW of the library's op and of the variant against an fp32
  reference (materialised logits, autograd), and of torch computing in bf16 as HF does.

    python benchmarks/experiments/bf16_logits_tradeoff.py [--out bf16_logits_tradeoff.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from bench_linear_cross_entropy import SHAPES, floor_fns, method_fns  # noqa: E402
from check_correctness_gpu import chunked_reference, make_inputs, rel  # noqa: E402

from hf_lsce import linear_cross_entropy  # noqa: E402
from hf_lsce.ops.backward import add_chunk_gradients  # noqa: E402
from hf_lsce.ops.config import TRAIN_CHUNK_BYTES  # noqa: E402
from hf_lsce.ops.train_pass import _lce_rows_kernel, _rows_launch_config  # noqa: E402


def bf16_logits_pass(h, w, y, b):
    """Mean smoothed loss and (dh, dW) through bf16 logits, chunks of TRAIN_CHUNK_BYTES (G in place)."""
    n, d = h.shape
    v = w.shape[0]
    t = torch.where(y == -100, torch.full_like(y, -1), y)
    valid = t >= 0
    scale = valid.float() / valid.sum().clamp_min(1)
    smooth = torch.full((n,), b, dtype=torch.float32, device=h.device)
    f32 = dict(dtype=torch.float32, device=h.device)
    lse, zy, sz, ent = (torch.empty(n, **f32) for _ in range(4))
    am = torch.empty(n, dtype=torch.int32, device=h.device)
    rows = max(1, min(n, TRAIN_CHUNK_BYTES // (v * h.element_size())))
    buf = torch.empty(rows, v, dtype=h.dtype, device=h.device)
    dh = torch.empty_like(h)
    dw = torch.empty_like(w)
    block, warps = _rows_launch_config(v)
    for s in range(0, n, rows):
        e = min(n, s + rows)
        z = buf[: e - s]
        torch.mm(h[s:e], w.T, out=z)
        _lce_rows_kernel[(e - s,)](z, z, t[s:e], smooth[s:e], scale[s:e], z, lse[s:e], zy[s:e], sz[s:e],
                                   am[s:e], ent[s:e], v, z.stride(0), z.stride(0), 1.0, 1.0 / v,
                                   HAS_BIAS=False, SOFTCAP=False, WRITE_G=True, BLOCK=block, num_warps=warps)
        add_chunk_gradients(z, h[s:e], w, dh[s:e], dw, None, first=s == 0)
    tok = torch.where(valid, lse - (1 - b) * zy - b * sz / v, torch.zeros_like(lse))
    return (tok * scale).sum(), dh, dw


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bf16_logits_tradeoff.json")
    args = ap.parse_args()
    from triton.testing import do_bench

    b = 0.1
    n, d, v = SHAPES["gemma2-2b"]
    out = dict(shape="gemma2-2b", N=n, D=d, V=v, b=b, device=torch.cuda.get_device_name(), times_ms={},
               errors={})

    # Accuracy, on inputs with 20% ignored tokens (as the GPU correctness check).
    h, w, y, _ = make_inputs(n, d, v, peaked=True, bias=False, ignore_frac=0.2, seed=1)
    ref = chunked_reference(h, w, y, None, b, None, "mean", None, torch.float32)
    hf = chunked_reference(h, w, y, None, b, None, "mean", None, torch.bfloat16)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy(hh, ww, y, label_smoothing=b)
    loss.backward()
    loss16, dh16, dw16 = bf16_logits_pass(h, w, y, b)
    for name, (lo, dh, dw) in {"hf_lsce (fp32 logits)": (loss.detach(), hh.grad, ww.grad),
                               "bf16 logits variant": (loss16, dh16, dw16),
                               "torch in bf16 (HF)": hf[:3]}.items():
        out["errors"][name] = dict(loss=rel(lo.float(), ref[0]), dh=rel(dh, ref[1]), dw=rel(dw, ref[2]))
    del ref, hf, hh, ww, dh16, dw16
    torch.cuda.empty_cache()

    # Speed, on the benchmark's inputs (no ignored tokens).
    h, w, y, _ = make_inputs(n, d, v, peaked=True, bias=False, ignore_frac=0.0, seed=0)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    fns = method_fns()

    def timed(name, fn):
        fn()
        torch.cuda.synchronize()
        out["times_ms"][name] = do_bench(fn, warmup=20, rep=400, return_mode="median")
        print(f"{name}: {out['times_ms'][name]:.2f} ms", flush=True)

    def op(method):
        def run():
            hh.grad = ww.grad = None
            method(hh, ww, y, b, None).backward()
        return run
    timed("hf_lsce (fp32 logits)", op(fns["hf_lsce"]))
    timed("bf16 logits variant", lambda: bf16_logits_pass(h, w, y, b))
    timed("torch.compile", op(fns["torch.compile"]))
    if not isinstance(fns.get("liger"), str) and "liger" in fns:
        timed("liger", op(fns["liger"]))
    timed("floor (3 matmuls)", floor_fns(h, w)[1])
    t = out["times_ms"]
    for name in ("hf_lsce (fp32 logits)", "bf16 logits variant"):
        out[f"{name}: vs torch.compile"] = t[name] / t["torch.compile"]
        if "liger" in t:
            out[f"{name}: liger / it"] = t["liger"] / t[name]
    print(json.dumps(out, indent=1))
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
