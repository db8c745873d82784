"""Frozen head, memory budget ~180 MiB: the fused path in row chunks (no dW, so no V x D accumulator) against the
two-pass low-memory mode. Times and extra memory at N = 8192."""
import sys, json, torch
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
import bench_linear_cross_entropy as B
from real_inputs import fitted_params, realistic_batch
from triton.testing import do_bench
from hf_lsce import linear_cross_entropy
import hf_lsce.ops.fused_pass as fp
import hf_lsce.ops.config as config

for shape in ["smollm2-135m", "gemma3-270m", "gemma2-2b", "llama3-8b"]:
    n, d, v = B.SHAPES[shape]
    h, w, y = realistic_batch(n, d, v, seed=0, device="cuda", **fitted_params())
    row = dict(shape=shape, floor=B.floor_ms(h, w, True, do_bench))
    row["low"] = B.measure(lambda hh, ww, yy, b, cap: linear_cross_entropy(hh, ww, yy, label_smoothing=b, memory="low"),
                           h, w, y, 0.1, None, True, do_bench, True)
    row["default"] = B.measure(lambda hh, ww, yy, b, cap: linear_cross_entropy(hh, ww, yy, label_smoothing=b),
                               h, w, y, 0.1, None, True, do_bench, True)
    for mib in (96, 180):
        saved = fp.FUSED_CHUNK_BYTES
        fp.FUSED_CHUNK_BYTES = mib << 20
        row[f"fused chunks {mib} MiB"] = B.measure(
            lambda hh, ww, yy, b, cap: linear_cross_entropy(hh, ww, yy, label_smoothing=b), h, w, y, 0.1, None, True,
            do_bench, True)
        fp.FUSED_CHUNK_BYTES = saved
    print(json.dumps(row), flush=True)
    del h, w, y
    torch.cuda.empty_cache()
