"""The single patched causal-LM forward shared by every supported family.

In training with labels it runs the backbone, then the fused op on the last hidden state and the
lm_head weight: ``logits=None``, the loss identical to the model's own (plus label smoothing). In
every other case (no labels, generation, ``logits_to_keep``, evaluation) it calls the original
forward unchanged, so logits are bit-for-bit those of the unpatched model; with labels and
smoothing in evaluation the loss is computed from those logits with the same smoothing.

It also answers TRL's ``fused_lm_head=True`` protocol (``SFTTrainer`` calls the model that way):
per-token ``log_probs``, ``entropy``, ``is_top1`` and ``label_mask`` from the op's statistics.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import ModelOutput

from ..ops import divide_summed_loss, linear_cross_entropy
from .models import check_supported, output_head, softcap_of

# Registry of original forwards of patched classes (class -> function).
ORIGINAL_CLASS_FORWARDS: dict[type, Any] = {}


@dataclass
class FusedCausalLMOutput(ModelOutput):
    """What TRL reads from ``model(..., fused_lm_head=True)``. Per-token fields are zero where the
    label is ignored. ``log_probs`` is ``log p(label)`` when the smoothing is 0; with smoothing b it is
    minus the smoothed per-token loss, so that TRL's ``-log_probs.sum() / num_items`` is the smoothed loss."""

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    past_key_values: Any = None
    hidden_states: Any = None
    attentions: Any = None


def original_forward(model):
    """The unpatched forward of ``model``, bound to it."""
    inst = model.__dict__.get("_lsce_original_forward")
    if inst is not None:
        return inst
    for cls in type(model).__mro__:
        if cls in ORIGINAL_CLASS_FORWARDS:
            return ORIGINAL_CLASS_FORWARDS[cls].__get__(model, type(model))
    return type(model).forward.__get__(model, type(model))


def _as_kwargs(model, args, kwargs):
    """Name positional arguments with the original forward's signature."""
    if not args:
        return kwargs
    params = [p for p in inspect.signature(original_forward(model)).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(args) > len(params):
        raise TypeError(f"{type(model).__name__}.forward got {len(args)} positional arguments, expected at most {len(params)}.")
    named = {p.name: a for p, a in zip(params, args)}
    dup = set(named) & set(kwargs)
    if dup:
        raise TypeError(f"{type(model).__name__}.forward got multiple values for {sorted(dup)}.")
    return {**named, **kwargs}


def smoothing_of(model, label_smoothing) -> float:
    b = label_smoothing if label_smoothing is not None else getattr(model, "_lsce_label_smoothing", None)
    return float(b) if b is not None else 0.0


def lsce_forward(self, *args, **kwargs):
    kwargs = _as_kwargs(self, args, kwargs)
    labels = kwargs.pop("labels", None)
    shift_labels = kwargs.pop("shift_labels", None)
    num_items = kwargs.pop("num_items_in_batch", None)
    b = smoothing_of(self, kwargs.pop("label_smoothing", None))
    fused_lm_head = bool(kwargs.pop("fused_lm_head", False))
    logits_to_keep = kwargs.get("logits_to_keep", 0)
    return_dict = kwargs.pop("return_dict", None)
    has_labels = labels is not None or shift_labels is not None
    keep_all = isinstance(logits_to_keep, int) and logits_to_keep == 0
    fused = has_labels and keep_all and (self.training or fused_lm_head or getattr(self, "_lsce_fused_eval_loss", False))

    if not fused:
        if fused_lm_head:
            raise ValueError("fused_lm_head=True needs labels (or shift_labels) and logits_to_keep=0.")
        orig = original_forward(self)
        if not has_labels or b == 0.0:
            if labels is not None:
                kwargs["labels"] = labels
            if shift_labels is not None:
                kwargs["shift_labels"] = shift_labels
            if num_items is not None:
                kwargs["num_items_in_batch"] = num_items
            if return_dict is not None:
                kwargs["return_dict"] = return_dict
            return orig(**kwargs)
        # Evaluation with smoothing: the model's own logits, the smoothed loss from them.
        out = orig(**kwargs, return_dict=True)
        logits = out.logits.float()
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
        tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shift_labels.reshape(-1).to(logits.device),
                              ignore_index=-100, label_smoothing=b, reduction="sum")
        out.loss = divide_summed_loss(tok, num_items, (shift_labels != -100).sum())
        return out if return_dict is not False else out.to_tuple()

    check_supported(self)  # fail closed on configs the op cannot reproduce (the class patch checks here)
    kwargs.pop("logits_to_keep", None)
    if fused_lm_head:
        kwargs["use_cache"] = False
    backbone_out = self.model(**kwargs, return_dict=True)
    head = output_head(self)
    targets, shift = (shift_labels, False) if shift_labels is not None else (labels, True)
    op_kwargs = dict(label_smoothing=b, softcap=softcap_of(self), shift=shift)

    def head_loss(weight, bias, hidden, targets):
        hidden, targets = hidden.to(weight.device), targets.to(weight.device)
        if not fused_lm_head:
            # sum of token losses / num_items_in_batch (or the valid-token count): the reduced loss lets the op
            # compute its gradients in the forward with the right weights (one pass, no rescaling).
            return linear_cross_entropy(hidden, weight, targets, bias=bias, num_items_in_batch=num_items, **op_kwargs)
        return linear_cross_entropy(hidden, weight, targets, bias=bias, reduction="none", return_stats=True,
                                    **op_kwargs)

    result = call_head(head, head_loss, backbone_out.last_hidden_state, targets)
    if not fused_lm_head:
        out = CausalLMOutputWithPast(loss=result, logits=None, past_key_values=backbone_out.past_key_values,
                                     hidden_states=backbone_out.hidden_states, attentions=backbone_out.attentions)
        return out if return_dict is not False else out.to_tuple()
    tok, stats = result
    targets = targets.to(tok.device)
    loss = divide_summed_loss(tok.sum(), num_items, stats.valid.sum())
    cut = (slice(None), slice(None, -1)) if shift else (slice(None), slice(None))
    mask = stats.valid[cut]
    return FusedCausalLMOutput(
        loss=loss, log_probs=-tok[cut], entropy=stats.entropy[cut] * mask, label_mask=mask,
        is_top1=(stats.argmax[cut] == targets[cut]) & mask,
        past_key_values=None, hidden_states=backbone_out.hidden_states, attentions=backbone_out.attentions)


def call_head(head: torch.nn.Module, fn, hidden: torch.Tensor, targets: torch.Tensor):
    """``fn(weight, bias, hidden, targets)`` with the head's full weight.

    When the head is its own FSDP2 unit (the Trainer's auto-wrap can make it one), its weight is a
    shard outside its own call: ``fn`` then runs *as* the head's forward, so FSDP2's hooks all-gather
    the weight before it, reshard after it, and reduce-scatter the weight's gradient in backward,
    exactly as for the ``nn.Linear`` it replaces. DeepSpeed ZeRO-3 gathers a partitioned weight by
    hooks on the module's forward too, and gets the same treatment (not verified: no wheel here).
    Otherwise (the head inside a larger FSDP unit, or no sharding) the weight is used as it is, or
    gathered whole if it is still a DTensor.
    """
    if _is_fsdp_unit(head) or hasattr(head.weight, "ds_id"):
        head.forward = lambda h, t: fn(head.weight, head.bias, h, t)
        try:
            return head(hidden, targets)
        finally:
            del head.forward  # back to the class's forward
    weight, bias = head.weight, head.bias
    if hasattr(weight, "full_tensor"):  # a DTensor outside FSDP's forward: gather the head for the op
        weight = weight.full_tensor()
        bias = bias.full_tensor() if bias is not None else None
    return fn(weight, bias, hidden, targets)


def _is_fsdp_unit(module: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(module, FSDPModule)
