"""The training paths: which one a call takes, and the statistics and gradients each computes.

Shared by the eager op (``linear_cross_entropy._LinearCrossEntropy``) and the compiled one (``compiled.py``), so
that neither imports the other for them. Every path is exact:

* fused (``fused_pass.py``): one logits pass whose kernel stores ``exp(z - c)`` in bf16, the gradients from it by
  cuBLAS, on a GPU whose Triton dots are tensor-core MMA (compute capability 8.0 and newer: ``KernelConfig.mma_dot``);
  bf16 with soft-caps up to ``fused_pass.SOFTCAP_MAX`` and z-loss included, fp16 without a soft-cap
  (``fused_pass.online``); a bf16 frozen head by chunks of vocabulary columns
  (``fused_pass.triton_fused_columns``), ``memory="low"`` included, unless soft-capped;
* two-pass (``backward.triton_gradients_by_columns``): the fused kernel's statistics for the lse, then the logits
  recomputed on chip and G written a chunk of vocabulary columns at a time; also ``memory="low"`` wherever dW or db
  is needed, the logits are soft-capped or the fused pass cannot run, with small chunks, on every device;
* one-pass (``train_pass.py``): fp32 logits from cuBLAS a chunk of rows at a time, read twice; fp32 inputs and every
  other case (above D = 1,024: a bf16 trainable head whose every-row R does not fit, soft-caps the fused path does not
  take; the interpreter's CPU runs).

fp16 inputs on the one-pass, two-pass and recomputing paths: their G writers take the token weights divided by a power
of two and scale the gradients back (``matmul.fp16_weights``), so that G keeps fp16's digits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import free_cuda_memory
from .dispatch import cublas_logits, dense_backward, forward_stats


@dataclass(frozen=True)
class Options:
    """How the op runs (resolved by ``training_options``)."""

    softcap: float | None
    backend: str
    z_loss: float = 0.0
    memory: str = "fast"
    accum_dtype: torch.dtype | None = None
    need_stats: bool = False
    # training: "one-pass" (train_pass), "two-pass" (two_pass_gradients; memory="low" too) or "fused" (fused_pass; a
    # frozen head by vocabulary columns in every memory mode; under memory="low" dW or db take two passes:
    # _fused_gradients)
    path: str = "one-pass"
    reduce: bool = False  # the first output is the reduced loss (sum / denom), not per-token losses
    smoothed: bool = True  # False: b = 0 for every token (a float 0), so the fused pass skips dW's rank-one term
    free_bytes: int | None = None  # CUDA's free memory when memory="auto" resolved (fused layout, low chunk)


MEMORY_MODES = ("auto", "fast", "low")

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
    them), every other route from its statistics here (``token_loss_terms``)."""
    if len(stats) == 7:
        return stats[5], stats[6]
    lse, zy, sz = stats[:3]
    return token_loss_terms(lse, zy, sz, smoothing, targets >= 0, vocab_size, z_loss)


def use_train_pass(hidden, weight, bias, backend) -> bool:
    """A training path runs (gradients computed in the forward): Triton backend, gradients needed, and fp32 logits
    obtainable from cuBLAS (see ``train_pass.supported``)."""
    if backend != "triton" or hidden.shape[0] == 0:
        return False
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))):
        return False
    from .train_pass import supported

    return supported(hidden)


def _train_path(hidden, weight, softcap, z_loss, accum_dtype, free_bytes=None) -> str:
    """The training path: ``config.TRAIN_PATH`` where it can run; off CUDA the one-pass path; on CUDA
    ``cuda_path``'s choice. ``free_bytes``: CUDA's free memory (``memory="auto"``), which the fused path's every-row
    layout must fit."""
    from . import config

    can = {"fused": _fused_runs(hidden, weight, softcap, z_loss),
           "two-pass": accum_dtype in (None, weight.dtype), "one-pass": True}
    if config.TRAIN_PATH is not None and can[config.TRAIN_PATH]:
        return config.TRAIN_PATH
    if not hidden.is_cuda:
        return "one-pass"
    mma = config.fused_config(hidden.dtype, hidden.device).mma_dot
    return cuda_path(*hidden.shape, weight.shape[0], hidden.dtype, weight.requires_grad, can["fused"],
                     can["two-pass"] and mma, free_bytes)


def cuda_path(n: int, d: int, v: int, dtype, need_dw: bool, fused_runs: bool, two_pass_runs: bool,
              free_bytes=None) -> str:
    """The training path on CUDA: the fused path where it can run (``fused_pass.supported``) and is preferred
    (``fused_pass.preferred``; fp16 always: the other paths write G = w (p - y) in fp16, whose weight 1 / N puts
    most of it below fp16's normal range, dh 0.39-0.42 off fp64 where the fused path's is 4.7-5.4e-3, H100,
    N = 8,192, Llama-3-8B and Gemma2-2B heads); else, in half precision up to hidden size ``config.TWO_PASS_MAX_D``,
    the two-pass path (dW written once per row there; not on GPUs whose Triton dots are FMA, ``KernelConfig.mma_dot``:
    Turing and Volta take the one-pass path's cuBLAS); otherwise the one-pass path, fp32 inputs at every D: their
    two-pass logits are Triton's fp32 dots, 2.9-3.9 x the one-pass path's cuBLAS (H100, N = 8,192, Gemma-3-270m and
    Llama-3-8B heads: 494 against 168 ms, 1,372 against 355; docs/how_it_works.md)."""
    from . import config
    from .fused_pass import preferred

    if fused_runs and (dtype == torch.float16 or preferred(n, v, d, need_dw, free_bytes)):
        return "fused"
    if d <= config.TWO_PASS_MAX_D and two_pass_runs and dtype != torch.float32:
        return "two-pass"
    return "one-pass"


def _fused_runs(hidden, weight, softcap, z_loss) -> bool:
    """Whether the fused pass can run these inputs (``fused_pass.supported``, with ``config.fused_config``)."""
    from . import config
    from .fused_pass import supported

    cfg = config.fused_config(hidden.dtype, hidden.device) if hidden.is_cuda or config.interpreting() else None
    return cfg is not None and supported(hidden, weight, softcap, z_loss, cfg)


def training_options(hidden, weight, softcap, backend, z_loss, memory, accum_dtype, one_pass, need_stats=False,
                     reduce=False, smoothed=True) -> Options:
    """How a call runs, from the validated arguments: for training, the fused, two-pass or one-pass path, and the
    memory mode (``"auto"`` resolved against CUDA's free memory; ``"low"`` runs the two-pass path's computation).
    The free memory is read (once) only where the path's buffers exceed ``SMALL_BUFFER_FRACTION`` of
    the device's memory: the query costs host time every call, and a small model's step pays it (host_overhead.py)."""
    free = None
    path = _train_path(hidden, weight, softcap, z_loss, accum_dtype) if one_pass else "one-pass"
    if memory == "auto" and one_pass and hidden.device.type == "cuda" and not _small_buffers(
            hidden, weight, accum_dtype, path):
        free = free_cuda_memory(hidden.device)
        path = _train_path(hidden, weight, softcap, z_loss, accum_dtype, free)
    mem = _resolve_memory(memory, one_pass, hidden, weight, accum_dtype, path, free)
    if mem == "low":  # the fused pass's statistics and a frozen head's columns where it runs (see _fused_gradients)
        from .fused_pass import online

        path = "fused" if (one_pass and softcap is None and not online(hidden)
                           and _fused_runs(hidden, weight, softcap, z_loss)) else "two-pass"
    return Options(softcap=softcap, backend=backend, z_loss=float(z_loss), memory=mem, accum_dtype=accum_dtype,
                   need_stats=need_stats, path=path, reduce=reduce, free_bytes=free, smoothed=smoothed)


# memory="auto" reads CUDA's free memory only where the fast path's buffers (times the headroom) exceed this fraction
# of the device's memory; below it they are taken to fit, as any other allocation of the step is
SMALL_BUFFER_FRACTION = 1 / 32


def _buffer_bytes(hidden, weight, accum_dtype, path, free=None) -> int:
    """Bytes of the fast path's buffers: R for the fused path (every row if it fits, else a chunk and dW's fp32
    accumulator), one chunk of fp32 logits otherwise, and an fp32 dW accumulator where asked for."""
    from .config import TRAIN_CHUNK_BYTES
    from .fused_pass import extra_memory, online

    n, (v, d) = hidden.shape[0], weight.shape
    if path == "fused":
        need = extra_memory(n, v, d, weight.requires_grad, free, half_range=online(hidden))
    else:
        need = min(n, max(1, TRAIN_CHUNK_BYTES // (v * 4))) * v * 4
    if accum_dtype == torch.float32 and weight.dtype != torch.float32 and path != "fused":
        need += v * d * 4
    return need


def _small_buffers(hidden, weight, accum_dtype, path) -> bool:
    from .config import MEMORY_HEADROOM, device_memory

    return MEMORY_HEADROOM * _buffer_bytes(hidden, weight, accum_dtype, path) <= (
        SMALL_BUFFER_FRACTION * device_memory(hidden.device))


def _resolve_memory(memory, one_pass, hidden, weight, accum_dtype, path="one-pass", free=None) -> str:
    """'auto': the low-memory path when CUDA's free memory (``free``, read by ``training_options``; None: the
    buffers are small, taken to fit) cannot hold the fast path's buffers."""
    if memory != "auto":
        return memory
    if not one_pass or hidden.device.type != "cuda" or free is None:
        return "fast"
    from .config import MEMORY_HEADROOM

    return "low" if free < MEMORY_HEADROOM * _buffer_bytes(hidden, weight, accum_dtype, path, free) else "fast"


def statistics_and_gradients(hidden, weight, bias, targets, smoothing, token_weight, opts, need_dh, need_dw,
                             need_db):
    """The training paths' forward: (statistics, (dh, dw, db, gamma)): the gradients of ``sum_n token_weight_n
    loss_n`` are gamma times dh, dw and db (gamma None but for fp16, multiplied back where backward casts them:
    ``finish_gradients``), by the path ``opts`` names (fused, two-pass, or the one-pass
    ``train_pass``)."""
    if opts.path == "fused":
        return _fused_gradients(hidden, weight, bias, targets, smoothing, token_weight, opts, need_dh, need_dw, need_db)
    if opts.path == "two-pass":
        stats = statistics(hidden, weight, bias, targets, opts, smoothing)
        return stats, two_pass_gradients(hidden, weight, bias, targets, smoothing, token_weight, stats[0], opts,
                                         need_dh, need_dw, need_db)
    from .train_pass import triton_train_pass

    stats, *grads = triton_train_pass(
        hidden, weight, bias, targets, smoothing, token_weight, opts.softcap, need_dh=need_dh, need_dw=need_dw,
        need_db=need_db, z_loss=opts.z_loss, accum_dtype=opts.accum_dtype)
    return stats, tuple(grads)


def statistics(hidden, weight, bias, targets, opts, smoothing=None):
    """The per-token statistics alone (``dispatch.forward_stats``), within the low-memory mode's budget there; with
    ``smoothing``, where the fused kernel gives them, the tokens' losses too (``loss_terms``)."""
    return forward_stats(hidden, weight, bias, targets, opts.softcap, opts.backend, stats=opts.need_stats,
                         low_memory=opts.memory == "low", free_bytes=opts.free_bytes, smoothing=smoothing,
                         z_loss=opts.z_loss)


def recompute_kept(hidden, weight, bias, targets, smoothing, token_weight, lse, opts, need_dh, need_dw, need_db):
    """The training path's gradients again, by the same computation as the forward's (a second backward, or the
    compiled backward of per-token losses): (dh, dw, db, gamma), as ``statistics_and_gradients``."""
    if opts.path == "fused":
        return _fused_gradients(hidden, weight, bias, targets, smoothing, token_weight, opts, need_dh, need_dw,
                                need_db, lse)[1]
    if opts.path == "two-pass":
        return two_pass_gradients(hidden, weight, bias, targets, smoothing, token_weight, lse, opts, need_dh, need_dw,
                                  need_db)
    return statistics_and_gradients(hidden, weight, bias, targets, smoothing, token_weight, opts, need_dh, need_dw,
                                    need_db)[1]


def finish_gradients(grads, c, hidden, weight, bias) -> tuple:
    """A path's gradients ``(dh, dw, db, gamma)`` (None entries pass) times the upstream factor ``c`` (a one-element
    fp32 tensor; None: 1) and gamma (fp16's: ``matmul.fp16_weights``), in the inputs' dtypes, rounded once: a pass over
    each at most (``train_pass.scale_by``; fp16's are kept in fp32 until here, ``matmul.kept_dtype``)."""
    from .train_pass import scale_by

    *grads, gamma = grads
    return tuple(scale_by(grads, c, (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None), gamma))


def loss_gradients(hidden, weight, bias, targets, lse, smoothing, grad, grad_lse, opts, training_path: bool,
                   need_dh, need_dw, need_db):
    """(dh, dw, db, gamma): gamma (None: 1) times dh, dw and db are the gradients of ``sum_n grad_n loss_n
    (+ grad_lse_n lse_n)``, exact: ``training_path`` (and no lse gradient)
    by the training path ``opts`` names, with ``grad`` as the token weights; otherwise the recomputing dense
    backward (``dispatch.dense_backward``: through cuBLAS's logits where Triton's dots are FMA, fp32, Turing,
    Volta)."""
    if training_path and grad_lse is None:
        return recompute_kept(hidden, weight, bias, targets, smoothing, grad.float(), lse, opts, need_dh, need_dw,
                              need_db)
    extra = None
    if opts.z_loss or grad_lse is not None:  # extra_n p_n on the logits' gradient
        extra = torch.zeros_like(grad, dtype=torch.float32)
        if opts.z_loss:
            extra = extra + grad.float() * (2.0 * opts.z_loss) * lse.float()
        if grad_lse is not None:
            extra = extra + grad_lse.float()
        extra = extra.contiguous()
    return dense_backward(hidden, weight, bias, targets, lse, grad.float().contiguous(),
                          smoothing.float().contiguous(), opts.softcap, opts.backend, need_dh=need_dh,
                          need_dw=need_dw, extra=extra)


def _fused_gradients(hidden, weight, bias, targets, smoothing, token_weight, opts, need_dh, need_dw, need_db,
                     lse=None):
    """The fused training path (``fused_pass``): statistics and gradients from one logits pass whose kernel stores
    the shifted exponentials; ``(stats, (dh, dw, db, gamma))`` (``statistics_and_gradients``). A frozen head goes by
    vocabulary columns (``fused_pass.triton_fused_columns``). Under ``memory="low"`` dW or db need every row's
    normalisation before a chunk's product: the fused pass gives the statistics alone (no R stored; ``lse`` given, as
    a second backward has it: none) and the two-pass computation the gradients."""
    from .config import fused_config, low_memory_chunk_bytes
    from .fused_pass import frozen_chunk_bytes, online, triton_fused_columns, triton_fused_pass

    cfg = fused_config(hidden.dtype, hidden.device)
    (n, d), v = hidden.shape, weight.shape[0]
    if opts.memory == "low" and (need_dw or need_db):
        stats = None
        if lse is None:  # (the fused kernel's statistics: dispatch.forward_stats)
            stats = statistics(hidden, weight, bias, targets, opts, smoothing)
            lse = stats[0]
        return stats, two_pass_gradients(hidden, weight, bias, targets, smoothing, token_weight, lse, opts, need_dh,
                                         need_dw, need_db)
    chunk = None
    if not (need_dw or need_db or opts.softcap or online(hidden)):  # a frozen head: by vocabulary columns (unless
        # their accumulator is large); not soft-capped, whose G needs each row's normalisation before its product, nor
        # fp16, whose R is normalised per row (fused_pass.online)
        chunk = (low_memory_chunk_bytes(n, d, opts.free_bytes) if opts.memory == "low"
                 else frozen_chunk_bytes(n, v, d, opts.free_bytes))
    if chunk is not None:
        stats, *grads = triton_fused_columns(hidden, weight, bias, targets, smoothing, token_weight, cfg, chunk,
                                             need_stats=opts.need_stats, z_loss=opts.z_loss)
        return stats, tuple(grads)
    stats, *grads = triton_fused_pass(hidden, weight, bias, targets, smoothing, token_weight, cfg, need_dh=need_dh,
                                      need_dw=need_dw, need_db=need_db, need_stats=opts.need_stats,
                                      free_bytes=opts.free_bytes, z_loss=opts.z_loss, softcap=opts.softcap,
                                      smoothed=opts.smoothed)
    return stats, tuple(grads)


def two_pass_gradients(hidden, weight, bias, targets, smoothing, token_weight, lse, opts, need_dh, need_dw, need_db):
    """The two-pass training path's gradients of ``sum_n token_weight_n loss_n``, given the statistics' lse:
    the logits recomputed tile by tile on chip, G = dL/dz written in the input dtype a chunk of vocabulary columns
    at a time (1 GiB; ``memory="low"``: ``config.low_memory_chunk_bytes``), dW (one rounding) and dh (fp32
    accumulator) from cuBLAS (``backward.triton_gradients_by_columns``). One more logits matmul than the one-pass
    path, but no fp32 logits in memory: where D is small the fp32 traffic, not the matmuls, sets the one-pass path's
    time. Returns (dh, dw, db, gamma), as ``statistics_and_gradients``."""
    from .backward import triton_gradients_by_columns
    from .config import grad_logits_config, low_memory_chunk_bytes

    extra = token_weight * (2.0 * opts.z_loss) * lse if opts.z_loss else None
    return triton_gradients_by_columns(hidden, weight, bias, targets, lse, token_weight, smoothing, opts.softcap,
                                       grad_logits_config(hidden.dtype, hidden.device), need_dh=need_dh,
                                       need_dw=need_dw, need_db=need_db, extra=extra,
                                       chunk_bytes=low_memory_chunk_bytes(*hidden.shape, opts.free_bytes)
                                       if opts.memory == "low" else None, cublas=cublas_logits(hidden))
