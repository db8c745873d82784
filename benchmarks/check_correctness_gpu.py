"""Correctness of the Triton kernels on CUDA at real sizes, bf16 against an fp32 reference.

For each shape and case: relative error (||x - ref|| / ||ref||) of the loss and of the gradients
of hidden, weight (and bias), for hf_lsce's kernels and, for scale, for torch computing the same
thing in bf16 the way Hugging Face does (bf16 logits, upcast, F.cross_entropy). The fp32 reference
materialises fp32 logits a chunk of rows at a time and differentiates with autograd.

    python benchmarks/check_correctness_gpu.py [--out results/correctness.json] [--quick]
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

from hf_lsce import linear_cross_entropy

SHAPES = {"gemma2-2b": (8192, 2304, 256000), "llama3-8b": (8192, 4096, 128256)}


def make_inputs(n, d, v, *, peaked, bias, ignore_frac, seed, dtype=torch.bfloat16, dev="cuda"):
    """W ~ N(0,1)/sqrt(D), h ~ N(0, 9), Zipf targets; 'peaked' pushes h toward its target row."""
    g = torch.Generator(device=dev).manual_seed(seed)
    w = torch.randn(v, d, generator=g, device=dev) / math.sqrt(d)
    ranks = torch.arange(1, v + 1, device=dev, dtype=torch.float64)
    y = torch.multinomial((1.0 / ranks).float(), n, replacement=True, generator=g)
    h = 3.0 * torch.randn(n, d, generator=g, device=dev)
    if peaked:
        wy = w[y]
        h = h + (18.0 - (h * wy).sum(-1, keepdim=True)) * wy / (wy * wy).sum(-1, keepdim=True)
    if ignore_frac:
        y = y.masked_fill(torch.rand(n, generator=g, device=dev) < ignore_frac, -100)
    b = 0.5 * torch.randn(v, generator=g, device=dev) if bias else None
    return h.to(dtype), w.to(dtype), y, (b.to(dtype) if b is not None else None)


def chunked_reference(h, w, y, b, smoothing, softcap, reduction, num_items, compute_dtype, chunk=1024, z_loss=0.0,
                      lse_weight=0.0):
    """Loss and gradients through materialised logits in `compute_dtype` (chunks of rows); ``z_loss`` adds
    z_loss * lse^2 per token, ``lse_weight`` adds lse_weight * sum of the lse (a loss on the lse output)."""
    n = h.shape[0]
    hh = h.detach().to(compute_dtype)
    ww = w.detach().to(compute_dtype).requires_grad_()
    bb = b.detach().to(compute_dtype).requires_grad_() if b is not None else None
    valid = y != -100
    count = int(valid.sum()) if num_items is None else num_items
    dh = torch.empty_like(hh, dtype=torch.float32)
    tok = torch.zeros(n, dtype=torch.float32, device=h.device)
    for s in range(0, n, chunk):
        hc = hh[s:s + chunk].clone().requires_grad_()
        z = hc @ ww.T
        if bb is not None:
            z = z + bb
        z = z.float()
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        yc = y[s:s + chunk]
        if torch.is_tensor(smoothing):
            logp = torch.log_softmax(z, -1)
            nll = -logp.gather(1, yc.clamp(min=0)[:, None])[:, 0]
            sm = smoothing[s:s + chunk]
            lt = torch.where(yc != -100, (1 - sm) * nll - sm * logp.mean(-1), 0.0)
        else:
            lt = F.cross_entropy(z, yc, label_smoothing=smoothing, reduction="none")
        if z_loss:
            lse = torch.logsumexp(z, -1)
            lt = lt + z_loss * torch.where(yc != -100, lse * lse, torch.zeros_like(lse))
        tok[s:s + chunk] = lt.detach()
        if reduction == "none":
            part = lt.sum()
        else:
            part = lt.sum() / (count if reduction == "mean" or num_items is not None else 1)
        if lse_weight:
            part = part + lse_weight * torch.logsumexp(z, -1).sum()
        part.backward()
        dh[s:s + chunk] = hc.grad.float()
    loss = tok if reduction == "none" else tok.sum() / (count if reduction == "mean" or num_items is not None else 1)
    return loss, dh, ww.grad.float(), (bb.grad.float() if bb is not None else None)


def rel(a, b):
    if a is None or b is None:
        return float("nan")
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


CASES = [
    # name, kwargs for make_inputs, kwargs for the loss
    ("b=0 peaked", dict(peaked=True), dict(smoothing=0.0)),
    ("b=0.1 peaked", dict(peaked=True), dict(smoothing=0.1)),
    ("b=0.1 flat", dict(peaked=False), dict(smoothing=0.1)),
    ("b=1 flat", dict(peaked=False), dict(smoothing=1.0)),
    ("per-token b peaked", dict(peaked=True), dict(smoothing="per-token")),
    ("softcap30 b=0.1 peaked", dict(peaked=True), dict(smoothing=0.1, softcap=30.0)),
    ("softcap30 b=0 flat", dict(peaked=False), dict(smoothing=0.0, softcap=30.0)),
    ("bias b=0.1 peaked", dict(peaked=True, bias=True), dict(smoothing=0.1)),
    ("sum b=0.1", dict(peaked=True), dict(smoothing=0.1, reduction="sum")),
    ("none b=0.1", dict(peaked=True), dict(smoothing=0.1, reduction="none")),
    ("num_items b=0.1", dict(peaked=True), dict(smoothing=0.1, num_items=5000)),
]


def repeat_check(n, d, v, times=5):
    """The one-pass training path stores G in place over the logits it reads; a race there would make
    repeated runs differ. Run fwd+bwd `times` times on the same inputs and compare bit for bit."""
    h, w, y, _ = make_inputs(n, d, v, peaked=True, bias=False, ignore_frac=0.2, seed=99)
    outs = []
    for _ in range(times):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = linear_cross_entropy(hh, ww, y, label_smoothing=0.1, softcap=30.0)
        loss.backward()
        outs.append((loss.detach(), hh.grad, ww.grad))
    same = all(torch.equal(a, b) for o in outs[1:] for a, b in zip(o, outs[0]))
    return dict(check="repeat fwd+bwd bitwise identical", shape=(n, d, v), times=times, identical=same)


def eval_check(sname, n, d, v, softcap, bias, dtype=torch.bfloat16):
    """Evaluation (no gradients): the fused forward kernel's loss and statistics against fp32 logits, and
    against the one-pass training path's loss on the same inputs."""
    h, w, y, b = make_inputs(n, d, v, peaked=True, bias=bias, ignore_frac=0.2, seed=7, dtype=dtype)
    ref = chunked_reference(h, w, y, b, 0.1, softcap, "mean", None, torch.float32)[0]
    lse_r, am_r, ent_r = [], [], []
    for s in range(0, n, 1024):
        z = h[s:s + 1024].float() @ w.float().T + (b.float() if b is not None else 0)
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        lse_r.append(torch.logsumexp(z, -1))
        am_r.append(z.argmax(-1))
        p = torch.softmax(z, -1)
        ent_r.append(-(p * torch.log(p.clamp_min(1e-45))).sum(-1))
        del z, p
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, y, bias=b, label_smoothing=0.1, softcap=softcap)
        loss_s, st = linear_cross_entropy(h, w, y, bias=b, label_smoothing=0.1, softcap=softcap, return_stats=True)
    hh = h.clone().requires_grad_()
    train = linear_cross_entropy(hh, w, y, bias=b, label_smoothing=0.1, softcap=softcap)
    return dict(check="evaluation forward", shape=sname, dtype=str(dtype).replace("torch.", ""), softcap=softcap,
                bias=bias,
                loss_err=rel(loss.float(), ref), stats_loss_err=rel(loss_s.float(), ref),
                train_vs_eval=rel(train.detach().float(), loss.float()),
                lse_err=rel(st.lse, torch.cat(lse_r)), entropy_err=rel(st.entropy, torch.cat(ent_r)),
                argmax_agree=float((st.argmax == torch.cat(am_r)).float().mean()),
                finite=bool(torch.isfinite(loss) and torch.isfinite(st.lse).all()))


def new_paths_check(sname, n, d, v, params):
    """The training paths added for real inputs, on the fitted realistic generator (benchmarks/real_inputs.py),
    bf16 against the fp32 reference, beside torch in bf16: the default (no filtering), filtering at 2**-16 with the
    vocabulary sorted (with the fraction of tiles skipped), memory='low', fp32 dW accumulation, larger thresholds,
    z-loss, a loss on the lse output; a second backward (retain_graph) bit for bit; double backward refused."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from real_inputs import realistic_batch

    h, w, y = realistic_batch(n, d, v, seed=3, device="cuda", **params)
    y = y.masked_fill(torch.rand(n, device="cuda", generator=torch.Generator("cuda").manual_seed(1)) < 0.2, -100)
    out = []
    ref = chunked_reference(h, w, y, None, 0.1, None, "mean", None, torch.float32)
    same = chunked_reference(h, w, y, None, 0.1, None, "mean", None, torch.bfloat16)
    base = dict(shape=sname, inputs="realistic (fitted)", loss_err_torch_bf16=rel(same[0], ref[0]),
                dh_err_torch_bf16=rel(same[1], ref[1]), dw_err_torch_bf16=rel(same[2], ref[2]))
    variants = [("default (no filtering)", {}), ("filter 2^-8, sorted", dict(filter_eps=2.0 ** -8)),
                ("memory=low", dict(memory="low")), ("accum_dtype=fp32", dict(accum_dtype=torch.float32)),
                ("filter 2^-6", dict(filter_eps=2.0 ** -6)), ("filter 2^-10", dict(filter_eps=2.0 ** -10)),
                ("filter 2^-8, natural order", dict(filter_eps=2.0 ** -8, sort_vocab=False))]
    for name, kw in variants:
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = linear_cross_entropy(hh, ww, y, label_smoothing=0.1, **kw)
        loss.backward()
        out.append(dict(base, check=name, loss_err=rel(loss.detach().float(), ref[0]), dh_err=rel(hh.grad, ref[1]),
                        dw_err=rel(ww.grad, ref[2])))
        print(json.dumps(out[-1]), flush=True)
    zref = chunked_reference(h, w, y, None, 0.1, None, "mean", None, torch.float32, z_loss=1e-4)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy(hh, ww, y, label_smoothing=0.1, z_loss=1e-4)
    loss.backward()
    out.append(dict(shape=sname, check="z_loss 1e-4", loss_err=rel(loss.detach().float(), zref[0]),
                    dh_err=rel(hh.grad, zref[1]), dw_err=rel(ww.grad, zref[2])))
    lref = chunked_reference(h, w, y, None, 0.1, None, "mean", None, torch.float32, lse_weight=1e-5)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, lse = linear_cross_entropy(hh, ww, y, label_smoothing=0.1, return_lse=True)
    (loss + 1e-5 * lse.sum()).backward()
    out.append(dict(shape=sname, check="loss on the lse output", dh_err=rel(hh.grad, lref[1]),
                    dw_err=rel(ww.grad, lref[2])))
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy(hh, ww, y, label_smoothing=0.1)
    loss.backward(retain_graph=True)
    g1 = (hh.grad.clone(), ww.grad.clone())
    loss.backward()
    out.append(dict(shape=sname, check="second backward (retain_graph) identical",
                    identical=bool(torch.equal(hh.grad, 2 * g1[0]) and torch.equal(ww.grad, 2 * g1[1]))))
    hh = h.clone().requires_grad_()
    loss = linear_cross_entropy(hh, w, y)
    try:
        torch.autograd.grad(loss, hh, create_graph=True)
        refused, message = False, ""
    except RuntimeError as e:
        refused, message = "double backward" in str(e), str(e)[:120]
    out.append(dict(shape=sname, check="double backward refused", refused=refused, message=message))
    for r in out[-4:]:
        print(json.dumps(r), flush=True)
    return out


EDGE_SHAPES = [(1, 64, 100), (7, 2304, 256000), (100, 40, 1000), (300, 4096, 32001), (129, 2048, 257)]


def edge_check():
    """Small and ragged shapes (fewer rows than a block, a vocabulary smaller than a tile, odd V, D = 40):
    the evaluation loss (TMA kernel on Hopper) and the training loss and gradients against fp64."""
    out = []
    for n, d, v in EDGE_SHAPES:
        h, w, y, _ = make_inputs(n, d, v, peaked=True, bias=False, ignore_frac=0.2, seed=11)
        hr, wr = h.double().requires_grad_(), w.double().requires_grad_()
        ref = torch.nn.functional.cross_entropy(hr @ wr.T, y, label_smoothing=0.1)
        ref.backward()
        with torch.no_grad():
            ev = linear_cross_entropy(h, w, y, label_smoothing=0.1)
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        tr = linear_cross_entropy(hh, ww, y, label_smoothing=0.1)
        tr.backward()
        out.append(dict(check="edge shape", shape=(n, d, v), eval_loss_err=rel(ev, ref.detach()),
                        train_loss_err=rel(tr.detach(), ref.detach()), dh_err=rel(hh.grad, hr.grad),
                        dw_err=rel(ww.grad, wr.grad), finite=bool(torch.isfinite(ev) and torch.isfinite(tr))))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="correctness_gpu.json")
    ap.add_argument("--quick", action="store_true", help="first shape, first three cases")
    ap.add_argument("--sections", default="cases,repeat,edge,eval,new",
                    help="comma-separated: cases, repeat, edge, eval, new (the paths for real inputs)")
    ap.add_argument("--case-shapes", default=None, help="shapes for the cases section (default: all)")
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    assert torch.cuda.is_available(), "this check needs a CUDA GPU"
    results = []
    shapes = list(SHAPES.items())[:1] if args.quick else list(SHAPES.items())
    if args.case_shapes:
        shapes = [(k, SHAPES[k]) for k in args.case_shapes.split(",")]
    cases = (CASES[:3] if args.quick else CASES) if "cases" in sections else []
    for sname, (n, d, v) in (shapes if cases else []):
        for i, (cname, ik, lk) in enumerate(cases):
            ik = dict(dict(bias=False, ignore_frac=0.2, seed=i), **ik)
            h, w, y, b = make_inputs(n, d, v, **ik)
            sm = lk.get("smoothing", 0.0)
            if sm == "per-token":
                sm = torch.rand(n, device="cuda")
                sm[::3] = 0.0
                sm[1::3] = 1.0
            softcap, red, ni = lk.get("softcap"), lk.get("reduction", "mean"), lk.get("num_items")
            ref = chunked_reference(h, w, y, b, sm, softcap, red, ni, torch.float32)
            same = chunked_reference(h, w, y, b, sm, softcap, red, ni, torch.bfloat16)
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            bb = b.clone().requires_grad_() if b is not None else None
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = linear_cross_entropy(hh, ww, y, bias=bb, label_smoothing=sm, softcap=softcap,
                                        reduction=red, num_items_in_batch=ni)
            (loss.sum() if loss.dim() else loss).backward()
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            finite = bool(torch.isfinite(loss).all() and torch.isfinite(hh.grad).all() and torch.isfinite(ww.grad).all())
            row = dict(shape=sname, N=n, D=d, V=v, case=cname, finite=finite, seconds=dt,
                       loss_ref=float(ref[0].sum()),
                       loss_err=rel(loss.detach().float(), ref[0]), loss_err_torch_bf16=rel(same[0], ref[0]),
                       dh_err=rel(hh.grad, ref[1]), dh_err_torch_bf16=rel(same[1], ref[1]),
                       dw_err=rel(ww.grad, ref[2]), dw_err_torch_bf16=rel(same[2], ref[2]),
                       db_err=rel(bb.grad if bb is not None else None, ref[3]),
                       db_err_torch_bf16=rel(same[3], ref[3]))
            results.append(row)
            print(json.dumps(row), flush=True)
            del h, w, y, b, hh, ww, bb, ref, same, loss
            torch.cuda.empty_cache()
    repeat = repeat_check(*shapes[0][1]) if "repeat" in sections else None
    print(json.dumps(repeat), flush=True)
    edges = edge_check() if "edge" in sections else []
    for e in edges:
        print(json.dumps(e), flush=True)
    new = []
    if "new" in sections:
        import sys

        sys.path.insert(0, __import__("os").path.dirname(__file__))
        from real_inputs import fitted_params

        new = new_paths_check("gemma2-2b", *SHAPES["gemma2-2b"], fitted_params())
    evals = []
    for sname, (n, d, v) in (shapes if "eval" in sections else []):
        for softcap, bias, dt in ((None, False, torch.bfloat16), (30.0, True, torch.bfloat16),
                                  (None, False, torch.float16)):
            evals.append(eval_check(sname, n, d, v, softcap, bias, dt))
            print(json.dumps(evals[-1]), flush=True)
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                       triton=__import__("triton").__version__, results=results, repeat=repeat,
                       evaluation=evals, edge_shapes=edges, new_paths=new), f, indent=1)
    hdr = "| shape | case | loss err (ours / torch bf16) | dh err | dW err | db err | finite |"
    print("\n" + hdr + "\n|---|---|---|---|---|---|---|")
    for r in results:
        f2 = lambda a, b: f"{r[a]:.1e} / {r[b]:.1e}"  # noqa: E731
        print(f"| {r['shape']} | {r['case']} | {f2('loss_err', 'loss_err_torch_bf16')} | "
              f"{f2('dh_err', 'dh_err_torch_bf16')} | {f2('dw_err', 'dw_err_torch_bf16')} | "
              f"{f2('db_err', 'db_err_torch_bf16')} | {r['finite']} |")


if __name__ == "__main__":
    main()
