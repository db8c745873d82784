"""Kernel times of one op fwd+bwd (Gemma-3-270m head, N=8192, b=0.1, trainable): TMA against pointer loads."""
import json, os, sys
root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path[:0] = [root, os.path.join(root, "benchmarks")]
import torch
from torch.profiler import profile, ProfilerActivity
from hf_lsce import linear_cross_entropy
from hf_lsce.ops import config
from real_inputs import fitted_params, realistic_batch
for shape, (n, d, v) in (("gemma3-270m", (8192, 640, 262144)), ("llama3-8b", (8192, 4096, 128256))):
    h, w, y = realistic_batch(n, d, v, seed=0, device="cuda", **fitted_params())
    for switch in ("1", "0"):
        config.TMA_SWITCH = switch; config.clear_caches()
        for b in (0.1, 0.0):
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            def step():
                hh.grad = ww.grad = None
                linear_cross_entropy(hh, ww, y, label_smoothing=b).backward()
            for _ in range(3): step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5): step()
                torch.cuda.synchronize()
            ev = sorted(((e.key, e.device_time_total / 5 / 1e3) for e in prof.key_averages()), key=lambda x: -x[1])
            print(json.dumps(dict(shape=shape, tma=switch, b=b, total_ms=round(sum(t for _, t in ev), 3),
                                  kernels=[(k[:70], round(t, 3)) for k, t in ev[:8]])), flush=True)
