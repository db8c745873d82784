"""Gradient filtering with a per-row bound: ``dh = G W`` and ``dW = G^T h`` over the tiles of G that matter.

G is the gradient of the loss with respect to the logits (rows x a chunk of columns), written by a training
path's kernel *without* the smoothing's uniform term ``-u_n = -s_n b_n / V`` (the same for every v), so that
almost every entry of a peaked softmax's G is tiny. With it the kernel writes each row's exact mass per
``TILE_V`` columns, ``S_nt = sum_{v in t} |G_nv|``.

The bound. Each row n may lose at most ``eps`` of its mass ``||G_n||_1`` (``filter_eps``; the softmax and target
terms, before the token weights): it admits its smallest tiles, in ascending order, while their running sum stays
within that budget (a chunk of columns gets the share of its width). A tile holding the row's target is never
admitted. A (``TILE_N`` rows x ``TILE_V`` columns) tile is skipped only when every one of its rows admits it, so
what a row loses is a subset of what it admitted: at most ``eps ||G_n||_1``, up to fp32 rounding. The uniform
term is exact, as a rank-one correction: ``dh_n -= u_n sum_v W_v`` and ``dW_v -= sum_n u_n h_n``. No host
synchronisation: the per-row choice is a sort and a running sum on the device.

The sparse products are deterministic: every output tile is owned by one program that sums its active tiles in a
fixed order (no atomics). The vocabulary may be sorted by mean logit first: tokens that are likely everywhere then
sit in the same tiles, and more tiles are negligible for every row of a block. The dW kernel writes through that
permutation.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .config import interpreting
from .forward import _dot

TILE_N = 64  # rows per tile of the skip mask
TILE_V = 128  # vocabulary columns per tile of the skip mask
# dh's tile lists split into up to DH_MAX_SPLITS parts, one per DH_TILES_PER_SPLIT tiles of the longest possible list
# (H100, real Gemma-3 inputs: a chunk with 2% of its tiles active took 0.47 ms unsplit, 0.26 ms in 8 parts: one row
# block whose rows keep most tiles set the time alone). Products over two row blocks at a time (the union of their
# tiles: fewer reads of W) were tried and were slower (benchmarks/experiments/NOTES.md, v11).
DH_MAX_SPLITS = 8
DH_TILES_PER_SPLIT = 64


@triton.jit
def _sparse_dh_kernel(
    G, W, DH, PART, IDX, CNT, COLSUM, RANK1,
    R, V, D, stride_g, stride_w, stride_dh, max_cnt,
    HAS_RANK1: tl.constexpr, ACCUM: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SPLITS: tl.constexpr, TN: tl.constexpr, TV: tl.constexpr, BD: tl.constexpr,
):
    """dh[rows of block m, d block] = sum over the active vocabulary tiles of block m of G_tile @ W_tile. With
    SPLITS > 1, program k sums the k-th of SPLITS equal parts of the block's list into PART[k] (fp32; the caller
    adds the parts in a fixed order): a block whose rows keep most tiles no longer sets the time alone."""
    pid_m = tl.program_id(1)
    pid_d = tl.program_id(0)
    pid_k = tl.program_id(2)
    offs_m = pid_m * TN + tl.arange(0, TN)
    offs_d = pid_d * BD + tl.arange(0, BD)
    offs_k = tl.arange(0, TV)
    mask_m = offs_m < R
    mask_d = offs_d < D
    acc = tl.zeros((TN, BD), dtype=tl.float32)
    cnt = tl.load(CNT + pid_m)
    for i in range(pid_k * cnt // SPLITS, (pid_k + 1) * cnt // SPLITS):
        vt = tl.load(IDX + pid_m * max_cnt + i)
        cols = vt * TV + offs_k
        mask_k = cols < V
        a = tl.load(G + offs_m[:, None].to(tl.int64) * stride_g + cols[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(W + cols[:, None].to(tl.int64) * stride_w + offs_d[None, :],
                    mask=mask_k[:, None] & mask_d[None, :], other=0.0)
        acc = _dot(a, b, acc, DOT_PRECISION, UPCAST)
    if SPLITS > 1:
        tl.store(PART + pid_k * R * D + offs_m[:, None].to(tl.int64) * D + offs_d[None, :], acc,
                 mask=mask_m[:, None] & mask_d[None, :])
        return
    if HAS_RANK1:
        c = tl.load(RANK1 + offs_m, mask=mask_m, other=0.0)
        cs = tl.load(COLSUM + offs_d, mask=mask_d, other=0.0)
        acc -= c[:, None] * cs[None, :]
    ptrs = DH + offs_m[:, None].to(tl.int64) * stride_dh + offs_d[None, :]
    m = mask_m[:, None] & mask_d[None, :]
    if ACCUM:  # add into the (fp32) accumulator
        acc += tl.load(ptrs, mask=m, other=0.0).to(tl.float32)
    tl.store(ptrs, acc.to(DH.dtype.element_ty), mask=m)


@triton.jit
def _sparse_dw_kernel(
    G, H, DW, IDX, CNT, RVEC, PERM,
    R, V, D, stride_g, stride_h, stride_dw, max_cnt,
    FIRST: tl.constexpr, HAS_RANK1: tl.constexpr, HAS_PERM: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TN: tl.constexpr, TV: tl.constexpr, BD: tl.constexpr,
):
    """dW[vocabulary tile t, d block] (+)= sum over the active row blocks of tile t of G_tile^T @ h_block,
    written to rows PERM[t's columns] when the vocabulary is permuted. FIRST: write, else accumulate."""
    pid_v = tl.program_id(1)
    pid_d = tl.program_id(0)
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


@triton.jit
def _choose_tiles_kernel(MASS, TGT, BUDGET, KEEP, R, T, stride_m, TN: tl.constexpr, TP: tl.constexpr,
                         RB: tl.constexpr):
    """One program per RB rows (of one block of TN). Each row sorts its tile masses (its target's tile set to
    +inf) and admits the smallest while their running sum stays within its budget; where the masses at the cut tie,
    only those strictly below it, so that the bound holds. The tiles a row does not admit are OR-ed into its block's
    KEEP flags (int32, zero-initialised; OR does not depend on the order of the programs)."""
    pid = tl.program_id(0)
    blk = pid * RB // TN
    cols = tl.arange(0, TP)
    cmask = cols < T
    rows = pid * RB + tl.arange(0, RB)
    rmask = rows < R
    s = tl.load(MASS + rows[:, None].to(tl.int64) * stride_m + cols[None, :],
                mask=rmask[:, None] & cmask[None, :], other=float("inf"))
    tgt = tl.load(TGT + rows, mask=rmask, other=-1)
    s = tl.where(cols[None, :] == tgt[:, None], float("inf"), s)
    s = tl.where(rmask[:, None], s, 0.0)  # rows past R admit everything
    b = tl.load(BUDGET + rows, mask=rmask, other=0.0)
    srt = tl.sort(s, dim=1)
    ok = tl.cumsum(srt, axis=1) <= b[:, None]
    j1 = tl.sum(ok.to(tl.int32), axis=1)
    thr = tl.max(tl.where(ok, srt, -1.0), axis=1)
    le = tl.sum((s <= thr[:, None]).to(tl.int32), axis=1)
    adm = tl.where((le > j1)[:, None], s < thr[:, None], s <= thr[:, None])
    keep = tl.max((adm == 0).to(tl.int32), axis=0)
    tl.atomic_or(KEEP + blk * T + cols, keep, mask=cmask & (keep > 0))


@triton.jit
def _row_lists_kernel(KEEP, IDX, CNT, T, TP: tl.constexpr):
    """One program per row block: the compacted list of its active tiles (ascending) and their count."""
    blk = tl.program_id(0)
    cols = tl.arange(0, TP)
    act = tl.load(KEEP + blk * T + cols, mask=cols < T, other=0)
    pos = tl.cumsum(act, axis=0) - 1
    tl.store(IDX + blk * T + pos, cols, mask=act > 0)
    tl.store(CNT + blk, tl.sum(act, axis=0))


@triton.jit
def _column_lists_kernel(ACTIVE, IDX, CNT, NB, T, NBP: tl.constexpr):
    """One program per tile column: the compacted list of the row blocks for which it is active (ascending)."""
    t = tl.program_id(0)
    blks = tl.arange(0, NBP)
    m = blks < NB
    act = tl.load(ACTIVE + blks * T + t, mask=m, other=0).to(tl.int32)
    pos = tl.cumsum(act, axis=0) - 1
    tl.store(IDX + t * NB + pos, blks, mask=act > 0)
    tl.store(CNT + t, tl.sum(act, axis=0))


class TilePlan(NamedTuple):
    """Which (TILE_N x TILE_V) tiles the sparse products compute: ``active`` (row blocks, tiles) bool; per row block
    the list of its active tiles (``row_idx``, ``row_cnt``, for dh) and per tile the list of its active row blocks
    (``col_idx``, ``col_cnt``, for dW)."""
    active: torch.Tensor
    row_idx: torch.Tensor
    row_cnt: torch.Tensor
    col_idx: torch.Tensor
    col_cnt: torch.Tensor


def plan_from_active(active: torch.Tensor) -> TilePlan:
    """The plan of an arbitrary active matrix (torch; the kernels build theirs in ``filter_active``)."""
    ri, rc = tile_lists(active)
    ci, cc = tile_lists(active.T.contiguous())
    return TilePlan(active, ri, rc, ci, cc)


def tile_lists(active: torch.Tensor):
    """(index, count) of the active columns of each row of a bool matrix, active first in column order."""
    cnt = active.sum(1, dtype=torch.int32)
    idx = torch.argsort((~active).to(torch.int8), dim=1, stable=True).to(torch.int32).contiguous()
    return idx, cnt.contiguous()


def admitted_tiles(mass: torch.Tensor, target_tile: torch.Tensor, budget: torch.Tensor,
                   tile_n: int = TILE_N) -> torch.Tensor:
    """(row blocks, tiles) bool: the tiles that may be skipped with every row's skipped mass within its budget.

    ``mass`` (R, T): per row and tile of columns the exact ``sum |G'|`` over the tile (G' without the uniform
    smoothing term); ``target_tile`` (R,): the tile holding the row's target (out of range: none); ``budget``
    (R,): the most mass the row may lose in these tiles. Each row admits its smallest tiles, ascending, while
    their running sum stays within its budget (where masses tie at the cut, none of the tied ones); a tile holding
    the row's target is never admitted. The torch form of ``filter_active``'s kernel (its oracle). A (tile_n
    rows x 1 tile) block is skippable when every one of its rows admits it, so what a row loses is a subset of
    what it admitted: at most its budget. No host synchronisation (sort, cumsum, scatter on the device).
    """
    r, t = mass.shape
    m = mass.float().clone()
    has_t = (target_tile >= 0) & (target_tile < t)
    rows = torch.arange(r, device=m.device)
    m[rows, target_tile.clamp(0, t - 1).long()] = torch.where(
        has_t, torch.full_like(budget, float("inf"), dtype=m.dtype), m[rows, target_tile.clamp(0, t - 1).long()])
    sv = torch.sort(m, dim=1).values
    ok = torch.cumsum(sv, dim=1) <= budget.float()[:, None]
    thr = torch.where(ok, sv, torch.full_like(sv, -1.0)).amax(1, keepdim=True)  # the largest admitted mass
    # masses tied at the cut: admit none of them when the sorted order admitted only some (as the kernel does)
    strict = (m <= thr).sum(1, keepdim=True) > ok.sum(1, keepdim=True)
    admitted = torch.where(strict, m < thr, m <= thr)
    pad = (-r) % tile_n
    if pad:
        admitted = torch.cat([admitted, admitted.new_ones(pad, t)])
    return admitted.view(-1, tile_n, t).all(1)


def filter_active(mass: torch.Tensor, target_tile: torch.Tensor, budget: torch.Tensor, tile_n: int = TILE_N,
                  stats: "FilterStats | None" = None, row0: int = 0) -> TilePlan:
    """The tiles the sparse products must compute, by the rule of ``admitted_tiles`` (its complement), in three small
    kernels (the per-row choice, the row blocks' lists, the tiles' lists); ``stats`` records what the skipped ones
    held."""
    r, t = mass.shape
    nb = triton.cdiv(r, tile_n)
    dev = mass.device
    mass = mass.float().contiguous()
    active = torch.zeros(nb, t, dtype=torch.int32, device=dev)
    row_idx = torch.empty(nb, t, dtype=torch.int32, device=dev)
    row_cnt = torch.empty(nb, dtype=torch.int32, device=dev)
    col_idx = torch.empty(t, nb, dtype=torch.int32, device=dev)
    col_cnt = torch.empty(t, dtype=torch.int32, device=dev)
    tp = triton.next_power_of_2(max(t, 2))
    rb = max(1, min(tile_n, 2048 // tp))
    warps = 1 if interpreting() else 4
    _choose_tiles_kernel[(triton.cdiv(r, rb),)](mass, target_tile.to(torch.int32).contiguous(),
                                                budget.float().contiguous(), active, r, t, mass.stride(0), TN=tile_n,
                                                TP=tp, RB=rb, num_warps=warps)
    _row_lists_kernel[(nb,)](active, row_idx, row_cnt, t, TP=tp, num_warps=warps)
    _column_lists_kernel[(t,)](active, col_idx, col_cnt, nb, t, NBP=triton.next_power_of_2(max(nb, 2)),
                               num_warps=warps)
    plan = TilePlan(active.bool(), row_idx, row_cnt, col_idx, col_cnt)
    if stats is not None:
        stats.add(mass, plan.active, tile_n, row0)
    return plan


def tile_masses(mass: torch.Tensor, width: int) -> torch.Tensor:
    """Per-row masses over ``width`` columns summed to ``TILE_V`` columns."""
    if width == TILE_V:
        return mass
    r = TILE_V // width
    pad = (-mass.shape[1]) % r
    if pad:
        mass = torch.nn.functional.pad(mass, (0, pad))
    return mass.view(mass.shape[0], -1, r).sum(-1)


def target_logits(hidden, weight, bias, targets) -> torch.Tensor:
    """fp32 ``z_{n, y_n}`` (0 where ignored), one gathered row of W per token (no soft-cap)."""
    y = targets.clamp(min=0)
    z = torch.einsum("nd,nd->n", hidden.float(), weight.index_select(0, y).float())
    if bias is not None:
        z = z + bias.float().index_select(0, y)
    return torch.where(targets >= 0, z, torch.zeros_like(z))


def row_mass(hidden, weight, bias, targets, lse, grad, smoothing, extra=None, zy=None) -> torch.Tensor:
    """The L1 mass of each row of G without the uniform term, ``sum_v |(grad_n + extra_n) p_nv - (1 - b_n) grad_n
    [v = y_n]|``, in closed form from the target's probability (``zy``, the target logit, computed when None):
    ``|grad + extra| (1 - p_y) + |(grad + extra) p_y - (1 - b) grad|``. No soft-cap."""
    if zy is None:
        zy = target_logits(hidden, weight, bias, targets)
    valid = targets >= 0
    py = torch.where(valid, torch.exp(zy.float() - lse.float()).clamp(max=1.0), torch.zeros_like(lse))
    pm = grad + extra if extra is not None else grad
    mass = pm.abs() * (1.0 - py) + (pm * py - (1.0 - smoothing) * grad * valid).abs()
    return torch.where(valid | (pm != 0), mass, torch.zeros_like(mass))


def vocabulary_order(hidden: torch.Tensor, weight: torch.Tensor):
    """(order, inverse): the vocabulary sorted by mean logit over the rows, ``(mean_n h_n) . W_v`` (one
    matrix-vector product). Tokens likely everywhere come first and share tiles."""
    mean_logit = weight.float() @ hidden.float().mean(0)
    order = torch.argsort(mean_logit, descending=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return order, inverse


def sorted_vocabulary(hidden, weight, bias, targets):
    """(order, weight, bias, targets) in the order of ``vocabulary_order``: W and the bias copied in that order, the
    targets mapped to it (ignored ones, -1, kept). The training paths' filtering works in this order; dW, db and the
    argmax go back through ``order``."""
    order, inverse = vocabulary_order(hidden, weight)
    return (order, weight.index_select(0, order), bias.index_select(0, order) if bias is not None else None,
            torch.where(targets >= 0, inverse[targets.clamp(min=0)], targets).contiguous())


def uniform_terms(grad, smoothing, v: int, hidden, need_dw: bool):
    """The smoothing's uniform term, left out of G when filtering: ``u_n = grad_n b_n / V`` (-u_n on every logit of
    row n), and dW's rank-one correction ``sum_n u_n h_n`` (subtracted from every row; None unless ``need_dw``)."""
    u = grad * smoothing / v
    return u, ((u[:, None] * hidden.float()).sum(0) if need_dw else None)


class FilterStats:
    """What the filter skipped, accumulated over chunks on the device (no host synchronisation until read):
    the fraction of tiles skipped and each row's skipped mass."""

    def __init__(self, n: int, device):
        self.lost = torch.zeros(n, dtype=torch.float32, device=device)
        self.skipped = torch.zeros((), dtype=torch.float32, device=device)
        self.total = 0

    def add(self, mass: torch.Tensor, active: torch.Tensor, tile_n: int, row0: int = 0) -> None:
        skip = ~active
        self.skipped += skip.sum()
        self.total += skip.numel()
        rows = mass.shape[0]
        self.lost[row0: row0 + rows] += (mass * skip.repeat_interleave(tile_n, 0)[:rows]).sum(1)

    def finish(self, budget: torch.Tensor, eps: float, sorted: bool) -> dict:
        """``skipped_tiles``: fraction skipped; ``max_row_lost``: the largest skipped mass of a row over its mass
        (the bound: at most ``eps``); ``lost``: each row's skipped mass."""
        l1 = budget / eps
        frac = torch.where(l1 > 0, self.lost / l1.clamp_min(1e-30), torch.zeros_like(l1))
        return dict(skipped_tiles=self.skipped / max(self.total, 1), max_row_lost=frac.max() if frac.numel() else
                    frac.sum(), lost=self.lost, eps=eps, tile=(TILE_N, TILE_V), sorted=sorted)


def _block_d(d: int) -> int:
    if interpreting():
        return min(32, triton.next_power_of_2(d))
    return 128 if d >= 128 else triton.next_power_of_2(d)


def _launch(d: int, tuning: dict | None) -> dict:
    """Block of D and launch options of the sparse kernels (``tuning`` overrides them: the benchmarks' sweep)."""
    t = dict(BD=_block_d(d), num_warps=1 if interpreting() else 4, num_stages=1 if interpreting() else 3)
    t.update(tuning or {})
    return t


def sparse_dh(g, weight, plan: TilePlan, dh_out, rank1=None, colsum=None, accumulate: bool = False, tuning=None):
    """dh_out (R, D) = G W over the active tiles (minus rank1_n * colsum when given); added into dh_out when
    ``accumulate``."""
    r, d = dh_out.shape
    v = weight.shape[0]
    idx, cnt = plan.row_idx, plan.row_cnt
    t = _launch(d, tuning)
    splits = t.pop("SPLITS", None) or max(1, min(DH_MAX_SPLITS, idx.shape[1] // DH_TILES_PER_SPLIT))
    # the D blocks of one tile list run together (G read once from HBM), then the row blocks, then the splits
    grid = (triton.cdiv(d, t["BD"]), idx.shape[0], splits)
    part = torch.empty(splits, r, d, dtype=torch.float32, device=g.device) if splits > 1 else dh_out
    dummy = cnt
    _sparse_dh_kernel[grid](
        g, weight, dh_out, part, idx, cnt, colsum if colsum is not None else dummy,
        rank1 if rank1 is not None else dummy, r, v, d, g.stride(0), weight.stride(0), dh_out.stride(0), idx.shape[1],
        HAS_RANK1=rank1 is not None, ACCUM=accumulate, UPCAST=interpreting() and g.dtype != torch.float32,
        DOT_PRECISION="ieee" if g.dtype == torch.float32 else "tf32", SPLITS=splits, TN=TILE_N, TV=TILE_V, **t)
    if splits > 1:  # the parts in a fixed order: deterministic
        total = part.sum(0)
        if rank1 is not None:
            total -= rank1[:, None] * colsum[None, :]
        if accumulate:
            dh_out += total
        else:
            dh_out.copy_(total)


def sparse_dw(g, hidden, plan: TilePlan, dw, first: bool, rvec=None, perm=None, tuning=None):
    """dW (V, D) (+)= G^T h over the active tiles (minus rvec in every row when given), rows through perm."""
    r, d = hidden.shape
    v = g.shape[1]
    idx, cnt = plan.col_idx, plan.col_cnt
    t = _launch(d, tuning)
    grid = (triton.cdiv(d, t["BD"]), idx.shape[0])
    dummy = cnt
    _sparse_dw_kernel[grid](
        g, hidden, dw, idx, cnt, rvec if rvec is not None else dummy, perm if perm is not None else dummy,
        r, v, d, g.stride(0), hidden.stride(0), dw.stride(0), idx.shape[1],
        FIRST=first, HAS_RANK1=rvec is not None, HAS_PERM=perm is not None,
        UPCAST=interpreting() and g.dtype != torch.float32,
        DOT_PRECISION="ieee" if g.dtype == torch.float32 else "tf32", TN=TILE_N, TV=TILE_V, **t)
