"""Block sizes of the Triton kernels, chosen per dtype and device."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KernelConfig:
    block_n: int
    block_v: int
    block_d: int
    num_warps: int
    num_stages: int
    dot_precision: str
    # Forward: split the vocabulary until the grid has at least this many programs.
    min_programs: int
    # fp32 operands for tl.dot: only under the interpreter, whose bf16 dot is wrong.
    upcast_dot: bool = False
    # Let triton.autotune pick the block sizes (CUDA; kernels without side effects only).
    autotune: bool = False


def interpreting() -> bool:
    """True when Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def forward_config(dtype: torch.dtype, device: torch.device) -> KernelConfig:
    prec = "ieee" if dtype == torch.float32 else "tf32"
    if interpreting():
        return KernelConfig(16, 32, 16, 1, 1, prec, 4, upcast_dot=dtype == torch.bfloat16)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if dtype == torch.float32:
        return KernelConfig(64, 64, 32, 4, 3, prec, 2 * sms)
    return KernelConfig(128, 128, 64, 8, 3, prec, 2 * sms, autotune=True)


def backward_config(dtype: torch.dtype, device: torch.device) -> KernelConfig:
    prec = "ieee" if dtype == torch.float32 else "tf32"
    if interpreting():
        return KernelConfig(16, 32, 16, 1, 1, prec, 1, upcast_dot=dtype == torch.bfloat16)
    if dtype == torch.float32:
        return KernelConfig(64, 64, 32, 4, 3, prec, 1)
    return KernelConfig(128, 128, 64, 8, 3, prec, 1, autotune=True)


# Memory for one chunk of the dense backward's gradient-of-logits buffer (chunk_rows x V).
GRAD_CHUNK_BYTES = 1 << 30
