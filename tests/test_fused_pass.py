"""The fused computation (``fused_pass``) in each layout a memory budget gives it (``budget.Plan``: R for every row or
chunks of rows; R kept for some columns and the rest recomputed as G; a frozen head by column chunks), under Triton's
interpreter, against fp64 torch on materialised logits and against torch's own bf16 / fp16 path.

The interpreter rounds fp32 to bf16 by truncation (the GPU rounds to nearest), so bf16 tolerances here are about
twice what the GPU gives (benchmarks/check_gpu.py measures those)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import hf_lsce.ops.config as config
import hf_lsce.ops.fused_pass as fp
import hf_lsce.ops.budget as bud
from hf_lsce import linear_cross_entropy
from hf_lsce.ops.budget import Plan

N, D, V = 37, 48, 203  # ragged on purpose (R's rows padded to 208)

# One plan per layout at this shape (the interpreter's blocks: 16 rows, 32 columns)
LAYOUTS = {
    "every row": Plan("fused", "rows", rows=N),
    "row chunks": Plan("fused", "rows", rows=16),
    "columns kept": Plan("fused", "columns", keep=96, cols=64),
    "columns": Plan("fused", "columns", keep=0, cols=64),
    "frozen columns": Plan("fused", "frozen", cols=64),
}
TRAINABLE = ["every row", "row chunks", "columns kept", "columns"]


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.fixture(params=[True, False], ids=["tma", "pointers"])
def tma(monkeypatch, request):
    """The fused kernel with TMA loads (what an H100 runs) and with pointer loads (what GPUs without TMA run, and an
    H100 under HF_LSCE_TMA=0), small tiles and three vocabulary splits, on the interpreter."""
    if request.param and (not config._has_tensor_descriptors()
                          or config._release(config.triton_version()) in ((3, 4), (3, 5))):
        pytest.skip("Triton < 3.4 has no tensor descriptors (the op takes pointer loads there); 3.4 and 3.5's "
                    "interpreters check their strides in elements, not bytes")
    real = config.fused_config
    small = lambda dt, dev: dataclasses.replace(real(dt, dev), tma=request.param, min_splits=3, min_programs=1)  # noqa
    monkeypatch.setattr(config, "fused_config", small)
    return request.param


@pytest.fixture
def layout(monkeypatch):
    """``layout(name)``: every call of the op takes that plan (``budget.plan_for`` replaced); returns a record of the
    fused pass's parts that ran."""
    ran = []
    for name in ("_r_pass", "fused_gradients", "triton_fused_columns"):
        real = getattr(fp, name)
        monkeypatch.setattr(fp, name, lambda *a, _n=name, _f=real, **k: ran.append(_n) or _f(*a, **k))

    def force(name):
        monkeypatch.setattr(bud, "plan_for", lambda *a, **k: LAYOUTS[name])
        return ran
    return force


# the parts of the fused pass each layout runs (a frozen head's statistics too go through triton_fused_columns)
PARTS = {"every row": {"_r_pass"}, "row chunks": {"_r_pass"}, "columns kept": {"_r_pass", "fused_gradients"},
         "columns": {"triton_fused_columns", "fused_gradients"}, "frozen columns": {"triton_fused_columns"}}


def inputs(seed=0, bias=False, spike=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, D, generator=g, dtype=torch.float64) / D ** 0.5
    y = torch.randint(0, V, (N,), generator=g)
    h = torch.randn(N, D, generator=g, dtype=torch.float64) * 2.0
    h = h * 0.5 + 6.0 * w[y] / w[y].norm(dim=-1, keepdim=True)  # a peaked softmax, as a trained LM's
    y[torch.rand(N, generator=g) < 0.2] = -100
    if spike:  # rows whose max logit sits ~160 nats above their mean logit: exp(z - c) would overflow even fp32
        h[:5] = 160.0 * w[7] / w[7].norm() ** 2
    b = torch.randn(V, generator=g, dtype=torch.float64) * 0.5 if bias else None
    return h, w, y, b


def reference(h, w, y, b, smoothing, num_items, weights=None, softcap=None, z_loss=0.0, dtype=torch.float64,
              frozen=False):
    """(loss, dh, dW, db, lse) through materialised logits in ``dtype`` (fp64: the truth; bf16 / fp16: torch's own
    half-precision path, as Hugging Face computes it), the loss in fp64."""
    hh, ww = h.to(dtype).requires_grad_(), w.to(dtype).requires_grad_(not frozen)
    bb = b.to(dtype).requires_grad_(not frozen) if b is not None else None
    z = (hh @ ww.T + (bb if bb is not None else 0)).double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    lse = torch.logsumexp(z, -1)
    logp = z - lse[:, None]
    sm = smoothing.double() if torch.is_tensor(smoothing) else torch.full((N,), float(smoothing), dtype=torch.float64)
    tok = -(1 - sm) * logp.gather(1, y.clamp(min=0)[:, None])[:, 0] - sm * logp.mean(-1) + z_loss * lse * lse
    tok = torch.where(y != -100, tok, 0.0)
    out = tok if weights is not None else tok.sum() / num_items
    (out * weights).sum().backward() if weights is not None else out.backward()
    return out.detach(), hh.grad, ww.grad, bb.grad if bb is not None else None, lse.detach()


def run(h, w, y, b, smoothing, reduction="sum", num_items=29, weights=None, stats=False, softcap=None,
        dtype=torch.bfloat16, frozen=False, z_loss=0.0):
    hh, ww = h.to(dtype).requires_grad_(), w.to(dtype).requires_grad_(not frozen)
    bb = b.to(dtype).requires_grad_(not frozen) if b is not None else None
    out = linear_cross_entropy(hh, ww, y, bias=bb, label_smoothing=smoothing, reduction=reduction,
                               num_items_in_batch=num_items, backend="triton", return_stats=stats, softcap=softcap,
                               z_loss=z_loss)
    loss = out[0] if stats else out
    (loss * weights).sum().backward() if weights is not None else loss.backward()
    return (loss.detach(), hh.grad, ww.grad, bb.grad if b is not None else None) + ((out[1],) if stats else ())


def half(t):
    return t.bfloat16().double() if t is not None else None


@pytest.mark.parametrize("name", TRAINABLE)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduction", ["sum", "none"])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_layouts_match_fp64_and_torch_bf16(tma, layout, name, bias, reduction, softcap):
    """Loss, dh, dW and db of each trainable layout against fp64 (per-token b, ignored rows, num_items_in_batch, bias,
    a per-token upstream gradient, soft-cap) and no worse than torch's own bf16 logits on the same inputs; the parts of
    the fused pass the layout names ran (a soft-cap keeps no columns: ``columns kept`` runs as ``columns``). A cap of 5
    puts most of the peaked rows' largest logits where the cap bends them (tanh' < 0.5)."""
    ran = layout(name)
    h, w, y, b = inputs(seed=1, bias=bias)
    sm = torch.rand(N, generator=torch.Generator().manual_seed(3)) * 0.3
    weights = torch.rand(N, generator=torch.Generator().manual_seed(4)) if reduction == "none" else None
    items = 29 if reduction == "sum" else None
    got = run(h, w, y, b, sm, reduction, items, weights, softcap=softcap)
    parts = PARTS["columns" if name == "columns kept" and softcap else name]
    assert set(ran) == parts, ran
    ref = reference(half(h), half(w), y, half(b), sm, 29.0, weights.double() if weights is not None else None,
                    softcap=softcap)
    own = reference(h, w, y, b, sm, 29.0, weights.double() if weights is not None else None, softcap=softcap,
                    dtype=torch.bfloat16)
    assert rel(got[0], ref[0]) < 1e-5
    for i in (1, 2, 3):
        if ref[i] is not None:
            assert rel(got[i], ref[i]) < 2e-2
            assert rel(got[i], ref[i]) < 2 * rel(own[i], ref[i]) + 1e-3


@pytest.mark.parametrize("name", TRAINABLE)
def test_dw_carries_the_whole_smoothing_term(tma, layout, name):
    """With b = 1 on every token the smoothing's uniform term is the whole of each row's -1/V: every layout carries it
    (R's rows of ones against hs's hi and lo rows where R is kept, G itself where recomputed; a wrong sign or a
    missing row would be an error of order 1)."""
    layout(name)
    h, w, y, _ = inputs(seed=6)
    sm = torch.ones(N)
    got = run(h, w, y, None, sm)
    ref = reference(half(h), half(w), y, None, sm, 29.0)
    assert rel(got[2], ref[2]) < 2e-2 and rel(got[1], ref[1]) < 2e-2


@pytest.mark.parametrize("name", ["every row", "row chunks", "columns kept"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1, "zeros tensor"])
def test_rank_one_term_skipped_only_for_a_float_zero(tma, layout, monkeypatch, name, smoothing):
    """A float b = 0 has no uniform term: dW's rank-one rows are neither computed nor multiplied, and loss, dh, dW and
    db still equal fp64's; a float b > 0, or a tensor b (its values unknown to the host), keeps the term. Mutation
    check: the term skipped for b = 0.1 fails here (dW and db)."""
    layout(name)
    h, w, y, b = inputs(seed=15, bias=True)
    rank_one = []
    real = fp._rank_one_rows
    monkeypatch.setattr(fp, "_rank_one_rows", lambda *a, **k: rank_one.append(1) or real(*a, **k))
    sm = torch.zeros(N) if smoothing == "zeros tensor" else smoothing
    got = run(h, w, y, b, sm)
    ref = reference(half(h), half(w), y, half(b), 0.0 if smoothing == "zeros tensor" else smoothing, 29.0)
    assert bool(rank_one) == (smoothing != 0.0)
    assert rel(got[0], ref[0]) < 1e-5
    for i in (1, 2, 3):
        assert rel(got[i], ref[i]) < 2e-2


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_returned_lse_and_stats_are_copies_of_the_saved_lse(tma, reduction):
    """The autograd function returns the lse it saves for backward; what the caller hands out (``stats.lse``,
    ``return_lse``) is a copy, so changing it in place neither raises in backward nor changes the gradients (the
    kept gradients of a reduced loss, and the recomputing backward of weighted per-token losses, which reads the
    saved lse). Mutation check: handing out the saved lse fails both."""
    h, w, y, _ = inputs(seed=16)
    weights = torch.rand(N, generator=torch.Generator().manual_seed(17))
    grads = []
    for touch in (False, True):
        hh, ww = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
        loss, stats, lse = linear_cross_entropy(hh, ww, y, label_smoothing=0.1, backend="triton", return_stats=True,
                                                return_lse=True, reduction=reduction)
        if touch:
            stats.lse.add_(3.0)
            lse.add_(5.0)
        (loss * weights).sum().backward() if reduction == "none" else loss.backward()
        grads.append((hh.grad, ww.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("z_loss", [1e-2, 0.3])
def test_layouts_with_z_loss(tma, layout, name, z_loss, softcap):
    """The z-loss lam lse^2 in every layout (R's factor k = 1 + 2 lam lse per row and the target entry over k; G's
    factor of p): loss, dh, dW and db against fp64, with a bias, soft-capped or not (a frozen head for the frozen
    layout). lam = 0.3 with logits shifted by -9 (uncapped) puts rows' k on both sides of 0."""
    if name == "frozen columns" and softcap:
        pytest.skip("a soft-capped frozen head goes by rows (the planner's frozen layout is not soft-capped)")
    layout(name)
    h, w, y, b = inputs(seed=8, bias=True)
    b = b - 9.0
    frozen = name == "frozen columns"
    got = run(h, w, y, b, 0.1, softcap=softcap, z_loss=z_loss, frozen=frozen)
    ref = reference(half(h), half(w), y, half(b), 0.1, 29.0, softcap=softcap, z_loss=z_loss, frozen=frozen)
    assert rel(got[0], ref[0]) < 1e-5
    assert rel(got[1], ref[1]) < 2e-2
    assert frozen or (rel(got[2], ref[2]) < 2e-2 and rel(got[3], ref[3]) < 2e-2)


@pytest.mark.parametrize("name", ["every row", "row chunks", "columns", "frozen columns"])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_frozen_head_in_each_layout(tma, layout, name, softcap):
    """A frozen head (LoRA: no dW): dh against fp64 in each layout that serves it, soft-capped too where the layout
    takes a cap; the parts that ran are the layout's."""
    if name == "frozen columns" and softcap:
        pytest.skip("the frozen layout is not soft-capped (the planner gives rows or columns there)")
    ran = layout(name)
    h, w, y, _ = inputs(seed=7)
    sm = torch.full((N,), 0.1)
    got = run(h, w, y, None, sm, softcap=softcap, frozen=True)
    assert set(ran) == PARTS[name], ran
    ref = reference(half(h), half(w), y, None, sm, 29.0, softcap=softcap, frozen=True)
    assert got[2] is None
    assert rel(got[0], ref[0]) < 1e-5 and rel(got[1], ref[1]) < 2e-2


@pytest.mark.parametrize("name", ["every row", "row chunks", "columns", "frozen columns"])
@pytest.mark.parametrize("case", ["plain", "bias+z_loss", "spike+stats", "soft-cap"])
def test_fp16_layouts_match_fp64(tma, layout, name, case):
    """fp16 in each layout (rows: R relative to each row's running max, normalised into p once the row's lse is known,
    ``fused_pass.online``; columns: nothing kept, G from the weights divided by gamma; frozen columns: fp32 sums):
    loss, lse, dh, dW, db against fp64 on the fp16 inputs, no worse than torch's fp16 logits, with rows whose max sits
    160 nats above their mean logit, a bias and a z-loss, per-token b and ignored rows. A soft-cap in fp16 goes by
    columns alone (fp16's R cannot give the cap's slope back)."""
    if case == "soft-cap" and name != "columns":
        pytest.skip("fp16 with a soft-cap: the columns layout only (budget.fused_plans)")
    layout(name)
    frozen = name == "frozen columns"  # (fp16 runs it as the columns layout: R relative to fixed offsets overflows)
    h, w, y, b = inputs(seed=1, bias=case == "bias+z_loss", spike=case == "spike+stats")
    sm = torch.rand(N, generator=torch.Generator().manual_seed(3)) * 0.3
    zl = 1e-2 if case == "bias+z_loss" else 0.0
    cap = 5.0 if case == "soft-cap" else None
    got = run(h, w, y, b, sm, stats=case == "spike+stats", dtype=torch.float16, frozen=frozen, z_loss=zl, softcap=cap)
    h16, w16 = h.half().double(), w.half().double()
    b16 = b.half().double() if b is not None else None
    ref = reference(h16, w16, y, b16, sm, 29.0, z_loss=zl, softcap=cap, frozen=frozen)
    own = reference(h, w, y, b, sm, 29.0, z_loss=zl, softcap=cap, dtype=torch.float16, frozen=frozen)
    assert rel(got[0], ref[0]) < 1e-5
    for i in (1, 2, 3):
        if ref[i] is not None:
            err = rel(got[i], ref[i])
            assert err < 2e-3, (i, err)
            assert err <= rel(own[i], ref[i]) * 1.1 + 1e-4, (i, err, rel(own[i], ref[i]))
    if case == "spike+stats":
        assert rel(got[4].lse, ref[4]) < 1e-6


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_rows_past_the_exponent_range_are_redone(tma, layout, name):
    """Rows whose max logit sits far above their mean logit (R = exp(z - c) would overflow bf16) are flagged and
    redone with c = their max, in every layout (by columns: some rows peak in a later chunk than the first, and what
    they accumulated before is rescaled): loss, lse and gradients stay exact."""
    layout(name)
    h, w, y, _ = inputs(seed=2, spike=True)
    h[5:8] = 160.0 * w[150] / w[150].norm() ** 2  # (rows 0-4 peak at column 7, rows 5-7 at column 150)
    z = h.bfloat16().double() @ w.bfloat16().double().T
    assert float((z.max(1).values - z.mean(1))[:8].min()) > 89 + fp.C_SHIFT  # exp(max - c) past fp32's range
    frozen = name == "frozen columns"
    got = run(h, w, y, None, 0.1, stats=True, frozen=frozen)
    ref = reference(half(h), half(w), y, None, 0.1, 29.0, frozen=frozen)
    assert torch.isfinite(got[0])
    assert rel(got[0], ref[0]) < 1e-5
    assert rel(got[4].lse, ref[4]) < 1e-6
    assert torch.equal(got[4].argmax, z.argmax(-1))
    assert rel(got[1], ref[1]) < 2e-2 and (frozen or rel(got[2], ref[2]) < 2e-2)


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_training_statistics_match_fp64(tma, layout, name, softcap):
    """The statistics a training call returns with its gradients (lse, argmax, entropy, nll: TRL's token accuracy and
    entropy) are those of fp64 on the materialised logits, soft-capped too, and those the same kernel gives without
    storing R (evaluation)."""
    if name == "frozen columns" and softcap:
        pytest.skip("the frozen layout is not soft-capped")
    layout(name)
    h, w, y, _ = inputs(seed=5)
    stats = run(h, w, y, None, 0.1, "sum", None, stats=True, softcap=softcap, frozen=name == "frozen columns")[4]
    hh, ww = h.bfloat16(), w.bfloat16()
    z = hh.double() @ ww.double().T
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    logp = torch.log_softmax(z, -1)
    valid = y != -100
    assert torch.equal(stats.argmax, z.argmax(-1))
    assert rel(stats.lse, torch.logsumexp(z, -1)) < 1e-6
    assert rel(stats.entropy, -(logp.exp() * logp).sum(-1)) < 1e-5
    assert rel(stats.nll[valid], -logp.gather(1, y.clamp(min=0)[:, None])[:, 0][valid]) < 1e-5
    with torch.no_grad():
        plain = linear_cross_entropy(hh, ww, y, label_smoothing=0.1, reduction="sum", backend="triton",
                                     return_stats=True, softcap=softcap)[1]
    assert torch.equal(stats.argmax, plain.argmax)
    for a, b in ((stats.lse, plain.lse), (stats.entropy, plain.entropy), (stats.nll, plain.nll)):
        assert rel(a, b) < 1e-5


# Layouts users hand the op (checkpoint converters, tied or resized embeddings, slices of larger tensors, user code):
# each a view whose values equal the contiguous tensor's (``expanded``: rows that share memory, stride 0)
def _views(h, w, b, y, sm):
    def every_second(t):
        return torch.stack([t, t], -1)[..., 0]
    return {
        "hidden transposed": dict(h=h.T.contiguous().T),
        "hidden rows of a wider tensor": dict(h=torch.cat([h, h], 1)[:, D:]),
        "weight column-major": dict(w=w.T.contiguous().T),
        "weight rows of a wider tensor": dict(w=torch.cat([w, w], 1)[:, D:]),
        "bias stride 2": dict(b=every_second(b)),
        "labels stride 2": dict(y=every_second(y)),
        "smoothing stride 2": dict(sm=every_second(sm)),
        "all together": dict(h=h.T.contiguous().T, w=w.T.contiguous().T, b=every_second(b), y=every_second(y),
                             sm=every_second(sm)),
        "hidden rows expanded": dict(h=h[:1].expand(N, D)),
        "weight rows expanded": dict(w=w[:1].expand(V, D)),
    }


def _equal_on_strided_views(h, w, b, y, sm, frozen, cases):
    """Each case's views against the same values made contiguous: loss, dh, dW, db (None where frozen)."""
    def go(h, w, b, y, sm):
        hh = h.detach().requires_grad_()
        ww, bb = (t.detach().requires_grad_(not frozen) for t in (w, b))
        loss = linear_cross_entropy(hh, ww, y, bias=bb, label_smoothing=sm, reduction="sum", num_items_in_batch=29,
                                    backend="triton")
        loss.backward()
        return [loss.detach(), hh.grad, ww.grad, bb.grad]

    base = dict(h=h, w=w, b=b, y=y, sm=sm)
    want = go(**base)
    assert rel(want[0], reference(h.double(), w.double(), y, b.double(), sm, 29.0, frozen=frozen)[0]) < 1e-5
    for case in cases:
        views = _views(**base)[case]
        given = {**base, **views}
        strided = [k for k, t in given.items() if not t.is_contiguous()]
        assert strided == list(views), (case, strided)  # (each case hands the op what it names)
        dense = want if "expanded" not in case else go(**{k: t.contiguous() for k, t in given.items()})
        got = go(**given)
        for i, (g, r) in enumerate(zip(got, dense)):
            assert (g is None) == (r is None), (case, i)
            if g is not None:
                assert rel(g, r) < (1e-6 if i == 0 else 1e-3), (case, i, rel(g, r))


def _strided_inputs(seed, dtype):
    h, w, y, b = inputs(seed=seed, bias=True)
    sm = torch.rand(N, generator=torch.Generator().manual_seed(seed + 1)) * 0.3
    return h.to(dtype), w.to(dtype), b.to(dtype), y, sm


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_strided_inputs_equal_contiguous(layout, name, dtype):
    """Every layout of the budget (trainable and frozen head, bf16 and fp16) takes hidden and weight transposed, bias,
    labels and per-token smoothing of stride 2, all at once, and rows sharing memory (stride 0), and gives the loss,
    dh, dW and db of the same values made contiguous. Mutation check: the kernels' inner strides dropped (1.0's
    behaviour) fail here, the loss off by 0.1-0.7."""
    ran = layout(name)
    _equal_on_strided_views(*_strided_inputs(21, dtype), name == "frozen columns",
                            ["all together", "hidden rows expanded", "weight rows expanded"])
    # (fp16 keeps no R by columns, and runs a frozen head by columns too: R relative to fixed offsets overflows)
    by_columns = dtype == torch.float16 and name in ("columns kept", "frozen columns")
    assert set(ran) == PARTS["columns" if by_columns else name], ran


def test_each_strided_input_alone(tma):
    """Each view alone (R for every row, bf16), with TMA loads where the layout allows them (rows of a wider tensor)
    and pointer loads otherwise, so a failure names the argument whose stride a kernel ignored."""
    _equal_on_strided_views(*_strided_inputs(25, torch.bfloat16), False,
                            [c for c in _views(*_strided_inputs(25, torch.bfloat16)) if c != "all together"])


def test_strided_inputs_under_torch_compile():
    """The compiled operator receives the strided views as they are (bf16, trainable head with a bias, every view
    together): torch.compile's loss and gradients equal eager's on the contiguous values."""
    h, w, y, b = inputs(seed=23, bias=True)
    sm = torch.rand(N, generator=torch.Generator().manual_seed(24)) * 0.3
    h, w, b = (t.bfloat16() for t in (h, w, b))

    def loss_fn(hh, ww, bb, yy, ss):
        return linear_cross_entropy(hh, ww, yy, bias=bb, label_smoothing=ss, reduction="sum", num_items_in_batch=29,
                                    backend="triton")
    views = _views(h, w, b, y, sm)["all together"]
    results = []
    strided = tuple(views[k] for k in ("h", "w", "b", "y", "sm"))
    for fn, args in ((loss_fn, (h, w, b, y, sm)), (None, strided)):
        if fn is None:
            torch._dynamo.reset()
            fn = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
        hh, ww, bb = (t.detach().requires_grad_() for t in args[:3])
        loss = fn(hh, ww, bb, *args[3:])
        loss.backward()
        results.append((loss.detach(), hh.grad, ww.grad, bb.grad))
    for got, want in zip(results[1], results[0]):
        assert rel(got, want) < 1e-6


def test_fused_computation_only_where_it_applies(tma):
    """bf16 and fp16, without a soft-cap or with one up to SOFTCAP_MAX: the fused computation; fp32, fp64 and larger
    caps: the torch computation (``budget.computation``)."""
    h = torch.zeros(4, D, dtype=torch.bfloat16, requires_grad=True)
    w = torch.zeros(V, D, dtype=torch.bfloat16)
    assert bud.computation(h, w, None, "triton") == "fused"
    assert bud.computation(h, w, 30.0, "triton") == "fused"  # Gemma 2's cap
    assert bud.computation(h, w, fp.SOFTCAP_MAX * 1.25, "triton") == "torch"
    assert bud.computation(h.half(), w.half(), 30.0, "triton") == "fused"
    assert bud.computation(h.float(), w.float(), None, "triton") == "torch"
    assert bud.computation(h.double(), w.double(), None, "triton") == "torch"
    assert bud.computation(h, w, None, "torch") == "torch"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_no_fused_computation_without_tensor_core_dots(monkeypatch, dtype):
    """A GPU whose Triton dots are not tensor-core MMA (Turing, Volta: config.mma_dot False) takes the torch
    computation (cuBLAS's tensor cores), in bf16 or fp16."""
    real = config.fused_config
    monkeypatch.setattr(config, "fused_config", lambda dt, dev: dataclasses.replace(real(dt, dev), mma_dot=False))
    h = torch.zeros(4, D, dtype=dtype, requires_grad=True)
    w = torch.zeros(V, D, dtype=dtype)
    assert bud.computation(h, w, None, "triton") == "torch"
    monkeypatch.setattr(config, "fused_config", real)
    assert bud.computation(h, w, None, "triton") == "fused"


@pytest.mark.parametrize("name", ["every row", "columns kept"])
def test_soft_capped_fused_pass_compiles(tma, layout, monkeypatch, name):
    """A soft-capped loss inside torch.compile(fullgraph=True): the compiled operator runs the same fused pass (with
    the cap) and gives eager's loss and gradients exactly, trainable head with a bias."""
    layout(name)
    h, w, y, b = inputs(seed=13, bias=True)
    caps = []
    real = fp.triton_fused_pass
    monkeypatch.setattr(fp, "triton_fused_pass", lambda *a, **k: caps.append(k.get("softcap")) or real(*a, **k))

    def loss_fn(hh, ww, bb):
        return linear_cross_entropy(hh, ww, y, bias=bb, label_smoothing=0.1, softcap=5.0, reduction="sum",
                                    num_items_in_batch=29, backend="triton")
    results = []
    for fn in (loss_fn, None):
        if fn is None:
            torch._dynamo.reset()
            fn = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
        hh, ww, bb = (t.bfloat16().requires_grad_() for t in (h, w, b))
        loss = fn(hh, ww, bb)
        loss.backward()
        results.append((loss.detach(), hh.grad, ww.grad, bb.grad))
    assert caps == [5.0, 5.0], caps
    for got, want in zip(results[1], results[0]):
        assert torch.equal(got, want)
    ref = reference(half(h), half(w), y, half(b), 0.1, 29.0, softcap=5.0)
    assert rel(results[1][0], ref[0]) < 1e-5 and rel(results[1][1], ref[1]) < 2e-2


@pytest.mark.parametrize("name", TRAINABLE)
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_second_backward_doubles_the_gradients(tma, layout, monkeypatch, name, softcap):
    """A second backward through the same graph (retain_graph) recomputes the gradients the same way: the accumulated
    gradients are exactly twice the first's (trainable head with a bias, soft-capped or not)."""
    layout(name)
    calls = []
    real = fp.triton_fused_pass
    monkeypatch.setattr(fp, "triton_fused_pass", lambda *a, **k: calls.append(1) or real(*a, **k))
    h, w, y, b = inputs(seed=14, bias=True)
    hh, ww, bb = (t.bfloat16().requires_grad_() for t in (h, w, b))
    loss = linear_cross_entropy(hh, ww, y, bias=bb, label_smoothing=0.1, softcap=softcap, backend="triton")
    loss.backward(retain_graph=True)
    first = [t.grad.clone() for t in (hh, ww, bb)]
    loss.backward()
    assert len(calls) == 2  # the forward's pass, and the second backward's
    for t, g in zip((hh, ww, bb), first):
        assert torch.equal(t.grad, 2 * g)


def test_tma_switch_values(monkeypatch):
    """HF_LSCE_TMA takes 0 or 1 (or nothing); anything else is refused at import, naming the variable. Each value
    imports the config module's file afresh as a module of its own (the package's loaded one stays as it is)."""
    import importlib.util
    import sys

    import hf_lsce.ops.config as loaded

    for value, ok in (("0", True), ("1", True), ("", True), ("yes", False), ("2", False)):
        monkeypatch.setenv("HF_LSCE_TMA", value)
        spec = importlib.util.spec_from_file_location("hf_lsce_config_probe", loaded.__file__)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, module)  # (its dataclasses look their module up there)
        if ok:
            spec.loader.exec_module(module)
            assert module.TMA_SWITCH == value
        else:
            with pytest.raises(ValueError, match=f"HF_LSCE_TMA must be 0 .*got {value!r}"):
                spec.loader.exec_module(module)


def test_gpu_older_than_triton_supports_takes_the_torch_path_with_one_warning(monkeypatch):
    """A CUDA device below compute capability 7.0 (Pascal): backend="auto" resolves to the chunked torch path and says
    so once, instead of a compile error inside Triton."""
    import importlib
    import warnings

    lce = importlib.import_module("hf_lsce.ops.linear_cross_entropy")  # the module (the package exports the function)

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (6, 1))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla P100")
    lce._triton_runs_on.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert lce._resolve_backend("auto", torch.device("cuda", 0)) == "torch"
            assert lce._resolve_backend("auto", torch.device("cuda", 0)) == "torch"
        assert len([w for w in caught if "compute capability 6.1" in str(w.message)]) == 1
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
        lce._triton_runs_on.cache_clear()
        assert lce._resolve_backend("auto", torch.device("cuda", 0)) == "triton"
    finally:
        lce._triton_runs_on.cache_clear()
