"""Probe: per-launch host cost of Triton kernels (jit [grid] call, its binder, the CompiledKernel runner, the raw
launcher) and of small torch ops, on the op's kernels at SmolLM2's head, N = 256."""
import sys, os, time, statistics
sys.path.insert(0, os.getcwd())
import torch, triton
from hf_lsce.ops import fused_pass as fp
from hf_lsce.ops.config import forward_config

def per_call_us(fn, iters=2000, blocks=5):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(out)

print("triton", triton.__version__, "torch", torch.__version__, torch.cuda.get_device_name())
N, D, V = 256, 576, 49152
g = torch.Generator(device="cpu").manual_seed(0)
h = (torch.randn(N, D, generator=g) * 0.5).cuda().bfloat16()
w = (torch.randn(V, D, generator=g) * 0.02).cuda().bfloat16()
y = torch.randint(0, V, (N,), generator=g).cuda()
sums = fp._column_sums(w, None)
c, sz, zy = torch.empty(3, N, device="cuda")
kern = fp._offsets_kernel
grid, br, bd, warps = fp._rows_launch(N)
args = (h, w, sums[0], sums[0], sums[1], y, c, sz, zy, N, V, D, h.stride(0), w.stride(0), fp.C_SHIFT)
kw = dict(HAS_BIAS=False, BLOCK_R=br, BLOCK_D=bd, num_warps=warps)
res = {}
res["offsets: kernel[grid](...)"] = per_call_us(lambda: kern[grid](*args, **kw))
ck = kern[grid](*args, **kw)
dev = torch.cuda.current_device()
caches = kern.device_caches[dev]
binder = caches[-1]
try:
    res["offsets: binder alone"] = per_call_us(lambda: binder(*args, **kw))
except Exception as e:
    print("binder failed", repr(e))
allargs = list(args) + [False, br, bd]
try:
    runner = ck[grid]
    res["offsets: CompiledKernel[grid](...)"] = per_call_us(lambda: runner(*allargs))
except Exception as e:
    print("runner failed", repr(e))
try:
    stream = torch.cuda.current_stream().cuda_stream
    fn, pm, run = ck.function, ck.packed_metadata, ck.run
    res["offsets: raw ck.run"] = per_call_us(lambda: run(grid[0], 1, 1, stream, fn, pm, None, None, None, *allargs))
except Exception as e:
    print("raw failed", repr(e))
from triton.runtime import driver
res["driver get_current_device+stream"] = per_call_us(
    lambda: driver.active.get_current_stream(driver.active.get_current_device()))
res["torch.cuda.current_stream().cuda_stream"] = per_call_us(lambda: torch.cuda.current_stream().cuda_stream)
res["torch.empty(8, 256)"] = per_call_us(lambda: torch.empty(8, N, device="cuda"))
res["x.zero_()"] = per_call_us(lambda: c.zero_())
res["torch.ones(1, V) bf16"] = per_call_us(lambda: torch.ones(1, V, dtype=torch.bfloat16, device="cuda"))
res["_column_sums"] = per_call_us(lambda: fp._column_sums(w, None))
from triton.tools.tensor_descriptor import TensorDescriptor
cfg = forward_config(torch.bfloat16, h.device)
res["TensorDescriptor.from_tensor x2"] = per_call_us(lambda: (
    TensorDescriptor.from_tensor(h, [cfg.block_n, cfg.block_d]), TensorDescriptor.from_tensor(w, [cfg.block_v, cfg.block_d])))
r = torch.empty(N + 2, V, dtype=torch.bfloat16, device="cuda")
res["_exp_tiles (2 descs, 4 bufs, launch)"] = per_call_us(lambda: fp._exp_tiles(cfg, h, w, None, c, r[:N], False), iters=500)
bufs, descs = fp._exp_tiles(cfg, h, w, None, c, r[:N], False)
res["_exp_tiles fixup (bufs given)"] = per_call_us(lambda: fp._exp_tiles(cfg, h, w, None, c, r[:N], False, bufs=bufs, descs=descs), iters=500)
for k, v in res.items():
    print(f"{k:45s} {v:8.2f} us")
