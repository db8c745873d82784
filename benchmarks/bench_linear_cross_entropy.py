"""Side-by-side benchmark of label-smoothed linear cross-entropy implementations, one process.

Methods: hf_lsce (Triton kernels); torch eager (fp32 logits + F.cross_entropy(label_smoothing=b));
torch.compile of the same; Liger-Kernel's LigerFusedLinearCrossEntropyLoss(label_smoothing=b);
Cut Cross-Entropy's linear_cross_entropy (b = 0 only: it has no smoothing); and a floor of three
bf16 cuBLAS matmuls (logits, dH, dW) with no softmax. A peer that cannot be imported is reported
as missing in the table and the JSON.

Inputs. "peaked" and "flat" as ../shared/ANCHORS.md: W ~ N(0,1)/sqrt(D); h ~ N(0, 9); Zipf-distributed
targets; "peaked" moves each hidden state along its target row until the target logit is +18, which leaves
no tile of the softmax negligible; "flat": h left as drawn. "realistic": the generator of
benchmarks/real_inputs.py with its parameters fitted to the real softmax of Gemma-3-270m on real text
(entropy, top-1 and target probability, fractions of negligible tiles), at the given shape. "real": the
real Gemma-3-270m's hidden states on real text and its real LM head (D = 640, V = 262,144), captured on the
device (``--real-inputs FILE`` from ``real_inputs.py capture``).

Methods beyond the peers: "hf_lsce" is the default (exact: no gradient filtering); "hf_lsce (filter 2^-k)"
(filter_eps=2**-k: each row may lose at most that share of its gradient's L1 mass; the vocabulary sorted by mean
logit), "hf_lsce (low memory)" (memory="low").
For realistic and real inputs each method's loss and gradients are also compared with an fp64 computation
(relative errors), beside torch in bf16.

Figures: median time of `triton.testing.do_bench` for the forward and forward+backward; peak
memory allocated during the op minus what was allocated before it, less the inputs' gradients
(so: the op's own extra memory); effective TFLOP/s = 8 N D V / fwd+bwd time, the same count for
every method (the three matmuls of fwd+bwd plus the recomputation of the logits that fused methods do).

    python benchmarks/bench_linear_cross_entropy.py --suite main --out-dir results
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from check_correctness_gpu import make_inputs  # noqa: E402

from hf_lsce import linear_cross_entropy  # noqa: E402

SHAPES = {
    "gemma2-2b": (8192, 2304, 256000),
    "llama3-8b": (8192, 4096, 128256),
    "llama3.2-1b": (16384, 2048, 128256),
    "gemma3-270m": (8192, 640, 262144),
    "smollm2-135m": (8192, 576, 49152),
    "qwen2.5-0.5b": (8192, 896, 151936),
    "qwen2.5-1.5b": (8192, 1536, 151936),
}


def torch_loss(h, w, y, b, cap):
    z = (h @ w.T).float()
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    return F.cross_entropy(z, y, label_smoothing=b)


_compiled = None
FILTER_EXPONENTS = (6, 8, 10)


def method_fns(compile_: bool = True):
    """name -> (callable(h, w, y, b, cap) -> loss, or an error string if unavailable)."""
    global _compiled
    fns = {}
    fns["hf_lsce"] = lambda h, w, y, b, cap: linear_cross_entropy(h, w, y, label_smoothing=b, softcap=cap)

    def recompute(h, w, y, b, cap):
        # The same loss with the one-pass training path switched off: fused forward, then the recomputing
        # backward (Triton logits again, G chunks, two cuBLAS matmuls), the previous version, for comparison
        # (and what vocabulary-parallel heads use).
        import hf_lsce.ops.train_pass as tp

        real, tp.supported = tp.supported, (lambda hidden: False)
        try:
            return linear_cross_entropy(h, w, y, label_smoothing=b, softcap=cap)
        finally:
            tp.supported = real
    fns["hf_lsce (recompute bwd)"] = recompute
    def forced(path):
        def fn(h, w, y, b, cap):
            # the training path forced (hf_lsce.ops.config.TRAIN_PATH), to compare the two at one shape
            import hf_lsce.ops.config as config

            real, config.TRAIN_PATH = config.TRAIN_PATH, path
            try:
                return linear_cross_entropy(h, w, y, label_smoothing=b, softcap=cap)
            finally:
                config.TRAIN_PATH = real
        return fn
    fns["hf_lsce (one-pass)"] = forced("one-pass")
    fns["hf_lsce (two-pass)"] = forced("two-pass")
    fns["hf_lsce (fused)"] = forced("fused")
    for k in FILTER_EXPONENTS:  # gradient filtering with a per-row bound, the vocabulary sorted
        fns[f"hf_lsce (filter 2^-{k})"] = (lambda e: lambda h, w, y, b, cap: linear_cross_entropy(
            h, w, y, label_smoothing=b, softcap=cap, filter_eps=e, sort_vocab=True))(2.0 ** -k)
    fns["hf_lsce (low memory)"] = lambda h, w, y, b, cap: linear_cross_entropy(h, w, y, label_smoothing=b,
                                                                              softcap=cap, memory="low")
    fns["torch eager"] = torch_loss
    if compile_:
        _compiled = _compiled or torch.compile(torch_loss, dynamic=False)
        fns["torch.compile"] = _compiled
    else:
        fns["torch.compile"] = "not in the smoke run"
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        def liger(h, w, y, b, cap):
            return LigerFusedLinearCrossEntropyLoss(label_smoothing=b, softcap=cap)(w, h, y)
        fns["liger"] = liger
    except Exception as e:  # noqa: BLE001
        fns["liger"] = f"missing: {type(e).__name__}: {e}"
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        def cce_fn(h, w, y, b, cap):
            if b:
                raise NotImplementedError("no label smoothing in Cut Cross-Entropy")
            return cce(h, w, y, softcap=cap)
        fns["cce"] = cce_fn
    except Exception as e:  # noqa: BLE001
        fns["cce"] = f"missing: {type(e).__name__}: {e}"
    return fns


def floor_fns(h, w):
    n, v = h.shape[0], w.shape[0]
    g = torch.randn(n, v, device=h.device, dtype=h.dtype)

    def fwd():
        return h @ w.T

    def fwd_bwd():
        _ = h @ w.T
        _ = g @ w
        _ = g.T @ h
    return fwd, fwd_bwd, g


def _timer(fn, warmup=3, rep=10, return_mode="median"):
    """A CPU stand-in for triton.testing.do_bench (the smoke mode): median wall time in ms."""
    import time

    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(rep):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return sorted(ts)[len(ts) // 2]


def measure(fn, h, w, y, b, cap, do_bench, reps=(300, 600)):
    hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    cuda = h.device.type == "cuda"

    def f():
        with torch.no_grad():
            return fn(hh, ww, y, b, cap)

    def fb():
        hh.grad = None
        ww.grad = None
        fn(hh, ww, y, b, cap).backward()
    out = {}
    fb()  # compile / autotune / warm
    if cuda:
        torch.cuda.synchronize()
    out["fwd_ms"] = do_bench(f, warmup=50 if cuda else 1, rep=reps[0] if cuda else 3, return_mode="median")
    out["fwdbwd_ms"] = do_bench(fb, warmup=50 if cuda else 1, rep=reps[1] if cuda else 3, return_mode="median")
    for key, fun in (("fwd_mb", f), ("fwdbwd_mb", fb)):
        hh.grad = None
        ww.grad = None
        gc.collect()
        if not cuda:
            out[key] = float("nan")
            continue
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fun()
        torch.cuda.synchronize()
        grads = sum(t.grad.numel() * t.grad.element_size() for t in (hh, ww) if t.grad is not None)
        out[key] = (torch.cuda.max_memory_allocated() - base - grads) / 1e6
    return out


@torch.no_grad()
def fp64_reference(h, w, y, b, cap, chunk=512):
    """Loss and gradients in fp64 through materialised logits, a chunk of rows at a time (for the errors)."""
    n, v = h.shape[0], w.shape[0]
    w64 = w.double()
    dh = torch.empty(h.shape, dtype=torch.float64, device=h.device)
    dw = torch.zeros(w.shape, dtype=torch.float64, device=h.device)
    valid = y >= 0
    count = max(int(valid.sum()), 1)
    total = 0.0
    for s in range(0, n, chunk):
        h64 = h[s:s + chunk].double()
        z = h64 @ w64.T
        t = None
        if cap is not None:
            t = torch.tanh(z / cap)
            z = cap * t
        lse = torch.logsumexp(z, -1)
        yc = y[s:s + chunk]
        vc = yc >= 0
        zy = z.gather(1, yc.clamp(min=0)[:, None])[:, 0]
        tok = lse - (1 - b) * zy - b * z.mean(-1)
        total += float(tok[vc].sum())
        g = torch.exp(z - lse[:, None]) - b / v
        g[vc.nonzero()[:, 0], yc[vc]] -= 1 - b
        if t is not None:
            g *= 1 - t * t
        g *= (vc.double() / count)[:, None]
        dh[s:s + chunk] = g @ w64
        dw += g.T @ h64
        del z, g
    return total / count, dh, dw


def errors(fn, h, w, y, b, cap, ref):
    """Relative errors of one method's loss, dh and dW against the fp64 reference."""
    hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(hh, ww, y, b, cap)
    loss.backward()

    def rel(a, r):
        return float((a.double() - r).norm() / r.norm().clamp_min(1e-300))
    return dict(loss_err=abs(float(loss) - ref[0]) / abs(ref[0]), dh_err=rel(hh.grad, ref[1]),
                dw_err=rel(ww.grad, ref[2]))


def make_regime_inputs(regime, n, d, v, dev, real_inputs=None, params=None):
    """(h, w, y) for a regime (see the module docstring); bf16."""
    if regime in ("peaked", "flat"):
        h, w, y, _ = make_inputs(n, d, v, peaked=regime == "peaked", bias=False, ignore_frac=0.0, seed=0, dev=dev)
        return h, w, y
    if regime == "realistic":
        from real_inputs import fitted_params, realistic_batch

        return realistic_batch(n, d, v, seed=0, device=dev, **(fitted_params() if params is None else params))
    if regime == "real":
        data = torch.load(real_inputs, map_location=dev)
        h = data["hidden"][:n].to(dev, torch.bfloat16)
        return h, data["weight"].to(dev, torch.bfloat16), data["targets"][:n].to(dev)
    raise ValueError(f"unknown regime {regime!r}")


def run_config(rows, fns, shape, n, d, v, b, cap, regime, methods, do_bench, dev="cuda", real_inputs=None,
               with_errors=False, params=None):
    h, w, y = make_regime_inputs(regime, n, d, v, dev, real_inputs, params)
    n, d = h.shape
    v = w.shape[0]
    flops = 8 * n * d * v
    ref = fp64_reference(h, w, y, b, cap) if with_errors else None
    for name in methods:
        row = dict(shape=shape, N=n, D=d, V=v, b=b, softcap=cap, regime=regime, method=name)
        if name == "floor (3 matmuls)":
            fwd, fwd_bwd, g = floor_fns(h, w)
            row["fwd_ms"] = do_bench(fwd, warmup=50, rep=300, return_mode="median")
            row["fwdbwd_ms"] = do_bench(fwd_bwd, warmup=50, rep=600, return_mode="median")
            row["fwd_mb"] = n * v * h.element_size() / 1e6
            row["fwdbwd_mb"] = n * v * h.element_size() / 1e6 + (n * d + v * d) * h.element_size() / 1e6
            del g
        else:
            fn = fns[name]
            if isinstance(fn, str):
                row["error"] = fn
            else:
                try:
                    row.update(measure(fn, h, w, y, b, cap, do_bench))
                    if ref is not None:
                        row.update(errors(fn, h, w, y, b, cap, ref))
                except NotImplementedError:
                    continue
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        if "fwdbwd_ms" in row:
            row["tflops"] = flops / (row["fwdbwd_ms"] * 1e-3) / 1e12
        rows.append(row)
        print(json.dumps(row), flush=True)
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
    del h, w, y, ref


ALL = ["hf_lsce", "torch eager", "torch.compile", "liger", "cce", "floor (3 matmuls)"]
OURS = ["hf_lsce", "hf_lsce (filter 2^-8)", "hf_lsce (low memory)"]
FILTERS = [f"hf_lsce (filter 2^-{k})" for k in FILTER_EXPONENTS]

# Targets: (description, numerator row, denominator row, value key, bound, "<=" or ">=").
# A row is named by (shape, b, softcap, regime, method, N or None for the shape's own N).
_G = ("gemma2-2b", 0.1, None, "peaked")
_R = ("gemma2-2b", 0.1, None, "realistic")
_L = ("llama3-8b", 0.1, None, "realistic")
_E = ("gemma3-270m", 0.1, None, "real")
TARGETS = [
    # issue 20, realistic inputs (the generator fitted to Gemma-3-270m's real softmax) and the real Gemma head
    ("realistic: fwd+bwd time vs torch.compile", _R + ("hf_lsce", None), _R + ("torch.compile", None), "fwdbwd_ms", 0.80,
     "<="),
    ("realistic: Liger fwd+bwd time / ours", _R + ("liger", None), _R + ("hf_lsce", None), "fwdbwd_ms", 3.0, ">="),
    ("realistic: low-memory extra memory vs torch.compile", _R + ("hf_lsce (low memory)", None),
     _R + ("torch.compile", None), "fwdbwd_mb", 0.01, "<="),
    ("realistic: low-memory fwd+bwd time vs torch.compile", _R + ("hf_lsce (low memory)", None),
     _R + ("torch.compile", None), "fwdbwd_ms", None, "report"),
    ("realistic: dh error vs torch in bf16", _R + ("hf_lsce", None), _R + ("torch eager", None), "dh_err", 1.0, "<="),
    ("realistic: dW error vs torch in bf16", _R + ("hf_lsce", None), _R + ("torch eager", None), "dw_err", 1.0, "<="),
    ("realistic b=0: fwd+bwd vs Cut Cross-Entropy", ("gemma2-2b", 0.0, None, "realistic", "hf_lsce", None),
     ("gemma2-2b", 0.0, None, "realistic", "cce", None), "fwdbwd_ms", None, "report"),
    ("Llama-3-8B realistic: fwd+bwd vs torch.compile", _L + ("hf_lsce", None), _L + ("torch.compile", None),
     "fwdbwd_ms", 0.80, "<="),
    ("Llama-3-8B realistic: Liger / ours", _L + ("liger", None), _L + ("hf_lsce", None), "fwdbwd_ms", 3.0, ">="),
    ("Gemma-3-270m real: fwd+bwd vs torch.compile", _E + ("hf_lsce", None), _E + ("torch.compile", None),
     "fwdbwd_ms", 0.80, "<="),
    ("Gemma-3-270m real: Liger / ours", _E + ("liger", None), _E + ("hf_lsce", None), "fwdbwd_ms", 3.0, ">="),
    ("Gemma-3-270m real: low-memory extra memory vs torch.compile", _E + ("hf_lsce (low memory)", None),
     _E + ("torch.compile", None), "fwdbwd_mb", 0.01, "<="),
    ("Gemma-3-270m real: dh error vs torch in bf16", _E + ("hf_lsce", None), _E + ("torch eager", None), "dh_err",
     1.0, "<="),
    ("Gemma-3-270m real b=0: fwd+bwd vs Cut Cross-Entropy", ("gemma3-270m", 0.0, None, "real", "hf_lsce", None),
     ("gemma3-270m", 0.0, None, "real", "cce", None), "fwdbwd_ms", None, "report"),
    # issue 27 (suite v2): at most 0.70 x torch.compile at Gemma-3-270m, 0.85 x at Gemma2-2B and Llama-3-8B (b = 0.1);
    # at b = 0 no slower than CCE; gradients no worse than torch's own bf16 path
    ("v2 Gemma-3-270m realistic: fwd+bwd vs torch.compile", ("gemma3-270m", 0.1, None, "realistic", "hf_lsce", None),
     ("gemma3-270m", 0.1, None, "realistic", "torch.compile", None), "fwdbwd_ms", 0.70, "<="),
    ("v2 Gemma2-2B realistic: fwd+bwd vs torch.compile", _R + ("hf_lsce", None), _R + ("torch.compile", None),
     "fwdbwd_ms", 0.85, "<="),
    ("v2 Llama-3-8B realistic: fwd+bwd vs torch.compile", _L + ("hf_lsce", None), _L + ("torch.compile", None),
     "fwdbwd_ms", 0.85, "<="),
    ("v2 Gemma-3-270m b=0: fwd+bwd vs CCE", ("gemma3-270m", 0.0, None, "realistic", "hf_lsce", None),
     ("gemma3-270m", 0.0, None, "realistic", "cce", None), "fwdbwd_ms", 1.0, "<="),
    ("v2 Gemma2-2B b=0: fwd+bwd vs CCE", ("gemma2-2b", 0.0, None, "realistic", "hf_lsce", None),
     ("gemma2-2b", 0.0, None, "realistic", "cce", None), "fwdbwd_ms", 1.0, "<="),
    ("v2 Llama-3-8B b=0: fwd+bwd vs CCE", ("llama3-8b", 0.0, None, "realistic", "hf_lsce", None),
     ("llama3-8b", 0.0, None, "realistic", "cce", None), "fwdbwd_ms", 1.0, "<="),
    ("v2 Gemma-3-270m realistic: dh error vs torch in bf16", ("gemma3-270m", 0.1, None, "realistic", "hf_lsce", None),
     ("gemma3-270m", 0.1, None, "realistic", "torch eager", None), "dh_err", 1.0, "<="),
    ("v2 Gemma-3-270m realistic: dW error vs torch in bf16", ("gemma3-270m", 0.1, None, "realistic", "hf_lsce", None),
     ("gemma3-270m", 0.1, None, "realistic", "torch eager", None), "dw_err", 1.0, "<="),
    ("v2 low memory, Gemma2-2B: extra memory vs torch.compile", _R + ("hf_lsce (low memory)", None),
     _R + ("torch.compile", None), "fwdbwd_mb", 0.01, "<="),
    ("v2 low memory, Gemma2-2B: fwd+bwd vs the default", _R + ("hf_lsce (low memory)", None), _R + ("hf_lsce", None),
     "fwdbwd_ms", 1.25, "<="),
    ("v2 low memory, Gemma-3-270m: fwd+bwd vs the default", ("gemma3-270m", 0.1, None, "realistic",
                                                              "hf_lsce (low memory)", None),
     ("gemma3-270m", 0.1, None, "realistic", "hf_lsce", None), "fwdbwd_ms", 1.25, "<="),
    ("v2 SmolLM2 realistic: fwd+bwd vs torch.compile", ("smollm2-135m", 0.1, None, "realistic", "hf_lsce", None),
     ("smollm2-135m", 0.1, None, "realistic", "torch.compile", None), "fwdbwd_ms", None, "report"),
    # issue 3's, on the peaked inputs where nothing is skippable
    ("peaked: fwd+bwd time vs torch.compile", _G + ("hf_lsce", None), _G + ("torch.compile", None), "fwdbwd_ms", 0.80,
     "<="),
    ("peaked: fwd+bwd, filter 2^-8 vs none", _G + ("hf_lsce (filter 2^-8)", None), _G + ("hf_lsce", None),
     "fwdbwd_ms", None, "report"),
    # issue 27, gradient filtering with a per-row bound on Gemma-3-270m's real hidden states and head (suite filter)
    ("filter: Gemma-3-270m real, filter 2^-8 vs torch.compile", _E + ("hf_lsce (filter 2^-8)", None),
     _E + ("torch.compile", None), "fwdbwd_ms", 0.70, "<="),
    ("filter: Gemma-3-270m real, filter 2^-6 vs torch.compile", _E + ("hf_lsce (filter 2^-6)", None),
     _E + ("torch.compile", None), "fwdbwd_ms", 0.70, "<="),
    ("filter: Gemma-3-270m real, filter 2^-8: dh error vs torch in bf16", _E + ("hf_lsce (filter 2^-8)", None),
     _E + ("torch eager", None), "dh_err", 1.0, "<="),
    ("filter: Gemma-3-270m real, filter 2^-8: dW error vs torch in bf16", _E + ("hf_lsce (filter 2^-8)", None),
     _E + ("torch eager", None), "dw_err", 1.0, "<="),
    ("filter: Gemma-3-270m real b=0, filter 2^-8 vs CCE", ("gemma3-270m", 0.0, None, "real", "hf_lsce (filter 2^-8)",
                                                           None), ("gemma3-270m", 0.0, None, "real", "cce", None),
     "fwdbwd_ms", 1.0, "<="),
    ("filter: Gemma-3-270m realistic (nothing to skip), filter 2^-8 vs none",
     ("gemma3-270m", 0.1, None, "realistic", "hf_lsce (filter 2^-8)", None),
     ("gemma3-270m", 0.1, None, "realistic", "hf_lsce", None), "fwdbwd_ms", None, "report"),
    ("peaked: Liger fwd+bwd time / ours", _G + ("liger", None), _G + ("hf_lsce", None), "fwdbwd_ms", 3.0, ">="),
]


def _find(rows, key):
    shape, b, cap, regime, method, n = key
    n = n or SHAPES[shape][0]
    for r in rows:
        if (r["shape"], r["b"], r["softcap"], r["regime"], r["method"], r["N"]) == (shape, b, cap, regime, method, n):
            return r if "error" not in r else None
    return None


def target_rows(rows):
    """The ratios above, each from rows of this one run (None where a row is missing)."""
    out = []
    for desc, num, den, key, bound, op in TARGETS:
        a, c = _find(rows, num), _find(rows, den)
        ratio = a[key] / c[key] if a and c and c.get(key) else None
        met = None if ratio is None or bound is None else (ratio <= bound if op == "<=" else ratio >= bound)
        out.append(dict(target=desc, key=key, ratio=ratio, bound=f"{op} {bound}" if bound else op, met=met))
    return out


def suite(name):
    """(shape, b, softcap, regime, methods, N override, with fp64 errors) tuples."""
    if name == "smoke":  # CPU, tiny: the code paths, not the figures
        return [("smoke", 0.1, None, "realistic", OURS + ["torch eager"], None, True),
                ("smoke", 0.1, None, "peaked", ["hf_lsce", "torch eager"], None, False)]
    if name == "quick":
        return [("gemma2-2b", 0.1, None, "realistic", ["hf_lsce", "torch.compile", "floor (3 matmuls)"], None, False)]
    if name == "v2":  # issue 27: the two training paths against torch.compile and CCE, and where they cross
        both = ["hf_lsce", "hf_lsce (one-pass)", "hf_lsce (two-pass)"]
        return [("gemma3-270m", 0.1, None, "realistic", both + ["torch eager", "torch.compile", "liger",
                                                                "floor (3 matmuls)"], None, True),
                ("gemma3-270m", 0.0, None, "realistic", ["hf_lsce", "cce", "torch.compile"], None, False),
                ("smollm2-135m", 0.1, None, "realistic", both + ["torch.compile", "floor (3 matmuls)"], None, False),
                ("qwen2.5-0.5b", 0.1, None, "realistic", both[1:], None, False),
                ("qwen2.5-1.5b", 0.1, None, "realistic", both[1:], None, False),
                ("gemma2-2b", 0.1, None, "realistic", both + ["torch eager", "torch.compile", "floor (3 matmuls)"], None,
                 True),
                ("llama3-8b", 0.1, None, "realistic", both + ["torch.compile", "floor (3 matmuls)"], None, False),
                ("llama3-8b", 0.0, None, "realistic", ["hf_lsce", "cce"], None, False),
                ("gemma2-2b", 0.0, None, "realistic", ["hf_lsce", "cce"], None, False)]
    if name == "v3":  # issue 27: the fused training path (one logits pass storing exp(z - c)) against the others
        paths = ["hf_lsce", "hf_lsce (fused)", "hf_lsce (one-pass)", "hf_lsce (two-pass)"]
        return [("gemma3-270m", 0.1, None, "realistic", paths + ["torch eager", "torch.compile", "floor (3 matmuls)"], None,
                 True),
                ("gemma3-270m", 0.0, None, "realistic", ["hf_lsce", "cce", "torch.compile"], None, False),
                ("smollm2-135m", 0.1, None, "realistic", paths + ["torch.compile", "floor (3 matmuls)"], None, False),
                ("qwen2.5-0.5b", 0.1, None, "realistic", paths[1:], None, False),
                ("gemma2-2b", 0.1, None, "realistic", paths + ["torch.compile", "floor (3 matmuls)"], None, True),
                ("gemma2-2b", 0.0, None, "realistic", ["hf_lsce", "cce"], None, False),
                ("llama3-8b", 0.1, None, "realistic", paths + ["torch.compile", "floor (3 matmuls)"], None, True),
                ("llama3-8b", 0.0, None, "realistic", ["hf_lsce", "cce"], None, False)]
    if name == "v2-low":  # issue 27: memory="low" (two-pass computation in 32 MiB column chunks) against the default
        low = ["hf_lsce", "hf_lsce (low memory)", "torch.compile"]
        return [("gemma2-2b", 0.1, None, "realistic", low, None, True),
                ("gemma3-270m", 0.1, None, "realistic", low, None, True),
                ("llama3-8b", 0.1, None, "realistic", low, None, False)]
    if name == "filter":  # issue 27: gradient filtering with a per-row bound, real Gemma-3 inputs (and the generator)
        return [("gemma3-270m", 0.1, None, "real", ["hf_lsce"] + FILTERS + ["torch eager", "torch.compile",
                                                                            "floor (3 matmuls)"], None, True),
                ("gemma3-270m", 0.0, None, "real", ["hf_lsce", "hf_lsce (filter 2^-8)", "cce"], None, False),
                ("gemma3-270m", 0.1, None, "realistic", ["hf_lsce", "hf_lsce (filter 2^-8)"], None, False)]
    if name == "real":
        return [("gemma3-270m", 0.1, None, "real", OURS + ["torch eager", "torch.compile", "liger", "floor (3 matmuls)"],
                 None, True),
                ("gemma3-270m", 0.0, None, "real", ["hf_lsce", "cce", "liger"], None, False)]
    out = [
        ("gemma2-2b", 0.1, None, "realistic", OURS + ["torch eager", "torch.compile", "liger", "floor (3 matmuls)"],
         None, True),
        ("gemma2-2b", 0.0, None, "realistic", ["hf_lsce", "cce", "liger", "torch.compile"], None, False),
        ("gemma2-2b", 0.1, None, "peaked", ["hf_lsce", "hf_lsce (filter 2^-8)", "torch.compile", "liger"], None, False),
        ("llama3-8b", 0.1, None, "realistic", OURS + ["torch.compile", "liger", "floor (3 matmuls)"], None, True),
        ("llama3-8b", 0.0, None, "realistic", ["hf_lsce", "cce"], None, False),
    ]
    if name == "full":
        out += [
            ("gemma2-2b", 0.1, 30.0, "realistic", ["hf_lsce", "torch.compile"], None, False),
            ("gemma2-2b", 0.1, None, "realistic", ["hf_lsce", "hf_lsce (low memory)"], 32768, False),
            ("llama3.2-1b", 0.1, None, "realistic", ["hf_lsce", "torch.compile", "liger"], None, False),
        ]
    return out


def _fmt(x, spec):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def write_outputs(rows, out_dir, meta, stem="bench_linear_cross_entropy"):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(dict(meta, rows=rows, targets=target_rows(rows)), f, indent=1)
    lines = [f"Device: {meta['device']}; torch {meta['torch']}, triton {meta['triton']}; "
             f"peers: {meta['peers']}.", "",
             "| shape (N, D, V) | b | inputs | method | fwd ms | fwd extra MB | fwd+bwd ms | fwd+bwd extra MB | "
             "TFLOP/s | loss err | dh err | dW err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        shp = f"{r['shape']} ({r['N']}, {r['D']}, {r['V']})" + (f", cap {r['softcap']:g}" if r["softcap"] else "")
        if "error" in r:
            lines.append(f"| {shp} | {r['b']} | {r['regime']} | {r['method']} | {r['error']} |||||||")
            continue
        lines.append(f"| {shp} | {r['b']} | {r['regime']} | {r['method']} | {_fmt(r['fwd_ms'], '.1f')} | "
                     f"{_fmt(r['fwd_mb'], ',.0f')} | {_fmt(r['fwdbwd_ms'], '.1f')} | {_fmt(r['fwdbwd_mb'], ',.0f')} | "
                     f"{_fmt(r.get('tflops'), '.0f')} | {_fmt(r.get('loss_err'), '.1e')} | "
                     f"{_fmt(r.get('dh_err'), '.1e')} | {_fmt(r.get('dw_err'), '.1e')} |")
    tgt = target_rows(rows)
    lines += ["", "Targets, ratios of rows above (numerator / denominator of the named rows):", "",
              "| target | ratio | bound | met |", "|---|---|---|---|"]
    for t in tgt:
        lines.append(f"| {t['target']} ({t['key']}) | {_fmt(t['ratio'], '.3f')} | {t['bound']} | "
                     f"{'-' if t['met'] is None else t['met']} |")
    table = "\n".join(lines)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(table + "\n")
    print("\n" + table)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        sel = [r for r in rows if "error" not in r and r["softcap"] is None and r["shape"] in SHAPES
               and r["N"] == SHAPES[r["shape"]][0] and not math.isnan(r.get("fwdbwd_ms", float("nan")))]
        if not sel:
            return
        labels = [f"{r['shape']} {r['regime']}\nb={r['b']} {r['method']}" for r in sel]
        fig, ax = plt.subplots(1, 2, figsize=(max(9, len(sel) * 0.55), 5.5))
        colors = {"peaked": "C0", "realistic": "C1", "real": "C2", "flat": "C3"}
        ax[0].bar(range(len(sel)), [r["fwdbwd_ms"] for r in sel], color=[colors.get(r["regime"], "C4") for r in sel])
        ax[0].set_ylabel("fwd+bwd ms (median)")
        ax[1].bar(range(len(sel)), [max(r["fwdbwd_mb"], 0.1) if not math.isnan(r["fwdbwd_mb"]) else 0.1 for r in sel],
                  color=[colors.get(r["regime"], "C4") for r in sel])
        ax[1].set_yscale("log")
        ax[1].set_ylabel("fwd+bwd extra MB (log)")
        for a in ax:
            a.set_xticks(range(len(sel)))
            a.set_xticklabels(labels, rotation=90, fontsize=6)
        fig.suptitle(f"Linear + label-smoothed CE, {meta['device']} (colour: inputs: peaked / realistic / real)")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, f"{stem}.png"), dpi=110)
        plt.close(fig)
    except Exception as e:  # noqa: BLE001
        print("plot skipped:", e)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", choices=["smoke", "quick", "main", "full", "real", "v2", "v3", "v2-low", "filter"], default="main")
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--real-inputs", default=None, help="for --suite real: the capture file (real_inputs.py)")
    ap.add_argument("--deadline-s", type=float, default=None, help="stop starting new configurations after this")
    ap.add_argument("--stem", default="bench_linear_cross_entropy")
    ap.add_argument("--only", default=None, help="comma-separated shapes: run only the suite's configurations of these")
    args = ap.parse_args()
    import time

    import triton

    start = time.time()
    smoke = args.suite == "smoke"
    dev = "cpu" if smoke else "cuda"
    if smoke:
        SHAPES["smoke"] = (192, 48, 3000)
        do_bench = _timer
    else:
        from triton.testing import do_bench
    fns = method_fns(compile_=not smoke)
    peers = ", ".join(f"{k}: {'ok' if not isinstance(v, str) else v}" for k, v in fns.items() if k in ("liger", "cce"))
    meta = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke)", torch=torch.__version__,
                triton=triton.__version__, peers=peers)
    path = os.path.join(args.out_dir, f"{args.stem}.json")
    rows = json.load(open(path))["rows"] if os.path.exists(path) and args.suite in ("real", "filter") else []
    for shape, b, cap, regime, methods, n_over, with_err in suite(args.suite):
        if args.only and shape not in args.only.split(","):
            continue
        if args.deadline_s is not None and time.time() - start > args.deadline_s:
            print(f"deadline: skipping {shape} b={b} {regime}", flush=True)
            continue
        n, d, v = SHAPES[shape]
        if not smoke:
            # compiled afresh per configuration (dynamo's caches reset: they live on the function's code object, so a
            # new torch.compile wrapper alone would not do): one reused across shapes (and values of b) recompiles
            # with dynamic shapes, and past the cache limit falls back to eager
            torch._dynamo.reset()
            fns["torch.compile"] = torch.compile(torch_loss, dynamic=False)
        run_config(rows, fns, shape, n_over or n, d, v, b, cap, regime, methods, do_bench, dev=dev,
                   real_inputs=args.real_inputs, with_errors=with_err,
                   params={} if smoke else None)  # smoke: the generator's defaults (the code path, not the fit)
        write_outputs(rows, args.out_dir, meta, args.stem)


if __name__ == "__main__":
    main()
