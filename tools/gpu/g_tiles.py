"""Question: does the pointer-load G kernel (``backward._lce_grad_logits_kernel``: the two-pass path, ``memory="low"``
with a trainable head, the recomputing backward, the vocabulary-parallel backward, on GPUs without TMA) need its
autotuning (five candidates, tuned again per chunk width), or does one fixed tile shape match it? One chunk of G
(65,536 columns: 1 GiB at N = 8,192, bf16) at the Gemma-3-270m, Gemma2-2B and Llama-3-8B heads, realistic inputs;
do_bench medians (ms). Run natively and under TRITON_OVERRIDE_ARCH=sm80 (an A100's code). Writes
$OUT/g_tiles[_sm80].json.

    PYTHONPATH=$PWD python tools/gpu/g_tiles.py
"""
import dataclasses
import json
import os
import sys

import torch
from triton.testing import do_bench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from real_inputs import fitted_params, realistic_batch  # noqa: E402

from hf_lsce.ops import config  # noqa: E402
from hf_lsce.ops.backward import write_grad_logits  # noqa: E402
from hf_lsce.ops.fused_pass import fused_statistics  # noqa: E402

SHAPES = {"gemma3-270m": (8192, 640, 262144), "gemma2-2b": (8192, 2304, 256000), "llama3-8b": (8192, 4096, 128256)}
FIXED = [(128, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (256, 128, 64, 8, 3)]


def main():
    arch = os.environ.get("TRITON_OVERRIDE_ARCH", "")
    rows = []
    for head, (n, d, v) in SHAPES.items():
        h, w, y = realistic_batch(n, d, v, dtype=torch.bfloat16, device="cuda", **fitted_params())
        lse = fused_statistics(h, w, None, y, None, config.fused_config(h.dtype, h.device), need_stats=False)[0]
        grad = torch.full((n,), 1.0 / n, device="cuda")
        sm = torch.full((n,), 0.1, device="cuda")
        cols = 65536
        wc = w[:cols]
        g = torch.empty(n, cols, dtype=h.dtype, device="cuda")
        config.TMA_SWITCH = "0"
        config.clear_caches()
        base = config.grad_logits_config(h.dtype, h.device)
        cands = {"autotuned": base}
        for bn, bv, bd, warps, st in FIXED:
            cands[f"{bn}x{bv}x{bd} w{warps} s{st}"] = dataclasses.replace(
                base, block_n=bn, block_v=bv, block_d=bd, num_warps=warps, num_stages=st, autotune=False)
        config.TMA_SWITCH = ""
        config.clear_caches()
        tma = config.grad_logits_config(h.dtype, h.device)
        if tma.tma and not arch:
            cands["TMA"] = tma
        ref = None
        for name, cfg in cands.items():
            fn = lambda: write_grad_logits(cfg, h, wc, None, y, lse, grad, sm, None, g, v, None)  # noqa: E731
            fn()
            if ref is None:
                ref = g.clone()
            same = bool(torch.equal(g, ref))
            t = do_bench(fn, warmup=50, rep=300)
            rows.append(dict(head=head, config=name, ms=t, arch=arch or "native", same_g=same))
            print(f"{arch or 'native':7s} {head:12s} {name:22s} {t:7.3f} ms  G equal to autotuned's: {same}", flush=True)
        del h, w, y, g
        torch.cuda.empty_cache()
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, f"g_tiles{'_' + arch if arch else ''}.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
