"""Which computation a call takes and what it runs: the statistics, a training call's statistics and gradients (in
the forward), the recomputing backward. Shared by the eager op and the compiled one (``compiled.py``).

Two computations, both exact: the fused one (``fused_pass.py``: bf16 and fp16 where Triton's dots are tensor-core MMA,
torch >= 2.9, soft-caps up to ``fused_pass.SOFTCAP_MAX``; the interpreter), in the layout the memory budget allows
(``budget.py``); the chunked torch computation (``reference.py``) for everything else. The budget (``memory=``):
``"auto"`` (CUDA's free memory over ``budget.HEADROOM``, at most ``budget.AUTO_MAX_BYTES``; read only where the
fastest plan exceeds ``SMALL_BUFFER_FRACTION`` of the device, the query costing host time), ``"low"`` or bytes; one
no plan fits, or the device cannot hold, is a ``ValueError`` before any kernel runs.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from . import budget as bud
from .reference import torch_pass

MEMORY_MODES = ("auto", "low")
# memory="auto" reads CUDA's free memory only where the fastest plan (times the headroom) exceeds this fraction of the
# device's memory; below it the plan is taken to fit, as any other allocation of the step is
SMALL_BUFFER_FRACTION = 1 / 32


@dataclass(frozen=True)
class Options:
    """How a call runs (``options``)."""

    softcap: float | None
    backend: str
    computation: str = "torch"  # "fused" or "torch"
    plan: bud.Plan | None = None  # the training plan, and the torch computation's chunk (None: the default chunk)
    z_loss: float = 0.0
    need_stats: bool = False
    reduce: bool = False  # the first output is the reduced loss (sum / denom), not per-token losses
    smoothed: bool = True  # False: b = 0 for every token (a float 0), so the fused pass skips dW's rank-one term


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


def check_memory(memory) -> str:
    """``memory`` validated (``"auto"``, ``"low"`` or a positive number of bytes), as the string the compiled
    operators take; a ``ValueError`` / ``TypeError`` naming it otherwise."""
    if isinstance(memory, str):
        if memory in MEMORY_MODES:
            return memory
        if memory == "fast":
            raise ValueError("memory='fast' was retired in 1.0: memory='auto' (the default) takes the fastest "
                             "computation that fits the GPU's free memory; pass a number of bytes to cap it.")
        raise ValueError(f"memory must be 'auto', 'low' or a number of bytes, got {memory!r}.")
    if isinstance(memory, bool) or not isinstance(memory, numbers.Real):
        raise TypeError(f"memory must be 'auto', 'low' or a number of bytes, got {memory!r} "
                        f"({type(memory).__name__}).")
    if not (memory == memory and memory not in (float("inf"), float("-inf")) and memory > 0):
        raise ValueError(f"memory={memory!r}: a budget is a positive number of bytes (e.g. 2e9), 'auto' or 'low'.")
    return str(int(memory))


def computation(hidden, weight, softcap, backend) -> str:
    """``"fused"`` where the fused computation runs these inputs (``fused_pass.supported``), else ``"torch"``."""
    from .config import fused_config, interpreting

    if backend != "triton" or not (hidden.is_cuda or interpreting()):
        return "torch"
    from .fused_pass import supported

    return "fused" if supported(hidden, weight, softcap, fused_config(hidden.dtype, hidden.device)) else "torch"


def shape_of(hidden, weight, bias, softcap, comp: str, need_dw: bool, need_db: bool) -> bud.Shape:
    """The planner's view of a call (``budget.Shape``), with the fused kernel's blocks on its device."""
    kw = {}
    if comp == "fused":
        from .config import fused_config

        cfg = fused_config(hidden.dtype, hidden.device)
        kw = dict(block_n=cfg.block_n, block_v=cfg.block_v, programs=cfg.min_programs)
    return bud.Shape(hidden.shape[0], weight.shape[0], weight.shape[1], need_dw, need_db and bias is not None,
                     half=hidden.dtype == torch.float16, soft=softcap is not None,
                     item=8 if hidden.dtype == torch.float64 else 4,
                     cast=hidden.dtype in (torch.float16, torch.bfloat16), **kw)


def _head(s: bud.Shape) -> str:
    return f"{s.n} tokens, a {s.v:,} x {s.d} head{'' if s.need_dw else ' (frozen)'}"


def plan_for(s: bud.Shape, comp: str, memory: str, device: torch.device) -> bud.Plan:
    """The fastest plan of ``comp`` within the budget ``memory`` (``check_memory``'s string), or a ``ValueError``
    naming ``memory``, the value and the smallest budget that works (also where the device cannot hold the plan)."""
    from .config import device_memory, free_cuda_memory

    cuda = device.type == "cuda"
    if memory == "low":
        return bud.best(s, bud.low_budget(s, comp), comp)
    if memory == "auto":  # (the cap never below the smallest plan: a large step is limited by free memory only)
        cap = max(bud.AUTO_MAX_BYTES, bud.smallest(s, comp)) if cuda else None
        plan = bud.best(s, cap, comp)
        if not cuda or bud.HEADROOM * plan.nbytes <= SMALL_BUFFER_FRACTION * device_memory(device):
            return plan
        free = free_cuda_memory(device)
        plan = bud.best(s, min(int(free / bud.HEADROOM), cap), comp)
        if plan is None:
            least = bud.smallest(s, comp)
            raise ValueError(f"memory='auto': the GPU has {bud.describe(free)} free, and the op needs at least "
                             f"{least:,} bytes ({bud.describe(least)}) beside it at {_head(s)}: free memory or lower "
                             f"the batch.")
        return plan
    plan = bud.best(s, int(memory), comp)
    if plan is None:
        least = bud.smallest(s, comp)
        raise ValueError(f"memory={memory}: below what the op needs at {_head(s)}; the smallest budget that works "
                         f"is {least:,} bytes ({bud.describe(least)}); pass at least that, or memory='low' "
                         f"({bud.describe(bud.low_budget(s, comp))}).")
    if cuda and plan.nbytes > SMALL_BUFFER_FRACTION * device_memory(device):
        free = free_cuda_memory(device)
        if plan.nbytes > free:
            raise ValueError(f"memory={memory}: its plan takes {plan.nbytes:,} bytes ({bud.describe(plan.nbytes)}) "
                             f"but the GPU has {bud.describe(free)} free; pass memory='auto' or at most {free:,}.")
    return plan


def options(hidden, weight, bias, softcap, backend, z_loss, memory, training: bool, need_dw: bool, need_db: bool,
            need_stats=False, reduce=False, smoothed=True) -> Options:
    """How a call runs: the computation and, for a training call (or the torch computation's chunks), the plan."""
    comp = computation(hidden, weight, softcap, backend) if hidden.shape[0] else "torch"
    plan = None
    if hidden.shape[0] and (training or comp == "torch"):
        s = shape_of(hidden, weight, bias, softcap, comp, need_dw and training, need_db and training)
        plan = plan_for(s, comp, memory, hidden.device)
    return Options(softcap=softcap, backend=backend, computation=comp, plan=plan, z_loss=float(z_loss),
                   need_stats=need_stats, reduce=reduce, smoothed=smoothed)


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
    s = shape_of(hidden, weight, bias, opts.softcap, "fused", need_dw, need_db)
    cols = bud.recompute_cols(s, opts.plan.nbytes if opts.plan else None)
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


def finish_gradients(grads, c, hidden, weight, bias, opts: Options | None = None) -> tuple:
    """Gradients ``(dh, dw, db, gamma)`` times the upstream factor ``c`` (a one-element tensor; None: 1) and gamma,
    in the inputs' dtypes, rounded once (``matmul.scale_by``; the torch computation's by torch)."""
    from .matmul import scale_by

    *grads, gamma = grads
    return tuple(scale_by(grads, c, (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None), gamma,
                          interpreted=opts is None or opts.computation == "fused"))
