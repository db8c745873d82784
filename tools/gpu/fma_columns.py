"""Question: where Triton's dots are FMA (fp32 inputs on every GPU; every dtype on Turing and Volta), should the
recomputing backward by vocabulary columns (the vocabulary-parallel backward, ``memory="low"``'s gradients, a loss
on the lse output) take each chunk's logits from cuBLAS and G from the one-pass row kernel with the lse given
(``train_pass.logits_gradients``) instead of the G kernel's FMA dots? ``backward.triton_gradients_by_columns`` both
ways on the same realistic inputs (N = 8,192, b = 0.1), the default 1 GiB chunk and the low-memory mode's; do_bench
medians (ms) and the largest relative difference of dh and dW. fp32 natively; bf16 under TRITON_OVERRIDE_ARCH=sm75
(a T4's code). Writes $OUT/fma_columns[_ARCH].json.

    PYTHONPATH=$PWD python tools/gpu/fma_columns.py
"""
import json
import os
import sys

import torch
from triton.testing import do_bench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from real_inputs import fitted_params, realistic_batch  # noqa: E402

from hf_lsce.ops import config  # noqa: E402
from hf_lsce.ops.backward import triton_gradients_by_columns  # noqa: E402
from hf_lsce.ops.dispatch import forward_stats  # noqa: E402

SHAPES = {"gemma3-270m": (8192, 640, 262144), "gemma2-2b": (8192, 2304, 256000), "llama3-8b": (8192, 4096, 128256)}


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def main():
    arch = os.environ.get("TRITON_OVERRIDE_ARCH", "")
    dtype = torch.bfloat16 if arch else torch.float32
    rows = []
    for head, (n, d, v) in SHAPES.items():
        h, w, y = realistic_batch(n, d, v, dtype=dtype, device="cuda", **fitted_params())
        lse = forward_stats(h, w, None, y, None, "triton", stats=False)[0]
        grad = torch.full((n,), 1.0 / n, device="cuda")
        sm = torch.full((n,), 0.1, device="cuda")
        cfg = config.grad_logits_config(dtype, h.device)
        for chunk_name, chunk in (("1 GiB", None), ("low", config.low_memory_chunk_bytes(n, d))):
            for need_dw in (True, False):
                out = {}
                for route, cublas in (("G kernel", False), ("cuBLAS + row kernel", True)):
                    fn = lambda: triton_gradients_by_columns(h, w, None, y, lse, grad, sm, None, cfg,  # noqa: E731
                                                             need_dw=need_dw, need_db=False, chunk_bytes=chunk,
                                                             cublas=cublas)
                    out[route] = fn()
                    t = do_bench(fn, warmup=1, rep=1)
                    rows.append(dict(arch=arch or "native", dtype=str(dtype)[6:], head=head, chunk=chunk_name,
                                     trainable=need_dw, route=route, ms=t))
                    print(f"{arch or 'native':6s} {head:12s} {chunk_name:5s} {'trainable' if need_dw else 'frozen':9s} "
                          f"{route:20s} {t:9.2f} ms", flush=True)
                a, b = out["G kernel"], out["cuBLAS + row kernel"]
                diff = dict(dh=rel(b[0], a[0]), dw=rel(b[1], a[1]) if need_dw else None)
                rows[-1]["diff_vs_g_kernel"] = diff
                print(f"    dh / dW relative difference between the routes: {diff}", flush=True)
        del h, w, y
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), f"fma_columns{'_' + arch if arch else ''}.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
