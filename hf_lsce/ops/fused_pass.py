"""The fused computation: one logits matmul for the loss and its gradients, no fp32 logits in memory
(docs/how_it_works.md has the derivation and the measurements).

The logits kernel (``_exp_tiles_kernel``; TMA loads on Hopper, pointer loads elsewhere) computes each tile once and in
its epilogue folds it into the rows' statistics and stores ``R = exp(z - c)`` in the input dtype, with a per-row
offset fixed before the kernel (the mean logit plus ``C_SHIFT``; a row whose max passes it by more than
``R_EXP_MAX`` is redone by a second, fix-up launch with its max as the offset). With ``S = sum_v R``:

    dh = a o (R' W) - u colsum(W),   dW = R'^T (a o h) - 1 (u^T h)^T,   a = w k / S,   u = w b / V

(``w`` the token's weight, ``b`` its smoothing, ``k = 1 + 2 lam lse`` the z-loss's factor, R' R with the target
entry ``R_y - (1 - b) S / k``). Layouts (``budget.Plan``): ``rows`` (R for every row, dW written by one matmul with the
rank-one term as two extra rows; or chunks of rows with dW's fp32 accumulator), ``columns`` (R kept for the first
``keep`` columns, the rest recomputed as G by the kernel's G epilogue once the lse is known: ``fused_gradients``),
``frozen`` (no dW: chunks of columns, every row, the logits once: ``triton_fused_columns``). fp16 keeps R relative to
each row's running max (``online``); a soft-cap (up to ``SOFTCAP_MAX``) takes the cap as the offset and its
derivative from log R (``_softcap_grad_kernel``).
"""

# (no `from __future__ import annotations` in a kernel module: Triton 3.1's interpreter then misreads each kernel's
# tl.constexpr parameters)
import torch
import triton
import triton.language as tl

from .config import fused_config, interpreting
from .matmul import MM_OUT_DTYPE, addmm_f32, fp16_weights, kept_dtype, mm_f32
from .tiles import _dot, _finish_logits, _init_state, _logit_acc, _split_bounds, _tanh, tma_ready

# c = mean logit + C_SHIFT; a row whose max exceeds c by more than R_EXP_MAX (R <= e^48 in bf16) is redone with c = max
C_SHIFT = 24.0
R_EXP_MAX = 48.0
# The largest soft-cap: the offset is the cap, so R >= e^-80 stays a normal bf16 number (Gemma 2 caps at 30)
SOFTCAP_MAX = 40.0


@triton.jit
def _exp_epilogue(acc, v0, v_end, v_store, B, R, stride_rn, offs_n, mask_n, c, c2, m, s, t_acc, sz, am, softcap, MT,
                  stride_mt, pm, uu, ot, y, HAS_BIAS: tl.constexpr, STATS: tl.constexpr, STORE: tl.constexpr,
                  SOFTCAP: tl.constexpr, ONLINE: tl.constexpr, GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
    """One finished tile (``acc``, columns from ``v0``) folded into the rows' state, its R stored below column
    ``v_store`` (STORE). ONLINE (fp16): R and the state relative to the row's running max, recorded per tile in MT.
    GRAD: the tile of G itself, ``p pm - uu - ot [v = y]`` (times the cap's derivative), ``c2`` the lse in base 2."""
    offs_v = v0 + tl.arange(0, BLOCK_V)
    mask_v = offs_v < v_end
    if GRAD:
        zg, tg = _finish_logits(acc, B, offs_v, mask_v, softcap, HAS_BIAS, SOFTCAP)
        g = (tl.math.exp2(zg * 1.4426950408889634 - c2[:, None]) * pm[:, None] - uu[:, None]
             - tl.where(offs_v[None, :] == y[:, None], ot[:, None], 0.0))
        if SOFTCAP:
            g = g * (1.0 - tg * tg)
        tl.store(R + offs_n[:, None].to(tl.int64) * stride_rn + offs_v[None, :], g.to(R.dtype.element_ty),
                 mask=mask_n[:, None] & mask_v[None, :])
        return m, s, t_acc, sz, am
    z, _t = _finish_logits(acc, B, offs_v, mask_v, 1.0, HAS_BIAS, False)
    # -inf past this split's columns; the mask is a select per logit, kept rather than a branch for full
    # tiles (a runtime branch here slowed the loop 5-8 % at D >= 2,304: docs/benchmarks.md)
    if ONLINE:
        z_m = tl.where(mask_v[None, :], z, float("-inf"))
        tile_max = tl.max(z_m, axis=1)
        m_new = tl.maximum(m, tile_max)
        dm = tl.where(m > float("-inf"), m - m_new, 0.0)  # (0 before the first tile, where s = t = 0)
        f = tl.math.exp2(dm * 1.4426950408889634)
        r = tl.math.exp2((z_m - m_new[:, None]) * 1.4426950408889634)
        if STATS:
            am = tl.where(tile_max > m, tl.argmax(z_m, axis=1).to(tl.int32) + v0, am)
            t_acc = f * (t_acc + s * dm) + tl.sum(r * tl.where(mask_v[None, :], z - m_new[:, None], 0.0), axis=1)
        s = f * s + tl.sum(r, axis=1)
        m = m_new
        tl.store(MT + offs_n * stride_mt + v0 // BLOCK_V, m, mask=mask_n)
        if STORE:
            tl.store(R + offs_n[:, None].to(tl.int64) * stride_rn + offs_v[None, :],
                     r.to(R.dtype.element_ty), mask=mask_n[:, None] & (offs_v < v_store)[None, :])
        return m, s, t_acc, sz, am
    if SOFTCAP:
        # cap tanh(z / cap) = cap (1 - 2 d) with d = 1 / (exp(2 z / cap) + 1); the offset is the cap, so
        # R = exp(-2 cap d), and the row's sum of capped logits is 2 cap times that of 1/2 - d. No max
        # unless STATS: no row leaves the range. STATS in d alone (z - c = -2 cap d; the max of z is the min of d).
        d = 1.0 / (tl.math.exp2(z * (2.8853900817779268 / softcap)) + 1.0)
        sz += tl.sum(tl.where(mask_v[None, :], 0.5 - d, 0.0), axis=1)
        r = tl.where(mask_v[None, :], tl.math.exp2(d * (-2.8853900817779268 * softcap)), 0.0)
        if STATS:
            d_m = tl.where(mask_v[None, :], d, 2.0)
            tile_max = (2.0 * softcap) * (0.5 - tl.min(d_m, axis=1))
            am = tl.where(tile_max > m, tl.argmin(d_m, axis=1).to(tl.int32) + v0, am)
            t_acc -= (2.0 * softcap) * tl.sum(r * d, axis=1)
            m = tl.maximum(m, tile_max)
    else:
        r = tl.math.exp2(tl.where(mask_v[None, :], z, float("-inf")) * 1.4426950408889634 - c2[:, None])
        z_m = tl.where(mask_v[None, :], z, float("-inf"))
        tile_max = tl.max(z_m, axis=1)
        if STATS:
            am = tl.where(tile_max > m, tl.argmax(z_m, axis=1).to(tl.int32) + v0, am)
            t_acc += tl.sum(r * (tl.where(mask_v[None, :], z, 0.0) - c[:, None]), axis=1)
        m = tl.maximum(m, tile_max)
    s += tl.sum(r, axis=1)
    if STORE:
        tl.store(R + offs_n[:, None].to(tl.int64) * stride_rn + offs_v[None, :],
                 r.to(R.dtype.element_ty), mask=mask_n[:, None] & (offs_v < v_store)[None, :])
    return m, s, t_acc, sz, am


# (per-batch counts: one variant for all; V and v_store stay specialised: without their divisibility by 16 the mask of
# R's store is no longer constant over 16 columns and the store goes 2 bytes at a time, 1.5 x the pass's time at the
# Gemma-3-270m head on an H200; a chunk's width is a multiple of the tile or the vocabulary's own)
@triton.jit(do_not_specialize=["N", "NUM_SPLITS", "col0"])
def _exp_tiles_kernel(
    H, W, R, B, C, MT,
    S_OUT, T_OUT, M_OUT, AM_OUT, SZ_OUT, TERMS, Y,
    N, V, D, NUM_SPLITS, v_store, col0, stride_rn, stride_hn, stride_hd, stride_wv, stride_wd, stride_mt, r_exp_max,
    softcap,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, STATS: tl.constexpr,
    FIXUP: tl.constexpr, STORE: tl.constexpr, SOFTCAP: tl.constexpr, ONLINE: tl.constexpr, GRAD: tl.constexpr,
    TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
):
    """Per (vocabulary split, row block): R = exp(z - c) stored tile by tile (STORE) and, per row over the split, S
    = sum R, the max and (STATS) T = sum R (z - c) and the argmax. FIXUP: the second launch; a row whose max exceeds
    its offset by more than ``r_exp_max`` is redone with its max as offset, and only blocks holding one run.
    SOFTCAP: the offset is the cap, and the capped logits' sum goes to SZ_OUT. ONLINE: fp16's running maxima
    (``online``). TMA: H and W are tensor descriptors, one flattened loop over (tile, D step) pairs; else pointer
    loads, a D loop per tile. GRAD: G from the lse (C) and the rows' TERMS (the factor of p, the uniform term, the
    target's) and Y (targets; ``col0`` the chunk's first column)."""
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    c = tl.load(C + offs_n, mask=mask_n, other=0.0)
    pm = c
    uu = c
    ot = c
    y = offs_n
    if GRAD:
        pm = tl.load(TERMS + offs_n, mask=mask_n, other=0.0)
        uu = tl.load(TERMS + N + offs_n, mask=mask_n, other=0.0)
        ot = tl.load(TERMS + 2 * N + offs_n, mask=mask_n, other=0.0)
        y = tl.load(Y + offs_n, mask=mask_n, other=-1) - col0
    run = True
    if FIXUP:
        c, flagged = _effective_offsets(M_OUT, c, offs_n, mask_n, N, NUM_SPLITS, r_exp_max, BLOCK_N)
        run = tl.max(flagged.to(tl.int32), axis=0) > 0
    if run:
        c2 = c * 1.4426950408889634
        m, s, t_acc, sz, am = _init_state(BLOCK_N)
        v_start, v_end = _split_bounds(V, NUM_SPLITS, BLOCK_V)
        # One of the two loops is compiled (TMA is a compile-time constant): a runtime-empty loop would still be
        # compiled, and descriptor loads do not compile on pointers.
        if TMA:
            k_steps = tl.cdiv(D, BLOCK_D)
            acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
            for it in range(0, tl.cdiv(v_end - v_start, BLOCK_V) * k_steps):
                v0 = v_start + (it // k_steps) * BLOCK_V
                k = it % k_steps
                h = H.load([n0, k * BLOCK_D])
                w = W.load([v0, k * BLOCK_D])
                acc = _dot(h, tl.trans(w), acc, DOT_PRECISION, UPCAST)
                if k == k_steps - 1:
                    m, s, t_acc, sz, am = _exp_epilogue(acc, v0, v_end, v_store, B, R, stride_rn, offs_n, mask_n, c,
                                                        c2, m, s, t_acc, sz, am, softcap, MT, stride_mt, pm, uu, ot,
                                                        y, HAS_BIAS, STATS, STORE, SOFTCAP, ONLINE, GRAD, BLOCK_V)
                    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        else:  # pointer loads: a D loop per vocabulary tile (Triton's classic matmul loop: 1-13 % faster than the
            # flattened one with pointers, settled experiments: pointer_blocks.py)
            for v0 in range(v_start, v_end, BLOCK_V):
                offs_w = v0 + tl.arange(0, BLOCK_V)
                acc = _logit_acc(H, W, offs_n.to(tl.int64), offs_w.to(tl.int64), mask_n, offs_w < V, D, stride_hn,
                                 stride_hd, stride_wv, stride_wd, BLOCK_D, DOT_PRECISION, UPCAST, BLOCK_N, BLOCK_V,
                                 EVEN_D)
                m, s, t_acc, sz, am = _exp_epilogue(acc, v0, v_end, v_store, B, R, stride_rn, offs_n, mask_n, c, c2,
                                                    m, s, t_acc, sz, am, softcap, MT, stride_mt, pm, uu, ot, y,
                                                    HAS_BIAS, STATS, STORE, SOFTCAP, ONLINE, GRAD, BLOCK_V)
        if not GRAD:
            out = tl.program_id(0) * N + offs_n
            tl.store(S_OUT + out, s, mask=mask_n)
            tl.store(T_OUT + out, t_acc, mask=mask_n)
            tl.store(M_OUT + out, m, mask=mask_n)
            tl.store(AM_OUT + out, am, mask=mask_n)
            if SOFTCAP:
                tl.store(SZ_OUT + out, (2.0 * softcap) * sz, mask=mask_n)


def supported(hidden, weight, softcap, config) -> bool:
    """Whether the fused computation runs these inputs: bf16 or fp16 on a GPU whose Triton dots are tensor-core MMA
    (compute capability 8.0 and newer, torch >= 2.9 for its fp32-output half matmuls) or the interpreter, with no
    soft-cap or one up to ``SOFTCAP_MAX``."""
    return (hidden.dtype in (torch.bfloat16, torch.float16) and weight.dtype == hidden.dtype and config.mma_dot
            and (softcap is None or softcap <= SOFTCAP_MAX) and (MM_OUT_DTYPE or not hidden.is_cuda))


def online(hidden) -> bool:
    """fp16's rows layout: fp16 holds about 27 nats, too few for R with an offset fixed before the logits, so R is
    kept relative to each row's running max and normalised into p once the lse is known (``_normalize_kernel``); the
    token weights are divided by gamma (``matmul.fp16_weights``) and dW goes through fp32."""
    return hidden.dtype == torch.float16


def _exp_tiles(config, h, weight, bias, c, r, stats: bool, bufs=None, descs=None, store: bool = True, softcap=None,
               mt=None, v_store: int | None = None, grad=None):
    """Launch the logits kernel on the rows ``h`` (offsets ``c``; R into ``r`` below column ``v_store``); returns
    (the per-split buffers S, T, max, argmax, sum of capped logits; the descriptors of h and W). ``bufs`` and
    ``descs``: the fix-up launch's, from the first. ``mt``: fp16's running maxima. ``grad`` = (terms, targets, first
    column): G into ``r``, ``c`` the lse."""
    n, d = h.shape
    v = weight.shape[0]
    splits = fused_splits(config, n, v)
    fixup = bufs is not None
    if bufs is None and grad is None:
        s, t, m, sz = torch.empty(4, splits, n, dtype=torch.float32, device=h.device)
        bufs = (s, t, m, torch.empty(splits, n, dtype=torch.int32, device=h.device), sz)
    if descs is None:  # the TMA kernel's descriptors, or the tensors themselves for pointer loads
        descs = (h, weight)
        if tma_ready(config, h, weight):
            from triton.tools.tensor_descriptor import TensorDescriptor

            descs = (TensorDescriptor.from_tensor(h, [config.block_n, config.block_d]),
                     TensorDescriptor.from_tensor(weight, [config.block_v, config.block_d]))
    use_tma = descs[0] is not h
    terms, y, col0 = grad if grad is not None else (c, c, 0)
    grid = (splits, triton.cdiv(n, config.block_n))
    _exp_tiles_kernel[grid](
        *descs, r, bias if bias is not None else weight, c, c if mt is None else mt,
        *(bufs if bufs is not None else (c,) * 5), terms, y, n, v, d, splits, v if v_store is None else v_store, col0,
        r.stride(0), *h.stride(), *weight.stride(), 0 if mt is None else mt.stride(0),
        R_EXP_MAX, float(softcap) if softcap is not None else 1.0,
        HAS_BIAS=bias is not None, DOT_PRECISION=config.dot_precision, UPCAST=config.upcast_dot,
        STATS=stats, FIXUP=fixup, STORE=store, SOFTCAP=softcap is not None, ONLINE=mt is not None,
        GRAD=grad is not None, TMA=use_tma, BLOCK_N=config.block_n,
        BLOCK_V=config.block_v, BLOCK_D=config.block_d, EVEN_D=d % config.block_d == 0, num_warps=config.num_warps,
        num_stages=config.num_stages)
    return bufs, descs


def fused_splits(config, rows: int, v: int) -> int:
    """Vocabulary splits of the grid: as many as keep about ``config.min_programs`` programs (two waves), at least
    ``config.min_splits``."""
    blocks = triton.cdiv(rows, config.block_n)
    return max(1, min(triton.cdiv(v, config.block_v), max(config.min_splits, config.min_programs // blocks)))


@triton.jit(do_not_specialize=["n"])  # (batch-dependent counts: one variant for all)
def _offsets_kernel(H, W, COLSUM, BIAS, BSUM, Y, C, SZ, ZY, n, V, D, stride_h, stride_hd, stride_w, stride_wd, shift,
                    softcap,
                    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Per row: the sum of logits ``h . colsum(W) (+ the bias's sum)``, the offset (the mean logit plus ``shift``)
    and the target logit (0 where ignored or past V: another rank's), fp32. SOFTCAP: the target logit capped, the
    offset the cap, no sum (the logits kernel adds the capped ones)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = rows < n
    y = tl.load(Y + rows, mask=mask_r, other=-1)
    has_y = mask_r & (y >= 0) & (y < V)  # (a target past V: another rank's, in the vocabulary-parallel forward)
    y_row = tl.maximum(y, 0).to(tl.int64) * stride_w
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    acc_y = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask_d = cols < D
        h = tl.load(H + rows[:, None].to(tl.int64) * stride_h + cols[None, :].to(tl.int64) * stride_hd,
                    mask=mask_r[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        if not SOFTCAP:
            acc += tl.sum(h * tl.load(COLSUM + cols, mask=mask_d, other=0.0)[None, :], axis=1)
        w_y = tl.load(W + y_row[:, None] + cols[None, :].to(tl.int64) * stride_wd,
                      mask=has_y[:, None] & mask_d[None, :], other=0.0)
        acc_y += tl.sum(h * w_y.to(tl.float32), axis=1)
    if HAS_BIAS:
        if not SOFTCAP:
            acc += tl.load(BSUM)
        acc_y += tl.load(BIAS + tl.maximum(y, 0), mask=has_y, other=0.0).to(tl.float32)
    if SOFTCAP:
        tl.store(C + rows, acc * 0.0 + softcap, mask=mask_r)
        acc_y = softcap * _tanh(acc_y / softcap)
    else:
        tl.store(SZ + rows, acc, mask=mask_r)
        tl.store(C + rows, acc / V + shift, mask=mask_r)
    tl.store(ZY + rows, tl.where(has_y, acc_y, 0.0), mask=mask_r)


@triton.jit
def _effective_offsets(M, c, rows, mask_r, n, splits, r_exp_max, BLOCK_R: tl.constexpr):
    """(the offsets R was computed with, the flagged rows) from the splits' row maxima (``_offset_rule``)."""
    m = tl.full((BLOCK_R,), float("-inf"), dtype=tl.float32)
    for k in range(0, splits):
        m = tl.maximum(m, tl.load(M + k * n + rows, mask=mask_r, other=float("-inf")))
    return _offset_rule(m, c, mask_r, r_exp_max)


@triton.jit
def _offset_rule(m, c, mask_r, r_exp_max):
    """A row whose max ``m`` passes its offset ``c`` by more than ``r_exp_max`` is flagged and takes its max as
    offset: (offsets, flagged)."""
    flagged = mask_r & (m - c > r_exp_max)
    return tl.where(flagged, m, c), flagged


@triton.jit
def _merge_splits(S, T, M, AM, rows, mask_r, n, splits, STATS: tl.constexpr, BLOCK_R: tl.constexpr,
                  ONLINE: tl.constexpr = False):
    """Per row, the splits' sum of R, T, max and first argmax merged (ONLINE: each split relative to its own max)."""
    zero = tl.zeros((BLOCK_R,), dtype=tl.float32)
    s, t_acc = zero, zero
    m = tl.full((BLOCK_R,), float("-inf"), dtype=tl.float32)
    am = tl.zeros((BLOCK_R,), dtype=tl.int32)
    for k in range(0, splits):
        at = k * n + rows
        sk = tl.load(S + at, mask=mask_r, other=1.0)
        mk = tl.load(M + at, mask=mask_r, other=0.0)
        tk = zero
        if STATS:
            tk = tl.load(T + at, mask=mask_r, other=0.0)
            am = tl.where(mk > m, tl.load(AM + at, mask=mask_r, other=0), am)  # first split holding the max
        if ONLINE:
            m_new = tl.maximum(m, mk)
            dm = tl.where(m > float("-inf"), m - m_new, 0.0)
            fa, fb = tl.exp(dm), tl.exp(mk - m_new)
            if STATS:
                t_acc = fa * (t_acc + s * dm) + fb * (tk + sk * (mk - m_new))
            s = fa * s + fb * sk
        else:
            s += sk
            t_acc += tk
        m = tl.maximum(m, mk)
    return s, t_acc, m, am


@triton.jit(do_not_specialize=["n", "splits", "col0"])  # (batch-dependent counts: one variant for all)
def _merge_columns_kernel(S, T, M, AM, C, S_RUN, T_RUN, M_RUN, AM_RUN, ACC, n, splits, D, stride_acc, col0,
                          r_exp_max, STATS: tl.constexpr, HAS_ACC: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    """A chunk of columns' splits (``triton_fused_columns``) folded into the rows' running state; a row whose offset
    the chunk raised has its running sums and (HAS_ACC) its row of dh's accumulator scaled by exp(c_old - c_new)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = rows < n
    s, t_acc, m, am = _merge_splits(S, T, M, AM, rows, mask_r, n, splits, STATS, BLOCK_R)
    c_old = tl.load(C + rows, mask=mask_r, other=0.0)
    c, flagged = _offset_rule(m, c_old, mask_r, r_exp_max)
    f = tl.exp(c_old - c)
    s_run = tl.load(S_RUN + rows, mask=mask_r, other=0.0)
    if STATS:
        t_run = tl.load(T_RUN + rows, mask=mask_r, other=0.0)
        tl.store(T_RUN + rows, f * (t_run + s_run * (c_old - c)) + t_acc, mask=mask_r)
        m_run = tl.load(M_RUN + rows, mask=mask_r, other=0.0)
        tl.store(AM_RUN + rows, tl.where(m > m_run, am + col0, tl.load(AM_RUN + rows, mask=mask_r, other=0)),
                 mask=mask_r)
        tl.store(M_RUN + rows, tl.maximum(m, m_run), mask=mask_r)
    tl.store(S_RUN + rows, s_run * f + s, mask=mask_r)
    tl.store(C + rows, c, mask=mask_r)
    if HAS_ACC:
        if tl.max(flagged.to(tl.int32), axis=0) > 0:
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                m2 = flagged[:, None] & (cols < D)[None, :]
                at = ACC + rows[:, None].to(tl.int64) * stride_acc + cols[None, :]
                tl.store(at, tl.load(at, mask=m2, other=0.0) * f[:, None], mask=m2)


@triton.jit
def _zloss_factor(lse, z_loss):
    """The z-loss scales p by ``k = 1 + 2 lam lse``, kept off 0 (where ``a = w k / S`` would lose the target term)."""
    k = 1.0 + 2.0 * z_loss * lse
    return tl.where(tl.abs(k) < 9.5367431640625e-07, 9.5367431640625e-07, k)


@triton.jit(do_not_specialize=["n", "splits", "v_store"])  # (batch-dependent counts: one variant for all)
def _finish_rows_kernel(
    S, T, M, AM, SZS, C, ZY, SZ, Y, SMOOTH, SCALE, H, R, HS,
    LSE_OUT, ENT_OUT, AM_OUT, A_OUT, U_OUT, LOSS_OUT, NLL_OUT,
    n, splits, v_store, D, stride_h, stride_hd, stride_r, stride_hs, inv_v, r_exp_max, z_loss,
    STATS: tl.constexpr, GRAD: tl.constexpr, R_TARGET: tl.constexpr, SCALE_H: tl.constexpr, SOFTCAP: tl.constexpr,
    ONLINE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Per row: the splits merged (lse = c + log S; STATS: entropy and argmax; SOFTCAP: the capped logits' sum), the
    token's loss and nll, and for the gradients (GRAD) a = w k / S and u = w b / V, R's target entry made ``R_y - (1
    - b) S / k`` where it is below ``v_store`` (R_TARGET), and a o h for dW (SCALE_H). ONLINE: lse = m + log S and a
    = w k (``_normalize_kernel`` sets the target)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = rows < n
    s, t_acc, m, am = _merge_splits(S, T, M, AM, rows, mask_r, n, splits, STATS, BLOCK_R, ONLINE)
    if SOFTCAP:
        sz = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k in range(0, splits):
            sz += tl.load(SZS + k * n + rows, mask=mask_r, other=0.0)
        tl.store(SZ + rows, sz, mask=mask_r)
    else:
        sz = tl.load(SZ + rows, mask=mask_r, other=0.0)
    if ONLINE:
        c = m
    else:
        c, _flagged = _offset_rule(m, tl.load(C + rows, mask=mask_r, other=0.0), mask_r, r_exp_max)
    log_s = tl.log(s)
    lse = c + log_s
    tl.store(LSE_OUT + rows, lse, mask=mask_r)
    y = tl.load(Y + rows, mask=mask_r, other=-1)
    b = tl.load(SMOOTH + rows, mask=mask_r, other=0.0)
    zy = tl.load(ZY + rows, mask=mask_r, other=0.0)
    loss = lse - (1.0 - b) * zy - b * sz * inv_v + z_loss * lse * lse
    tl.store(LOSS_OUT + rows, tl.where(y >= 0, loss, 0.0), mask=mask_r)
    tl.store(NLL_OUT + rows, tl.where(y >= 0, lse - zy, 0.0), mask=mask_r)
    if STATS:
        tl.store(ENT_OUT + rows, log_s - t_acc / s, mask=mask_r)
        tl.store(AM_OUT + rows, am.to(tl.int64), mask=mask_r)
    else:  # (zeros without statistics)
        tl.store(ENT_OUT + rows, tl.zeros((BLOCK_R,), dtype=tl.float32), mask=mask_r)
        tl.store(AM_OUT + rows, tl.zeros((BLOCK_R,), dtype=tl.int64), mask=mask_r)
    if GRAD:
        w = tl.load(SCALE + rows, mask=mask_r, other=0.0)
        k = _zloss_factor(lse, z_loss)
        a = w * k if ONLINE else w * k / s
        tl.store(A_OUT + rows, a, mask=mask_r)
        tl.store(U_OUT + rows, w * b * inv_v, mask=mask_r)
        if R_TARGET:
            tgt = tl.exp(zy - c) - (1.0 - b) * s / k
            ok = mask_r & (y >= 0) & (y < v_store)
            tl.store(R + rows.to(tl.int64) * stride_r + tl.maximum(y, 0), tgt.to(R.dtype.element_ty), mask=ok)
        if SCALE_H:
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                m2 = mask_r[:, None] & (cols < D)[None, :]
                h = tl.load(H + rows[:, None].to(tl.int64) * stride_h + cols[None, :].to(tl.int64) * stride_hd,
                            mask=m2, other=0.0)
                tl.store(HS + rows[:, None].to(tl.int64) * stride_hs + cols[None, :],
                         (h.to(tl.float32) * a[:, None]).to(HS.dtype.element_ty), mask=m2)


@triton.jit(do_not_specialize=["n"])  # (batch-dependent counts: one variant for all)
def _dh_rows_kernel(T, A, U, COLSUM, DH, Y, W, SCALE, SMOOTH, n, D, stride_t, stride_dh, stride_w, stride_wd,
                    TARGET: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """dh = a o T - u colsum(W) in DH's dtype (T = R' W, fp32); TARGET (R without the target's change): also - w (1
    - b) W_y."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = rows < n
    a = tl.load(A + rows, mask=mask_r, other=0.0)
    u = tl.load(U + rows, mask=mask_r, other=0.0)
    if TARGET:
        y = tl.load(Y + rows, mask=mask_r, other=-1)
        has_y = mask_r & (y >= 0)
        tw = tl.load(SCALE + rows, mask=mask_r, other=0.0) * (1.0 - tl.load(SMOOTH + rows, mask=mask_r, other=0.0))
        y_row = tl.maximum(y, 0).to(tl.int64) * stride_w
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask_d = cols < D
        m2 = mask_r[:, None] & mask_d[None, :]
        t = tl.load(T + rows[:, None].to(tl.int64) * stride_t + cols[None, :], mask=m2, other=0.0)
        g = a[:, None] * t - u[:, None] * tl.load(COLSUM + cols, mask=mask_d, other=0.0)[None, :]
        if TARGET:
            w_y = tl.load(W + y_row[:, None] + cols[None, :].to(tl.int64) * stride_wd,
                          mask=has_y[:, None] & mask_d[None, :], other=0.0)
            g -= tw[:, None] * w_y.to(tl.float32)
        tl.store(DH + rows[:, None].to(tl.int64) * stride_dh + cols[None, :], g.to(DH.dtype.element_ty), mask=m2)


@triton.jit(do_not_specialize=["n"])  # (batch-dependent counts: one variant for all)
def _softcap_grad_kernel(R, A, U, SCALE, SMOOTH, Y, n, V, stride_r, softcap, BLOCK_R: tl.constexpr,
                         BLOCK_V: tl.constexpr):
    """G over R in place for soft-capped logits, ``(a R - u - w (1 - b) [v = y]) (1 - t^2)``, the cap's derivative
    from R itself: ``t = 1 + log(R) / cap``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_r = rows < n
    m2 = mask_r[:, None] & (cols < V)[None, :]
    at = R + rows[:, None].to(tl.int64) * stride_r + cols[None, :]
    r = tl.load(at, mask=m2, other=1.0).to(tl.float32)
    a = tl.load(A + rows, mask=mask_r, other=0.0)
    u = tl.load(U + rows, mask=mask_r, other=0.0)
    tw = tl.load(SCALE + rows, mask=mask_r, other=0.0) * (1.0 - tl.load(SMOOTH + rows, mask=mask_r, other=0.0))
    y = tl.load(Y + rows, mask=mask_r, other=-1)
    q = tl.log2(r) * (0.6931471805599453 / softcap)
    g = a[:, None] * r - u[:, None] - tl.where(cols[None, :] == y[:, None], tw[:, None], 0.0)
    tl.store(at, (g * (-q * (2.0 + q))).to(R.dtype.element_ty), mask=m2)


@triton.jit(do_not_specialize=["n"])  # (batch-dependent counts: one variant for all)
def _normalize_kernel(R, MT, LSE, ZY, SMOOTH, Y, n, V, stride_r, stride_mt, z_loss, BLOCK_R: tl.constexpr,
                      BLOCK_V: tl.constexpr):
    """fp16 (``online``): R made the probabilities ``R exp(MT - lse)`` in place, the target entry ``p_y - (1 - b) /
    k``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_r = rows < n
    m2 = mask_r[:, None] & (cols < V)[None, :]
    lse = tl.load(LSE + rows, mask=mask_r, other=0.0)
    f = tl.exp(tl.load(MT + rows * stride_mt + tl.program_id(1), mask=mask_r, other=0.0) - lse)
    at = R + rows[:, None].to(tl.int64) * stride_r + cols[None, :]
    p = tl.load(at, mask=m2, other=0.0).to(tl.float32) * f[:, None]
    y = tl.load(Y + rows, mask=mask_r, other=-1)
    k = _zloss_factor(lse, z_loss)
    tgt = tl.exp(tl.load(ZY + rows, mask=mask_r, other=0.0) - lse) - (
        1.0 - tl.load(SMOOTH + rows, mask=mask_r, other=0.0)) / k
    p = tl.where(cols[None, :] == y[:, None], tgt[:, None], p)
    tl.store(at, p.to(R.dtype.element_ty), mask=m2)


class _ExactBf16Reduction:
    """cuBLAS without reduced-precision (half) reductions inside a half-precision matmul (split-K partial sums stay
    fp32), restored afterwards: dW's single matmul rounds once."""

    def __enter__(self):
        m = torch.backends.cuda.matmul
        self.saved = (m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction)
        m.allow_bf16_reduced_precision_reduction = m.allow_fp16_reduced_precision_reduction = False

    def __exit__(self, *exc):
        m = torch.backends.cuda.matmul
        m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction = self.saved


@triton.jit(do_not_specialize=["n", "splits"])  # (batch-dependent counts: one variant for all)
def _rank_one_rows_kernel(U, H, PART, HI, LO, n, D, splits, stride_h, stride_hd, FINISH: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """``-sum_r u_r h_r`` (fp32) by ``splits`` row ranges: each split's partial sum into its row of PART; FINISH: the
    partial sums added in order (bitwise repeatable), the hi and lo halves in hs's dtype into the rows HI and LO."""
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = cols < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if FINISH:
        for k in range(0, splits):
            acc -= tl.load(PART + k * D + cols, mask=mask_d, other=0.0)
        hi = acc.to(HI.dtype.element_ty)
        tl.store(HI + cols, hi, mask=mask_d)
        tl.store(LO + cols, (acc - hi.to(tl.float32)).to(LO.dtype.element_ty), mask=mask_d)
    else:
        per = tl.cdiv(tl.cdiv(n, splits), BLOCK_R) * BLOCK_R
        r_start = tl.program_id(1) * per
        for r0 in range(r_start, tl.minimum(n, r_start + per), BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            mask_r = rows < n
            h = tl.load(H + rows[:, None].to(tl.int64) * stride_h + cols[None, :].to(tl.int64) * stride_hd,
                        mask=mask_r[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(h * tl.load(U + rows, mask=mask_r, other=0.0)[:, None], axis=0)
        tl.store(PART + tl.program_id(1) * D + cols, acc, mask=mask_d)


def _rank_one_rows(r_buf, hs, u_all, hidden, at: int, v: int, ones: bool = False) -> None:
    """R's rows ``at``, ``at + 1`` made ones (unless ``ones``) and hs's the hi and lo halves of ``-u^T h``: a matmul
    over rows ``[0, at + 2)`` then adds dW's rank-one term in its fp32 accumulation. The rows are split over about the
    logits kernel's count of programs (one program a column block took 0.25 ms at Gemma-3's D = 640, N = 8,192)."""
    (n, d), interp = hidden.shape, interpreting()
    br, bd = (8, 16) if interp else (64, 64)
    blocks = triton.cdiv(d, bd)
    splits = max(1, min(triton.cdiv(n, br), fused_config(hidden.dtype, hidden.device).min_programs // blocks))
    part = torch.empty(splits, d, dtype=torch.float32, device=hidden.device)
    for finish in (False, True):
        _rank_one_rows_kernel[(blocks, 1 if finish else splits)](
            u_all, hidden, part, hs[at], hs[at + 1], n, d, splits, *hidden.stride(), FINISH=finish, BLOCK_R=br,
            BLOCK_D=bd, num_warps=1 if interp else 4)
    if not ones:
        r_buf[at:at + 2, :v].fill_(1.0)


def _direct_dw(r_buf, hs, u_all, hidden, n: int, v: int, out, rank_one: bool = True) -> None:
    """dW's rows of R's first ``v`` columns into ``out``: R'^T (a o h) and the rank-one term's two rows by one
    matmul (``rank_one=False``: u = 0); ``hs`` None (soft-capped, R holds G): G^T h."""
    k = n
    if hs is None:
        hs = hidden
    elif rank_one:
        _rank_one_rows(r_buf, hs, u_all, hidden, n, v, ones=True)  # (made ones by _r_pass)
        k = n + 2
    _mm_once(r_buf[:k, :v].T, hs[:k], out)


def _mm_once(a, b, out) -> None:
    """out (half precision) = a @ b rounded once: split-K partial sums stay fp32 (off CUDA: fp32 math)."""
    if a.device.type != "cuda":
        out.copy_(a.float() @ b.float())
        return
    with _ExactBf16Reduction():
        torch.mm(a, b, out=out)


def _column_sums(weight, bias, ones=None):
    """(``sum_v W_v``, the bias's sum or that same tensor) in fp32, by a matmul with a row of ones (``ones``: one
    given): a reduction's buffer would exceed the smallest budgets."""
    out = torch.empty(1, weight.shape[1], dtype=torch.float32, device=weight.device)
    if ones is None:
        ones = torch.ones(1, weight.shape[0], dtype=weight.dtype, device=weight.device)
    mm_f32(ones, weight, out)
    return out[0], (bias.sum(dtype=torch.float32).reshape(1) if bias is not None else out[0])


def _row_offsets(h, weight, bias, sums, y, c, sz, zy, softcap=None) -> None:
    """``_offsets_kernel`` on the rows ``h``: offsets, sums of logits and target logits into ``c``, ``sz``, ``zy``."""
    grid, br, bd, warps = _rows_launch(h.shape[0])
    colsum, b_sum = sums if sums is not None else (c, c)
    _offsets_kernel[grid](h, weight, colsum, bias if bias is not None else colsum, b_sum, y, c, sz, zy, h.shape[0],
                          weight.shape[0], h.shape[1], *h.stride(), *weight.stride(), C_SHIFT,
                          float(softcap) if softcap is not None else 1.0, HAS_BIAS=bias is not None,
                          SOFTCAP=softcap is not None, BLOCK_R=br, BLOCK_D=bd, num_warps=warps)


def _rows_launch(n: int):
    """(grid, BLOCK_R, BLOCK_D, num_warps) of the row kernels."""
    if interpreting():
        return (triton.cdiv(n, 8),), 8, 16, 1
    return (triton.cdiv(n, 32),), 32, 128, 4


def pad8(x: int) -> int:
    """A row length of a multiple of 8 elements: 16-byte rows for cuBLAS and TMA."""
    return triton.cdiv(x, 8) * 8


def triton_fused_pass(hidden, weight, bias, targets, smoothing, scale, config, plan, need_dh=True, need_dw=True,
                      need_db=True, need_stats=False, z_loss: float = 0.0, softcap: float | None = None,
                      smoothed: bool = True):
    """Statistics and gradients of ``sum_n scale_n loss_n`` for 2-D half-precision inputs in ``plan``'s layout
    (``budget.Plan``; an input a layout does not serve takes the columns layout). ``targets``: ids, -1 where
    ignored; ``smoothing``, ``scale``: fp32 per token; ``smoothed=False``: b is 0 everywhere (no rank-one term).
    Returns ``(lse, zy, sz, argmax, entropy, loss, nll), dh, dw, db, gamma``: dh, dw in the inputs' dtype (fp32 for
    fp16), db fp32, None where not needed; the gradients are gamma (None but for fp16) times these."""
    on, soft, need_db = online(hidden), softcap is not None, need_db and bias is not None
    frozen_ok = not (need_dw or need_db or soft or on)
    if plan.layout == "frozen" and frozen_ok:
        return triton_fused_columns(hidden, weight, bias, targets, smoothing, scale, config, plan.cols,
                                    need_stats=need_stats, z_loss=z_loss)
    n, d = hidden.shape
    v = weight.shape[0]
    (scale,), gamma = fp16_weights(hidden.dtype, scale)  # (fp16: every gradient divided by gamma, ``online``)
    # (the planner gives each layout only the inputs it serves; any other lands on the columns layout, which serves
    # every input: a kept share needs dW and bf16 R, fp16's R cannot give a cap's slope back)
    columns = plan.layout != "rows" or (on and soft)
    keep = (plan.keep if need_dw and not (soft or on) else 0) if columns else v
    cols = plan.cols or v
    db = torch.zeros(v, dtype=torch.float32, device=hidden.device) if need_db else None
    if keep:
        stats, dh, dw = _r_pass(hidden, weight, bias, targets, smoothing, scale, config, n if columns else plan.rows,
                                keep, db, need_dh, need_dw, need_stats, z_loss, softcap, smoothed)
    else:  # the statistics alone (fp16 and soft-caps too: no R kept), then G by chunks
        stats = fused_statistics(hidden, weight, bias, targets, softcap, config, need_stats, smoothing, z_loss)
        dh = torch.empty(n, d, dtype=torch.float32, device=hidden.device) if need_dh else None
        dw = torch.empty(v, d, dtype=kept_dtype(weight.dtype), device=hidden.device) if need_dw else None
    if keep < v:
        terms = row_terms(stats[0], scale, smoothing, z_loss, v)
        fused_gradients(hidden, weight, bias, targets, stats[0], terms, softcap, config, cols, dh, dw, db,
                        start=keep, started=keep > 0)
        dh = dh.to(kept_dtype(hidden.dtype)) if dh is not None else None
    return stats, dh, dw, db, gamma


def _r_pass(hidden, weight, bias, targets, smoothing, scale, config, rows, keep, db, need_dh, need_dw, need_stats,
            z_loss, softcap, smoothed):
    """The pass that keeps R, ``rows`` rows at a time, R of the first ``keep`` columns (all, or the columns layout's
    kept share, then every row at once); returns (statistics, dh, dw): dh fp32 and without the other columns' share
    where ``keep`` < V, dw (V, D) with its first ``keep`` rows written; db's first ``keep`` entries added into
    ``db``."""
    n, d = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    f32 = dict(dtype=torch.float32, device=dev)
    on = online(hidden)
    part = keep < v
    rows = min(rows, n)
    if rows < n and rows > config.block_n:
        rows = rows // config.block_n * config.block_n  # whole row blocks per chunk
    direct = rows == n and need_dw and not on
    soft = softcap is not None
    extra = 2 if need_dw and not soft else 0  # the rank-one term's rows (see _rank_one_rows)
    r_buf = torch.empty(rows + extra, pad8(keep), dtype=hidden.dtype, device=dev)
    ones = None
    if direct and extra:  # the rank-one term's rows of R (``_rank_one_rows``), ones from the start: the row of ones of
        # the column sums too (no exponential is written there)
        r_buf[n:, :keep].fill_(1.0)
        ones = r_buf[n:n + 1, :v] if not part else None
    sums = None if soft else _column_sums(weight, bias, ones)  # the offsets' and dh's uniform term
    colsum = sums[0] if sums is not None and not part else None
    if part and not soft:  # dh's uniform term over the kept columns only (G carries the others')
        colsum = _column_sums(weight[:keep], None, r_buf[n:n + 1, :keep])[0]
    rowbuf = torch.empty(8, n, **f32)  # per-row fp32 outputs and scratch in one allocation
    lse, zy, sz, ent, a_all, u_all, loss, nll = rowbuf
    am = torch.empty(n, dtype=torch.long, device=dev)
    grad = need_dh or need_dw or db is not None
    dh = None
    if need_dh:
        dh = torch.empty(n, d, dtype=torch.float32 if part else kept_dtype(hidden.dtype), device=dev)
    dw32 = torch.empty(v, d, **f32) if need_dw and not direct else None
    dw = torch.empty(v, d, dtype=weight.dtype, device=dev) if direct else None
    dh32 = torch.empty(rows, d, **f32) if need_dh and not (soft or part) else None
    hs = torch.empty(rows + extra, d, dtype=hidden.dtype, device=dev) if need_dw and not soft else None
    c_buf = torch.empty(rows, **f32)
    mt = torch.empty(rows, triton.cdiv(v, config.block_v), **f32) if on else None
    per_row = (zy, sz, smoothing, scale, lse, ent, am, a_all, u_all, loss, nll, dh)
    w_keep = weight[:keep] if part else weight
    for s0 in range(0, n, rows):
        e0 = min(n, s0 + rows)
        nr = e0 - s0
        # the chunk's rows of every per-row tensor (one chunk: the tensors themselves, no slicing's host time)
        zy_c, sz_c, b_c, w_c, lse_c, ent_c, am_c, a, u, loss_c, nll_c, dh_c = per_row if nr == n else (
            t[s0:e0] if t is not None else None for t in per_row)
        h, y = (hidden, targets) if nr == n else (hidden[s0:e0], targets[s0:e0])
        r, c = r_buf[:nr, :keep], c_buf if nr == rows else c_buf[:nr]
        grid, br, bd, warps = _rows_launch(nr)
        _row_offsets(h, weight, bias, sums, y, c, sz_c, zy_c, softcap)
        mt_c = None if mt is None else mt[:nr]
        st, descs = _exp_tiles(config, h, weight, bias, c, r, need_stats, softcap=softcap, mt=mt_c, v_store=keep)
        if not (soft or on):  # (capped logits never leave the range; fp16 has no fixed offset)
            _exp_tiles(config, h, weight, bias, c, r, need_stats, bufs=st, descs=descs, v_store=keep)  # flagged rows
        _finish_rows_kernel[grid](
            *st, c, zy_c, sz_c, y, b_c, w_c, h, r, h if hs is None else hs, lse_c, ent_c, am_c, a, u, loss_c,
            nll_c, nr, st[0].shape[0], keep, d, *h.stride(), r.stride(0), 0 if hs is None else hs.stride(0), 1.0 / v,
            R_EXP_MAX, float(z_loss), STATS=need_stats, GRAD=grad, R_TARGET=not (soft or on), SCALE_H=hs is not None,
            SOFTCAP=soft, ONLINE=on, BLOCK_R=br, BLOCK_D=bd, num_warps=warps)
        if on and grad:
            _normalize_kernel[(triton.cdiv(nr, 8), mt.shape[1])](
                r, mt_c, lse_c, zy_c, b_c, y, nr, v, r.stride(0), mt.stride(0), float(z_loss), BLOCK_R=8,
                BLOCK_V=config.block_v, num_warps=1 if interpreting() else 4)
        if soft and grad:
            blocks = (8, 32) if interpreting() else (8, 256)  # 3.3 ms at the Gemma2-2B head (in-place scale: 3.05)
            _softcap_grad_kernel[(triton.cdiv(nr, blocks[0]), triton.cdiv(v, blocks[1]))](
                r, a, u, w_c, b_c, y, nr, v, r.stride(0), float(softcap), BLOCK_R=blocks[0],
                BLOCK_V=blocks[1], num_warps=1 if interpreting() else 4)
        if need_dh and soft:
            _mm_once(r, weight, dh_c)
        elif need_dh:
            t = dh if part else (dh32 if nr == rows else dh32[:nr])
            mm_f32(r, w_keep, t)
            _dh_rows_kernel[grid](t, a, u, colsum, dh_c, y, weight, a, a, nr, d, t.stride(0), dh.stride(0),
                                  *weight.stride(), TARGET=False, BLOCK_R=br, BLOCK_D=bd, num_warps=warps)
        if need_dw and not direct:
            k, rhs = nr, h
            if not soft:
                rhs = hs
                if e0 == n and smoothed:  # the last chunk also adds the rank-one term (u is whole now)
                    _rank_one_rows(r_buf, hs, u_all, hidden, nr, v)
                    k = nr + 2
            if s0 == 0:
                mm_f32(r_buf[:k, :v].T, rhs[:k], dw32)
            else:
                addmm_f32(dw32, r_buf[:k, :v].T, rhs[:k])
        if db is not None:  # R's column sums weighted by a (soft-cap: G's column sums)
            db_chunk = torch.empty(keep, 1, **f32)
            mm_f32(r.T, (torch.ones_like(a) if soft else a).to(r.dtype)[:, None], db_chunk)
            db[:keep] += db_chunk[:, 0]
    if direct:
        _direct_dw(r_buf, hs, u_all, hidden, n, keep, dw if not part else dw[:keep], rank_one=smoothed)
    elif need_dw:  # (fp16's kept in fp32, divided by gamma, until backward: matmul.kept_dtype)
        dw = dw32 if on else dw32.to(weight.dtype)
    if db is not None and not soft and smoothed:
        db[:keep] -= u_all.sum()
    return (lse, zy, sz, am, ent, loss, nll), dh, dw


def row_terms(lse, scale, smoothing, z_loss: float, v: int, extra=None) -> torch.Tensor:
    """(3, N) fp32: each row's factor of p in G (``w k + e``: ``e`` an lse output's gradient), uniform term ``w b /
    V`` and target term ``w (1 - b)``."""
    pm = scale * (1.0 + 2.0 * z_loss * lse) if z_loss else scale
    if extra is not None:
        pm = pm + extra
    return torch.stack([pm, scale * smoothing / v, scale * (1.0 - smoothing)]).contiguous()


def fused_gradients(hidden, weight, bias, targets, lse, terms, softcap, config, cols: int, dh, dw, db, start: int = 0,
                    started: bool = False) -> None:
    """G recomputed from the lse by the logits kernel's G epilogue, ``cols`` columns at a time from ``start``:
    ``dh`` (fp32; None: not needed) gets G W added (written first unless ``started``), each chunk's rows of ``dw``
    and entries of ``db`` are written once."""
    n = hidden.shape[0]
    v = weight.shape[0]
    cols = max(1, min(cols, v - start))
    g_buf = torch.empty(n, pad8(cols), dtype=hidden.dtype, device=hidden.device)
    ones = torch.ones(n, 1, dtype=hidden.dtype, device=hidden.device) if db is not None else None
    for c0 in range(start, v, cols):
        c1 = min(v, c0 + cols)
        wc, g = weight[c0:c1], g_buf[:, :c1 - c0]
        _exp_tiles(config, hidden, wc, bias[c0:c1] if bias is not None else None, lse, g, False, softcap=softcap,
                   grad=(terms, targets, c0))
        if dh is not None:
            (addmm_f32 if started else mm_f32)(*((dh, g, wc) if started else (g, wc, dh)))
            started = True
        if dw is not None:
            (mm_f32 if dw.dtype == torch.float32 else _mm_once)(g.T, hidden, dw[c0:c1])
        if db is not None:
            col = torch.empty(c1 - c0, 1, dtype=torch.float32, device=hidden.device)
            mm_f32(g.T, ones, col)
            db[c0:c1] = col[:, 0]


def triton_fused_columns(hidden, weight, bias, targets, smoothing, scale, config, cols: int | None = None,
                         need_stats=False, z_loss: float = 0.0, need_dh: bool = True, softcap: float | None = None):
    """A frozen head's statistics and dh by chunks of ``cols`` columns (None: all), every row at once, the logits
    once: dh's unnormalised product and the rows' sums add up across chunks (a row whose max passes its running
    offset is redone and its earlier sums rescaled), the normalisation and the uniform and target terms come at the
    end. ``need_dh=False``: the statistics alone, no R stored (``fused_statistics``; a soft-cap allowed,
    ``smoothing`` and ``scale`` may be None). Returns what ``triton_fused_pass`` returns, dW, db and gamma None."""
    soft = softcap is not None
    if soft and need_dh:
        raise ValueError("triton_fused_columns takes a softcap only for the statistics alone (need_dh=False).")
    n, d = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    # every column in one chunk: the split statistics go straight to the row kernel
    one = not need_dh or cols is None or cols >= v
    cols = v if one else cols
    # 16-byte rows for cuBLAS; without dh no R is stored (hidden stands in for the pointer)
    r_buf = torch.empty(n, pad8(cols), dtype=hidden.dtype, device=dev) if need_dh else hidden
    sums = None if soft else _column_sums(weight, bias)
    colsum = None if soft else sums[0]  # also dh's uniform term
    rowbuf = torch.empty(12, n, dtype=torch.float32, device=dev)
    lse, zy, sz, ent, a, u, loss, nll, c, s_run, t_run, m_run = rowbuf
    if smoothing is None:  # (the statistics alone: the row kernel's loss, from the lse it has just written, unused)
        smoothing = scale = lse
    am = torch.empty(n, dtype=torch.long, device=dev)
    acc = torch.empty(n, d, dtype=torch.float32, device=dev) if need_dh else None
    grid, br, bd, warps = _rows_launch(n)
    _row_offsets(hidden, weight, bias, sums, targets, c, sz, zy, softcap)
    if not one:
        rowbuf[9:11].zero_()
        m_run.fill_(float("-inf"))
        am_run = torch.zeros(n, dtype=torch.int32, device=dev)
    for c0 in range(0, v, cols):
        c1 = min(v, c0 + cols)
        wc, r = weight[c0:c1], r_buf[:, :c1 - c0]
        bc = bias[c0:c1] if bias is not None else None
        st, descs = _exp_tiles(config, hidden, wc, bc, c, r, need_stats, store=need_dh, softcap=softcap)
        if not soft:  # (capped logits never leave the range)
            _exp_tiles(config, hidden, wc, bc, c, r, need_stats, bufs=st, descs=descs, store=need_dh)  # flagged rows
        if not one:
            _merge_columns_kernel[grid](*st[:4], c, s_run, t_run, m_run, am_run, acc, n, st[0].shape[0], d,
                                        acc.stride(0), c0, R_EXP_MAX, STATS=need_stats, HAS_ACC=c0 > 0, BLOCK_R=br,
                                        BLOCK_D=bd, num_warps=warps)
        if need_dh and c0 == 0:
            mm_f32(r, wc, acc)
        elif need_dh:
            addmm_f32(acc, r, wc)
    # several chunks: the running state as one split, M = the final offsets (no row's max exceeds them by more than
    # R_EXP_MAX, so the row kernel keeps them)
    state = st[:4] if one else (s_run, t_run, c, am_run)
    _finish_rows_kernel[grid](
        *state, st[4], c, zy, sz, targets, smoothing, scale, hidden, r_buf, hidden,
        lse, ent, am, a, u, loss, nll, n, state[0].shape[0] if one else 1, v, d, *hidden.stride(), r_buf.stride(0), 0,
        1.0 / v, R_EXP_MAX, float(z_loss), STATS=need_stats, GRAD=need_dh, R_TARGET=False, SCALE_H=False,
        SOFTCAP=soft, ONLINE=False, BLOCK_R=br, BLOCK_D=bd, num_warps=warps)
    dh = None
    if need_dh:
        dh = torch.empty(n, d, dtype=hidden.dtype, device=dev)
        _dh_rows_kernel[grid](acc, a, u, colsum, dh, targets, weight, scale, smoothing, n, d, acc.stride(0),
                              dh.stride(0), *weight.stride(), TARGET=True, BLOCK_R=br, BLOCK_D=bd, num_warps=warps)
    return (lse, zy, sz, am, ent, loss, nll), dh, None, None, None


def fused_statistics(hidden, weight, bias, targets, softcap, config, need_stats: bool = True, smoothing=None,
                     z_loss: float = 0.0):
    """Per-token (lse, target logit, sum of logits, argmax, entropy) by the logits kernel without R (argmax and
    entropy zeros unless ``need_stats``; a target past V has a target logit of 0); with ``smoothing``, also each
    token's loss and nll."""
    stats = triton_fused_columns(hidden, weight, bias, targets, smoothing, None, config, need_stats=need_stats,
                                 need_dh=False, softcap=softcap, z_loss=z_loss)[0]
    return stats if smoothing is not None else stats[:5]
