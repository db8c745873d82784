"""A frozen head under memory='low': the fused pass by vocabulary columns (new) against the two-pass computation
(what ran before), beside the two-matmul floor, N = 8192, realistic inputs; trainable low for reference."""
import json, os, sys
import torch
from triton.testing import do_bench
sys.path.insert(0, "benchmarks")
from bench_linear_cross_entropy import SHAPES, measure, floor_ms
from real_inputs import fitted_params, realistic_batch
import hf_lsce.ops.paths as paths
from hf_lsce import linear_cross_entropy

real_route = paths._route
def low(h, w, y, b, cap):
    return linear_cross_entropy(h, w, y, label_smoothing=b, softcap=cap, memory="low")
rows = []
for name in sys.argv[1].split(","):
    n, d, v = SHAPES[name]
    h, w, y = realistic_batch(n, d, v, seed=0, device="cuda", **fitted_params())
    for b in (0.1, 0.0):
        for method in ("columns", "two-pass"):
            paths._route = real_route if method == "columns" else (
                lambda opts, dw, db: "two-pass" if opts.memory == "low" else real_route(opts, dw, db))
            r = measure(low, h, w, y, b, None, True, do_bench, True)
            rows.append(dict(shape=name, b=b, method=method, **r))
            print(json.dumps(rows[-1]), flush=True)
        paths._route = real_route
    fl = floor_ms(h, w, True, do_bench)
    rows.append(dict(shape=name, method="floor", fwdbwd_ms=fl))
    print(json.dumps(rows[-1]), flush=True)
    del h, w, y
    torch.cuda.empty_cache()
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "frozen_low_cols.json"), "w"), indent=1)
