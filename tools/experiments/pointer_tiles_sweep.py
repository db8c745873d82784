"""Pointer-load configs of the logits kernel (HF_LSCE_TMA=0), op fwd+bwd, trainable, b=0.1/0."""
import json, os, sys
os.environ["HF_LSCE_TMA"] = "0"
root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path[:0] = [root, os.path.join(root, "benchmarks")]
import torch, triton.testing
from hf_lsce import linear_cross_entropy
from hf_lsce.ops import config
from real_inputs import fitted_params, realistic_batch
base = config.fused_config(torch.bfloat16, torch.device("cuda"))
print(json.dumps(dict(default=str(base))), flush=True)
CANDS = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 256, 32, 8, 4), (128, 256, 32, 8, 5), (128, 128, 64, 4, 4),
         (128, 128, 64, 8, 4), (256, 128, 64, 8, 3), (128, 256, 128, 8, 2), (64, 256, 64, 4, 4), (128, 128, 128, 8, 3),
         (128, 256, 64, 16, 3), (256, 256, 64, 16, 2)]
only = os.environ.get("SHAPES", "gemma3-270m,gemma2-2b,llama3-8b").split(",")
SH = {"gemma3-270m": (8192, 640, 262144), "gemma2-2b": (8192, 2304, 256000), "llama3-8b": (8192, 4096, 128256),
      "smollm2-135m": (8192, 576, 49152)}
for shape in only:
    n, d, v = SH[shape]
    h, w, y = realistic_batch(n, d, v, seed=0, device="cuda", **fitted_params())
    g = torch.randn(n, v, device="cuda", dtype=torch.bfloat16)
    floor = triton.testing.do_bench(lambda: (h @ w.T, g @ w, g.T @ h), warmup=50, rep=300, return_mode="median")
    del g; torch.cuda.empty_cache()
    for c in CANDS:
        import dataclasses
        cfg = dataclasses.replace(base, block_n=c[0], block_v=c[1], block_d=c[2], num_warps=c[3], num_stages=c[4])
        config._fused_config = lambda dtype, device, interp, cfg=cfg: cfg
        for b in (0.1, 0.0):
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            def step():
                hh.grad = ww.grad = None
                linear_cross_entropy(hh, ww, y, label_smoothing=b).backward()
            try:
                step()
                ms = triton.testing.do_bench(step, warmup=50, rep=300, return_mode="median")
                print(json.dumps(dict(shape=shape, cfg=c, b=b, ms=round(ms, 3), floor=round(floor, 3),
                                      ratio=round(ms / floor, 3))), flush=True)
            except Exception as e:
                print(json.dumps(dict(shape=shape, cfg=c, b=b, error=str(e)[:150])), flush=True)
            del hh, ww; torch.cuda.empty_cache()
