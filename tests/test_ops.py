"""linear_cross_entropy against fp64 F.cross_entropy on materialised logits (an independent oracle).

Triton kernels run under TRITON_INTERPRET=1 at small ragged sizes; the torch backend at larger ones.
"""
import pytest
import torch
import torch.nn.functional as F

from hf_lsce import linear_cross_entropy
from hf_lsce.ops.config import _has_tensor_descriptors, _release, triton_version
from hf_lsce.ops.reference import torch_pass

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
    """The torch computation at a larger size, forced through many small chunks, equals the reference."""
    from hf_lsce.ops import reference as refmod

    h, w, y, _ = make_inputs(n=700, d=64, v=3001, seed=13)
    full = torch_pass(h, w, None, y.masked_fill(y < 0, -1), None)[0]
    chunked = torch_pass(h, w, None, y.masked_fill(y < 0, -1), None, rows=refmod.chunk_rows(700, 3001, 5000))[0]
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_torch_training_computation_in_several_chunks(dtype, softcap):
    """The torch computation's training call (loss and gradients from each chunk's fp32 logits, 5 rows a chunk)
    equals the fp64 reference, per-token smoothing and bias included, with its statistics."""
    h, w, y, b = make_inputs(seed=21, bias=True, peaked=True)
    h, w, b = h.to(dtype).double(), w.to(dtype).double(), b.to(dtype).double()  # same rounded inputs
    sm = torch.rand(N, generator=torch.Generator().manual_seed(3))
    ref = reference(h, w, y, b, smoothing=sm, softcap=softcap, reduction="sum")
    t = y.masked_fill(y < 0, -1)
    stats, dh, dw, db = torch_pass(h.to(dtype), w.to(dtype), b.to(dtype), t, softcap, rows=5, grad=(t >= 0).float(),
                                   smoothing=sm)
    lse, zy, sz, argmax, ent = stats
    loss = torch.where(t >= 0, lse - (1 - sm) * zy - sm * sz / V, 0.0).sum()
    assert rel(loss, ref[0]) < 1e-5
    assert rel(dh, ref[1]) < 1e-5 and rel(dw, ref[2]) < 1e-5 and rel(db, ref[3]) < 1e-5  # (fp32 math either way)
    z = h @ w.T + b
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    assert torch.equal(argmax, z.argmax(-1))
    p = torch.softmax(z, -1)
    assert rel(ent, -(p * torch.log_softmax(z, -1)).sum(-1)) < 1e-4  # lse - E[z]: fp32 cancellation


def test_training_computes_gradients_in_the_forward_and_scales_by_the_upstream_gradient(monkeypatch):
    """With gradients on, the forward computes them (fp32: the torch computation's one pass); the backward multiplies
    them by the upstream gradient when that is uniform over the valid tokens (a mean, a sum, TRL's -log_probs.sum()
    / n) and computes them again with the upstream gradient as the token weights otherwise."""
    from hf_lsce.ops import paths

    calls = []
    real = paths.torch_pass
    monkeypatch.setattr(paths, "torch_pass", lambda *a, **k: calls.append(k.get("grad") is not None) or real(*a, **k))
    h, w, y, _ = make_inputs(seed=22)
    ref = reference(h, w, y, smoothing=0.1)
    hh, ww = h.float().requires_grad_(), w.float().requires_grad_()
    loss = linear_cross_entropy(hh, ww, y, label_smoothing=0.1, backend="triton")
    (2.5 * loss).backward()
    assert calls == [True]
    assert rel(loss, ref[0]) < 1e-5
    assert rel(hh.grad, 2.5 * ref[1]) < 1e-5 and rel(ww.grad, 2.5 * ref[2]) < 1e-5
    with torch.no_grad():
        linear_cross_entropy(hh, ww, y, label_smoothing=0.1, backend="triton")
    assert calls == [True, False]

    # reduction="none", summed and divided by a count (TRL's SFT loss): kept gradients, scaled
    tok_ref = reference(h, w, y, smoothing=0.1, reduction="none")
    for upstream, expect_again in ((torch.full((N,), 1 / 7.0), False),
                                   (torch.rand(N, generator=torch.Generator().manual_seed(5)), True)):
        calls.clear()
        hh.grad = ww.grad = None
        tok = linear_cross_entropy(hh, ww, y, label_smoothing=0.1, backend="triton", reduction="none")
        (tok * upstream).sum().backward()
        assert calls == ([True, True] if expect_again else [True])
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
    the torch computation, with the same result."""
    h, w, y, b = make_inputs(seed=23, bias=True, peaked=True)
    h, w, b = h.to(dtype), w.to(dtype), b.to(dtype)
    ref = reference(h.double(), w.double(), y, b.double(), smoothing=0.1, softcap=softcap)[0]
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, y, bias=b, label_smoothing=0.1, softcap=softcap, backend="triton")
        again, _ = linear_cross_entropy(h, w, y, bias=b, label_smoothing=0.1, softcap=softcap, backend="triton",
                                        return_stats=True)
    assert rel(loss, ref) < 1e-5
    assert torch.equal(loss, again)


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("memory", ["auto", "low"])
@pytest.mark.parametrize("softcap,z_loss", [(None, 0.0), (3.0, 1e-3)])
def test_gpus_without_tensor_core_dots_take_the_torch_computation(monkeypatch, frozen, memory, softcap, z_loss):
    """Where Triton's dots are FMA (``mma_dot`` off: Turing, Volta), every call takes the torch computation (the fused
    kernels never run), memory="low" included, and a loss on ``return_lse``'s output with per-token weights equals
    fp64 autograd through materialised logits (bias, soft-cap, z-loss)."""
    import dataclasses

    import hf_lsce.ops.config as config
    import hf_lsce.ops.fused_pass as fp

    real = config.fused_config
    monkeypatch.setattr(config, "fused_config", lambda dt, dev: dataclasses.replace(real(dt, dev), mma_dot=False))
    monkeypatch.setattr(fp, "_exp_tiles", lambda *a, **k: pytest.fail("a fused kernel ran"))
    h, w, y, b = make_inputs(n=37, d=40, v=203, seed=34, bias=True, peaked=True)
    hb = h.to(torch.bfloat16).requires_grad_()
    wb, bb = (t.to(torch.bfloat16).requires_grad_(not frozen) for t in (w, b))
    up = torch.linspace(0.5, 1.5, 37)
    tok, lse = linear_cross_entropy(hb, wb, y, bias=bb, label_smoothing=0.1, softcap=softcap, z_loss=z_loss,
                                    reduction="none", return_lse=True, backend="triton", memory=memory)
    ((tok * up).sum() + 0.01 * lse.sum()).backward()
    hr, wr, br = (t.detach().to(torch.bfloat16).double().requires_grad_() for t in (h, w, b))
    z = hr @ wr.T + br
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    lse_r = torch.logsumexp(z, -1)
    tok_r = F.cross_entropy(z, y, label_smoothing=0.1, reduction="none") + z_loss * torch.where(y != -100, lse_r ** 2, 0)
    ((tok_r * up.double()).sum() + 0.01 * lse_r.sum()).backward()
    assert rel(hb.grad, hr.grad) < 1e-2  # (the gradients rounded to bf16)
    if not frozen:
        assert rel(wb.grad, wr.grad) < 1e-2 and rel(bb.grad, br.grad) < 1e-2


def _columns_case(dtype, softcap, bias, seed, draws):
    """A recomputing-backward case at ragged sizes (37 x 40 x 203): the inputs in ``dtype``, ids with -1 for the ignored
    row, the fp32 lse, per-token b, upstream gradient and lse gradient, and the fp64 reference gradients."""
    h, w, y, b = make_inputs(n=37, d=40, v=203, seed=seed, bias=bias, peaked=True)
    hh, ww = h.to(dtype), w.to(dtype)
    bb = b.to(dtype) if bias else None
    t = y.masked_fill(y < 0, -1)
    g = torch.Generator().manual_seed(draws)
    sm, grad, extra = torch.rand(37, generator=g) * 0.3, torch.rand(37, generator=g), torch.rand(37, generator=g)
    h64, w64, b64 = hh.double(), ww.double(), bb.double() if bias else None
    lse = torch_pass(h64, w64, b64, t, softcap)[0][0].float()
    ref = torch_pass(h64, w64, b64, t, softcap, lse=lse.double(), grad=grad.double(), smoothing=sm.double(),
                     extra=extra.double())[1:]
    return hh, ww, bb, t, lse, sm, grad, extra, ref


@needs_descriptors
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softcap,bias", [(None, False), (3.0, True)])
@pytest.mark.parametrize("splits", [1, 3])
def test_recomputing_backward_matches_fp64_by_column_chunks(dtype, softcap, bias, splits):
    """The recomputing backward given the lse (``paths.dense_backward``: the fused kernel's G epilogue by chunks of
    vocabulary columns, TMA and pointer loads; fp32 by the torch computation) gives the fp64 gradients at ragged sizes,
    in chunks of 64 columns, with per-token b, a per-token upstream gradient, an lse gradient and an ignored row."""
    import dataclasses

    import hf_lsce.ops.config as config
    from hf_lsce.ops import paths
    from hf_lsce.ops.budget import Plan, options
    from hf_lsce.ops.matmul import times_gamma

    hh, ww, bb, t, lse, sm, grad, extra, ref = _columns_case(dtype, softcap, bias, seed=32, draws=7)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # half precision: G and the products in that dtype
    got = {}
    for tma in (True, False):
        cfg = dataclasses.replace(config.fused_config(dtype, hh.device), tma=tma, min_splits=splits, min_programs=1)
        real, config.fused_config = config.fused_config, lambda dt, dev: cfg
        try:
            opts = options(hh, ww, bb, softcap, "triton", 0.0, "auto", True, True, bias)
            plan = Plan(opts.computation, "columns", cols=64, nbytes=4 * 37 * 40 + 37 * 64 * 2)
            opts = dataclasses.replace(opts, plan=plan if opts.computation == "fused" else opts.plan)
            assert opts.computation == ("torch" if dtype == torch.float32 else "fused")
            dh, dw, db, gamma = paths.dense_backward(hh, ww, bb, t, lse, grad, sm, opts, extra=extra)
        finally:
            config.fused_config = real
        times_gamma((dh, dw, db), gamma)
        got[tma] = (dh, dw, db)
        for a, r in zip(got[tma], ref):
            if r is not None:
                assert rel(a, r) < tol
    for a, o in zip(got[True], got[False]):
        if a is not None:
            assert rel(a, o) < tol


@pytest.mark.parametrize("softcap,bias", [(None, False), (3.0, True)])
def test_torch_statistics_match_fp64_with_a_target_past_the_shard(softcap, bias):
    """The torch computation's statistics (evaluation where the fused kernels do not run, the vocabulary-parallel
    forward) equal fp64 on the materialised logits; a target past V (another rank's) has a target logit of 0."""
    h, w, y, b = make_inputs(n=37, d=40, v=203, seed=33, bias=bias, peaked=True)
    hh, ww = h.to(torch.bfloat16), w.to(torch.bfloat16)
    bb = b.to(torch.bfloat16) if bias else None
    t = y.clamp(min=0).clone()
    t[:3] = 203  # another rank's target
    t[3:5] = -1  # ignored
    lse, zy, sz, argmax, entropy = torch_pass(hh, ww, bb, t, softcap, rows=8)[0]
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
    """The statistics alone from the fused logits kernel (evaluation, the vocabulary-parallel forward, the columns
    layout's lse), with TMA loads (Hopper) and pointer loads (other GPUs), give the fp64 statistics of the materialised
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
    that GPU's paths on the GPU present: no TMA below sm90, FMA dots (the torch computation) below sm80; unset, the
    GPU's own capability."""
    from types import SimpleNamespace

    from hf_lsce.ops.config import compiled_capability, tma_capable

    monkeypatch.setenv("TRITON_OVERRIDE_ARCH", arch)
    h100 = SimpleNamespace(major=9, minor=0, shared_memory_per_block_optin=232448)
    assert compiled_capability(h100) == capability
    assert tma_capable(h100) is tma


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
