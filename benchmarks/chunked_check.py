"""GPU: the fused path's chunked layout (dW accumulated in fp32, the rank-one term in the last chunk's matmul) against
the direct layout and fp64, Gemma-3-270m head, N = 4096, b = 0.1, 512-row chunks."""
import sys, torch
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
import bench_linear_cross_entropy as B
from real_inputs import fitted_params, realistic_batch
import hf_lsce.ops.fused_pass as fp
from hf_lsce.ops.config import forward_config

n, d, v = 4096, 640, 262144
h, w, y = realistic_batch(n, d, v, seed=0, device="cuda", **fitted_params())
ref_dh, ref_dw = B.fp64_reference(h, w, y, 0.1, None)
cfg = forward_config(torch.bfloat16, torch.device("cuda"))
sm = torch.full((n,), 0.1, device="cuda")
count = int((y >= 0).sum())
scale = (y >= 0).float() / count
rel = lambda a, r: float((a.double() - r).norm() / r.norm())
for name, kw in [("direct", {}), ("chunked 512 rows", dict(chunk_bytes=512 * v * 2))]:
    saved = fp.DIRECT_DW_EXTRA_BYTES
    if name != "direct":
        fp.DIRECT_DW_EXTRA_BYTES = -(1 << 40)
    stats, dh, dw, _ = fp.triton_fused_pass(h, w, None, y, sm, scale, cfg, need_db=False, **kw)
    fp.DIRECT_DW_EXTRA_BYTES = saved
    print(name, "dh err %.2e  dW err %.2e" % (rel(dh, ref_dh), rel(dw, ref_dw)), flush=True)
z = (h @ w.T)
t = torch.nn.functional.cross_entropy(z.float(), y, label_smoothing=0.1)
hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
torch.nn.functional.cross_entropy((hh @ ww.T).float(), y, label_smoothing=0.1).backward()
print("torch bf16 logits dh err %.2e  dW err %.2e" % (rel(hh.grad, ref_dh), rel(ww.grad, ref_dw)))
