"""Experiment (issue 41): which block shape and R store make the fused pass's logits kernel fastest at small D?

Times ``fused_pass.triton_fused_pass`` (the whole training call: kernel, dh and dW matmuls) at real head shapes with
realistic inputs, for each kernel configuration below, against the floor of the same matmuls (bench_linear_cross_entropy
``floor_ms``), and checks each variant's gradients against the default configuration's. With ``--profile``: the
default's time per kernel (torch.profiler) at each shape.

    python tools/gpu/fused_variants.py [--shapes gemma3-270m,gemma2-2b] [--profile]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
if os.environ.get("HF_LSCE_ROOT"):  # another copy of the package (an A/B against an earlier commit's kernels)
    sys.path.insert(0, os.environ["HF_LSCE_ROOT"])

# name -> (KernelConfig fields to replace, unused)
VARIANTS = {
    "base 128x256x64 w8 s3": ({}, False),
    "128x256x64 w8 s4": (dict(num_stages=4), False),
    "base 1 wave": (dict(min_programs=-1), False),
}


def main():
    from bench_linear_cross_entropy import SHAPES, floor_ms
    from real_inputs import fitted_params, realistic_batch
    from triton.testing import do_bench

    import hf_lsce.ops.fused_pass as fp
    from hf_lsce.ops.config import forward_config

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="gemma3-270m,smollm2-135m,gemma2-2b,llama3-8b")
    ap.add_argument("--variants", default=";".join(VARIANTS))
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for shape in args.shapes.split(","):
        n, d, v = SHAPES[shape]
        h, w, y = realistic_batch(n, d, v, seed=0, device="cuda", **fitted_params())
        smooth = torch.full((n,), 0.1, device=dev)
        scale = torch.full((n,), 1.0 / n, device=dev)
        base_cfg = forward_config(torch.bfloat16, dev)
        for frozen in (True, False):
            head = "frozen" if frozen else "trainable"
            floor = floor_ms(h, w, frozen, do_bench)
            ref = None
            for name in args.variants.split(";"):
                over, _ = VARIANTS[name]
                if over.get("min_programs", 0) < 0:
                    over = dict(over, min_programs=-over["min_programs"] * sms)
                cfg = dataclasses.replace(base_cfg, **over)

                def run():
                    return fp.triton_fused_pass(h, w, None, y, smooth, scale, cfg, need_dh=True, need_dw=not frozen,
                                                need_db=False)
                row = dict(shape=shape, head=head, variant=os.environ.get("TAG", "") + name, floor_ms=floor)
                try:
                    out = run()
                    if ref is None:
                        ref = out
                    row["dh_diff"] = float((out[1].float() - ref[1].float()).norm() / ref[1].float().norm())
                    if not frozen:
                        row["dw_diff"] = float((out[2].float() - ref[2].float()).norm() / ref[2].float().norm())
                    row["ms"] = do_bench(run, warmup=25, rep=200, return_mode="median")
                    row["x_floor"] = row["ms"] / floor
                except Exception as e:  # noqa: BLE001 - a variant that cannot compile is a row saying so
                    row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
                print(json.dumps(row), flush=True)
                rows.append(row)
                if args.profile and name == "base 128x256x64 w8 s3":
                    profile(run, shape, head)
        del h, w, y
        torch.cuda.empty_cache()
    print("| shape | head | variant | ms | x floor | dh diff |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['head']} | {r['variant']} | {r.get('ms', float('nan')):.2f} | "
              f"{r.get('x_floor', float('nan')):.3f} | {r.get('dh_diff', r.get('error'))} |")
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "fused_variants.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


def profile(run, shape, head):
    from torch.profiler import ProfilerActivity, profile as prof

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            run()
        torch.cuda.synchronize()
    print(f"=== kernels, {shape} {head}, 5 calls")
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)


if __name__ == "__main__":
    main()
