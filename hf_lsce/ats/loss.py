"""The selective smoothing loss of adaptive temperature scaling (Xie et al. 2024).

On response tokens: where the base model's argmax equals the label, cross-entropy to the one-hot
target ("hard"); where it is wrong, cross-entropy to the uniform distribution ("smooth",
label smoothing 1). Each part is the mean over its own tokens; the hard part is weighted by
``(1 - alpha) * fraction_wrong`` and the smooth part by ``alpha * fraction_correct``, the two weights
normalised to sum to one (the reference implementation's balancing, alpha = 0.5).

Differences from the reference, on purpose: ignored positions (label -100) take no part (the
reference counts them as wrong); a part with no tokens contributes nothing and the other takes
weight 1 (the reference would divide by zero).

Two paths compute the same number:
* :func:`selective_smoothing_loss` on calibrated logits (materialised; small vocabularies, soft-
  capped bases, and the test oracle);
* :func:`fused_selective_smoothing_loss` on hidden states: scaling every logit of token n by s_n is
  scaling h_n by s_n, so it is the fused op with per-token scaled hidden states and per-token
  smoothing (0 where correct, 1 where wrong) and never holds the N x V logits.
"""
from __future__ import annotations

import weakref

import torch

from ..ops import linear_cross_entropy


def _combine(per_token: torch.Tensor, correct: torch.Tensor, valid: torch.Tensor, alpha: float | None) -> torch.Tensor:
    if alpha is None:  # plain NLL (temperature scaling's objective): mean over valid tokens
        return torch.where(valid, per_token, per_token.new_zeros(())).sum() / valid.sum().clamp_min(1)
    return _combine_selective(per_token, correct, valid, alpha)


def _combine_selective(per_token: torch.Tensor, correct: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """Weighted mean of the hard (correct) and smooth (wrong) parts of per-token losses."""
    wrong = valid & ~correct
    right = valid & correct
    n_valid = valid.sum().to(per_token.dtype)
    if n_valid == 0:
        return per_token.sum() * 0.0
    n_right, n_wrong = right.sum().to(per_token.dtype), wrong.sum().to(per_token.dtype)
    zero = per_token.new_zeros(())
    hard = torch.where(right, per_token, zero).sum() / n_right.clamp_min(1)
    smooth = torch.where(wrong, per_token, zero).sum() / n_wrong.clamp_min(1)
    if n_right == 0:
        return smooth
    if n_wrong == 0:
        return hard
    frac_right, frac_wrong = n_right / n_valid, n_wrong / n_valid
    w_hard, w_smooth = (1 - alpha) * frac_wrong, alpha * frac_right
    if alpha in (0.0, 1.0):  # one weight is 0: the other part alone
        return hard if alpha == 0.0 else smooth
    total = w_hard + w_smooth
    return (w_hard / total) * hard + (w_smooth / total) * smooth


def _shift(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return torch.cat([labels[..., 1:], labels.new_full(labels.shape[:-1] + (1,), ignore_index)], -1)


def selective_smoothing_loss(logits: torch.Tensor, labels: torch.Tensor, *, alpha: float | None = 0.5,
                             ignore_index: int = -100, shift: bool = True) -> torch.Tensor:
    """The loss from calibrated logits (..., V) (materialised path). ``alpha=None``: plain NLL."""
    if shift:
        labels = _shift(labels, ignore_index)
    logits = logits.reshape(-1, logits.shape[-1])
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    labels = labels.reshape(-1)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    logp = torch.log_softmax(logits, -1)
    nll = -logp.gather(1, safe[:, None]).squeeze(1)
    uniform = -logp.mean(-1)
    correct = logits.argmax(-1) == safe
    per_token = nll if alpha is None else torch.where(correct, nll, uniform)
    return _combine(per_token, correct, valid, alpha)


_FP32_HEAD: dict = {}


def _fp32_copy(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 copy of a frozen fp16 head, kept while the head is unchanged (one entry): the same tensor object (a
    weak reference: another head allocated where a freed one lay, as CUDA's caching allocator does, has the same
    address and version), at the same address and version."""
    key = (weight.data_ptr(), weight._version, tuple(weight.shape), weight.device)
    held = _FP32_HEAD.get("ref")
    if _FP32_HEAD.get("key") != key or held is None or held() is not weight:
        _FP32_HEAD.clear()
        _FP32_HEAD.update(key=key, ref=weakref.ref(weight), value=weight.detach().float())
    return _FP32_HEAD["value"]


def fused_selective_smoothing_loss(hidden: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor,
                                   labels: torch.Tensor, *, alpha: float | None = 0.5, ignore_index: int = -100,
                                   shift: bool = True, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The loss from hidden states (..., D), per-token inverse temperatures ``scale`` (...) and the
    LM head ``weight`` (V, D), without logits. The base's argmax (correctness) comes from the op.
    ``alpha=None``: plain NLL of the calibrated logits."""
    if bias is not None:
        raise ValueError("the fused ATS loss needs a bias-free lm_head (a bias is not scaled with h); "
                         "use selective_smoothing_loss on logits")
    if shift:
        labels = _shift(labels, ignore_index)
    d = hidden.shape[-1]
    h = hidden.reshape(-1, d)
    y = labels.reshape(-1)
    s = scale.reshape(-1)
    valid = y != ignore_index
    if alpha is None:
        correct = valid
    else:
        with torch.no_grad():  # the base's prediction: scaling by s > 0 never changes it
            _, stats = linear_cross_entropy(h.detach(), weight.detach(), y, reduction="none", return_stats=True,
                                            ignore_index=ignore_index)
        correct = valid & (stats.argmax == y)
    acc = torch.promote_types(h.dtype, torch.float32)  # scale in fp32 (fp64 stays fp64), then the op's dtype
    scaled = h.to(acc) * s.to(acc)[:, None]
    if weight.dtype == torch.float16:
        # fp16 tops out at 65504: a base's large hidden states times an inverse temperature up to max_scale
        # overflow it (an inf, then a NaN loss). The op then runs in fp32, on an fp32 copy of the frozen head.
        weight = _fp32_copy(weight) if not weight.requires_grad else weight.float()
    else:
        scaled = scaled.to(weight.dtype)
    smoothing = 0.0 if alpha is None else (~correct).float()
    per_token = linear_cross_entropy(scaled, weight, y, label_smoothing=smoothing, reduction="none",
                                     ignore_index=ignore_index)
    return _combine(per_token, correct, valid, alpha)
