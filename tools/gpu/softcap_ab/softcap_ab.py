"""A/B: the soft-capped exponentials' epilogue as tanh then exp (A: fp_variant_a.py beside this script) or through d = 1/(e+1)
without a max (B: the tree), the exp kernel alone and the whole op, Gemma2-2B and Gemma-3-270m heads, N = 8192, cap 30,
b = 0.1, interleaved twice; torch.compile and the floor beside them."""
import importlib.util, json, os, sys
sys.path.insert(0, "benchmarks"); sys.path.insert(0, os.getcwd())
import torch, triton
from triton.testing import do_bench
from bench_linear_cross_entropy import SHAPES, floor_ms, measure, torch_loss
from real_inputs import fitted_params, realistic_batch
import hf_lsce.ops.fused_pass as fpB
from hf_lsce.ops.config import forward_config
from hf_lsce import linear_cross_entropy

spec = importlib.util.spec_from_file_location("hf_lsce.ops.fp_variant_a", "tools/gpu/softcap_ab/fp_variant_a.py")
fpA = importlib.util.module_from_spec(spec)
fpA.__package__ = "hf_lsce.ops"
spec.loader.exec_module(fpA)
mods = {"A tanh": fpA, "B d-form": fpB}


def ours(h, w, y, b, cap):
    return linear_cross_entropy(h, w, y, label_smoothing=b, softcap=cap)


out = []
for name in ("gemma2-2b", "gemma3-270m"):
    n, (_, d, v) = 8192, SHAPES[name]
    h, w, y = realistic_batch(n, d, v, seed=0, device="cuda", **fitted_params())
    cfg = forward_config(torch.bfloat16, h.device)
    r = torch.empty(n, triton.cdiv(v, 8) * 8, dtype=torch.bfloat16, device="cuda")[:, :v]
    c = torch.full((n,), 30.0, device="cuda")
    res = dict(shape=name)
    for rep in range(2):
        for label, mod in mods.items():
            res.setdefault(f"exp kernel {label}", []).append(
                do_bench(lambda: mod._exp_tiles(cfg, h, w, None, c, r, False, softcap=30.0)))
    del r
    torch.cuda.empty_cache()
    for frozen in (False, True):
        head = "frozen" if frozen else "trainable"
        for rep in range(2):
            for label, mod in mods.items():
                sys.modules["hf_lsce.ops.fused_pass"] = mod
                try:
                    res.setdefault(f"{head} op {label}", []).append(
                        measure(ours, h, w, y, 0.1, 30.0, frozen, do_bench, True)["fwdbwd_ms"])
                finally:
                    sys.modules["hf_lsce.ops.fused_pass"] = fpB
        if name == "gemma2-2b":
            torch._dynamo.reset()
            res[f"{head} torch.compile"] = measure(torch.compile(torch_loss, dynamic=False), h, w, y, 0.1, 30.0, frozen,
                                                   do_bench, True)["fwdbwd_ms"]
        res[f"{head} floor"] = floor_ms(h, w, frozen, do_bench)
    print(json.dumps(res), flush=True)
    out.append(res)
    del h, w, y
    torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "softcap_ab.json"), "w"), indent=1)
