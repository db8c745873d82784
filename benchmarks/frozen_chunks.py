"""Frozen head: the fused path's R chunk size (1 GiB default) against larger chunks, N = 8192, b = 0.1."""
import sys, json, torch
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
import bench_linear_cross_entropy as B
from real_inputs import fitted_params, realistic_batch
from triton.testing import do_bench
from hf_lsce import linear_cross_entropy
import hf_lsce.ops.fused_pass as fp

fn = lambda hh, ww, yy, b, cap: linear_cross_entropy(hh, ww, yy, label_smoothing=b)
for name in ["gemma3-270m", "smollm2-135m", "gemma2-2b", "llama3-8b"]:
    n, d, v = B.SHAPES[name]
    h, w, y = realistic_batch(n, d, v, seed=0, device="cuda", **fitted_params())
    row = dict(shape=name, floor=round(B.floor_ms(h, w, True, do_bench), 2))
    for gib in (1, 2, 5, 1):
        fp.FUSED_CHUNK_BYTES = gib << 30
        r = B.measure(fn, h, w, y, 0.1, None, True, do_bench, True)
        row.setdefault(f"{gib} GiB", []).append((round(r["fwdbwd_ms"], 2), round(r["extra_mb"])))
    fp.FUSED_CHUNK_BYTES = 1 << 30
    print(json.dumps(row), flush=True)
    del h, w, y
    torch.cuda.empty_cache()
