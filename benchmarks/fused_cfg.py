"""Does a block shape with two resident programs per SM (their epilogues overlapping each other's MMA) make the fused
pass faster at small D? Times fused_pass.triton_fused_pass per KernelConfig variant against the matmul floor."""
import dataclasses, json, os, sys
import torch
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
from bench_linear_cross_entropy import SHAPES, floor_ms
from real_inputs import fitted_params, realistic_batch
from triton.testing import do_bench
import hf_lsce.ops.fused_pass as fp
from hf_lsce.ops.config import forward_config

dev = torch.device("cuda")
sms = torch.cuda.get_device_properties(dev).multi_processor_count
V = {  # name -> (block_n, block_v, block_d, warps, stages, programs per SM)
    "base 128x256x64 w8 s3 p2": (128, 256, 64, 8, 3, 2),
    "128x128x64 w4 s3 p2": (128, 128, 64, 4, 3, 2),
    "128x128x64 w4 s3 p1": (128, 128, 64, 4, 3, 1),
    "128x128x64 w4 s3 p3": (128, 128, 64, 4, 3, 3),
    "128x128x64 w4 s2 p2": (128, 128, 64, 4, 2, 2),
    "128x256x64 w8 s3 p2 again": (128, 256, 64, 8, 3, 2),
    "128x128x64 w4 s3 p2 again": (128, 128, 64, 4, 3, 2),
}
shapes = sys.argv[1].split(",") if len(sys.argv) > 1 else ["gemma3-270m", "smollm2-135m", "gemma2-2b"]
rows = []
for shape in shapes:
    n, d, v = SHAPES[shape]
    h, w, y = realistic_batch(n, d, v, seed=0, device="cuda", **fitted_params())
    smooth = torch.full((n,), 0.1, device=dev)
    scale = torch.full((n,), 1.0 / n, device=dev)
    base = forward_config(torch.bfloat16, dev)
    for frozen in ((True,) if os.environ.get("FROZEN_ONLY") else (True, False)):
        floor = floor_ms(h, w, frozen, do_bench)
        ref = None
        for name, (bn, bv, bd, wp, st, pp) in V.items():
            cfg = dataclasses.replace(base, block_n=bn, block_v=bv, block_d=bd, num_warps=wp, num_stages=st,
                                      min_programs=pp * sms)
            run = lambda: fp.triton_fused_pass(h, w, None, y, smooth, scale, cfg, need_dh=True, need_dw=not frozen,
                                               need_db=False)
            row = dict(shape=shape, head="frozen" if frozen else "trainable", variant=name, floor=floor)
            try:
                out = run()
                ref = out if ref is None else ref
                row["dh_diff"] = float((out[1].float() - ref[1].float()).norm() / ref[1].float().norm())
                row["ms"] = do_bench(run, warmup=25, rep=300, return_mode="median")
                row["x_floor"] = row["ms"] / floor
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:150]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
    del h, w, y
    torch.cuda.empty_cache()
for r in rows:
    print(f"| {r['shape']} | {r['head']} | {r['variant']} | {r.get('ms', float('nan')):.2f} | {r.get('x_floor', float('nan')):.3f} | {r.get('dh_diff', r.get('error'))} |")
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "fused_cfg.json"), "w"), indent=1)
