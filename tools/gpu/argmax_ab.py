"""Question: does the fused kernel's argmax as one integer min over the columns holding the tile's max
(``fused_pass._first_index``) make ``return_stats`` (TRL's token accuracy and entropy in training, the ATS loss,
evaluation with statistics) cheaper than ``tl.argmax``? The package given by PYTHONPATH (run before and after); the statistics
alone and a trainable head's training call, with and without statistics, N = 8,192, bf16, realistic inputs, TMA and
pointer loads; do_bench medians (ms). Writes $OUT/argmax_ab_TAG[_ARCH].json.

    PYTHONPATH=<package root> python tools/gpu/argmax_ab.py TAG
"""
import json
import os
import sys

import torch
from triton.testing import do_bench

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "benchmarks"))
from real_inputs import fitted_params, realistic_batch  # noqa: E402

SHAPES = {"gemma3-270m": (8192, 640, 262144), "gemma2-2b": (8192, 2304, 256000), "llama3-8b": (8192, 4096, 128256)}


def main():
    tag, arch = sys.argv[1], os.environ.get("TRITON_OVERRIDE_ARCH", "")
    from hf_lsce import linear_cross_entropy
    from hf_lsce.ops import config

    print(tag, arch, config.__file__, flush=True)
    rows = []
    for head, (n, d, v) in SHAPES.items():
        h, w, y = realistic_batch(n, d, v, dtype=torch.bfloat16, device="cuda", **fitted_params())
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        for tma in (("0",) if arch else ("1", "0")):
            config.TMA_SWITCH = tma
            config.clear_caches()
            for stats in (False, True):
                def evaluate():
                    with torch.no_grad():
                        return linear_cross_entropy(h, w, y, label_smoothing=0.1, return_stats=stats)

                def train():
                    out = linear_cross_entropy(hh, ww, y, label_smoothing=0.1, return_stats=stats)
                    (out[0] if stats else out).backward()
                for name, fn in (("eval", evaluate), ("trainable", train)):
                    t = do_bench(fn, warmup=50, rep=300, grad_to_none=[hh, ww])
                    rows.append(dict(tag=tag, arch=arch or "native", head=head, tma=tma, stats=stats, call=name, ms=t))
                    print(f"{tag:6s} {arch or 'native':6s} {head:12s} tma={tma} stats={stats!s:5s} {name:9s} {t:7.3f}",
                          flush=True)
        del h, w, y, hh, ww
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), f"argmax_ab_{tag}{'_' + arch if arch else ''}.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
