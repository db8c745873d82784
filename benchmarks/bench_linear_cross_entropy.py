"""The op against its peers, in one process: forward+backward time, extra memory and (``--errors``) gradient errors.

Methods (each on the same inputs):
  hf_lsce                the default (the training path the op picks: fused on Hopper in bf16)
  hf_lsce (low memory)   memory="low"
  hf_lsce (fused / one-pass / two-pass)   a path forced (``--methods``), to compare the paths at one shape
  hf_lsce (pointers)     pointer loads where TMA ones would run (HF_LSCE_TMA=0: what GPUs without TMA run); also
                         with a path forced, e.g. "hf_lsce (fused pointers)"
  torch.compile          fp32 logits + F.cross_entropy(label_smoothing=b), compiled afresh for each configuration
  torch eager            the same, not compiled
  liger                  Liger-Kernel's LigerFusedLinearCrossEntropyLoss(label_smoothing=b)
  cce                    Cut Cross-Entropy's linear_cross_entropy (b = 0 only: it has no smoothing)
  floor                  the bare bf16 cuBLAS matmuls of the same work, no softmax: logits, dh (and dW for a trainable
                         head): three matmuls, or two for a frozen one

Heads: ``trainable`` (dh and dW), ``frozen`` (``W.requires_grad = False``: LoRA's case, dh only) and ``eval``
(the forward alone, under no_grad; "hf_lsce (two-pass)" forces the fused kernel, "hf_lsce (one-pass)" cuBLAS).
Inputs: bf16 (``--dtype fp16``), N = 8,192 tokens (``--tokens``), the generator of benchmarks/real_inputs.py fitted to the real softmax of Gemma-3-270m on
real text. Time: the median of ``triton.testing.do_bench``; memory: the peak allocated during the call minus what was
allocated before it and the inputs' gradients. Errors: relative to an fp64 computation on materialised logits.

    python benchmarks/bench_linear_cross_entropy.py --out-dir results
    python benchmarks/bench_linear_cross_entropy.py --shapes gemma2-2b --b 0.1 --heads frozen --methods hf_lsce,floor
    python benchmarks/bench_linear_cross_entropy.py --smoke   (CPU, a tiny shape: the code path, not the figures)
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hf_lsce import linear_cross_entropy  # noqa: E402

SHAPES = {  # (N, D, V)
    "smollm2-135m": (8192, 576, 49152),
    "gemma3-270m": (8192, 640, 262144),
    "gemma2-2b": (8192, 2304, 256000),
    "llama3-8b": (8192, 4096, 128256),
    "smoke": (96, 48, 1000),
}
DEFAULT_METHODS = ["hf_lsce", "hf_lsce (low memory)", "torch.compile", "liger", "cce", "floor"]
SOFTCAP = {"gemma2-2b": 30.0}  # the soft-capped configuration run beside the plain one (Gemma 2's head)


def torch_loss(h, w, y, b, cap):
    z = (h @ w.T).float()
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    return F.cross_entropy(z, y, label_smoothing=b)


def _forced(path):
    def fn(h, w, y, b, cap):
        import hf_lsce.ops.config as config

        saved, config.TRAIN_PATH = config.TRAIN_PATH, path
        try:
            return linear_cross_entropy(h, w, y, label_smoothing=b, softcap=cap)
        finally:
            config.TRAIN_PATH = saved
    return fn


def _pointers(path=None):
    """The op with pointer loads where it would take TMA ones (``HF_LSCE_TMA=0``: what GPUs without TMA run), in this
    process beside the TMA rows; ``path``: a training path forced too."""
    def fn(h, w, y, b, cap):
        import hf_lsce.ops.config as config

        saved = config.TMA_SWITCH, config.TRAIN_PATH
        config.TMA_SWITCH, config.TRAIN_PATH = "0", path or config.TRAIN_PATH
        config.clear_caches()
        try:
            return linear_cross_entropy(h, w, y, label_smoothing=b, softcap=cap)
        finally:
            config.TMA_SWITCH, config.TRAIN_PATH = saved
            config.clear_caches()
    return fn


def method_fns():
    """name -> callable(h, w, y, b, cap) -> loss, or a string saying why it is unavailable."""
    fns = {"hf_lsce": lambda h, w, y, b, cap: linear_cross_entropy(h, w, y, label_smoothing=b, softcap=cap),
           "hf_lsce (low memory)": lambda h, w, y, b, cap: linear_cross_entropy(h, w, y, label_smoothing=b,
                                                                               softcap=cap, memory="low"),
           "torch eager": torch_loss, "torch.compile": torch_loss}  # compiled per configuration in run_config
    for path in ("fused", "one-pass", "two-pass"):
        fns[f"hf_lsce ({path})"] = _forced(path)
        fns[f"hf_lsce ({path} pointers)"] = _pointers(path)
    fns["hf_lsce (pointers)"] = _pointers()
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        fns["liger"] = lambda h, w, y, b, cap: LigerFusedLinearCrossEntropyLoss(label_smoothing=b, softcap=cap)(w, h, y)
    except Exception as e:  # noqa: BLE001 - a missing peer is a row saying so
        fns["liger"] = f"missing: {type(e).__name__}"
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        def cce_fn(h, w, y, b, cap):
            if b:
                raise NotImplementedError("Cut Cross-Entropy has no label smoothing")
            return cce(h, w, y, softcap=cap)
        fns["cce"] = cce_fn
    except Exception as e:  # noqa: BLE001
        fns["cce"] = f"missing: {type(e).__name__}"
    return fns


def _cpu_bench(fn, warmup=1, rep=3, return_mode="median"):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(rep):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return sorted(ts)[len(ts) // 2]


def measure(fn, h, w, y, b, cap, head, do_bench, cuda):
    """fwd+bwd median ms and extra MB of one method; dh (and dW) are what backward computes (the forward alone, under
    no_grad, for the ``eval`` head)."""
    hh = h.detach().clone().requires_grad_(head != "eval")
    ww = w.detach().clone().requires_grad_(head == "trainable")

    def step():
        hh.grad = ww.grad = None
        if head == "eval":
            with torch.no_grad():
                return fn(hh, ww, y, b, cap)
        fn(hh, ww, y, b, cap).backward()
    step()  # compile, autotune, warm
    out = dict(fwdbwd_ms=do_bench(step, warmup=50 if cuda else 1, rep=400 if cuda else 3, return_mode="median"))
    hh.grad = ww.grad = None
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        grads = sum(t.grad.numel() * t.grad.element_size() for t in (hh, ww) if t.grad is not None)
        out["extra_mb"] = (torch.cuda.max_memory_allocated() - base - grads) / 1e6
    return out


def floor_ms(h, w, head, do_bench):
    """The matmuls of the same work without a softmax: logits, dh = G W (not for eval) and dW = G^T h (trainable)."""
    g = torch.randn(h.shape[0], w.shape[0], device=h.device, dtype=h.dtype)

    def run():
        _ = h @ w.T
        if head != "eval":
            _ = g @ w
        if head == "trainable":
            _ = g.T @ h
    ms = do_bench(run, warmup=50, rep=400, return_mode="median")
    del g
    return ms


@torch.no_grad()
def fp64_reference(h, w, y, b, cap, chunk=512):
    """dh and dW of the mean smoothed loss in fp64 through materialised logits, a chunk of rows at a time."""
    v = w.shape[0]
    w64 = w.double()
    dh = torch.empty(h.shape, dtype=torch.float64, device=h.device)
    dw = torch.zeros(w.shape, dtype=torch.float64, device=h.device)
    count = max(int((y >= 0).sum()), 1)
    for s in range(0, h.shape[0], chunk):
        h64, yc = h[s:s + chunk].double(), y[s:s + chunk]
        z = h64 @ w64.T
        t = torch.tanh(z / cap) if cap is not None else None
        if t is not None:
            z = cap * t
        g = torch.softmax(z, -1) - b / v
        valid = yc >= 0
        g[valid.nonzero()[:, 0], yc[valid]] -= 1 - b
        if t is not None:
            g *= 1 - t * t
        g *= (valid.double() / count)[:, None]
        dh[s:s + chunk] = g @ w64
        dw += g.T @ h64
    return dh, dw


def errors(fn, h, w, y, b, cap, frozen, ref):
    hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_(not frozen)
    fn(hh, ww, y, b, cap).backward()
    rel = lambda a, r: float((a.double() - r).norm() / r.norm().clamp_min(1e-300))  # noqa: E731
    return dict(dh_err=rel(hh.grad, ref[0]), dw_err=None if frozen else rel(ww.grad, ref[1]))


def run_config(rows, fns, shape, head, b, cap, methods, with_errors, cuda, do_bench, dtype=torch.bfloat16,
               tokens=None):
    from real_inputs import fitted_params, realistic_batch

    n, d, v = SHAPES[shape]
    n = tokens or n
    frozen, with_errors = head == "frozen", with_errors and head != "eval"
    dev = "cuda" if cuda else "cpu"
    h, w, y = realistic_batch(n, d, v, seed=0, device=dev, dtype=dtype, **(fitted_params() if cuda else {}))
    ref = fp64_reference(h, w, y, b, cap) if with_errors else None
    if cuda:  # compiled afresh per configuration: one compiled function reused across shapes recompiles
        torch._dynamo.reset()
        fns = dict(fns, **{"torch.compile": torch.compile(torch_loss, dynamic=False)})
    for name in methods:
        row = dict(shape=shape, N=n, D=d, V=v, head=head, b=b, softcap=cap, method=name, dtype=str(dtype)[6:])
        fn = fns.get(name, f"unknown method {name!r}")
        try:
            if name == "floor":
                if not cuda:
                    continue
                row["fwdbwd_ms"] = floor_ms(h, w, head, do_bench)
            elif isinstance(fn, str):
                row["error"] = fn
            else:
                row.update(measure(fn, h, w, y, b, cap, head, do_bench, cuda))
                if ref is not None:
                    row.update(errors(fn, h, w, y, b, cap, frozen, ref))
        except NotImplementedError:
            continue
        except Exception as e:  # noqa: BLE001 - a failing peer is a row, not a crash
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def _fmt(x, spec):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(rows) -> str:
    """One line per method, with its time over torch.compile's and over the floor's of the same configuration."""
    def same(r, method):
        return next((x for x in rows if x["method"] == method and "fwdbwd_ms" in x and all(
            x.get(k) == r.get(k) for k in ("shape", "head", "b", "softcap", "N", "dtype"))), None)
    lines = ["| shape (N, D, V) | head | b | soft-cap | method | fwd+bwd ms | / torch.compile | / floor | extra MB | "
             "dh err | dW err |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        shp = f"{r['shape']} ({r['N']}, {r['D']}, {r['V']})"
        cells = [shp, r["head"], str(r["b"]), _fmt(r["softcap"], "g"), r["method"]]
        if "error" in r:
            lines.append("| " + " | ".join(cells) + f" | {r['error']} ||||||")
            continue
        comp, flo = same(r, "torch.compile"), same(r, "floor")
        ratio = lambda ref: _fmt(r["fwdbwd_ms"] / ref["fwdbwd_ms"] if ref else None, ".2f")  # noqa: E731
        lines.append("| " + " | ".join(cells + [_fmt(r["fwdbwd_ms"], ".2f"), ratio(comp), ratio(flo),
                                                _fmt(r.get("extra_mb"), ",.0f"), _fmt(r.get("dh_err"), ".1e"),
                                                _fmt(r.get("dw_err"), ".1e")]) + " |")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "fwdbwd_ms" in r]
    configs = list(dict.fromkeys((r["shape"], r["head"], r["b"], r["softcap"]) for r in ok))
    methods = list(dict.fromkeys(r["method"] for r in ok))
    if not configs:
        return
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(configs)), 4.5))
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        for i, c in enumerate(configs):
            r = next((x for x in ok if (x["shape"], x["head"], x["b"], x["softcap"]) == c and x["method"] == m), None)
            if r is not None:
                ax.bar(i + j * width, r["fwdbwd_ms"], width, color=f"C{j}", label=m if i == 0 else None)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(configs))])
    ax.set_xticklabels([f"{s}\n{h}, b={b}" + (f", cap {c:g}" if c else "") for s, h, b, c in configs], fontsize=7)
    ax.set_ylabel("forward + backward, ms (median)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="smollm2-135m,gemma3-270m,gemma2-2b,llama3-8b")
    ap.add_argument("--heads", default="trainable,frozen")
    ap.add_argument("--b", default="0.1,0", help="label smoothing values")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    ap.add_argument("--no-softcap", action="store_true", help="skip the soft-capped Gemma2-2B configuration")
    ap.add_argument("--errors", action="store_true", help="gradient errors against fp64 (slow: fp64 logits)")
    ap.add_argument("--out-dir", default="bench_out")
    ap.add_argument("--stem", default="bench_linear_cross_entropy")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="the inputs' dtype")
    ap.add_argument("--tokens", type=int, default=None, help="N for every shape (default: each shape's 8,192)")
    args = ap.parse_args()
    dtype = dict(bf16=torch.bfloat16, fp16=torch.float16, fp32=torch.float32)[args.dtype]
    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        raise SystemExit("bench_linear_cross_entropy.py needs a CUDA GPU (or --smoke for the CPU code path)")
    shapes = ["smoke"] if args.smoke else args.shapes.split(",")
    heads = args.heads.split(",")
    for name, known in [(s, SHAPES) for s in shapes] + [(hd, ("trainable", "frozen", "eval")) for hd in heads]:
        if name not in known:
            raise SystemExit(f"--shapes / --heads: unknown {name!r}; known: {', '.join(known)}")
    do_bench = triton.testing.do_bench if cuda else _cpu_bench
    fns = method_fns()
    methods = args.methods.split(",")
    rows = []
    for shape in shapes:
        caps = [None] + ([SOFTCAP[shape]] if shape in SOFTCAP and not args.no_softcap else [])
        for head in heads:
            for b in (float(x) for x in args.b.split(",")):
                for cap in caps:
                    if cap is not None and b == 0:
                        continue
                    ms = [m for m in methods if cap is None or m not in ("cce",)]
                    run_config(rows, fns, shape, head, b, cap, ms, args.errors or args.smoke, cuda, do_bench,
                               dtype, args.tokens)
    os.makedirs(args.out_dir, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name() if cuda else "cpu (smoke)", torch=torch.__version__,
                triton=triton.__version__, inputs="realistic (real_inputs.fitted_params)", timing="do_bench median")
    with open(os.path.join(args.out_dir, f"{args.stem}.json"), "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)
    md = f"{meta['device']}; torch {meta['torch']}, triton {meta['triton']}\n\n{table(rows)}"
    with open(os.path.join(args.out_dir, f"{args.stem}.md"), "w") as f:
        f.write(md + "\n")
    plot(rows, os.path.join(args.out_dir, f"{args.stem}.png"))
    print("\n" + md)


if __name__ == "__main__":
    main()
