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
import threading
import weakref
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
from transformers.utils import ModelOutput

from ..ops import divide_summed_loss, linear_cross_entropy
from ..ops.paths import observe_training_calls
from ..ops.checks import check_now
from .models import check_supported, logit_scale_of, output_head, router_aux_loss, softcap_of, table_spec

# Registry of original forwards of patched classes (class -> function).
ORIGINAL_CLASS_FORWARDS: dict[type, Any] = {}

# The forward functions hf_lsce created, recognised by identity: wrappers built with functools.wraps
# (TRL's fused LM head, torch.autocast, accelerate) copy a function's attributes, so a marker
# attribute would be taken for ours; membership in this set cannot be copied.
_OUR_FORWARDS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def make_patched_forward(like):
    """A new function with ``like``'s name and signature that runs :func:`lsce_forward`."""
    def forward(self, *args, **kwargs):
        return lsce_forward(self, *args, **kwargs)
    forward.__name__, forward.__qualname__ = like.__name__, getattr(like, "__qualname__", like.__name__)
    forward.__doc__, forward.__module__ = like.__doc__, like.__module__
    forward.__wrapped__ = like  # inspect.signature (the Trainer's loss-kwargs check, generate) reads like's
    _OUR_FORWARDS.add(forward)
    return forward


def is_ours(fn) -> bool:
    """True if ``fn`` (a function or a bound method) is a forward hf_lsce created."""
    fn = getattr(fn, "__func__", fn)
    try:
        return fn in _OUR_FORWARDS
    except TypeError:  # not weak-referenceable: not ours
        return False


class Engagement:
    """What the patched forward did, counted process-wide (thread-safe: DataParallel replicas run in
    threads). The Trainer hooks read it around each training ``compute_loss`` to prove the fused op ran
    with the requested smoothing, and to say why when it did not."""

    def __init__(self):
        self._lock = threading.Lock()
        self.fused_calls = 0
        self.smoothing: list[float] = []  # b of the fused calls since the last start() (bounded)
        self.seen: set[float] = set()  # every b the fused op trained with in this process
        self.last_unfused_reason: str | None = None

    def record_fused(self, b: float | None) -> None:
        """One training call of the op, with smoothing ``b`` (None: per-token smoothing, not recorded as a value)."""
        with self._lock:
            self.fused_calls += 1
            if b is None:
                return
            self.seen.add(b)
            if len(self.smoothing) < 64:
                self.smoothing.append(b)

    def record_unfused(self, reason: str) -> None:
        with self._lock:
            self.last_unfused_reason = reason

    def start(self) -> int:
        """Begin a watched call; returns the count to compare with after it."""
        with self._lock:
            self.smoothing.clear()
            self.last_unfused_reason = None
            return self.fused_calls


ENGAGEMENT = Engagement()
observe_training_calls(ENGAGEMENT.record_fused)


# The outputs' cache field: ``past_key_values`` until transformers 5.24 renamed it ``cache`` (the old keyword then warns,
# and a ModelOutput subclass that still declares it fails at construction, where the keyword is renamed).
CACHE_FIELD = "cache" if "cache" in {f.name for f in fields(CausalLMOutputWithPast)} else "past_key_values"


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
    if CACHE_FIELD == "cache":
        cache: Any = None
    else:
        past_key_values: Any = None
    hidden_states: Any = None
    attentions: Any = None


@dataclass
class TokenStatsCausalLMOutput(CausalLMOutputWithPast):
    """A training output with the token statistics that TRL's SFTTrainer logs (``entropy``, ``mean_token_accuracy``)
    where it cannot read them from logits: sums over the batch's scored tokens, from the op's own statistics.
    The fields TRL 1.x's chunked loss (``loss_type="chunked_nll"``) returns; set when a trainer hook asks
    (``_lsce_token_stats``, see trainer.py)."""

    num_correct_tokens: torch.Tensor | None = None
    entropy_sum: torch.Tensor | None = None
    num_valid_tokens: torch.Tensor | None = None


@dataclass
class TokenStatsMoeCausalLMOutput(MoeCausalLMOutputWithPast):
    """:class:`TokenStatsCausalLMOutput` for a mixture of experts (the router's fields kept)."""

    num_correct_tokens: torch.Tensor | None = None
    entropy_sum: torch.Tensor | None = None
    num_valid_tokens: torch.Tensor | None = None


def _eager(fn):
    """``fn`` run outside torch.compile's tracing (a graph break; the code around it still compiles)."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(fn) if disable is not None else fn


def original_forward(model):
    """The unpatched forward of ``model``, bound to it: the instance's forward from before an instance
    patch (which may be another wrapper, e.g. TRL's fused LM head), else the class's original. Never
    one of ours (a class patch under an instance patch would otherwise recurse)."""
    inst = model.__dict__.get("_lsce_original_forward")
    if inst is not None and not is_ours(inst):
        return inst
    for cls in type(model).__mro__:
        if cls in ORIGINAL_CLASS_FORWARDS:
            return ORIGINAL_CLASS_FORWARDS[cls].__get__(model, type(model))
    fwd = type(model).forward
    if is_ours(fwd):  # pragma: no cover - a class patch always registers its original
        raise RuntimeError(f"hf_lsce lost the original forward of {type(model).__name__}; call revert_lsce_patch().")
    return fwd.__get__(model, type(model))


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


def _unfused_reason(model, has_labels, keep_all) -> str:
    if not has_labels:
        return ("the model was called without labels, so no loss was asked of it (a Trainer whose label_smoother or "
                "compute_loss_func is set pops the labels and computes the loss from full logits)")
    if not keep_all:
        return "logits_to_keep was set, which asks for logits"
    return "the model was in evaluation mode"  # pragma: no cover - training calls reach here only as above


def _check_label_range(model, labels, name: str) -> None:
    """In evaluation (the fused op checks its own targets): labels outside [0, V) and not -100 raise the op's
    ValueError, named ``name``, instead of an IndexError from inside torch's cross-entropy or a device-side assert."""
    if not torch.is_tensor(labels):
        return
    weight = output_head(model).weight
    vocab = getattr(weight, "ds_shape", weight.shape)[0]  # ZeRO-3 partitions a weight to an empty tensor
    check_now(labels, vocab, -100, None, None, name=name)


@torch.no_grad()
def _with_logit_token_stats(out, logits, shift_labels):
    """``out`` with the statistics TRL's chunked loss returns (:class:`TokenStatsCausalLMOutput`), from the logits an
    evaluation built: TRL 1.x (1.14 for one) calls ``compute_loss`` in evaluation too and reads them, and its own chunked
    forward, which the patch replaces, returns them there as well."""
    targets = shift_labels.to(logits.device)
    valid = targets != -100
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    counts = dict(num_valid_tokens=valid.sum(), entropy_sum=(entropy * valid).sum(),
                  num_correct_tokens=((logits.argmax(-1) == targets) & valid).sum())
    cls = TokenStatsMoeCausalLMOutput if isinstance(out, MoeCausalLMOutputWithPast) else TokenStatsCausalLMOutput
    return cls(**dict(out.items()), **counts)


def lsce_forward(self, *args, **kwargs):
    kwargs = _as_kwargs(self, args, kwargs)
    labels = kwargs.pop("labels", None)
    shift_labels = kwargs.pop("shift_labels", None)
    num_items = kwargs.pop("num_items_in_batch", None)
    b = smoothing_of(self, kwargs.pop("label_smoothing", None))
    fused_lm_head = bool(kwargs.pop("fused_lm_head", False))
    # Liger's protocol (the Trainer's evaluation with use_liger_kernel and prediction_loss_only): the loss without
    # logits, which the fused op gives; unknown to the family's own forward
    skip_logits = bool(kwargs.pop("skip_logits", False))
    logits_to_keep = kwargs.get("logits_to_keep", 0)
    return_dict = kwargs.pop("return_dict", None)
    has_labels = labels is not None or shift_labels is not None
    keep_all = isinstance(logits_to_keep, int) and logits_to_keep == 0
    fused = has_labels and keep_all and (self.training or fused_lm_head or skip_logits
                                         or getattr(self, "_lsce_fused_eval_loss", False))

    if not fused:
        if fused_lm_head:
            raise ValueError("fused_lm_head=True needs labels (or shift_labels) and logits_to_keep=0.")
        if self.training and torch.is_grad_enabled():
            ENGAGEMENT.record_unfused(_unfused_reason(self, has_labels, keep_all))
        orig = original_forward(self)
        if has_labels:
            _check_label_range(self, labels if labels is not None else shift_labels,
                               "labels" if labels is not None else "shift_labels")
        chunked = has_labels and self.__dict__.get("_lsce_token_stats") == "chunked" and return_dict is not False
        if not has_labels or (b == 0.0 and not chunked):
            if labels is not None:
                kwargs["labels"] = labels
            if shift_labels is not None:
                kwargs["shift_labels"] = shift_labels
            if num_items is not None:
                kwargs["num_items_in_batch"] = num_items
            if return_dict is not None:
                kwargs["return_dict"] = return_dict
            return orig(**kwargs)
        # Evaluation with smoothing: the model's own logits, the smoothed loss from them (plus, for a mixture of
        # experts, the router's term its forward adds when given labels).
        out = orig(**kwargs, return_dict=True)
        logits = out.logits.float()
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
        tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shift_labels.reshape(-1).to(logits.device),
                              ignore_index=-100, label_smoothing=b, reduction="sum")
        loss = divide_summed_loss(tok, num_items, (shift_labels != -100).sum())
        spec = table_spec(self)
        if spec is not None and spec.router_aux and getattr(out, "aux_loss", None) is not None:
            loss = loss + self.router_aux_loss_coef * out.aux_loss.to(loss.device)
        out = type(out)(loss=loss, **{k: v for k, v in out.items() if k != "loss"})  # loss first, as HF orders it
        if chunked:
            out = _with_logit_token_stats(out, logits, shift_labels)
        return out if return_dict is not False else out.to_tuple()

    spec = check_supported(self)  # fail closed on configs the op cannot reproduce (the class patch checks here)
    kwargs.pop("logits_to_keep", None)
    if fused_lm_head:
        kwargs["use_cache"] = False
    router = spec.router_aux and _wants_router_logits(self, kwargs)
    if spec.router_aux:
        kwargs["output_router_logits"] = router
    backbone_out = getattr(self, spec.backbone)(**kwargs, return_dict=True)
    head = output_head(self)
    targets, shift = (shift_labels, False) if shift_labels is not None else (labels, True)
    op_kwargs = dict(label_smoothing=b, softcap=softcap_of(self), shift=shift,
                     memory=getattr(self, "_lsce_memory", "auto"))
    scale = logit_scale_of(self, spec)

    token_stats = self.__dict__.get("_lsce_token_stats", False)
    coef = getattr(self, "router_aux_loss_coef", None)
    if token_stats == "chunked":  # as TRL's chunked forward: the config's coefficient (TRL writes its own there)
        coef = getattr(self.config.get_text_config(), "router_aux_loss_coef", coef)

    def head_loss(weight, bias, hidden, targets):
        hidden, targets = hidden.to(weight.device), targets.to(weight.device)
        if scale is not None:  # logits * scale = (hidden * scale) W^T + bias * scale
            hidden = hidden * scale
            bias = bias * scale if bias is not None else None
        if not fused_lm_head:
            # sum of token losses / num_items_in_batch (or the valid-token count): the reduced loss lets the op
            # compute its gradients in the forward with the right weights (one pass, no rescaling).
            return linear_cross_entropy(hidden, weight, targets, bias=bias, num_items_in_batch=num_items,
                                        return_stats=bool(token_stats), **op_kwargs)
        return linear_cross_entropy(hidden, weight, targets, bias=bias, reduction="none", return_stats=True,
                                    **op_kwargs)

    # the op records the engagement itself (ENGAGEMENT observes its training calls), also from a compiled graph
    result = call_head(head, head_loss, backbone_out.last_hidden_state, targets)
    aux = None
    if router:  # as the family's own forward: loss + router_aux_loss_coef * load-balancing loss
        aux = router_aux_loss(self, spec, backbone_out.router_logits, kwargs.get("attention_mask"))
    if not fused_lm_head:
        if token_stats:
            result, stats = result
            valid = stats.valid
            nxt = targets.to(valid.device)
            if shift:  # the op's statistics at position t score the label at t + 1
                nxt = F.pad(nxt, (0, 1), value=-100)[..., 1:]
            counts = dict(num_valid_tokens=valid.sum(), entropy_sum=(stats.entropy * valid).sum(),
                          num_correct_tokens=((stats.argmax == nxt) & valid).sum())
        loss = result if aux is None else result + coef * aux.to(result.device)
        fields = dict(loss=loss, logits=None, hidden_states=backbone_out.hidden_states,
                      attentions=backbone_out.attentions, **{CACHE_FIELD: getattr(backbone_out, CACHE_FIELD, None)})
        if token_stats:
            fields.update(counts)
        if spec.router_aux:
            cls = TokenStatsMoeCausalLMOutput if token_stats else MoeCausalLMOutputWithPast
            out = cls(**fields, aux_loss=aux, router_logits=backbone_out.router_logits)
        else:
            out = (TokenStatsCausalLMOutput if token_stats else CausalLMOutputWithPast)(**fields)
        return keep_fused_outputs(self, out if return_dict is not False else _stock_positions(out))
    tok, stats = result
    targets = targets.to(tok.device)
    loss = divide_summed_loss(tok.sum(), num_items, stats.valid.sum())
    if aux is not None:  # TRL reads aux_loss and weights it itself; loss is the model's own, as without the patch
        loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
    # TRL's alignment: position t scores the label at t + 1 (labels[:, 1:]) unless shift_labels were given
    cut = (slice(None), slice(None, -1)) if shift else (slice(None), slice(None))
    nxt = targets[:, 1:] if shift else targets
    mask = stats.valid[cut]
    return keep_fused_outputs(self, FusedCausalLMOutput(
        loss=loss, log_probs=-tok[cut], entropy=stats.entropy[cut] * mask, label_mask=mask,
        is_top1=(stats.argmax[cut] == nxt) & mask, aux_loss=aux,
        hidden_states=backbone_out.hidden_states, attentions=backbone_out.attentions))


def _stock_positions(out: ModelOutput) -> tuple:
    """``out`` as a tuple (``return_dict=False``) whose positions are the stock model's: transformers' ``to_tuple``
    drops None fields, so without the (never made) logits the cache would move into their place; their place is kept,
    as None."""
    return tuple(getattr(out, f.name) for f in fields(out) if f.name == "logits" or getattr(out, f.name) is not None)


def _wants_router_logits(model, kwargs) -> bool:
    """``output_router_logits`` as a mixture-of-experts forward resolves it: the call's, else the config's."""
    flag = kwargs.get("output_router_logits")
    return bool(flag if flag is not None else getattr(model.config, "output_router_logits", False))


def call_head(head: torch.nn.Module, fn, hidden: torch.Tensor, targets: torch.Tensor):
    """``fn(weight, bias, hidden, targets)`` with the head's full weight.

    When the head is its own FSDP2 unit (the Trainer's auto-wrap makes it one, grouped with the final norm), its
    weight is a shard outside its own call: ``fn`` then runs *as* the head's forward, so FSDP2's hooks all-gather
    the weight before it, reshard after it, and reduce-scatter the weight's gradient in backward, exactly as for
    the ``nn.Linear`` it replaces. DeepSpeed ZeRO-3 gathers a partitioned weight (``ds_id``) by hooks on the
    module's forward, and re-gathers it for backward through the outputs of that forward: the same treatment.
    Otherwise (the head inside a larger FSDP unit, or no sharding) the weight is used as it is, or gathered whole
    if it is still a DTensor.
    """
    if _is_fsdp_unit(head) or hasattr(head.weight, "ds_id"):
        return _call_as_head_forward(head, fn, hidden, targets)
    weight, bias = head.weight, head.bias
    if hasattr(weight, "full_tensor"):  # a DTensor outside FSDP's forward: gather the head for the op
        weight = weight.full_tensor()
        bias = bias.full_tensor() if bias is not None else None
    return fn(weight, bias, hidden, targets)


@_eager
def _call_as_head_forward(head: torch.nn.Module, fn, hidden: torch.Tensor, targets: torch.Tensor):
    """``fn`` run as ``head``'s forward (see :func:`call_head`), outside torch.compile's tracing: swapping a module's
    forward is not something Dynamo traces, and the sharding engines' hooks run as they do eagerly."""
    computed = []

    def forward(h, t):
        computed.append(fn(head.weight, head.bias, h, t))
        return computed[-1]

    head.forward = forward
    try:
        out = head(hidden, targets)
    finally:
        del head.forward  # back to the class's forward
    return undo_output_cast(out, computed[-1])


def undo_output_cast(out, computed):
    """``out`` with every tensor that a wrapper only cast to another dtype replaced by the tensor the op computed.

    FSDP2's mixed precision casts each floating output of a unit to its ``output_dtype`` (accelerate sets bf16 on
    the root and on the head's unit), so the loss would reach the Trainer rounded to bf16 (12.5625 where it is
    12.5709...). FSDP2 hooks its pre-backward on the tensors the unit returned, before casting them, so the op's
    own fp32 tensors carry the hook and can be handed on. Wrappers that put outputs through an autograd function
    of their own (DeepSpeed ZeRO-3's re-gather for backward) keep the dtype, so their tensors are kept."""
    if torch.is_tensor(out):
        if (torch.is_tensor(computed) and out is not computed and out.dtype != computed.dtype
                and out.shape == computed.shape):
            return computed
        return out
    if isinstance(out, ModelOutput) and isinstance(computed, ModelOutput):
        for key, value in out.items():
            if key in computed:
                out[key] = undo_output_cast(value, computed[key])
        return out
    if isinstance(out, (tuple, list)) and isinstance(computed, (tuple, list)) and len(out) == len(computed):
        items = [undo_output_cast(o, c) for o, c in zip(out, computed)]
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
    return out


def _restore_root_outputs(module, args, output):
    """Forward hook, registered after FSDP2's own on a patched model that is an FSDP2 unit (the root): undo its
    output cast on the fused outputs (:func:`undo_output_cast`)."""
    computed = module.__dict__.pop("_lsce_computed_output", None)
    return output if computed is None else undo_output_cast(output, computed)


def keep_fused_outputs(model, out):
    """Remember ``out`` for :func:`_restore_root_outputs` when ``model`` is an FSDP2 unit; the hook is registered on
    the first fused call, after ``fully_shard`` registered FSDP2's, so it runs after FSDP2's cast."""
    if not _is_fsdp_unit(model):
        return out
    model.__dict__["_lsce_computed_output"] = out
    if "_lsce_restore_hook" not in model.__dict__:
        model.__dict__["_lsce_restore_hook"] = model.register_forward_hook(_restore_root_outputs)
    return out


def _is_fsdp_unit(module: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(module, FSDPModule)


