"""How much of the softmax gradient can be skipped under a per-row bound on the skipped mass (real inputs, CPU).

    python benchmarks/experiments/filter_budget.py --model gemma-3-270m --tokens 1024 \
        --json benchmarks/experiments/results/filter_budget_gemma3.json

For each row n the gradient of the loss with respect to the logits is ``g_n = G'_n - b/V`` with
``G'_n = p_n - (1 - b) onehot(y_n)``. The uniform term is exact as a rank-one correction, so only G' is
filtered. Per (row, tile of TILE_V columns) the exact mass ``S_nt = sum_{v in t} |G'_nv|`` is known on chip; a
row admits its smallest tiles (ascending, per chunk of columns) while their running sum stays within
``eps * ||g_n||_1 * (chunk width / V)``; a (TILE_N rows x TILE_V columns) tile is skipped only when every one of
its rows admits it, and never when it holds a row's target. So each row loses at most ``eps * ||g_n||_1`` of
its gradient's L1 mass: the stated bound. This script measures the fraction of tiles skipped (vocabulary order
and sorted by mean logit) and the resulting dh and dW errors against the exact fp64 gradient, beside the
error of torch's bf16 path (bf16 logits, bf16 G).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from hf_lsce.ops.sparse import admitted_tiles  # noqa: E402


def rel(a, b):
    return float((a - b).norm() / b.norm())


@torch.no_grad()
def study(h, w, y, b, eps_list, tile_n=64, tile_v=128, chunks=4):
    n, v = h.shape[0], w.shape[0]
    h64, w64 = h.double(), w.double()
    rows = torch.arange(n)
    gq = torch.softmax(h64 @ w64.T, -1)
    gq[rows, y] -= 1 - b  # G' = p - (1 - b) onehot(y), fp64
    l1 = (gq - b / v).abs().sum(-1)
    dh_ref = gq @ w64 - (b / v) * w64.sum(0)  # exact gradients of the smoothed CE (per token, unscaled)
    dw_ref = gq.T @ h64 - (b / v) * h64.sum(0)
    # torch's bf16 path: bf16 logits, softmax in fp32, G in bf16, bf16 matmuls (fp32 accumulate)
    gb = torch.softmax((h.bfloat16() @ w.bfloat16().T).float(), -1)
    gb[rows, y] -= 1 - b
    gb = (gb - b / v).bfloat16().float()
    out = {"tokens": n, "vocab": v, "b": b, "tile": [tile_n, tile_v], "chunks": chunks,
           "torch_bf16": {"dh": rel((gb @ w.bfloat16().float()).double(), dh_ref),
                          "dw": rel((gb.T @ h.bfloat16().float()).double(), dw_ref)}}
    del gb
    order = torch.argsort(w64 @ h64.mean(0), descending=True)
    inverse = torch.argsort(order)
    pad = (-v) % tile_v
    for name in ("natural", "sorted"):
        perm = order if name == "sorted" else torch.arange(v)
        gs = gq[:, perm]  # G' in this order
        yy = inverse[y] if name == "sorted" else y
        s = torch.nn.functional.pad(gs.abs(), (0, pad)).view(n, -1, tile_v).sum(-1)  # (N, T) exact tile masses
        t = s.shape[1]
        edges = [round(i * t / chunks) for i in range(chunks + 1)]
        for eps in eps_list:
            # per chunk of columns, the row's budget in proportion to the chunk's width
            skip = torch.cat([admitted_tiles(s[:, a:e], yy // tile_v - a, eps * l1 * (e - a) / t, tile_n)
                              for a, e in zip(edges[:-1], edges[1:])], 1)  # (N / TILE_N, T) bool
            dropped = skip.repeat_interleave(tile_n, 0)[:n].repeat_interleave(tile_v, 1)[:, :v]
            lost = torch.where(dropped, gs, torch.zeros((), dtype=gs.dtype))  # what filtering leaves out
            del dropped
            out.setdefault(name, {})[f"2^{int(math.log2(eps))}"] = {
                "tiles_skipped": float(skip.float().mean()),
                "max_row_lost_over_l1": float((lost.abs().sum(-1) / l1).max()),
                "dh": float((lost @ w64[perm]).norm() / dh_ref.norm()),
                "dw": float((lost.T @ h64).norm() / dw_ref.norm())}
            del lost
        del gs
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--b", type=float, default=0.1)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--generator", default=None, metavar="D,V",
                    help="the fitted synthetic generator at this shape instead of the real model")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from real_inputs import capture, fitted_params, realistic_batch

    if a.generator:
        d, v = (int(x) for x in a.generator.split(","))
        h, w, y = realistic_batch(a.tokens, d, v, seed=0, dtype=torch.float32, **fitted_params())
        a.model = f"generator D={d} V={v}"
    else:
        h, y, w = capture(a.model, a.tokens, seq=512)
    res = study(h, w, y, a.b, [2.0 ** -k for k in (4, 6, 8, 10, 12)], chunks=a.chunks)
    print(f"{a.model}: N={res['tokens']} V={res['vocab']} b={a.b}; torch bf16 errors dh {res['torch_bf16']['dh']:.2e}"
          f" dW {res['torch_bf16']['dw']:.2e}")
    print("| order | eps | tiles skipped | max row loss / L1 | dh error | dW error |")
    print("|---|---|---|---|---|---|")
    for o in ("natural", "sorted"):
        for e, r in res[o].items():
            print(f"| {o} | {e} | {r['tiles_skipped']:.1%} | {r['max_row_lost_over_l1']:.2e} | {r['dh']:.2e} |"
                  f" {r['dw']:.2e} |")
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
