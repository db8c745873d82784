"""Where the fused training path's time goes (issue 27), one process on the GPU: the exp-tiles kernel against the
forward kernel, cuBLAS dh and dW per chunk (dW accumulated in fp32 and in bf16), and the
whole pass at two chunk sizes. Prints a table and writes $OUT/profile_fused.json.

    python benchmarks/experiments/profile_fused.py [--shapes gemma3-270m,gemma2-2b]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import hf_lsce.ops.fused_pass as fp  # noqa: E402
from hf_lsce.ops.config import forward_config  # noqa: E402
from hf_lsce.ops.forward import triton_forward  # noqa: E402

SHAPES = {"gemma3-270m": (8192, 640, 262144), "smollm2-135m": (8192, 576, 49152),
          "gemma2-2b": (8192, 2304, 256000), "llama3-8b": (8192, 4096, 128256)}


def timed(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def pass_inputs(name):
    """(h, w, y, smoothing 0.1, token weights 1/N, forward config) at a shape: bf16 on the GPU, seeded."""
    n, d, v = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(v, d, device="cuda", generator=g) / d ** 0.5).bfloat16()
    h = (torch.randn(n, d, device="cuda", generator=g) * 3).bfloat16()
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    sm = torch.full((n,), 0.1, device="cuda")
    sc = torch.full((n,), 1.0 / n, device="cuda")
    return h, w, y, sm, sc, forward_config(h.dtype, h.device)


def trace(name):
    """The op's fwd+bwd under torch.profiler, each training path: kernel times and launches."""
    import hf_lsce.ops.config as config
    from hf_lsce import linear_cross_entropy

    n, d, v = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(v, d, device="cuda", generator=g) / d ** 0.5).bfloat16().requires_grad_()
    h = (torch.randn(n, d, device="cuda", generator=g) * 3).bfloat16().requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    for path in ("fused", "two-pass", "one-pass"):
        config.TRAIN_PATH = path

        def step():
            linear_cross_entropy(h, w, y, label_smoothing=0.1).backward()
        print(f"{name} {path}: fwd+bwd {timed(step):.2f} ms", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA], record_shapes=True) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60),
              flush=True)
        # the host side: ops by their own CPU time, per input shape (the GPU runs behind the host at small shapes)
        print(prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40, max_shapes_column_width=60),
            flush=True)
    config.TRAIN_PATH = None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="gemma3-270m,smollm2-135m,gemma2-2b,llama3-8b")
    ap.add_argument("--trace", default="", help="shapes whose op call (fwd+bwd, each path) torch.profiler lists")
    args = ap.parse_args()
    for name in filter(None, args.trace.split(",")):
        trace(name)
    out = os.environ.get("OUT", "gpu_out")
    os.makedirs(out, exist_ok=True)
    rows = []
    for name in filter(None, args.shapes.split(",")):
        n, d, v = SHAPES[name]
        h, w, y, sm, sc, cfg = pass_inputs(name)
        row = dict(shape=name, N=n, D=d, V=v)
        row["forward kernel (all N)"] = timed(lambda: triton_forward(h, w, None, y, None, cfg, stats=False))
        z = torch.empty(n, v, dtype=torch.bfloat16, device="cuda") if n * v * 2 <= (4 << 30) else None
        if z is not None:
            row["cuBLAS logits bf16 (all N)"] = timed(lambda: torch.mm(h, w.T, out=z))
            del z
        for gib in (1, 2):
            rows_c = min(n, (gib << 30) // (v * 2))
            r = torch.empty(rows_c, v, dtype=torch.bfloat16, device="cuda")
            hc, yc = h[:rows_c], y[:rows_c]
            c = (hc.float() @ w.float().mean(0) + fp.C_SHIFT).contiguous()
            chunks = -(-n // rows_c)
            row[f"exp kernel x{chunks} ({gib} GiB)"] = chunks * timed(lambda: fp._exp_tiles(cfg, hc, w, None, yc, c, r,
                                                                                            False))
            t32 = torch.empty(rows_c, d, dtype=torch.float32, device="cuda")
            row[f"dh mm x{chunks} ({gib} GiB)"] = chunks * timed(lambda: torch.mm(r, w, out_dtype=torch.float32, out=t32))
            dw32 = torch.zeros(v, d, dtype=torch.float32, device="cuda")
            row[f"dW addmm fp32 x{chunks} ({gib} GiB)"] = chunks * timed(
                lambda: torch.addmm(dw32, r.T, hc, out_dtype=torch.float32, out=dw32))
            dw16 = torch.zeros(v, d, dtype=torch.bfloat16, device="cuda")
            row[f"dW addmm bf16 x{chunks} ({gib} GiB)"] = chunks * timed(lambda: dw16.addmm_(r.T, hc))
            del r, dw32, dw16
            row[f"whole pass ({gib} GiB)"] = timed(
                lambda: fp.triton_fused_pass(h, w, None, y, sm, sc, cfg, chunk_bytes=gib << 30), reps=5)
            torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(out, "profile_fused.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
