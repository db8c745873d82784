"""The logit tiles the fused pass's kernel shares (``fused_pass.py``): ``h W^T`` of a (rows, vocabulary columns) tile
with an fp32 accumulator by pointer loads over D (``_logit_acc``; with TMA loads the kernel's own flattened loop:
``tma_ready`` says when the inputs allow them), the bias and soft-cap on a finished tile, a split's columns; and the
kernel that scales the gradients kept from the forward (``matmul.scale_by``)."""

# (no `from __future__ import annotations` in a kernel module: Triton 3.1's interpreter then misreads each kernel's
# tl.constexpr parameters)
import triton
import triton.language as tl

from .config import interpreting



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
def _logit_acc(
    H, W, offs_n, offs_v, mask_n, mask_v, D, stride_hn, stride_hd, stride_wv, stride_wd, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    """h W^T of one (BLOCK_N, BLOCK_V) tile in fp32, by pointer loads over D in BLOCK_D steps: the loop of every
    pointer kernel's logit tile. Rows outside ``mask_n`` and columns outside ``mask_v`` read row / column 0 (their
    logits are garbage the epilogue masks), so only D's tail is masked, and not at all where BLOCK_D divides D
    (EVEN_D); the pointers advance by BLOCK_D columns a step."""
    rows = tl.where(mask_n, offs_n, 0)
    cols = tl.where(mask_v, offs_v, 0)
    offs_d = tl.arange(0, BLOCK_D)
    h_at = H + rows[:, None] * stride_hn + offs_d[None, :].to(tl.int64) * stride_hd
    w_at = W + cols[:, None] * stride_wv + offs_d[None, :].to(tl.int64) * stride_wd
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        if EVEN_D:
            h = tl.load(h_at)
            w = tl.load(w_at)
        else:
            mask_d = (offs_d < D - d0)[None, :]
            h = tl.load(h_at, mask=mask_d, other=0.0)
            w = tl.load(w_at, mask=mask_d, other=0.0)
        acc = _dot(h, tl.trans(w), acc, DOT_PRECISION, UPCAST)
        h_at += BLOCK_D * stride_hd
        w_at += BLOCK_D * stride_wd
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
def _init_state(BLOCK_N: tl.constexpr):
    """Empty state (max, sum, entropy term, sum of capped logits, argmax) of BLOCK_N rows."""
    zero = tl.zeros((BLOCK_N,), dtype=tl.float32)
    return tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32), zero, zero, zero, tl.zeros((BLOCK_N,), dtype=tl.int32)


@triton.jit
def _split_bounds(V, NUM_SPLITS, BLOCK_V: tl.constexpr):
    """[v_start, v_end) of this program's vocabulary split (whole BLOCK_V tiles; the last may be short)."""
    v_per_split = tl.cdiv(tl.cdiv(V, BLOCK_V), NUM_SPLITS) * BLOCK_V
    v_start = tl.program_id(0) * v_per_split
    return v_start, tl.minimum(v_start + v_per_split, V)


def tma_ready(config, *tensors) -> bool:
    """Whether the TMA kernel can read these 2-D tensors: the config asks for it, rows are contiguous and do not
    overlap (not an ``expand``), and the base address and row stride are 16-byte aligned (what a tensor descriptor
    requires). Any other layout takes the pointer loads, which honour every stride."""
    return config.tma and all(
        t.dim() == 2 and t.stride(1) == 1 and t.stride(0) >= t.shape[1] and (t.stride(0) * t.element_size()) % 16 == 0
        and t.data_ptr() % 16 == 0 for t in tensors)


@triton.jit(do_not_specialize=["blocks_x", "blocks"])  # (batch-dependent counts: one variant for all)
def _scale_kernel(X, Y, XO, YO, C, nx, ny, blocks_x, blocks, CAST: tl.constexpr, BLOCK: tl.constexpr):
    """XO = X * C[0] and YO = Y * C[0] (in place where XO is X), ``BLOCK`` elements at a time (blocks below
    ``blocks_x`` in X, the rest in Y) with a stride of the grid over them. Unless CAST (outputs of their own, another
    dtype), every program returns at once when C[0] == 1 (the usual upstream gradient), and the grid is small, so that
    case costs a launch (one program per block was 90 us a call for dW at the Gemma2-2B head: 144,000 programs)."""
    c = tl.load(C)
    if CAST or c != 1.0:
        for blk in range(tl.program_id(0), blocks, tl.num_programs(0)):
            if blk < blocks_x:
                offs = tl.cast(blk, tl.int64) * BLOCK + tl.arange(0, BLOCK)
                x = tl.load(X + offs, mask=offs < nx, other=0.0)
                tl.store(XO + offs, (x.to(tl.float32) * c).to(XO.dtype.element_ty), mask=offs < nx)
            else:
                offs = tl.cast(blk - blocks_x, tl.int64) * BLOCK + tl.arange(0, BLOCK)
                y = tl.load(Y + offs, mask=offs < ny, other=0.0)
                tl.store(YO + offs, (y.to(tl.float32) * c).to(YO.dtype.element_ty), mask=offs < ny)


def scale_pairs(pairs, c, cast: bool) -> None:
    """``_scale_kernel`` over (tensor, output) pairs, two per launch (``matmul.scale_by``)."""
    block = 1024 if interpreting() else 4096
    for k in range(0, len(pairs), 2):
        x, xo = pairs[k]
        y, yo = pairs[k + 1] if k + 1 < len(pairs) else (x[:0], xo[:0])
        bx = triton.cdiv(x.numel(), block)
        blocks = bx + triton.cdiv(y.numel(), block)
        _scale_kernel[(min(blocks, 4 if interpreting() else 1024),)](
            x, y, xo, yo, c, x.numel(), y.numel(), bx, blocks, CAST=cast, BLOCK=block,
            num_warps=1 if interpreting() else 8)
