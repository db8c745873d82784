"""Triton forward kernel: per-token log-sum-exp and friends, without the N x V logits.

Each program owns ``BLOCK_N`` rows and one contiguous slice ("split") of the vocabulary. It walks
its slice ``BLOCK_V`` columns at a time, computing the logit tile ``h @ W^T`` with an fp32
accumulator (loop over D in ``BLOCK_D`` steps), and keeps per row an online softmax state:

    m  running max             s  sum exp(z - m)           t  sum exp(z - m) * z
    sz sum of logits           zy target logit              am argmax

Splitting the vocabulary gives enough programs to fill the GPU when N is small; the few partial
states per row are merged in torch (``merge_splits``), which costs O(N * splits).

Launch order: the split is the fast grid axis, so the programs resident at one time cover a few row
blocks times every split. Their working set (those rows of h, plus one W tile per split) stays in L2,
and each W tile is read from memory once per wave, not once per row block.

Two kernels compute the same statistics with the same epilogue (``_fold_tile``):

* ``_lce_forward_tma_kernel`` (Hopper and newer, half precision): one flattened loop over
  (vocabulary tile, D step) pairs with TMA tensor-descriptor loads. The software pipeline runs across
  tile boundaries, so the next tile's loads are in flight while this tile's epilogue runs; with the
  nested loop below, every tile restarted the pipeline. Few vocabulary splits (about two waves of
  programs, at least 2: 4 at N = 8192 on an H100) keep many row blocks on one W tile at a time, so W
  is read from memory about once per wave. Measured on an H100 at the Gemma2-2B shape
  (docs/benchmarks.md, settled experiments: ``forward_variants.py``): 14.4 ms against 19.3 ms for the nested kernel,
  1.05 x one cuBLAS logits matmul. Needs Triton >= 3.4 and 16-byte aligned rows (``tma_ready``).
* ``_lce_forward_kernel``: pointer loads and a nested loop (tile, then D), block sizes autotuned;
  every other GPU, fp32, and inputs the TMA kernel cannot take.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import launch, tuning_configs


@triton.jit
def _tanh(x):
    # tanh through exp: portable (interpreter and every GPU backend), saturates correctly at +-inf.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b. UPCAST: fp32 operands (Triton's CPU interpreter mishandles bf16 dots)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _tile_offsets(N, V, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """Row and vocabulary offsets (and bounds masks) of this program's (BLOCK_N, BLOCK_V) tile."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    return offs_n, offs_v, offs_n < N, offs_v < V


@triton.jit
def _logit_tile(
    H, W, B, offs_n, offs_v, mask_n, mask_v, D, stride_hn, stride_hd, stride_wv, stride_wd,
    softcap, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """fp32 logits of one (BLOCK_N, BLOCK_V) tile; also tanh(z/cap) when soft-capped (else 0)."""
    acc = _logit_acc(H, W, offs_n, offs_v, mask_n, mask_v, D, stride_hn, stride_hd, stride_wv, stride_wd, BLOCK_D,
                     DOT_PRECISION, UPCAST, BLOCK_N, BLOCK_V)
    return _finish_logits(acc, B, offs_v, mask_v, softcap, HAS_BIAS, SOFTCAP)


@triton.jit
def _logit_acc(
    H, W, offs_n, offs_v, mask_n, mask_v, D, stride_hn, stride_hd, stride_wv, stride_wd, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """h W^T of one (BLOCK_N, BLOCK_V) tile in fp32, by pointer loads over D in BLOCK_D steps (rows outside
    ``mask_n`` / ``mask_v`` read as 0): the loop of every pointer kernel's logit tile."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        h = tl.load(H + offs_n[:, None] * stride_hn + offs_d[None, :] * stride_hd,
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        w = tl.load(W + offs_v[:, None] * stride_wv + offs_d[None, :] * stride_wd,
                    mask=mask_v[:, None] & mask_d[None, :], other=0.0)
        acc = _dot(h, tl.trans(w), acc, DOT_PRECISION, UPCAST)
    return acc


@triton.jit
def _finish_logits(acc, B, offs_v, mask_v, softcap, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr):
    """Bias and soft-cap on an fp32 tile of h W^T; returns (z, tanh(z/cap) or 0)."""
    if HAS_BIAS:
        acc += tl.load(B + offs_v, mask=mask_v, other=0.0).to(tl.float32)[None, :]
    if SOFTCAP:
        t = _tanh(acc * (1.0 / softcap))
        acc = softcap * t
    else:
        t = acc * 0.0
    return acc, t


@triton.jit
def _fold_tile(z, v0, offs_v, mask_v, y, m, s, t_acc, sz, zy, am, STATS: tl.constexpr):
    """Fold one fp32 logit tile (columns ``offs_v``, valid where ``mask_v``) into the per-row online
    softmax state; returns the new (m, s, t_acc, sz, zy, am)."""
    z_valid = tl.where(mask_v[None, :], z, 0.0)
    zy += tl.sum(tl.where(offs_v[None, :] == y[:, None], z_valid, 0.0), axis=1)
    sz += tl.sum(z_valid, axis=1)
    z_m = tl.where(mask_v[None, :], z, float("-inf"))
    tile_max = tl.max(z_m, axis=1)
    if STATS:
        am = tl.where(tile_max > m, tl.argmax(z_m, axis=1).to(tl.int32) + v0, am)
    new_m = tl.maximum(m, tile_max)
    # exp(z - m) as exp2(z log2(e) - m log2(e)): one fused multiply-add per element before exp2.
    alpha = tl.math.exp2((m - new_m) * 1.4426950408889634)
    e = tl.math.exp2(z_m * 1.4426950408889634 - (new_m * 1.4426950408889634)[:, None])
    if STATS:
        # t = sum exp(z - m) (z - m), kept relative to the running maximum (entropy = log s - t / s): the plain
        # sum exp(z - m) z loses its digits to cancellation when the logits are large. A new maximum m' turns
        # t into alpha (t + s (m - m')).
        shift = tl.where(m == float("-inf"), 0.0, m - new_m)
        t_acc = alpha * (t_acc + s * shift) + tl.sum(e * (z_valid - new_m[:, None]), axis=1)
    s = s * alpha + tl.sum(e, axis=1)
    return new_m, s, t_acc, sz, zy, am


@triton.jit
def _init_state(BLOCK_N: tl.constexpr):
    """Empty online-softmax state (m, s, t_acc, sz, zy, am) of BLOCK_N rows."""
    zero = tl.zeros((BLOCK_N,), dtype=tl.float32)
    return (tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32), zero, zero, zero, zero,
            tl.zeros((BLOCK_N,), dtype=tl.int32))


@triton.jit
def _split_bounds(V, NUM_SPLITS, BLOCK_V: tl.constexpr):
    """[v_start, v_end) of this program's vocabulary split (whole BLOCK_V tiles; the last may be short)."""
    v_per_split = tl.cdiv(tl.cdiv(V, BLOCK_V), NUM_SPLITS) * BLOCK_V
    v_start = tl.program_id(0) * v_per_split
    return v_start, tl.minimum(v_start + v_per_split, V)


@triton.jit
def _store_state(M_OUT, S_OUT, T_OUT, SZ_OUT, ZY_OUT, AM_OUT, N, offs_n, mask_n, m, s, t_acc, sz, zy, am):
    out = tl.program_id(0) * N + offs_n
    tl.store(M_OUT + out, m, mask=mask_n)
    tl.store(S_OUT + out, s, mask=mask_n)
    tl.store(T_OUT + out, t_acc, mask=mask_n)
    tl.store(SZ_OUT + out, sz, mask=mask_n)
    tl.store(ZY_OUT + out, zy, mask=mask_n)
    tl.store(AM_OUT + out, am, mask=mask_n)


@triton.jit
def _lce_forward_kernel(
    H, W, B, Y,
    M_OUT, S_OUT, T_OUT, SZ_OUT, ZY_OUT, AM_OUT,
    N, V, D, NUM_SPLITS,
    stride_hn, stride_hd, stride_wv, stride_wd,
    softcap,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    STATS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # STATS: also the argmax and sum exp(z - m) z (entropy); the loss needs neither.
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    y = tl.load(Y + offs_n, mask=mask_n, other=-1)
    m, s, t_acc, sz, zy, am = _init_state(BLOCK_N)
    v_start, v_end = _split_bounds(V, NUM_SPLITS, BLOCK_V)
    for v0 in range(v_start, v_end, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        mask_v = offs_v < v_end
        z, _t = _logit_tile(H, W, B, offs_n, offs_v, mask_n, mask_v, D, stride_hn, stride_hd,
                            stride_wv, stride_wd, softcap, HAS_BIAS, SOFTCAP, BLOCK_D,
                            DOT_PRECISION, UPCAST, BLOCK_N, BLOCK_V)
        m, s, t_acc, sz, zy, am = _fold_tile(z, v0, offs_v, mask_v, y, m, s, t_acc, sz, zy, am, STATS)
    _store_state(M_OUT, S_OUT, T_OUT, SZ_OUT, ZY_OUT, AM_OUT, N, offs_n, mask_n, m, s, t_acc, sz, zy, am)


@triton.jit
def _lce_forward_tma_kernel(
    h_desc, w_desc, B, Y,
    M_OUT, S_OUT, T_OUT, SZ_OUT, ZY_OUT, AM_OUT,
    N, V, D, NUM_SPLITS,
    softcap,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    STATS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # The same statistics as _lce_forward_kernel, from one flattened loop over (tile, D step) pairs.
    # TMA zero-fills loads past N, V and D; the epilogue masks columns past this split's end.
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    y = tl.load(Y + offs_n, mask=mask_n, other=-1)
    m, s, t_acc, sz, zy, am = _init_state(BLOCK_N)
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
            z, _t = _finish_logits(acc, B, offs_v, mask_v, softcap, HAS_BIAS, SOFTCAP)
            m, s, t_acc, sz, zy, am = _fold_tile(z, v0, offs_v, mask_v, y, m, s, t_acc, sz, zy, am, STATS)
            acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    _store_state(M_OUT, S_OUT, T_OUT, SZ_OUT, ZY_OUT, AM_OUT, N, offs_n, mask_n, m, s, t_acc, sz, zy, am)


_lce_forward_autotuned = triton.autotune(
    configs=tuning_configs([(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 256, 64, 4, 4),
                            (128, 128, 64, 4, 4), (256, 128, 64, 8, 3), (128, 64, 128, 4, 3),
                            (128, 256, 64, 8, 4), (256, 128, 64, 8, 4), (128, 128, 64, 8, 4),
                            (128, 128, 128, 8, 2)]),
    key=["D", "V", "DOT_PRECISION", "STATS"])(_lce_forward_kernel)


def tma_ready(config, *tensors) -> bool:
    """Whether the TMA kernel can read these 2-D tensors: the config asks for it, rows are contiguous,
    and the base address and row stride are 16-byte aligned (what a tensor descriptor requires)."""
    return config.tma and all(
        t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
        and t.data_ptr() % 16 == 0 for t in tensors)


def vocab_splits(config, rows: int, v: int, tile: int) -> int:
    """How many vocabulary splits a grid of (splits, row blocks) gets: about ``config.min_programs`` programs for
    ``rows`` rows, at least ``config.min_splits``, at most one per ``tile`` columns (see the launch order above)."""
    want = max(config.min_splits, round(config.min_programs / triton.cdiv(rows, config.block_n)))
    return max(1, min(triton.cdiv(v, tile), want))


def merge_splits(m, s, t, sz, zy, am, stats: bool = True):
    """Merge per-split online-softmax states (splits, N) into per-token statistics (N,).
    ``stats=False``: the kernel did not compute argmax and entropy; they are returned as zeros."""
    m_max, best = m.max(dim=0)
    scale = torch.exp(m - m_max[None, :])
    s_tot = (s * scale).sum(0)
    lse = m_max + torch.log(s_tot)
    if stats:
        # each split's t is relative to its own maximum m_k: sum_k exp(m_k - M) (t_k + s_k (m_k - M)), M the max
        rel = torch.where(torch.isfinite(m), m - m_max[None, :], torch.zeros_like(m))
        t_tot = (scale * (t + s * rel)).sum(0)
        entropy = torch.log(s_tot) - t_tot / s_tot
        argmax = am.gather(0, best[None, :])[0].long()
    else:
        entropy, argmax = torch.zeros_like(lse), torch.zeros_like(best)
    return lse, zy.sum(0), sz.sum(0), argmax, entropy


def triton_forward(hidden, weight, bias, targets, softcap, config, stats: bool = True):
    """Launch the forward kernel on 2-D ``hidden`` (N, D); returns (lse, zy, sz, argmax, entropy).
    ``stats=False``: argmax and entropy are not computed (zeros), which the loss alone does not need."""
    n, d = hidden.shape
    v = weight.shape[0]
    # Split the vocabulary until the grid has about config.min_programs programs (for config.block_n-row
    # blocks), and into at least config.min_splits parts (see the launch order above).
    splits = vocab_splits(config, n, v, 256)
    f32 = dict(dtype=torch.float32, device=hidden.device)
    m, s, t, sz, zy = (torch.empty(splits, n, **f32) for _ in range(5))
    am = torch.empty(splits, n, dtype=torch.int32, device=hidden.device)
    outs = (bias if bias is not None else weight, targets, m, s, t, sz, zy, am, n, v, d, splits)
    cap = float(softcap) if softcap is not None else 1.0
    flags = dict(HAS_BIAS=bias is not None, SOFTCAP=softcap is not None,
                 DOT_PRECISION=config.dot_precision, UPCAST=config.upcast_dot, STATS=stats)
    grid = lambda meta: (splits, triton.cdiv(n, meta["BLOCK_N"]))  # noqa: E731
    if tma_ready(config, hidden, weight):
        from triton.tools.tensor_descriptor import TensorDescriptor

        h_desc = TensorDescriptor.from_tensor(hidden, [config.block_n, config.block_d])
        w_desc = TensorDescriptor.from_tensor(weight, [config.block_v, config.block_d])
        launch(_lce_forward_tma_kernel, None, config, grid,
               (h_desc, w_desc, *outs, cap), flags)
    else:
        args = (hidden, weight, *outs, hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), cap)
        launch(_lce_forward_kernel, _lce_forward_autotuned, config, grid, args, flags)
    return merge_splits(m, s, t, sz, zy, am, stats)
