"""Are the kernels right on this GPU? One process; JSON lines as it goes, ``check_gpu.json`` and a table at the end.

1. paths: every layout of the fused computation (``budget.Plan``), ``memory="auto"``, ``"low"`` and the smallest
   budget, trainable and frozen, against fp64 on materialised logits: bf16 and fp16, ragged and aligned vocabularies,
   soft-cap, bias, per-token b, a tensor ``num_items_in_batch``; each call sync-free (``set_sync_debug_mode``).
2. strides: hidden and weight transposed or rows of a wider tensor, bias, labels and per-token b of stride 2, all
   together (also compiled), in every layout, trainable and frozen, bf16 and fp16: equal to the contiguous values.
3. real: Gemma2-2B (also capped at 30) and Llama-3-8B heads, N = 8,192, realistic inputs, "auto" and "low", beside
   torch's bf16 logits; a patched two-layer Gemma 2 against the stock model in fp32 and bf16.
4. eval: loss, lse, entropy and argmax against fp32 logits. 5. edge: one token, V below a tile, odd V, D = 40.
6. behaviour: a bad target (NaN loss, no gradient, the next call raises), bitwise-repeatable runs, a second backward
   doubles the gradients, double backward refused, the free-memory reading.
7. compile: the op under ``torch.compile(fullgraph=True)`` and replayed from a CUDA graph against eager; a patched
   model compiled whole against HF's smoothed loss and the eager patched model.
8. budget: Gemma-3-270m and Llama-3-8B heads, trainable and frozen, budgets from the smallest to unlimited: the
   measured peak beyond the inputs and gradients within the budget (plus ``budget.SLACK_BYTES``).

    python benchmarks/check_gpu.py [--out DIR] [--sections paths,strides,real,eval,edge,behaviour,compile,budget]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hf_lsce import linear_cross_entropy  # noqa: E402
from hf_lsce.ops import budget as bud  # noqa: E402
from hf_lsce.ops import checks  # noqa: E402

DEV = "cuda"


def rel(a, r):
    return None if a is None or r is None else float((a.double() - r.double()).norm() / r.double().norm().clamp_min(1e-300))


def reference(h, w, bias, y, b, cap, num_items, dtype=torch.float64, chunk=1024, frozen=False, z_loss=0.0):
    """Loss, dh, dW, db of ``sum_n loss_n / num_items`` through logits materialised in ``dtype`` a chunk of rows at a
    time (fp64: the truth; bf16: torch's own half-precision path, the logits rounded as Hugging Face's are)."""
    b = b if torch.is_tensor(b) else torch.full(y.shape, float(b), device=y.device)
    ww = w.detach().to(dtype, copy=True).requires_grad_(not frozen)  # copies: the inputs stay untouched leaves
    bb = bias.detach().to(dtype, copy=True).requires_grad_() if bias is not None else None
    dh, total = torch.empty(h.shape, dtype=torch.float64, device=h.device), 0.0
    for s in range(0, h.shape[0], chunk):
        hh = h[s:s + chunk].detach().to(dtype, copy=True).requires_grad_()
        z = (hh @ ww.T + (bb if bb is not None else 0)).double()
        z = cap * torch.tanh(z / cap) if cap is not None else z
        logp = torch.log_softmax(z, -1)
        yc, bc = y[s:s + chunk], b[s:s + chunk].double()
        tok = -(1 - bc) * logp.gather(1, yc.clamp(min=0)[:, None])[:, 0] - bc * logp.mean(-1)
        loss = torch.where(yc >= 0, tok + z_loss * torch.logsumexp(z, -1) ** 2, 0.0).sum() / float(num_items)
        loss.backward()
        total += float(loss)
        dh[s:s + chunk] = hh.grad
    return total, dh, (None if frozen else ww.grad), (bb.grad if bb is not None else None)


def run_op(h, w, bias, y, b, cap, num_items, frozen, fn=None, **kw):
    """(loss tensor, dh, dW, db) of the op (``fn``: a compiled call of it) on new leaves that keep the inputs'
    layout; nothing here reads the device (the paths section checks that)."""
    hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_(not frozen)
    bb = bias.detach().requires_grad_() if bias is not None else None
    loss = (fn or linear_cross_entropy)(hh, ww, y, bias=bb, label_smoothing=b, softcap=cap, reduction="sum",
                                        num_items_in_batch=num_items, **kw)
    loss.backward()
    return loss.detach(), hh.grad, ww.grad, (bb.grad if bb is not None else None)


def errors(got, ref):
    return dict(loss_err=abs(float(got[0]) - ref[0]) / abs(ref[0]), dh_err=rel(got[1], ref[1]),
                dw_err=rel(got[2], ref[2]), db_err=rel(got[3], ref[3]))


def paths_section(emit):
    g = torch.Generator(device=DEV).manual_seed(0)
    configs = [(1500, 640, 32768, None, False, torch.bfloat16, 0), (1500, 576, 50257, 30.0, True, torch.bfloat16, 0),
               (777, 2304, 40000, None, False, torch.bfloat16, 0), (1500, 640, 32771, None, True, torch.bfloat16, 1e-3),
               (900, 1536, 30000, None, False, torch.float16, 0), (1500, 640, 32771, None, True, torch.float16, 1e-3)]
    for n, d, v, cap, with_bias, dt, zl in configs:
        w = (torch.randn(v, d, device=DEV, generator=g) / d ** 0.5).to(dt)
        h = (torch.randn(n, d, device=DEV, generator=g) * 3).to(dt)
        y = torch.randint(0, v, (n,), device=DEV, generator=g)
        y[::7] = -100
        bias = (torch.randn(v, device=DEV, generator=g) * 0.1).to(dt) if with_bias else None
        b = torch.rand(n, device=DEV, generator=g) * 0.2
        items = (y >= 0).sum() + 5
        for frozen in (False, True):
            ref = reference(h, w, bias, y, b, cap, items, frozen=frozen, z_loss=zl)
            base = dict(section="paths", N=n, D=d, V=v, dtype=str(dt)[6:], softcap=cap, bias=with_bias, z_loss=zl,
                        head="frozen" if frozen else "trainable")
            emit(dict(base, path="torch half logits", **errors(
                reference(h, w, bias, y, b, cap, items, dtype=dt, frozen=frozen, z_loss=zl), ref)))
            for path, mem, plan in layouts(h, w, bias, cap, frozen):
                real_plan = forced(plan)
                try:
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("error")
                    got = run_op(h, w, bias, y, b, cap, items, frozen, z_loss=zl, memory=mem)
                    sync_free = True
                except RuntimeError as e:
                    sync_free = f"{type(e).__name__}: {str(e)[:160]}"
                    torch.cuda.set_sync_debug_mode("default")
                    got = run_op(h, w, bias, y, b, cap, items, frozen, z_loss=zl, memory=mem)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    bud.plan_for = real_plan
                emit(dict(base, path=path, sync_free=sync_free, **errors(got, ref)))


def forced(plan):
    """Every call of the op takes ``plan`` (None: the budget's) until the returned real ``bud.plan_for`` is back."""
    real = bud.plan_for
    if plan is not None:
        bud.plan_for = lambda *a, **k: plan
    return real


def layouts(h, w, bias, cap, frozen):
    """(name, memory, a plan forced or None) for every layout the fused computation has at this shape, and the
    budgets "auto", "low" and the smallest."""
    n, v = h.shape[0], w.shape[0]
    comp = bud.computation(h, w, cap, "triton")
    least = bud.smallest(bud.shape_of(h, w, bias, cap, comp, not frozen, bias is not None), comp)  # (run_op: db)
    out = [("auto", "auto", None), ("low", "low", None), ("smallest budget", least, None)]
    if comp == "fused":
        out += [("rows, every row", "auto", bud.Plan("fused", "rows", rows=n)),
                ("rows, by 512", "auto", bud.Plan("fused", "rows", rows=512)),
                ("columns, keep half", "auto", bud.Plan("fused", "columns", keep=v // 2 // 256 * 256, cols=4096)),
                ("columns, keep none", "auto", bud.Plan("fused", "columns", cols=4096))]
        if frozen:
            out.append(("frozen columns", "auto", bud.Plan("fused", "frozen", cols=4096)))
    return out


def real_section(emit):
    from real_inputs import fitted_params, realistic_batch

    for shape, (n, d, v), cap in (("gemma2-2b", (8192, 2304, 256000), None), ("gemma2-2b", (8192, 2304, 256000), 30.0),
                                  ("llama3-8b", (8192, 4096, 128256), None)):
        h, w, y = realistic_batch(n, d, v, seed=3, device=DEV, **fitted_params())
        y = y.masked_fill(torch.rand(n, device=DEV, generator=torch.Generator(DEV).manual_seed(1)) < 0.2, -100)
        items = (y >= 0).sum()
        for frozen in (False, True):
            ref = reference(h, w, None, y, 0.1, cap, items, frozen=frozen)
            base = dict(section="real", shape=shape, softcap=cap, head="frozen" if frozen else "trainable", b=0.1)
            emit(dict(base, path="torch bf16 logits", **errors(
                reference(h, w, None, y, 0.1, cap, items, dtype=torch.bfloat16, frozen=frozen), ref)))
            for name, kw in (("auto", {}), ("low", dict(memory="low"))):
                emit(dict(base, path=name, **errors(run_op(h, w, None, y, 0.1, cap, items, frozen, **kw), ref)))
        del h, w, y
        torch.cuda.empty_cache()
    gemma2_patched(emit)


def gemma2_patched(emit):
    """A patched Gemma 2 (Gemma2-2B's width, vocabulary and soft-cap of 30; two layers, bf16, 4 x 1,024 tokens)
    against the stock model in fp32 and in bf16, all with the same weights: the smoothed loss and the tied
    embedding's gradient; the fused pass ran on the capped logits and no logits were returned."""
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_lsce.ops.fused_pass as fp
    from hf_lsce import apply_lsce_patch

    cfg = AutoConfig.for_model("gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                               num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                               final_logit_softcapping=30.0, attn_implementation="eager")
    g = torch.Generator(device=DEV).manual_seed(5)
    ids = torch.randint(0, cfg.vocab_size, (4, 1024), device=DEV, generator=g)
    labels = ids.masked_fill(torch.rand(ids.shape, device=DEV, generator=g) < 0.1, -100)
    items = (labels[:, 1:] != -100).sum()
    res, weights, caps, real = {}, None, [], fp.triton_fused_pass
    fp.triton_fused_pass = lambda *a, **k: caps.append(k.get("softcap")) or real(*a, **k)
    try:
        for name, dt in (("fp32", torch.float32), ("stock", torch.bfloat16), ("patched", torch.bfloat16)):
            torch.manual_seed(0)
            with torch.device(DEV):
                model = AutoModelForCausalLM.from_config(cfg, dtype=dt).train()
            weights = weights or {k: t.clone() for k, t in model.state_dict().items()}
            model.load_state_dict(weights)  # the fp32 model's (rounded to bf16)
            if name == "patched":
                apply_lsce_patch(model, label_smoothing=0.1)
                out = model(input_ids=ids, labels=labels, num_items_in_batch=items)
                loss = out.loss
            else:
                out = model(input_ids=ids)
                loss = F.cross_entropy(out.logits.float()[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                       label_smoothing=0.1, reduction="sum") / items
            loss.backward()
            res[name] = (float(loss), model.model.embed_tokens.weight.grad.float(), out.logits is None)
            del model, out, loss
            torch.cuda.empty_cache()
    finally:
        fp.triton_fused_pass = real
    (l32, g32, _), (ls, gs, _), (lp, gp, no_logits) = res["fp32"], res["stock"], res["patched"]
    emit(dict(section="real", check="patched Gemma 2 (soft-cap 30)", loss_err=abs(lp - l32) / l32,
              stock_bf16_loss_err=abs(ls - l32) / l32, embedding_grad_err=rel(gp, g32),
              stock_bf16_embedding_grad_err=rel(gs, g32), embedding_grad_vs_stock_bf16=rel(gp, gs),
              ok=caps == [30.0] and no_logits))


def eval_section(emit):
    g = torch.Generator(device=DEV).manual_seed(7)
    for n, d, v, cap, dt in ((4096, 2304, 256000, None, torch.bfloat16), (4096, 2304, 256000, 30.0, torch.bfloat16),
                             (4096, 2048, 128256, None, torch.float16), (4096, 2048, 128256, 30.0, torch.float16),
                             (4096, 1024, 128256, 50.0, torch.bfloat16), (4096, 1024, 128256, 30.0, torch.float32)):
        h = (torch.randn(n, d, device=DEV, generator=g) * 3).to(dt)
        w = (torch.randn(v, d, device=DEV, generator=g) / d ** 0.5).to(dt)
        y = torch.randint(0, v, (n,), device=DEV, generator=g)
        lse, am, ent, tok = [], [], [], []
        for s in range(0, n, 1024):
            z = h[s:s + 1024].float() @ w.float().T
            z = cap * torch.tanh(z / cap) if cap is not None else z
            logp = torch.log_softmax(z, -1)
            lse.append(torch.logsumexp(z, -1)), am.append(z.argmax(-1)), ent.append(-(logp.exp() * logp).sum(-1))
            tok.append(-0.9 * logp.gather(1, y[s:s + 1024, None])[:, 0] - 0.1 * logp.mean(-1))
        with torch.no_grad():
            loss, st = linear_cross_entropy(h, w, y, label_smoothing=0.1, softcap=cap, return_stats=True)
        emit(dict(section="eval", N=n, D=d, V=v, softcap=cap, dtype=str(dt)[6:],
                  loss_err=rel(loss.float(), torch.cat(tok).mean()), lse_err=rel(st.lse, torch.cat(lse)),
                  entropy_err=rel(st.entropy, torch.cat(ent)),
                  argmax_agree=float((st.argmax == torch.cat(am)).float().mean())))


def edge_section(emit):
    g = torch.Generator(device=DEV).manual_seed(11)
    for n, d, v in ((1, 64, 100), (7, 2304, 256000), (100, 40, 1000), (300, 4096, 32001), (129, 2048, 257)):
        h = (torch.randn(n, d, device=DEV, generator=g) * 2).bfloat16()
        w = (torch.randn(v, d, device=DEV, generator=g) / d ** 0.5).bfloat16()
        y = torch.randint(0, v, (n,), device=DEV, generator=g)
        ref = reference(h, w, None, y, 0.1, None, n)
        ev = float(linear_cross_entropy(h, w, y, label_smoothing=0.1, reduction="sum"))  # (no gradient wanted)
        emit(dict(section="edge", N=n, D=d, V=v, eval_loss_err=abs(ev / n - ref[0]) / abs(ref[0]),
                  **errors(run_op(h, w, None, y, 0.1, None, n, False), ref)))


def behaviour_section(emit):
    from hf_lsce.ops.config import free_cuda_memory

    g = torch.Generator(device=DEV).manual_seed(5)
    n, d, v = 1024, 640, 32768
    w = (torch.randn(v, d, device=DEV, generator=g) / d ** 0.5).bfloat16().requires_grad_()
    h = (torch.randn(n, d, device=DEV, generator=g) * 3).bfloat16().requires_grad_()
    y = torch.randint(0, v, (n,), device=DEV, generator=g)
    bad = y.clone()
    bad[5] = v + 3
    loss = linear_cross_entropy(h, w, bad, label_smoothing=0.1)
    loss.backward()
    nan_loss, zero_grad = bool(torch.isnan(loss)), float(h.grad.abs().max()) == 0 and float(w.grad.abs().max()) == 0
    torch.cuda.synchronize()
    raised = None
    try:
        linear_cross_entropy(h.detach(), w.detach(), y, label_smoothing=0.1)
    except ValueError as e:
        raised = str(e)[:160]
    after = bool(torch.isfinite(linear_cross_entropy(h.detach(), w.detach(), y, label_smoothing=0.1)))
    checks.raise_pending_errors()
    emit(dict(section="behaviour", check="bad target", nan_loss=nan_loss, zero_grad=zero_grad,
              next_call_raised=raised, call_after_is_finite=after))
    outs = [run_op(h.detach(), w.detach(), None, y, 0.1, 30.0, n, False)[1:3] for _ in range(4)]
    emit(dict(section="behaviour", check="repeated fwd+bwd bitwise identical (soft-capped)",
              ok=all(torch.equal(a, b) for o in outs[1:] for a, b in zip(o, outs[0]))))
    hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = linear_cross_entropy(hh, ww, y, label_smoothing=0.1)
    loss.backward(retain_graph=True)
    first = (hh.grad.clone(), ww.grad.clone())
    loss.backward()
    emit(dict(section="behaviour", check="second backward doubles the gradients",
              ok=bool(torch.equal(hh.grad, 2 * first[0]) and torch.equal(ww.grad, 2 * first[1]))))
    refused = False
    try:
        torch.autograd.grad(linear_cross_entropy(hh, w.detach(), y), hh, create_graph=True)
    except RuntimeError as e:
        refused = "double backward" in str(e)
    emit(dict(section="behaviour", check="double backward refused", ok=refused))
    del loss
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    expected = free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    emit(dict(section="behaviour", check="free_cuda_memory", ok=free_cuda_memory(h.device) == expected))


def compile_section(emit):
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_lsce.patching import ENGAGEMENT, apply_lsce_patch

    g = torch.Generator(device=DEV).manual_seed(2)
    n, d, v = 4096, 640, 65536
    w = (torch.randn(v, d, device=DEV, generator=g) / d ** 0.5).bfloat16()
    h = (torch.randn(n, d, device=DEV, generator=g) * 3).bfloat16()
    y = torch.randint(0, v, (n,), device=DEV, generator=g)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()

    def op(a, b, t):
        return linear_cross_entropy(a, b, t, label_smoothing=0.1)
    op(hh, ww, y).backward()
    eager = (hh.grad.clone(), ww.grad.clone())
    torch._dynamo.reset()
    compiled = torch.compile(op, fullgraph=True)

    def body():
        hh.grad = ww.grad = None
        compiled(hh, ww, y).backward()
    body()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        body()
        sync_free = True
    except RuntimeError as e:
        sync_free = str(e)[:160]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    emit(dict(section="compile", check="op compiled (fullgraph) vs eager", sync_free=sync_free,
              dh_err=rel(hh.grad, eager[0]), dw_err=rel(ww.grad, eager[1])))
    gh, gw = torch.zeros_like(h), torch.zeros_like(w)

    def captured():
        body()
        gh.copy_(hh.grad), gw.copy_(ww.grad)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        captured()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured()
    gh.zero_(), gw.zero_()
    graph.replay()
    emit(dict(section="compile", check="CUDA graph replay vs eager", dh_err=rel(gh, eager[0]), dw_err=rel(gw, eager[1])))
    del graph

    cfg = AutoConfig.for_model("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                               num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True)
    ids = torch.randint(0, 49152, (4, 512), device=DEV, generator=g)
    labels = ids.clone()
    labels[:, :128] = -100
    items = (labels[:, 1:] != -100).sum()
    models = []
    for _ in range(4):
        torch.manual_seed(0)
        with torch.device(DEV):
            models.append(AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).train())
    stock, stock_c, eager_m, comp_m = models

    def stock_loss(fwd):
        logits = fwd(input_ids=ids).logits.float()
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), label_smoothing=0.1,
                               reduction="sum") / items
    hf = stock_loss(stock)
    hf.backward()
    torch._dynamo.reset()
    stock_loss(torch.compile(stock_c)).backward()  # compiling the bf16 backbone alone moves the gradients this much
    baseline = max(rel(p.grad, q.grad) for p, q in zip(stock_c.parameters(), stock.parameters()))
    for m in (eager_m, comp_m):
        apply_lsce_patch(m, label_smoothing=0.1)
    eager_m(input_ids=ids, labels=labels, num_items_in_batch=items).loss.backward()
    torch._dynamo.reset()
    fwd = torch.compile(comp_m, fullgraph=True)
    before = ENGAGEMENT.fused_calls
    for _ in range(2):
        comp_m.zero_grad(set_to_none=True)
        out = fwd(input_ids=ids, labels=labels, num_items_in_batch=items)
        out.loss.backward()
    hf = float(hf)
    emit(dict(section="compile", check="patched model compiled whole", hf_loss=hf, compiled_loss=float(out.loss),
              loss_err=abs(float(out.loss) - hf) / hf, logits_returned=out.logits is not None,
              ok=ENGAGEMENT.fused_calls - before == 2 and out.logits is None, stock_compiled_vs_eager=baseline,
              grad_err_vs_eager=max(rel(p.grad, q.grad) for p, q in zip(comp_m.parameters(), eager_m.parameters()))))


def _views(h, w, bias, y, b):
    """Layouts users hand the op, each equal in value to the contiguous tensors: (name, h, w, bias, y, b)."""
    two = lambda t: torch.stack([t, t], -1)[..., 0]  # noqa: E731 - stride 2
    ht, wt = h.T.contiguous().T, w.T.contiguous().T
    return [("hidden transposed", ht, w, bias, y, b), ("weight column-major", h, wt, bias, y, b),
            ("hidden rows of a wider tensor", torch.cat([h, h], 1)[:, h.shape[1]:], w, bias, y, b),
            ("weight rows of a wider tensor", h, torch.cat([w, w], 1)[:, w.shape[1]:], bias, y, b),
            ("bias stride 2", h, w, two(bias), y, b), ("labels stride 2", h, w, bias, two(y), b),
            ("smoothing stride 2", h, w, bias, y, two(b)), ("all together", ht, wt, two(bias), two(y), two(b))]


def strides_section(emit):
    """Strided and transposed inputs in every layout of the budget, eager and compiled, against the same values made
    contiguous (TMA loads where rows are contiguous, pointer loads otherwise)."""
    torch.manual_seed(5)
    for n, d, v, dt in ((1500, 640, 32771, torch.bfloat16), (1024, 576, 32768, torch.bfloat16),
                        (900, 1536, 30000, torch.float16)):
        w, h = (torch.randn(v, d, device=DEV) / d ** 0.5).to(dt), (torch.randn(n, d, device=DEV) * 3).to(dt)
        bias, y = (torch.randn(v, device=DEV) * 0.1).to(dt), torch.randint(0, v, (n,), device=DEV)
        y[::7] = -100
        b, items = torch.rand(n, device=DEV) * 0.2, int((y >= 0).sum())
        base = dict(section="strides", N=n, D=d, V=v, dtype=str(dt)[6:])

        def same(row, got, want):
            err = errors(got, (float(want[0]),) + want[1:])
            emit(dict(row, ok=err["loss_err"] < 1e-6 and all(e is None or e < 1e-3 for e in err.values()), **err))
        for frozen in (False, True):
            for path, mem, plan in layouts(h, w, bias, None, frozen):
                real_plan = forced(plan)
                try:
                    dense = run_op(h, w, bias, y, b, None, items, frozen, memory=mem)
                    for name, *args in _views(h, w, bias, y, b):
                        same(dict(base, view=name, path=path, head="frozen" if frozen else "trainable"),
                             run_op(*args, None, items, frozen, memory=mem), dense)
                finally:
                    bud.plan_for = real_plan
        torch._dynamo.reset()  # (per shape: a second compiled function in one process failed to trace without it)
        _, ht, wt, bt, yt, st = _views(h, w, bias, y, b)[-1]
        same(dict(base, view="all together", path="torch.compile", head="trainable"),
             run_op(ht, wt, bt, yt, st, None, items, False, fn=torch.compile(linear_cross_entropy, fullgraph=True)),
             run_op(h, w, bias, y, b, None, items, False))


def budget_section(emit):
    """The measured peak of a training call (forward and backward) beyond its inputs and gradients, against its
    budget and its plan's byte count, from the smallest budget to unlimited (fp32, the torch computation: 1 GB, "low"
    and "auto")."""
    from real_inputs import fitted_params, realistic_batch

    for (shape, (n, d, v)), dt in [(x, dt) for x in (("gemma3-270m", (8192, 640, 262144)), ("llama3-8b",
                                   (8192, 4096, 128256))) for dt in (torch.bfloat16, torch.float32)]:
        h, w, y = realistic_batch(n, d, v, seed=4, device=DEV, dtype=dt, **fitted_params())
        for frozen in (False, True):
            s = bud.Shape(n, v, d, not frozen, False, half=False, soft=False)
            least, top = bud.smallest(s, "fused"), bud.best(s, None, "fused").nbytes
            budgets = [least * 3 ** k for k in range(40) if least * 3 ** k < top]
            for budget in (budgets + [top] if dt == torch.bfloat16 else [10 ** 9]) + ["low", "auto"]:
                plans, real = [], bud.plan_for
                bud.plan_for = lambda *a, **k: plans.append(real(*a, **k)) or plans[-1]
                hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_(not frozen)
                try:
                    linear_cross_entropy(hh, ww, y, label_smoothing=0.1, memory=budget).backward()  # (warm)
                    hh.grad = ww.grad = None
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    linear_cross_entropy(hh, ww, y, label_smoothing=0.1, memory=budget).backward()
                    torch.cuda.synchronize()
                finally:
                    bud.plan_for = real
                grads = sum(t.grad.numel() * t.grad.element_size() for t in (hh, ww) if t.grad is not None)
                extra = torch.cuda.max_memory_allocated() - base - grads
                plan = plans[-1]
                limit = budget if isinstance(budget, int) else plan.nbytes
                emit(dict(section="budget", shape=shape, dtype=str(dt)[6:], head="frozen" if frozen else "trainable",
                          budget=budget, plan=bud.describe_plan(plan), plan_bytes=plan.nbytes, measured_extra=extra,
                          ok=extra <= limit + bud.SLACK_BYTES))
                del hh, ww
        del h, w, y
        torch.cuda.empty_cache()


SECTIONS = dict(paths=paths_section, strides=strides_section, real=real_section, eval=eval_section,
                edge=edge_section, behaviour=behaviour_section, compile=compile_section, budget=budget_section)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", "--out-dir", dest="out_dir", default="gpu_out", help="folder for the JSON")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("check_gpu.py needs a CUDA GPU; the CPU tests run the kernels in Triton's interpreter")
    rows = []

    def emit(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
    for name in args.sections.split(","):
        try:
            SECTIONS[name](emit)
        except Exception as e:  # noqa: BLE001 - a section that breaks is a failed row; the others still run
            emit(dict(section=name, check="section ran", ok=False, error=f"{type(e).__name__}: {str(e)[:300]}"))
        torch.cuda.empty_cache()
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "check_gpu.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       rows=rows), f, indent=1)
    fmt = lambda x: "-" if x is None else (f"{x:.1e}" if isinstance(x, float) else str(x))  # noqa: E731
    print("\n| section | case | path | loss err | dh err | dW err | db err | sync-free |\n|---|---|---|---|---|---|---|---|")
    for r in (x for x in rows if "dh_err" in x):
        case = " ".join(str(r[k]) for k in ("shape", "N", "D", "V", "dtype", "head", "view") if k in r)
        case += (" cap" if r.get("softcap") else "") + (f" z-loss {r['z_loss']:g}" if r.get("z_loss") else "")
        print(f"| {r['section']} | {case} | {r.get('path', '-')} | {fmt(r.get('loss_err'))} | {fmt(r.get('dh_err'))} | "
              f"{fmt(r.get('dw_err'))} | {fmt(r.get('db_err'))} | {r.get('sync_free', '-')} |")
    bad = [r for r in rows if r.get("ok") is False or r.get("sync_free") not in (None, True)]
    print(f"\n{len(bad)} failed behaviour / synchronisation checks" + (": " + json.dumps(bad)[:800] if bad else ""))


if __name__ == "__main__":
    main()
