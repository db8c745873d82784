"""A frozen head's fast path: every row's R (the default, 4 GiB allowance) or 1 GiB row chunks, against the fused
column chunks (triton_fused_columns) at 0.5 / 1 / 2 GiB of R, N = 8192 (and 16384 at Gemma-3-270m), b = 0.1."""
import json, os, sys
import torch
from triton.testing import do_bench
sys.path.insert(0, "benchmarks")
from bench_linear_cross_entropy import SHAPES, measure, floor_ms
from real_inputs import fitted_params, realistic_batch
import hf_lsce.ops.config as config
import hf_lsce.ops.fused_pass as fp
from hf_lsce import linear_cross_entropy

real_chunk = config.low_memory_chunk_bytes
def fast(h, w, y, b, cap):
    return linear_cross_entropy(h, w, y, label_smoothing=b)
def low(h, w, y, b, cap):
    return linear_cross_entropy(h, w, y, label_smoothing=b, memory="low")
rows = []
for name, n in (("gemma3-270m", 8192), ("gemma2-2b", 8192), ("llama3-8b", 8192), ("smollm2-135m", 8192),
                ("gemma3-270m", 16384)):
    _, d, v = SHAPES[name]
    h, w, y = realistic_batch(n, d, v, seed=0, device="cuda", **fitted_params())
    res = dict(shape=name, N=n)
    res["default"] = measure(fast, h, w, y, 0.1, None, True, do_bench, True)
    saved = fp.EVERY_ROW_EXTRA_BYTES
    fp.EVERY_ROW_EXTRA_BYTES = -(1 << 40)
    res["rows 1GiB"] = measure(fast, h, w, y, 0.1, None, True, do_bench, True)
    fp.EVERY_ROW_EXTRA_BYTES = saved
    for gib in (0.5, 1, 2):
        config.low_memory_chunk_bytes = lambda n_, d_, free=None, g=gib: int(g * (1 << 30))
        res[f"cols {gib}GiB"] = measure(low, h, w, y, 0.1, None, True, do_bench, True)
    config.low_memory_chunk_bytes = real_chunk
    res["floor"] = floor_ms(h, w, True, do_bench)
    rows.append(res)
    print(json.dumps(res), flush=True)
    del h, w, y
    torch.cuda.empty_cache()
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "frozen_cols_fast.json"), "w"), indent=1)
