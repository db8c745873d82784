"""The fused training path (``fused_pass``: one logits pass whose kernel stores exp(z - c), gradients from the
stored tiles), under Triton's interpreter, against fp64 torch on materialised logits and against the two-pass path.

The interpreter rounds fp32 to bf16 by truncation (the GPU rounds to nearest), so bf16 tolerances here are about
twice what the GPU gives (benchmarks/check_gpu.py measures those)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import hf_lsce.ops.config as config
import hf_lsce.ops.fused_pass as fp
from hf_lsce import linear_cross_entropy
from hf_lsce.ops.paths import _train_path, training_options

N, D, V = 37, 48, 203  # ragged on purpose (R's rows padded to 208)


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


def fp64(h, w, y, b, smoothing, num_items, weights=None, softcap=None):
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    bb = b.clone().requires_grad_() if b is not None else None
    z = hh @ ww.T + (bb if bb is not None else 0)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    logp = torch.log_softmax(z, -1)
    valid = y != -100
    sm = smoothing.double()
    tok = -(1 - sm) * logp.gather(1, y.clamp(min=0)[:, None])[:, 0] - sm * logp.mean(-1)
    tok = torch.where(valid, tok, 0.0)
    out = tok if weights is not None else tok.sum() / num_items
    (out * weights).sum().backward() if weights is not None else out.backward()
    return out.detach(), hh.grad, ww.grad, bb.grad if bb is not None else None, torch.logsumexp(z, -1).detach()


def run(path, h, w, y, b, smoothing, reduction, num_items, weights=None, stats=False, softcap=None,
        dtype=torch.bfloat16, frozen=False, z_loss=0.0):
    config.TRAIN_PATH = path
    try:
        hh, ww = h.to(dtype).requires_grad_(), w.to(dtype).requires_grad_(not frozen)
        bb = b.to(dtype).requires_grad_(not frozen) if b is not None else None
        out = linear_cross_entropy(hh, ww, y, bias=bb, label_smoothing=smoothing, reduction=reduction,
                                   num_items_in_batch=num_items, backend="triton", return_stats=stats,
                                   softcap=softcap, z_loss=z_loss)
        loss = out[0] if stats else out
        (loss * weights).sum().backward() if weights is not None else loss.backward()
        return (loss.detach(), hh.grad, ww.grad, bb.grad if b is not None else None) + ((out[1],) if stats else ())
    finally:
        config.TRAIN_PATH = None


@pytest.mark.parametrize("layout", ["chunked", "direct"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduction", ["sum", "none"])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_fused_path_matches_fp64_and_the_two_pass_path(tma, monkeypatch, bias, reduction, layout, softcap):
    """Loss, dh, dW and db of the fused path against fp64 (per-token b, ignored rows, num_items_in_batch, bias, a
    per-token upstream gradient, soft-cap) and against the two-pass path on the same bf16 inputs; the fused pass ran,
    in several row chunks with dW's fp32 accumulator ("chunked"), or over every row with dW written by one matmul
    ("direct"). A cap of 5 puts most of the peaked rows' largest logits where the cap bends them (tanh' < 0.5)."""
    h, w, y, b = inputs(seed=1, bias=bias)
    sm = torch.rand(N, generator=torch.Generator().manual_seed(3)) * 0.3
    weights = torch.rand(N, generator=torch.Generator().manual_seed(4)) if reduction == "none" else None
    calls, direct = [], []
    real, real_direct = fp.triton_fused_pass, fp._direct_dw
    monkeypatch.setattr(fp, "triton_fused_pass",
                        lambda *a, **k: calls.append(1) or real(*a, **dict(k, chunk_bytes=16 * 208 * 2)))
    monkeypatch.setattr(fp, "_direct_dw", lambda *a, **k: direct.append(1) or real_direct(*a, **k))
    if layout == "chunked":
        monkeypatch.setattr(fp, "EVERY_ROW_EXTRA_BYTES", -(1 << 40))
    items = 29 if reduction == "sum" else None
    got = run("fused", h, w, y, b, sm, reduction, items, weights, softcap=softcap)
    assert calls, "the fused pass did not run"
    assert bool(direct) == (layout == "direct")
    two = run("two-pass", h, w, y, b, sm, reduction, items, weights, softcap=softcap)
    ref = fp64(h.bfloat16().double(), w.bfloat16().double(), y, b.bfloat16().double() if bias else None, sm, 29.0,
               weights.double() if weights is not None else None, softcap=softcap)
    assert rel(got[0], ref[0]) < 1e-5
    for i in (1, 2, 3):
        if ref[i] is not None:
            assert rel(got[i], ref[i]) < 2e-2
            assert rel(got[i], ref[i]) < 2 * rel(two[i], ref[i]) + 1e-3  # no worse than the two-pass path


def test_fused_direct_dw_carries_the_smoothing_term(tma, monkeypatch):
    """With b = 1 on every token the smoothing's uniform term is the whole of each row's -1/V: the direct layout
    carries it in the matmul (R's rows of ones against hs's hi and lo rows), as accurately as the chunked layout's
    fp32 subtraction (a wrong sign or a missing row would be an error of order 1)."""
    h, w, y, _ = inputs(seed=6)
    sm = torch.ones(N)
    ref = fp64(h.bfloat16().double(), w.bfloat16().double(), y, None, sm, 29.0)
    direct = run("fused", h, w, y, None, sm, "sum", 29)
    monkeypatch.setattr(fp, "EVERY_ROW_EXTRA_BYTES", -(1 << 40))
    chunked = run("fused", h, w, y, None, sm, "sum", 29)
    assert rel(direct[2], ref[2]) < 2e-2
    assert rel(direct[2], ref[2]) < 1.5 * rel(chunked[2], ref[2]) + 1e-3


@pytest.mark.parametrize("layout", ["chunked", "direct"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1, "zeros tensor"])
def test_fused_rank_one_term_skipped_only_for_a_float_zero(tma, monkeypatch, layout, smoothing):
    """A float b = 0 has no uniform term: dW's rank-one rows are neither computed nor multiplied (one launch fewer),
    and loss, dh, dW and db still equal fp64's; a float b > 0, or a tensor b (zeros or not, its values unknown to the
    host), keeps the term. Mutation check: the term skipped for b = 0.1 fails here (dW and db)."""
    h, w, y, b = inputs(seed=15, bias=True)
    rank_one = []
    real = fp._rank_one_rows
    monkeypatch.setattr(fp, "_rank_one_rows", lambda *a, **k: rank_one.append(1) or real(*a, **k))
    if layout == "chunked":
        monkeypatch.setattr(fp, "EVERY_ROW_EXTRA_BYTES", -(1 << 40))
        real_pass = fp.triton_fused_pass
        monkeypatch.setattr(fp, "triton_fused_pass", lambda *a, **k: real_pass(*a, **dict(k, chunk_bytes=16 * 208 * 2)))
    sm = torch.zeros(N) if smoothing == "zeros tensor" else smoothing
    got = run("fused", h, w, y, b, sm, "sum", 29)
    b_tok = torch.zeros(N) if smoothing == "zeros tensor" else torch.full((N,), float(smoothing))
    ref = fp64(h.bfloat16().double(), w.bfloat16().double(), y, b.bfloat16().double(), b_tok, 29.0)
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


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("z_loss", [1e-2, 0.3])
def test_fused_path_with_z_loss(tma, monkeypatch, z_loss, softcap):
    """The z-loss lam lse^2 on the fused path (its factor k = 1 + 2 lam lse per row, the target entry over k): loss,
    dh, dW and db against fp64, trainable head with a bias and a frozen one, soft-capped or not; the fused pass ran.
    lam = 0.3 with logits shifted by -9 (uncapped) puts rows' k on both sides of 0 (26 of 37 below, the nearest 3e-4
    from it)."""
    h, w, y, b = inputs(seed=8, bias=True)
    b = b - 9.0
    sm = torch.full((N,), 0.1)
    calls = []
    real = fp.triton_fused_pass
    monkeypatch.setattr(fp, "triton_fused_pass", lambda *a, **k: calls.append(k.get("z_loss")) or real(*a, **k))
    hd, wd, bd = h.bfloat16().double(), w.bfloat16().double(), b.bfloat16().double()
    hh, ww, bb = (hd.clone().requires_grad_(), wd.clone().requires_grad_(), bd.clone().requires_grad_())
    z = hh @ ww.T + bb
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    lse = torch.logsumexp(z, -1)
    logp = z - lse[:, None]
    valid = y != -100
    tok = -0.9 * logp.gather(1, y.clamp(min=0)[:, None])[:, 0] - 0.1 * logp.mean(-1) + z_loss * lse * lse
    (torch.where(valid, tok, 0.0).sum() / 29.0).backward()
    for frozen in (False, True):
        config.TRAIN_PATH = "fused"
        try:
            h2, w2 = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_(not frozen)
            b2 = b.bfloat16().requires_grad_()
            loss = linear_cross_entropy(h2, w2, y, bias=b2, label_smoothing=0.1, z_loss=z_loss, reduction="sum",
                                        num_items_in_batch=29, backend="triton", softcap=softcap)
            loss.backward()
        finally:
            config.TRAIN_PATH = None
        assert calls and calls[-1] == z_loss, "the fused pass did not run with the z-loss"
        assert rel(loss, (torch.where(valid, tok, 0.0).sum() / 29.0).detach()) < 1e-5
        assert rel(h2.grad, hh.grad) < 2e-2 and rel(b2.grad, bb.grad) < 2e-2
        assert frozen or rel(w2.grad, ww.grad) < 2e-2


@pytest.mark.parametrize("layout", ["every row", "column chunks", "row chunks", "soft-cap", "soft-cap row chunks"])
def test_fused_path_with_a_frozen_head(tma, monkeypatch, layout):
    """A frozen head (LoRA): no dW, so no direct dW; dh against fp64, by the fused pass over vocabulary columns, in
    one chunk where every row's R fits the allowance, else in chunks (here 64 columns), or in chunks of rows where
    the columns' fp32 dh accumulator would be large (``frozen_chunk_bytes``: here a chunk of 16 rows' R). Soft-capped
    logits go by rows (G needs each row's normalisation), one launch per chunk (no row leaves the range)."""
    h, w, y, _ = inputs(seed=7)
    sm = torch.full((N,), 0.1)
    config.TRAIN_PATH = "fused"
    direct, rows, widths = [], [], []
    real_direct, real_layout, real_tiles = fp._direct_dw, fp.layout, fp._exp_tiles
    monkeypatch.setattr(fp, "_direct_dw", lambda *a, **k: direct.append(1) or real_direct(*a, **k))
    monkeypatch.setattr(fp, "layout", lambda *a, **k: rows.append(real_layout(*a, **k)[1]) or real_layout(*a, **k))
    monkeypatch.setattr(fp, "_exp_tiles", lambda cfg, h, w, *a, **k: widths.append((h.shape[0], w.shape[0])) or
                        real_tiles(cfg, h, w, *a, **k))
    if layout not in ("every row", "soft-cap"):
        monkeypatch.setattr(fp, "EVERY_ROW_EXTRA_BYTES", -(1 << 40))
        monkeypatch.setattr(fp, "FUSED_CHUNK_BYTES", 16 * 208 * 2)  # 4 N D = 7,104 bytes: over a quarter of it
    if layout == "column chunks":
        monkeypatch.setattr(fp, "frozen_chunk_bytes", lambda *a, **k: N * 2 * 64)
    cap = 5.0 if layout.startswith("soft-cap") else None
    try:
        hh = h.bfloat16().requires_grad_()
        loss = linear_cross_entropy(hh, w.bfloat16(), y, label_smoothing=sm, reduction="sum", num_items_in_batch=29,
                                    backend="triton", softcap=cap)
        loss.backward()
    finally:
        config.TRAIN_PATH = None
    ref = fp64(h.bfloat16().double(), w.bfloat16().double(), y, None, sm, 29.0, softcap=cap)
    assert not direct
    expected = {"every row": [(N, V)] * 2, "column chunks": [(N, 64)] * 6 + [(N, V - 3 * 64)] * 2,
                "row chunks": [(16, V)] * 4 + [(N - 32, V)] * 2, "soft-cap": [(N, V)],
                "soft-cap row chunks": [(16, V)] * 2 + [(N - 32, V)]}[layout]
    assert widths == expected, widths
    assert rel(loss, ref[0]) < 1e-5 and rel(hh.grad, ref[1]) < 2e-2


def test_fused_layout_and_its_memory():
    """Which layout the fused path takes, the memory it reports for memory='auto', and where it is preferred above
    TWO_PASS_MAX_D: R for every row where that costs at most EVERY_ROW_EXTRA_BYTES more than a chunk of R and dW's
    fp32 accumulator."""
    gib = 1 << 30
    # Gemma2-2B shape, N = 8192: every row's R (4.2 GB) against 1 GiB + 2.4 GB: direct, and preferred above D = 1024
    n, v, d = 8192, 256000, 2304
    assert fp.layout(n, v, d, True) == (256000, n, True)
    assert fp.extra_memory(n, v, d) == (n + 2) * v * 2  # N rows and the rank-one term's two
    # fp16: every row, but dW through its fp32 accumulator (fused_pass.online)
    assert fp.layout(n, v, d, True, half_range=True) == (v, n, False)
    assert fp.extra_memory(n, v, d, half_range=True) == (n + 2) * v * 2 + v * d * 4
    assert fp.preferred(n, v, d, True)
    assert fp.preferred(n, v, d, False)  # frozen head (LoRA): no dW, R read by dh's matmul alone
    assert not fp.preferred(4 * n, v, d, True)  # R for 32,768 rows (16.8 GB) would cost far more: chunked
    v_pad, rows, direct = fp.layout(4 * n, v, d, True)
    assert not direct and rows * v_pad * 2 <= gib and fp.extra_memory(4 * n, v, d) == (rows + 2) * v_pad * 2 + v * d * 4
    # Gemma-3-270m shape: R for every row (4.3 GB) against 1 GiB + 0.67 GB: within 4 GiB more, direct; at N = 16,384
    # (8.6 GB) chunked, and preferred (D <= 1024) anyway
    assert fp.layout(8192, 262144, 640, True)[2]
    v_pad, rows, direct = fp.layout(16384, 262144, 640, True)
    assert not direct and rows < 16384 and fp.preferred(16384, 262144, 640, True)
    v_pad, rows, direct = fp.layout(8192, 262144, 640, False)  # frozen: every row too (4.3 GB, no dW), not direct
    acc = 4 * 8192 * 640  # a frozen head's fp32 dh accumulator (triton_fused_columns)
    assert not direct and rows == 8192 and fp.extra_memory(8192, 262144, 640, need_dw=False) == 8192 * v_pad * 2 + acc
    v_pad, rows, direct = fp.layout(16384, 262144, 640, False)
    assert not direct and rows < 16384
    assert fp.extra_memory(16384, 262144, 640, need_dw=False) == rows * v_pad * 2 + 2 * acc
    # a frozen head by chunks of columns while dh's fp32 accumulator (4 N D) is within a quarter of the chunk, else
    # by chunks of rows: the Gemma-3-270m head at N = 16,384 by columns, LoRA on Llama-3-8B at 28 x 4,096 by rows
    assert fp.frozen_chunk_bytes(16384, 262144, 640) == fp.FUSED_CHUNK_BYTES
    assert fp.frozen_chunk_bytes(8192, 262144, 640) == 8192 * 262144 * 2  # every column, one chunk
    assert fp.frozen_chunk_bytes(28 * 4096, 128256, 4096) is None
    rows_8b = fp.layout(28 * 4096, 128256, 4096, False)[1]
    assert fp.extra_memory(28 * 4096, 128256, 4096, need_dw=False) == rows_8b * 128256 * 2 + 4 * rows_8b * 4096
    whole = 8192 * 262144 * 2  # a frozen head's every row, without the free memory for it: chunks again
    assert fp.layout(8192, 262144, 640, False, free_bytes=int(1.25 * whole))[1] == 8192
    assert fp.layout(8192, 262144, 640, False, free_bytes=int(1.25 * whole) - 1)[1] < 8192
    # memory="auto" with too little free memory for every row's R: chunked, and above D = 1,024 not preferred
    need = (n + 2) * v * 2
    assert fp.layout(n, v, d, True, free_bytes=int(1.25 * need))[2]
    assert not fp.layout(n, v, d, True, free_bytes=int(1.25 * need) - 1)[2]
    assert not fp.preferred(n, v, d, True, free_bytes=need)
    assert fp.extra_memory(n, v, d, free_bytes=need) == (fp.chunk_rows(n, v)[1] + 2) * v * 2 + v * d * 4


def torch_half(h, w, y, b, smoothing, num_items, dtype, frozen=False):
    """dh, dW, db of torch's own half-precision path: logits in ``dtype``, the loss in fp64 (as check_gpu's)."""
    hh, ww = h.to(dtype).requires_grad_(), w.to(dtype).requires_grad_(not frozen)
    bb = b.to(dtype).requires_grad_(not frozen) if b is not None else None
    z = (hh @ ww.T + (bb if bb is not None else 0)).double()
    logp = torch.log_softmax(z, -1)
    tok = -(1 - smoothing.double()) * logp.gather(1, y.clamp(min=0)[:, None])[:, 0] - smoothing.double() * logp.mean(-1)
    (torch.where(y != -100, tok, 0.0).sum() / num_items).backward()
    return None, hh.grad, ww.grad, bb.grad if bb is not None else None


@pytest.mark.parametrize("case", ["every row", "row chunks", "frozen", "bias+z_loss", "spike+stats"])
def test_fp16_fused_path_matches_fp64(tma, monkeypatch, case):
    """fp16 on the fused path (``fused_pass.online``: R relative to each row's running max, normalised into p once the
    row's lse is known; dW from (a / gamma) o h in fp32): loss, lse, dh, dW, db against fp64 on the fp16 inputs, no
    worse than torch's fp16 logits (the bar of issue 54), with rows whose max sits 160 nats above their mean logit
    (past fp16's range under any offset fixed before the logits), every row or row chunks, a frozen head, a bias and
    a z-loss, per-token b and ignored rows; the pass ran in fp16."""
    h, w, y, b = inputs(seed=1, bias=case == "bias+z_loss", spike=case == "spike+stats")
    sm = torch.rand(N, generator=torch.Generator().manual_seed(3)) * 0.3
    calls = []
    real = fp.triton_fused_pass
    chunk = 16 * 208 * 2 if case == "row chunks" else None
    monkeypatch.setattr(fp, "triton_fused_pass",
                        lambda *a, **k: calls.append(a[0].dtype) or real(*a, **dict(k, chunk_bytes=chunk)))
    zl = 1e-2 if case == "bias+z_loss" else 0.0
    frozen = case == "frozen"
    got = run("fused", h, w, y, b, sm, "sum", 29, stats=case == "spike+stats", dtype=torch.float16, frozen=frozen,
              z_loss=zl)
    assert calls == [torch.float16]
    h16, w16 = h.half().double(), w.half().double()
    b16 = b.half().double() if b is not None else None
    ref = fp64(h16, w16, y, b16, sm, 29.0) if not zl else None
    if zl:  # the z-loss's fp64 truth: the op's own formula, on the same inputs
        hh, ww, bb = h16.clone().requires_grad_(), w16.clone().requires_grad_(), b16.clone().requires_grad_()
        z = hh @ ww.T + bb
        lse = torch.logsumexp(z, -1)
        tok = lse - (1 - sm.double()) * z.gather(1, y.clamp(min=0)[:, None])[:, 0] - sm.double() * z.mean(-1)
        (torch.where(y != -100, tok + zl * lse * lse, 0.0).sum() / 29.0).backward()
        ref = (None, hh.grad, ww.grad, bb.grad, lse.detach())
    else:
        assert rel(got[0], ref[0]) < 1e-5
    half = torch_half(h, w, y, b, sm, 29.0, torch.float16, frozen)
    for i in (1, 2, 3):
        if ref[i] is not None and got[i] is not None:
            err = rel(got[i], ref[i])
            assert err < 2e-3, (i, err)
            if not zl:
                assert err <= rel(half[i], ref[i]) * 1.1 + 1e-4, (i, err, rel(half[i], ref[i]))
    if frozen:
        assert got[2] is None
    if case == "spike+stats":
        assert rel(got[4].lse, ref[4]) < 1e-6


def test_fused_rows_past_the_exponent_range_are_redone(tma):
    """Rows whose max logit sits far above their mean logit (R = exp(z - c) would overflow bf16) are flagged and
    redone with c = their max: loss, lse and gradients stay exact."""
    h, w, y, _ = inputs(seed=2, spike=True)
    z = h @ w.T
    assert float((z.max(1).values - z.mean(1))[:5].min()) > 89 + fp.C_SHIFT  # exp(max - c) past fp32's range
    sm = torch.full((N,), 0.1)
    got = run("fused", h, w, y, None, sm, "sum", 29, stats=True)
    ref = fp64(h.bfloat16().double(), w.bfloat16().double(), y, None, sm, 29.0)
    assert torch.isfinite(got[0])
    assert rel(got[0], ref[0]) < 1e-5
    assert rel(got[4].lse, ref[4]) < 1e-6
    assert rel(got[1], ref[1]) < 2e-2 and rel(got[2], ref[2]) < 2e-2


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_fused_training_statistics_match_fp64(tma, softcap):
    """The statistics the fused training pass returns with its gradients (lse, argmax, entropy, nll: TRL's token
    accuracy and entropy) are those of fp64 on the materialised logits, soft-capped too, and those the same kernel
    gives without storing R (evaluation)."""
    h, w, y, _ = inputs(seed=5)
    sm = torch.full((N,), 0.1)
    fused = run("fused", h, w, y, None, sm, "sum", None, stats=True, softcap=softcap)[4]
    hh, ww = h.bfloat16(), w.bfloat16()
    z = hh.double() @ ww.double().T
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    logp = torch.log_softmax(z, -1)
    valid = y != -100
    assert torch.equal(fused.argmax, z.argmax(-1))
    assert rel(fused.lse, torch.logsumexp(z, -1)) < 1e-6
    assert rel(fused.entropy, -(logp.exp() * logp).sum(-1)) < 1e-5
    assert rel(fused.nll[valid], -logp.gather(1, y.clamp(min=0)[:, None])[:, 0][valid]) < 1e-5
    with torch.no_grad():
        plain = linear_cross_entropy(hh, ww, y, label_smoothing=0.1, reduction="sum", backend="triton",
                                     return_stats=True, softcap=softcap)[1]
    assert torch.equal(fused.argmax, plain.argmax)
    for a, b in ((fused.lse, plain.lse), (fused.entropy, plain.entropy), (fused.nll, plain.nll)):
        assert rel(a, b) < 1e-5


def test_fused_pass_only_where_it_applies(tma):
    """bf16 without soft-cap or with one up to SOFTCAP_MAX (with or without z-loss): everything else takes another
    path, even when forced; memory='low' with a soft-cap takes the two-pass computation."""
    h = torch.zeros(4, D, dtype=torch.bfloat16, requires_grad=True)
    w = torch.zeros(V, D, dtype=torch.bfloat16)
    config.TRAIN_PATH = "fused"
    try:
        assert _train_path(h, w, None, 0.0, None) == "fused"
        assert _train_path(h, w, 30.0, 0.0, None) == "fused"  # Gemma 2's cap
        assert _train_path(h, w, fp.SOFTCAP_MAX * 1.25, 0.0, None) != "fused"
        assert _train_path(h, w, None, 1e-4, None) == "fused"
        assert _train_path(h, w, 30.0, 1e-4, None) == "fused"
        assert _train_path(h.half(), w.half(), None, 0.0, None) == "fused"
        assert _train_path(h.half(), w.half(), 30.0, 0.0, None) != "fused"  # (fp16's R cannot give the cap's slope)
        assert training_options(h.half(), w.half(), None, "triton", 0.0, "low", None, True).path == "two-pass"
        low = training_options(h, w, 30.0, "triton", 0.0, "low", None, True)
        assert low.path == "two-pass" and low.memory == "low"
    finally:
        config.TRAIN_PATH = None


@pytest.mark.parametrize("case", ["plain", "spike+stats", "bias+z_loss"])
def test_frozen_head_low_memory_by_vocabulary_columns(tma, monkeypatch, case):
    """memory='low' with a frozen head runs the fused pass over chunks of vocabulary columns (the logits once, dh
    accumulated in fp32 across chunks): loss, lse, entropy, argmax and dh against fp64, over several chunks, with rows
    whose max lies past their offset in a later chunk than the first (redone, their earlier sums rescaled); the
    two-pass computation does not run."""
    import hf_lsce.ops.backward as bw

    monkeypatch.setattr(config, "LOW_MEMORY_BYTES", 0)
    monkeypatch.setattr(config, "LOW_MEMORY_CHUNK_BYTES", N * 2 * 64)  # R's chunk: 64 columns of 203
    monkeypatch.setattr(bw, "triton_gradients_by_columns", lambda *a, **k: pytest.fail("the two-pass path ran"))
    widths = []
    real = fp._exp_tiles
    monkeypatch.setattr(fp, "_exp_tiles", lambda cfg, h, w, *a, **k: widths.append(w.shape[0]) or real(cfg, h, w, *a,
                                                                                                         **k))
    h, w, y, b = inputs(seed=11, bias=case == "bias+z_loss", spike=case == "spike+stats")
    if case == "spike+stats":  # rows 0-4 peak at column 7 (first chunk), rows 5-7 at column 150 (the third)
        h[5:8] = 160.0 * w[150] / w[150].norm() ** 2
    z_loss = 1e-2 if case == "bias+z_loss" else 0.0
    sm = torch.rand(N, generator=torch.Generator().manual_seed(3)) * 0.3
    hh, wb = h.bfloat16().requires_grad_(), w.bfloat16()
    bb = b.bfloat16() if b is not None else None
    loss, stats = linear_cross_entropy(hh, wb, y, bias=bb, label_smoothing=sm, reduction="sum", num_items_in_batch=29,
                                       backend="triton", memory="low", z_loss=z_loss, return_stats=True)
    loss.backward()
    assert widths == [64] * 6 + [203 - 3 * 64] * 2, widths  # R by 64 columns: four chunks, each launched twice
    h64, w64 = h.bfloat16().double().requires_grad_(), w.bfloat16().double()
    zz = h64 @ w64.T + (bb.double() if bb is not None else 0)
    lse = torch.logsumexp(zz, -1)
    logp = zz - lse[:, None]
    tok = -(1 - sm.double()) * logp.gather(1, y.clamp(min=0)[:, None])[:, 0] - sm.double() * logp.mean(-1)
    tok = torch.where(y != -100, tok + z_loss * lse * lse, 0.0)
    ref = tok.sum() / 29
    ref.backward()
    assert rel(loss, ref.detach()) < 1e-5
    assert rel(stats.lse, lse.detach()) < 1e-6
    assert torch.equal(stats.argmax, zz.argmax(-1))
    ent = -(logp.exp() * logp).sum(-1)
    assert rel(stats.entropy, ent.detach()) < 1e-4
    assert rel(hh.grad, h64.grad) < 2e-2


@pytest.mark.parametrize("trainable", ["weight", "bias"])
def test_low_memory_takes_the_two_pass_computation_where_dw_or_db_is_needed(tma, monkeypatch, trainable):
    """memory='low' with a trainable head (or bias) on the fused path's inputs: dW and db need every row's
    normalisation before a column chunk's product, so the gradients come from the two-pass computation, its
    statistics from the fused pass without R (no dh there, no R stored), rows past the exponent range included: loss,
    lse, argmax and the gradients against fp64."""
    import hf_lsce.ops.backward as bw

    calls, two_pass = [], []
    real_cols, real_two = fp.triton_fused_columns, bw.triton_gradients_by_columns
    monkeypatch.setattr(fp, "triton_fused_columns", lambda *a, **k: calls.append(k.get("need_dh", True)) or real_cols(
        *a, **k))
    monkeypatch.setattr(bw, "triton_gradients_by_columns", lambda *a, **k: two_pass.append(1) or real_two(*a, **k))
    h, w, y, b = inputs(seed=12, bias=True, spike=True)
    sm = torch.full((N,), 0.1)
    hh, ww, bb = h.bfloat16().requires_grad_(), w.bfloat16(), b.bfloat16()
    (ww if trainable == "weight" else bb).requires_grad_()
    loss, stats = linear_cross_entropy(hh, ww, y, bias=bb, label_smoothing=sm, reduction="sum", num_items_in_batch=29,
                                       backend="triton", memory="low", return_stats=True)
    loss.backward()
    assert calls == [False] and two_pass == [1], (calls, two_pass)
    ref = fp64(h.bfloat16().double(), w.bfloat16().double(), y, b.bfloat16().double(), sm, 29.0)
    z = h.bfloat16().double() @ w.bfloat16().double().T + b.bfloat16().double()
    got = ww.grad if trainable == "weight" else bb.grad
    assert rel(loss, ref[0]) < 1e-5 and rel(stats.lse, ref[4]) < 1e-6 and torch.equal(stats.argmax, z.argmax(-1))
    assert rel(hh.grad, ref[1]) < 2e-2 and rel(got, ref[2 if trainable == "weight" else 3]) < 2e-2


def test_soft_capped_fused_path_compiles(tma, monkeypatch):
    """A soft-capped loss on the fused path inside torch.compile(fullgraph=True): the compiled operator runs the same
    fused pass (with the cap) and gives eager's loss and gradients exactly, trainable head with a bias."""
    h, w, y, b = inputs(seed=13, bias=True)
    caps = []
    real = fp.triton_fused_pass
    monkeypatch.setattr(fp, "triton_fused_pass", lambda *a, **k: caps.append(k.get("softcap")) or real(*a, **k))
    monkeypatch.setattr(config, "TRAIN_PATH", "fused")

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
    ref = fp64(h.bfloat16().double(), w.bfloat16().double(), y, b.bfloat16().double(), torch.full((N,), 0.1), 29.0,
               softcap=5.0)
    assert rel(results[1][0], ref[0]) < 1e-5 and rel(results[1][1], ref[1]) < 2e-2


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_fused_second_backward_doubles_the_gradients(tma, monkeypatch, softcap):
    """A second backward through the same graph (retain_graph) recomputes the fused path's gradients the same way:
    the accumulated gradients are exactly twice the first's (trainable head with a bias, soft-capped or not)."""
    monkeypatch.setattr(config, "TRAIN_PATH", "fused")
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


def test_tma_switch_values():
    """HF_LSCE_TMA takes 0 or 1 (or nothing); anything else is refused at import, naming the variable."""
    import os
    import subprocess
    import sys

    code = "import hf_lsce.ops.config as c; print(c.TMA_SWITCH)"
    for value, ok in (("0", True), ("1", True), ("", True), ("yes", False), ("2", False)):
        env = dict(os.environ, HF_LSCE_TMA=value)
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert (r.returncode == 0) == ok, (value, r.stderr[-300:])
        if not ok:
            assert "HF_LSCE_TMA must be 0" in r.stderr and repr(value) in r.stderr


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_no_fused_path_without_tensor_core_dots(monkeypatch, dtype):
    """A GPU whose Triton dots are not tensor-core MMA (Turing, Volta: config.mma_dot False) never takes the fused path,
    forced or not, in bf16 or fp16."""
    real = config.fused_config
    monkeypatch.setattr(config, "fused_config", lambda dt, dev: dataclasses.replace(real(dt, dev), mma_dot=False))
    h = torch.zeros(4, D, dtype=dtype, requires_grad=True)
    w = torch.zeros(V, D, dtype=dtype)
    monkeypatch.setattr(config, "TRAIN_PATH", "fused")
    assert _train_path(h, w, None, 0.0, None) != "fused"
    monkeypatch.setattr(config, "fused_config", real)
    assert _train_path(h, w, None, 0.0, None) == "fused"


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
