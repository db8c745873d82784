"""The op and the patched forward inside ``torch.compile(fullgraph=True)`` (CPU: the torch backend, and the Triton
kernels under the interpreter), against fp64 cross-entropy on materialised logits and against HF's own loss."""
import importlib

import pytest
import torch
import torch.nn.functional as F

from hf_lsce import linear_cross_entropy
from hf_lsce.ops.budget import Plan
from tests.test_ops import make_inputs, reference, rel
from tests.tiny_models import tiny_model

B = 0.1
paths_module = importlib.import_module("hf_lsce.ops.paths")  # the recomputing backward lives there
budget_module = importlib.import_module("hf_lsce.ops.budget")  # where each call's plan is decided


# (backend, dtype, the plan forced; None: the op's own)
CASES = {"torch fp32": ("torch", torch.float32, None), "fused rows": ("triton", torch.bfloat16, Plan("fused", "rows",
         rows=37)), "fused columns": ("triton", torch.bfloat16, Plan("fused", "columns", keep=0, cols=64))}


def _case(monkeypatch, name):
    backend, dtype, plan = CASES[name]
    if plan is not None:
        monkeypatch.setattr(budget_module, "plan_for", lambda *a, **k: plan)
    return backend, dtype, 1e-5 if dtype == torch.float32 else 2e-2


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="aot_eager")  # the graph is what matters; inductor adds minutes


@pytest.mark.parametrize("items", ["tensor", "int"])
@pytest.mark.parametrize("case", list(CASES))
def test_op_compiles_fullgraph_and_matches_fp64(case, items, monkeypatch):
    """``num_items_in_batch`` as the Trainer passes it (a tensor) and as a number (a compiled training call failed on
    a number before 2026-11-26: the operator takes a tensor divisor): the compiled reduced loss computes its gradients
    in the forward, as eagerly (no recomputing backward), for the torch computation and the fused layouts."""
    backend, dtype, tol = _case(monkeypatch, case)
    h, w, y, b = make_inputs(bias=True, peaked=True)
    items = torch.tensor(41) if items == "tensor" else 41

    def loss_fn(h, w, b, y):
        return linear_cross_entropy(h, w, y, bias=b, label_smoothing=B, num_items_in_batch=items, backend=backend)

    recomputed = []
    original = paths_module.loss_gradients
    for where in ("hf_lsce.ops.linear_cross_entropy", "hf_lsce.ops.compiled"):  # the name each module calls it by
        monkeypatch.setattr(importlib.import_module(where), "loss_gradients",
                            lambda *a, **k: (recomputed.append(1), original(*a, **k))[1])
    results = []
    for fn in (loss_fn, _compiled(loss_fn)):
        hc, wc, bc = (t.to(dtype).requires_grad_() for t in (h, w, b))
        loss = fn(hc, wc, bc, y)
        loss.backward()
        results.append((loss.detach(), hc.grad, wc.grad, bc.grad))
    assert not recomputed
    ref = reference(h.to(dtype).double(), w.to(dtype).double(), y, b.to(dtype).double(), smoothing=B, num_items=41)
    assert abs(results[1][0].item() - ref[0].item()) < 1e-5 * abs(ref[0].item())
    for eager, compiled, want in zip(results[0][1:], results[1][1:], ref[1:]):
        assert torch.equal(eager, compiled)
        assert rel(compiled, want) < tol


def test_per_token_losses_stats_and_lse_gradient_under_compile():
    """reduction='none' with statistics, z-loss and a loss on the returned lse (the recomputing backward)."""
    h, w, y, _ = make_inputs(peaked=True)
    z_loss = 1e-3

    def loss_fn(h, w, y):
        tok, stats, lse = linear_cross_entropy(h, w, y, label_smoothing=B, reduction="none", return_stats=True,
                                               return_lse=True, z_loss=z_loss, backend="triton")
        return (tok * torch.linspace(0.5, 1.5, tok.shape[0])).sum() + 0.01 * lse.sum(), stats.argmax, stats.valid

    hc, wc = (t.float().requires_grad_() for t in (h, w))
    loss, argmax, valid = _compiled(loss_fn)(hc, wc, y)
    loss.backward()
    hr, wr = (t.detach().clone().requires_grad_() for t in (h, w))
    z = hr @ wr.T
    lse = torch.logsumexp(z, -1)
    tok = F.cross_entropy(z, y, label_smoothing=B, reduction="none") + z_loss * torch.where(y != -100, lse * lse, 0)
    ref = (tok * torch.linspace(0.5, 1.5, tok.shape[0], dtype=torch.float64)).sum() + 0.01 * lse.sum()
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-5 * abs(ref.item())
    # (fp32: the lse from BLAS's logits, the recomputing backward's from the kernel's dots, two summation orders; a
    # peaked softmax's target gradient p - (1 - b) amplifies their 1e-7 difference)
    assert rel(hc.grad, hr.grad) < 3e-5 and rel(wc.grad, wr.grad) < 3e-5
    assert torch.equal(valid, y != -100) and torch.equal(argmax, z.argmax(-1))


def test_bad_targets_raise_from_a_compiled_call():
    h, w, y, _ = make_inputs()
    fn = _compiled(lambda h, w, y: linear_cross_entropy(h, w, y, label_smoothing=B, backend="torch"))
    fn(h.float(), w.float(), y)
    y = y.clone()
    y[3] = w.shape[0] + 5
    with pytest.raises(ValueError, match=rf"targets must be in \[0, {w.shape[0]}\).*found {w.shape[0] + 5}"):
        fn(h.float(), w.float(), y)


def _stock_compiles_or_skip(stock, ids, labels):
    """Skips where the unpatched model itself cannot be compiled whole: torch 2.6's dynamo cannot trace transformers
    5's forward wrappers (``co_varnames``), whatever the loss. (Training passes ``use_cache=False``: the
    DynamicCache that transformers >= 5.2 builds otherwise cannot be traced by torch <= 2.8's dynamo either.)"""
    try:
        _compiled(stock)(input_ids=ids, labels=labels, use_cache=False)
    except torch._dynamo.exc.Unsupported as e:
        import transformers

        pytest.skip(f"the unpatched model does not compile whole under torch {torch.__version__} with transformers "
                    f"{transformers.__version__}: {str(e).splitlines()[0][:120]}")


def test_patched_model_compiles_fullgraph_with_hf_loss_and_proof():
    """A patched Llama under torch.compile(fullgraph=True): the loss and every gradient are HF's own smoothed loss on
    the unpatched model's logits, no logits are returned, and each compiled step is counted as a fused call when it
    runs (not only when it was traced)."""
    from hf_lsce.patching import ENGAGEMENT, apply_lsce_patch

    stock = tiny_model("llama")
    model = tiny_model("llama")
    apply_lsce_patch(model, label_smoothing=B)
    model.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 100, (2, 12), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100
    items = torch.tensor(15)

    logits = stock(input_ids=ids).logits.float()
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    ref = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1), label_smoothing=B,
                          reduction="sum") / items
    ref.backward()

    _stock_compiles_or_skip(stock, ids, labels)
    compiled = _compiled(model)
    before = ENGAGEMENT.fused_calls
    for step in range(2):
        model.zero_grad(set_to_none=True)
        out = compiled(input_ids=ids, labels=labels, num_items_in_batch=items, use_cache=False)
        out.loss.backward()
        assert out.logits is None
        assert ENGAGEMENT.fused_calls - before == step + 1
        assert abs(out.loss.item() - ref.item()) < 1e-5 * ref.item()
        for (name, p), q in zip(model.named_parameters(), stock.parameters()):
            assert rel(p.grad, q.grad) < 1e-4, name



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_per_token_losses_compile(dtype):
    """reduction='none' in bf16 and fp16 under torch.compile: the fused kernel's statistics hold each token's loss and
    nll as rows of one buffer, which the compiled operator returned as two aliasing outputs (torch refused the call
    from 1f96dbf to the fix). The compiled losses and nll equal the eager op's; the gradients are within half
    precision's rounding of fp64's (the eager op's training pass and the compiled forward's statistics, two kernels,
    agree to fp32's rounding)."""
    h, w, y, _ = make_inputs(peaked=True)

    def loss_fn(h, w, y):
        tok, stats = linear_cross_entropy(h, w, y, label_smoothing=B, reduction="none", return_stats=True,
                                          backend="triton")
        return tok.sum() * 3.0, tok.detach(), stats.nll

    results = []
    for fn in (loss_fn, _compiled(loss_fn)):
        hc, wc = (t.to(dtype).requires_grad_() for t in (h, w))
        loss, tok, nll = fn(hc, wc, y)
        loss.backward()
        results.append((tok, nll, hc.grad, wc.grad))
    hr, wr = (t.to(dtype).double().requires_grad_() for t in (h, w))
    z = hr @ wr.T
    (F.cross_entropy(z, y, label_smoothing=B, reduction="sum") * 3.0).backward()
    tok, nll = (F.cross_entropy(z, y, label_smoothing=b, reduction="none").detach() for b in (B, 0.0))
    for got in results:
        assert rel(got[0], tok) < 1e-5 and (got[1] - nll).abs().max() < 1e-5  # (nll: lse - z_y, fp32's cancellation)
        assert rel(got[2], hr.grad) < 1e-2 and rel(got[3], wr.grad) < 1e-2

@pytest.mark.parametrize("case", list(CASES))
def test_a_frozen_head_compiles(case, monkeypatch):
    """A frozen head without a bias (LoRA) under torch.compile: dW and db are both not needed, and the compiled
    operator's outputs may not alias one another (torch refuses the call); dh against fp64."""
    backend, dtype, tol = _case(monkeypatch, case)
    h, w, y, _ = make_inputs(peaked=True)
    hc = h.to(dtype).requires_grad_()
    loss = _compiled(lambda h, w, y: linear_cross_entropy(h, w, y, label_smoothing=B, backend=backend))(
        hc, w.to(dtype), y)
    loss.backward()
    ref, dh, _, _ = reference(h.to(dtype).double(), w.to(dtype).double(), y, smoothing=B)
    assert abs(loss.item() - ref.item()) < 1e-5 * abs(ref.item())
    assert rel(hc.grad, dh) < tol


@pytest.mark.parametrize("case", ["fused rows", "fused columns"])
def test_fp16_op_compiles_fullgraph_as_eagerly(case, monkeypatch):
    """fp16 inputs under torch.compile: the rows layout's fp16 mode and the columns layout's rescaled token weights
    (``matmul.fp16_weights``) run inside the compiled operators and give the eager op's loss and gradients, within
    fp16's rounding of fp64's."""
    _case(monkeypatch, case)
    h, w, y, b = make_inputs(bias=True, peaked=True)

    def loss_fn(h, w, b, y):
        return linear_cross_entropy(h, w, y, bias=b, label_smoothing=B, num_items_in_batch=41, backend="triton")

    grads = []
    for fn in (loss_fn, _compiled(loss_fn)):
        hc, wc, bc = (t.half().requires_grad_() for t in (h, w, b))
        loss = fn(hc, wc, bc, y)
        loss.backward()
        grads.append((loss.detach(), hc.grad, wc.grad, bc.grad))
    ref = reference(h.half().double(), w.half().double(), y, b.half().double(), smoothing=B, num_items=41)
    assert abs(grads[1][0].item() - ref[0].item()) < 1e-5 * abs(ref[0].item())
    for eager, compiled, want in zip(grads[0][1:], grads[1][1:], ref[1:]):
        assert torch.equal(eager, compiled)
        assert rel(compiled, want) < 5e-3
