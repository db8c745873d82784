"""The op against its peers, in one process: forward+backward time, extra memory and (``--errors``) gradient errors.

Methods (each on the same inputs):
  hf_lsce                memory="auto" (the fastest plan that fits the GPU's free memory)
  hf_lsce (low)          memory="low"
  hf_lsce@B              memory=B bytes (``hf_lsce@1.1e9``); ``hf_lsce@liger`` (``@unsloth``, ``@cce``,
                         ``@torch.compile``): the extra memory that peer measured at this configuration, or the smallest
                         budget that holds exact gradients where the peer keeps less
  hf_lsce (pointers)     pointer loads where TMA ones would run (HF_LSCE_TMA=0: what GPUs without TMA run)
  torch.compile          fp32 logits + F.cross_entropy(label_smoothing=b), compiled afresh for each configuration
  torch eager            the same, not compiled
  liger                  Liger-Kernel's LigerFusedLinearCrossEntropyLoss(label_smoothing=b)
  cce                    Cut Cross-Entropy's linear_cross_entropy (b = 0 only: it has no smoothing)
  unsloth                unsloth_zoo's fused_linear_cross_entropy(label_smoothing=b), its ``fused_losses/fused_linear.py``
                         loaded from the installed wheel as a module of its own (it imports torch and Triton only)
  floor                  the bare bf16 cuBLAS matmuls of the same work, no softmax: logits, dh (and dW for a trainable
                         head): three matmuls, or two for a frozen one

Heads: ``trainable`` (dh and dW), ``frozen`` (``W.requires_grad = False``: LoRA's case, dh only) and ``eval`` (the
forward alone, under no_grad). Inputs: bf16 (``--dtype``), N = 8,192 tokens (``--tokens``), the generator of
benchmarks/real_inputs.py fitted to the real softmax of Gemma-3-270m on real text. Time: the median of
``triton.testing.do_bench``; memory: the peak allocated during the call minus what was allocated before it and the
inputs' gradients. Errors: relative to an fp64 computation on materialised logits. hf_lsce's rows name the plan the
budget gave (``budget.Plan``). ``--sweep``: hf_lsce over budgets from the smallest to unlimited, for the picture of
time against extra memory (each peer a point).

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
from hf_lsce.ops import budget as bud  # noqa: E402

SHAPES = {  # (N, D, V)
    "smollm2-135m": (8192, 576, 49152),
    "gemma3-270m": (8192, 640, 262144),
    "gemma2-2b": (8192, 2304, 256000),
    "llama3-8b": (8192, 4096, 128256),
    "smoke": (96, 48, 1000),
}
PEERS = ["torch.compile", "liger", "cce", "unsloth"]
DEFAULT_METHODS = ["hf_lsce", "hf_lsce (low)", *PEERS, "floor", *(f"hf_lsce@{p}" for p in PEERS)]
SOFTCAP = {"gemma2-2b": 30.0}  # the soft-capped configuration run beside the plain one (Gemma 2's head)


def torch_loss(h, w, y, b, cap):
    z = (h @ w.T).float()
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    return F.cross_entropy(z, y, label_smoothing=b)


PLANS: list = []  # the plans the op took (budget.plan_for spied), for the rows' "plan"


def _ours(memory="auto", pointers=False):
    def fn(h, w, y, b, cap):
        import hf_lsce.ops.config as config

        if pointers:
            saved, config.TMA_SWITCH = config.TMA_SWITCH, "0"
            config.clear_caches()
        try:
            return linear_cross_entropy(h, w, y, label_smoothing=b, softcap=cap, memory=memory)
        finally:
            if pointers:
                config.TMA_SWITCH = saved
                config.clear_caches()
    return fn


def unsloth_op():
    """unsloth_zoo's ``fused_linear_cross_entropy`` from the installed wheel's file, loaded as a module of its own."""
    import importlib.util
    from importlib import metadata

    dist = metadata.distribution("unsloth_zoo")
    path = dist.locate_file("unsloth_zoo/fused_losses/fused_linear.py")
    spec = importlib.util.spec_from_file_location("unsloth_fused_linear", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.fused_linear_cross_entropy


def method_fns():
    """name -> callable(h, w, y, b, cap) -> loss, or a string saying why it is unavailable (``hf_lsce@B`` methods are
    made in ``run_config``)."""
    fns = {"hf_lsce": _ours(), "hf_lsce (low)": _ours("low"), "hf_lsce (pointers)": _ours(pointers=True),
           "torch eager": torch_loss, "torch.compile": torch_loss}  # compiled per configuration in run_config
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
    try:
        unsloth = unsloth_op()

        def unsloth_fn(h, w, y, b, cap):  # (the mean: its divisor is the count of valid targets)
            return unsloth(h, w, None, y, divisor=(y >= 0).sum(), label_smoothing=b, logit_softcapping=cap or 0.0)
        fns["unsloth"] = unsloth_fn
    except Exception as e:  # noqa: BLE001
        fns["unsloth"] = f"missing: {type(e).__name__}: {str(e)[:100]}"
    return fns


def _cpu_bench(fn, warmup=1, rep=3, return_mode="median"):
    """``do_bench``'s median on the CPU (``--smoke``): ``rep`` timed calls after ``warmup``."""
    times = [(time.perf_counter(), fn(), time.perf_counter()) for _ in range(warmup + rep)][warmup:]
    return sorted((end - start) * 1e3 for start, _, end in times)[rep // 2]


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
    PLANS.clear()
    step()  # compile, autotune, warm
    out = dict(fwdbwd_ms=do_bench(step, warmup=50 if cuda else 1, rep=400 if cuda else 3, return_mode="median"))
    if PLANS:
        p = PLANS[-1]
        out["plan"] = bud.describe_plan(p)
        out["plan_mb"] = p.nbytes / 1e6
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
        _ = h @ w.T, (g @ w if head != "eval" else None), (g.T @ h if head == "trainable" else None)
    return do_bench(run, warmup=50, rep=400, return_mode="median")


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
               tokens=None, repeat=1):
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
    measured = {}
    for name in methods:
        row = dict(shape=shape, N=n, D=d, V=v, head=head, b=b, softcap=cap, method=name, dtype=str(dtype)[6:])
        fn = fns.get(name, f"unknown method {name!r}")
        if name.startswith("hf_lsce@"):
            budget = budget_for(name.split("@", 1)[1], measured, h, w, cap, head)
            if budget is None:
                continue  # (the peer did not run here: b > 0 for CCE, a missing package)
            row["budget_mb"] = budget / 1e6
            fn = _ours(budget)
        try:
            if name == "floor":
                if not cuda:
                    continue
                runs = [dict(fwdbwd_ms=floor_ms(h, w, head, do_bench)) for _ in range(repeat)]
            elif isinstance(fn, str):
                row["error"] = fn
            else:
                runs = [measure(fn, h, w, y, b, cap, head, do_bench, cuda) for _ in range(repeat)]
            if "error" not in row:  # (the median of ``repeat`` runs, each run's time beside it)
                ms = sorted(r["fwdbwd_ms"] for r in runs)
                row.update(runs[-1], fwdbwd_ms=ms[len(ms) // 2], runs_ms=[r["fwdbwd_ms"] for r in runs])
            if name != "floor" and "error" not in row:
                measured[name] = row.get("extra_mb")
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


def budget_for(what: str, measured: dict, h, w, cap, head) -> int | None:
    """The budget of ``hf_lsce@what``: bytes (``1.1e9``), or a peer's measured extra memory at this configuration,
    raised to the smallest budget that holds exact gradients where the peer keeps less (None: the peer did not run)."""
    try:
        return int(float(what))
    except ValueError:
        pass
    mb = measured.get(what)
    if mb is None:
        return None
    hh = h.detach().requires_grad_(head != "eval")
    comp = bud.computation(hh, w, cap, "triton")
    least = bud.smallest(bud.shape_of(hh, w, None, cap, comp, head == "trainable", False), comp)
    return max(int(mb * 1e6), least)


def _fmt(x, spec):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(rows) -> str:
    """One line per method, with its time over torch.compile's and over the floor's of the same configuration."""
    def same(r, method):
        return next((x for x in rows if x["method"] == method and "fwdbwd_ms" in x and all(
            x.get(k) == r.get(k) for k in ("shape", "head", "b", "softcap", "N", "dtype"))), None)
    lines = ["| shape (N, D, V) | head | b | soft-cap | method | fwd+bwd ms | / torch.compile | / floor | extra MB | "
             "dh err | dW err | plan |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        shp = f"{r['shape']} ({r['N']}, {r['D']}, {r['V']})"
        cells = [shp, r["head"], str(r["b"]), _fmt(r["softcap"], "g"), r["method"]]
        if "error" in r:
            lines.append("| " + " | ".join(cells) + f" | {r['error']} |||||||")
            continue
        comp, flo = same(r, "torch.compile"), same(r, "floor")
        ratio = lambda ref: _fmt(r["fwdbwd_ms"] / ref["fwdbwd_ms"] if ref else None, ".2f")  # noqa: E731
        lines.append("| " + " | ".join(cells + [_fmt(r["fwdbwd_ms"], ".2f"), ratio(comp), ratio(flo),
                                                _fmt(r.get("extra_mb"), ",.0f"), _fmt(r.get("dh_err"), ".1e"),
                                                _fmt(r.get("dw_err"), ".1e"), r.get("plan", "")]) + " |")
    return "\n".join(lines)


def plot(rows, path):
    """Time against extra memory, one panel per configuration: every peer a point, hf_lsce a line over its budgets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "fwdbwd_ms" in r and r.get("extra_mb") is not None]
    configs = list(dict.fromkeys((r["shape"], r["head"], r["b"], r["softcap"]) for r in ok))
    if not configs:
        return
    cols = min(4, len(configs))
    fig, axes = plt.subplots(-(-len(configs) // cols), cols, figsize=(4.2 * cols, 3.4 * -(-len(configs) // cols)),
                             squeeze=False)
    for ax, c in zip(axes.flat, configs):
        here = [r for r in ok if (r["shape"], r["head"], r["b"], r["softcap"]) == c]
        ours = sorted((r for r in here if r["method"].startswith("hf_lsce") and "pointers" not in r["method"]),
                      key=lambda r: r["extra_mb"])
        ax.plot([r["extra_mb"] for r in ours], [r["fwdbwd_ms"] for r in ours], "o-", color="C0", label="hf_lsce",
                markersize=3)
        for k, r in enumerate(x for x in here if not x["method"].startswith("hf_lsce")):
            ax.plot(r["extra_mb"], r["fwdbwd_ms"], "s", color=f"C{k + 1}", label=r["method"])
        floor = next((r["fwdbwd_ms"] for r in rows if r["method"] == "floor" and "fwdbwd_ms" in r and (
            r["shape"], r["head"], r["b"], r["softcap"]) == c), None)
        if floor:
            ax.axhline(floor, color="grey", lw=0.8, ls=":", label="matmul floor")
        ax.set(xscale="log", xlabel="extra memory, MB", ylabel="fwd+bwd ms (median)")
        ax.set_title(f"{c[0]}, {c[1]}, b={c[2]}" + (f", cap {c[3]:g}" if c[3] else ""), fontsize=8)
        ax.tick_params(labelsize=7), ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(configs):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sweep_budgets(shape, head, tokens, cap, dtype) -> list[str]:
    """``hf_lsce@B`` methods from the smallest budget to the fastest plan's, about a factor of two apart."""
    n, d, v = SHAPES[shape]
    s = bud.Shape(tokens or n, v, d, head == "trainable", False, half=dtype == torch.float16, soft=cap is not None)
    least, top = bud.smallest(s, "fused"), bud.best(s, None, "fused").nbytes
    out, b = [], least
    while b < top:
        out.append(f"hf_lsce@{b}")
        b *= 2
    return out + [f"hf_lsce@{top}"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="smollm2-135m,gemma3-270m,gemma2-2b,llama3-8b")
    ap.add_argument("--heads", default="trainable,frozen")
    ap.add_argument("--b", default="0.1,0", help="label smoothing values")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    ap.add_argument("--no-softcap", action="store_true", help="skip the soft-capped Gemma2-2B configuration")
    ap.add_argument("--errors", action="store_true", help="gradient errors against fp64 (slow: fp64 logits)")
    ap.add_argument("--out", "--out-dir", dest="out_dir", default="bench_out", help="folder for the JSON and tables")
    ap.add_argument("--stem", default="bench_linear_cross_entropy")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="the inputs' dtype")
    ap.add_argument("--tokens", type=int, default=None, help="N for every shape (default: each shape's 8,192)")
    ap.add_argument("--sweep", action="store_true", help="also hf_lsce over budgets from the smallest to unlimited")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each method; its time is their median")
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
    real_plan = bud.plan_for
    bud.plan_for = lambda *a, **k: PLANS.append(real_plan(*a, **k)) or PLANS[-1]
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
                    if args.sweep and head != "eval":
                        ms += sweep_budgets(shape, head, args.tokens, cap, dtype)
                    run_config(rows, fns, shape, head, b, cap, ms, args.errors or args.smoke, cuda, do_bench,
                               dtype, args.tokens, args.repeat)
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
