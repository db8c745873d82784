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
from hf_lsce.ops.sparse import vocabulary_order
from hf_lsce.ops.train_pass import triton_train_pass


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
    blocks) and a slice of its real head, V' = 1024 (eight vocabulary tiles): every target, the 384 rows most
    likely on average (the real softmax's head) and rows of its tail (evenly spaced in the mean-logit order)."""
    from hf_lsce.checkpoints import CHECKPOINTS, is_installed

    if not is_installed("gemma-3-270m"):
        pytest.skip(f"gemma-3-270m is not installed ({CHECKPOINTS['gemma-3-270m'].install})")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from real_inputs import capture

    h, y, w = capture("gemma-3-270m", 128, seq=128)
    ranked = torch.argsort(w @ h.mean(0), descending=True)
    tail = ranked[384:][torch.linspace(0, ranked.numel() - 385, 1024).long()]
    keep = torch.unique(torch.cat([y, ranked[:384]]))
    keep = torch.unique(torch.cat([keep, tail[~torch.isin(tail, keep)][: 1024 - keep.numel()]]))
    remap = torch.full((w.shape[0],), -1, dtype=torch.long)
    remap[keep] = torch.arange(keep.numel())
    return h, w[keep].contiguous(), remap[y]


def _grads(h, w, y, path, b=0.0, chunk_cols=512, **kw):
    """(dh, dW, info) of the mean smoothed loss through one training path's filtered products: "one-pass"
    (train_pass), "two-pass" (the column path, pointer G kernel) or "two-pass-tma" (the TMA G kernel)."""
    import dataclasses

    from hf_lsce.ops.backward import triton_gradients_by_columns
    from hf_lsce.ops.config import backward_config, forward_config
    from hf_lsce.ops.reference import torch_forward

    n = h.shape[0]
    scale = torch.full((n,), 1.0 / n)
    bb = torch.full((n,), b)
    info = {}
    if path == "one-pass":
        _, dh, dw, _ = triton_train_pass(h, w, None, y, bb, scale, None, info=info, **kw)
        return dh, dw, info
    lse = torch_forward(h, w, None, y, None)[0].float()
    cfg = backward_config(h.dtype, h.device)
    if path == "two-pass-tma":
        cfg = dataclasses.replace(forward_config(h.dtype, h.device), tma=True, min_programs=1)
    dh, dw, _ = triton_gradients_by_columns(h, w, None, y, lse, scale, bb, None, cfg, info=info,
                                            chunk_bytes=n * chunk_cols * h.element_size(), **kw)
    return dh, dw, info


def _masses(h, w, y, b):
    """fp64: each row's G without the uniform term, |p - (1 - b) onehot(y)|, and its L1 mass."""
    gp = torch.softmax(h.double() @ w.double().T, -1)
    rows = torch.arange(h.shape[0])
    gp[rows, y] -= 1 - b
    return gp.abs(), gp.abs().sum(1)


def _greedy_admitted(mass, target, budget, tile_n):
    """A loop over rows: each admits its smallest tiles while the running sum stays within its budget (never its
    target's tile; where masses tie at the cut, none of the tied ones); a block skips what all its rows admit."""
    r, t = mass.shape
    row_ok = torch.zeros(r, t, dtype=torch.bool)
    for i in range(r):
        order = sorted((j for j in range(t) if j != int(target[i])), key=lambda k: float(mass[i, k]))
        total, cut = 0.0, None
        for j in order:
            if total + float(mass[i, j]) > float(budget[i]):
                cut = float(mass[i, j])
                break
            total += float(mass[i, j])
            row_ok[i, j] = True
        if cut is not None:  # a tie at the cut: leave out every tile of that mass
            row_ok[i] &= ~((mass[i] == cut) & (mass[i] > 0))
    return torch.cat([row_ok, torch.ones(-r % tile_n, t, dtype=torch.bool)]).view(-1, tile_n, t).all(1)


@pytest.mark.parametrize("ties", [False, True])
def test_the_choice_of_tiles_matches_a_greedy_reference(ties):
    """The device-side choice (the choice kernel and the torch oracle ``admitted_tiles``) against a loop over rows,
    with ignored rows, out-of-range targets, zero budgets and masses tied at the cut; the lists agree with the
    flags and every row's loss is within its budget."""
    from hf_lsce.ops.sparse import admitted_tiles, filter_active

    g = torch.Generator().manual_seed(0)
    r, t, tile_n = 70, 9, 16
    mass = torch.rand(r, t, generator=g) ** 4
    if ties:
        mass = (mass * 8).round() / 8  # many equal masses
    budget = torch.rand(r, generator=g) * mass.sum(1) * 0.5
    target = torch.randint(-2, t + 2, (r,), generator=g)
    budget[5] = 0.0
    mass[6] = 0.0  # an ignored row: no mass, admits everything
    want = _greedy_admitted(mass, target, budget, tile_n)
    plan = filter_active(mass, target, budget, tile_n)
    assert torch.equal(~plan.active, want)
    assert torch.equal(admitted_tiles(mass, target, budget, tile_n), want)
    for blk in range(plan.active.shape[0]):
        cols = plan.row_idx[blk, : int(plan.row_cnt[blk])].long()
        assert torch.equal(cols, plan.active[blk].nonzero()[:, 0])
    for col in range(t):
        blks = plan.col_idx[col, : int(plan.col_cnt[col])].long()
        assert torch.equal(blks, plan.active[:, col].nonzero()[:, 0])
    lost = (mass * (~plan.active).repeat_interleave(tile_n, 0)[:r]).sum(1)
    assert bool((lost <= budget * (1 + 1e-6)).all())


@pytest.mark.parametrize("splits", [1, 3])
def test_sparse_products_against_masked_matmuls(splits):
    """dh = G W and dW = G^T h over the active tiles only (a random plan), with dh's lists split in parts (summed in
    a fixed order), the rank-one terms, accumulation and dW written through a permutation, against fp64 torch."""
    from hf_lsce.ops.sparse import TILE_N, TILE_V, plan_from_active, sparse_dh, sparse_dw

    gen = torch.Generator().manual_seed(9)
    r, v, d = 150, 700, 40
    g, w, h = torch.randn(r, v, generator=gen), torch.randn(v, d, generator=gen), torch.randn(r, d, generator=gen)
    active = torch.rand(-(-r // TILE_N), -(-v // TILE_V), generator=gen) < 0.5
    plan = plan_from_active(active)
    def dense(act, rows):
        mask = act.repeat_interleave(rows, 0)[:r].repeat_interleave(TILE_V, 1)[:, :v]
        return torch.where(mask, g, torch.zeros_like(g)).double()
    gm = dense(active, TILE_N)
    c, colsum = torch.rand(r, generator=gen), w.sum(0)
    dh = torch.randn(r, d, generator=gen)
    want = dh.double() + gm @ w.double() - c.double()[:, None] * colsum.double()[None, :]
    sparse_dh(g, w, plan, dh, rank1=c, colsum=colsum, accumulate=True, tuning=dict(SPLITS=splits))
    assert rel(dh, want) < 1e-5
    perm = torch.randperm(v, generator=gen)
    rvec = torch.randn(d, generator=gen)
    dw = torch.full((v, d), float("nan"))
    sparse_dw(g, h, plan, dw, first=True, rvec=rvec, perm=perm)
    want_dw = torch.empty(v, d, dtype=torch.float64)
    want_dw[perm] = gm.T @ h.double() - rvec.double()[None, :]
    assert rel(dw, want_dw) < 1e-5


@pytest.mark.parametrize("path,sort", [("one-pass", True), ("two-pass", True), ("two-pass-tma", False)])
def test_bounded_filter_on_real_inputs(real_slice, path, sort):
    """eps = 2**-6 on the real softmax (b = 0.1): tiles are skipped, and every row's dh moves by no more than the
    bound allows, ``scale_n * eps * ||G_n||_1 * max_v ||W_v||`` (fp64 masses, not the kernels' own report); dW
    moves by no more than ``sum_n scale_n eps ||G_n||_1 ||h_n||``; the kernels' reported skipped mass is within
    the budget too."""
    h, w, y = real_slice
    n, eps = h.shape[0], 2.0 ** -6
    _, dh_ex, dw_ex, _ = _ref(h, w, y, b=0.1)
    dh, dw, info = _grads(h, w, y, path, b=0.1, filter_eps=eps, sort_vocab=sort)
    assert float(info["skipped_tiles"]) > 0.1
    assert float(info["max_row_lost"]) <= eps * (1 + 1e-4)
    _, l1 = _masses(h, w, y, 0.1)
    wmax = float(w.double().norm(dim=1).max())
    per_row = (dh.double() - dh_ex).norm(dim=1)
    assert bool((per_row <= eps * l1 * wmax / n + 1e-7).all())
    dw_moved = float((dw.double() - dw_ex).norm(dim=1).sum())
    assert dw_moved <= float((eps * l1 * h.double().norm(dim=1)).sum() / n) + 1e-6
    assert 0 < rel(dh, dh_ex) < 0.05


@pytest.mark.parametrize("b,path,sort", [(0.0, "one-pass", False), (0.1, "one-pass", True),
                                         (0.1, "two-pass-tma", True)])
def test_filtering_at_tiny_eps_is_exact(real_slice, b, path, sort):
    """A budget below every tile keeps every tile: the sparse products (and the exact rank-one smoothing
    term, the vocabulary permutation, the column chunks) give the fp64 gradients to fp32 accuracy."""
    h, w, y = real_slice
    _, dh_ex, dw_ex, _ = _ref(h, w, y, b=b)
    dh, dw, info = _grads(h, w, y, path, b=b, filter_eps=1e-30, sort_vocab=sort)
    assert float(info["skipped_tiles"]) == 0.0
    assert rel(dh, dh_ex) < 1e-5 and rel(dw, dw_ex) < 1e-5


def test_sorting_the_vocabulary_makes_more_tiles_skippable(real_slice):
    h, w, y = real_slice
    _, _, natural = _grads(h, w, y, "one-pass", filter_eps=2.0 ** -8, sort_vocab=False)
    _, _, ordered = _grads(h, w, y, "one-pass", filter_eps=2.0 ** -8, sort_vocab=True)
    assert float(ordered["skipped_tiles"]) > float(natural["skipped_tiles"])
    order, inverse = vocabulary_order(h, w)
    assert torch.equal(order[inverse], torch.arange(w.shape[0]))
    mean_logit = w @ h.mean(0)
    assert bool((mean_logit[order][:-1] >= mean_logit[order][1:]).all())


@pytest.mark.parametrize("tma", [False, True])
def test_grad_kernels_write_the_exact_tile_masses(tma):
    """With filtering the G kernels leave the uniform term out of G and write each row's sum |G| per tile of
    columns: against fp64, with an ignored row, a z-loss term and per-token b."""
    import dataclasses

    from hf_lsce.ops.backward import mass_width, write_grad_logits
    from hf_lsce.ops.config import backward_config, forward_config
    from hf_lsce.ops.reference import torch_forward
    from hf_lsce.ops.sparse import tile_masses

    g = torch.Generator().manual_seed(4)
    n, d, v = 37, 24, 300
    h, w = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g) / 3
    y = torch.randint(0, v, (n,), generator=g)
    y[3] = -1
    grad = torch.rand(n, generator=g) * (y >= 0)
    extra, b = torch.rand(n, generator=g) * 0.1, torch.rand(n, generator=g) * 0.2
    lse = torch_forward(h, w, None, y, None)[0].float()
    cfg = backward_config(h.dtype, h.device)
    if tma:
        cfg = dataclasses.replace(forward_config(h.dtype, h.device), tma=True, min_programs=1)
    out = torch.empty(n, v)
    mw = mass_width(cfg)
    mass = torch.full((n, -(-v // mw)), float("nan"))
    write_grad_logits(cfg, h, w, None, y, lse, grad, b, extra, out, v, None, mass=mass)
    p = torch.softmax(h.double() @ w.double().T, -1)
    ref = p * (grad + extra).double()[:, None]
    rows = torch.arange(n)[y >= 0]
    ref[rows, y[y >= 0]] -= ((1 - b) * grad).double()[y >= 0]
    assert rel(out, ref) < 1e-5
    want = torch.nn.functional.pad(ref.abs(), (0, -v % 128)).view(n, -1, 128).sum(-1)
    assert rel(tile_masses(mass, mw), want) < 1e-5
    from hf_lsce.ops.sparse import row_mass

    l1 = row_mass(h, w, None, y, lse, grad, b, extra)
    assert rel(l1, ref.abs().sum(1)) < 1e-5


@pytest.mark.parametrize("path", ["one-pass", "two-pass"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_filtered_path_through_the_op_with_stats_and_bias(monkeypatch, path, dtype):
    """The op itself with filter_eps > 0 (sorted), on both training paths: loss and argmax unchanged by the
    permutation; gradients of a peaked softmax (most tiles negligible) within rounding; bias gradient through the
    un-permutation; ignored tokens."""
    from hf_lsce.ops import config

    monkeypatch.setattr(config, "TRAIN_PATH", path)
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
                                       filter_eps=2.0 ** -12, return_stats=True)
    loss.backward()
    assert abs(float(loss.detach()) - float(ref[0])) / float(ref[0]) < (1e-5 if dtype == torch.float32 else 2e-2)
    tol = 2.0 ** -12 if dtype == torch.float32 else 2e-2  # fp32: the filter's own (bounded) error
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
