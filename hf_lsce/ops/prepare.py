"""The per-token inputs of a Triton call and the checks of the device's values, in one launch: the (shifted) ids with
-1 where ignored, the per-token smoothing, the count of loss tokens, the reduction's divisor and each token's weight,
and ``checks.py``'s summary (in torch, about forty small operations whose host time was a fifth of a small batch's
op). One program sweeps the tokens twice: the counts first, then the per-token outputs. The torch computation stays
for the torch backend, ``torch.compile`` and the vocabulary-parallel op; tests hold the two equal.
"""

# (no `from __future__ import annotations` in a kernel module: Triton 3.1's interpreter then misreads each kernel's
# tl.constexpr parameters)
import torch
import triton
import triton.language as tl

from .checks import SUMMARY_SIZE
from .config import interpreting


@triton.jit(do_not_specialize=["n", "seq", "items_value"])  # (batch-dependent counts: one variant for all)
def _prepare_kernel(
    Y, B, ITEMS, T1, B1, TW, DEN, OUT, BAD,
    n, seq, ignore_index, vocab, b_value, items_value,
    SHIFT: tl.constexpr, B_TENSOR: tl.constexpr, ITEMS_MODE: tl.constexpr, DIVIDE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program. ITEMS_MODE: 0 none, 1 a tensor, 2 the number ``items_value``. DIVIDE: the reduction divides the
    summed loss (by num_items_in_batch if given, else by the valid tokens; at least 1), else the weights are 1.
    OUT: the summary (fp64, SUMMARY_SIZE); DEN: the divisor (fp32); BAD: whether any check failed."""
    n_bad = tl.zeros((BLOCK,), dtype=tl.float32)
    first = tl.full((BLOCK,), 2 ** 62, dtype=tl.int64)
    n_valid = tl.zeros((BLOCK,), dtype=tl.float32)
    b_bad = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, n, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        m = offs < n
        y = tl.load(Y + offs, mask=m, other=ignore_index).to(tl.int64)
        # (an ignore_index inside [0, V) is ignored too; no ~ on booleans: Triton 3.2 and 3.3's interpreters lack it)
        kept = y != ignore_index
        good = (y >= 0) & (y < vocab) & kept
        bad = m & ((y < 0) | (y >= vocab)) & kept
        n_bad += bad.to(tl.float32)
        first = tl.minimum(first, tl.where(bad, offs.to(tl.int64), 2 ** 62))
        used = m
        if SHIFT:  # the first position of each sequence predicts nothing (its target and smoothing go unused)
            used = used & (offs % seq != 0)
        n_valid += (used & good).to(tl.float32)
        if B_TENSOR:
            b = tl.load(B + offs, mask=m, other=0.0).to(tl.float32)
            b_bad += (used & ((b < 0.0) | (b > 1.0) | (b != b))).to(tl.float32)
    bad_count = tl.sum(n_bad, axis=0)
    first_at = tl.min(first, axis=0)
    first_value = tl.load(Y + tl.minimum(first_at, n - 1)).to(tl.float64)
    valid = tl.sum(n_valid, axis=0).to(tl.float64)
    items = valid * 0.0
    items_bad = valid < 0.0  # False
    if ITEMS_MODE == 1:
        items = tl.load(ITEMS).to(tl.float64)
        items_bad = (items != items) | (items == float("inf")) | (items < 0.0) | (items != tl.floor(items)) | (
            (items == 0.0) & (valid > 0.0))
    if ITEMS_MODE == 2:
        items = valid * 0.0 + items_value  # a whole number (the op's validation), passed as an int: exact
        items_bad = (items == 0.0) & (valid > 0.0)
    b_bad_count = tl.sum(b_bad, axis=0)
    tl.store(OUT + 0, bad_count.to(tl.float64))
    tl.store(OUT + 1, tl.where(bad_count > 0, first_value, 0.0))
    tl.store(OUT + 2, items if ITEMS_MODE == 1 else items * 0.0)  # (as _summary: a number is checked on the host)
    tl.store(OUT + 3, valid)
    tl.store(OUT + 4, b_bad_count.to(tl.float64))
    tl.store(OUT + 5, items_bad.to(tl.float64))
    denom = tl.maximum(items if ITEMS_MODE != 0 else valid, 1.0).to(tl.float32)
    if not DIVIDE:
        denom = denom * 0.0 + 1.0
    tl.store(DEN, denom)
    failed = (bad_count > 0) | (b_bad_count > 0) | items_bad
    tl.store(BAD, failed)
    keep = tl.where(failed, 0.0, 1.0) / denom  # a failed check: every weight 0 (its NaN loss passes no gradient)
    for s in range(0, n, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        m = offs < n
        src = offs
        if SHIFT:
            src = offs + 1
            read = m & (offs % seq != seq - 1)  # (a sequence's last position has no next token)
        else:
            read = m
        y = tl.load(Y + src, mask=read, other=-1).to(tl.int64)
        y = tl.where((y >= 0) & (y < vocab) & (y != ignore_index), y, -1)
        tl.store(T1 + offs, y, mask=m)
        if B_TENSOR:
            b = tl.load(B + src, mask=read, other=0.0).to(tl.float32)
            b = tl.where(b != b, 0.0, tl.minimum(tl.maximum(b, 0.0), 1.0))  # bad values are reported, not used
        else:
            b = tl.zeros((BLOCK,), dtype=tl.float32) + b_value
        tl.store(B1 + offs, b, mask=m)
        tl.store(TW + offs, (y >= 0).to(tl.float32) * keep, mask=m)


def prepare(targets, label_smoothing, ignore_index: int, vocab: int, shift: bool, num_items_in_batch, divide: bool):
    """(t1, b1, token_weight, summary, divisor, bad) for ``targets`` (any shape, the sequence last when ``shift``):
    int64 ids with -1 for an ignored or out-of-range token, fp32 smoothing (clamped to [0, 1], 0 for NaN: a bad value
    is reported by the summary), fp32 weights (valid / divisor if ``divide`` else valid; all 0 where a check failed),
    the fp64 summary of ``checks._summary``, the divisor (0-d fp32; 1 if not ``divide``) and a 0-d bool, True where
    a check failed."""
    dev = targets.device
    n = targets.numel()
    y = targets.reshape(-1)
    y = y if y.is_contiguous() else y.contiguous()
    b_tensor = torch.is_tensor(label_smoothing)
    b = label_smoothing.detach().expand(targets.shape).reshape(-1).contiguous() if b_tensor else None
    items_mode, items_value, items = 0, 0, None
    if torch.is_tensor(num_items_in_batch):
        items_mode, items = 1, num_items_in_batch.detach().reshape(1).to(dev)
    elif num_items_in_batch is not None:
        items_mode, items_value = 2, int(num_items_in_batch)
    t1 = torch.empty(n, dtype=torch.int64, device=dev)
    f32 = torch.empty(2 * n + 1, dtype=torch.float32, device=dev)
    out = torch.empty(SUMMARY_SIZE, dtype=torch.float64, device=dev)
    bad = torch.empty((), dtype=torch.bool, device=dev)
    b1, tw, den = f32[:n], f32[n:2 * n], f32[2 * n]
    block = 64 if interpreting() else 1024
    _prepare_kernel[(1,)](
        y, b if b is not None else f32, items if items is not None else out, t1, b1, tw, den, out, bad,
        n, targets.shape[-1] if targets.dim() else 1, int(ignore_index), vocab,
        0.0 if b_tensor else float(label_smoothing), items_value,
        SHIFT=shift, B_TENSOR=b_tensor, ITEMS_MODE=items_mode, DIVIDE=divide, BLOCK=block,
        num_warps=1 if interpreting() else 4)
    return t1, b1, tw, out, den, bad
