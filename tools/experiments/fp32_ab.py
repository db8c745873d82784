"""fp32 fwd+bwd of the op from the package at --pkg: median of 3 do_bench medians per shape."""
import argparse, json, os, sys
ap = argparse.ArgumentParser()
ap.add_argument("--pkg")
ap.add_argument("--label")
ap.add_argument("--tf32", action="store_true")
a = ap.parse_args()
sys.path.insert(0, a.pkg)
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import torch, triton.testing
from hf_lsce import linear_cross_entropy
import hf_lsce
from real_inputs import fitted_params, realistic_batch
torch.backends.cuda.matmul.allow_tf32 = a.tf32
for shape, (n, d, v) in (("gemma3-270m", (8192, 640, 262144)), ("llama3-8b", (8192, 4096, 128256))):
    h, w, y = realistic_batch(n, d, v, seed=0, device="cuda", dtype=torch.float32, **fitted_params())
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    def step():
        hh.grad = ww.grad = None
        linear_cross_entropy(hh, ww, y, label_smoothing=0.1).backward()
    step()
    runs = [triton.testing.do_bench(step, warmup=50, rep=400, return_mode="median") for _ in range(3)]
    hh.grad = ww.grad = None
    torch.cuda.synchronize(); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated(); step(); torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - base - 2 * 0 - (hh.grad.numel() + ww.grad.numel()) * 4) / 1e6
    print(json.dumps(dict(label=a.label, file=hf_lsce.__file__.split("/")[-3], shape=shape, tf32=a.tf32,
                          ms=sorted(runs)[1], runs=runs, extra_mb=round(extra))), flush=True)
    del h, w, y, hh, ww; torch.cuda.empty_cache()
