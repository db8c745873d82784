"""Triton backward kernels: the gradient of the loss with respect to the logits, G, recomputed tile by tile.

The logits are recomputed on chip from h and W (the lse is known), and each finished tile of

    G_nv = grad_n (p_nv (1 + extra_n / grad_n) - b_n / V - (1 - b_n) [v == y_n]) (1 - tanh^2)

(the last factor with soft-cap) is written in the input dtype; cuBLAS then computes ``dh = G W`` and ``dW = G^T h``.
G goes a chunk of vocabulary columns at a time (``triton_gradients_by_columns``: the two-pass training path,
``memory="low"`` and the recomputing backward for an arbitrary upstream gradient), every row by a chunk of columns,
so each chunk's rows of dW are written once (one rounding) and dh adds into an fp32 accumulator.
"""

# (no `from __future__ import annotations` in a kernel module: Triton 3.1's interpreter then misreads each kernel's
# tl.constexpr parameters)
import functools

import torch
import triton
import triton.language as tl

from .config import launch, tuning_configs
from .matmul import addmm_f32, fp16_weights, kept_dtype, mm_f32
from .tiles import _dot, _finish_logits, _logit_tile, _split_bounds, _tile_offsets, tma_ready, vocab_splits
from .train_pass import logits_gradients


@triton.jit
def _grad_tile(G, stride_gn, z, t, offs_n, offs_v, mask_n, mask_v, y, lse2, p_mult, uniform, on_target,
               SOFTCAP: tl.constexpr):
    """One tile of G from its logits (``z`` fp32, bias added, capped; ``t`` the tanh of the cap), stored in G's
    dtype."""
    p = tl.math.exp2(z * 1.4426950408889634 - lse2[:, None])
    g = p * p_mult[:, None] - uniform[:, None] - tl.where(offs_v[None, :] == y[:, None], on_target[:, None], 0.0)
    if SOFTCAP:
        g = g * (1.0 - t * t)
    m = mask_n[:, None] & mask_v[None, :]
    tl.store(G + offs_n[:, None].to(tl.int64) * stride_gn + offs_v[None, :], g.to(G.dtype.element_ty), mask=m)


@triton.jit
def _row_terms(Y, LSE, GRAD, SMOOTH, EXTRA, offs_n, mask_n, inv_v, HAS_EXTRA: tl.constexpr):
    """Per row of a tile: target, lse in base 2, the factor of p, the uniform term and the target's term."""
    y = tl.load(Y + offs_n, mask=mask_n, other=-1)
    lse2 = tl.load(LSE + offs_n, mask=mask_n, other=0.0) * 1.4426950408889634
    b = tl.load(SMOOTH + offs_n, mask=mask_n, other=0.0)
    grad = tl.load(GRAD + offs_n, mask=mask_n, other=0.0)
    p_mult = grad
    if HAS_EXTRA:
        p_mult += tl.load(EXTRA + offs_n, mask=mask_n, other=0.0)
    uniform = b * inv_v * grad
    return y, lse2, p_mult, uniform, (1.0 - b) * grad


@triton.jit(do_not_specialize=["N"])  # (batch-dependent counts: one variant for all)
def _lce_grad_logits_kernel(
    H, W, B, Y, LSE, GRAD, SMOOTH, EXTRA, G,
    N, V, D,
    stride_hn, stride_hd, stride_wv, stride_wd, stride_gn,
    softcap, inv_v,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, HAS_EXTRA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """G[n, v] = grad_n * dloss_n / dz_nv (+ extra_n p_nv: z-loss, an lse output's gradient), the full
    gradient (smoothing term included), input dtype; one program per tile."""
    offs_n, offs_v, mask_n, mask_v = _tile_offsets(N, V, BLOCK_N, BLOCK_V)
    z, t = _logit_tile(H, W, B, offs_n, offs_v, mask_n, mask_v, D, stride_hn, stride_hd,
                       stride_wv, stride_wd, softcap, HAS_BIAS, SOFTCAP, BLOCK_D,
                       DOT_PRECISION, UPCAST, BLOCK_N, BLOCK_V)
    y, lse2, p_mult, uniform, on_target = _row_terms(Y, LSE, GRAD, SMOOTH, EXTRA, offs_n, mask_n, inv_v, HAS_EXTRA)
    _grad_tile(G, stride_gn, z, t, offs_n, offs_v, mask_n, mask_v, y, lse2, p_mult, uniform, on_target, SOFTCAP)


@triton.jit(do_not_specialize=["N", "NUM_SPLITS"])  # (batch-dependent counts: one variant for all)
def _lce_grad_logits_tma_kernel(
    h_desc, w_desc, B, Y, LSE, GRAD, SMOOTH, EXTRA, G,
    N, V, D, NUM_SPLITS, stride_gn,
    softcap, inv_v,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, HAS_EXTRA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The G of ``_lce_grad_logits_kernel`` from the fused logits kernel's TMA loop: one program per (vocabulary split,
    row block) walks its split with one flattened loop over (tile, D step) pairs (the pipeline runs across tiles),
    and each finished logit tile becomes a tile of G in the epilogue. TMA zero-fills loads past N, V and D; stores
    are masked."""
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    y, lse2, p_mult, uniform, on_target = _row_terms(Y, LSE, GRAD, SMOOTH, EXTRA, offs_n, mask_n, inv_v, HAS_EXTRA)
    v_start, v_end = _split_bounds(V, NUM_SPLITS, BLOCK_V)
    k_steps = tl.cdiv(D, BLOCK_D)
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
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
            _grad_tile(G, stride_gn, z, t, offs_n, offs_v, mask_n, mask_v, y, lse2, p_mult, uniform, on_target,
                       SOFTCAP)
            acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)


# The pointer G kernel's autotuning candidates (the TMA kernel and the interpreter take fixed tiles)
GRAD_LOGITS_TILES = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 256, 64, 4, 4), (128, 128, 64, 4, 4),
                     (256, 128, 64, 8, 3)]


@functools.lru_cache(maxsize=None)
def grad_logits_autotuned():
    """The pointer G kernel under ``triton.autotune``, made at its first use: Triton 3.2 and 3.3 ask the active
    driver for a benchmarker when the autotuner is made, which fails without a GPU (the interpreter's CPU runs)."""
    return triton.autotune(configs=tuning_configs(GRAD_LOGITS_TILES), key=["D", "V", "DOT_PRECISION"])(
        _lce_grad_logits_kernel)


def write_grad_logits(config, hidden, weight, bias, targets, lse, grad, smoothing, extra, g, v_total: int,
                      softcap) -> None:
    """G (rows of ``hidden`` x rows of ``weight``) = ``grad_n dL/dz + extra_n p``, for the columns ``weight`` holds
    of a vocabulary of ``v_total`` (``targets`` and ``bias`` relative to those columns): the TMA kernel with the
    fused logits kernel's grid where it can read the inputs, else the (autotuned) pointer kernel."""
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
        launch(_lce_grad_logits_kernel, grad_logits_autotuned() if config.autotune else None, config,
               lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(vc, meta["BLOCK_V"])),
               (hidden, weight, b, targets, lse, grad, smoothing, ext, g, n, vc, d, hidden.stride(0),
                hidden.stride(1), weight.stride(0), weight.stride(1), g.stride(0), cap, 1.0 / v_total), flags)


def add_column_chunk_gradients(g, hidden, weight_cols, dh_acc, dw_rows, db_rows, first: bool) -> None:
    """From G over one chunk of vocabulary columns (every row): those rows of dW written whole (one matmul over all
    N, one rounding), ``G W_cols`` added into the fp32 dh accumulator (written on the ``first`` chunk), those
    entries of db; any of them may be None."""
    if dw_rows is not None:
        if dw_rows.dtype != g.dtype:  # (fp16's fp32 dW: matmul.kept_dtype)
            mm_f32(g.T, hidden, dw_rows)
        elif hidden.is_cuda:
            torch.mm(g.T, hidden, out=dw_rows)
        else:
            dw_rows.copy_((g.float().T @ hidden.float()).to(dw_rows.dtype))
    if dh_acc is not None:
        if first:
            mm_f32(g, weight_cols, dh_acc)
        else:
            addmm_f32(dh_acc, g, weight_cols)
    if db_rows is not None:
        db_rows.copy_(g.sum(0, dtype=torch.float32))


def triton_gradients_by_columns(hidden, weight, bias, targets, lse, grad, smoothing, softcap, config,
                                need_dh: bool = True, need_dw: bool = True, need_db: bool = True,
                                chunk_bytes: int | None = None, extra: torch.Tensor | None = None,
                                cublas: bool = False):
    """(dh, dW, db, gamma): gamma (None but for fp16, ``matmul.fp16_weights``) times dh, dW and db are the gradients
    of ``sum_n grad_n loss_n (+ extra_n p_n)`` (dh in hidden's dtype, dW in weight's, both fp32 for fp16:
    ``kept_dtype``; db fp32),
    through chunks of vocabulary *columns* of G: the lse is known, so each chunk of columns is complete for every
    row. Its rows of dW come from one matmul over all N (written once, one rounding, as torch's own bf16 path), its
    part of dh is added into an fp32 accumulator (``4 N D`` bytes; one rounding at the end). The logits are
    recomputed on chip (the TMA kernel where the device has one); G is written in the input dtype, ``chunk_bytes``
    at a time. ``cublas`` (where Triton's dots are FMA: ``dispatch.cublas_logits``): each chunk's logits from cuBLAS
    in fp32 (``chunk_bytes`` of them) and G by the one-pass path's row kernel (``train_pass.logits_gradients``)."""
    from .config import GRAD_CHUNK_BYTES

    (grad, extra), gamma = fp16_weights(hidden.dtype, grad, extra)  # (fp16: G keeps its digits; gamma returned)
    n, d = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    cols = max(1, min(v, (chunk_bytes or GRAD_CHUNK_BYTES) // (max(n, 1) * (4 if cublas else hidden.element_size()))))
    if cols < v and cublas:  # 16-byte rows of fp32 logits
        cols = max(8, cols // 8 * 8)
    elif cols < v and config.tma:  # whole tiles per chunk
        cols = max(config.block_v, cols // config.block_v * config.block_v)
    elif cols < v:  # a power of two for the pointer kernel, whose autotuning key holds the chunk's width: a width that
        # followed N would tune again at every new token count
        cols = 1 << (cols.bit_length() - 1)
    buf = torch.empty(n * cols, dtype=torch.float32 if cublas else hidden.dtype, device=dev)
    dh_acc = torch.empty(n, d, dtype=torch.float32, device=dev) if need_dh else None
    dw = torch.empty(v, d, dtype=kept_dtype(weight.dtype), device=dev) if need_dw else None
    db = torch.empty(v, dtype=torch.float32, device=dev) if (need_db and bias is not None) else None
    for c0 in range(0, v, cols):
        c1 = min(v, c0 + cols)
        # the kernels compare targets with local column indices; ignored rows (-1) stay negative
        b_cols = bias[c0:c1] if bias is not None else None
        if cublas:
            g = logits_gradients(hidden, weight[c0:c1], b_cols, targets - c0, lse, grad, smoothing, extra, buf, v,
                                 softcap)
        else:
            g = buf[: n * (c1 - c0)].view(n, c1 - c0)
            write_grad_logits(config, hidden, weight[c0:c1], b_cols, targets - c0, lse, grad, smoothing, extra, g, v,
                              softcap)
        add_column_chunk_gradients(g, hidden, weight[c0:c1], dh_acc, dw[c0:c1] if need_dw else None,
                                   db[c0:c1] if db is not None else None, first=c0 == 0)
    return (dh_acc.to(kept_dtype(hidden.dtype)) if need_dh else None), dw, db, gamma
