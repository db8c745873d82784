"""linear_cross_entropy against fp64 F.cross_entropy on materialised logits (an independent oracle).

Triton kernels run under TRITON_INTERPRET=1 at small ragged sizes; the torch backend at larger ones.
"""
import pytest
import torch
import torch.nn.functional as F

from hf_lsce import linear_cross_entropy
from hf_lsce.ops.config import _has_tensor_descriptors, _release, grad_logits_config, triton_version
from hf_lsce.ops.reference import torch_forward

N, D, V = 37, 48, 203  # ragged on purpose


# The tests that force the TMA kernels: Triton before 3.4 has no host tensor descriptors, and the op takes pointer loads
# there; the interpreters of Triton 3.4 and 3.5 check a descriptor's row stride in elements, not bytes (a row of 24
# bf16 values is refused), which 3.6 fixed (tools/triton_matrix.py runs these tests on each torch's Triton)
needs_descriptors = pytest.mark.skipif(
    not _has_tensor_descriptors() or _release(triton_version()) in ((3, 4), (3, 5)),
    reason="Triton < 3.4 has no tensor descriptors; 3.4 and 3.5's interpreters check their strides in elements")


def make_inputs(n=N, d=D, v=V, *, peaked=False, ignore_frac=0.2, bias=False, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, d, generator=g, dtype=torch.float64) / d ** 0.5
    y = torch.randint(0, v, (n,), generator=g)
    h = torch.randn(n, d, generator=g, dtype=torch.float64) * scale
    if peaked:  # push each hidden state toward its target row: a trained-LM-like peaked softmax
        h = h * 0.3 + 12.0 * w[y] / w[y].norm(dim=-1, keepdim=True)
    ign = torch.rand(n, generator=g) < ignore_frac
    y = y.masked_fill(ign, -100)
    b = torch.randn(v, generator=g, dtype=torch.float64) * 0.5 if bias else None
    return h, w, y, b


def reference(h, w, y, b=None, *, smoothing=0.0, softcap=None, reduction="mean", num_items=None,
              dtype=torch.float64):
    """Loss and gradients through materialised logits and torch's own cross-entropy (fp64 default)."""
    h = h.detach().to(dtype).requires_grad_()
    w = w.detach().to(dtype).requires_grad_()
    bb = b.detach().to(dtype).requires_grad_() if b is not None else None
    z = h @ w.T + (bb if bb is not None else 0)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if torch.is_tensor(smoothing):  # per-token: build it from the definition
        logp = torch.log_softmax(z, -1)
        valid = y != -100
        nll = -logp.gather(1, y.clamp(min=0)[:, None])[:, 0]
        smooth = -logp.mean(-1)
        sm = smoothing.to(dtype)
        tok = torch.where(valid, (1 - sm) * nll + sm * smooth, 0.0)
        loss = {"none": tok, "sum": tok.sum(), "mean": tok.sum() / valid.sum()}[reduction]
    else:
        red = "sum" if num_items is not None else reduction
        loss = F.cross_entropy(z, y, label_smoothing=smoothing, reduction=red)
        if num_items is not None:
            loss = loss / num_items
    out = loss.sum() if loss.dim() else loss
    out.backward()
    return loss.detach(), h.grad, w.grad, (bb.grad if bb is not None else None)


def rel(a, b):
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm().clamp_min(1e-30))


def run(h, w, y, b=None, dtype=torch.float32, backend="triton", **kw):
    hh = h.to(dtype).requires_grad_()
    ww = w.to(dtype).requires_grad_()
    bb = b.to(dtype).requires_grad_() if b is not None else None
    loss = linear_cross_entropy(hh, ww, y, bias=bb, backend=backend, **kw)
    (loss.sum() if loss.dim() else loss).backward()
    return loss.detach(), hh.grad, ww.grad, (bb.grad if bb is not None else None)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1, 1.0, "per-token"])
@pytest.mark.parametrize("softcap", [None, 4.0])
@pytest.mark.parametrize("peaked", [False, True])
def test_matches_fp64_reference(backend, smoothing, softcap, peaked):
    h, w, y, b = make_inputs(peaked=peaked, bias=True, seed=hash((smoothing, softcap, peaked)) % 1000)
    if smoothing == "per-token":
        smoothing = torch.rand(N, generator=torch.Generator().manual_seed(1))
        smoothing[::3] = 0.0
        smoothing[1::3] = 1.0
    ref = reference(h, w, y, b, smoothing=smoothing, softcap=softcap)
    t32 = reference(h, w, y, b, smoothing=smoothing, softcap=softcap, dtype=torch.float32)
    got = run(h, w, y, b, backend=backend, label_smoothing=smoothing, softcap=softcap)
    assert torch.isfinite(got[0]).all()
    # three-way: no worse than fp32 torch on the same inputs, plus a small margin
    for g, t, r in zip(got, t32, ref):
        assert rel(g, r) <= 2 * rel(t, r) + 5e-5  # lse-based p - 1 cancels on peaked rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_half_precision_no_worse_than_torch(dtype, softcap):
    """Three-way check: kernel error vs fp64 is within torch's own same-dtype error plus a margin."""
    h, w, y, _ = make_inputs(seed=7)
    h, w = h.to(dtype).double(), w.to(dtype).double()  # both see exactly the same rounded inputs
    ref = reference(h, w, y, smoothing=0.1, softcap=softcap)
    # torch in the same dtype, as HF computes it: half logits, upcast, F.cross_entropy
    th, tw = h.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
    z = th @ tw.T
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    tl = F.cross_entropy(z.float(), y, label_smoothing=0.1)
    tl.backward()
    got = run(h, w, y, dtype=dtype, label_smoothing=0.1, softcap=softcap)
    assert rel(got[0], ref[0]) <= rel(tl.detach(), ref[0]) + 1e-4
    assert rel(got[1], ref[1]) <= rel(th.grad, ref[1]) + 1e-2
    assert rel(got[2], ref[2]) <= rel(tw.grad, ref[2]) + 1e-2


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reductions(backend, reduction):
    h, w, y, _ = make_inputs(seed=3)
    ref = reference(h, w, y, smoothing=0.1, reduction=reduction)
    got = run(h, w, y, backend=backend, label_smoothing=0.1, reduction=reduction)
    assert got[0].shape == ref[0].shape
    assert rel(got[0], ref[0]) < 1e-6
    assert rel(got[1], ref[1]) < 1e-5 and rel(got[2], ref[2]) < 1e-5


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_num_items_in_batch(backend):
    h, w, y, _ = make_inputs(seed=4)
    ref = reference(h, w, y, smoothing=0.1, num_items=50)
    for num in (50, torch.tensor(50)):
        got = run(h, w, y, backend=backend, label_smoothing=0.1, num_items_in_batch=num)
        assert rel(got[0], ref[0]) < 1e-6 and rel(got[1], ref[1]) < 1e-5 and rel(got[2], ref[2]) < 1e-5


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_shift_matches_hf_causal_shift(backend):
    bsz, t = 3, 13
    h, w, y, _ = make_inputs(n=bsz * t, seed=5)
    h3, y2 = h.reshape(bsz, t, D), y.reshape(bsz, t)
    # HF: logits[:, :-1] against labels[:, 1:]
    ref = reference(h3[:, :-1].reshape(-1, D), w, y2[:, 1:].reshape(-1), smoothing=0.1)
    got = run(h3, w, y2, backend=backend, label_smoothing=0.1, shift=True)
    assert rel(got[0], ref[0]) < 1e-6
    assert rel(got[1][:, :-1].reshape(-1, D), ref[1]) < 1e-5
    assert float(got[1][:, -1].abs().max()) == 0.0  # last position predicts nothing
    assert rel(got[2], ref[2]) < 1e-5


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_stats_match_materialised_logits(backend):
    h, w, y, b = make_inputs(seed=6, bias=True)
    loss, st = linear_cross_entropy(h.float(), w.float(), y, bias=b.float(), label_smoothing=0.1,
                                    softcap=3.0, return_stats=True, backend=backend)
    z = 3.0 * torch.tanh((h @ w.T + b) / 3.0)
    lse = torch.logsumexp(z, -1)
    p = torch.softmax(z, -1)
    valid = y != -100
    assert torch.equal(st.valid, valid)
    assert rel(st.lse, lse) < 1e-6
    assert torch.equal(st.argmax, z.argmax(-1))
    assert rel(st.entropy, -(p * torch.log(p)).sum(-1)) < 1e-5
    nll = F.cross_entropy(z, y, reduction="none")
    assert rel(st.nll, nll) < 1e-6


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_all_ignored_and_empty_give_zero_not_nan(backend):
    h, w, y, _ = make_inputs(seed=8)
    y = torch.full_like(y, -100)
    for reduction in ("mean", "sum"):
        loss, gh, gw, _ = run(h, w, y, backend=backend, label_smoothing=0.1, reduction=reduction)
        assert float(loss) == 0.0
        assert float(gh.abs().max()) == 0.0 and float(gw.abs().max()) == 0.0
    he = torch.zeros(0, D, dtype=torch.float64)
    loss, gh, gw, _ = run(he, w, torch.zeros(0, dtype=torch.long), backend=backend)
    assert float(loss) == 0.0 and gh.shape == (0, D) and float(gw.abs().max()) == 0.0


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_non_contiguous_inputs(backend):
    h, w, y, _ = make_inputs(seed=9)
    hw = torch.stack([h, -h], dim=-1)[..., 0]  # strided view (stride 2), same values
    wt = w.T.contiguous().T  # column-major weight
    assert not hw.is_contiguous() and not wt.is_contiguous()
    ref = reference(h, w, y, smoothing=0.1)
    loss = linear_cross_entropy(hw.float(), wt.float(), y, label_smoothing=0.1, backend=backend)
    assert rel(loss.detach(), ref[0]) < 1e-6


def test_ignore_index_inside_vocabulary():
    h, w, y, _ = make_inputs(ignore_frac=0.0, seed=10)
    y[::4] = 0
    ref = F.cross_entropy(h @ w.T, y, ignore_index=0, label_smoothing=0.1)
    got = linear_cross_entropy(h.float(), w.float(), y, ignore_index=0, label_smoothing=0.1, backend="triton")
    assert rel(got, ref) < 1e-6


def test_torch_backend_bounded_memory_chunks_match():
    """The torch path at a larger size, forced through many small chunks, equals the reference."""
    from hf_lsce.ops import reference as refmod

    h, w, y, _ = make_inputs(n=700, d=64, v=3001, seed=13)
    full = refmod.torch_forward(h, w, None, y.masked_fill(y < 0, -1), None)
    chunked = refmod.torch_forward(h, w, None, y.masked_fill(y < 0, -1), None, chunk_elements=5000)
    assert refmod.chunk_rows(700, 3001, 5000) == 1
    for a, b in zip(full, chunked):
        assert torch.allclose(a.double(), b.double())
    ref = reference(h, w, y, smoothing=0.2)
    got = run(h, w, y, backend="torch", label_smoothing=0.2)
    assert rel(got[0], ref[0]) < 1e-6 and rel(got[1], ref[1]) < 1e-5 and rel(got[2], ref[2]) < 1e-5


def test_frozen_weight_gets_no_gradient():
    h, w, y, _ = make_inputs(seed=14)
    hh = h.float().requires_grad_()
    loss = linear_cross_entropy(hh, w.float(), y, label_smoothing=0.1, backend="triton")
    loss.backward()
    ref = reference(h, w, y, smoothing=0.1)
    assert rel(hh.grad, ref[1]) < 1e-5


def test_autocast_computes_in_autocast_dtype():
    h, w, y, _ = make_inputs(seed=15)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h.float(), w.float(), y, backend="torch")
    ref = F.cross_entropy((h.bfloat16() @ w.bfloat16().T).double(), y)
    assert rel(loss.detach(), ref) < 1e-2


# ---------------------------------------------------------------- bad input
def _bad(**over):
    h, w, y, _ = make_inputs(seed=16)
    args = dict(hidden=h.float(), weight=w.float(), targets=y)
    kw = {k: v for k, v in over.items() if k not in args}
    args.update({k: v for k, v in over.items() if k in args})
    return args, kw


@pytest.mark.parametrize("over, exc, words", [
    (dict(targets=torch.full((N,), V)), ValueError, "targets"),
    (dict(targets=torch.full((N,), -5)), ValueError, "targets"),
    (dict(targets=torch.zeros(N, dtype=torch.float32)), TypeError, "targets"),
    (dict(targets=torch.zeros(N + 1, dtype=torch.long)), ValueError, "targets shape"),
    (dict(weight=torch.randn(V, D + 1)), ValueError, "last dimension"),
    (dict(weight=torch.randn(V, D, dtype=torch.float64)), TypeError, "weight dtype"),
    (dict(weight=torch.randn(V, D, 2)), ValueError, "weight"),
    (dict(hidden=torch.zeros(N, D, dtype=torch.long)), TypeError, "hidden"),
    (dict(label_smoothing=1.5), ValueError, "label_smoothing"),
    (dict(label_smoothing=-0.1), ValueError, "label_smoothing"),
    (dict(label_smoothing=float("nan")), ValueError, "label_smoothing"),
    (dict(label_smoothing=torch.full((N,), 2.0)), ValueError, "label_smoothing"),
    (dict(label_smoothing=torch.zeros(N + 2)), ValueError, "label_smoothing"),
    (dict(label_smoothing="0.1"), TypeError, "label_smoothing"),
    (dict(reduction="avg"), ValueError, "reduction"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=0), ValueError, "softcap"),
    (dict(bias=torch.zeros(V + 1)), ValueError, "bias"),
    (dict(num_items_in_batch=-3), ValueError, "num_items_in_batch"),
    (dict(num_items_in_batch=4, reduction="none"), ValueError, "num_items_in_batch"),
    (dict(backend="cuda"), ValueError, "backend"),
    (dict(ignore_index=1.5), TypeError, "ignore_index"),
])
def test_bad_input_raises_naming_the_argument(over, exc, words):
    args, kw = _bad(**over)
    with pytest.raises(exc, match=words):
        linear_cross_entropy(**args, **kw)


def test_triton_backend_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    h, w, y, _ = make_inputs(seed=17)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        linear_cross_entropy(h.float(), w.float(), y, backend="triton")


@pytest.mark.parametrize("softcap", [None, 4.0])
def test_dense_backward_in_several_chunks(softcap):
    """The recomputing Triton backward, forced through chunks of 5 vocabulary columns, equals the fp64 reference."""
    from hf_lsce.ops.backward import triton_gradients_by_columns

    h, w, y, b = make_inputs(seed=18, bias=True)
    ref = reference(h, w, y, b, smoothing=0.1, softcap=softcap, reduction="sum")
    h32, w32, b32 = h.float(), w.float(), b.float()
    t = y.masked_fill(y < 0, -1)
    lse = torch_forward(h32, w32, b32, t, softcap)[0].float()
    grad = (t >= 0).float()
    dh, dw, db, _ = triton_gradients_by_columns(h32, w32, b32, t, lse, grad, torch.full((N,), 0.1), softcap,
                                                grad_logits_config(torch.float32, h32.device), chunk_bytes=5 * N * 4)
    assert rel(dh, ref[1]) < 1e-5 and rel(dw, ref[2]) < 1e-5 and rel(db, ref[3]) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_train_pass_in_several_chunks(dtype, softcap):
    """The one-pass training path (loss and gradients from fp32 logits of chunks of 5 rows, G stored in
    place over them) equals the fp64 reference, per-token smoothing and bias included."""
    from hf_lsce.ops.train_pass import triton_train_pass

    h, w, y, b = make_inputs(seed=21, bias=True, peaked=True)
    h, w, b = h.to(dtype).double(), w.to(dtype).double(), b.to(dtype).double()  # same rounded inputs
    sm = torch.rand(N, generator=torch.Generator().manual_seed(3))
    ref = reference(h, w, y, b, smoothing=sm, softcap=softcap, reduction="sum")
    t = y.masked_fill(y < 0, -1)
    stats, dh, dw, db, gamma = triton_train_pass(h.to(dtype), w.to(dtype), b.to(dtype), t, sm, (t >= 0).float(),
                                                 softcap, chunk_bytes=5 * V * 4)
    assert gamma is None  # (fp16 alone returns its gradients divided by a power of two)
    lse, zy, sz, argmax, ent = stats
    loss = torch.where(t >= 0, lse - (1 - sm) * zy - sm * sz / V, 0.0).sum()
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: G is stored in bf16
    assert rel(loss, ref[0]) < 1e-5
    assert rel(dh, ref[1]) < tol and rel(dw, ref[2]) < tol and rel(db, ref[3]) < tol
    z = h @ w.T + b
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    assert torch.equal(argmax, z.argmax(-1))
    p = torch.softmax(z, -1)
    assert rel(ent, -(p * torch.log_softmax(z, -1)).sum(-1)) < 1e-4  # lse - E[z]: fp32 cancellation


def test_training_takes_the_one_pass_path_and_scales_by_the_upstream_gradient(monkeypatch):
    """With gradients on, the Triton backend computes them in the forward (train_pass); the backward
    multiplies them by the upstream gradient when that is uniform over the valid tokens (a mean, a
    sum, TRL's -log_probs.sum() / n) and recomputes otherwise. fp32 evaluation and recomputation take cuBLAS's logits
    (dispatch.cublas_logits), never the G kernel's dots."""
    import hf_lsce.ops.train_pass as tp
    from hf_lsce.ops import backward as bw

    calls, recomputed = [], []
    real, real_rows = tp.triton_train_pass, bw.logits_gradients
    monkeypatch.setattr(tp, "triton_train_pass", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(bw, "logits_gradients", lambda *a, **k: recomputed.append(1) or real_rows(*a, **k))
    monkeypatch.setattr(bw, "write_grad_logits", lambda *a, **k: pytest.fail("the G kernel ran"))
    h, w, y, _ = make_inputs(seed=22)
    ref = reference(h, w, y, smoothing=0.1)
    hh, ww = h.float().requires_grad_(), w.float().requires_grad_()
    loss = linear_cross_entropy(hh, ww, y, label_smoothing=0.1, backend="triton")
    (2.5 * loss).backward()
    assert calls == [1] and recomputed == []
    assert rel(loss, ref[0]) < 1e-5
    assert rel(hh.grad, 2.5 * ref[1]) < 1e-5 and rel(ww.grad, 2.5 * ref[2]) < 1e-5
    with torch.no_grad():
        linear_cross_entropy(hh, ww, y, label_smoothing=0.1, backend="triton")
    assert calls == [1, 1]

    # reduction="none", summed and divided by a count (TRL's SFT loss): kept gradients, scaled
    tok_ref = reference(h, w, y, smoothing=0.1, reduction="none")
    for upstream, expect_recompute in ((torch.full((N,), 1 / 7.0), False),
                                       (torch.rand(N, generator=torch.Generator().manual_seed(5)), True)):
        calls.clear(), recomputed.clear()
        hh.grad = ww.grad = None
        tok = linear_cross_entropy(hh, ww, y, label_smoothing=0.1, backend="triton", reduction="none")
        (tok * upstream).sum().backward()
        # (fp32: the recomputation is the row kernel over cuBLAS's logits by columns, not the G kernel's FMA dots)
        assert calls == [1] and bool(recomputed) == expect_recompute
        hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
        z = hr @ wr.T
        (F.cross_entropy(z, y, label_smoothing=0.1, reduction="none") * upstream.double()).sum().backward()
        assert rel(tok.detach(), tok_ref[0]) < 1e-5
        assert rel(hh.grad, hr.grad) < 1e-5 and rel(ww.grad, wr.grad) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_evaluation_loss_without_stats(softcap, dtype):
    """Without gradients and without return_stats, the fused kernel's statistics (bf16) skip argmax and entropy: the
    loss (which needs neither) still equals the fp64 reference, and asking for stats gives the same loss; fp32 takes
    cuBLAS's logits and the row kernel (dispatch.cublas_logits), with the same result."""
    h, w, y, b = make_inputs(seed=23, bias=True, peaked=True)
    h, w, b = h.to(dtype), w.to(dtype), b.to(dtype)
    ref = reference(h.double(), w.double(), y, b.double(), smoothing=0.1, softcap=softcap)[0]
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, y, bias=b, label_smoothing=0.1, softcap=softcap, backend="triton")
        again, _ = linear_cross_entropy(h, w, y, bias=b, label_smoothing=0.1, softcap=softcap, backend="triton",
                                        return_stats=True)
    assert rel(loss, ref) < 1e-5
    assert torch.equal(loss, again)


@pytest.mark.parametrize("softcap,z_loss", [(None, 0.0), (3.0, 1e-3)])
def test_recomputing_backward_takes_cublas_logits_where_triton_dots_are_fma(monkeypatch, softcap, z_loss):
    """Where Triton's dots are FMA (``mma_dot`` off: Turing, Volta; fp32 everywhere), the recomputing backward (a loss
    on ``return_lse``'s output, per-token weights) runs the one-pass row kernel over cuBLAS's logits by vocabulary
    columns, never the G kernel's dots, and equals fp64 autograd through materialised logits (bias, soft-cap,
    z-loss)."""
    import dataclasses

    import hf_lsce.ops.backward as bw
    import hf_lsce.ops.config as config

    real = config.fused_config
    monkeypatch.setattr(config, "fused_config", lambda dt, dev: dataclasses.replace(real(dt, dev), mma_dot=False))
    monkeypatch.setattr(bw, "write_grad_logits", lambda *a, **k: pytest.fail("the G kernel ran"))
    h, w, y, b = make_inputs(n=37, d=40, v=203, seed=34, bias=True, peaked=True)
    hb, wb, bb = (t.to(torch.bfloat16).requires_grad_() for t in (h, w, b))
    up = torch.linspace(0.5, 1.5, 37)
    tok, lse = linear_cross_entropy(hb, wb, y, bias=bb, label_smoothing=0.1, softcap=softcap, z_loss=z_loss,
                                    reduction="none", return_lse=True, backend="triton")
    ((tok * up).sum() + 0.01 * lse.sum()).backward()
    hr, wr, br = (t.detach().to(torch.bfloat16).double().requires_grad_() for t in (h, w, b))
    z = hr @ wr.T + br
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    lse_r = torch.logsumexp(z, -1)
    tok_r = F.cross_entropy(z, y, label_smoothing=0.1, reduction="none") + z_loss * torch.where(y != -100, lse_r ** 2, 0)
    ((tok_r * up.double()).sum() + 0.01 * lse_r.sum()).backward()
    for got, want in ((hb.grad, hr.grad), (wb.grad, wr.grad), (bb.grad, br.grad)):
        assert rel(got, want) < 1e-2  # G and the gradients in bf16


def _columns_case(dtype, softcap, bias, seed, draws):
    """A recomputing-backward case at ragged sizes (37 x 40 x 203): the inputs in ``dtype``, ids with -1 for the ignored
    row, the fp32 lse, per-token b, upstream gradient and extra p term, and the fp64 reference gradients."""
    from hf_lsce.ops.reference import torch_backward

    h, w, y, b = make_inputs(n=37, d=40, v=203, seed=seed, bias=bias, peaked=True)
    hh, ww = h.to(dtype), w.to(dtype)
    bb = b.to(dtype) if bias else None
    t = y.masked_fill(y < 0, -1)
    g = torch.Generator().manual_seed(draws)
    sm, grad, extra = torch.rand(37, generator=g) * 0.3, torch.rand(37, generator=g), torch.rand(37, generator=g)
    lse = torch_forward(hh.double(), ww.double(), bb.double() if bias else None, t, softcap)[0].float()
    ref = torch_backward(hh.double(), ww.double(), bb.double() if bias else None, t, lse.double(), grad.double(),
                         sm.double(), softcap, extra=extra.double())
    return hh, ww, bb, t, lse, sm, grad, extra, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap,bias", [(None, False), (3.0, True)])
def test_gradients_by_columns_through_cublas_logits_match_fp64(dtype, softcap, bias):
    """Where Triton's dots are FMA, the recomputing backward's G comes from cuBLAS's fp32 logits by vocabulary columns
    and the row kernel's G pass with the lse given (``train_pass.logits_gradients``): the fp64 gradients in chunks
    (three of 64 columns and one of 11), with per-token b, a per-token upstream gradient, an extra p
    term and an ignored row; the G kernel's route agrees."""
    import dataclasses

    from hf_lsce.ops.backward import triton_gradients_by_columns
    from hf_lsce.ops.config import fused_config

    hh, ww, bb, t, lse, sm, grad, extra, ref = _columns_case(dtype, softcap, bias, seed=35, draws=8)
    cfg = dataclasses.replace(fused_config(dtype, hh.device), tma=False)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: G and the products in bf16
    got = triton_gradients_by_columns(hh, ww, bb, t, lse, grad, sm, softcap, cfg, extra=extra,
                                      chunk_bytes=37 * 70 * 4, cublas=True)
    kernel = triton_gradients_by_columns(hh, ww, bb, t, lse, grad, sm, softcap, cfg, extra=extra)
    for a, k, r in zip(got, kernel, ref):
        if r is not None:
            assert rel(a, r) < tol and rel(a, k) < tol


@pytest.mark.parametrize("frozen", [False, True])
def test_low_memory_takes_cublas_columns_where_triton_dots_are_fma(monkeypatch, frozen):
    """``memory="low"`` on a GPU whose Triton dots are FMA (Turing, Volta: ``mma_dot`` False): the statistics and the
    gradients come from cuBLAS's logits (the G kernel never runs), and equal fp64 autograd through materialised
    logits in bf16 (bias, per-token b, z-loss)."""
    import dataclasses

    import hf_lsce.ops.backward as bw
    import hf_lsce.ops.config as config

    real = config.fused_config
    monkeypatch.setattr(config, "fused_config", lambda dt, dev: dataclasses.replace(real(dt, dev), mma_dot=False))
    monkeypatch.setattr(bw, "write_grad_logits", lambda *a, **k: pytest.fail("the G kernel ran"))
    h, w, y, b = make_inputs(n=37, d=40, v=203, seed=36, bias=True, peaked=True)
    sm = torch.rand(37, generator=torch.Generator().manual_seed(3)) * 0.2
    hb = h.to(torch.bfloat16).requires_grad_()
    wb, bb = (t.to(torch.bfloat16).requires_grad_(not frozen) for t in (w, b))
    loss = linear_cross_entropy(hb, wb, y, bias=bb, label_smoothing=sm, z_loss=1e-3, memory="low", backend="triton")
    loss.backward()
    hr, wr, br = (t.detach().to(torch.bfloat16).double().requires_grad_() for t in (h, w, b))
    z = hr @ wr.T + br
    valid = y != -100
    tok = -(1 - sm.double()) * torch.log_softmax(z, -1).gather(1, y.clamp(min=0)[:, None])[:, 0] - sm.double() * (
        torch.log_softmax(z, -1).mean(-1))
    ref = torch.where(valid, tok + 1e-3 * torch.logsumexp(z, -1) ** 2, 0.0).sum() / valid.sum()
    ref.backward()
    assert rel(loss, ref.detach()) < 1e-5
    assert rel(hb.grad, hr.grad) < 1e-2
    if not frozen:
        assert rel(wb.grad, wr.grad) < 1e-2 and rel(bb.grad, br.grad) < 1e-2


def test_cublas_statistics_chunk_fits_free_memory():
    """The cuBLAS statistics route's chunk of fp32 logits: 1 GiB, or what CUDA's free memory holds with the headroom
    (an evaluation on a nearly full GPU, where the fused kernel's statistics need no buffer), never below the low mode's
    minimum chunk."""
    from hf_lsce.ops.config import LOW_MEMORY_CHUNK_BYTES, MEMORY_HEADROOM, STATS_CHUNK_BYTES, stats_chunk_bytes

    assert stats_chunk_bytes(None) == STATS_CHUNK_BYTES == 1 << 30
    assert stats_chunk_bytes(10 << 30) == STATS_CHUNK_BYTES
    assert stats_chunk_bytes(int(MEMORY_HEADROOM * (300 << 20))) == 300 << 20
    assert stats_chunk_bytes(1 << 20) == LOW_MEMORY_CHUNK_BYTES


@pytest.mark.parametrize("softcap,bias", [(None, False), (3.0, True)])
def test_statistics_take_cublas_logits_where_triton_dots_are_fma(monkeypatch, softcap, bias):
    """On a GPU whose Triton dots lower to FMA (Turing, Volta: ``mma_dot`` False), the statistics of an evaluation
    call and of the vocabulary-parallel forward come from the row kernel over cuBLAS's logits, not the fused
    kernel: the same statistics as fp64 on the materialised logits (a target past V, as the vocabulary-parallel
    forward passes for another rank's, gives a target logit of 0)."""
    import dataclasses

    import hf_lsce.ops.config as config
    import hf_lsce.ops.fused_pass as fp
    import hf_lsce.ops.train_pass as tp
    from hf_lsce.ops.dispatch import cublas_logits, forward_stats

    h, w, y, b = make_inputs(n=37, d=40, v=203, seed=33, bias=bias, peaked=True)
    hh, ww = h.to(torch.bfloat16), w.to(torch.bfloat16)
    bb = b.to(torch.bfloat16) if bias else None
    assert not cublas_logits(hh) and cublas_logits(hh.float())
    real = config.fused_config
    monkeypatch.setattr(config, "fused_config", lambda dt, dev: dataclasses.replace(real(dt, dev), mma_dot=False))
    assert cublas_logits(hh)
    calls = []
    monkeypatch.setattr(fp, "fused_statistics", lambda *a, **k: calls.append("fused kernel"))
    real_pass = tp.triton_train_pass
    monkeypatch.setattr(tp, "triton_train_pass", lambda *a, **k: calls.append("row kernel") or real_pass(*a, **k))
    t = y.clamp(min=0).clone()
    t[:3] = 203  # another rank's target
    t[3:5] = -1  # ignored
    lse, zy, sz, argmax, entropy = forward_stats(hh, ww, bb, t, softcap, "triton")
    assert calls == ["row kernel"]
    z = hh.double() @ ww.double().T + (bb.double() if bias else 0)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    p = torch.softmax(z, -1)
    here = (t >= 0) & (t < 203)
    assert rel(lse, torch.logsumexp(z, -1)) < 1e-6
    assert rel(zy, torch.where(here, z.gather(1, t.clamp(0, 202)[:, None])[:, 0], 0.0)) < 1e-6
    assert rel(sz, z.sum(-1)) < 1e-6
    assert torch.equal(argmax, z.argmax(-1))
    assert rel(entropy, -(p * torch.log(p)).sum(-1)) < 1e-5


@needs_descriptors
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("softcap,bias", [(None, False), (3.0, True)])
@pytest.mark.parametrize("splits", [1, 3])
def test_fused_statistics_match_fp64(dtype, softcap, bias, splits):
    """The statistics alone from the fused logits kernel (evaluation, the vocabulary-parallel forward, the two-pass
    path's lse), with TMA loads (Hopper) and pointer loads (other GPUs), give the fp64 statistics of the materialised
    logits at ragged sizes (N, V and D not multiples of the blocks, splits ending mid-tile), with an ignored row, a
    target past V (another rank's: target logit 0) and a row whose max is far above its mean logit (the fix-up
    launch)."""
    import dataclasses

    from hf_lsce.ops.config import fused_config
    from hf_lsce.ops.fused_pass import R_EXP_MAX, C_SHIFT, fused_statistics
    from hf_lsce.ops.tiles import tma_ready

    h, w, y, b = make_inputs(n=37, d=40, v=203, seed=31, bias=bias, peaked=True)
    h[0] = 100.0 * w[7] / w[7].norm() ** 2  # logit 7 = 100, far above the row's mean
    hh, ww = h.to(dtype), w.to(dtype)
    bb = b.to(dtype) if bias else None
    t = y.clamp(min=0).clone()
    t[3], t[4] = -1, 203
    z = hh.double() @ ww.double().T + (bb.double() if bias else 0)
    if softcap is None:
        assert (z.max(-1).values - z.mean(-1) > C_SHIFT + R_EXP_MAX).any()  # a row the fix-up redoes
    else:
        z = softcap * torch.tanh(z / softcap)
    p = torch.softmax(z, -1)
    here = (t >= 0) & (t < 203)
    cfg = dataclasses.replace(fused_config(dtype, hh.device), tma=True, min_splits=splits, min_programs=1)
    assert tma_ready(cfg, hh, ww)
    for c in (cfg, dataclasses.replace(cfg, tma=False)):
        lse, zy, sz, argmax, entropy = fused_statistics(hh, ww, bb, t, softcap, c, need_stats=True)
        assert rel(lse, torch.logsumexp(z, -1)) < 1e-6
        assert rel(zy, torch.where(here, z.gather(1, t.clamp(0, 202)[:, None])[:, 0], 0.0)) < 1e-6
        assert rel(sz, z.sum(-1)) < 1e-6
        assert torch.equal(argmax, z.argmax(-1))
        assert rel(entropy, -(p * torch.log(p)).sum(-1)) < 1e-5
        lse2, _, _, argmax2, entropy2 = fused_statistics(hh, ww, bb, t, softcap, c, need_stats=False)
        assert torch.equal(lse2, lse) and not argmax2.any() and not entropy2.any()


@needs_descriptors
def test_tma_kernel_only_for_aligned_rows():
    """A row stride that is not a multiple of 16 bytes cannot be a tensor descriptor: the statistics fall back to
    the pointer loads instead of faulting, and still match fp64."""
    import dataclasses

    from hf_lsce.ops.config import fused_config
    from hf_lsce.ops.fused_pass import fused_statistics
    from hf_lsce.ops.tiles import tma_ready

    h, w, y, _ = make_inputs(n=21, d=20, v=77, seed=32)
    hh, ww = h.to(torch.bfloat16), w.to(torch.bfloat16)  # 20 bf16 = 40 bytes per row
    cfg = dataclasses.replace(fused_config(torch.bfloat16, hh.device), tma=True)
    assert not tma_ready(cfg, hh, ww)
    assert tma_ready(cfg, hh.float(), ww.float())  # 80 bytes per row
    assert not tma_ready(cfg, hh.float()[:, 1:], ww.float())  # rows not contiguous
    lse = fused_statistics(hh, ww, None, y.clamp(min=0), None, cfg, need_stats=False)[0]
    assert rel(lse, torch.logsumexp(hh.double() @ ww.double().T, -1)) < 1e-6


@needs_descriptors
@pytest.mark.parametrize("version,expected", [("3.3.1", False), ("3.4.0", True), ("3.6.0+git1234", True), ("4.0.0", True)])
def test_tma_kernel_needs_triton_3_4(monkeypatch, version, expected):
    """Older Tritons lack the host tensor descriptors the TMA kernel takes: they get the pointer kernel."""
    import triton

    from hf_lsce.ops import config

    monkeypatch.setattr(triton, "__version__", version)
    config._has_tensor_descriptors.cache_clear()
    try:
        assert config._has_tensor_descriptors() is expected
    finally:
        config._has_tensor_descriptors.cache_clear()  # the next caller sees the real version


@needs_descriptors
@pytest.mark.parametrize("shift", [False, True])
def test_evaluation_loss_through_the_tma_kernel(monkeypatch, shift):
    """The op as users call it for evaluation, with the config a Hopper GPU gets (the fused kernel's TMA loads):
    the loss equals fp64 cross-entropy of the materialised logits, also for a shifted (HF causal) batch
    whose hidden rows are a strided view, and the TMA loads are the ones that ran."""
    import dataclasses

    from hf_lsce.ops import config, fused_pass

    real_cfg, real_ready = config.fused_config, fused_pass.tma_ready
    monkeypatch.setattr(config, "fused_config", lambda dt, dev: dataclasses.replace(real_cfg(dt, dev), tma=True))
    used = []
    monkeypatch.setattr(fused_pass, "tma_ready", lambda *a: used.append(real_ready(*a)) or used[-1])
    h, w, y, _ = make_inputs(n=2 * 19, d=40, v=203, seed=33, peaked=True)
    hh = h.to(torch.bfloat16).reshape(2, 19, 40)
    ww = w.to(torch.bfloat16)
    yy = y.reshape(2, 19)
    with torch.no_grad():
        loss = linear_cross_entropy(hh, ww, yy, label_smoothing=0.1, shift=shift, backend="triton")
    z = hh.double() @ ww.double().T
    tgt = F.pad(yy, (0, 1), value=-100)[:, 1:] if shift else yy
    ref = F.cross_entropy(z.reshape(-1, 203), tgt.reshape(-1), label_smoothing=0.1)
    assert used and all(used)
    assert rel(loss, ref) < 1e-6


@pytest.mark.parametrize("major,smem,expected", [
    (9, 232448, True),     # H100 / H200
    (10, 232448, True),    # B200
    (12, 101376, False),   # consumer Blackwell: TMA, but not the shared memory for 3 stages of 128 x 256 tiles
    (8, 166912, False),    # A100: no TMA
    (9, None, True),       # older torch without the property: Hopper assumed to have it
    (12, None, False),
])
def test_tma_kernel_only_where_its_shared_memory_fits(major, smem, expected):
    from types import SimpleNamespace

    from hf_lsce.ops.config import tma_capable

    props = SimpleNamespace(major=major) if smem is None else SimpleNamespace(major=major, shared_memory_per_block_optin=smem)
    assert tma_capable(props) is expected


@pytest.mark.parametrize("arch,capability,tma", [("", (9, 0), True), ("sm80", (8, 0), False), ("sm75", (7, 5), False),
                                                 ("sm100", (10, 0), True)])
def test_an_overridden_arch_takes_that_gpus_paths(monkeypatch, arch, capability, tma):
    """TRITON_OVERRIDE_ARCH=sm80 (or sm75) makes Triton compile every kernel as for an A100 (a T4) and the op take
    that GPU's paths on the GPU present: no TMA below sm90, FMA dots (the one-pass path, cuBLAS's logits) below
    sm80; unset, the GPU's own capability."""
    from types import SimpleNamespace

    from hf_lsce.ops.config import compiled_capability, tma_capable

    monkeypatch.setenv("TRITON_OVERRIDE_ARCH", arch)
    h100 = SimpleNamespace(major=9, minor=0, shared_memory_per_block_optin=232448)
    assert compiled_capability(h100) == capability
    assert tma_capable(h100) is tma


@needs_descriptors
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap,bias", [(None, False), (3.0, True)])
@pytest.mark.parametrize("splits", [1, 3])
def test_tma_grad_logits_kernel_matches_fp64(dtype, softcap, bias, splits):
    """The TMA kernel writing G = dL/dz (the two-pass path and the recomputing backward on Hopper) gives the fp64
    gradients through cuBLAS-style products, at ragged sizes, in chunks of vocabulary columns, with per-token b, a
    per-token upstream gradient, an extra p term (z-loss, lse output) and an ignored row; the pointer kernel (GPUs
    without TMA) agrees with it."""
    import dataclasses

    from hf_lsce.ops.backward import triton_gradients_by_columns
    from hf_lsce.ops.config import fused_config

    hh, ww, bb, t, lse, sm, grad, extra, ref = _columns_case(dtype, softcap, bias, seed=32, draws=7)
    cfg = dataclasses.replace(fused_config(dtype, hh.device), tma=True, min_splits=splits, min_programs=1)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: G and the products in bf16
    got = {}
    for c in (cfg, dataclasses.replace(cfg, tma=False)):
        got[c.tma] = triton_gradients_by_columns(hh, ww, bb, t, lse, grad, sm, softcap, c, extra=extra,
                                                 chunk_bytes=37 * 70 * hh.element_size())
        for a, r in zip(got[c.tma], ref):
            if r is not None:
                assert rel(a, r) < tol
    for a, o in zip(got[True], got[False]):
        if a is not None:
            assert rel(a, o) < tol


@pytest.mark.parametrize("softcap,bias", [(None, False), (4.0, True)])
@pytest.mark.parametrize("reduction,upstream", [("mean", 1.0), ("sum", 0.5), ("none", None)])
def test_two_pass_training_path_matches_fp64(monkeypatch, softcap, bias, reduction, upstream):
    """The two-pass training path (the statistics, then G from recomputed logits and cuBLAS products, in the
    forward) gives the fp64 loss and gradients for every reduction, per-token b and z-loss; the one-pass path is not
    called, and the same call with the one-pass path gives the same numbers."""
    import hf_lsce.ops.config as config
    import hf_lsce.ops.train_pass as tp

    h, w, y, b = make_inputs(seed=41, bias=bias, peaked=True)
    sm = torch.rand(N, generator=torch.Generator().manual_seed(9)) * 0.2
    results = {}
    for path in ("two-pass", "one-pass"):
        monkeypatch.setattr(config, "TRAIN_PATH", path)
        one_pass_calls = []
        real = tp.triton_train_pass
        # (the one-pass path's gradients; fp32's statistics come from its row kernel on every path)
        monkeypatch.setattr(tp, "triton_train_pass", lambda *a, **k: (k["need_dh"] or k["need_dw"])
                            and one_pass_calls.append(1) or real(*a, **k))
        hh, ww = h.float().requires_grad_(), w.float().requires_grad_()
        bb = b.float().requires_grad_() if bias else None
        out = linear_cross_entropy(hh, ww, y, bias=bb, label_smoothing=sm, softcap=softcap, reduction=reduction,
                                   z_loss=1e-3, backend="triton")
        weights = torch.rand(N, generator=torch.Generator().manual_seed(2)) if reduction == "none" else None
        (out * weights).sum().backward() if weights is not None else (upstream * out).backward()
        # (one-pass forced: per-token weights that are not uniform recompute through cuBLAS's logits by columns,
        # dispatch.cublas_logits, not the one-pass pass again)
        assert one_pass_calls == ([] if path == "two-pass" else [1])
        results[path] = (out.detach(), hh.grad, ww.grad, bb.grad if bias else None)
        monkeypatch.setattr(tp, "triton_train_pass", real)
    # fp64 oracle: the definition on materialised logits, z-loss added
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    br = b.clone().requires_grad_() if bias else None
    z = hr @ wr.T + (br if bias else 0)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    logp = torch.log_softmax(z, -1)
    valid = y != -100
    smd = sm.double()
    tok = -(1 - smd) * logp.gather(1, y.clamp(min=0)[:, None])[:, 0] - smd * logp.mean(-1)
    tok = torch.where(valid, tok + 1e-3 * torch.logsumexp(z, -1) ** 2, 0.0)
    ref = {"mean": tok.sum() / valid.sum(), "sum": tok.sum(), "none": tok}[reduction]
    (ref * weights.double()).sum().backward() if reduction == "none" else (upstream * ref).backward()
    two = results["two-pass"]
    assert rel(two[0], ref.detach()) < 1e-5
    assert rel(two[1], hr.grad) < 1e-5 and rel(two[2], wr.grad) < 1e-5
    if bias:
        assert rel(two[3], br.grad) < 1e-5
    for a, o in zip(two, results["one-pass"]):
        if a is not None:
            assert rel(a, o) < 1e-5


def _scalar_casts(source: str):
    """(kernel, expression) for each ``.to(...)`` applied directly to a kernel's scalar argument (or to arithmetic of
    scalars and constants) in ``source``: on a GPU Triton makes an int argument equal to 1 a compile-time constant,
    which has no ``.to()``, so such a kernel fails to compile for that one value (the interpreter does not specialise
    and cannot show it)."""
    import ast

    found = []
    for fn in ast.walk(ast.parse(source)):
        if not (isinstance(fn, ast.FunctionDef) and fn.name.endswith("_kernel")  # kernels, not their helpers
                and any("jit" in ast.unparse(d) for d in fn.decorator_list)):
            continue
        scalars = {a.arg for a in fn.args.args if a.arg.islower() and not a.arg.endswith("_desc")
                   and not (a.annotation is not None and "constexpr" in ast.unparse(a.annotation))}

        def only_scalars(node):
            names = [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]
            calls = [n for n in ast.walk(node) if isinstance(n, ast.Call)]
            return names and not calls and all(name in scalars for name in names)

        for node in ast.walk(fn):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to"
                    and only_scalars(node.func.value)):
                found.append((fn.name, ast.unparse(node)))
    return found


def test_no_kernel_casts_a_scalar_argument():
    """Every Triton kernel of the package: no ``.to()`` on a scalar argument (see ``_scalar_casts``); the check itself
    finds the cast that broke the direct dW's rank-one kernel for one token on the H100."""
    from pathlib import Path

    ops = Path(__file__).resolve().parents[1] / "hf_lsce" / "ops"
    bad = [(f.name, *hit) for f in sorted(ops.glob("*.py")) for hit in _scalar_casts(f.read_text())]
    assert not bad, bad
    broken = '''
@triton.jit
def _rows_kernel(HS, n, stride_hs, BLOCK: tl.constexpr):
    tl.store(HS + n.to(tl.int64) * stride_hs, 1.0)
    tl.store(HS + (n + 1).to(tl.int64) * stride_hs, 1.0)
'''
    assert [e for _, e in _scalar_casts(broken)] == ["n.to(tl.int64)", "(n + 1).to(tl.int64)"]
