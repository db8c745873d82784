"""Settled experiment: the recomputing backward (a loss on return_lse's output, per-token weights) in fp32 through the
G kernel's Triton dots (FMA: `ieee`) against the one-pass row kernel over cuBLAS's logits (paths.loss_gradients'
route where Triton's dots are FMA). One GPU, realistic inputs, N = 8,192, b = 0.1, do_bench medians.

    python benchmarks/recompute_fp32.py   (writes $OUT/recompute_fp32.json)
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import triton.testing  # noqa: E402

from bench_linear_cross_entropy import SHAPES  # noqa: E402
from hf_lsce.ops.dispatch import dense_backward, forward_stats  # noqa: E402
from hf_lsce.ops.train_pass import triton_train_pass  # noqa: E402
from real_inputs import fitted_params, realistic_batch  # noqa: E402

rows = []
for shape in ("smollm2-135m", "gemma3-270m", "gemma2-2b", "llama3-8b"):
    n, d, v = SHAPES[shape]
    h, w, y = realistic_batch(n, d, v, seed=0, device="cuda", dtype=torch.float32, **fitted_params())
    y = y.clamp(min=-1)
    grad = torch.rand(n, device="cuda") / n
    grad_lse = torch.full((n,), 0.01 / n, device="cuda")
    sm = torch.full((n,), 0.1, device="cuda")
    lse = forward_stats(h, w, None, y, None, "triton")[0]
    row = dict(shape=shape, dtype="fp32")
    for trainable in (True, False):
        g_kernel = lambda: dense_backward(h, w, None, y, lse, grad, sm, None, "triton", need_dw=trainable,  # noqa
                                          extra=grad_lse)
        row_kernel = lambda: triton_train_pass(h, w, None, y, sm, grad, None, need_dw=trainable,  # noqa
                                               need_db=False, extra=grad_lse)
        head = "trainable" if trainable else "frozen"
        a, b = g_kernel(), row_kernel()[1:]
        row[f"{head} dh rel diff"] = float((a[0] - b[0]).norm() / a[0].norm())
        for name, fn in (("G kernel (FMA)", g_kernel), ("row kernel (cuBLAS)", row_kernel)):
            row[f"{head} {name} ms"] = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
    rows.append(row)
    print(json.dumps(row), flush=True)
    del h, w
    torch.cuda.empty_cache()
with open(os.path.join(os.environ.get("OUT", "."), "recompute_fp32.json"), "w") as f:
    json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
