"""Checks of the values that live on the device, without stalling the GPU: a target outside ``[0, V)`` that is not
``ignore_index``, a tensor ``num_items_in_batch`` that is not a count, a per-token ``label_smoothing`` outside
``[0, 1]``. On CUDA the bad entries are found on the device (bad targets are treated as ignored, so the kernels never
read outside the weight), the loss is NaN, and a summary goes to pinned host memory behind a CUDA event; the next call
(or :func:`raise_pending_errors`, or the Trainer integration) raises the ``ValueError`` once it has arrived. On the CPU
the check is synchronous, and ``HF_LSCE_SYNC_CHECKS=1`` makes CUDA's synchronous too (the error then points at the
offending call). Under CUDA-graph capture and ``torch.compile`` tracing no summary is queued (the NaN loss marks it).
"""
from __future__ import annotations

import math
import os
import threading

import torch

_PENDING: list = []
_LOCK = threading.Lock()
# the summary's values (``_summary``): bad targets, first bad target, items, valid tokens, bad b, items bad
SUMMARY_SIZE = 6


def _check_num_items(value: float, valid_tokens: int | None = None) -> None:
    """``num_items_in_batch`` is a count of loss tokens: finite, a whole number, >= 0, and not 0 when there are
    tokens to divide (HF's Trainer passes the count over the accumulated micro-batches)."""
    if not math.isfinite(value):
        raise ValueError(f"num_items_in_batch must be a finite count of loss tokens, got {value}.")
    if value < 0 or value != math.floor(value):
        raise ValueError(f"num_items_in_batch must be a whole number >= 0 (a count of loss tokens), got {value}.")
    if valid_tokens is not None and value == 0 and valid_tokens > 0:
        raise ValueError(f"num_items_in_batch is 0 but {valid_tokens} tokens carry a loss: the loss would be divided "
                         "by zero. Pass the number of loss tokens (over all accumulated micro-batches), or None.")


def synchronous(device: torch.device) -> bool:
    """Whether checks on this device read their values at once (CPU, or ``HF_LSCE_SYNC_CHECKS=1``)."""
    return device.type != "cuda" or os.environ.get("HF_LSCE_SYNC_CHECKS", "0") == "1"


def _summary(targets, vocab_size, ignore_index, num_items_in_batch, valid_count, smoothing):
    """(values, bad): a float64 vector [bad targets, first bad target, num_items, valid tokens, bad b, items bad]
    on the targets' device, and a 0-d bool that is True when any check failed (all device ops, no sync)."""
    dev = targets.device
    f64 = dict(dtype=torch.float64, device=dev)
    flat = targets.reshape(-1)
    if flat.numel():
        bad_t = ~(((flat >= 0) & (flat < vocab_size)) | (flat == ignore_index))
        n_bad = bad_t.sum().to(torch.float64)
        first = flat.gather(0, bad_t.int().argmax().reshape(1))[0].to(torch.float64)
    else:
        n_bad = first = torch.zeros((), **f64)
    valid = valid_count.to(**f64).reshape(())
    items_bad = torch.zeros((), dtype=torch.bool, device=dev)
    items = torch.zeros((), **f64)
    if isinstance(num_items_in_batch, torch.Tensor):
        items = num_items_in_batch.detach().reshape(()).to(**f64)
        items_bad = ~torch.isfinite(items) | (items < 0) | (items != torch.floor(items)) | ((items == 0) & (valid > 0))
    elif num_items_in_batch is not None and float(num_items_in_batch) == 0:
        items_bad = valid > 0
    b_bad = torch.zeros((), **f64)
    if isinstance(smoothing, torch.Tensor) and smoothing.numel():
        b_bad = (~((smoothing >= 0) & (smoothing <= 1))).sum().to(torch.float64)
    values = torch.stack([n_bad, first, items, valid, b_bad, items_bad.to(torch.float64)])
    return values, (n_bad > 0) | (b_bad > 0) | items_bad


def _raise_from(values, vocab_size, ignore_index, name, tensor_items, zero_items, late: bool = False) -> None:
    n_bad, first, items, valid, b_bad, _ = values
    when = (" (found after the call that received it returned: that call's loss was NaN and it gave no gradient;"
            " set HF_LSCE_SYNC_CHECKS=1 to raise from the call itself)") if late else ""
    if n_bad > 0:
        raise ValueError(
            f"{name} must be in [0, {vocab_size}) or equal ignore_index={ignore_index}; found {int(first)} "
            f"({int(n_bad)} bad entries). Check the tokenizer matches the model's vocabulary.{when}")
    if b_bad > 0:
        raise ValueError(f"label_smoothing values must lie in [0, 1] (and not be NaN).{when}")
    try:
        if tensor_items:
            _check_num_items(items, int(valid))
        elif zero_items:
            _check_num_items(0.0, int(valid))
    except ValueError as e:
        raise ValueError(f"{e}{when}") from None


# Pinned host buffers for the summaries, reused in turn: at most 64 summaries are pending (an older one is read, and
# waited for, before a newer one is queued), so a buffer is reused only after the summary it held was read. A pinned
# allocation per call cost host time at every step of a small model (docs/benchmarks.md, the host).
_PINNED_RING = 66
_PINNED_LOCK = threading.Lock()
_PINNED: list = []
_PINNED_NEXT = [0]


def _pinned():
    """The next pinned host buffer of the ring, for a summary's asynchronous copy (``SUMMARY_SIZE`` fp64 values: what
    ``_summary`` and ``prepare.prepare`` both write)."""
    with _PINNED_LOCK:
        i = _PINNED_NEXT[0]
        _PINNED_NEXT[0] = (i + 1) % _PINNED_RING
        if len(_PINNED) <= i:
            _PINNED.append(torch.empty(SUMMARY_SIZE, dtype=torch.float64, pin_memory=True))
        return _PINNED[i]


class _Pending:
    """One call's summary on its way to pinned host memory (CUDA), or already on the host."""

    def __init__(self, values, context):
        self.context = context
        self.event = None
        if values.is_cuda:
            self.host = _pinned()
            self.host.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = values

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def check(self) -> None:
        if self.event is not None:
            self.event.synchronize()
        _raise_from(self.host.tolist(), *self.context, late=True)


def _tracing() -> bool:
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and getattr(compiler, "is_compiling", lambda: False)():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def raise_pending_errors(block: bool = True) -> None:
    """Raise the ``ValueError`` of an earlier call whose device-side checks failed.

    ``block=False`` looks only at the checks whose values have reached the host (no synchronisation: what every
    call of the op does first); ``block=True`` waits for all of them (the end of training, or a test)."""
    while True:
        with _LOCK:
            if not _PENDING or not (block or _PENDING[0].ready()):
                return
            item = _PENDING.pop(0)
        item.check()


def _context(vocab_size, ignore_index, num_items_in_batch, name):
    """What ``_raise_from`` needs besides the values: the vocabulary, ignore_index, the argument's name, and whether
    num_items_in_batch is a tensor (checked on the device) or a number 0 (checked against the valid count)."""
    tensor_items = isinstance(num_items_in_batch, torch.Tensor)
    zero_items = not tensor_items and num_items_in_batch is not None and float(num_items_in_batch) == 0
    return vocab_size, ignore_index, name, tensor_items, zero_items


def check_device_values(targets, vocab_size: int, ignore_index: int, num_items_in_batch, valid_count,
                        smoothing=None, name: str = "targets"):
    """Run the checks (see the module docstring). Returns a 0-d bool tensor that is True where a check failed
    (asynchronous mode), or None (synchronous: an error was raised already, or all is well)."""
    values, bad = _summary(targets, vocab_size, ignore_index, num_items_in_batch, valid_count, smoothing)
    return check_summary(values, bad, vocab_size, ignore_index, num_items_in_batch, name)


def check_summary(values, bad, vocab_size: int, ignore_index: int, num_items_in_batch, name: str = "targets"):
    """The checks' outcome from a summary computed already (``_summary``'s values, or ``prepare.prepare``'s kernel):
    raise now where checks are synchronous (returns None), else raise an earlier call's error whose summary has
    reached the host, queue this one and return ``bad`` (asynchronous, as ``check_device_values``)."""
    context = _context(vocab_size, ignore_index, num_items_in_batch, name)
    if synchronous(values.device):
        _raise_from(values.tolist(), *context)
        return None
    if not _tracing():  # (no event queries while a CUDA graph is captured)
        raise_pending_errors(block=False)
        item = _Pending(values, context)
        with _LOCK:
            _PENDING.append(item)
            overflow = _PENDING.pop(0) if len(_PENDING) > 64 else None  # bounded: the oldest is long complete
        if overflow is not None:
            overflow.check()
    return bad


def check_now(targets, vocab_size: int, ignore_index: int, num_items_in_batch, valid_count, smoothing=None,
              name: str = "targets"):
    """The same checks, read at once on any device (the CPU, and evaluation paths, which synchronise anyway)."""
    if valid_count is None:
        valid_count = torch.zeros((), device=targets.device)
    values, _ = _summary(targets, vocab_size, ignore_index, num_items_in_batch, valid_count, smoothing)
    _raise_from(values.tolist(), *_context(vocab_size, ignore_index, num_items_in_batch, name))
