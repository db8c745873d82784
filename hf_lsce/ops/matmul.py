"""cuBLAS products with an fp32 result from half-precision operands, and the dtypes and scales of the gradients the
op keeps from its forward until backward (``fused_pass``, ``reference``, ``paths``). No Triton import: the torch
computation runs without it."""
from __future__ import annotations

import torch

from .config import interpreting

# torch.mm(..., out_dtype=) exists (torch >= 2.9): fp32 results of half-precision cuBLAS products, which the fused pass
# needs on CUDA (read once, at import: not while torch.compile traces)
MM_OUT_DTYPE = "dtype_out" in torch.ops.aten.mm.overloads()


def mm_f32(a, b, out):
    """out (fp32) = a @ b from half or fp32 operands: cuBLAS with fp32 output on CUDA, fp32 math elsewhere."""
    if a.device.type != "cuda":
        torch.mm(a.float(), b.float(), out=out)
    elif a.dtype == torch.float32:
        torch.mm(a, b, out=out)
    else:
        torch.mm(a, b, out_dtype=torch.float32, out=out)


def kept_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the gradients kept from the forward until backward: fp32 for fp16 inputs (at a token weight of 1
    / N they would be subnormal in fp16, where a loss scaler's factor could not give their digits back), the input
    dtype otherwise."""
    return torch.float32 if dtype == torch.float16 else dtype


def power_of_two_scale(*tensors) -> torch.Tensor:
    """The smallest power of two at least the largest magnitude in ``tensors`` (None and empty skipped), a
    one-element fp32 tensor, no host synchronisation."""
    top = torch.stack([t.detach().abs().amax().float() for t in tensors if t is not None and t.numel()]).amax()
    return torch.exp2(torch.ceil(torch.log2(top.clamp_min(2.0 ** -100)))).reshape(1)


def fp16_weights(dtype: torch.dtype, *weights):
    """fp16 inputs: (the token weights / gamma, gamma), gamma = ``power_of_two_scale(*weights)``; other dtypes: (the
    weights, None). G = w (p - y) in fp16 at w ~ 1 / N would sit mostly below fp16's normal range (dh 0.4 off fp64
    on an H100); with weights near 1 it keeps fp16's digits, and the gradients are gamma times the products,
    multiplied back where backward casts them (``paths.finish_gradients``) or before the vocabulary-parallel
    all-reduce (``times_gamma``)."""
    if dtype != torch.float16:
        return weights, None
    gamma = power_of_two_scale(*weights)
    return tuple(w / gamma if w is not None else None for w in weights), gamma


def times_gamma(grads, gamma) -> None:
    """Each gradient (None passes) times ``gamma`` in place (``fp16_weights``; None: nothing to do)."""
    if gamma is not None:
        for t in grads:
            if t is not None:
                t.mul_(gamma)


def addmm_f32(acc, a, b):
    """acc (fp32) += a @ b for half operands, without a temporary where cuBLAS can accumulate into fp32."""
    if a.device.type == "cuda" and a.dtype != torch.float32 and "dtype_out" in torch.ops.aten.addmm.overloads():
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc += a.float() @ b.float()


def scale_by(tensors, c: torch.Tensor | None = None, dtypes=None, gamma: torch.Tensor | None = None,
             interpreted: bool = True) -> list:
    """Each tensor (None passes) times ``c * gamma`` (one-element fp32 tensors on their device; None: 1) in
    ``dtypes[i]`` (None: its own dtype, in place), without reading them on the host: the kept gradients times the
    upstream gradient and, for fp16, times gamma (``fp16_weights``) as they are cast from fp32 to fp16, in one pass
    (other casts, as a bf16 bias's db, follow the scaling: the interpreter's bf16 casts truncate). On CUDA (and the
    interpreter) a kernel, two tensors per launch, that touches no memory where the factor is 1 and nothing is cast
    (``tiles._scale_kernel``; ``interpreted=False``: not the interpreter's, for the torch computation's CPU tensors);
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
        elif (t.is_cuda or (interpreted and interpreting())) and t.is_contiguous():
            cast = dt == torch.float16 and t.dtype == torch.float32
            out[i] = torch.empty_like(t, dtype=dt) if cast else t
            jobs[cast].append((t, out[i]))
        else:
            wide = torch.float64 if t.dtype == torch.float64 else torch.float32
            res = t.to(wide) * c.to(wide)
            out[i] = t.copy_(res) if dt == t.dtype else res.to(dt)
    if jobs[False] or jobs[True]:
        from .tiles import scale_pairs

        for cast, pairs in jobs.items():
            scale_pairs(pairs, c, cast)
    return [t if t is None or dtypes is None or dtypes[i] is None else t.to(dtypes[i]) for i, t in enumerate(out)]
