"""The checks of values on the device (bad targets, a tensor num_items_in_batch, per-token b) without host
synchronisation, and a training call of the op that reads no device value on the host.

On CUDA the checks are asynchronous (hf_lsce/ops/checks.py); here, on the CPU, that mode is forced by
patching ``checks.synchronous``: the same code runs, with the summary already on the host. The oracle for the
losses and gradients is fp64 torch on materialised logits (test_ops.reference).
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_lsce import linear_cross_entropy
from hf_lsce.ops import checks
from test_ops import make_inputs, reference, rel

BACKENDS = ["torch", "triton"]


@pytest.fixture
def asynchronous(monkeypatch):
    monkeypatch.setattr(checks, "synchronous", lambda device: False)
    checks._PENDING.clear()
    yield
    checks._PENDING.clear()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_bad_target_gives_nan_loss_no_gradient_then_raises_at_the_next_call(asynchronous, backend, reduction):
    h, w, y, _ = make_inputs(seed=3)
    bad = y.clone()
    bad[4] = w.shape[0] + 7  # out of range: the kernels must not read row V + 7 of W
    hh, ww = h.float().requires_grad_(), w.float().requires_grad_()
    loss = linear_cross_entropy(hh, ww, bad, label_smoothing=0.1, backend=backend, reduction=reduction)
    assert torch.isnan(loss).all()
    loss.sum().backward()
    assert float(hh.grad.abs().max()) == 0 and float(ww.grad.abs().max()) == 0
    with pytest.raises(ValueError, match=rf"targets must be in \[0, {w.shape[0]}\).*found {w.shape[0] + 7}.*"
                                         r"found after the call"):
        linear_cross_entropy(hh.detach(), ww.detach(), y, backend=backend)
    # reported once; the next good call is exact
    got = linear_cross_entropy(hh.detach(), ww.detach(), y, label_smoothing=0.1, backend=backend)
    assert rel(got, reference(h, w, y, smoothing=0.1)[0]) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_num_items_and_smoothing_raise_from_raise_pending_errors(asynchronous, backend):
    h, w, y, _ = make_inputs(seed=4)
    loss = linear_cross_entropy(h.float(), w.float(), y, reduction="sum", num_items_in_batch=torch.tensor(0),
                                backend=backend)
    assert torch.isnan(loss)
    with pytest.raises(ValueError, match="num_items_in_batch is 0 but .* tokens carry a loss"):
        checks.raise_pending_errors()
    b = torch.full(y.shape, 0.1)
    b[2] = 1.5
    tok = linear_cross_entropy(h.float(), w.float(), y, label_smoothing=b, reduction="none", backend=backend)
    assert torch.isnan(tok).all()
    with pytest.raises(ValueError, match=r"label_smoothing values must lie in \[0, 1\]"):
        checks.raise_pending_errors()
    checks.raise_pending_errors()  # nothing left


def test_synchronous_checks_on_cpu_raise_from_the_call():
    h, w, y, _ = make_inputs(seed=5)
    y = y.clone()
    y[0] = -3
    with pytest.raises(ValueError, match=r"found -3 \(1 bad entries\)"):
        linear_cross_entropy(h, w, y)
    assert not checks._PENDING


class _HostReads(TorchDispatchMode):
    """Records the ops that read a device value on the host (a blocking synchronisation on CUDA)."""
    SYNCING = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
               "aten.is_nonzero.default", "aten.equal.default"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in self.SYNCING:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", ["torch fp32", "fused rows", "fused columns"])
@pytest.mark.parametrize("upstream", [1.0, 0.25])
def test_a_training_call_reads_no_device_value_on_the_host(asynchronous, monkeypatch, upstream, case):
    """A training call (a reduced loss, a tensor num_items_in_batch as the Trainer passes, per-token b), by the torch
    computation and the fused layouts, reads nothing back: no .item(), bool(), .tolist() or data-dependent shape."""
    import hf_lsce.ops.budget as bud
    from hf_lsce.ops.budget import Plan

    dtype = torch.float32 if case == "torch fp32" else torch.bfloat16
    if case != "torch fp32":
        plan = Plan("fused", "rows", rows=1 << 20) if case == "fused rows" else Plan("fused", "columns", cols=64)
        monkeypatch.setattr(bud, "plan_for", lambda *a, **k: plan)
    tolists = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: tolists.append(1) or real_tolist(self))
    h, w, y, _ = make_inputs(seed=6)
    b = torch.full(y.shape, 0.1)
    hh, ww = h.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
    n_items = (y != -100).sum() + 3
    with _HostReads() as reads:
        loss = linear_cross_entropy(hh, ww, y, label_smoothing=b, reduction="sum", num_items_in_batch=n_items,
                                    backend="triton")
        (upstream * loss).backward()
    assert reads.seen == [] and tolists == []
    _, gh, gw, _ = reference(h.to(dtype).double(), w.to(dtype).double(), y, smoothing=0.1, reduction="sum",
                             num_items=float(n_items))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel(hh.grad, upstream * gh) < tol and rel(ww.grad, upstream * gw) < tol
    checks.raise_pending_errors()  # and the checks passed


def test_scale_kernel_touches_nothing_at_one_and_scales_otherwise():
    from hf_lsce.ops.matmul import scale_by

    t = torch.randn(3000).to(torch.bfloat16)
    u = torch.randn(1500)  # a second tensor of another dtype and size, in the same launch
    keep, keep_u = t.clone(), u.clone()
    scale_by([t, None, u], torch.ones(1))
    assert torch.equal(t, keep) and torch.equal(u, keep_u)
    assert scale_by([t, None, u], torch.full((1,), 0.3))[1] is None
    # one bf16 rounding of the fp32 product (the interpreter truncates where the GPU rounds to nearest)
    assert torch.allclose(t.float(), keep.float() * 0.3, rtol=2 ** -7, atol=0)
    assert not torch.allclose(t.float(), keep.float(), rtol=0.1)
    assert torch.allclose(u, keep_u * 0.3, rtol=1e-6, atol=0)
    v = torch.randn(700).to(torch.bfloat16)  # a third tensor: a second launch
    keep_v = v.clone()
    scale_by([t, u, v], torch.full((1,), 2.0))
    assert torch.equal(v.float(), keep_v.float() * 2.0)
    # fp16's kept gradients: fp32, cast by the same pass that multiplies them by the upstream factor and gamma (new
    # tensors: the fp32 ones untouched), beside one scaled in place; a factor of 1 still casts
    k32 = torch.randn(2500)
    keep_k = k32.clone()
    half, same = scale_by([k32, v], torch.full((1,), 3.0), (torch.float16, None), gamma=torch.full((1,), 2.0 ** -4))
    assert half.dtype == torch.float16 and torch.equal(k32, keep_k) and same is v
    assert torch.allclose(half.float(), keep_k * (3.0 / 16), rtol=2 ** -10, atol=6e-8)  # (one fp16 rounding)
    assert torch.allclose(v.float(), keep_v.float() * (2.0 * 3.0 / 16), rtol=2 ** -7, atol=0)
    cast = scale_by([k32], torch.ones(1), (torch.float16,))[0]
    assert cast.dtype == torch.float16 and torch.allclose(cast.float(), keep_k, rtol=2 ** -10, atol=0)


def test_trainer_raises_a_bad_last_batch_when_training_ends(asynchronous, tmp_path):
    """A bad label in the last step's batch has no next call of the op to report it: Trainer.train (hooked by the
    patch) waits for the device checks when it returns and raises the op's ValueError."""
    from transformers import Trainer, TrainingArguments

    from hf_lsce import apply_lsce_patch
    from tiny_models import V, TokenRows, tiny_model

    model = apply_lsce_patch(tiny_model("llama"))
    data = TokenRows(n=4)
    data.rows[3]["labels"] = data.rows[3]["labels"].clone()
    data.rows[3]["labels"][1] = V + 5  # outside the vocabulary, in the second (last) step's batch
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, learning_rate=0.1,
                             optim="sgd", label_smoothing_factor=0.1, report_to=[], save_strategy="no",
                             use_cpu=True, seed=0, max_grad_norm=0.0, dataloader_drop_last=True)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.get_train_dataloader = lambda: torch.utils.data.DataLoader(data, batch_size=2, shuffle=False)
    with pytest.raises(ValueError, match=rf"targets must be in \[0, {V}\).*found {V + 5}.*found after the call"):
        trainer.train()
    assert trainer.state.global_step == 2  # both steps ran: the error came when training returned
    assert not checks._PENDING


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("smoothing", ["number", "tensor"])
@pytest.mark.parametrize("items", [None, "tensor", "number", "zero"])
@pytest.mark.parametrize("bad", [False, True])
@pytest.mark.parametrize("ig", [-100, 3])
def test_the_one_launch_preparation_equals_the_torch_one(shift, smoothing, items, bad, ig):
    """prepare.prepare (the Triton path's ids, smoothing, token weights, divisor and checks in one launch) against the
    torch computation the other backends run (checks._summary, loss_denominator), value for value."""
    import torch.nn.functional as F

    from hf_lsce.ops.linear_cross_entropy import loss_denominator
    from hf_lsce.ops.prepare import prepare

    g = torch.Generator().manual_seed(11)
    V = 50
    y = torch.randint(0, V, (3, 41), generator=g)
    y[torch.rand(y.shape, generator=g) < 0.2] = ig
    b = torch.rand(y.shape, generator=g) * 0.3 if smoothing == "tensor" else 0.1
    if bad:
        y[1, 7], y[2, 3] = V + 4, -7
        if smoothing == "tensor":
            b[0, 5], b[2, 9] = 1.5, float("nan")
    num = {None: None, "tensor": torch.tensor(77), "number": 77, "zero": 0}[items]
    t1, b1, tw, values, divisor, flag = prepare(y, b, ig, V, shift, num, divide=True)

    ys = F.pad(y, (0, 1), value=ig)[..., 1:] if shift else y
    ref_t1 = torch.where((ys == ig) | (ys >= V) | (ys < 0), -1, ys).reshape(-1)
    valid = ref_t1 >= 0
    bs = None
    if smoothing == "tensor":
        bs = F.pad(b, (0, 1), value=0.0)[..., 1:] if shift else b
    ref_values, ref_bad = checks._summary(y, V, ig, num, valid.sum(), bs)
    ref_b1 = bs.reshape(-1).nan_to_num(0.0).clamp(0, 1) if bs is not None else torch.full((y.numel(),), 0.1)
    ref_div = loss_denominator(num, valid.sum())
    assert torch.equal(t1, ref_t1)
    assert torch.equal(b1, ref_b1.float())
    keep = [0, 2, 3, 4, 5] + ([1] if ref_values[0] > 0 else [])  # the first bad target: only where there is one
    assert torch.equal(values[keep], ref_values[keep]) and (ref_values[0] > 0) == bad
    assert bool(flag) == bool(ref_bad)
    assert float(divisor) == float(ref_div)
    # the token weights: all 0 where a check failed (the NaN loss passes no gradient)
    ok = 0.0 if bool(ref_bad) else 1.0
    assert torch.allclose(tw, valid.float() * ok / float(ref_div), rtol=1e-7, atol=0)
    _, _, tw_sum, _, one, flag_sum = prepare(y, b, ig, V, shift, None, divide=False)
    ok = 0.0 if bool(checks._summary(y, V, ig, None, valid.sum(), bs)[1]) else 1.0  # (no num_items_in_batch now)
    assert bool(flag_sum) == (ok == 0.0)
    assert torch.equal(tw_sum, valid.float() * ok) and float(one) == 1.0
