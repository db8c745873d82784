"""Question: fp16's kept gradients (fp32) were multiplied by gamma (``matmul.fp16_weights``) in the forward, a pass
over dW (and dh) of their own, and then by the upstream gradient and cast in backward: does returning them divided by
gamma and multiplying it back in backward's cast (``paths.finish_gradients``) save that pass, with the gradients
unchanged? The package given by PYTHONPATH (run before and after); fp16 trainable heads on the fused path (TMA and
pointer loads) and the one-pass path (a T4's path, forced), an upstream gradient of 1 (the bench's) and of 2^16 (a
GradScaler's); bf16's fused path as a control; N = 8,192, realistic inputs, do_bench medians (ms), and a checksum of
each gradient's bits. Writes $OUT/gamma_ab_TAG.json.

    PYTHONPATH=<package root> python tools/gpu/gamma_ab.py TAG
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


def bits(t):
    return int(t.view(torch.int16).to(torch.int64).sum()) if t.element_size() == 2 else float(t.double().sum())


def main():
    tag = sys.argv[1]
    from hf_lsce import linear_cross_entropy
    from hf_lsce.ops import config

    print(tag, config.__file__, flush=True)
    rows = []
    for head, (n, d, v) in SHAPES.items():
        for dtype in (torch.float16, torch.bfloat16):
            h, w, y = realistic_batch(n, d, v, dtype=dtype, device="cuda", **fitted_params())
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            routes = [("fused", "1"), ("fused", "0"), ("one-pass", "1")] if dtype == torch.float16 else [("fused", "1")]
            for path, tma in routes:
                config.TMA_SWITCH, config.TRAIN_PATH = tma, path
                config.clear_caches()
                for factor in (1.0, 65536.0):
                    def train():
                        loss = linear_cross_entropy(hh, ww, y, label_smoothing=0.1)
                        (loss * factor if factor != 1.0 else loss).backward()
                    t = do_bench(train, warmup=30, rep=200, grad_to_none=[hh, ww])
                    hh.grad = ww.grad = None
                    train()
                    row = dict(tag=tag, head=head, dtype=str(dtype)[6:], path=path, tma=tma, factor=factor, ms=t,
                               dh_bits=bits(hh.grad), dw_bits=bits(ww.grad))
                    rows.append(row)
                    print(f"{tag:6s} {head:12s} {row['dtype']:8s} {path:8s} tma={tma} x{factor:<7g} {t:7.3f} ms "
                          f"dh {row['dh_bits']} dw {row['dw_bits']}", flush=True)
            del h, w, y, hh, ww
            torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), f"gamma_ab_{tag}.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
