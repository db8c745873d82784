"""Forward-kernel experiments (issue 3's evaluation-loss target: <= 1.1 x one bf16 logits matmul).

These experiments led to the library's TMA forward kernel (``hf_lsce/ops/forward.py``, v7 in
``benchmarks/experiments/NOTES.md``). The kernel before it walked its vocabulary slice one (BLOCK_N, BLOCK_V) tile
at a time with a nested loop over D: every tile restarted the software pipeline of the D loop (its
prologue loads exposed), and the online-softmax epilogue ran while no MMA was in flight. The variants
here keep the same arithmetic and change only the schedule:

- ``flat``: one flattened loop over (vocabulary tile, D step) pairs, so the loads of the next tile
  are already in flight while the epilogue of this one runs (the pipeline never drains);
- ``flat-tma``: the same with TMA tensor-descriptor loads (Hopper);
- ``flat-tma-ws`` / ``nested-tma-ws``: Triton's automatic warp specialisation (producer warps issue
  the TMA loads, consumer warps run MMA and epilogue), where the installed Triton supports it.

Each variant runs in its own process (a kernel that faults cannot poison the others), is checked
against fp64 on its first 512 rows (lse, target logit, sum of logits) and timed with
``triton.testing.do_bench`` (median), beside cuBLAS's bf16 logits matmul; a table is printed and JSON
written. A variant that fails to compile or run is reported with its error. ``--production`` times the
library's own ``triton_forward`` per block shape and split count instead.

    python benchmarks/experiments/forward_variants.py [--shape gemma2-2b] [--out forward_variants.json]
    python benchmarks/experiments/forward_variants.py --production [--shape gemma2-2b]
    TRITON_INTERPRET=1 python benchmarks/experiments/forward_variants.py --check-only   # CPU: correctness only
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from hf_lsce.ops import forward as fw  # noqa: E402
from hf_lsce.ops.config import forward_config  # noqa: E402


@triton.jit
def _fwd_flat_ptr(H, W, Y, M_OUT, S_OUT, T_OUT, SZ_OUT, ZY_OUT, AM_OUT, N, V, D, NUM_SPLITS, stride_hn, stride_wv,
                  BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                  UPCAST: tl.constexpr):
    # Pointer loads, one flattened (tile, D step) loop; the library's epilogue and state (fw._fold_tile etc.).
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    y = tl.load(Y + offs_n, mask=mask_n, other=-1)
    m, s, t, sz, zy, am = fw._init_state(BLOCK_N)
    v_start, v_end = fw._split_bounds(V, NUM_SPLITS, BLOCK_V)
    k_steps = tl.cdiv(D, BLOCK_D)
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for it in range(0, tl.cdiv(v_end - v_start, BLOCK_V) * k_steps):
        v0 = v_start + (it // k_steps) * BLOCK_V
        k = it % k_steps
        offs_v = v0 + tl.arange(0, BLOCK_V)
        offs_d = k * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        h = tl.load(H + offs_n[:, None] * stride_hn + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        w = tl.load(W + offs_v[:, None] * stride_wv + offs_d[None, :],
                    mask=(offs_v < V)[:, None] & mask_d[None, :], other=0.0)
        acc = fw._dot(h, tl.trans(w), acc, "tf32", UPCAST)
        if k == k_steps - 1:
            m, s, t, sz, zy, am = fw._fold_tile(acc, v0, offs_v, offs_v < v_end, y, m, s, t, sz, zy, am, False)
            acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    fw._store_state(M_OUT, S_OUT, T_OUT, SZ_OUT, ZY_OUT, AM_OUT, N, offs_n, mask_n, m, s, t, sz, zy, am)


@triton.jit
def _fwd_tma(h_desc, w_desc, z_desc, Y, M_OUT, S_OUT, T_OUT, SZ_OUT, ZY_OUT, AM_OUT, N, V, D, NUM_SPLITS,
             BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
             WS: tl.constexpr, NESTED: tl.constexpr, STORE_Z: tl.constexpr):
    # TMA loads; NESTED: a loop over tiles with the D loop inside (else flattened); WS: Triton's automatic
    # warp specialisation on the outer loop; STORE_Z: also write the fp32 logits (as cuBLAS does for the
    # training path).
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    y = tl.load(Y + offs_n, mask=mask_n, other=-1)
    m, s, t, sz, zy, am = fw._init_state(BLOCK_N)
    v_start, v_end = fw._split_bounds(V, NUM_SPLITS, BLOCK_V)
    k_steps = tl.cdiv(D, BLOCK_D)
    if NESTED:
        for v0 in tl.range(v_start, v_end, BLOCK_V, warp_specialize=WS):
            acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
            for k in range(k_steps):
                h = h_desc.load([n0, k * BLOCK_D])
                w = w_desc.load([v0, k * BLOCK_D])
                acc = fw._dot(h, tl.trans(w), acc, "tf32", UPCAST)
            if STORE_Z:
                z_desc.store([n0, v0], acc)
            offs_v = v0 + tl.arange(0, BLOCK_V)
            m, s, t, sz, zy, am = fw._fold_tile(acc, v0, offs_v, offs_v < v_end, y, m, s, t, sz, zy, am, False)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        for it in tl.range(0, tl.cdiv(v_end - v_start, BLOCK_V) * k_steps, warp_specialize=WS):
            v0 = v_start + (it // k_steps) * BLOCK_V
            k = it % k_steps
            h = h_desc.load([n0, k * BLOCK_D])
            w = w_desc.load([v0, k * BLOCK_D])
            acc = fw._dot(h, tl.trans(w), acc, "tf32", UPCAST)
            if k == k_steps - 1:
                if STORE_Z:
                    z_desc.store([n0, v0], acc)
                offs_v = v0 + tl.arange(0, BLOCK_V)
                m, s, t, sz, zy, am = fw._fold_tile(acc, v0, offs_v, offs_v < v_end, y, m, s, t, sz, zy, am, False)
                acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    fw._store_state(M_OUT, S_OUT, T_OUT, SZ_OUT, ZY_OUT, AM_OUT, N, offs_n, mask_n, m, s, t, sz, zy, am)


def run_variant(kind, h, w, y, splits, bn, bv, bd, warps, stages, z=None):
    """Launch one variant; returns (lse, zy, sz) per token. ``kind`` ending in "-store" also writes the
    fp32 logits into ``z`` (N, V) (what the one-pass training path gets from cuBLAS)."""
    n, d = h.shape
    v = w.shape[0]
    f32 = dict(dtype=torch.float32, device=h.device)
    m, s, t, sz, zy = (torch.empty(splits, n, **f32) for _ in range(5))
    am = torch.empty(splits, n, dtype=torch.int32, device=h.device)
    outs = (y, m, s, t, sz, zy, am, n, v, d, splits)
    grid = (splits, triton.cdiv(n, bn))
    upcast = h.device.type == "cpu"
    if kind == "flat":
        _fwd_flat_ptr[grid](h, w, *outs, h.stride(0), w.stride(0), BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=bd,
                            UPCAST=upcast, num_warps=warps, num_stages=stages)
    else:
        from triton.tools.tensor_descriptor import TensorDescriptor
        hd = TensorDescriptor.from_tensor(h, [bn, bd])
        wd = TensorDescriptor.from_tensor(w, [bv, bd])
        store = kind.endswith("-store")
        zd = TensorDescriptor.from_tensor(z, [bn, bv]) if store else hd
        kind = kind.removesuffix("-store")
        _fwd_tma[grid](hd, wd, zd, *outs, BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=bd, UPCAST=upcast,
                       WS=kind.endswith("-ws"), NESTED=kind.startswith("nested"), STORE_Z=store,
                       num_warps=warps, num_stages=stages)
    lse, zy_, sz_, _, _ = fw.merge_splits(m, s, t, sz, zy, am, stats=False)
    return lse, zy_, sz_


VARIANTS = [  # (kind, BLOCK_N, BLOCK_V, BLOCK_D, num_warps, num_stages, splits); splits 0: fit whole waves
    ("flat-tma", 128, 256, 64, 8, 3, 4), ("flat-tma-ws", 128, 256, 64, 8, 3, 4),
    ("flat-tma-ws", 128, 256, 64, 8, 4, 4), ("flat-tma-ws", 128, 256, 64, 4, 3, 4),
    ("flat-tma-ws", 256, 128, 64, 8, 3, 4), ("flat-tma-ws", 256, 128, 64, 8, 4, 4),
    ("flat-tma-ws", 128, 128, 64, 4, 4, 4), ("flat-tma", 256, 128, 64, 8, 4, 4),
    ("flat-tma-ws", 128, 256, 64, 8, 3, 2), ("flat-tma-ws", 256, 128, 64, 8, 4, 2),
]
# Earlier sweeps (benchmarks/experiments/results/forward_variants_v7*.json) ran other lists: 128 x 128 / 256 x 128 / 128 x 256 tiles,
# 3 / 4 stages, 2 to 66 splits, pointer and TMA loads, nested and flattened loops, with and without warp
# specialisation, and storing the logits.
# Other shapes: the leading candidates only.
SHORT = [0, 1, 4, 5]

def fitted_splits(row_blocks, sms, lo=16, hi=48):
    """Split count in [lo, hi] whose grid (splits x row blocks) wastes the least of its last wave."""
    def waste(sp):
        p = sp * row_blocks
        return (triton.cdiv(p, sms) * sms - p) / p
    return min(range(lo, hi + 1), key=lambda sp: (round(waste(sp), 3), sp))


def check_only():
    """Tiny shape under the CPU interpreter: every non-WS kind against fp64."""
    torch.manual_seed(0)
    n, d, v = 40, 48, 300
    h = torch.randn(n, d)
    w = torch.randn(v, d) / math.sqrt(d)
    y = torch.randint(0, v, (n,))
    z = (h.double() @ w.double().T)
    want = (torch.logsumexp(z, -1), z.gather(1, y[:, None])[:, 0], z.sum(-1))
    for kind in ("flat", "flat-tma", "flat-tma-store", "nested-tma-store"):
        for splits in (1, 3):
            zbuf = torch.full((n, v), float("nan"))
            got = run_variant(kind, h, w, y, splits, 16, 32, 16, 1, 1, z=zbuf)
            err = max(float((g.double() - e).abs().max()) for g, e in zip(got, want))
            if kind.endswith("-store"):
                err = max(err, float((zbuf.double() - z).abs().max()))
            print(f"{kind} splits={splits}: max abs err vs fp64 {err:.2e}")


def one_variant(index, shape):
    """Compile, check (first 512 rows against fp64) and time VARIANTS[index]; returns a row dict."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
    from bench_linear_cross_entropy import SHAPES
    from check_correctness_gpu import make_inputs
    from triton.testing import do_bench

    kind, bn, bv, bd, warps, stages, splits = VARIANTS[index]
    n, d, v = SHAPES[shape]
    h, w, y, _ = make_inputs(n, d, v, peaked=True, bias=False, ignore_frac=0.0, seed=0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = splits or fitted_splits(triton.cdiv(n, bn), sms)
    name = f"{kind} {bn}x{bv}x{bd} w{warps} s{stages} splits={splits}"
    zbuf = torch.empty(n, v, dtype=torch.float32, device=h.device) if kind.endswith("-store") else None
    try:
        got = run_variant(kind, h, w, y, splits, bn, bv, bd, warps, stages, z=zbuf)
        torch.cuda.synchronize()
        z = h[:512].double() @ w.double().T
        want = (torch.logsumexp(z, -1), z.gather(1, y[:512, None])[:, 0], z.sum(-1))
        err = max(float(((g[:512].double() - e).abs() / e.abs().clamp_min(1)).max()) for g, e in zip(got, want))
        if zbuf is not None:
            err = max(err, float((zbuf[:512].double() - z).abs().max() / z.abs().max()))
        del z
        fn = lambda: run_variant(kind, h, w, y, splits, bn, bv, bd, warps, stages, z=zbuf)  # noqa: E731
        fn()
        torch.cuda.synchronize()
        t = do_bench(fn, warmup=10, rep=200, return_mode="median")
        return dict(variant=name, ms=t, max_rel_err_fp64=err)
    except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
        return dict(variant=name, error=f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")


def production(shape, out, n_override=None):
    """hf_lsce's own forward (``triton_forward``) per block shape and split count, as configured, and the
    whole evaluation loss call, beside cuBLAS's logits matmul."""
    import dataclasses

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
    from bench_linear_cross_entropy import SHAPES
    from check_correctness_gpu import make_inputs
    from triton.testing import do_bench

    from hf_lsce import linear_cross_entropy

    n, d, v = SHAPES[shape]
    n = n_override or n
    h, w, y, _ = make_inputs(n, d, v, peaked=True, bias=False, ignore_frac=0.0, seed=0)
    cfg = forward_config(h.dtype, h.device)

    def bench(fn):
        fn()
        torch.cuda.synchronize()
        return do_bench(fn, warmup=10, rep=300, return_mode="median")

    rows = [dict(variant="cuBLAS bf16 logits matmul", ms=bench(lambda: h @ w.T))]
    # Block shapes (BLOCK_N, BLOCK_V, BLOCK_D, warps, stages) around the library's choice, at several split counts.
    shapes = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3)]
    for bn, bv, bd, warps, stages in shapes[:1] if n_override else shapes:
        for splits in (1, 2, 4, 8, 16):
            one = dataclasses.replace(cfg, autotune=False, block_n=bn, block_v=bv, block_d=bd, num_warps=warps,
                                      num_stages=stages, min_splits=splits, min_programs=1)
            rows.append(dict(variant=f"triton_forward {bn}x{bv}x{bd} w{warps} s{stages} splits={splits}",
                             ms=bench(lambda: fw.triton_forward(h, w, None, y, None, one, stats=False))))
    rows.append(dict(variant=f"triton_forward as configured ({'TMA' if cfg.tma else 'pointer'} kernel)",
                     ms=bench(lambda: fw.triton_forward(h, w, None, y, None, cfg, stats=False))))
    with torch.no_grad():
        rows.append(dict(variant="linear_cross_entropy, no grad, b=0.1",
                         ms=bench(lambda: linear_cross_entropy(h, w, y, label_smoothing=0.1))))
    for r in rows:
        r["x_matmul"] = r["ms"] / rows[0]["ms"]
        print(f"{r['variant']}: {r['ms']:.2f} ms ({r['x_matmul']:.3f}x)", flush=True)
    with open(out, "w") as f:
        json.dump(dict(shape=shape, N=n, D=d, V=v, device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="gemma2-2b")
    ap.add_argument("--short", action="store_true", help="only the leading candidates (SHORT)")
    ap.add_argument("--n", type=int, default=None, help="--production: number of rows N instead of the shape's")
    ap.add_argument("--out", default="forward_variants.json")
    ap.add_argument("--check-only", action="store_true", help="tiny shape, correctness only (CPU interpreter)")
    ap.add_argument("--only", type=int, default=None, help="(internal) run VARIANTS[i] and print its row as JSON")
    ap.add_argument("--production", action="store_true",
                    help="time the library's forward per block shape and split count, as configured, and the op")
    args = ap.parse_args()
    if args.check_only:
        return check_only()
    if args.production:
        return production(args.shape, args.out, args.n)
    if args.only is not None:
        print("ROW " + json.dumps(one_variant(args.only, args.shape)), flush=True)
        return

    import subprocess

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
    from bench_linear_cross_entropy import SHAPES
    from check_correctness_gpu import make_inputs
    from triton.testing import do_bench

    n, d, v = SHAPES[args.shape]
    h, w, y, _ = make_inputs(n, d, v, peaked=True, bias=False, ignore_frac=0.0, seed=0)

    def bench(fn):
        fn()
        torch.cuda.synchronize()
        return do_bench(fn, warmup=10, rep=200, return_mode="median")

    t_mm = bench(lambda: h @ w.T)
    rows = [dict(variant="cuBLAS bf16 logits matmul", ms=t_mm)]
    zbuf = torch.empty(n, v, dtype=torch.float32, device=h.device)
    rows.append(dict(variant="cuBLAS logits matmul, fp32 out",
                     ms=bench(lambda: torch.mm(h, w.T, out_dtype=torch.float32, out=zbuf))))
    del zbuf
    cfg = forward_config(h.dtype, h.device)
    rows.append(dict(variant="production forward (autotuned)",
                     ms=bench(lambda: fw.triton_forward(h, w, None, y, None, cfg, stats=False))))
    for r in rows:
        print(f"{r['variant']}: {r['ms']:.2f} ms ({r['ms'] / t_mm:.3f}x matmul)", flush=True)
    del h, w, y
    torch.cuda.empty_cache()
    # Each variant in its own process: a kernel that faults must not poison the others' CUDA context.
    for i in (SHORT if args.short else range(len(VARIANTS))):
        res = subprocess.run([sys.executable, __file__, "--only", str(i), "--shape", args.shape],
                             capture_output=True, text=True, timeout=300)
        line = [ln for ln in res.stdout.splitlines() if ln.startswith("ROW ")]
        row = json.loads(line[0][4:]) if line else dict(variant=str(VARIANTS[i]),
                                                          error=(res.stderr.strip().splitlines() or ["?"])[-1][:300])
        if "ms" in row:
            row["x_matmul"] = row["ms"] / t_mm
            print(f"{row['variant']}: {row['ms']:.2f} ms ({row['x_matmul']:.3f}x matmul), "
                  f"max rel err vs fp64 {row['max_rel_err_fp64']:.1e}", flush=True)
        else:
            print(f"{row['variant']}: FAILED {row['error']}", flush=True)
        rows.append(row)
    with open(args.out, "w") as f:
        json.dump(dict(shape=args.shape, N=n, D=d, V=v, device=torch.cuda.get_device_name(),
                       triton=triton.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
