"""Gradient filtering, vocabulary ordering, the low-memory path, z-loss and the differentiable lse, under
Triton's interpreter, against fp64 torch on materialised logits.

The filtering tests use real inputs where they can: hidden states of the real Gemma-3-270m on real text and
its real LM head, restricted to a slice of the vocabulary (every target plus other real rows) so that the
interpreter can run them.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hf_lsce import linear_cross_entropy
from hf_lsce.ops.train_pass import triton_train_pass, vocabulary_order


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


@pytest.fixture(scope="module")
def real_slice():
    """(h (N, D) fp32, W (V', D) fp32, y (N,)): Gemma-3-270m's hidden states on real text (N = 128: two row
    blocks) and a slice of its real head holding every target and the rows most likely on average (the real
    softmax's head), V' = 1024 (eight vocabulary tiles)."""
    from hf_lsce.checkpoints import CHECKPOINTS, is_installed

    if not is_installed("gemma-3-270m"):
        pytest.skip(f"gemma-3-270m is not installed ({CHECKPOINTS['gemma-3-270m'].install})")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from real_inputs import capture

    h, y, w = capture("gemma-3-270m", 128, seq=128)
    top = torch.argsort(w @ h.mean(0), descending=True)[:1024]
    keep = torch.unique(torch.cat([y, top]))[:1024]
    keep = torch.unique(torch.cat([y, keep]))
    remap = torch.full((w.shape[0],), -1, dtype=torch.long)
    remap[keep] = torch.arange(keep.numel())
    return h, w[keep].contiguous(), remap[y]


def _gm(h, w, y, **kw):
    n = h.shape[0]
    scale = torch.full((n,), 1.0 / n)
    b = torch.full((n,), kw.pop("b", 0.0))
    info = {}
    stats, dh, dw, db = triton_train_pass(h, w, None, y, b, scale, kw.pop("softcap", None), info=info, **kw)
    return stats, dh, dw, info


def test_filtered_gradients_on_real_inputs_within_the_stated_bound(real_slice):
    """eps = 2**-16 on the real softmax: the change in every row's dh is within the bound the skipped entries
    allow (each below eps: at most (entries skipped) * eps * max ||W_v|| times the row's weight), and the whole
    error is far below storing G in bf16."""
    h, w, y = real_slice
    n, v = h.shape[0], w.shape[0]
    loss, dh_ex, dw_ex, _ = _ref(h, w, y)
    _, dh, dw, info = _gm(h, w, y, filter_eps=2.0 ** -16, sort_vocab=True)
    assert info["skipped_tiles"] > 0.05  # the real softmax has negligible tiles even in this slice
    wmax = float(w.double().norm(dim=1).max())
    per_row = (dh.double() - dh_ex).norm(dim=1)
    bound = (1.0 / n) * v * 2.0 ** -16 * wmax  # every entry of a row skipped, each below eps
    assert float(per_row.max()) <= bound
    assert float(per_row.max()) <= (1.0 / n) * info["row_mass_bound"] * wmax + 1e-9  # the measured bound
    gb = torch.softmax(h.double() @ w.double().T, -1)
    gb[torch.arange(n), y] -= 1
    dh_bf16 = (gb / n).to(torch.bfloat16).double() @ w.double()  # the error bf16 storage of G alone costs
    assert rel(dh, dh_ex) < rel(dh_bf16, dh_ex) and rel(dw, dw_ex) < 1e-3


@pytest.mark.parametrize("b,sort", [(0.0, False), (0.1, True), (0.1, False)])
def test_filtering_at_tiny_eps_is_exact(real_slice, b, sort):
    """A threshold below every entry keeps every tile: the sparse products (and the exact rank-one smoothing
    term, the vocabulary permutation) give the fp64 gradients to fp32 accuracy."""
    h, w, y = real_slice
    _, dh_ex, dw_ex, _ = _ref(h, w, y, b=b)
    _, dh, dw, info = _gm(h, w, y, b=b, filter_eps=1e-30, sort_vocab=sort)
    assert rel(dh, dh_ex) < 1e-5 and rel(dw, dw_ex) < 1e-5


def test_sorting_the_vocabulary_makes_more_tiles_skippable(real_slice):
    h, w, y = real_slice
    _, _, _, natural = _gm(h, w, y, filter_eps=2.0 ** -12, sort_vocab=False)
    _, _, _, ordered = _gm(h, w, y, filter_eps=2.0 ** -12, sort_vocab=True)
    assert ordered["skipped_tiles"] > natural["skipped_tiles"]
    order, inverse = vocabulary_order(h, w)
    assert torch.equal(order[inverse], torch.arange(w.shape[0]))
    mean_logit = w @ h.mean(0)
    assert bool((mean_logit[order][:-1] >= mean_logit[order][1:]).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_filtered_path_through_the_op_with_stats_and_bias(dtype):
    """The op itself with filter_eps > 0 (sorted): loss and argmax unchanged by the permutation; gradients of a
    peaked softmax (most tiles negligible) within rounding; bias gradient through the un-permutation."""
    g = torch.Generator().manual_seed(3)
    n, d, v = 130, 24, 700
    w = torch.randn(v, d, generator=g, dtype=torch.float64) / d ** 0.5
    y = torch.randint(0, 60, (n,), generator=g)
    h = 0.3 * torch.randn(n, d, generator=g, dtype=torch.float64) + 40 * w[y] / w[y].norm(dim=-1, keepdim=True)
    bias = torch.randn(v, generator=g, dtype=torch.float64) * 0.1
    y[::7] = -100
    ref = _ref(h, w, y, b=0.1, bias=bias)
    hh, ww, bb = (t.to(dtype).requires_grad_() for t in (h, w, bias))
    loss, stats = linear_cross_entropy(hh, ww, y, bias=bb, label_smoothing=0.1, backend="triton",
                                       filter_eps=2.0 ** -16, return_stats=True)
    loss.backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert abs(float(loss) - float(ref[0])) / float(ref[0]) < max(tol, 1e-5)
    assert rel(hh.grad, ref[1]) < tol and rel(ww.grad, ref[2]) < tol and rel(bb.grad, ref[3]) < tol
    z = h @ w.T + bias
    assert torch.equal(stats.argmax, z.argmax(-1))


# ------------------------------------------------------------------------------------------------- z-loss
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_z_loss_against_torch(backend, reduction, softcap):
    """z_loss * lse^2 per token and its gradient 2 z_loss lse p: the one-pass path (mean) and the recomputing
    backward (reduction='none' with uneven upstream weights), with smoothing."""
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


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_differentiable_lse_output(backend):
    """return_lse: the per-token log-sum-exp, and a loss built on it (with the smoothed loss) back-propagates."""
    g = torch.Generator().manual_seed(6)
    n, d, v = 23, 12, 90
    h, w = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g) / 3
    y = torch.randint(0, v, (n,), generator=g)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, lse = linear_cross_entropy(hh, ww, y, label_smoothing=0.1, return_lse=True, backend=backend)
    (loss + 0.3 * (lse ** 2).mean()).backward()
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    z = h64 @ w64.T
    ref = F.cross_entropy(z, y, label_smoothing=0.1) + 0.3 * (torch.logsumexp(z, -1) ** 2).mean()
    ref.backward()
    assert torch.allclose(lse.detach().double(), torch.logsumexp(z, -1).detach(), atol=1e-5)
    assert rel(hh.grad, h64.grad) < 1e-5 and rel(ww.grad, w64.grad) < 1e-5


# ------------------------------------------------------------------------------------------ low memory
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["plain", "smoothing+bias", "softcap+z_loss"])
def test_low_memory_mode_equals_the_default_path(dtype, case, monkeypatch):
    """memory='low' (vocabulary chunks, fp32 dh accumulator) against the default one-pass path and fp64."""
    from hf_lsce.ops import config

    monkeypatch.setattr(config, "LOW_MEMORY_CHUNK_BYTES", 37 * 4 * 60)  # several vocabulary chunks here
    import hf_lsce.ops.train_pass as tp

    monkeypatch.setattr(tp, "LOW_MEMORY_CHUNK_BYTES", 37 * 4 * 60)
    g = torch.Generator().manual_seed(7)
    n, d, v = 37, 20, 333
    h, w = torch.randn(n, d, generator=g) * 2, torch.randn(v, d, generator=g) / 4
    y = torch.randint(0, v, (n,), generator=g)
    y[::5] = -100
    kw = dict(plain={}, **{"smoothing+bias": dict(label_smoothing=0.2), "softcap+z_loss": dict(softcap=3.0,
                                                                                                 z_loss=1e-3)})[case]
    bias = torch.randn(v, generator=g) * 0.2 if case == "smoothing+bias" else None
    grads = {}
    for mode in ("fast", "low"):
        hh, ww = h.to(dtype).clone().requires_grad_(), w.to(dtype).clone().requires_grad_()
        bb = bias.to(dtype).clone().requires_grad_() if bias is not None else None
        loss = linear_cross_entropy(hh, ww, y, bias=bb, backend="triton", memory=mode, **kw)
        loss.backward()
        grads[mode] = (loss.detach(), hh.grad, ww.grad, bb.grad if bb is not None else None)
    ref = _ref(h.to(dtype).float(), w.to(dtype).float(), y, b=kw.get("label_smoothing", 0.0),
               z_loss=kw.get("z_loss", 0.0), softcap=kw.get("softcap"),
               bias=bias.to(dtype).float() if bias is not None else None)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for k in range(4):
        if grads["low"][k] is None:
            continue
        assert rel(grads["low"][k], ref[k]) < tol, k
        assert rel(grads["low"][k], grads["fast"][k]) < tol, k


def test_low_memory_mode_allocates_no_chunk_of_rows_by_vocabulary(monkeypatch):
    """The largest tensor the low-memory path creates (in bytes) is the weight's gradient, the fp32 dh accumulator
    or a vocabulary chunk, never an N x V buffer (the fast path's chunk of rows is N x V here). Bytes, because
    Triton's interpreter copies each kernel argument's storage as bytes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import hf_lsce.ops.train_pass as tp

    monkeypatch.setattr(tp, "LOW_MEMORY_CHUNK_BYTES", 64 * 4 * 100)

    class Biggest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.biggest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.biggest = max(self.biggest, t.numel() * t.element_size())
            return out

    n, d, v = 64, 16, 2000
    g = torch.Generator().manual_seed(8)
    h = torch.randn(n, d, generator=g).requires_grad_()
    w = (torch.randn(v, d, generator=g) / 4).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g)
    with Biggest() as mode:
        linear_cross_entropy(h, w, y, backend="triton", memory="low").backward()
    assert mode.biggest <= 4 * max(v * d, n * 100, n * d), mode.biggest  # the weight's own gradient is V x D
    assert mode.biggest < 4 * n * v


def test_fp32_accumulation_of_dw_across_chunks(monkeypatch):
    """accum_dtype=float32: bf16 dW accumulated in fp32 over many row chunks is closer to fp64 than one bf16
    rounding per chunk."""
    import hf_lsce.ops.train_pass as tp

    g = torch.Generator().manual_seed(9)
    n, d, v = 96, 16, 130
    h, w = torch.randn(n, d, generator=g) * 2, torch.randn(v, d, generator=g) / 4
    y = torch.randint(0, v, (n,), generator=g)
    ref = _ref(h.bfloat16().float(), w.bfloat16().float(), y)
    errs = {}
    for acc in (None, torch.float32):
        hh, ww = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
        monkeypatch.setattr(tp, "TRAIN_CHUNK_BYTES", 8 * v * 4)  # 12 chunks of 8 rows
        linear_cross_entropy(hh, ww, y, backend="triton", accum_dtype=acc).backward()
        errs[acc] = rel(ww.grad, ref[2])
    assert errs[torch.float32] < errs[None] and errs[torch.float32] < 5e-3


def test_auto_policies_on_this_machine():
    """On a CPU the automatic choices keep the exact path: no filtering, the fast memory mode."""
    from hf_lsce.ops.linear_cross_entropy import _resolve_memory

    h, w = torch.randn(4, 8), torch.randn(20000, 8)
    assert _resolve_memory("auto", True, h, w, None, False) == "fast"
    with pytest.raises(ValueError, match="memory"):
        linear_cross_entropy(h, w, torch.zeros(4, dtype=torch.long), memory="tiny")
    with pytest.raises(ValueError, match="z_loss"):
        linear_cross_entropy(h, w, torch.zeros(4, dtype=torch.long), z_loss=-1.0)
    with pytest.raises(ValueError, match="accum_dtype"):
        linear_cross_entropy(h, w, torch.zeros(4, dtype=torch.long), accum_dtype=torch.float16)
