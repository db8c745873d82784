"""Triton backward kernels.

Two strategies, chosen by ``filter_eps``:

* dense (default): for a chunk of rows, ``_lce_grad_logits_kernel`` recomputes the logits tile by tile
  in fp32 and writes the gradient of the loss with respect to them, G (chunk x V, input dtype), then
  cuBLAS computes ``dh = G @ W`` and ``dW += G^T @ h``. Memory: one chunk of G (``GRAD_CHUNK_BYTES``).
* tile skipping (``filter_eps > 0``): ``_lce_backward_kernel`` below, which never writes G.

Tile skipping, in detail.
For token n with smoothing b_n and upstream gradient g_n the gradient with respect to the logits is

    dL/dz_nv = g_n * (p_nv - (1 - b_n) [v == y_n] - b_n / V)        (no soft-cap)

The last term is the same for every v: its contribution is rank one (``dh_n -= g_n b_n / V * sum_v W_v``
and ``dW_v -= sum_n g_n b_n / V * h_n``) and is applied exactly in torch by the caller. This kernel
handles the rest, ``p - (1 - b) onehot``, which is negligible on most tiles of a peaked softmax: a
tile whose every entry is below ``filter_eps`` is skipped (gradient filtering). With soft-cap,
``dz_capped/dz = 1 - tanh^2``: the smoothing term becomes ``-b/V + b/V tanh^2``; the first part is the
same rank-one term, the second a dense remainder the kernel adds exactly (tiles are then never
skipped when b > 0).

Each program recomputes one (BLOCK_N, BLOCK_V) logit tile from h and W, forms the gradient tile
G and accumulates ``G @ W_tile`` into dh and ``G^T @ h_tile`` into dW (fp32 atomics).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import launch, tuning_configs
from .forward import _dot, _finish_logits, _logit_tile, _split_bounds, _tile_offsets, tma_ready, vocab_splits


@triton.jit
def _lce_backward_kernel(
    H, W, B, Y, LSE, GRAD, SMOOTH, EXTRA,
    DH, DW, DB, SKIPPED,
    N, V, D,
    stride_hn, stride_hd, stride_wv, stride_wd,
    softcap, inv_v, filter_eps,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, FILTER: tl.constexpr, HAS_EXTRA: tl.constexpr,
    NEED_DH: tl.constexpr, NEED_DW: tl.constexpr,
    COUNT_SKIPPED: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
):
    offs_n, offs_v, mask_n, mask_v = _tile_offsets(N, V, BLOCK_N, BLOCK_V)

    grad = tl.load(GRAD + offs_n, mask=mask_n, other=0.0)
    extra = grad * 0.0
    if HAS_EXTRA:
        extra = tl.load(EXTRA + offs_n, mask=mask_n, other=0.0)
    # Rows with no upstream gradient (ignored tokens, padding) contribute nothing.
    active = mask_n & ((grad != 0.0) | (extra != 0.0))
    if tl.max(active.to(tl.int32), axis=0) == 0:
        if COUNT_SKIPPED:
            tl.atomic_add(SKIPPED, 1)
        return

    z, t = _logit_tile(H, W, B, offs_n, offs_v, mask_n, mask_v, D, stride_hn, stride_hd,
                       stride_wv, stride_wd, softcap, HAS_BIAS, SOFTCAP, BLOCK_D,
                       DOT_PRECISION, UPCAST, BLOCK_N, BLOCK_V)
    lse = tl.load(LSE + offs_n, mask=mask_n, other=0.0)
    y = tl.load(Y + offs_n, mask=mask_n, other=-1)
    b = tl.load(SMOOTH + offs_n, mask=mask_n, other=0.0)

    p = tl.exp(z - lse[:, None])
    g = p - tl.where(offs_v[None, :] == y[:, None], 1.0 - b[:, None], 0.0)
    if SOFTCAP:
        t2 = t * t
        g = g * (1.0 - t2) + (b * inv_v)[:, None] * t2
    g = tl.where(active[:, None] & mask_v[None, :], g, 0.0)
    gg = g * grad[:, None]
    if HAS_EXTRA:  # + extra_n p_nv (z-loss, an lse output's gradient); never filtered away from its tile
        pe = p
        if SOFTCAP:
            pe = p * (1.0 - t * t)
        gg += tl.where(active[:, None] & mask_v[None, :], extra[:, None] * pe, 0.0)

    keep = True
    if FILTER:
        keep = tl.max(tl.max(tl.abs(g), axis=1), axis=0) >= filter_eps
        if HAS_EXTRA:
            keep = keep | (tl.max(tl.max(tl.abs(gg), axis=1), axis=0) >= filter_eps)
    if keep:
        gc = gg.to(H.dtype.element_ty)
        if HAS_BIAS:
            tl.atomic_add(DB + offs_v, tl.sum(gg, axis=0), mask=mask_v)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < D
            if NEED_DH:
                w = tl.load(W + offs_v[:, None] * stride_wv + offs_d[None, :] * stride_wd,
                            mask=mask_v[:, None] & mask_d[None, :], other=0.0)
                dh = _dot(gc, w, tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32), DOT_PRECISION, UPCAST)
                tl.atomic_add(DH + offs_n[:, None] * D + offs_d[None, :], dh,
                              mask=mask_n[:, None] & mask_d[None, :])
            if NEED_DW:
                h = tl.load(H + offs_n[:, None] * stride_hn + offs_d[None, :] * stride_hd,
                            mask=mask_n[:, None] & mask_d[None, :], other=0.0)
                dw = _dot(tl.trans(gc), h, tl.zeros((BLOCK_V, BLOCK_D), dtype=tl.float32), DOT_PRECISION, UPCAST)
                tl.atomic_add(DW + offs_v[:, None] * D + offs_d[None, :], dw,
                              mask=mask_v[:, None] & mask_d[None, :])
    elif COUNT_SKIPPED:
        tl.atomic_add(SKIPPED, 1)


@triton.jit
def _lce_grad_logits_kernel(
    H, W, B, Y, LSE, GRAD, SMOOTH, EXTRA, G,
    N, V, D,
    stride_hn, stride_hd, stride_wv, stride_wd, stride_gn,
    softcap, inv_v,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, HAS_EXTRA: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """G[n, v] = grad_n * dloss_n / dz_nv (+ extra_n p_nv: z-loss, an lse output's gradient), the full
    gradient (smoothing term included), input dtype."""
    offs_n, offs_v, mask_n, mask_v = _tile_offsets(N, V, BLOCK_N, BLOCK_V)
    z, t = _logit_tile(H, W, B, offs_n, offs_v, mask_n, mask_v, D, stride_hn, stride_hd,
                       stride_wv, stride_wd, softcap, HAS_BIAS, SOFTCAP, BLOCK_D,
                       DOT_PRECISION, UPCAST, BLOCK_N, BLOCK_V)
    lse = tl.load(LSE + offs_n, mask=mask_n, other=0.0)
    y = tl.load(Y + offs_n, mask=mask_n, other=-1)
    b = tl.load(SMOOTH + offs_n, mask=mask_n, other=0.0)
    grad = tl.load(GRAD + offs_n, mask=mask_n, other=0.0)
    p = tl.exp(z - lse[:, None])
    g = (p - (b * inv_v)[:, None] - tl.where(offs_v[None, :] == y[:, None], 1.0 - b[:, None], 0.0)) * grad[:, None]
    if HAS_EXTRA:
        g += tl.load(EXTRA + offs_n, mask=mask_n, other=0.0)[:, None] * p
    if SOFTCAP:
        g = g * (1.0 - t * t)
    tl.store(G + offs_n[:, None] * stride_gn + offs_v[None, :], g.to(G.dtype.element_ty),
             mask=mask_n[:, None] & mask_v[None, :])


@triton.jit
def _lce_grad_logits_tma_kernel(
    h_desc, w_desc, B, Y, LSE, GRAD, SMOOTH, EXTRA, G,
    N, V, D, NUM_SPLITS, stride_gn,
    softcap, inv_v,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, HAS_EXTRA: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The G of ``_lce_grad_logits_kernel`` from the forward's TMA loop: one program per (vocabulary split, row
    block) walks its split with one flattened loop over (tile, D step) pairs (the pipeline runs across tiles), and
    each finished logit tile becomes a tile of G in the epilogue. TMA zero-fills loads past N, V and D; stores are
    masked."""
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    y = tl.load(Y + offs_n, mask=mask_n, other=-1)
    lse2 = tl.load(LSE + offs_n, mask=mask_n, other=0.0) * 1.4426950408889634
    b = tl.load(SMOOTH + offs_n, mask=mask_n, other=0.0)
    grad = tl.load(GRAD + offs_n, mask=mask_n, other=0.0)
    uniform = b * inv_v * grad
    on_target = (1.0 - b) * grad
    extra = grad * 0.0
    if HAS_EXTRA:
        extra = tl.load(EXTRA + offs_n, mask=mask_n, other=0.0)
    v_start, v_end = _split_bounds(V, NUM_SPLITS, BLOCK_V)
    k_steps = tl.cdiv(D, BLOCK_D)
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    g_rows = G + offs_n[:, None].to(tl.int64) * stride_gn
    for it in range(0, tl.cdiv(v_end - v_start, BLOCK_V) * k_steps):
        v0 = v_start + (it // k_steps) * BLOCK_V
        k = it % k_steps
        h = h_desc.load([n0, k * BLOCK_D])
        w = w_desc.load([v0, k * BLOCK_D])
        acc = _dot(h, tl.trans(w), acc, DOT_PRECISION, UPCAST)
        if k == k_steps - 1:
            offs_v = v0 + tl.arange(0, BLOCK_V)
            mask_v = offs_v < v_end
            z, t = _finish_logits(acc, B, offs_v, mask_v, softcap, HAS_BIAS, SOFTCAP)
            p = tl.math.exp2(z * 1.4426950408889634 - lse2[:, None])
            g = p * (grad + extra)[:, None] - uniform[:, None] - tl.where(offs_v[None, :] == y[:, None],
                                                                          on_target[:, None], 0.0)
            if SOFTCAP:
                g = g * (1.0 - t * t)
            tl.store(g_rows + offs_v[None, :], g.to(G.dtype.element_ty), mask=mask_n[:, None] & mask_v[None, :])
            acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)


_lce_grad_logits_autotuned = triton.autotune(
    configs=tuning_configs([(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 256, 64, 4, 4),
                            (128, 128, 64, 4, 4), (256, 128, 64, 8, 3)]),
    key=["D", "V", "DOT_PRECISION"])(_lce_grad_logits_kernel)


def add_chunk_gradients(g, hidden_chunk, weight, dh_chunk, dw, db, first: bool) -> None:
    """From G = dL/dz of one chunk of rows (rows x V): ``dh_chunk = G W``, ``dW += G^T h`` (written,
    not added, on the first chunk) and ``db += sum of G's rows``, by cuBLAS; any of them may be None."""
    if dh_chunk is not None:
        torch.mm(g, weight, out=dh_chunk)
    if dw is not None:
        if first:
            torch.mm(g.T, hidden_chunk, out=dw)
        else:
            dw.addmm_(g.T, hidden_chunk)
    if db is not None:
        db += g.sum(0, dtype=torch.float32)


def write_grad_logits(config, hidden, weight, bias, targets, lse, grad, smoothing, extra, g, v_total: int,
                      softcap) -> None:
    """G (rows of ``hidden`` x rows of ``weight``) = ``grad_n dL/dz + extra_n p``, for the columns ``weight`` holds
    of a vocabulary of ``v_total`` (``targets`` and ``bias`` relative to those columns): the TMA kernel with the
    forward's grid where it can read the inputs, else the (autotuned) pointer kernel."""
    n, d = hidden.shape
    vc = weight.shape[0]
    b = bias if bias is not None else weight
    ext = extra if extra is not None else grad
    cap = float(softcap) if softcap is not None else 1.0
    flags = dict(HAS_BIAS=bias is not None, SOFTCAP=softcap is not None, HAS_EXTRA=extra is not None,
                 DOT_PRECISION=config.dot_precision, UPCAST=config.upcast_dot)
    if tma_ready(config, hidden, weight):
        from triton.tools.tensor_descriptor import TensorDescriptor

        h_desc = TensorDescriptor.from_tensor(hidden, [config.block_n, config.block_d])
        w_desc = TensorDescriptor.from_tensor(weight, [config.block_v, config.block_d])
        blocks = triton.cdiv(n, config.block_n)
        splits = vocab_splits(config, n, vc, config.block_v)
        launch(_lce_grad_logits_tma_kernel, None, config, lambda meta: (splits, blocks),
               (h_desc, w_desc, b, targets, lse, grad, smoothing, ext, g, n, vc, d, splits, g.stride(0), cap,
                1.0 / v_total), flags)
    else:
        launch(_lce_grad_logits_kernel, _lce_grad_logits_autotuned, config,
               lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(vc, meta["BLOCK_V"])),
               (hidden, weight, b, targets, lse, grad, smoothing, ext, g, n, vc, d, hidden.stride(0), hidden.stride(1),
                weight.stride(0), weight.stride(1), g.stride(0), cap, 1.0 / v_total), flags)


def add_column_chunk_gradients(g, hidden, weight_cols, dh_acc, dw_rows, db_rows, first: bool) -> None:
    """From G over one chunk of vocabulary columns (every row): those rows of dW written whole (one matmul over all
    N, one rounding), ``G W_cols`` added into the fp32 dh accumulator (written on the ``first`` chunk), those
    entries of db; any of them may be None."""
    from .train_pass import _addmm_f32, _mm_f32

    if dw_rows is not None:
        if hidden.is_cuda:
            torch.mm(g.T, hidden, out=dw_rows)
        else:
            dw_rows.copy_((g.float().T @ hidden.float()).to(dw_rows.dtype))
    if dh_acc is not None:
        if first:
            _mm_f32(g, weight_cols, dh_acc)
        else:
            _addmm_f32(dh_acc, g, weight_cols)
    if db_rows is not None:
        db_rows.copy_(g.sum(0, dtype=torch.float32))


def triton_backward_dense(hidden, weight, bias, targets, lse, grad, smoothing, softcap, config,
                          need_dh: bool = True, need_dw: bool = True, chunk_bytes: int | None = None,
                          extra: torch.Tensor | None = None):
    """Full gradients (dh in hidden's dtype, dW in weight's dtype, db fp32) through chunks of G."""
    from .config import GRAD_CHUNK_BYTES

    n, d = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    rows = max(1, min(n, (chunk_bytes or GRAD_CHUNK_BYTES) // (v * hidden.element_size())))
    g = torch.empty(rows, v, dtype=hidden.dtype, device=dev)
    dh = torch.empty(n, d, dtype=hidden.dtype, device=dev) if need_dh else None
    dw = torch.empty(v, d, dtype=weight.dtype, device=dev) if need_dw else None
    db = torch.zeros(v, dtype=torch.float32, device=dev) if bias is not None else None
    for s in range(0, n, rows):
        e = min(n, s + rows)
        gc = g[: e - s]
        write_grad_logits(config, hidden[s:e], weight, bias, targets[s:e], lse[s:e], grad[s:e], smoothing[s:e],
                          extra[s:e] if extra is not None else None, gc, v, softcap)
        add_chunk_gradients(gc, hidden[s:e], weight, dh[s:e] if need_dh else None, dw, db, first=s == 0)
    return dh, dw, db


def triton_backward(hidden, weight, bias, targets, lse, grad, smoothing, softcap, config,
                    filter_eps: float, need_dh: bool = True, need_dw: bool = True,
                    count_skipped: bool = False, extra: torch.Tensor | None = None):
    """Softmax-part gradients (fp32) for 2-D ``hidden``; returns (dh, dw, db, skipped_tiles).

    The rank-one smoothing term is not included: the caller adds it (see module docstring).
    """
    n, d = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    dh = torch.zeros(n if need_dh else 1, d, dtype=torch.float32, device=dev)
    dw = torch.zeros(v if need_dw else 1, d, dtype=torch.float32, device=dev)
    db = torch.zeros(v, dtype=torch.float32, device=dev) if bias is not None else None
    skipped = torch.zeros(1, dtype=torch.int32, device=dev)
    args = (hidden, weight, bias if bias is not None else weight, targets, lse, grad, smoothing,
            extra if extra is not None else grad, dh, dw, db if db is not None else dw, skipped, n, v, d,
            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
            float(softcap) if softcap is not None else 1.0, 1.0 / v, float(filter_eps))
    flags = dict(HAS_BIAS=bias is not None, SOFTCAP=softcap is not None, FILTER=filter_eps > 0,
                 HAS_EXTRA=extra is not None, NEED_DH=need_dh, NEED_DW=need_dw, COUNT_SKIPPED=count_skipped,
                 DOT_PRECISION=config.dot_precision, UPCAST=config.upcast_dot)
    # No autotuned twin: autotuning re-runs the kernel, and its atomics would accumulate each run.
    launch(_lce_backward_kernel, None, config,
           lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(v, meta["BLOCK_V"])), args, flags)
    return dh, dw, db, int(skipped.item()) if count_skipped else None


def triton_gradients_by_columns(hidden, weight, bias, targets, lse, grad, smoothing, softcap, config,
                                need_dh: bool = True, need_dw: bool = True, need_db: bool = True,
                                chunk_bytes: int | None = None, extra: torch.Tensor | None = None):
    """The gradients of ``triton_backward_dense`` (dh in hidden's dtype, dW in weight's, db fp32), through chunks
    of vocabulary *columns* of G: the lse is known, so each chunk of columns is complete for every row. Its rows of
    dW come from one matmul over all N (written once, one rounding, as torch's own bf16 path), its part of dh is
    added into an fp32 accumulator (``4 N D`` bytes; one rounding at the end). The logits are recomputed on chip
    (the TMA kernel where the device has one); G is written in the input dtype, ``chunk_bytes`` at a time."""
    from .config import GRAD_CHUNK_BYTES

    n, d = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    cols = max(1, min(v, (chunk_bytes or GRAD_CHUNK_BYTES) // (max(n, 1) * hidden.element_size())))
    if cols < v and config.tma:
        cols = max(config.block_v, cols // config.block_v * config.block_v)  # whole tiles per chunk
    buf = torch.empty(n * cols, dtype=hidden.dtype, device=dev)
    dh_acc = torch.empty(n, d, dtype=torch.float32, device=dev) if need_dh else None
    dw = torch.empty(v, d, dtype=weight.dtype, device=dev) if need_dw else None
    db = torch.empty(v, dtype=torch.float32, device=dev) if (need_db and bias is not None) else None
    for c0 in range(0, v, cols):
        c1 = min(v, c0 + cols)
        g = buf[: n * (c1 - c0)].view(n, c1 - c0)
        # the kernels compare targets with local column indices; ignored rows (-1) stay negative
        write_grad_logits(config, hidden, weight[c0:c1], bias[c0:c1] if bias is not None else None, targets - c0,
                          lse, grad, smoothing, extra, g, v, softcap)
        add_column_chunk_gradients(g, hidden, weight[c0:c1], dh_acc, dw[c0:c1] if need_dw else None,
                                   db[c0:c1] if db is not None else None, first=c0 == 0)
    return (dh_acc.to(hidden.dtype) if need_dh else None), dw, db
