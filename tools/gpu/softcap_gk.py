"""The soft-cap G kernel's block shape (Gemma2-2B head, N = 8192): the kernel at several shapes, a plain in-place
scale of the same bytes, a looping variant, and a copy."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch, triton, triton.language as tl
from triton.testing import do_bench
from hf_lsce.ops import fused_pass as fp

n, v = 8192, 256000
r = (torch.rand(n, v, device="cuda") * 0.5 + 1e-3).bfloat16()
f32 = dict(dtype=torch.float32, device="cuda")
a = torch.rand(n, **f32) * 1e-4
u = torch.rand(n, **f32) * 1e-9
sc = torch.full((n,), 1e-4, **f32)
sm = torch.full((n,), 0.1, **f32)
y = torch.randint(0, v, (n,), device="cuda")


@triton.jit
def scale_inplace(R, n, V, stride_r, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    m2 = (rows < n)[:, None] & (cols < V)[None, :]
    at = R + rows[:, None].to(tl.int64) * stride_r + cols[None, :]
    x = tl.load(at, mask=m2, other=1.0).to(tl.float32)
    tl.store(at, (x * 1.0000001).to(R.dtype.element_ty), mask=m2)


@triton.jit
def g_loop(R, A, U, SCALE, SMOOTH, Y, n, V, stride_r, softcap, COLS_PER: tl.constexpr, BLOCK_R: tl.constexpr,
           BLOCK_V: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = rows < n
    a = tl.load(A + rows, mask=mask_r, other=0.0)
    u = tl.load(U + rows, mask=mask_r, other=0.0)
    tw = tl.load(SCALE + rows, mask=mask_r, other=0.0) * (1.0 - tl.load(SMOOTH + rows, mask=mask_r, other=0.0))
    y = tl.load(Y + rows, mask=mask_r, other=-1)
    k = 0.6931471805599453 / softcap
    base = R + rows[:, None].to(tl.int64) * stride_r
    for c0 in range(tl.program_id(1) * COLS_PER, tl.minimum(V, (tl.program_id(1) + 1) * COLS_PER), BLOCK_V):
        cols = c0 + tl.arange(0, BLOCK_V)
        m2 = mask_r[:, None] & (cols < V)[None, :]
        r = tl.load(base + cols[None, :], mask=m2, other=1.0).to(tl.float32)
        q = tl.log2(r) * k
        g = a[:, None] * r - u[:, None] - tl.where(cols[None, :] == y[:, None], tw[:, None], 0.0)
        tl.store(base + cols[None, :], (g * (-q * (2.0 + q))).to(R.dtype.element_ty), mask=m2)


res = {}
r2 = torch.empty_like(r)
res["copy"] = do_bench(lambda: r2.copy_(r))
del r2
for br, bv, w in [(16, 256, 4), (8, 256, 4), (8, 512, 4), (16, 512, 4), (4, 1024, 4), (8, 1024, 4), (2, 2048, 4),
                  (1, 4096, 4), (32, 128, 4), (16, 128, 2), (8, 256, 2), (4, 512, 2), (16, 256, 8)]:
    res[f"G {br}x{bv} w{w}"] = do_bench(lambda: fp._softcap_grad_kernel[(triton.cdiv(n, br), triton.cdiv(v, bv))](
        r, a, u, sc, sm, y, n, v, r.stride(0), 30.0, BLOCK_R=br, BLOCK_V=bv, num_warps=w))
for br, bv, w in [(16, 256, 4), (8, 512, 4), (4, 1024, 4)]:
    res[f"scale {br}x{bv} w{w}"] = do_bench(lambda: scale_inplace[(triton.cdiv(n, br), triton.cdiv(v, bv))](
        r, n, v, r.stride(0), BLOCK_R=br, BLOCK_V=bv, num_warps=w))
for br, bv, w, per in [(16, 256, 4, 4096), (8, 512, 4, 8192), (16, 512, 8, 16384), (4, 1024, 4, 16384),
                       (16, 256, 4, 16384)]:
    res[f"loop {br}x{bv} w{w} per {per}"] = do_bench(lambda: g_loop[(triton.cdiv(n, br), triton.cdiv(v, per))](
        r, a, u, sc, sm, y, n, v, r.stride(0), 30.0, COLS_PER=per, BLOCK_R=br, BLOCK_V=bv, num_warps=w))
for k, t in res.items():
    print(f"{k:32s} {t:7.3f} ms")
