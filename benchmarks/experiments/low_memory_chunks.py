"""memory="low" against the default training path at several column-chunk sizes (issue 27: the low path within
1.25 x the default's time, its extra memory within 1% of torch.compile's). One process on the GPU, the fitted
realistic inputs, fwd+bwd medians and extra memory (peak minus inputs and the gradients themselves), as the kernel
benchmark measures them. Prints a table and writes $OUT/low_memory_chunks.json.

    python benchmarks/experiments/low_memory_chunks.py [--shapes gemma3-270m,gemma2-2b,llama3-8b] [--mib 32,64,128]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton.testing

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
import hf_lsce.ops.config as config  # noqa: E402
from bench_linear_cross_entropy import make_regime_inputs, measure  # noqa: E402
from hf_lsce import linear_cross_entropy  # noqa: E402

SHAPES = {"gemma3-270m": (8192, 640, 262144), "gemma2-2b": (8192, 2304, 256000), "llama3-8b": (8192, 4096, 128256)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="gemma3-270m,gemma2-2b,llama3-8b")
    ap.add_argument("--mib", default="32,64,128")
    args = ap.parse_args()
    rows = []
    default_chunk = config.LOW_MEMORY_CHUNK_BYTES
    for name in args.shapes.split(","):
        n, d, v = SHAPES[name]
        h, w, y = make_regime_inputs("realistic", n, d, v, "cuda")
        runs = [("default", None)] + [(f"low, {m} MiB chunks", int(m) << 20) for m in args.mib.split(",")]
        for label, chunk in runs:
            config.LOW_MEMORY_CHUNK_BYTES = chunk or default_chunk
            mem = "low" if chunk else "fast"

            def fn(hh, ww, yy, b, cap, mem=mem):
                return linear_cross_entropy(hh, ww, yy, label_smoothing=b, memory=mem)
            r = measure(fn, h, w, y, 0.1, None, triton.testing.do_bench, reps=(100, 200))
            rows.append({"shape": name, "N": n, "D": d, "V": v, "method": label, **r})
            print(f"{name:12s} {label:22s} fwd+bwd {r['fwdbwd_ms']:7.2f} ms  extra {r['fwdbwd_mb']:8.0f} MB", flush=True)
        del h, w, y
        torch.cuda.empty_cache()
    config.LOW_MEMORY_CHUNK_BYTES = default_chunk
    base = {r["shape"]: r["fwdbwd_ms"] for r in rows if r["method"] == "default"}
    print("\n| shape | method | fwd+bwd ms | vs default | extra MB |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['method']} | {r['fwdbwd_ms']:.2f} | {r['fwdbwd_ms'] / base[r['shape']]:.2f} x | "
              f"{r['fwdbwd_mb']:,.0f} |")
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "low_memory_chunks.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
