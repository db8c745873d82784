"""Where the soft-capped fused pass's time goes at the Gemma2-2B head (N = 8192, cap 30): the exponentials' kernel
capped against uncapped, the G kernel at several block shapes against a copy of the same bytes, and a torch.profiler
kernel table of the whole op (trainable and frozen)."""
import os, sys, json
sys.path.insert(0, "benchmarks"); sys.path.insert(0, os.getcwd())
import torch, triton
from triton.testing import do_bench
from real_inputs import fitted_params, realistic_batch
from hf_lsce.ops import fused_pass as fp
from hf_lsce.ops.config import forward_config
from hf_lsce import linear_cross_entropy

n, d, v = 8192, 2304, 256000
h, w, y = realistic_batch(n, d, v, seed=0, device="cuda", **fitted_params())
cfg = forward_config(torch.bfloat16, h.device)
v_pad = triton.cdiv(v, 8) * 8
r = torch.empty(n, v_pad, dtype=torch.bfloat16, device="cuda")
f32 = dict(dtype=torch.float32, device="cuda")
c_cap = torch.full((n,), 30.0, **f32)
c_plain, sz, zy = torch.empty(3, n, **f32)
fp._row_offsets(h, w, None, fp._column_sums(w, None), y, c_plain, sz, zy)
res = {}
res["exp kernel, capped"] = do_bench(lambda: fp._exp_tiles(cfg, h, w, None, c_cap, r[:, :v], False, softcap=30.0))
res["exp kernel, plain"] = do_bench(lambda: fp._exp_tiles(cfg, h, w, None, c_plain, r[:, :v], False))
res["exp kernel, plain, no store"] = do_bench(lambda: fp._exp_tiles(cfg, h, w, None, c_plain, r[:, :v], False, store=False))
res["exp kernel, capped, no store"] = do_bench(lambda: fp._exp_tiles(cfg, h, w, None, c_cap, r[:, :v], False, store=False, softcap=30.0))
r2 = torch.empty_like(r)
res["copy of R (same bytes as G)"] = do_bench(lambda: r2.copy_(r))
del r2
a = torch.rand(n, **f32) * 1e-4
u = torch.rand(n, **f32) * 1e-9
sc = torch.full((n,), 1e-4, **f32)
sm = torch.full((n,), 0.1, **f32)
for br, bv, warps in [(16, 256, 4), (32, 256, 4), (32, 512, 8), (64, 256, 8), (16, 1024, 8), (8, 2048, 8),
                      (32, 1024, 8), (64, 512, 8), (4, 4096, 8)]:
    fp._exp_tiles(cfg, h, w, None, c_cap, r[:, :v], False, softcap=30.0)
    res[f"G kernel {br}x{bv} w{warps}"] = do_bench(lambda: fp._softcap_grad_kernel[(triton.cdiv(n, br), triton.cdiv(v, bv))](
        r, a, u, sc, sm, y, n, v, r.stride(0), 30.0, BLOCK_R=br, BLOCK_V=bv, num_warps=warps))
for k, t in res.items():
    print(f"{k:40s} {t:8.3f} ms")
del r
torch.cuda.empty_cache()
from torch.profiler import profile, ProfilerActivity
for frozen in (False, True):
    hh = h.detach().clone().requires_grad_()
    ww = w.detach().clone().requires_grad_(not frozen)
    def step():
        hh.grad = ww.grad = None
        linear_cross_entropy(hh, ww, y, label_smoothing=0.1, softcap=30.0).backward()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print("=== frozen" if frozen else "=== trainable")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
