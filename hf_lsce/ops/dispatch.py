"""The backend dispatch shared by the single-device op (``linear_cross_entropy``) and the vocabulary-parallel one
(``vocab_parallel``): per-token forward statistics and the dense backward, from the Triton kernels or the chunked
torch reference. A module of its own so that neither of those two imports the other for it."""
from __future__ import annotations

from . import reference


def forward_stats(hidden, weight, bias, targets, softcap, backend, stats=True):
    """Per-token (lse, target logit, sum of logits, argmax, entropy) from the chosen backend
    (``stats=False``: the Triton kernel skips argmax and entropy, returned as zeros)."""
    if backend == "triton":
        from .config import forward_config
        from .forward import triton_forward

        return triton_forward(hidden, weight, bias, targets, softcap, forward_config(hidden.dtype, hidden.device),
                              stats=stats)
    return reference.torch_forward(hidden, weight, bias, targets, softcap)


def dense_backward(hidden, weight, bias, targets, lse, grad, smoothing, softcap, backend, need_dh=True, need_dw=True,
                   extra=None):
    """(dh, dw, db) of ``sum_n grad_n loss_n`` (+ ``extra_n p_n`` on the logits' gradient), exact, from the chosen
    backend."""
    if backend == "triton":
        from .backward import triton_gradients_by_columns
        from .config import grad_logits_config

        return triton_gradients_by_columns(hidden, weight, bias, targets, lse, grad, smoothing, softcap,
                                           grad_logits_config(hidden.dtype, hidden.device), need_dh=need_dh,
                                           need_dw=need_dw, need_db=bias is not None, extra=extra)
    return reference.torch_backward(hidden, weight, bias, targets, lse, grad, smoothing, softcap,
                                    need_dh=need_dh, need_dw=need_dw, extra=extra)
