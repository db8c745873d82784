"""Triton backward kernel: gradient of the softmax part, tile by tile, with tile skipping.

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

from .forward import _dot, _logit_tile


@triton.jit
def _lce_backward_kernel(
    H, W, B, Y, LSE, GRAD, SMOOTH,
    DH, DW, DB, SKIPPED,
    N, V, D,
    stride_hn, stride_hd, stride_wv, stride_wd,
    softcap, inv_v, filter_eps,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, FILTER: tl.constexpr,
    NEED_DH: tl.constexpr, NEED_DW: tl.constexpr,
    COUNT_SKIPPED: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_n = offs_n < N
    mask_v = offs_v < V

    grad = tl.load(GRAD + offs_n, mask=mask_n, other=0.0)
    # Rows with no upstream gradient (ignored tokens, padding) contribute nothing.
    active = mask_n & (grad != 0.0)
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

    keep = True
    if FILTER:
        keep = tl.max(tl.max(tl.abs(g), axis=1), axis=0) >= filter_eps
    if keep:
        gc = (g * grad[:, None]).to(H.dtype.element_ty)
        if HAS_BIAS:
            tl.atomic_add(DB + offs_v, tl.sum(g * grad[:, None], axis=0), mask=mask_v)
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


def triton_backward(hidden, weight, bias, targets, lse, grad, smoothing, softcap, config,
                    filter_eps: float, need_dh: bool = True, need_dw: bool = True,
                    count_skipped: bool = False):
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
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(v, config.block_v))
    _lce_backward_kernel[grid](
        hidden, weight, bias if bias is not None else weight, targets, lse, grad, smoothing,
        dh, dw, db if db is not None else dw, skipped,
        n, v, d,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        float(softcap) if softcap is not None else 1.0, 1.0 / v, float(filter_eps),
        HAS_BIAS=bias is not None, SOFTCAP=softcap is not None, FILTER=filter_eps > 0,
        NEED_DH=need_dh, NEED_DW=need_dw, COUNT_SKIPPED=count_skipped, DOT_PRECISION=config.dot_precision, UPCAST=config.upcast_dot,
        BLOCK_N=config.block_n, BLOCK_V=config.block_v, BLOCK_D=config.block_d,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return dh, dw, db, int(skipped.item()) if count_skipped else None
