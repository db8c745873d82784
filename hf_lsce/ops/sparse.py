"""Gradient filtering in the training path: ``dh = G W`` and ``dW += G^T h`` over the tiles of G that matter.

G is the gradient of one chunk of rows with respect to the logits (rows x V, written by the training path's
row kernel, ``train_pass.py``). With filtering on, the row kernel writes G *without* the smoothing's uniform
term ``-s_n b_n / V`` (the same for every v), so that almost every entry of a peaked softmax's G is tiny, and
it writes, per row and per ``TILE_V`` columns, the largest ``|G|`` (without the weighting ``s_n``). A
(``TILE_N`` rows x ``TILE_V`` columns) tile whose largest entry is below ``eps`` is skipped; every other tile
goes through the two kernels below. The uniform term is exact, as a rank-one correction in their epilogues:
``dh_n -= s_n b_n / V * sum_v W_v`` and ``dW_v -= sum_n s_n b_n / V * h_n``. The target's term
``-(1 - b_n)`` is never below eps unless ``p_target`` is within eps of ``1 - b_n``, where the entry itself is.

What is skipped: entries below eps, so a row loses at most ``(number of its skipped entries) * eps`` of
``sum_v |G_nv|``; ``skipped_mass`` measures the actual amount. Deterministic: every output tile is owned by one
program that sums its active tiles in a fixed order (no atomics).

The vocabulary may be sorted by mean logit first (``train_pass``): tokens that are likely everywhere then sit
in the same tiles, and more tiles are empty. The dW kernel writes through that permutation.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import interpreting
from .forward import _dot

TILE_N = 64  # rows per tile of the skip mask
TILE_V = 128  # vocabulary columns per tile of the skip mask


@triton.jit
def _sparse_dh_kernel(
    G, W, DH, IDX, CNT, COLSUM, RANK1,
    R, V, D, stride_g, stride_w, stride_dh, max_cnt,
    HAS_RANK1: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TN: tl.constexpr, TV: tl.constexpr, BD: tl.constexpr,
):
    """dh[rows of block m, d block] = sum over the active vocabulary tiles of block m of G_tile @ W_tile."""
    pid_m = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_m = pid_m * TN + tl.arange(0, TN)
    offs_d = pid_d * BD + tl.arange(0, BD)
    offs_k = tl.arange(0, TV)
    mask_m = offs_m < R
    mask_d = offs_d < D
    acc = tl.zeros((TN, BD), dtype=tl.float32)
    cnt = tl.load(CNT + pid_m)
    for i in range(0, cnt):
        vt = tl.load(IDX + pid_m * max_cnt + i)
        cols = vt * TV + offs_k
        mask_k = cols < V
        a = tl.load(G + offs_m[:, None].to(tl.int64) * stride_g + cols[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(W + cols[:, None].to(tl.int64) * stride_w + offs_d[None, :],
                    mask=mask_k[:, None] & mask_d[None, :], other=0.0)
        acc = _dot(a, b, acc, DOT_PRECISION, UPCAST)
    if HAS_RANK1:
        c = tl.load(RANK1 + offs_m, mask=mask_m, other=0.0)
        cs = tl.load(COLSUM + offs_d, mask=mask_d, other=0.0)
        acc -= c[:, None] * cs[None, :]
    tl.store(DH + offs_m[:, None].to(tl.int64) * stride_dh + offs_d[None, :], acc.to(DH.dtype.element_ty),
             mask=mask_m[:, None] & mask_d[None, :])


@triton.jit
def _sparse_dw_kernel(
    G, H, DW, IDX, CNT, RVEC, PERM,
    R, V, D, stride_g, stride_h, stride_dw, max_cnt,
    FIRST: tl.constexpr, HAS_RANK1: tl.constexpr, HAS_PERM: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TN: tl.constexpr, TV: tl.constexpr, BD: tl.constexpr,
):
    """dW[vocabulary tile t, d block] (+)= sum over the active row blocks of tile t of G_tile^T @ h_block,
    written to rows PERM[t's columns] when the vocabulary is permuted. FIRST: write, else accumulate."""
    pid_v = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_v = pid_v * TV + tl.arange(0, TV)
    offs_d = pid_d * BD + tl.arange(0, BD)
    offs_m = tl.arange(0, TN)
    mask_v = offs_v < V
    mask_d = offs_d < D
    cnt = tl.load(CNT + pid_v)
    work = cnt > 0
    if FIRST:  # the first chunk writes every tile
        work = cnt >= 0
    if HAS_RANK1:  # the uniform term reaches every tile
        work = cnt >= 0
    if work:  # a tile with nothing to add keeps its dW
        acc = tl.zeros((TV, BD), dtype=tl.float32)
        for i in range(0, cnt):
            rb = tl.load(IDX + pid_v * max_cnt + i)
            rows = rb * TN + offs_m
            mask_r = rows < R
            a = tl.load(G + rows[:, None].to(tl.int64) * stride_g + offs_v[None, :],
                        mask=mask_r[:, None] & mask_v[None, :], other=0.0)
            b = tl.load(H + rows[:, None].to(tl.int64) * stride_h + offs_d[None, :],
                        mask=mask_r[:, None] & mask_d[None, :], other=0.0)
            acc = _dot(tl.trans(a), b, acc, DOT_PRECISION, UPCAST)
        if HAS_RANK1:
            acc -= tl.load(RVEC + offs_d, mask=mask_d, other=0.0)[None, :]
        if HAS_PERM:
            out_rows = tl.load(PERM + offs_v, mask=mask_v, other=0)
        else:
            out_rows = offs_v
        ptrs = DW + out_rows[:, None].to(tl.int64) * stride_dw + offs_d[None, :]
        m = mask_v[:, None] & mask_d[None, :]
        if not FIRST:
            acc += tl.load(ptrs, mask=m, other=0.0).to(tl.float32)
        tl.store(ptrs, acc.to(DW.dtype.element_ty), mask=m)


def tile_lists(active: torch.Tensor):
    """(index, count) of the active columns of each row of a bool matrix, active first in column order."""
    cnt = active.sum(1, dtype=torch.int32)
    idx = torch.argsort((~active).to(torch.int8), dim=1, stable=True).to(torch.int32).contiguous()
    return idx, cnt.contiguous()


def tile_mask(row_maxima: torch.Tensor, eps: float, tile_n: int = TILE_N) -> torch.Tensor:
    """(row blocks, vocabulary tiles) bool: some entry of the tile is >= eps, from per-row tile maxima."""
    r, vt = row_maxima.shape
    pad = (-r) % tile_n
    if pad:
        row_maxima = torch.cat([row_maxima, row_maxima.new_zeros(pad, vt)])
    return row_maxima.view(-1, tile_n, vt).amax(1) >= eps


def _block_d(d: int) -> int:
    if interpreting():
        return min(32, triton.next_power_of_2(d))
    return 128 if d >= 128 else triton.next_power_of_2(d)


def sparse_dh(g, weight, active, dh_out, rank1=None, colsum=None):
    """dh_out (R, D) = G W over the active tiles (minus rank1_n * colsum when given)."""
    r, d = dh_out.shape
    v = weight.shape[0]
    idx, cnt = tile_lists(active)
    bd = _block_d(d)
    grid = (active.shape[0], triton.cdiv(d, bd))
    dummy = cnt
    _sparse_dh_kernel[grid](
        g, weight, dh_out, idx, cnt, colsum if colsum is not None else dummy, rank1 if rank1 is not None else dummy,
        r, v, d, g.stride(0), weight.stride(0), dh_out.stride(0), idx.shape[1],
        HAS_RANK1=rank1 is not None, UPCAST=interpreting() and g.dtype != torch.float32,
        DOT_PRECISION="ieee" if g.dtype == torch.float32 else "tf32", TN=TILE_N, TV=TILE_V, BD=bd, num_warps=1 if interpreting() else 4, num_stages=1 if interpreting() else 3)


def sparse_dw(g, hidden, active, dw, first: bool, rvec=None, perm=None):
    """dW (V, D) (+)= G^T h over the active tiles (minus rvec in every row when given), rows through perm."""
    r, d = hidden.shape
    v = g.shape[1]
    idx, cnt = tile_lists(active.T.contiguous())
    bd = _block_d(d)
    grid = (active.shape[1], triton.cdiv(d, bd))
    dummy = cnt
    _sparse_dw_kernel[grid](
        g, hidden, dw, idx, cnt, rvec if rvec is not None else dummy, perm if perm is not None else dummy,
        r, v, d, g.stride(0), hidden.stride(0), dw.stride(0), idx.shape[1],
        FIRST=first, HAS_RANK1=rvec is not None, HAS_PERM=perm is not None,
        UPCAST=interpreting() and g.dtype != torch.float32,
        DOT_PRECISION="ieee" if g.dtype == torch.float32 else "tf32", TN=TILE_N, TV=TILE_V, BD=bd, num_warps=1 if interpreting() else 4, num_stages=1 if interpreting() else 3)
