"""Which part of the fused logits kernel's epilogue costs what at small D? The production kernel against copies that
drop one part each (timing only; the copies' outputs are not the op's). Gemma-3-270m and SmolLM2 heads, N = 8192."""
import sys, torch, triton, triton.language as tl
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
from bench_linear_cross_entropy import SHAPES
from real_inputs import fitted_params, realistic_batch
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor
import hf_lsce.ops.fused_pass as fp
from hf_lsce.ops.config import forward_config
from hf_lsce.ops.forward import _split_bounds


@triton.jit
def variant(h_desc, w_desc, r_desc, R, C, S_OUT, M_OUT, N, NUM_SPLITS, stride_rn, V, D,
            MAX: tl.constexpr, SUM: tl.constexpr, EXP: tl.constexpr, STORE: tl.constexpr, MASK: tl.constexpr,
            MODE: tl.constexpr,
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
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for it in range(0, tl.cdiv(v_end - v_start, BLOCK_V) * k_steps):
        v0 = v_start + (it // k_steps) * BLOCK_V
        k = it % k_steps
        h = h_desc.load([n0, k * BLOCK_D])
        w = w_desc.load([v0, k * BLOCK_D])
        acc = tl.dot(h, tl.trans(w), acc)
        if k == k_steps - 1:
            offs_v = v0 + tl.arange(0, BLOCK_V)
            mask_v = offs_v < v_end
            z = acc
            if MASK:
                z = tl.where(mask_v[None, :], z, float("-inf"))
            if MAX:
                m = tl.maximum(m, tl.max(z, axis=1))
            r = z
            if EXP:
                r = tl.math.exp2(z * 1.4426950408889634 - c2[:, None])
            if SUM:
                s += tl.sum(r, axis=1)
            if STORE:
                if MODE == 0:
                    tl.store(R + offs_n[:, None].to(tl.int64) * stride_rn + offs_v[None, :], r.to(R.dtype.element_ty),
                             mask=mask_n[:, None] & mask_v[None, :])
                elif MODE == 1:  # TMA store
                    r_desc.store([n0, v0], r.to(tl.bfloat16))
                elif MODE == 2:  # no mask
                    tl.store(R + offs_n[:, None].to(tl.int64) * stride_rn + offs_v[None, :], r.to(R.dtype.element_ty))
                elif MODE == 3:  # int32 offsets from a per-program base
                    base = R + n0.to(tl.int64) * stride_rn
                    loc = tl.arange(0, BLOCK_N)[:, None] * stride_rn + offs_v[None, :]
                    tl.store(base + loc, r.to(R.dtype.element_ty), mask=mask_n[:, None] & mask_v[None, :])
                else:  # int32 offsets, no mask
                    base = R + n0.to(tl.int64) * stride_rn
                    loc = tl.arange(0, BLOCK_N)[:, None] * stride_rn + offs_v[None, :]
                    tl.store(base + loc, r.to(R.dtype.element_ty))
            acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    out = tl.program_id(0) * N + offs_n
    tl.store(S_OUT + out, s, mask=mask_n)
    tl.store(M_OUT + out, m, mask=mask_n)


cfg = forward_config(torch.bfloat16, torch.device("cuda"))
for shape in ["gemma3-270m", "smollm2-135m"]:
    n, d, v = SHAPES[shape]
    h, w, y = realistic_batch(n, d, v, seed=0, device="cuda", **fitted_params())
    c = torch.zeros(n, device="cuda")
    v_pad, _ = fp.chunk_rows(n, v)
    r = torch.empty(n, v_pad, dtype=torch.bfloat16, device="cuda")[:, :v]
    splits = fp.fused_splits(cfg, n, v)
    st = torch.empty(2, splits, n, device="cuda")
    hd = TensorDescriptor.from_tensor(h, [cfg.block_n, cfg.block_d])
    wd = TensorDescriptor.from_tensor(w, [cfg.block_v, cfg.block_d])
    grid = (splits, triton.cdiv(n, cfg.block_n))
    prod = lambda: fp._exp_tiles(cfg, h, w, None, c, r, False, descs=(hd, wd))
    out = {"production": do_bench(prod, warmup=25, rep=300, return_mode="median"),
           "cuBLAS logits bf16": do_bench(lambda: h @ w.T, warmup=25, rep=300, return_mode="median")}
    rd = TensorDescriptor.from_tensor(r, [cfg.block_n, cfg.block_v])
    for name, flags in [("all parts", (1, 1, 1, 1, 1, 0)), ("no store", (1, 1, 1, 0, 1, 0)),
                        ("TMA store", (1, 1, 1, 1, 1, 1)), ("store unmasked", (1, 1, 1, 1, 1, 2)),
                        ("int32 offsets", (1, 1, 1, 1, 1, 3)), ("int32 offsets unmasked", (1, 1, 1, 1, 1, 4)),
                        ("all parts again", (1, 1, 1, 1, 1, 0))]:
        mx, sm, ex, sto, msk, mode = flags
        f = lambda: variant[grid](hd, wd, rd, r, c, st[0], st[1], n, splits, r.stride(0), v, d, MAX=mx, SUM=sm, EXP=ex,
                                  STORE=sto, MASK=msk, MODE=mode, BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v,
                                  BLOCK_D=cfg.block_d,
                                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        out[name] = do_bench(f, warmup=25, rep=300, return_mode="median")
    print(shape, " | ".join(f"{k} {t:.2f}" for k, t in out.items()), flush=True)
