"""Block shapes of the TMA kernel that writes G = dL/dz (kernel v2's two-pass path), against one cuBLAS logits
matmul of the same chunk (bf16 out), at the Gemma-3-270m and Gemma2-2B shapes; one chunk of 2,048 rows (1 GiB of G
at V = 262,144). Prints a table and writes $OUT/grad_kernel_variants.json.

    python benchmarks/experiments/grad_kernel_variants.py
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from hf_lsce.ops.backward import _lce_grad_logits_tma_kernel  # noqa: E402
from hf_lsce.ops.config import forward_config, launch  # noqa: E402


def main():
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows = []
    for name, d, v in (("gemma3-270m", 640, 262144), ("gemma2-2b", 2304, 256000), ("llama3-8b", 4096, 128256)):
        n = 2048
        h = (torch.randn(n, d, device="cuda") * 3).bfloat16()
        w = (torch.randn(v, d, device="cuda") / d ** 0.5).bfloat16()
        y = torch.randint(0, v, (n,), device="cuda")
        lse = torch.logsumexp((h @ w.T).float(), -1)
        grad, sm = torch.full((n,), 1 / n, device="cuda"), torch.full((n,), 0.1, device="cuda")
        g = torch.empty(n, v, dtype=torch.bfloat16, device="cuda")
        mm = do_bench(lambda: torch.mm(h, w.T, out=g), warmup=25, rep=200)
        base = forward_config(torch.bfloat16, h.device)
        for bn, bv, bd, warps, stages, splits in ((128, 256, 64, 8, 3, None), (128, 128, 64, 8, 3, None),
                                                  (128, 128, 64, 4, 4, None), (64, 256, 64, 4, 3, None),
                                                  (128, 256, 64, 8, 4, None), (128, 256, 64, 8, 3, 4),
                                                  (128, 256, 64, 8, 3, 64)):
            cfg = dataclasses.replace(base, block_n=bn, block_v=bv, block_d=bd, num_warps=warps, num_stages=stages)
            blocks = triton.cdiv(n, bn)
            sp = splits or max(1, min(triton.cdiv(v, bv), max(cfg.min_splits, round(cfg.min_programs / blocks))))
            hd = TensorDescriptor.from_tensor(h, [bn, bd])
            wd = TensorDescriptor.from_tensor(w, [bv, bd])
            args = (hd, wd, w, y, lse, grad, sm, grad, g, n, v, d, sp, g.stride(0), 1.0, 1.0 / v)
            flags = dict(HAS_BIAS=False, SOFTCAP=False, HAS_EXTRA=False, DOT_PRECISION=cfg.dot_precision,
                         UPCAST=False)
            try:
                ms = do_bench(lambda: launch(_lce_grad_logits_tma_kernel, None, cfg, lambda m: (sp, blocks), args,
                                             flags), warmup=25, rep=200)
                row = dict(shape=name, D=d, V=v, rows=n, block=(bn, bv, bd), warps=warps, stages=stages, splits=sp,
                           ms=ms, cublas_logits_ms=mm, ratio=ms / mm)
            except Exception as e:  # noqa: BLE001 - out of shared memory and the like
                row = dict(shape=name, block=(bn, bv, bd), warps=warps, stages=stages, error=str(e)[:200])
            rows.append(row)
            print(json.dumps(row), flush=True)
        del g
        torch.cuda.empty_cache()
    out = os.environ.get("OUT", "gpu_out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "grad_kernel_variants.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
