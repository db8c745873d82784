"""Experiment (issue 41): where does the op's host time per training call go? Wraps the stages of one eager call in
wall-clock timers (the GPU idles at this size, so wall time is the host's) and prints each stage's ms per call.

    python tools/gpu/host_stages.py [--tokens 256] [--iters 300]
"""
from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

TOTALS = collections.Counter()


def timed(module, name, label=None):
    fn = getattr(module, name)

    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            TOTALS[label or name] += time.perf_counter() - t0
    setattr(module, name, wrapper)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    import hf_lsce.ops.fused_pass as fp
    import hf_lsce.ops.linear_cross_entropy  # noqa: F401 (the package exports a function of that name)
    import hf_lsce.ops.paths as paths
    from hf_lsce import linear_cross_entropy

    lce = sys.modules["hf_lsce.ops.linear_cross_entropy"]

    import hf_lsce.ops.prepare as prep

    timed(prep, "prepare")
    timed(lce, "check_summary")
    for mod, name in ((lce, "check_device_values"), (lce, "training_options"), (lce, "_validate"),
                      (lce, "loss_denominator"), (lce, "notify_training_call"), (lce, "loss_terms"),
                      (paths, "_fused_gradients"),
                      (fp, "_exp_tiles"), (fp, "_direct_dw"), (fp, "mm_f32")):
        timed(mod, name)
    from triton.runtime.jit import JITFunction

    import hf_lsce.ops.checks as checks

    timed(JITFunction, "run", "every Triton launch")
    timed(checks, "_summary")
    timed(checks, "raise_pending_errors")
    timed(paths, "free_cuda_memory")
    timed(lce._LinearCrossEntropy, "forward", "autograd forward (the fused pass and the loss terms)")
    g = torch.Generator(device="cpu").manual_seed(0)
    h = (torch.randn(1, args.tokens, 576, generator=g) * 0.5).cuda().bfloat16().requires_grad_()
    w = (torch.randn(49152, 576, generator=g) * 0.02).cuda().bfloat16().requires_grad_()
    y = torch.randint(0, 49152, (1, args.tokens), generator=g).cuda()
    for b in (0.0, 0.1):
        fwd = bwd = 0.0
        for i in range(args.iters + 20):
            if i == 20:
                TOTALS.clear()
                fwd = bwd = 0.0
                torch.cuda.synchronize()
                t_all = time.perf_counter()
            t0 = time.perf_counter()
            loss = linear_cross_entropy(h, w, y, label_smoothing=b, shift=True)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            fwd += t1 - t0
            bwd += t2 - t1
        torch.cuda.synchronize()
        wall = time.perf_counter() - t_all
        n = args.iters
        print(f"=== b = {b}, {args.tokens} tokens: wall {wall / n * 1e3:.3f} ms per call; forward call "
              f"{fwd / n * 1e3:.3f}, backward {bwd / n * 1e3:.3f}")
        for k, v in TOTALS.most_common():
            print(f"  {k:40s} {v / n * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
