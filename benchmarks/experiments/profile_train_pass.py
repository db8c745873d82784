"""Where the time of hf_lsce's fwd+bwd goes, at one shape (default Gemma2-2B, bf16, b = 0.1, peaked).

Prints: (1) fwd+bwd median time for several chunk sizes of the one-pass training path;
(2) the torch.profiler kernel table of one fwd+bwd at the default chunk; (3) the parts of one chunk
timed alone (fp32-output logits matmul, the row kernel, dh and dW matmuls); (4) the forward
kernel's autotuned block shape. Writes JSON with all of it.

    python benchmarks/experiments/profile_train_pass.py [--shape gemma2-2b] [--out profile.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from bench_linear_cross_entropy import SHAPES  # noqa: E402
from check_correctness_gpu import make_inputs  # noqa: E402

import hf_lsce.ops.train_pass as tp  # noqa: E402
from hf_lsce import linear_cross_entropy  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="gemma2-2b", choices=list(SHAPES))
    ap.add_argument("--out", default="profile_train_pass.json")
    args = ap.parse_args()
    from triton.testing import do_bench

    n, d, v = SHAPES[args.shape]
    h, w, y, _ = make_inputs(n, d, v, peaked=True, bias=False, ignore_frac=0.0, seed=0)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = dict(shape=args.shape, N=n, D=d, V=v, device=torch.cuda.get_device_name())

    def fb():
        hh.grad = ww.grad = None
        linear_cross_entropy(hh, ww, y, label_smoothing=0.1).backward()

    default = tp.TRAIN_CHUNK_BYTES
    out["chunks"] = {}
    for gib in (0.5, 1, 2, 4):
        tp.TRAIN_CHUNK_BYTES = int(gib * (1 << 30))
        fb()
        t = do_bench(fb, warmup=20, rep=300, return_mode="median")
        out["chunks"][f"{gib} GiB ({max(1, min(n, tp.TRAIN_CHUNK_BYTES // (v * 4)))} rows)"] = t
        print(f"chunk {gib} GiB: fwd+bwd {t:.2f} ms", flush=True)
    tp.TRAIN_CHUNK_BYTES = default

    from torch.profiler import ProfilerActivity, profile
    fb()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fb()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
    print(table, flush=True)
    out["profile"] = table

    rows = max(1, min(n, default // (v * 4)))
    buf = torch.empty(rows, v, dtype=torch.float32, device="cuda")
    g = buf.view(h.dtype)[:, :v]
    hc = h[:rows]
    t = y[:rows].contiguous()
    sm = torch.full((rows,), 0.1, device="cuda")
    sc = torch.full((rows,), 1.0 / n, device="cuda")
    st = [torch.empty(rows, device="cuda") for _ in range(4)] + [torch.empty(rows, dtype=torch.int32, device="cuda")]
    block, warps = tp._rows_launch_config(v)
    dh = torch.empty(rows, d, dtype=h.dtype, device="cuda")
    dw = torch.empty(v, d, dtype=w.dtype, device="cuda")

    def rows_kernel(write_g=True):
        tp._lce_rows_kernel[(rows,)](buf, buf, t, sm, sc, g, st[0], st[1], st[2], st[4], st[3], v, buf.stride(0),
                                     g.stride(0), 1.0, 1.0 / v, HAS_BIAS=False, SOFTCAP=False, WRITE_G=write_g,
                                     BLOCK=block, num_warps=warps)
    parts = {
        "logits matmul, fp32 out": lambda: torch.mm(hc, w.T, out_dtype=torch.float32, out=buf),
        "logits matmul, bf16 out": lambda: hc @ w.T,
        "row kernel (stats + G)": rows_kernel,
        "row kernel (stats only)": lambda: rows_kernel(False),
        "dh = G @ W": lambda: torch.mm(g, w, out=dh),
        "dW += G^T h": lambda: dw.addmm_(g.T, hc),
        "dW = G^T h (first chunk)": lambda: torch.mm(g.T, hc, out=dw),
    }
    out["parts_ms_per_chunk"] = {}
    for name, fn in parts.items():
        fn()
        ms = do_bench(fn, warmup=10, rep=200, return_mode="median")
        out["parts_ms_per_chunk"][name] = ms
        print(f"{name:28s} {ms:7.3f} ms per chunk of {rows} rows  (x{n / rows:.1f} chunks = {ms * n / rows:.1f} ms)",
              flush=True)
    from hf_lsce.ops import forward as fwd

    def f():
        with torch.no_grad():
            linear_cross_entropy(h, w, y, label_smoothing=0.1)
    f()
    out["forward_ms"] = do_bench(f, warmup=10, rep=200, return_mode="median")
    print(f"forward (no grad, Triton kernel) {out['forward_ms']:.2f} ms")
    best = getattr(fwd._lce_forward_autotuned, "best_config", None)
    out["forward_best_config"] = str(best)
    print("forward kernel best config:", best)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
