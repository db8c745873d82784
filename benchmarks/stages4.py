"""Settled experiment: 4 stages of 128 x 256 tiles for the fused kernel's pointer loads (an A100 and an H100 under
HF_LSCE_TMA=0 have the shared memory) against 3, in sm80 code (TRITON_OVERRIDE_ARCH=sm80) or the GPU's own; timed on a
Hopper GPU. TRITON_OVERRIDE_ARCH=sm80 makes Triton lower every kernel as for sm80 (mma.sync,
cp.async, ldmatrix: the A100's and the sm86/sm89 cards' instruction mix), then assemble it for the GPU present;
HF_LSCE_TMA=0. Each configuration times the op's fwd+bwd on the fused path (do_bench medians, realistic inputs,
N = 8,192, b = 0.1), with the compiled kernels' registers, spills and shared memory.

    python benchmarks/sm80_configs.py   (writes $OUT/sm80_configs.json)
"""
import dataclasses
import json
import os
import sys

os.environ.setdefault("TRITON_OVERRIDE_ARCH", "")
os.environ["HF_LSCE_TMA"] = "0"
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import triton.testing  # noqa: E402

import hf_lsce.ops.config as config  # noqa: E402
import hf_lsce.ops.fused_pass as fp  # noqa: E402
from bench_linear_cross_entropy import SHAPES, floor_ms, measure  # noqa: E402
from hf_lsce import linear_cross_entropy  # noqa: E402
from real_inputs import fitted_params, realistic_batch  # noqa: E402

VARIANTS = {"128x256 s3": (256, 3), "128x256 s4": (256, 4), "128x256 s3 again": (256, 3)}
orig = config.fused_config
config.TRAIN_PATH = "fused"
rows = []
for shape in sys.argv[1:] or ("gemma3-270m", "gemma2-2b", "llama3-8b"):
    n, d, v = SHAPES[shape]
    h, w, y = realistic_batch(n, d, v, seed=0, device="cuda", dtype=torch.bfloat16, **fitted_params())
    for head in ("trainable", "frozen"):
        row = dict(shape=shape, head=head, floor_ms=floor_ms(h, w, head, triton.testing.do_bench))
        for name, (bv, st) in VARIANTS.items():
            config.fused_config = lambda dt, dev, bv=bv, st=st: dataclasses.replace(orig(dt, dev), block_v=bv,
                                                                                    num_stages=st)
            fn = lambda hh, ww, yy, b, cap: linear_cross_entropy(hh, ww, yy, label_smoothing=b)  # noqa: E731
            row[name] = measure(fn, h, w, y, 0.1, None, head, triton.testing.do_bench, True)["fwdbwd_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    del h, w
kernels = []
try:
    for cache in fp._exp_tiles_kernel.device_caches.values():
        for k in cache[0].values():
            kernels.append(dict(stages=k.metadata.num_stages, shared=k.metadata.shared, regs=k.n_regs,
                                spills=k.n_spills, arch=str(k.metadata.target)))
except Exception as e:  # noqa: BLE001 - Triton's cache layout: the timings stand without it
    kernels.append(dict(error=repr(e)[:300]))
print(json.dumps(kernels))
with open(os.path.join(os.environ.get("OUT", "."), f"stages4_{os.environ['TRITON_OVERRIDE_ARCH'] or 'own'}.json"), "w") as f:
    json.dump(dict(device=torch.cuda.get_device_name(), override=os.environ["TRITON_OVERRIDE_ARCH"], rows=rows,
                   kernels=kernels), f, indent=1)
