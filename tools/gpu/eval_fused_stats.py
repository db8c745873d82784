"""Question: should the per-token statistics (evaluation, the two-pass path's lse, the vocabulary-parallel forward)
come from the fused logits kernel without storing R (``fused_pass.fused_statistics``) instead of the forward kernel
(``forward.triton_forward``)? Both on the same realistic inputs, N = 8,192, bf16 and fp16, TMA and pointer loads
(``HF_LSCE_TMA=0`` through ``config.TMA_SWITCH``), with and without argmax/entropy; do_bench medians (ms) and the
largest lse difference between the two. Writes JSON to $OUT/eval_fused_stats.json.

    PYTHONPATH=$PWD python tools/gpu/eval_fused_stats.py
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
from hf_lsce.ops.forward import triton_forward  # noqa: E402
from hf_lsce.ops.fused_pass import fused_statistics  # noqa: E402

SHAPES = {"smollm2-135m": (8192, 576, 49152), "gemma3-270m": (8192, 640, 262144),
          "gemma2-2b": (8192, 2304, 256000), "llama3-8b": (8192, 4096, 128256)}


def main():
    rows = []
    params = fitted_params()
    for dtype in (torch.bfloat16, torch.float16):
        for head, (n, d, v) in SHAPES.items():
            h, w, y = realistic_batch(n, d, v, dtype=dtype, device="cuda", **params)
            for cap in ((None, 30.0) if head == "gemma2-2b" else (None,)):
                for tma in ("1", "0"):
                    config.TMA_SWITCH = tma
                    config.clear_caches()
                    fcfg = config.forward_config(dtype, h.device)
                    ucfg = config.fused_config(dtype, h.device)
                    for stats in (False, True):
                        fw = lambda: triton_forward(h, w, None, y, cap, fcfg, stats=stats)  # noqa: E731
                        fu = lambda: fused_statistics(h, w, None, y, cap, ucfg, need_stats=stats)  # noqa: E731
                        a, b = fw(), fu()
                        diff = [float((x.double() - q.double()).abs().max()) for x, q in zip(a, b)]
                        t_fw = do_bench(fw, warmup=50, rep=300)
                        t_fu = do_bench(fu, warmup=50, rep=300)
                        row = dict(dtype=str(dtype).split(".")[-1], head=head, cap=cap, tma=tma, stats=stats,
                                   forward_ms=t_fw, fused_ms=t_fu, ratio=t_fu / t_fw, max_diff=diff)
                        rows.append(row)
                        print(f"{row['dtype']:9s} {head:13s} cap={cap} tma={tma} stats={stats!s:5s} "
                              f"forward {t_fw:8.3f}  fused {t_fu:8.3f}  ratio {t_fu / t_fw:5.3f}  "
                              f"diff lse {diff[0]:.1e} zy {diff[1]:.1e} sz {diff[2]:.1e} am {diff[3]:.0f} "
                              f"ent {diff[4]:.1e}", flush=True)
            del h, w, y
            torch.cuda.empty_cache()
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "eval_fused_stats.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
