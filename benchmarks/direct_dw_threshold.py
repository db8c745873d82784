"""Trainable small-D heads: the fused path's direct dW (R for every row, dW by one matmul) against its chunked layout
(1 GiB chunks of R, dW accumulated in fp32), by DIRECT_DW_EXTRA_BYTES. Time, extra memory, floor."""
import sys, json, torch
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
import bench_linear_cross_entropy as B
from real_inputs import fitted_params, realistic_batch
from triton.testing import do_bench
from hf_lsce import linear_cross_entropy
import hf_lsce.ops.fused_pass as fp

fn = lambda hh, ww, yy, b, cap: linear_cross_entropy(hh, ww, yy, label_smoothing=b)
for (n, d, v, name) in [(8192, 640, 262144, "gemma3-270m"), (4096, 640, 262144, "gemma3-270m"),
                        (16384, 640, 262144, "gemma3-270m"), (8192, 1152, 262144, "gemma3-1b"),
                        (8192, 896, 151936, "qwen2.5-0.5b")]:
    h, w, y = realistic_batch(n, d, v, seed=0, device="cuda", **fitted_params())
    row = dict(shape=name, N=n, floor=B.floor_ms(h, w, False, do_bench))
    for extra_gib in (1, 3, 8):
        fp.DIRECT_DW_EXTRA_BYTES = extra_gib << 30
        direct = fp.layout(n, v, d, True)[2]
        r = B.measure(fn, h, w, y, 0.1, None, False, do_bench, True)
        row[f"{extra_gib} GiB"] = dict(direct=direct, ms=round(r["fwdbwd_ms"], 2), mb=round(r["extra_mb"]),
                                       x_floor=round(r["fwdbwd_ms"] / row["floor"], 3))
    fp.DIRECT_DW_EXTRA_BYTES = 1 << 30
    print(json.dumps(row), flush=True)
    del h, w, y
    torch.cuda.empty_cache()
