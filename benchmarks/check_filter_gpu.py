"""Gradient filtering with a per-row bound on the GPU: what it skips, what it costs, where the time goes.

    python benchmarks/check_filter_gpu.py [--real-inputs FILE] [--sweep] --out-dir DIR

For Gemma-3-270m's shape (N = 8192, D = 640, V = 262,144, bf16, b = 0.1), on the real hidden states and head
(``--real-inputs``, a ``real_inputs.py capture --with-head`` file) and on the fitted generator: the gradients of the
two-pass column path (what the op runs at this D) without filtering and with ``filter_eps = 2^-k``, vocabulary
sorted: fraction of (64 x 128) tiles skipped, the largest share of a row's L1 mass skipped (the bound: at most
eps), time; then, per chunk of columns at 2^-8, where the time goes (G kernel with and without the masses, the
per-row choice, the sparse products against cuBLAS's dense ones). ``--sweep``: the sparse kernels' block of D,
warps and stages on the first and last chunk. Writes ``check_filter_gpu.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--real-inputs", default=None)
    ap.add_argument("--eps", default="6,8,10", help="exponents k of filter_eps = 2^-k")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--regimes", default=None, help="comma-separated: real, realistic (default: both when given)")
    ap.add_argument("--check", action="store_true", help="first: the op with filtering on both training paths "
                    "against fp64 (the generator, N = 4096, V = 65,536)")
    ap.add_argument("--out-dir", default=".")
    a = ap.parse_args()
    from triton.testing import do_bench

    from bench_linear_cross_entropy import make_regime_inputs
    from hf_lsce import linear_cross_entropy
    from hf_lsce.ops.backward import (add_column_chunk_gradients, mass_width, triton_gradients_by_columns,
                                      write_grad_logits)
    from hf_lsce.ops.config import GRAD_CHUNK_BYTES, grad_logits_config
    from hf_lsce.ops.sparse import (TILE_N, TILE_V, filter_active, row_mass, sorted_vocabulary, sparse_dh, sparse_dw,
                                    tile_masses)

    def bench(fn):
        return do_bench(fn, warmup=20, rep=200, return_mode="median")

    rows, parts, sweep, checks = [], [], [], []
    if a.check:
        import hf_lsce.ops.config as config
        from bench_linear_cross_entropy import fp64_reference

        h, w, y = make_regime_inputs("realistic", 4096, 640, 65536, "cuda")
        ref = fp64_reference(h, w, y, 0.1, None)
        for path in ("one-pass", "two-pass"):
            config.TRAIN_PATH = path
            for k in (None, 4, 8):
                hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
                loss = linear_cross_entropy(hh, ww, y, label_smoothing=0.1, filter_eps=2.0 ** -k if k else 0.0)
                loss.backward()
                r = dict(path=path, eps=f"2^-{k}" if k else "0", loss_err=abs(float(loss) - ref[0]) / abs(ref[0]),
                         dh_err=float((hh.grad.double() - ref[1]).norm() / ref[1].norm()),
                         dw_err=float((ww.grad.double() - ref[2]).norm() / ref[2].norm()))
                checks.append(r)
                print(json.dumps(r), flush=True)
        config.TRAIN_PATH = None
        h = w = y = ref = None
    regimes = a.regimes.split(",") if a.regimes else (["real"] if a.real_inputs else []) + ["realistic"]
    for regime in regimes:
        h, w, y = make_regime_inputs(regime, 8192, 640, 262144, "cuda", a.real_inputs)
        n, d = h.shape
        v = w.shape[0]
        with torch.no_grad():
            _, lse = linear_cross_entropy(h, w, y, label_smoothing=0.1, return_lse=True, reduction="none")
        lse = lse.float().contiguous()
        t = torch.where(y >= 0, y, -1).contiguous()
        scale = ((t >= 0).float() / (t >= 0).sum().clamp_min(1)).contiguous()
        sm = torch.full((n,), 0.1, device="cuda")
        cfg = grad_logits_config(h.dtype, h.device)
        for k in [None] + [int(x) for x in a.eps.split(",")]:
            eps = 0.0 if k is None else 2.0 ** -k
            info = {}
            triton_gradients_by_columns(h, w, None, t, lse, scale, sm, None, cfg, filter_eps=eps, sort_vocab=eps > 0,
                                        info=info)
            ms = bench(lambda: triton_gradients_by_columns(h, w, None, t, lse, scale, sm, None, cfg, filter_eps=eps,
                                                           sort_vocab=eps > 0))
            row = dict(regime=regime, eps=f"2^-{k}" if k else "0 (exact)", backward_ms=ms,
                       skipped_tiles=float(info["skipped_tiles"]) if info else 0.0,
                       max_row_lost=float(info["max_row_lost"]) if info else 0.0)
            rows.append(row)
            print(json.dumps(row), flush=True)
        # where the time goes at 2^-8, chunk by chunk (sorted vocabulary)
        eps = 2.0 ** -8
        order, ws, _, ts = sorted_vocabulary(h, w, None, t)
        budget = eps * row_mass(h, w, None, t, lse, scale, sm)
        cols = GRAD_CHUNK_BYTES // (n * h.element_size()) // TILE_V * TILE_V
        g = torch.empty(n, cols, dtype=h.dtype, device="cuda")
        mw = mass_width(cfg)
        mass = torch.empty(n, cols // mw, device="cuda")
        dh = torch.zeros(n, d, device="cuda")
        dw = torch.empty(v, d, dtype=w.dtype, device="cuda")
        for c0 in range(0, v, cols):
            c1 = min(v, c0 + cols)
            gc, mc, wc = g[:, : c1 - c0], mass[:, : (c1 - c0) // mw], ws[c0:c1]
            p = dict(regime=regime, chunk=f"{c0}:{c1}")
            p["G kernel ms"] = bench(lambda: write_grad_logits(cfg, h, wc, None, ts - c0, lse, scale, sm, None, gc, v,
                                                               None))
            p["G kernel + masses ms"] = bench(lambda: write_grad_logits(cfg, h, wc, None, ts - c0, lse, scale, sm, None,
                                                                        gc, v, None, mass=mc))
            tm = tile_masses(mc, mw)
            tgt = torch.div(ts - c0, TILE_V, rounding_mode="floor")
            bud = budget * ((c1 - c0) / v)
            p["choice ms"] = bench(lambda: filter_active(tm, tgt, bud, TILE_N))
            plan = filter_active(tm, tgt, bud, TILE_N)
            p["active tiles"] = float(plan.active.float().mean())
            p["sparse dh ms"] = bench(lambda: sparse_dh(gc, wc, plan, dh, accumulate=True))
            p["sparse dW ms"] = bench(lambda: sparse_dw(gc, h, plan, dw, first=True, perm=order[c0:c1]))
            p["cuBLAS dh + dW ms"] = bench(lambda: add_column_chunk_gradients(gc, h, wc, dh, dw[c0:c1], None,
                                                                             first=False))
            parts.append(p)
            print(json.dumps(p), flush=True)
            if a.sweep and c0 in (0, (v - 1) // cols * cols):
                for bd in (64, 128):
                    for warps in (4, 8):
                        for splits in (1, 4, 8):
                            tu = dict(BD=bd, num_warps=warps, num_stages=3)
                            try:
                                r = dict(regime=regime, chunk=p["chunk"], SPLITS=splits, **tu,
                                         dh_ms=bench(lambda: sparse_dh(gc, wc, plan, dh, accumulate=True,
                                                                       tuning=dict(tu, SPLITS=splits))),
                                         dw_ms=bench(lambda: sparse_dw(gc, h, plan, dw, first=True,
                                                                       perm=order[c0:c1], tuning=tu)))
                            except Exception as e:  # noqa: BLE001 (out of shared memory, ...)
                                r = dict(regime=regime, chunk=p["chunk"], SPLITS=splits, **tu,
                                         error=f"{type(e).__name__}")
                            sweep.append(r)
                            print(json.dumps(r), flush=True)
        h = w = y = g = dw = ws = None
        torch.cuda.empty_cache()
    os.makedirs(a.out_dir, exist_ok=True)
    out = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, checks=checks, rows=rows, parts=parts,
               sweep=sweep)
    with open(os.path.join(a.out_dir, "check_filter_gpu.json"), "w") as f:
        json.dump(out, f, indent=1)
    lines = ["| inputs | filter_eps | backward (column path) ms | tiles skipped | largest row loss / its L1 |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['regime']} | {r['eps']} | {r['backward_ms']:.2f} | {r['skipped_tiles']:.1%} | "
              f"{r['max_row_lost']:.2e} |" for r in rows]
    keys = ["G kernel ms", "G kernel + masses ms", "choice ms", "active tiles", "sparse dh ms", "sparse dW ms",
            "cuBLAS dh + dW ms"]
    lines += ["", "| inputs | chunk | " + " | ".join(keys) + " |", "|---" * (len(keys) + 2) + "|"]
    lines += [f"| {p['regime']} | {p['chunk']} | " + " | ".join(f"{p[k]:.3g}" for k in keys) + " |" for p in parts]
    with open(os.path.join(a.out_dir, "check_filter_gpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
