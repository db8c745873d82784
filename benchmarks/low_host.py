"""Host time per vocabulary chunk of memory='low' (cProfile), Gemma-3-270m head, N = 8192, 32 MiB chunks forced."""
import cProfile, pstats, sys, torch
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
from real_inputs import fitted_params, realistic_batch
from hf_lsce import linear_cross_entropy
import hf_lsce.ops.config as config
config.LOW_MEMORY_BYTES = 0
h, w, y = realistic_batch(8192, 640, 262144, seed=0, device="cuda", **fitted_params())
hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
for _ in range(3):
    linear_cross_entropy(hh, ww, y, label_smoothing=0.1, memory="low").backward()
torch.cuda.synchronize()
pr = cProfile.Profile(); pr.enable()
for _ in range(3):
    hh.grad = ww.grad = None
    linear_cross_entropy(hh, ww, y, label_smoothing=0.1, memory="low").backward()
torch.cuda.synchronize()
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(22)
