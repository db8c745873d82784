"""The op inside ``torch.compile`` graphs and CUDA-graph captures: ``torch.library`` custom operators, opaque to the
compiler, that run the same code when the graph runs (the eager autograd function keeps state on its context, which
cannot be traced):

* ``hf_lsce::check_values``: the device values' checks (``checks.check_device_values``), returning the NaN flag;
* ``hf_lsce::token_losses`` (per-token losses and statistics, no gradient work) and its backward
  ``hf_lsce::token_loss_gradients`` (``paths.loss_gradients``, with the per-token upstream gradient: one more logits
  pass than eagerly);
* ``hf_lsce::reduced_training_loss``: a reduced training loss whose forward computes the gradients, as eagerly; its
  backward multiplies them by the upstream scalar.

None synchronises with the host on CUDA, so a compiled step can be captured in a CUDA graph (whose replays raise no
deferred error: the NaN loss still marks a bad target).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .budget import options
from .checks import check_device_values
from .matmul import kept_dtype, scale_by
from .paths import (finish_gradients, loss_gradients, loss_terms, notify_training_call, statistics,
                    statistics_and_gradients)


def compiling() -> bool:
    """Whether Dynamo is tracing the caller (torch >= 2.3; False on older torch, which then runs eagerly)."""
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and getattr(compiler, "is_compiling", lambda: False)())


@torch.library.custom_op("hf_lsce::check_values", mutates_args=())
def check_values(targets: Tensor, vocab_size: int, ignore_index: int, items: Optional[Tensor],
                 items_value: Optional[float], valid_count: Tensor, smoothing: Optional[Tensor]) -> Tensor:
    num_items = items if items is not None else (None if items_value is None else items_value)
    bad = check_device_values(targets, vocab_size, ignore_index, num_items, valid_count, smoothing)
    if bad is None:
        return torch.zeros((), dtype=torch.bool, device=targets.device)
    return bad.clone()


@check_values.register_fake
def _(targets, vocab_size, ignore_index, items, items_value, valid_count, smoothing):
    return targets.new_empty((), dtype=torch.bool)


def _stats_dtype(hidden: Tensor) -> torch.dtype:
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


@torch.library.custom_op("hf_lsce::token_losses", mutates_args=())
def token_losses(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, smoothing: Tensor,
                 softcap: Optional[float], backend: str, z_loss: float, need_stats: bool, memory: str,
                 training: bool, observed_smoothing: Optional[float]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(per-token loss, lse, argmax, nll, entropy); ignored tokens (target < 0) have loss and nll 0."""
    n = hidden.shape[0]
    if n == 0:
        e = torch.zeros(0, dtype=_stats_dtype(hidden), device=hidden.device)
        return e, e.clone(), torch.zeros(0, dtype=torch.long, device=hidden.device), e.clone(), e.clone()
    opts = options(hidden, weight, bias, softcap, backend, z_loss, memory, False, False, False, need_stats=need_stats)
    stats = statistics(hidden, weight, bias, targets, opts, smoothing.float().contiguous())
    lse, argmax, entropy = stats[0], stats[3], stats[4]
    loss, nll = loss_terms(stats, smoothing, targets, weight.shape[0], z_loss)
    if training:
        notify_training_call(observed_smoothing)
    # (copies: an operator's outputs may not alias each other, and the fused kernel's statistics hold the lse, loss
    # and nll as rows of one buffer)
    return loss, lse.clone(), argmax.clone(), nll.clone(), entropy.clone()


@token_losses.register_fake
def _(hidden, weight, bias, targets, smoothing, softcap, backend, z_loss, need_stats, memory, training,
      observed_smoothing):
    n, dt = hidden.shape[0], _stats_dtype(hidden)
    return (hidden.new_empty(n, dtype=dt), hidden.new_empty(n, dtype=dt), hidden.new_empty(n, dtype=torch.long),
            hidden.new_empty(n, dtype=dt), hidden.new_empty(n, dtype=dt))


def _none(hidden):
    """A gradient not needed: an empty tensor of its own (a custom operator's outputs may not alias each other; one
    empty tensor returned for both dW and db made torch refuse a frozen head without a bias, LoRA's case)."""
    return hidden.new_empty(0)


@torch.library.custom_op("hf_lsce::token_loss_gradients", mutates_args=())
def token_loss_gradients(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, lse: Tensor,
                         smoothing: Tensor, grad: Tensor, grad_lse: Optional[Tensor], softcap: Optional[float],
                         backend: str, z_loss: float, memory: str, need_dh: bool, need_dw: bool,
                         need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dh, dw, db) of ``sum_n grad_n loss_n + grad_lse_n lse_n``; an output not needed is an empty tensor."""
    need_db = need_db and bias is not None
    opts = options(hidden, weight, bias, softcap, backend, z_loss, memory, True, need_dw, need_db)
    dh, dw, db = finish_gradients(loss_gradients(hidden, weight, bias, targets, lse, smoothing, grad, grad_lse, opts,
                                                 need_dh, need_dw, need_db), None, hidden, weight, bias, opts)
    return (dh if need_dh else _none(hidden), dw if need_dw else _none(hidden),
            db if need_db and db is not None else _none(hidden))


@token_loss_gradients.register_fake
def _(hidden, weight, bias, targets, lse, smoothing, grad, grad_lse, softcap, backend, z_loss, memory, need_dh,
      need_dw, need_db):
    # (the gradients are new contiguous tensors whatever the inputs' strides: empty_like would copy a transposed
    # weight's, which the compiled graph then asserts)
    return (hidden.new_empty(hidden.shape) if need_dh else _none(hidden),
            weight.new_empty(weight.shape) if need_dw else _none(hidden),
            bias.new_empty(bias.shape) if need_db and bias is not None else _none(hidden))


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, targets, smoothing, softcap, backend, z_loss, _, memory, _, _ = inputs
    lse = output[1]
    ctx.save_for_backward(hidden, weight, bias, targets, smoothing, lse)
    ctx.options = (softcap, backend, z_loss, memory)
    ctx.mark_non_differentiable(output[2], output[3], output[4])


def _backward(ctx, grad_loss, grad_lse, *unused):
    hidden, weight, bias, targets, smoothing, lse = ctx.saved_tensors
    softcap, backend, z_loss, memory = ctx.options
    need_dh, need_dw, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    if grad_loss is None and grad_lse is None:
        return (None,) * 12
    grad = torch.zeros_like(lse) if grad_loss is None else grad_loss
    grad = torch.where(targets >= 0, grad.to(lse.dtype), torch.zeros_like(lse))
    dh, dw, db = token_loss_gradients(hidden, weight, bias, targets, lse, smoothing, grad.contiguous(),
                                      None if grad_lse is None else grad_lse.to(lse.dtype).contiguous(), softcap,
                                      backend, z_loss, memory, need_dh, need_dw, need_db and bias is not None)
    return (dh if need_dh else None, dw if need_dw else None,
            db if need_db and bias is not None else None) + (None,) * 9


torch.library.register_autograd("hf_lsce::token_losses", _backward, setup_context=_setup_context)


@torch.library.custom_op("hf_lsce::reduced_training_loss", mutates_args=())
def reduced_training_loss(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, smoothing: Tensor,
                          token_weight: Tensor, denom: Optional[Tensor], softcap: Optional[float], backend: str,
                          z_loss: float, need_stats: bool, memory: str, observed_smoothing: Optional[float], need_dh: bool,
                          need_dw: bool, need_db: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                 Tensor, Tensor]:
    """(loss = sum_n loss_n / denom, lse, argmax, nll, entropy, dh, dw, db), the gradients those of the loss; a
    gradient not needed is an empty tensor."""
    n, dt = hidden.shape[0], _stats_dtype(hidden)
    need_db = need_db and bias is not None
    if n == 0:
        e = torch.zeros(0, dtype=dt, device=hidden.device)
        kept = (hidden.new_zeros(hidden.shape, dtype=kept_dtype(hidden.dtype)) if need_dh else _none(hidden),
                weight.new_zeros(weight.shape, dtype=kept_dtype(weight.dtype)) if need_dw
                else _none(hidden), bias.new_zeros(bias.shape) if need_db else _none(hidden))
        return (torch.zeros((), dtype=dt, device=hidden.device), e, torch.zeros(0, dtype=torch.long,
                device=hidden.device), e.clone(), e.clone(), *kept)
    opts = options(hidden, weight, bias, softcap, backend, z_loss, memory, True, need_dw, need_db,
                   need_stats=need_stats, reduce=True)
    stats, (dh, dw, db, gamma) = statistics_and_gradients(hidden, weight, bias, targets, smoothing, token_weight,
                                                          opts, need_dh, need_dw, need_db)
    dh, dw, db = scale_by((dh, dw, db), gamma=gamma,  # (fp16: times gamma, in place; kept in fp32: kept_dtype)
                          interpreted=opts.computation == "fused")
    lse, argmax, entropy = stats[0], stats[3], stats[4]
    per, nll = loss_terms(stats, smoothing, targets, weight.shape[0], z_loss)
    loss = per.sum() if denom is None else per.sum() / denom
    notify_training_call(observed_smoothing)
    return (loss, lse.clone(), argmax.clone(), nll.clone(), entropy.clone(),
            dh.to(kept_dtype(hidden.dtype)) if need_dh else _none(hidden),
            dw.to(kept_dtype(weight.dtype)) if need_dw else _none(hidden),
            db.to(bias.dtype) if need_db and db is not None else _none(hidden))


@reduced_training_loss.register_fake
def _(hidden, weight, bias, targets, smoothing, token_weight, denom, softcap, backend, z_loss, need_stats, memory,
      observed_smoothing, need_dh, need_dw, need_db):
    n, dt = hidden.shape[0], _stats_dtype(hidden)
    return (hidden.new_empty((), dtype=dt), hidden.new_empty(n, dtype=dt), hidden.new_empty(n, dtype=torch.long),
            hidden.new_empty(n, dtype=dt), hidden.new_empty(n, dtype=dt),
            hidden.new_empty(hidden.shape, dtype=kept_dtype(hidden.dtype)) if need_dh else _none(hidden),
            weight.new_empty(weight.shape, dtype=kept_dtype(weight.dtype)) if need_dw else _none(hidden),
            bias.new_empty(bias.shape) if need_db and bias is not None else _none(hidden))


def _setup_reduced(ctx, inputs, output):
    ctx.save_for_backward(*output[5:])
    ctx.has_bias = inputs[2] is not None
    ctx.dtypes = inputs[0].dtype, inputs[1].dtype  # (the kept gradients' are fp32 for fp16: kept_dtype)
    ctx.mark_non_differentiable(*output[1:])


def _backward_reduced(ctx, grad_loss, *unused):
    dh, dw, db = ctx.saved_tensors
    need_dh, need_dw, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    if grad_loss is None:
        return (None,) * 16
    g = grad_loss.reshape(()).float()

    def scaled(t, dtype=None):
        return (t.float() * g).to(dtype or t.dtype)

    return (scaled(dh, ctx.dtypes[0]) if need_dh else None, scaled(dw, ctx.dtypes[1]) if need_dw else None,
            scaled(db) if need_db and ctx.has_bias else None) + (None,) * 13


torch.library.register_autograd("hf_lsce::reduced_training_loss", _backward_reduced, setup_context=_setup_reduced)


def reduced_loss(hidden, weight, bias, targets, smoothing, token_weight, denom, softcap, backend, z_loss, need_stats,
                 memory, observed_smoothing):
    """``reduced_training_loss`` with the gradients it needs read from ``requires_grad``: (loss, lse, argmax, nll,
    entropy). ``denom``: a tensor, a number (``num_items_in_batch`` given as one: made a tensor, the operator's
    argument type) or None."""
    if denom is not None and not torch.is_tensor(denom):
        denom = torch.tensor(float(denom), dtype=torch.float32, device=hidden.device)
    out = reduced_training_loss(hidden, weight, bias, targets, smoothing, token_weight, denom, softcap, backend,
                                z_loss, need_stats, memory, observed_smoothing,
                                hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    return out[:5]
