"""cuBLAS products with an fp32 result from half-precision operands, shared by the training paths (``backward``,
``train_pass``, ``fused_pass``): a module of its own, so that none of those imports another for them."""
from __future__ import annotations

import torch


def mm_f32(a, b, out):
    """out (fp32) = a @ b from half or fp32 operands: cuBLAS with fp32 output on CUDA, fp32 math elsewhere."""
    if a.device.type != "cuda":
        torch.mm(a.float(), b.float(), out=out)
    elif a.dtype == torch.float32:
        torch.mm(a, b, out=out)
    else:
        torch.mm(a, b, out_dtype=torch.float32, out=out)


def addmm_f32(acc, a, b):
    """acc (fp32) += a @ b for half operands, without a temporary where cuBLAS can accumulate into fp32."""
    if a.device.type == "cuda" and a.dtype != torch.float32 and "dtype_out" in torch.ops.aten.addmm.overloads():
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc += a.float() @ b.float()
