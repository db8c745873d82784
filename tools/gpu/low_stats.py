"""memory='low' with a trainable head: its statistics pass by the fused kernel without storing R (new) against the
forward kernel (before), in one process; N = 8192, realistic inputs, b = 0.1, the three-matmul floor beside."""
import json, os, sys
import torch
from triton.testing import do_bench
sys.path.insert(0, "benchmarks")
from bench_linear_cross_entropy import SHAPES, measure, floor_ms
from real_inputs import fitted_params, realistic_batch
import hf_lsce.ops.fused_pass as fp
from hf_lsce.ops.dispatch import forward_stats
from hf_lsce import linear_cross_entropy

orig = fp.triton_fused_columns
def old_stats(hidden, weight, bias, targets, smoothing, scale, config, chunk_bytes=None, need_stats=False,
              z_loss=0.0, need_dh=True):
    if need_dh:
        return orig(hidden, weight, bias, targets, smoothing, scale, config, chunk_bytes, need_stats, z_loss)
    return forward_stats(hidden, weight, bias, targets, None, "triton", stats=need_stats), None, None, None
def low(h, w, y, b, cap):
    return linear_cross_entropy(h, w, y, label_smoothing=b, memory="low")
rows = []
for name in sys.argv[1].split(","):
    n, d, v = SHAPES[name]
    h, w, y = realistic_batch(n, d, v, seed=0, device="cuda", **fitted_params())
    res = dict(shape=name)
    for rep in range(2):
        for method in ("fused stats", "forward kernel"):
            fp.triton_fused_columns = orig if method == "fused stats" else old_stats
            res[f"{method} {rep}"] = measure(low, h, w, y, 0.1, None, False, do_bench, True)["fwdbwd_ms"]
    fp.triton_fused_columns = orig
    res["floor"] = floor_ms(h, w, False, do_bench)
    rows.append(res)
    print(json.dumps(res), flush=True)
    del h, w, y
    torch.cuda.empty_cache()
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "low_stats.json"), "w"), indent=1)
