"""The logit tiles the Triton kernels share: ``h W^T`` of a (rows, vocabulary columns) tile with an fp32
accumulator, by pointer loads over D (``_logit_acc``) or, on Hopper and data-centre Blackwell in half precision, by
tensor-descriptor (TMA) loads in the kernels' own flattened loops (``tma_ready`` says when the inputs allow them);
the bias and soft-cap on a finished tile; the vocabulary splits of a (splits, row blocks) grid.

The kernels: the fused pass's logits kernel (``fused_pass.py``: training, and the statistics alone for evaluation,
``fused_pass.fused_statistics``) and the G kernels of the recomputing backward (``backward.py``). The statistics had a
kernel of their own here (an online softmax per row, merged across splits in torch) until the fused kernel without
its store of R measured as fast or faster at every head (docs/benchmarks.md, settled experiments:
``eval_fused_stats.py``).
"""

# (no `from __future__ import annotations` in a kernel module: Triton 3.1's interpreter then misreads each kernel's
# tl.constexpr parameters)
import triton
import triton.language as tl



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
    """Whether the TMA kernel can read these 2-D tensors: the config asks for it, rows are contiguous,
    and the base address and row stride are 16-byte aligned (what a tensor descriptor requires)."""
    return config.tma and all(
        t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
        and t.data_ptr() % 16 == 0 for t in tensors)


def vocab_splits(config, rows: int, v: int, tile: int) -> int:
    """How many vocabulary splits a grid of (splits, row blocks) gets: about ``config.min_programs`` programs for
    ``rows`` rows, at least ``config.min_splits``, at most one per ``tile`` columns. The split is the grid's fast axis,
    so the programs resident at once share a few row blocks of h and each split's W tile through L2."""
    want = max(config.min_splits, round(config.min_programs / triton.cdiv(rows, config.block_n)))
    return max(1, min(triton.cdiv(v, tile), want))
