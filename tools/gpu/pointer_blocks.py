"""Experiment (issue 54): the fused path's logits kernel with pointer loads (what GPUs without TMA run), on an H100
under HF_LSCE_TMA=0 semantics: which block shape, at each benchmark head, trainable and frozen, b = 0.1. The op's
fwd+bwd through linear_cross_entropy (the fused path forced), do_bench median, the realistic inputs of
benchmarks/real_inputs.py; the TMA kernel's time in the same process for reference.

    python tools/gpu/pointer_blocks.py [--shapes gemma3-270m,gemma2-2b,llama3-8b,smollm2-135m]
"""
import argparse
import dataclasses
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import hf_lsce.ops.config as config  # noqa: E402
import hf_lsce.ops.fused_pass as fp  # noqa: E402
from bench_linear_cross_entropy import SHAPES  # noqa: E402
from real_inputs import fitted_params, realistic_batch  # noqa: E402
from hf_lsce import linear_cross_entropy  # noqa: E402

CANDIDATES = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (128, 128, 64, 8, 4),
              (128, 256, 32, 8, 4)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="gemma3-270m,gemma2-2b,llama3-8b,smollm2-135m")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    real = config._fused_config.__wrapped__
    rows = []
    config.TRAIN_PATH = "fused"
    for shape in args.shapes.split(","):
        for frozen in (False, True):
            n, d, v = SHAPES[shape]
            h, w, y = realistic_batch(n, d, v, seed=0, device="cuda", **fitted_params())
            h.requires_grad_(True)
            w.requires_grad_(not frozen)
            for cand, nested in [(None, False)] + [(c, n) for c in CANDIDATES for n in (False, True)]:
                fp.NESTED_POINTERS = nested
                def cfg(dt, dev, _c=cand):
                    base = real(dt, torch.device(dev), False)
                    if _c is None:
                        return base
                    bn, bv, bd, nw, ns = _c
                    return dataclasses.replace(base, block_n=bn, block_v=bv, block_d=bd, num_warps=nw, num_stages=ns,
                                               tma=False, min_splits=2)
                config.fused_config = cfg

                def step():
                    h.grad = None
                    w.grad = None
                    # (the fused path forced above)
                    linear_cross_entropy(h, w, y, label_smoothing=0.1).backward()
                try:
                    step()
                    ms = triton.testing.do_bench(step, warmup=100, rep=400, return_mode="median")
                except Exception as e:  # noqa: BLE001 - a shape that does not compile (shared memory)
                    ms = None
                    print(shape, cand, "failed:", type(e).__name__, str(e)[:120], flush=True)
                row = dict(shape=shape, head="frozen" if frozen else "trainable", blocks=cand or "tma",
                           loop="nested" if nested else "flat", ms=ms)
                rows.append(row)
                print(json.dumps(row), flush=True)
            del h, w, y
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "pointer_blocks.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("| shape | head | blocks | loop | ms |")
    for r in rows:
        print(f"| {r['shape']} | {r['head']} | {r['blocks']} | {r['loop']} | {r['ms'] and round(r['ms'], 2)} |")


if __name__ == "__main__":
    main()
