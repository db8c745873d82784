"""Experiment (issue 41, soft-cap at the edge of 0.85 x compile): can the soft-capped fused path hide its G pass
(``_softcap_grad_kernel``, 3.3-4.1 ms at the Gemma2-2B head) behind dh's matmul, on a second CUDA stream?

At the Gemma2-2B head (N = 8,192, D = 2,304, V = 256,000, bf16, R for every row), times on CUDA events, the median of
15 interleaved repetitions:

* ``sequential``: G over every row, then dh = G W (what the op does);
* ``overlap K``: the rows in K chunks; G of chunk i + 1 runs on a second stream while dh's matmul of chunk i runs;
* the parts alone: G over every row, dh's matmul over every row.

The values of R do not matter to either kernel's time (the G pass rewrites R in place at every repetition).

    python tools/gpu/softcap_overlap.py
"""
from __future__ import annotations

import json
import os
import statistics
import sys

import torch
import triton

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def main():
    from hf_lsce.ops.fused_pass import _softcap_grad_kernel

    n, d, v, cap = 8192, 2304, 256000, 30.0
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    z = torch.randn(n, v, device=dev, generator=g, dtype=torch.float32) * 3
    r = torch.exp(cap * torch.tanh(z / cap) - cap).bfloat16()
    del z
    w = (torch.randn(v, d, device=dev, generator=g) * 0.02).bfloat16()
    a = torch.rand(n, device=dev, generator=g) / v
    u = torch.full((n,), 0.1 / v / n, device=dev)
    scale = torch.full((n,), 1.0 / n, device=dev)
    smooth = torch.full((n,), 0.1, device=dev)
    y = torch.randint(0, v, (n,), device=dev, generator=g)
    dh = torch.empty(n, d, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream()

    def gpass(s0, e0):
        rr = r[s0:e0]
        _softcap_grad_kernel[(triton.cdiv(e0 - s0, 8), triton.cdiv(v, 256))](
            rr, a[s0:], u[s0:], scale[s0:], smooth[s0:], y[s0:], e0 - s0, v, rr.stride(0), cap, BLOCK_R=8,
            BLOCK_V=256, num_warps=4)

    def mm(s0, e0):
        torch.mm(r[s0:e0], w, out=dh[s0:e0])

    def sequential():
        gpass(0, n)
        mm(0, n)

    def overlap(k):
        def run():
            bounds = [(i * n // k, (i + 1) * n // k) for i in range(k)]
            main_s = torch.cuda.current_stream()
            gpass(*bounds[0])
            done = []
            side.wait_stream(main_s)
            with torch.cuda.stream(side):  # G of every later chunk on the side stream, in order
                for b in bounds[1:]:
                    gpass(*b)
                    ev = torch.cuda.Event()
                    ev.record(side)
                    done.append(ev)
            for i, b in enumerate(bounds):
                if i:
                    main_s.wait_event(done[i - 1])
                mm(*b)
            main_s.wait_stream(side)
        return run

    variants = {"sequential": sequential, "G alone": lambda: gpass(0, n), "dh matmul alone": lambda: mm(0, n)}
    for k in (2, 4, 8):
        variants[f"overlap {k}"] = overlap(k)
    times = {name: [] for name in variants}
    for _ in range(3):
        for fn in variants.values():
            fn()
    torch.cuda.synchronize()
    for _ in range(15):
        for name, fn in variants.items():
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times[name].append(s.elapsed_time(e))
    rows = {name: statistics.median(t) for name, t in times.items()}
    print(f"{torch.cuda.get_device_name()}, N = {n}, D = {d}, V = {v}, median of 15 (ms):")
    for name, t in rows.items():
        print(f"  {name:18s} {t:7.3f}  (min {min(times[name]):.3f}, max {max(times[name]):.3f})")
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "softcap_overlap.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "median_ms": rows, "all_ms": times}, f, indent=1)


if __name__ == "__main__":
    main()
