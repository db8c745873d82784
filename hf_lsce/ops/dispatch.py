"""The backend dispatch shared by the single-device op (``linear_cross_entropy``) and the vocabulary-parallel one
(``vocab_parallel``): per-token forward statistics and the dense backward, from the Triton kernels or the chunked
torch reference. A module of its own so that neither of those two imports the other for it."""
from __future__ import annotations

import torch

from . import reference


def cublas_logits(hidden) -> bool:
    """Whether the per-token statistics (evaluation, the two-pass path's lse, the vocabulary-parallel forward; a chunk
    of rows at a time) and the recomputing backward by vocabulary columns (``dense_backward``, the two-pass
    computation) take their logits from cuBLAS and the one-pass path's row kernel (``train_pass``) rather than the
    fused and G kernels' Triton dots: where those dots are not tensor-core MMA. That is fp32 inputs on every GPU
    (Triton's fp32 dots are ``ieee``, FMA) and every dtype on GPUs below compute capability 8.0
    (``KernelConfig.mma_dot``: Turing, Volta), and wherever ``HF_LSCE_TRAIN_PATH`` forces the one-pass path
    (``"fused"`` or ``"two-pass"`` force the Triton kernels)."""
    from . import config
    from .train_pass import supported

    if not supported(hidden):
        return False
    if config.TRAIN_PATH is not None:
        return config.TRAIN_PATH == "one-pass"
    return hidden.dtype == torch.float32 or not config.fused_config(hidden.dtype, hidden.device).mma_dot


def forward_stats(hidden, weight, bias, targets, softcap, backend, stats=True, low_memory=False, free_bytes=None,
                  smoothing=None, z_loss=0.0):
    """Per-token (lse, target logit, sum of logits, argmax, entropy) from the chosen backend: the fused logits kernel
    without its store (``fused_pass.fused_statistics``; ``stats=False``: argmax and entropy skipped, returned as
    zeros), else (fp32, Turing and Volta, a soft-cap above ``fused_pass.SOFTCAP_MAX``) cuBLAS's logits and the
    one-pass path's row kernel, in chunks of ``config.stats_chunk_bytes`` within CUDA's free memory, or the low-memory
    mode's with ``low_memory``. With ``smoothing`` the fused kernel's statistics also carry each token's loss and nll
    (``paths.loss_terms`` takes them; the other routes' it computes)."""
    if backend == "triton" and not cublas_logits(hidden):
        from .config import fused_config
        from .fused_pass import fused_statistics, statistics_supported

        cfg = fused_config(hidden.dtype, hidden.device)
        if statistics_supported(hidden, softcap, cfg):
            return fused_statistics(hidden, weight, bias, targets, softcap, cfg, need_stats=stats, smoothing=smoothing,
                                    z_loss=z_loss)
    if backend == "triton":  # (the kernels' modules import Triton: the torch path runs without it)
        from .train_pass import supported, triton_train_pass
    if backend == "triton" and supported(hidden):
        from .config import free_cuda_memory, low_memory_chunk_bytes, stats_chunk_bytes

        if low_memory:
            chunk = low_memory_chunk_bytes(*hidden.shape, free_bytes)
        else:
            chunk = stats_chunk_bytes(free_cuda_memory(hidden.device) if hidden.is_cuda else None)
        return triton_train_pass(hidden, weight, bias, targets, None, None, softcap, need_dh=False, need_dw=False,
                                 need_db=False, chunk_bytes=chunk)[0]
    return reference.torch_forward(hidden, weight, bias, targets, softcap)


def dense_backward(hidden, weight, bias, targets, lse, grad, smoothing, softcap, backend, need_dh=True, need_dw=True,
                   extra=None):
    """(dh, dw, db, gamma): gamma (None: 1) times dh, dw and db are the gradients of ``sum_n grad_n loss_n``
    (+ ``extra_n p_n`` on the logits' gradient), exact, from the chosen backend (Triton: the logits recomputed by
    vocabulary columns, through cuBLAS where Triton's dots are FMA; fp16's gamma: ``matmul.fp16_weights``)."""
    if backend == "triton":
        from .backward import triton_gradients_by_columns
        from .config import grad_logits_config

        return triton_gradients_by_columns(hidden, weight, bias, targets, lse, grad, smoothing, softcap,
                                           grad_logits_config(hidden.dtype, hidden.device), need_dh=need_dh,
                                           need_dw=need_dw, need_db=bias is not None, extra=extra,
                                           cublas=cublas_logits(hidden))
    return (*reference.torch_backward(hidden, weight, bias, targets, lse, grad, smoothing, softcap,
                                      need_dh=need_dh, need_dw=need_dw, extra=extra), None)
