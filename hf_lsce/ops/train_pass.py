"""One pass for training: the loss and its gradients together, three matmuls, no recomputation.

When the loss will be differentiated (grad mode, a reduced loss), computing the gradients already in
the forward saves the second logits matmul that a recomputing backward pays (4 matmuls become 3).
For each chunk of rows (``TRAIN_CHUNK_BYTES`` of fp32 logits, so memory is bounded and does not grow
with N):

1. cuBLAS: ``Z = h_chunk @ W^T`` in fp32 (bf16/fp16 tensor cores, fp32 accumulate and output);
2. ``_lce_rows_kernel`` (Triton, one program per row): a first read of the row gives the online
   softmax statistics (max, sum of exp, entropy term, sum of logits, target logit, argmax); a second
   read writes the gradient of the loss with respect to the logits,

       G_nv = (s_n (p_nv (1 + 2 lam lse_n) - b_n / V - (1 - b_n) [v == y_n]) + e_n p_nv) * (1 - tanh^2)

   (last factor: soft-cap; ``lam``: the z-loss ``lam * lse^2``), with s_n the reduction's weight of token n
   (1/#valid for the mean, 0 where ignored) and e_n an optional extra term (z-loss or the gradient reaching an lse
   output, in the recomputing backward where Triton's dots are FMA: ``logits_gradients``). G is stored in the input
   dtype *in place over Z*: element v of row n goes to byte ``4 V n + size * v``, which only overwrites values of
   that row already read by every warp (a barrier per block makes sure). A 2-byte G is then a (rows, V) view of row
   stride 2V.
3. cuBLAS: ``dh_chunk = G @ W`` and ``dW += G^T h_chunk`` (and ``db += sum_n G``).

The autograd function keeps dh and dW until backward, which only scales them by the upstream
gradient (a no-op for the usual 1). The statistics are those of the fused pass (``fused_pass.fused_statistics``).
"""

# (no `from __future__ import annotations` in a kernel module: Triton 3.1's interpreter then misreads each kernel's
# tl.constexpr parameters)
import torch
import triton
import triton.language as tl

from .config import STATS_CHUNK_BYTES, TRAIN_CHUNK_BYTES, interpreting
from .matmul import addmm_f32, fp16_weights, kept_dtype, mm_f32
from .tiles import _tanh


@triton.jit
def _logit_grad(z, is_target, lse, p_mult, uniform, on_target, softcap, SOFTCAP: tl.constexpr):
    """The gradient on one block of a row's logits ``z`` (bias added, before the soft-cap):
    ``p * p_mult - uniform - on_target [target]``, times the soft-cap's derivative."""
    if SOFTCAP:
        tc = _tanh(z / softcap)
        z = softcap * tc
    g = tl.exp(z - lse) * p_mult - uniform - tl.where(is_target, on_target, 0.0)
    if SOFTCAP:
        g = g * (1.0 - tc * tc)
    return g


@triton.jit
def _lce_rows_kernel(
    Z, BIAS, Y, SMOOTH, SCALE, EXTRA, G,
    LSE_OUT, ZY_OUT, SZ_OUT, AM_OUT, ENT_OUT,
    V, stride_z, stride_g, softcap, inv_v, z_loss,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, WRITE_G: tl.constexpr, HAS_ZLOSS: tl.constexpr,
    HAS_EXTRA: tl.constexpr, HAS_LSE: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per row of Z: the statistics (pass 1), then (WRITE_G) G in place. HAS_LSE: the row's lse is given
    (LSE_OUT read, nothing else written) and Z holds a chunk of its columns (Y relative to them; ``inv_v`` 1 / the
    whole vocabulary): G alone (``logits_gradients``)."""
    row = tl.program_id(0)
    y = tl.load(Y + row)
    z_row = Z + row.to(tl.int64) * stride_z
    if HAS_LSE:
        lse = tl.load(LSE_OUT + row)
    else:
        lse = _row_statistics(z_row, BIAS, y, LSE_OUT + row, ZY_OUT + row, SZ_OUT + row, AM_OUT + row, ENT_OUT + row,
                              V, softcap, HAS_BIAS, SOFTCAP, BLOCK)
    if WRITE_G:
        b = tl.load(SMOOTH + row)
        scale = tl.load(SCALE + row)
        p_mult = scale
        if HAS_ZLOSS:  # d(lam lse^2)/dz = 2 lam lse p
            p_mult = scale * (1.0 + 2.0 * z_loss * lse)
        if HAS_EXTRA:  # extra_n p on the row (the gradient reaching the lse output)
            p_mult += tl.load(EXTRA + row)
        uniform = scale * b * inv_v
        g_row = G + row.to(tl.int64) * stride_g
        for v0 in range(0, V, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            mask = offs < V
            z = tl.load(z_row + offs, mask=mask, other=0.0)
            # Every warp has read this block before any warp overwrites it (the in-place store of
            # block k covers fp32 elements [k B / 2, (k + 1) B / 2), read in blocks <= k).
            tl.debug_barrier()
            if HAS_BIAS:
                z += tl.load(BIAS + offs, mask=mask, other=0.0).to(tl.float32)
            g = _logit_grad(z, offs == y, lse, p_mult, uniform, scale * (1.0 - b), softcap, SOFTCAP)
            tl.store(g_row + offs, g.to(G.dtype.element_ty), mask=mask)


@triton.jit
def _row_statistics(z_row, BIAS, y, LSE_OUT, ZY_OUT, SZ_OUT, AM_OUT, ENT_OUT, V, softcap, HAS_BIAS: tl.constexpr,
                    SOFTCAP: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 1 of ``_lce_rows_kernel`` over one row: its statistics stored, its lse returned."""
    # Pass 1: an online softmax per lane (BLOCK lanes, each striding the row); lanes merge at the end,
    # so the loop has no cross-warp reductions.
    m_l = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    s_l = tl.zeros((BLOCK,), dtype=tl.float32)
    t_l = tl.zeros((BLOCK,), dtype=tl.float32)
    sz_l = tl.zeros((BLOCK,), dtype=tl.float32)
    am_l = tl.zeros((BLOCK,), dtype=tl.int32)
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        mask = offs < V
        z = tl.load(z_row + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            z += tl.load(BIAS + offs, mask=mask, other=0.0).to(tl.float32)
        if SOFTCAP:
            z = softcap * _tanh(z / softcap)
        z_m = tl.where(mask, z, float("-inf"))
        new_m = tl.maximum(m_l, z_m)
        am_l = tl.where(z_m > m_l, offs, am_l)
        # Lanes still at -inf (only masked values so far) keep s = t = 0.
        alpha = tl.where(new_m == float("-inf"), 1.0, tl.exp(m_l - new_m))
        e = tl.where(mask, tl.exp(z_m - new_m), 0.0)
        z_valid = tl.where(mask, z, 0.0)
        # t = sum exp(z - m) (z - m) relative to the lane's running maximum: the plain sum exp(z - m) z loses its
        # digits to cancellation when the logits are large; a new maximum m' turns t into alpha (t + s (m - m'))
        shift = tl.where(m_l == float("-inf"), 0.0, m_l - new_m)
        t_l = alpha * (t_l + s_l * shift) + tl.where(mask, e * (z - new_m), 0.0)
        s_l = s_l * alpha + e
        sz_l += z_valid
        m_l = new_m
    m = tl.max(m_l, axis=0)
    scale = tl.where(m_l == float("-inf"), 0.0, tl.exp(m_l - m))
    s = tl.sum(s_l * scale, axis=0)
    t_acc = tl.sum(scale * (t_l + s_l * tl.where(m_l == float("-inf"), 0.0, m_l - m)), axis=0)
    am = tl.min(tl.where(m_l == m, am_l, V), axis=0)  # first index of the maximum, as torch.argmax
    lse = m + tl.log(s)
    # The target logit: one load (0 for an ignored token, whose loss is masked anyway, and for a target past V: the
    # vocabulary-parallel forward's id of a target on another rank).
    yc = tl.minimum(tl.maximum(y, 0), V - 1).to(tl.int32)
    zy = tl.load(z_row + yc)
    if HAS_BIAS:
        zy += tl.load(BIAS + yc).to(tl.float32)
    if SOFTCAP:
        zy = softcap * _tanh(zy / softcap)
    zy = tl.where((y >= 0) & (y < V), zy, 0.0)
    tl.store(LSE_OUT, lse)
    tl.store(ZY_OUT, zy)
    tl.store(SZ_OUT, tl.sum(sz_l, axis=0))
    tl.store(AM_OUT, am)
    tl.store(ENT_OUT, tl.log(s) - t_acc / s)
    return lse


def logits_gradients(hidden, weight_cols, bias_cols, targets, lse, grad, smoothing, extra, buf, v_total: int,
                     softcap):
    """G = ``grad_n dL/dz + extra_n p`` (the recomputing backward's) over the vocabulary columns ``weight_cols`` holds
    (``targets`` and ``bias_cols`` relative to them) of a vocabulary of ``v_total``, the lse given: cuBLAS's fp32
    logits into ``buf`` (at least rows x columns fp32 elements), then the row kernel's G pass alone, G in hidden's
    dtype over the logits in place (its own storage off CUDA, as in ``triton_train_pass``). Where Triton's dots are
    FMA (fp32, Turing, Volta: ``dispatch.cublas_logits``) this replaces the G kernel's
    (``backward.triton_gradients_by_columns``)."""
    n, cols = hidden.shape[0], weight_cols.shape[0]
    z = buf[: n * cols].view(n, cols)
    on_cpu = hidden.device.type != "cuda"
    mm_f32(hidden, weight_cols.T, z)
    g = torch.empty(n, cols, dtype=hidden.dtype) if on_cpu else z.view(hidden.dtype)[:, :cols]
    bias_cols = bias_cols.contiguous() if bias_cols is not None else None
    block, warps = _rows_launch_config(cols)
    _lce_rows_kernel[(n,)](
        z, bias_cols if bias_cols is not None else z, targets, smoothing, grad, extra if extra is not None else grad, g,
        lse, lse, lse, lse, lse, cols, z.stride(0), g.stride(0), float(softcap) if softcap is not None else 1.0,
        1.0 / v_total, 0.0, HAS_BIAS=bias_cols is not None, SOFTCAP=softcap is not None, WRITE_G=True, HAS_ZLOSS=False,
        HAS_EXTRA=extra is not None, HAS_LSE=True, BLOCK=block, num_warps=warps)
    return g


def add_chunk_gradients(g, hidden_chunk, weight, dh_chunk, dw, db, first: bool) -> None:
    """From G = dL/dz of one chunk of rows (rows x V): ``dh_chunk = G W``, ``dW += G^T h`` (written,
    not added, on the first chunk) and ``db += sum of G's rows``, by cuBLAS; any of them may be None."""
    if dh_chunk is not None and dh_chunk.dtype != g.dtype:  # (fp16's fp32 dh: kept_dtype)
        mm_f32(g, weight, dh_chunk)
    elif dh_chunk is not None:
        torch.mm(g, weight, out=dh_chunk)
    if dw is not None:
        if first:
            torch.mm(g.T, hidden_chunk, out=dw)
        else:
            dw.addmm_(g.T, hidden_chunk)
    if db is not None:
        db += g.sum(0, dtype=torch.float32)


def supported(hidden: torch.Tensor) -> bool:
    """Whether this pass can run: fp32 logits from half inputs need ``torch.mm(..., out_dtype=)``
    on CUDA (torch >= 2.9); the interpreter (CPU) upcasts instead."""
    if hidden.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    if hidden.dtype == torch.float32 or hidden.device.type != "cuda":
        return True
    return _MM_OUT_DTYPE


# torch.mm(..., out_dtype=) exists (torch >= 2.9); read once, at import (not while torch.compile traces)
_MM_OUT_DTYPE = "dtype_out" in torch.ops.aten.mm.overloads()


def _rows_launch_config(v: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of the row kernel."""
    if interpreting():
        return min(64, triton.next_power_of_2(v)), 1
    return min(4096, triton.next_power_of_2(v)), 8


def triton_train_pass(hidden, weight, bias, targets, smoothing, scale, softcap,
                      need_dh=True, need_dw=True, need_db=True, chunk_bytes: int | None = None,
                      z_loss: float = 0.0, accum_dtype: torch.dtype | None = None):
    """Statistics and gradients of ``sum_n scale_n loss_n`` for 2-D ``hidden`` (N, D).

    Returns ``(lse, zy, sz, argmax, entropy), dh, dw, db, gamma``; dh in hidden's dtype, dw in weight's (both fp32 for
    fp16: ``kept_dtype``), db fp32 (None where not needed), the gradients gamma times these (None but for fp16, whose
    G is written from the weights divided by gamma: ``matmul.fp16_weights``; backward multiplies it back as it casts,
    ``scale_by``). ``targets``: ids with -1 for ignored tokens; ``smoothing`` and
    ``scale``: fp32 per token (unread, and may be None, where no gradient is needed: the statistics alone, by chunks
    of ``STATS_CHUNK_BYTES``). ``z_loss``: the coefficient of ``lse^2`` in each token's loss.
    ``accum_dtype``: the dtype dW is accumulated in across chunks (default: the weight's).
    """
    n, d = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    bias = bias.contiguous() if bias is not None else None  # the row kernel reads it with unit stride
    write_g = need_dh or need_dw or need_db
    gamma = None
    if write_g:
        (scale,), gamma = fp16_weights(hidden.dtype, scale)  # (fp16: G keeps its digits; scaled back)
    f32 = dict(dtype=torch.float32, device=dev)
    lse, zy, sz, ent = (torch.empty(n, **f32) for _ in range(4))
    am = torch.empty(n, dtype=torch.int32, device=dev)
    if not write_g:  # (the row kernel reads neither without G)
        smoothing = scale = lse
    rows = max(1, min(n, (chunk_bytes or (TRAIN_CHUNK_BYTES if write_g else STATS_CHUNK_BYTES)) // (v * 4)))
    buf = torch.empty(rows, v, **f32)
    on_cpu = dev.type != "cuda"
    # G in hidden's dtype, in place over the fp32 logits (row stride 4V bytes) on CUDA, where cuBLAS reads a strided
    # matrix's V columns alone (432 forced-path cases on an H100: no non-finite value). Off CUDA G has its own storage:
    # CPU BLAS (torch 2.13's oneDNN bf16 mm) read the strided view past its columns, where the logits' other half lies
    # (non-finite as bf16 pairs), and a row of dh came back NaN.
    g_all = (torch.empty(rows, v, dtype=hidden.dtype, device=dev) if on_cpu and write_g
             else buf.view(hidden.dtype)[:, :v])
    w_t = (weight.float() if on_cpu else weight).T  # (off CUDA the weight in fp32 once, not per chunk: mm_f32)
    dh = torch.empty(n, d, dtype=kept_dtype(hidden.dtype), device=dev) if need_dh else None
    acc_dt = accum_dtype or kept_dtype(weight.dtype)
    dw = torch.empty(v, d, dtype=acc_dt, device=dev) if need_dw else None
    db = torch.zeros(v, **f32) if need_db else None
    block, warps = _rows_launch_config(v)
    for s in range(0, n, rows):
        e = min(n, s + rows)
        z, g, h = buf[: e - s], g_all[: e - s], hidden[s:e]
        mm_f32(h, w_t, z)
        _lce_rows_kernel[(e - s,)](
            z, bias if bias is not None else z, targets[s:e], smoothing[s:e], scale[s:e],
            scale[s:e], g, lse[s:e], zy[s:e], sz[s:e], am[s:e], ent[s:e],
            v, z.stride(0), g.stride(0), float(softcap) if softcap is not None else 1.0, 1.0 / v,
            float(z_loss), HAS_BIAS=bias is not None, SOFTCAP=softcap is not None, WRITE_G=write_g,
            HAS_ZLOSS=z_loss != 0, HAS_EXTRA=False, HAS_LSE=False, BLOCK=block, num_warps=warps)
        if not write_g:
            continue
        if acc_dt != weight.dtype and dw is not None:  # fp32 accumulation across chunks
            if s == 0:
                mm_f32(g.T, h, dw)
            else:
                addmm_f32(dw, g.T, h)
            add_chunk_gradients(g, h, weight, dh[s:e] if need_dh else None, None, db, first=s == 0)
        else:
            add_chunk_gradients(g, h, weight, dh[s:e] if need_dh else None, dw, db, first=s == 0)
    if dw is not None and dw.dtype != kept_dtype(weight.dtype):
        dw = dw.to(weight.dtype)
    return (lse, zy, sz, am.long(), ent), dh, dw, db, gamma


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


def scale_by(tensors, c: torch.Tensor | None = None, dtypes=None, gamma: torch.Tensor | None = None) -> list:
    """Each tensor (None passes) times ``c * gamma`` (one-element fp32 tensors on their device; None: 1) in
    ``dtypes[i]`` (None: its own dtype, in place), without reading them on the host: the kept gradients times the
    upstream gradient and, for fp16, times gamma (``matmul.fp16_weights``) as they are cast from fp32 to fp16, in one
    pass (other casts, as a bf16 bias's db, follow the scaling: the interpreter's bf16 casts truncate). On CUDA (and
    the interpreter) kernels, two tensors per launch, that touch no memory where the factor is 1 and nothing is cast;
    elsewhere torch."""
    if gamma is not None:
        c = gamma if c is None else c * gamma
    out = list(tensors)
    jobs = {False: [], True: []}  # (tensor, output) pairs in place / cast
    for i, t in enumerate(tensors):
        if t is None:
            continue
        dt = (dtypes[i] if dtypes else None) or t.dtype
        if c is None or not t.numel():
            out[i] = t.to(dt)
        elif (t.is_cuda or interpreting()) and t.is_contiguous():
            cast = dt == torch.float16 and t.dtype == torch.float32
            out[i] = torch.empty_like(t, dtype=dt) if cast else t
            jobs[cast].append((t, out[i]))
        else:
            wide = torch.float64 if t.dtype == torch.float64 else torch.float32
            res = t.to(wide) * c.to(wide)
            out[i] = t.copy_(res) if dt == t.dtype else res.to(dt)
    block = 1024 if interpreting() else 4096
    for cast, pairs in jobs.items():
        for k in range(0, len(pairs), 2):
            x, xo = pairs[k]
            y, yo = pairs[k + 1] if k + 1 < len(pairs) else (x[:0], xo[:0])
            bx = triton.cdiv(x.numel(), block)
            blocks = bx + triton.cdiv(y.numel(), block)
            _scale_kernel[(min(blocks, 4 if interpreting() else 1024),)](
                x, y, xo, yo, c, x.numel(), y.numel(), bx, blocks, CAST=cast, BLOCK=block,
                num_warps=1 if interpreting() else 8)
    return [t if t is None or dtypes is None or dtypes[i] is None else t.to(dtypes[i]) for i, t in enumerate(out)]
