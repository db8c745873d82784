"""The memory budget (``budget.py``: what each plan holds, the fastest within a budget, how a call picks its
computation and plan: ``budget.options``), and the options every computation serves (z-loss, a differentiable lse,
fp16's scaled weights), against fp64 torch on materialised logits."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import hf_lsce.ops.budget as bud
import hf_lsce.ops.config as config
from hf_lsce import linear_cross_entropy

# (N, D, V) of the benchmark's heads at 8,192 tokens, and Llama-3-8B at 32,768
HEADS = {"SmolLM2": (8192, 576, 49152), "Gemma-3-270m": (8192, 640, 262144), "Gemma2-2B": (8192, 2304, 256000),
         "Llama-3-8B": (8192, 4096, 128256), "Llama-3-8B 32k": (32768, 4096, 128256)}


def _ref(h, w, y, b=0.0, z_loss=0.0, softcap=None, bias=None, weights=None):
    """Loss (sum of per-token losses times weights) and fp64 gradients through materialised logits."""
    h = h.detach().double().requires_grad_()
    w = w.detach().double().requires_grad_()
    bb = bias.detach().double().requires_grad_() if bias is not None else None
    z = h @ w.T + (bb if bb is not None else 0)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    tok = F.cross_entropy(z, y, label_smoothing=b, reduction="none", ignore_index=-100)
    lse = torch.logsumexp(z, -1)
    tok = tok + z_loss * torch.where(y != -100, lse * lse, torch.zeros_like(lse))
    wts = weights if weights is not None else (y != -100).double() / max(int((y != -100).sum()), 1)
    loss = (tok * wts).sum()
    loss.backward()
    return loss.detach(), h.grad, w.grad, (bb.grad if bb is not None else None)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------- the budget's plans
@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("trainable", [True, False])
def test_plans_stay_within_their_budget_and_get_faster_with_more(head, trainable):
    """At every budget from the smallest to unlimited: a plan exists, its bytes are within the budget, and its modelled
    cost does not rise as the budget grows; unlimited, a trainable head keeps R for every row (three matmuls, dW
    written once) and a frozen one takes every column at once."""
    n, d, v = HEADS[head]
    s = bud.Shape(n, v, d, trainable, False, half=False, soft=False)
    least = bud.smallest(s, "fused")
    assert bud.best(s, least - 1, "fused") is None
    last = math.inf
    for budget in sorted({least, 2 * least, 10 ** 8, 2 * 10 ** 8, 5 * 10 ** 8, 10 ** 9, 2 * 10 ** 9, 4 * 10 ** 9,
                          16 * 10 ** 9}):
        if budget < least:
            continue
        plan = bud.best(s, budget, "fused")
        assert plan is not None and plan.nbytes <= budget, (budget, plan)
        assert plan.cost <= last + 1e-9, (budget, plan, last)
        last = plan.cost
    top = bud.best(s, None, "fused")
    assert (top.layout, top.rows) == ("rows", n) if trainable else (top.layout, top.cols) == ("frozen", v)


def test_small_budgets_keep_columns_and_recompute_the_rest():
    """Below R for every row, a trainable head keeps R for the columns the budget holds and recomputes the rest (the
    Llama-3-8B head at 1.1 GB: about a third kept); at the smallest budgets nothing is kept, and the accumulator of
    dh (``4 N D`` bytes) is what no plan goes below."""
    n, d, v = HEADS["Llama-3-8B"]
    s = bud.Shape(n, v, d, True, False, half=False, soft=False)
    mid = bud.best(s, int(1.1e9), "fused")
    assert mid.layout == "columns" and 0.2 * v < mid.keep < 0.5 * v, mid
    low = bud.best(s, bud.low_budget(s, "fused"), "fused")
    assert low.layout == "columns" and low.keep == 0 and low.cols >= 256
    assert 4 * n * d < bud.smallest(s, "fused") < 4 * n * d + 8 * 1024 * 1024
    # fp16 and soft-caps keep no columns (R in fp16 cannot give a cap's slope back; fp16 keeps R by running maxima;
    # its kept gradients are fp32, 1.2 GB more here)
    for half, soft in ((True, False), (False, True)):
        s2 = bud.Shape(n, v, d, True, False, half=half, soft=soft)
        assert bud.best(s2, int(2.2e9), "fused").keep == 0


def test_memory_low_is_about_180_mb_where_the_head_allows():
    """memory="low": 180 MiB at the benchmark's heads (at N = 8,192), more where the dh accumulator and a 32 MiB chunk
    need more (Llama-3-8B at 32,768 tokens: 537 MB of accumulator)."""
    for head, (n, d, v) in HEADS.items():
        s = bud.Shape(n, v, d, True, False, half=False, soft=False)
        low = bud.low_budget(s, "fused")
        assert low == (bud.LOW_BYTES if n == 8192 else bud.smallest(s, "fused", bud.MIN_CHUNK_BYTES)), head
        assert bud.best(s, low, "fused").nbytes <= low


def test_byte_model_counts_the_buffers_of_each_layout():
    """The byte models, from their definitions at the Gemma2-2B head (N = 8,192): R for every row and the rank-one
    term's two (bf16), a o h (bf16) and dh's fp32 product; chunks of rows add dW's fp32 accumulator; the columns
    layout holds dh's fp32 accumulator, the kept R and one chunk of G."""
    n, d, v = HEADS["Gemma2-2B"]
    s = bud.Shape(n, v, d, True, False, half=False, soft=False)
    state = bud._row_state(s, n)
    assert bud.rows_bytes(s, n) == (n + 2) * v * 2 + (n + 2) * d * 2 + n * d * 4 + state
    assert bud.rows_bytes(s, 1024) - bud._row_state(s, 1024) == 1026 * v * 2 + 1026 * d * 2 + 1024 * d * 4 + 4 * v * d
    assert bud.columns_bytes(s, 0, 4096) == 4 * n * d + state + 16 * n + n * 4096 * 2
    assert bud.columns_bytes(s, 1024, 4096) - bud.columns_bytes(s, 0, 4096) == (n + 2) * (1024 * 2 + d * 2) + 4 * d


# ---------------------------------------------------------------------------------------------- memory= at the op
@pytest.mark.parametrize("memory,exc,words", [
    (True, TypeError, "memory must be"), ("tiny", ValueError, "memory must be"), (-5, ValueError, "positive"),
    (0, ValueError, "positive"), (float("nan"), ValueError, "positive"), ("fast", ValueError, "retired"),
    ([1], TypeError, "memory must be")])
def test_bad_memory_is_refused_naming_it(memory, exc, words):
    h, w = torch.randn(4, 8), torch.randn(50, 8)
    with pytest.raises(exc, match=words) as err:
        linear_cross_entropy(h, w, torch.zeros(4, dtype=torch.long), memory=memory)
    assert "memory" in str(err.value)


def test_a_budget_below_the_smallest_names_the_smallest_before_any_kernel(monkeypatch):
    """A numeric budget no plan fits: one ValueError naming memory, the value and the smallest budget that works (which
    then runs), before any kernel runs (prepare's kernel, the first launch of a training call, never starts)."""
    import hf_lsce.ops.prepare as prepare

    g = torch.Generator().manual_seed(0)
    h = torch.randn(64, 32, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(520, 32, generator=g) / 6).bfloat16().requires_grad_()
    y = torch.randint(0, 520, (64,), generator=g)
    launched = []
    real = prepare.prepare
    monkeypatch.setattr(prepare, "prepare", lambda *a, **k: launched.append(1) or real(*a, **k))
    with pytest.raises(ValueError, match=r"memory=1000: below what the op needs at 64 tokens") as err:
        linear_cross_entropy(h, w, y, label_smoothing=0.1, backend="triton", memory=1000)
    assert not launched
    least = int(str(err.value).split("smallest budget that works is ")[1].split(" bytes")[0].replace(",", ""))
    loss = linear_cross_entropy(h, w, y, label_smoothing=0.1, backend="triton", memory=least)
    loss.backward()
    ref = _ref(h, w, y, b=0.1)
    assert rel(loss, ref[0]) < 1e-5 and rel(h.grad, ref[1]) < 2e-2 and rel(w.grad, ref[2]) < 2e-2


def test_auto_reads_free_memory_only_for_large_plans_and_refuses_what_does_not_fit(monkeypatch):
    """memory="auto" on a GPU queries its free memory (host time every call) only where the fastest plan, with the
    headroom, exceeds SMALL_BUFFER_FRACTION of the device; a budget the GPU cannot hold, numeric or automatic, is a
    ValueError naming memory, not an out-of-memory inside a kernel. (A pretend 80 GB GPU; shapes only.)"""
    reads = []
    monkeypatch.setattr(config, "device_memory", lambda device: 80 * 10 ** 9)
    monkeypatch.setattr(config, "free_cuda_memory", lambda device: reads.append(1) or FREE[0])
    FREE = [40 * 10 ** 9]
    cuda = torch.device("cuda", 0)
    small = bud.Shape(256, 49152, 576, True, False, half=False, soft=False)
    big = bud.Shape(8192, 256000, 2304, True, False, half=False, soft=False)  # Gemma2-2B's head
    assert bud.plan_for(small, "fused", "auto", cuda) == bud.best(small, None, "fused") and not reads
    assert bud.plan_for(big, "fused", "auto", cuda) == bud.best(big, None, "fused") and reads == [1]
    FREE[0] = 3 * 10 ** 9  # less than every row's R: the fastest plan within 3 GB / 1.25
    plan = bud.plan_for(big, "fused", "auto", cuda)
    assert plan.layout == "columns" and plan.nbytes <= 3 * 10 ** 9 / bud.HEADROOM
    huge = bud.Shape(1 << 18, 262144, 5376, True, False, half=False, soft=False)  # Gemma-3-27B, 262k tokens
    FREE[0] = 80 * 10 ** 9  # past the automatic cap, the smallest plan that free memory holds
    assert bud.plan_for(huge, "fused", "auto", cuda) == bud.best(huge, bud.smallest(huge, "fused"), "fused")
    FREE[0] = 10 ** 6
    with pytest.raises(ValueError, match="memory='auto': the GPU has 1 MB free"):
        bud.plan_for(big, "fused", "auto", cuda)
    with pytest.raises(ValueError, match=r"memory=9000000000: its plan takes .* but the GPU has 1 MB free"):
        bud.plan_for(big, "fused", "9000000000", cuda)


def test_torch_computation_chunks_within_the_budget(monkeypatch):
    """The torch computation (CPU here) takes as many rows a chunk as the budget holds, beyond the default chunk
    (two rows here) where the budget allows: results equal at every budget, down to one row a chunk."""
    from hf_lsce.ops import reference

    monkeypatch.setattr(reference, "_CHUNK_ELEMENTS", 2 * 700)
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(30, 16, generator=g), torch.randn(700, 16, generator=g) / 4
    y = torch.randint(0, 700, (30,), generator=g)
    s = bud.Shape(30, 700, 16, True, False, half=False, soft=False)
    assert bud.best(s, None, "torch").rows == 2 and bud.best(s, 10 ** 9, "torch").rows == 30
    grads = []
    for memory in ("auto", bud.torch_bytes(s, 20), bud.torch_bytes(s, 7), bud.torch_bytes(s, 1)):
        rows = {bud.torch_bytes(s, 20): 20, bud.torch_bytes(s, 7): 7, bud.torch_bytes(s, 1): 1}.get(memory)
        assert memory == "auto" or bud.best(s, memory, "torch").rows == rows
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        linear_cross_entropy(hh, ww, y, label_smoothing=0.1, memory=memory).backward()
        grads.append((hh.grad, ww.grad))
    for dh, dw in grads[1:]:
        assert rel(dh, grads[0][0]) < 1e-6 and rel(dw, grads[0][1]) < 1e-6


# ---------------------------------------------------------------------------------------------- the options
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_z_loss_against_torch(backend, reduction, softcap):
    """z_loss * lse^2 per token and its gradient 2 z_loss lse p (fp32: the torch computation either way), a reduced
    loss and per-token losses with uneven upstream weights, with smoothing."""
    g = torch.Generator().manual_seed(5)
    n, d, v = 41, 16, 150
    h, w = torch.randn(n, d, generator=g) * 2, torch.randn(v, d, generator=g) / 4
    y = torch.randint(0, v, (n,), generator=g)
    y[::6] = -100
    weights = torch.rand(n, generator=g, dtype=torch.float64) if reduction == "none" else None
    ref = _ref(h, w, y, b=0.1, z_loss=1e-2, softcap=softcap, weights=weights)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = linear_cross_entropy(hh, ww, y, label_smoothing=0.1, z_loss=1e-2, softcap=softcap, backend=backend,
                               reduction=reduction)
    (out if reduction == "mean" else (out.double() * weights).sum()).backward()
    got = float(out) if reduction == "mean" else float((out.double() * weights).sum())
    assert math.isclose(got, float(ref[0]), rel_tol=1e-5)
    assert rel(hh.grad, ref[1]) < 1e-5 and rel(ww.grad, ref[2]) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_differentiable_lse_output(dtype, softcap):
    """return_lse: the per-token log-sum-exp, and a loss built on it (with the smoothed loss) back-propagates through
    the recomputing backward (the fused computation's G epilogue with the lse's gradient in G's factor of p in half
    precision, the torch computation in fp32), with a bias."""
    g = torch.Generator().manual_seed(6)
    n, d, v = 23, 16, 90
    h, w = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g) / 3
    bias = torch.randn(v, generator=g) * 0.1
    y = torch.randint(0, v, (n,), generator=g)
    hh, ww, bb = (t.to(dtype).clone().requires_grad_() for t in (h, w, bias))
    loss, lse = linear_cross_entropy(hh, ww, y, bias=bb, label_smoothing=0.1, return_lse=True, backend="triton",
                                     softcap=softcap)
    (loss + 0.3 * (lse ** 2).mean()).backward()
    h64, w64, b64 = (t.to(dtype).double().requires_grad_() for t in (h, w, bias))
    z = h64 @ w64.T + b64
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    ref = F.cross_entropy(z, y, label_smoothing=0.1) + 0.3 * (torch.logsumexp(z, -1) ** 2).mean()
    ref.backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(lse.detach().double(), torch.logsumexp(z, -1).detach(), atol=1e-5)
    assert rel(hh.grad, h64.grad) < tol and rel(ww.grad, w64.grad) < tol and rel(bb.grad, b64.grad) < tol


LAYOUTS = {"rows": bud.Plan("fused", "rows", rows=48), "row chunks": bud.Plan("fused", "rows", rows=16),
           "columns": bud.Plan("fused", "columns", keep=0, cols=512), "torch": None}


def _force(monkeypatch, name):
    if name == "torch":
        monkeypatch.setattr(bud, "computation", lambda *a, **k: "torch")
    else:
        monkeypatch.setattr(bud, "plan_for", lambda *a, **k: LAYOUTS[name])


@pytest.mark.parametrize("name", list(LAYOUTS) + ["recomputing"])
def test_fp16_gradients_keep_their_digits_under_a_small_token_weight(name, monkeypatch):
    """fp16 with the token weight of a large batch (num_items_in_batch = 20,000: w = 5e-5): G = w (p - y) in fp16
    would sit almost all below fp16's normal range (dh 0.4 off fp64 on an H100 at N = 8,192). Every layout keeps G's
    digits (``matmul.fp16_weights``, or the rows layout's fp32 row factor): dh, dW, db within 5e-3 of fp64 (the
    recomputing backward: through a returned lse's gradient)."""
    g = torch.Generator().manual_seed(0)
    n, d, v = 48, 32, 2000
    h = torch.randn(n, d, generator=g).half()
    w = (torch.randn(v, d, generator=g) / d ** 0.5 * 2).half()
    bias = (torch.randn(v, generator=g) * 0.1).half()
    y = torch.randint(0, v, (n,), generator=g)
    if name != "recomputing":
        _force(monkeypatch, name)
    hh, ww, bb = (t.clone().requires_grad_() for t in (h, w, bias))
    out = linear_cross_entropy(hh, ww, y, bias=bb, label_smoothing=0.1, reduction="sum", num_items_in_batch=20000,
                               backend="triton", return_lse=name == "recomputing")
    loss = out[0] + 1e-4 * out[1].sum() if name == "recomputing" else out
    loss.backward()
    h64, w64, b64 = (t.double().requires_grad_() for t in (h, w, bias))
    z = h64 @ w64.T + b64
    ref = F.cross_entropy(z, y, label_smoothing=0.1, reduction="sum") / 20000
    if name == "recomputing":
        ref = ref + 1e-4 * torch.logsumexp(z, -1).sum()
    ref.backward()
    for got, want in ((hh.grad, h64.grad), (ww.grad, w64.grad), (bb.grad, b64.grad)):
        assert rel(got, want) < 5e-3, (name, rel(got, want))  # (G in fp16 as it was: 1.0-1.8e-2)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fp16_gradients_take_a_loss_scale_before_their_rounding(name, monkeypatch):
    """fp16 with a loss scaler's factor (2^16, as torch.amp.GradScaler's first) on the loss of a large batch (w = 5e-6):
    dh and dW at scale 1 would sit in fp16's subnormal range, which the factor applied afterwards cannot undo. Every
    layout keeps them in fp32 until backward multiplies them by the upstream gradient (``matmul.kept_dtype``), so
    they keep fp16's digits: within 1e-3 of fp64 (rounded at scale 1 first: 9.8e-3 and 2.2e-2 here)."""
    g = torch.Generator().manual_seed(1)
    n, d, v = 48, 32, 2000
    h = torch.randn(n, d, generator=g).half()
    w = (torch.randn(v, d, generator=g) / d ** 0.5 * 2).half()
    y = torch.randint(0, v, (n,), generator=g)
    _force(monkeypatch, name)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy(hh, ww, y, label_smoothing=0.1, reduction="sum", num_items_in_batch=200000,
                                backend="triton")
    (loss * 65536.0).backward()
    assert hh.grad.dtype == ww.grad.dtype == torch.float16
    h64, w64 = (t.double().requires_grad_() for t in (h, w))
    (F.cross_entropy(h64 @ w64.T, y, label_smoothing=0.1, reduction="sum") / 200000 * 65536.0).backward()
    assert rel(hh.grad, h64.grad) < 1e-3, rel(hh.grad, h64.grad)
    assert rel(ww.grad, w64.grad) < 1e-3, rel(ww.grad, w64.grad)


@pytest.mark.parametrize("name", ["rows", "columns", "torch"])
def test_fp16_per_token_losses_take_gamma_back_in_backward(name, monkeypatch):
    """fp16's kept gradients are divided by gamma (a power of two), and backward multiplies it back as it casts them
    (``paths.finish_gradients``): per-token losses with a uniform upstream factor (the kept gradients times one
    constant), then a second backward through the same graph (recomputed), both within 1e-3 of fp64 and equal."""
    g = torch.Generator().manual_seed(2)
    n, d, v = 40, 32, 1500
    h = torch.randn(n, d, generator=g).half()
    w = (torch.randn(v, d, generator=g) / d ** 0.5 * 2).half()
    y = torch.randint(0, v, (n,), generator=g)
    y[::7] = -100
    _force(monkeypatch, name)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    per = linear_cross_entropy(hh, ww, y, label_smoothing=0.1, reduction="none", backend="triton")
    (per.sum() * 3.0).backward(retain_graph=True)
    first = hh.grad.clone(), ww.grad.clone()
    hh.grad = ww.grad = None
    (per.sum() * 3.0).backward()
    assert torch.equal(hh.grad, first[0]) and torch.equal(ww.grad, first[1])
    h64, w64 = (t.double().requires_grad_() for t in (h, w))
    (F.cross_entropy(h64 @ w64.T, y, label_smoothing=0.1, reduction="sum") * 3.0).backward()
    assert rel(hh.grad, h64.grad) < 1e-3 and rel(ww.grad, w64.grad) < 1e-3, (rel(hh.grad, h64.grad),
                                                                              rel(ww.grad, w64.grad))
