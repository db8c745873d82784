"""``linear_cross_entropy``: fused linear layer + label-smoothed cross-entropy, the one public entry point of
``hf_lsce.ops``. It validates every argument (the only place that does), normalises shapes, picks the computation
and its plan within the memory budget once (``budget.options``) and runs it; per token

    loss_n = (1 - b_n) (lse_n - z_{n,y_n}) + b_n (lse_n - mean_v z_nv),   z = h W^T + bias

(z soft-capped as ``cap * tanh(z / cap)`` with ``softcap``), never holding the N x V logits.
"""
from __future__ import annotations

import functools
import math
import numbers
import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .budget import Options, check_memory, options
from .checks import _check_num_items, check_device_values, check_summary
from .compiled import check_values, compiling, reduced_loss, token_losses
from .paths import (finish_gradients, loss_gradients, loss_terms, notify_training_call, statistics,
                    statistics_and_gradients)

_REDUCTIONS = ("mean", "sum", "none")
_BACKENDS = ("auto", "triton", "torch")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class LCEStats(NamedTuple):
    """Per-token statistics from the forward pass (shape of ``targets``; no gradient).

    ``lse``: log-sum-exp of the logits; ``argmax``: the top-1 token; ``nll``: unsmoothed
    cross-entropy ``lse - z_y`` (0 where ignored); ``entropy``: entropy of softmax(z), in nats;
    ``valid``: True where the target is not ``ignore_index``.
    """

    lse: torch.Tensor
    argmax: torch.Tensor
    nll: torch.Tensor
    entropy: torch.Tensor
    valid: torch.Tensor


# Triton compiles for NVIDIA GPUs of compute capability 7.0 (Volta) and newer.
TRITON_MIN_CAPABILITY = (7, 0)


@functools.lru_cache(maxsize=None)
def _triton_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels run on this CUDA device: a Triton of at least ``config.TRITON_MIN`` and a GPU it
    drives; otherwise the torch computation, with one warning per process and device (cached)."""
    from .config import triton_problem

    problem = triton_problem()
    if problem is not None:
        warnings.warn(f"hf_lsce: {problem}. The op runs its chunked torch path (exact, without the fused kernels' "
                      "speed).", RuntimeWarning, stacklevel=3)
        return False
    cap = torch.cuda.get_device_capability(device)
    if torch.version.hip is None and cap < TRITON_MIN_CAPABILITY:
        warnings.warn(f"hf_lsce: {torch.cuda.get_device_name(device)} (compute capability {cap[0]}.{cap[1]}) is older "
                      "than Triton supports (7.0); the op runs its chunked torch path there (exact, without the fused "
                      "kernels' speed).", RuntimeWarning, stacklevel=3)
        return False
    return True


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "triton" if device.type == "cuda" and _triton_runs_on(device) else "torch"
    if backend == "triton":
        from .config import interpreting, triton_problem, triton_version

        if triton_version() is None:
            raise RuntimeError("backend='triton' needs the `triton` package; install it or use backend='torch'.")
        if device.type != "cuda" and not interpreting():
            raise ValueError(
                f"backend='triton' needs CUDA tensors (got device {device}); set TRITON_INTERPRET=1 "
                "before importing hf_lsce to run the kernels in Triton's CPU interpreter, or use backend='torch'."
            )
        if triton_problem() is not None:  # asked for explicitly: run, and say once that it is untested
            _warn_untested_triton()
    return backend


@functools.lru_cache(maxsize=None)
def _warn_untested_triton() -> None:
    from .config import triton_problem

    warnings.warn(f"hf_lsce: backend='triton' was asked for, but {triton_problem()}; backend='auto' takes the torch "
                  "path there.", RuntimeWarning, stacklevel=4)


_INT64 = (-(2 ** 63), 2 ** 63 - 1)


def _validate(hidden, weight, targets, bias, label_smoothing, ignore_index, reduction, softcap,
              num_items_in_batch, backend, shift=False, return_stats=False):
    """Check every argument but the values that live on the device (``checks.py``); raise
    ValueError / TypeError naming the argument, before any work."""
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"hidden must be a torch.Tensor, got {type(hidden).__name__}.")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}.")
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a torch.Tensor of token ids, got {type(targets).__name__}.")
    if hidden.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"hidden must be float16, bfloat16, float32 or float64, got {hidden.dtype}.")
    if weight.dtype != hidden.dtype:
        raise TypeError(
            f"weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}; cast one of them "
            "(e.g. weight.to(hidden.dtype)) or run under torch.autocast."
        )
    if hidden.dim() < 1:
        raise ValueError("hidden must have shape (..., D); got a 0-d tensor.")
    if weight.dim() != 2:
        raise ValueError(f"weight must have shape (V, D); got {tuple(weight.shape)}.")
    if hidden.shape[-1] == 0:
        raise ValueError("hidden has a last dimension of 0: the hidden size D must be at least 1.")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"hidden's last dimension ({hidden.shape[-1]}) must equal weight.shape[1] ({weight.shape[1]})."
        )
    if weight.shape[0] == 0:
        raise ValueError("weight has no rows: the vocabulary size V must be at least 1.")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"targets must hold integer token ids, got dtype {targets.dtype}.")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal hidden.shape[:-1] = {tuple(hidden.shape[:-1])}."
        )
    for name, t in (("weight", weight), ("targets", targets)):
        if t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}; move them to one device.")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}.")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must have shape (V,) = ({weight.shape[0]},); got {tuple(bias.shape)}.")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias dtype {bias.dtype} differs from hidden dtype {hidden.dtype}.")
        if bias.device != hidden.device:
            raise ValueError(f"bias is on {bias.device} but hidden is on {hidden.device}.")
    if not isinstance(reduction, str) or reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}.")
    if not isinstance(backend, str) or backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}.")
    if not isinstance(ignore_index, numbers.Integral) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}.")
    if not _INT64[0] <= int(ignore_index) <= _INT64[1]:
        raise ValueError(f"ignore_index must fit in int64 (the dtype of token ids), got {ignore_index}.")
    if not isinstance(shift, bool):
        raise TypeError(f"shift must be True or False (shift by one position, as HF causal LMs), got {shift!r}.")
    if not isinstance(return_stats, bool):
        raise TypeError(f"return_stats must be True or False, got {return_stats!r}.")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not (
                math.isfinite(float(softcap)) and softcap > 0):
            raise ValueError(f"softcap must be None or a finite positive number, got {softcap!r}.")
    if num_items_in_batch is not None:
        if reduction == "none":
            raise ValueError("num_items_in_batch divides the summed loss; it cannot be used with reduction='none'.")
        if isinstance(num_items_in_batch, torch.Tensor):
            if num_items_in_batch.numel() != 1:
                raise ValueError("num_items_in_batch must be a number or a one-element tensor, got a tensor of shape "
                                 f"{tuple(num_items_in_batch.shape)}.")
            if num_items_in_batch.dtype == torch.bool or num_items_in_batch.is_complex():
                raise TypeError(f"num_items_in_batch must hold a count, got dtype {num_items_in_batch.dtype}.")
        elif isinstance(num_items_in_batch, bool) or not isinstance(num_items_in_batch, numbers.Real):
            raise TypeError(f"num_items_in_batch must be a number or a tensor, got {num_items_in_batch!r}.")
        else:
            _check_num_items(float(num_items_in_batch))

    if isinstance(label_smoothing, torch.Tensor):
        if not label_smoothing.dtype.is_floating_point:
            raise TypeError(f"label_smoothing tensor must be floating point, got {label_smoothing.dtype}.")
        if label_smoothing.dim() != 0 and tuple(label_smoothing.shape) != tuple(targets.shape):
            raise ValueError(
                f"per-token label_smoothing must have the shape of targets {tuple(targets.shape)}, "
                f"got {tuple(label_smoothing.shape)}."
            )
        if label_smoothing.device != hidden.device:
            raise ValueError(f"label_smoothing is on {label_smoothing.device} but hidden is on {hidden.device}.")
        # its values ([0, 1], not NaN) are checked with the targets (checks.py: no host synchronisation)
    elif isinstance(label_smoothing, numbers.Real) and not isinstance(label_smoothing, bool):
        if not 0.0 <= float(label_smoothing) <= 1.0:
            raise ValueError(f"label_smoothing must lie in [0, 1], got {label_smoothing}.")
    else:
        raise TypeError(f"label_smoothing must be a float in [0, 1] or a tensor, got {label_smoothing!r}.")


def loss_denominator(num_items_in_batch, valid_count: torch.Tensor, dtype=torch.float32):
    """Hugging Face's divisor of a summed token loss: ``num_items_in_batch`` when given, else the number
    of valid tokens; clamped to >= 1 so an all-ignored batch gives 0, never NaN (a tensor or a float)."""
    denom = valid_count if num_items_in_batch is None else num_items_in_batch
    if torch.is_tensor(denom):
        return denom.detach().reshape(()).to(device=valid_count.device, dtype=dtype).clamp_min(1)
    return max(float(denom), 1.0)


def divide_summed_loss(total: torch.Tensor, num_items_in_batch, valid_count: torch.Tensor) -> torch.Tensor:
    """``total`` divided by :func:`loss_denominator`."""
    return total / loss_denominator(num_items_in_batch, valid_count, total.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """Smoothed losses of 2-D inputs: the reduced loss ``sum_n loss_n / denom`` (``opts.reduce``; ``denom`` None:
    the sum) or per-token losses. A training call (``token_weight`` given) computes the gradients of ``sum_n
    token_weight_n loss_n`` in the forward; backward multiplies them by the upstream gradient, a device scalar for a
    reduced loss (no host synchronisation), one constant c over the valid tokens for per-token losses (TRL's
    ``-log_probs.sum() / n``; one synchronisation to find c). Any other upstream gradient, or one reaching the lse
    output, is computed again: exact either way."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, smoothing, token_weight, denom, bad, opts: Options):
        n, v = hidden.shape[0], weight.shape[0]
        ctx.kept = None
        ctx.set_materialize_grads(False)  # an unused output (the lse) sends None, not zeros
        if n == 0:
            e = torch.zeros(0, dtype=torch.float32, device=hidden.device)
            stats = (e, e, e, torch.zeros(0, dtype=torch.long, device=hidden.device), e)
        elif token_weight is not None:
            stats, ctx.kept = statistics_and_gradients(
                hidden, weight, bias, targets, smoothing, token_weight, opts, ctx.needs_input_grad[0],
                ctx.needs_input_grad[1], ctx.needs_input_grad[2] and bias is not None)
        else:
            stats = statistics(hidden, weight, bias, targets, opts, smoothing)
        lse, argmax, entropy = stats[0], stats[3], stats[4]
        loss, nll = loss_terms(stats, smoothing, targets, v, opts.z_loss)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, smoothing, token_weight, bad)
        ctx.opts = opts
        ctx.denom = denom
        ctx.mark_non_differentiable(argmax, nll, entropy)
        if opts.reduce:
            loss = loss.sum() if denom is None else loss.sum() / denom
        if bad is not None:  # a failed check of the device's values: a NaN loss (its gradients are zero: backward)
            # (in place on the reduced loss, a tensor of its own: 6 against 13-14 us of host time out of place or by
            # torch.where with a Python scalar, H200; per-token losses may share a buffer with the saved lse)
            loss = loss.masked_fill_(bad, float("nan")) if opts.reduce else loss.masked_fill(bad, float("nan"))
        # the lse saved for backward, returned as it is: the caller copies it where it hands it out (an in-place
        # change to a returned copy must not reach the saved one)
        return loss, lse, argmax, nll, entropy

    @staticmethod
    def backward(ctx, grad_loss, grad_lse, *unused):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "linear_cross_entropy does not support double backward (backward with create_graph=True, or "
                "torch.autograd.grad(..., create_graph=True) through it): its gradients are computed by kernels, "
                "not by differentiable torch ops. Compute second-order terms on materialised logits instead.")
        hidden, weight, bias, targets, lse, smoothing, token_weight, bad = ctx.saved_tensors
        opts = ctx.opts
        need_dh, need_dw, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        kept, ctx.kept = ctx.kept, None
        n = hidden.shape[0]
        rest = (None,) * 6
        if n == 0 or (grad_loss is None and grad_lse is None):
            return (torch.zeros_like(hidden) if need_dh else None, torch.zeros_like(weight) if need_dw else None,
                    torch.zeros_like(bias) if need_db and bias is not None else None) + rest
        kept_path = grad_lse is None and token_weight is not None
        if kept_path and kept is None:
            # A second backward through the same graph (retain_graph=True): the first took the gradients the
            # forward kept. Compute them again the same way (deterministic), so every backward agrees.
            kept = statistics_and_gradients(hidden, weight, bias, targets, smoothing, token_weight, opts,
                                            need_dh, need_dw, need_db and bias is not None)[1]
        if kept_path and opts.reduce:  # grad_loss is the upstream scalar (not None: see above)
            return *finish_gradients(kept, grad_loss.detach().float().reshape(1), hidden, weight, bias, opts), *rest
        if bad is not None and grad_loss is not None:  # the NaN loss of a failed check passes no gradient
            grad_loss = torch.where(bad, 0.0, grad_loss)
        valid = targets >= 0
        zeros = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        if grad_loss is None:
            grad = zeros
        elif opts.reduce:  # d(sum_n loss_n / denom) / d loss_n, times the upstream scalar
            g = grad_loss.float().reshape(())
            grad = torch.where(valid, g if ctx.denom is None else g / ctx.denom, zeros)
        else:
            grad = torch.where(valid, grad_loss.float(), zeros)
        if kept_path:
            c = _uniform_ratio(grad, token_weight)
            if c is not None:
                c = None if math.isclose(c, 1.0, rel_tol=1e-6, abs_tol=0.0) else torch.full(
                    (1,), c, dtype=torch.float32, device=hidden.device)
                return *finish_gradients(kept, c, hidden, weight, bias, opts), *rest
        del kept  # an upstream gradient the kept one cannot be scaled to: recompute below
        grads = loss_gradients(hidden, weight, bias, targets, lse, smoothing, grad, grad_lse, opts, need_dh,
                               need_dw, need_db and bias is not None)
        dh, dw, db = finish_gradients(grads, None, hidden, weight, bias, opts)
        return (dh if need_dh else None, dw if need_dw else None, db if need_db else None) + rest


def _uniform_ratio(grad: torch.Tensor, token_weight: torch.Tensor) -> float | None:
    """c if ``grad == c * token_weight`` on every token of non-zero weight, else None (one host sync)."""
    sel = token_weight != 0
    ratio = grad / torch.where(sel, token_weight, 1.0)
    big = torch.finfo(torch.float32).max
    lo = torch.where(sel, ratio, big).min()
    hi = torch.where(sel, ratio, -big).max()
    lo, hi = torch.stack([lo, hi]).tolist()
    if lo > hi:  # no token with weight: the kept gradients are zero whatever c is
        return 1.0
    return lo if lo == hi else None


def _validate_options(z_loss, return_lse, memory, process_group) -> str:
    """The options' checks; returns ``memory`` as ``budget.check_memory`` gives it."""
    if isinstance(z_loss, bool) or not isinstance(z_loss, numbers.Real) or not (
            math.isfinite(float(z_loss)) and z_loss >= 0):
        raise ValueError(f"z_loss must be a finite number >= 0 (the coefficient of lse^2), got {z_loss!r}.")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be True or False, got {return_lse!r}.")
    memory = check_memory(memory)
    if process_group is not None and (return_lse or memory != "auto"):
        raise ValueError("return_lse and a memory budget other than 'auto' are not available with process_group.")
    return memory


class _Targets(NamedTuple):
    """The targets as the kernels take them (``_prepare_targets``), per flattened token."""

    ids: torch.Tensor  # int64, -1 where ignored (and for a target past the vocabulary, which the checks refuse)
    smoothing: torch.Tensor  # fp32 b per token
    weight: torch.Tensor | None  # the reduction's weight per token from prepare's kernel (None: from valid and denom)
    valid: torch.Tensor | None  # bool, where the torch preparation computed it
    denom: torch.Tensor | None  # the reduction's divisor (None: a sum, or no reduction)
    bad: torch.Tensor | None  # the device checks' flag: a bad batch gets a NaN loss and no gradient


def _autocast_inputs(hidden, weight, bias):
    """What F.linear would do under autocast: hidden, weight and bias in the autocast dtype."""
    if not (torch.is_tensor(hidden) and torch.is_autocast_enabled(hidden.device.type)):
        return hidden, weight, bias
    dt = torch.get_autocast_dtype(hidden.device.type)
    return tuple(t.to(dt) if torch.is_tensor(t) and t.dtype != dt else t for t in (hidden, weight, bias))


def _prepare_targets(h2, targets, label_smoothing, ignore_index, vocab, shift, num_items_in_batch, reduction,
                     fast: bool) -> _Targets:
    """The flat ids, smoothing, weights, the reduction's divisor and the device values' checks: one launch
    (prepare.py) with ``fast`` (the Triton backend on one device; not fp64, empty or traced), else torch operations
    (checks.py)."""
    n, dtype = h2.shape[0], h2.dtype
    # The reduction's divisor of the summed token losses (None: the sum itself, or no reduction).
    divide = reduction == "mean" or (reduction == "sum" and num_items_in_batch is not None)
    if fast and n and dtype != torch.float64 and not compiling():
        from .prepare import prepare

        ids, b1, weight, values, divisor, bad = prepare(
            targets, label_smoothing, ignore_index, vocab, shift, num_items_in_batch, divide)
        bad = check_summary(values, bad, vocab, ignore_index, num_items_in_batch)
        return _Targets(ids, b1, weight, None, divisor if divide else None, bad)
    smoothing, shifted = label_smoothing, targets
    if shift:
        shifted = F.pad(targets, (0, 1), value=ignore_index)[..., 1:]
        if torch.is_tensor(smoothing) and smoothing.dim():
            smoothing = F.pad(smoothing, (0, 1), value=0.0)[..., 1:]
    ids = shifted.reshape(-1).to(torch.int64)
    ids = torch.where((ids == ignore_index) | (ids >= vocab), torch.full_like(ids, -1), ids).contiguous()
    valid = ids >= 0
    valid_count = valid.sum()
    if torch.is_tensor(smoothing):
        b1 = smoothing.detach().to(torch.float32).expand(targets.shape).reshape(-1).contiguous()
    else:
        b1 = torch.full((n,), float(smoothing), dtype=torch.float32, device=h2.device)
    b_given = smoothing if torch.is_tensor(smoothing) else None
    if compiling():  # an operator the compiled graph calls, so the checks run (and can raise) at every call
        items = num_items_in_batch if torch.is_tensor(num_items_in_batch) else None
        items_value = None if items is not None or num_items_in_batch is None else float(num_items_in_batch)
        bad = check_values(targets, vocab, ignore_index, items, items_value, valid_count, b_given)
    else:
        bad = check_device_values(targets, vocab, ignore_index, num_items_in_batch, valid_count, b_given)
    if bad is not None and torch.is_tensor(smoothing):
        b1 = b1.nan_to_num(0.0).clamp(0.0, 1.0)  # bad b clamped while its error waits for the next call
    denom = None
    if divide:
        denom = loss_denominator(num_items_in_batch, valid_count,
                                 torch.float64 if dtype == torch.float64 else torch.float32)
    return _Targets(ids, b1, None, valid, denom, bad)


def _losses(h2, weight, bias, tg: _Targets, shard, opts: Options | None, softcap, backend, z_loss, memory: str,
            return_stats, return_lse, observed_b, training: bool):
    """(loss, lse, argmax, nll, entropy) by the vocabulary-parallel head, the compiled operators (compiled.py, while
    Dynamo traces) or the eager autograd function (``opts``); the loss reduced (``opts.reduce``) or per token, NaN
    where the device checks failed."""
    reduce = opts.reduce
    lse = argmax = nll = entropy = None
    bad = tg.bad
    with torch.autocast(h2.device.type, enabled=False):
        if shard is not None:
            from .vocab_parallel import vocab_parallel_token_losses

            loss = vocab_parallel_token_losses(h2, weight, bias, tg.ids, tg.smoothing, opts, shard)
            if reduce:
                loss = loss.sum() if tg.denom is None else loss.sum() / tg.denom
        elif compiling() and reduce and training and not return_lse:
            # a reduced training loss: the gradients computed in the forward, as eagerly (no second logits pass)
            token_weight = tg.valid.float() if tg.denom is None else tg.valid.float() / tg.denom
            loss, lse, argmax, nll, entropy = reduced_loss(
                h2, weight, bias, tg.ids, tg.smoothing, token_weight, tg.denom, softcap, backend, float(z_loss),
                return_stats, memory, observed_b)
        elif compiling():
            loss, lse, argmax, nll, entropy = token_losses(
                h2, weight, bias, tg.ids, tg.smoothing, softcap, backend, float(z_loss), return_stats, memory,
                training, observed_b)
            if reduce:
                loss = loss.sum() if tg.denom is None else loss.sum() / tg.denom
        else:
            token_weight = None
            if training:  # the weighting the reduction gives each token's loss (the gradients the forward computes);
                # all 0 where a check failed (prepare's kernel too), so the NaN loss passes no gradient
                token_weight = tg.weight
                if token_weight is None:
                    token_weight = tg.valid.float() if tg.denom is None else tg.valid.float() / tg.denom
                    token_weight = token_weight if bad is None else torch.where(bad, 0.0, token_weight)
            loss, lse, argmax, nll, entropy = _LinearCrossEntropy.apply(h2, weight, bias, tg.ids, tg.smoothing,
                                                                        token_weight, tg.denom, bad, opts)
            bad = None  # (the NaN loss: applied by the forward)
        if bad is not None:
            loss = torch.where(bad, float("nan"), loss)
    return loss, lse, argmax, nll, entropy


def _outputs(loss, lse, argmax, nll, entropy, tg: _Targets, shape, reduce: bool, return_stats, return_lse):
    """The loss (per token in ``shape`` unless reduced), then the statistics and the lse where asked (copies: the
    saved lse stays the op's own)."""
    out = [loss if reduce else loss.reshape(shape)]
    if return_stats:
        valid = tg.ids >= 0 if tg.valid is None else tg.valid
        out.append(LCEStats(lse.detach().clone().reshape(shape), argmax.reshape(shape), nll.reshape(shape),
                            entropy.reshape(shape), valid.reshape(shape)))
    if return_lse:
        out.append(lse.clone().reshape(shape))
    return out[0] if len(out) == 1 else tuple(out)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    label_smoothing: float | torch.Tensor = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    softcap: float | None = None,
    shift: bool = False,
    num_items_in_batch: int | torch.Tensor | None = None,
    return_stats: bool = False,
    backend: str = "auto",
    process_group=None,
    z_loss: float = 0.0,
    return_lse: bool = False,
    memory: str | int = "auto",
):
    """Label-smoothed cross-entropy of ``hidden @ weight.T (+ bias)`` without materialising logits.

    Equals ``F.cross_entropy(z.float(), targets, label_smoothing=b, ignore_index=..., reduction=...)``
    with ``z = hidden @ weight.T + bias`` (soft-capped as ``softcap * tanh(z / softcap)`` if given), plus
    ``z_loss * lse^2`` per token when asked.

    Args:
        hidden: (..., D) float16 / bfloat16 / float32 / float64 hidden states.
        weight: (V, D) output embedding (the LM head), same dtype and device.
        targets: (...) integer token ids in [0, V), or ``ignore_index``.
        bias: optional (V,) bias of the LM head.
        label_smoothing: b in [0, 1], a float or a tensor of the shape of ``targets`` (per token;
            treated as a constant, no gradient). With ``shift=True`` it is shifted like ``targets``.
        ignore_index: target value whose tokens take no part (loss 0, gradient 0).
        reduction: ``"mean"`` (over non-ignored tokens), ``"sum"`` or ``"none"`` (shape of targets).
        softcap: Gemma-2 style logit soft-capping.
        shift: shift like Hugging Face causal LMs: position t predicts ``targets[..., t + 1]``
            (the last position is ignored). The sequence is the second-to-last dimension of hidden.
        num_items_in_batch: if given, the loss is ``sum / num_items_in_batch`` (Hugging Face's
            convention under gradient accumulation): a whole number, not 0 when some token carries a loss.
        return_stats: also return :class:`LCEStats` (per-token lse, argmax, nll, entropy, valid; no gradient).
        backend: ``"auto"`` (Triton kernels on CUDA, chunked torch elsewhere), ``"triton"``
            (also on CPU under ``TRITON_INTERPRET=1``) or ``"torch"``.
        process_group: vocabulary-parallel (tensor-parallel) LM head. ``weight`` (and ``bias``) is
            this rank's contiguous shard of the vocabulary, shards in rank order (what
            ``ColwiseParallel`` / ``torch.chunk(dim=0)`` gives); ``hidden`` and ``targets`` (full
            vocabulary ids) are the same on every rank. The log-sum-exp, target logit and sum of
            logits are reduced across the group (max and sum all-reduces); every rank returns the
            full loss, ``dW`` is its shard's, and ``dhidden`` is all-reduced. ``return_stats``,
            ``return_lse`` and a ``memory`` other than ``"auto"`` are not available with it.
        z_loss: coefficient lam of the z-loss ``lam * lse^2`` added to each token's loss (PaLM; Liger's
            ``lse_square_scale``), with its gradient ``2 lam lse p``.
        return_lse: also return the per-token log-sum-exp (shape of targets, fp32), differentiable: a loss
            built on it back-propagates (through the recomputing backward).
        memory: the memory budget of a training call, beyond its inputs and the gradients it returns: ``"auto"``
            (the fastest computation that fits the GPU's free memory, at most 4.5 GB unless the
            smallest plan needs more; the default), ``"low"`` (about
            180 MB, or the least with 32 MiB chunks where a head needs more), or a number of bytes: the fastest
            computation within it (docs/how_it_works.md). A budget below what the shape needs (an fp32 ``4 N D`` accumulator and a
            chunk), or one the GPU cannot hold, is a ``ValueError`` that names the smallest that works.

    Returns:
        The loss (float32; float64 for float64 inputs), then the stats if ``return_stats``, then the lse if
        ``return_lse``. All-ignored or empty inputs give a loss of 0 and zero gradients, never NaN.
    """
    hidden, weight, bias = _autocast_inputs(hidden, weight, bias)
    shard = None
    if process_group is not None:
        from .vocab_parallel import vocab_shard

        shard = vocab_shard(weight, process_group, return_stats)
    _validate(hidden, weight, targets, bias, label_smoothing, ignore_index, reduction, softcap,
              num_items_in_batch, backend, shift, return_stats)
    memory = _validate_options(z_loss, return_lse, memory, process_group)
    backend = _resolve_backend(backend, hidden.device)
    if bias is not None and bias.stride(0) != 1:  # (V elements: a copy costs nothing; the kernels then read it densely)
        bias = bias.contiguous()
    if shift and hidden.dim() < 2:
        raise ValueError("shift=True needs hidden of shape (..., T, D).")
    h2 = hidden.reshape(-1, weight.shape[1])
    observed_b = None if torch.is_tensor(label_smoothing) else float(label_smoothing)
    need = [t is not None and t.requires_grad for t in (h2, weight, bias)]
    grad_wanted = torch.is_grad_enabled() and any(need)
    training = grad_wanted and shard is None  # (the gradients computed in the forward)
    opts = None
    if shard is not None or not compiling():  # (traced: the operators resolve theirs when the graph runs)
        # before any kernel runs: a budget no computation fits is refused here
        opts = options(h2, weight, bias, softcap, backend, z_loss, memory, training, need[1], need[2],
                       need_stats=return_stats, reduce=reduction != "none", smoothed=observed_b != 0.0)
    tg = _prepare_targets(h2, targets, label_smoothing, ignore_index, shard.vocab_size if shard else weight.shape[0],
                          shift, num_items_in_batch, reduction, fast=shard is None and backend == "triton")
    loss, lse, argmax, nll, entropy = _losses(h2, weight, bias, tg, shard, opts or Options(softcap, backend,
                                              reduce=reduction != "none"), softcap, backend, z_loss, memory,
                                              return_stats, return_lse, observed_b, training)
    if grad_wanted and not compiling():  # (traced: the operator notifies when the graph runs)
        notify_training_call(observed_b)
    return _outputs(loss, lse, argmax, nll, entropy, tg, targets.shape, reduction != "none", return_stats, return_lse)
