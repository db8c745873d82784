"""What a call runs, given the ``budget.Options`` decided for it once (``budget.options``): the statistics, a training
call's statistics and gradients (in the forward), the recomputing backward. Shared by the eager op and the compiled
one (``compiled.py``): the fused computation (``fused_pass.py``) in the plan's layout, or the chunked torch computation
(``reference.py``) in the plan's chunks.
"""
from __future__ import annotations

import torch

from . import budget as bud
from .reference import torch_pass

# Functions called with the smoothing factor (a float; None when per-token) by every call of the op that trains
# (gradients wanted), when it runs: eagerly, and from the compiled graph's operator under torch.compile. The
# patching's engagement record subscribes here, so a training step proves that the op itself ran.
_TRAINING_CALL_OBSERVERS: list = []


def observe_training_calls(fn) -> None:
    """Call ``fn(label_smoothing)`` at every training call of the op (idempotent)."""
    if fn not in _TRAINING_CALL_OBSERVERS:
        _TRAINING_CALL_OBSERVERS.append(fn)


def notify_training_call(label_smoothing) -> None:
    for fn in list(_TRAINING_CALL_OBSERVERS):
        fn(label_smoothing)


def token_loss_terms(lse, zy, sz, smoothing, valid, vocab_size: int, z_loss: float):
    """(per-token smoothed loss, nll) from the forward statistics; 0 where ``valid`` is False."""
    b = smoothing.to(lse.dtype)
    per = lse - (1.0 - b) * zy - b * sz / vocab_size
    if z_loss:
        per = per + z_loss * lse * lse
    zero = torch.zeros_like(lse)
    return torch.where(valid, per, zero), torch.where(valid, lse - zy, zero)


def loss_terms(stats, smoothing, targets, vocab_size: int, z_loss: float):
    """(per-token smoothed loss, nll) of a call: the fused kernel computes them in its row kernel (its statistics carry
    them), the torch computation's from its statistics here (``token_loss_terms``)."""
    if len(stats) == 7:
        return stats[5], stats[6]
    lse, zy, sz = stats[:3]
    return token_loss_terms(lse, zy, sz, smoothing, targets >= 0, vocab_size, z_loss)


def _config(hidden):
    from .config import fused_config

    return fused_config(hidden.dtype, hidden.device)


def statistics(hidden, weight, bias, targets, opts, smoothing=None):
    """Per-token (lse, target logit, sum of logits, argmax, entropy); with ``smoothing``, where the fused kernel
    gives them, the tokens' losses and nll too."""
    if opts.computation == "fused":
        from .fused_pass import fused_statistics

        return fused_statistics(hidden, weight, bias, targets, opts.softcap, _config(hidden), opts.need_stats,
                                smoothing, opts.z_loss)
    return torch_pass(hidden, weight, bias, targets, opts.softcap, opts.plan.rows if opts.plan else None,
                      need_stats=opts.need_stats)[0]


def statistics_and_gradients(hidden, weight, bias, targets, smoothing, token_weight, opts, need_dh, need_dw,
                             need_db):
    """A training call's forward: (statistics, (dh, dw, db, gamma)), gamma times dh, dw and db the gradients of
    ``sum_n token_weight_n loss_n`` (gamma None but for fp16: ``finish_gradients``)."""
    if opts.computation == "fused":
        from .fused_pass import triton_fused_pass

        stats, *grads = triton_fused_pass(hidden, weight, bias, targets, smoothing, token_weight, _config(hidden),
                                          opts.plan, need_dh=need_dh, need_dw=need_dw, need_db=need_db,
                                          need_stats=opts.need_stats, z_loss=opts.z_loss, softcap=opts.softcap,
                                          smoothed=opts.smoothed)
        return stats, tuple(grads)
    stats, dh, dw, db = torch_pass(hidden, weight, bias, targets, opts.softcap, opts.plan.rows, grad=token_weight,
                                   smoothing=smoothing, z_loss=opts.z_loss, need_dh=need_dh, need_dw=need_dw,
                                   need_db=need_db, need_stats=opts.need_stats)
    return stats, (dh, dw, db, None)


def dense_backward(hidden, weight, bias, targets, lse, grad, smoothing, opts, need_dh=True, need_dw=True, need_db=True,
                   extra=None, vocab: int | None = None):
    """(dh, dw, db, gamma) of ``sum_n grad_n loss_n + extra_n lse_n`` given the lse (``vocab``: the whole vocabulary
    where ``weight`` is a shard): the fused kernel's G epilogue by chunks of columns within the call's budget, or
    the torch computation."""
    need_db = need_db and bias is not None
    if opts.computation != "fused":
        _, dh, dw, db = torch_pass(hidden, weight, bias, targets, opts.softcap, opts.plan.rows if opts.plan else None,
                                   lse=lse, grad=grad, smoothing=smoothing, z_loss=opts.z_loss, extra=extra,
                                   need_dh=need_dh, need_dw=need_dw, need_db=need_db, vocab=vocab)
        return dh, dw, db, None
    from .fused_pass import fused_gradients, row_terms
    from .matmul import fp16_weights, kept_dtype

    (n, d), v = hidden.shape, weight.shape[0]
    dev = hidden.device
    s = bud.shape_of(hidden, weight, bias, opts.softcap, "fused", need_dw, need_db)
    cols = bud.recompute_cols(s, opts.plan.nbytes if opts.plan else None)  # (the plan's bytes, not a new budget)
    (grad, extra), gamma = fp16_weights(hidden.dtype, grad.float(), extra)
    terms = row_terms(lse, grad, smoothing.float(), opts.z_loss, vocab or v, extra)
    dh = torch.empty(n, d, dtype=torch.float32, device=dev) if need_dh else None
    dw = torch.empty(v, d, dtype=kept_dtype(weight.dtype), device=dev) if need_dw else None
    db = torch.zeros(v, dtype=torch.float32, device=dev) if need_db else None
    fused_gradients(hidden, weight, bias, targets, lse.float().contiguous(), terms, opts.softcap, _config(hidden),
                    cols, dh, dw, db)
    return (dh.to(kept_dtype(hidden.dtype)) if dh is not None else None), dw, db, gamma


def loss_gradients(hidden, weight, bias, targets, lse, smoothing, grad, grad_lse, opts, need_dh, need_dw, need_db):
    """(dh, dw, db, gamma) of ``sum_n grad_n loss_n (+ grad_lse_n lse_n)``: the training computation again with
    ``grad`` as the token weights, or with an lse gradient ``dense_backward``."""
    if grad_lse is None:
        return statistics_and_gradients(hidden, weight, bias, targets, smoothing, grad.float(), opts, need_dh, need_dw,
                                        need_db)[1]
    return dense_backward(hidden, weight, bias, targets, lse, grad.float().contiguous(), smoothing.float().contiguous(),
                          opts, need_dh, need_dw, need_db, extra=grad_lse.float().contiguous())


def finish_gradients(grads, c, hidden, weight, bias, opts: bud.Options | None = None) -> tuple:
    """Gradients ``(dh, dw, db, gamma)`` times the upstream factor ``c`` (a one-element tensor; None: 1) and gamma,
    in the inputs' dtypes, rounded once (``matmul.scale_by``; the torch computation's by torch)."""
    from .matmul import scale_by

    *grads, gamma = grads
    return tuple(scale_by(grads, c, (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None), gamma,
                          interpreted=opts is None or opts.computation == "fused"))
