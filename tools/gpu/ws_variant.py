"""Experiment: the fused logits kernel as nested loops with Triton's Hopper warp specialisation, against the
production kernel (fused_pass._exp_tiles), at real head shapes (the rows of one 1 GiB chunk), kernel time only."""
import os
import sys

import torch
import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import hf_lsce.ops.fused_pass as fp  # noqa: E402
from hf_lsce.ops.config import forward_config  # noqa: E402
from hf_lsce.ops.forward import _split_bounds  # noqa: E402


@triton.jit
def _ws_kernel(h_desc, w_desc, R, C, S_OUT, M_OUT, N, V, D, NUM_SPLITS, stride_rn, WS: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    c = tl.load(C + offs_n, mask=mask_n, other=0.0)
    c2 = c * 1.4426950408889634
    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    v_start, v_end = _split_bounds(V, NUM_SPLITS, BLOCK_V)
    k_steps = tl.cdiv(D, BLOCK_D)
    for t in tl.range(0, tl.cdiv(v_end - v_start, BLOCK_V), warp_specialize=WS):
        v0 = v_start + t * BLOCK_V
        acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        for k in range(0, k_steps):
            h = h_desc.load([n0, k * BLOCK_D])
            w = w_desc.load([v0, k * BLOCK_D])
            acc = tl.dot(h, tl.trans(w), acc)
        offs_v = v0 + tl.arange(0, BLOCK_V)
        mask_v = offs_v < v_end
        z_m = tl.where(mask_v[None, :], acc, float("-inf"))
        m = tl.maximum(m, tl.max(z_m, axis=1))
        r = tl.math.exp2(z_m * 1.4426950408889634 - c2[:, None])
        s += tl.sum(r, axis=1)
        tl.store(R + offs_n[:, None].to(tl.int64) * stride_rn + offs_v[None, :], r.to(R.dtype.element_ty),
                 mask=mask_n[:, None] & mask_v[None, :])
    out = tl.program_id(0) * N + offs_n
    tl.store(S_OUT + out, s, mask=mask_n)
    tl.store(M_OUT + out, m, mask=mask_n)


def main():
    from triton.testing import do_bench
    from triton.tools.tensor_descriptor import TensorDescriptor

    dev = torch.device("cuda")
    cfg = forward_config(torch.bfloat16, dev)
    for name, (d, v) in dict(gemma3=(640, 262144), smollm2=(576, 49152), gemma2=(2304, 256000)).items():
        v_pad, rows = fp.chunk_rows(8192, v)
        rows = rows // cfg.block_n * cfg.block_n
        g = torch.Generator(device="cuda").manual_seed(0)
        h = (torch.randn(rows, d, device=dev, generator=g) * 0.5).bfloat16()
        w = (torch.randn(v, d, device=dev, generator=g) / d ** 0.5).bfloat16()
        c = torch.full((rows,), 24.0, device=dev)
        r1 = torch.empty(rows, v_pad, dtype=torch.bfloat16, device=dev)
        r2 = torch.empty_like(r1)
        prod = lambda: fp._exp_tiles(cfg, h, w, None, c, r1[:, :v], False)  # noqa: E731
        splits = fp.fused_splits(cfg, rows, v)
        hd = TensorDescriptor.from_tensor(h, [cfg.block_n, cfg.block_d])
        wd = TensorDescriptor.from_tensor(w, [cfg.block_v, cfg.block_d])
        so = torch.empty(splits, rows, device=dev)
        mo = torch.empty(splits, rows, device=dev)
        for ws, stages, warps in ((False, 3, 8), (True, 3, 8), (True, 2, 8), (True, 3, 4)):
            def var():
                _ws_kernel[(splits, triton.cdiv(rows, cfg.block_n))](
                    hd, wd, r2, c, so, mo, rows, v, d, splits, r2.stride(0), WS=ws, BLOCK_N=cfg.block_n,
                    BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d, num_warps=warps, num_stages=stages)
            try:
                st = prod()[0]
                var()
                ok = torch.equal(r1[:, :v], r2[:, :v]) or float((r1[:, :v].float() - r2[:, :v].float()).abs().max())
                s_ok = float(((so.sum(0) - st[0].sum(0)).abs() / st[0].sum(0)).max())
                t_p = do_bench(prod, warmup=25, rep=200)
                t_v = do_bench(var, warmup=25, rep=200)
                print(f"{name} rows {rows} ws={ws} stages={stages} warps={warps}: production {t_p:.3f} ms, variant "
                      f"{t_v:.3f} ms, R equal/maxdiff {ok}, S rel diff {s_ok:.2e}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{name} ws={ws} stages={stages} warps={warps}: {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
