"""Question: with ``return_stats`` (argmax and entropy: TRL's metrics, the ATS loss) the fused kernel's 128 x 256 pointer
tiles spill registers in sm80 code; would smaller tiles make the statistics faster on GPUs without TMA? The
statistics alone (``fused_pass.fused_statistics``, no R stored), with and without argmax/entropy, at the SmolLM2,
Gemma-3-270m, Gemma2-2B and Llama-3-8B heads, N = 8,192, bf16, realistic inputs; do_bench medians (ms). Run under
TRITON_OVERRIDE_ARCH=sm80 (an A100's code) and natively with pointer loads. Writes $OUT/stats_tiles[_ARCH].json.

    PYTHONPATH=$PWD TRITON_OVERRIDE_ARCH=sm80 python tools/gpu/stats_tiles.py
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
from hf_lsce.ops.fused_pass import fused_statistics  # noqa: E402

SHAPES = {"smollm2-135m": (8192, 576, 49152), "gemma3-270m": (8192, 640, 262144),
          "gemma2-2b": (8192, 2304, 256000), "llama3-8b": (8192, 4096, 128256)}
TILES = [(128, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 64, 4, 3), (64, 256, 64, 4, 3)]


def main():
    arch = os.environ.get("TRITON_OVERRIDE_ARCH", "")
    config.TMA_SWITCH = "0"
    config.clear_caches()
    rows = []
    for head, (n, d, v) in SHAPES.items():
        h, w, y = realistic_batch(n, d, v, dtype=torch.bfloat16, device="cuda", **fitted_params())
        base = config.fused_config(h.dtype, h.device)
        ref = None
        for bn, bv, bd, warps, st in TILES:
            cfg = dataclasses.replace(base, block_n=bn, block_v=bv, block_d=bd, num_warps=warps, num_stages=st)
            for stats in (False, True):
                out = fused_statistics(h, w, None, y, None, cfg, need_stats=stats)
                if stats and ref is None:
                    ref = out
                same = bool(torch.equal(out[3], ref[3])) if stats else None
                t = do_bench(lambda: fused_statistics(h, w, None, y, None, cfg, need_stats=stats), warmup=50, rep=300)
                rows.append(dict(arch=arch or "native", head=head, tiles=f"{bn}x{bv}x{bd} w{warps} s{st}",
                                 stats=stats, ms=t, argmax_equal=same))
                print(f"{arch or 'native':6s} {head:12s} {rows[-1]['tiles']:20s} stats={stats!s:5s} {t:7.3f} ms",
                      flush=True)
        del h, w, y
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), f"stats_tiles{'_' + arch if arch else ''}.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
