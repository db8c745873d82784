"""The Hugging Face side: ``apply_lsce_patch`` / ``revert_lsce_patch``.

``apply_lsce_patch(model)`` patches one instance; ``apply_lsce_patch()`` patches the classes of every
supported family (or of ``model_type``), so models created afterwards are patched too. Either way
the Trainer / SFTTrainer hooks that route ``label_smoothing_factor`` are installed. Applying twice
is harmless; ``revert_lsce_patch`` restores the originals.
"""
from __future__ import annotations

import functools
import types

from .forward import ORIGINAL_CLASS_FORWARDS, lsce_forward
from .models import MODEL_TABLE, check_supported, family_classes, supported_message
from .trainer import install_trainer_hooks, remove_trainer_hooks, route_smoothing

_SETTINGS = ("_lsce_label_smoothing", "_lsce_explicit_smoothing", "_lsce_fused_eval_loss")


def _patched_function(like):
    @functools.wraps(like)
    def forward(self, *args, **kwargs):
        return lsce_forward(self, *args, **kwargs)
    forward._lsce = True
    return forward


def is_patched(model) -> bool:
    """True if ``model``'s forward is hf_lsce's (instance or class patch)."""
    if "_lsce_original_forward" in model.__dict__:
        return True  # instance patch, possibly wrapped since (TRL's fused head)
    fwd = model.__dict__.get("forward")
    if fwd is not None:
        return bool(getattr(getattr(fwd, "__func__", fwd), "_lsce", False))
    return any(cls in ORIGINAL_CLASS_FORWARDS for cls in type(model).__mro__)


def _validate_smoothing(label_smoothing):
    if label_smoothing is not None and (isinstance(label_smoothing, bool) or not 0.0 <= float(label_smoothing) <= 1.0):
        raise ValueError(f"label_smoothing must be None or a float in [0, 1], got {label_smoothing!r}.")


def apply_lsce_patch(model=None, *, model_type: str | None = None, label_smoothing: float | None = None,
                     fused_eval_loss: bool = False):
    """Make supported causal LMs compute their training loss with the fused op.

    Args:
        model: a model instance to patch; None patches the classes of every supported family
            (or only ``model_type``'s).
        model_type: restrict the class patch to one family (e.g. ``"llama"``).
        label_smoothing: fixed smoothing b. None: take the Trainer's ``label_smoothing_factor``
            (or 0 outside a Trainer). A float set here wins over the Trainer's flag.
        fused_eval_loss: also compute the evaluation loss (model in eval mode, labels given) with the
            fused op; the outputs then carry no logits.

    Returns the model (or None for a class patch). Raises ValueError for unsupported models.
    """
    _validate_smoothing(label_smoothing)
    if model is not None:
        if model_type is not None and getattr(model.config, "model_type", None) != model_type:
            raise ValueError(f"model_type={model_type!r} does not match the model's {model.config.model_type!r}.")
        check_supported(model)
        if not (model.__dict__.get("forward") is not None and is_patched(model)):
            model._lsce_original_forward = model.forward
            model.forward = types.MethodType(_patched_function(type(model).forward), model)
        target = model
    else:
        types_ = [model_type] if model_type is not None else list(MODEL_TABLE)
        for mt in types_:
            for cls in family_classes(mt):
                if cls not in ORIGINAL_CLASS_FORWARDS:
                    ORIGINAL_CLASS_FORWARDS[cls] = cls.forward
                    cls.forward = _patched_function(cls.forward)
                if label_smoothing is not None:
                    cls._lsce_label_smoothing = float(label_smoothing)
                    cls._lsce_explicit_smoothing = float(label_smoothing)
                if fused_eval_loss:
                    cls._lsce_fused_eval_loss = True
        target = None
    if target is not None:
        if label_smoothing is not None:
            target._lsce_label_smoothing = float(label_smoothing)
            target._lsce_explicit_smoothing = float(label_smoothing)
        target._lsce_fused_eval_loss = bool(fused_eval_loss)
    install_trainer_hooks()
    return model


def revert_lsce_patch(model=None, *, model_type: str | None = None) -> None:
    """Undo :func:`apply_lsce_patch`: for one instance, or (no model) for the classes and Trainer hooks."""
    if model is not None:
        if "_lsce_original_forward" in model.__dict__:
            del model.__dict__["forward"]
            del model.__dict__["_lsce_original_forward"]
        for attr in _SETTINGS:
            model.__dict__.pop(attr, None)
        return
    for cls in list(ORIGINAL_CLASS_FORWARDS):
        if model_type is None or cls in family_classes(model_type):
            cls.forward = ORIGINAL_CLASS_FORWARDS.pop(cls)
            for attr in _SETTINGS:
                if attr in cls.__dict__:
                    delattr(cls, attr)
    if not ORIGINAL_CLASS_FORWARDS:
        remove_trainer_hooks()


__all__ = ["apply_lsce_patch", "revert_lsce_patch", "is_patched", "route_smoothing", "supported_message",
           "MODEL_TABLE"]
