"""Trainer / SFTTrainer glue: ``label_smoothing_factor`` drives the fused op.

Unpatched, ``Trainer`` with ``label_smoothing_factor=b`` pops the labels, builds the full logits and
applies its ``LabelSmoother``; TRL's ``SFTTrainer`` does the same and runs a second, fused forward for
its metrics. With a patched model we hand b to the model instead and switch the ``LabelSmoother``
off, so the labels reach the patched forward, the loss is ``sum / num_items_in_batch`` (exact under
gradient accumulation) and no logits are built. TRL's own fused LM head, which it installs on the
instance and which has no smoothing, is removed so that its ``fused_lm_head=True`` calls reach ours.
"""
from __future__ import annotations

import functools
import types

import logging

logger = logging.getLogger(__name__)

# class -> original compute_loss
ORIGINAL_COMPUTE_LOSS: dict[type, object] = {}


def unwrap_model(model):
    """The model under DDP / accelerate wrappers and PEFT."""
    m = model
    for _ in range(8):
        if hasattr(m, "module") and not hasattr(m, "lm_head") and not hasattr(m, "get_output_embeddings"):
            m = m.module
        else:
            break
    if hasattr(m, "get_base_model"):
        m = m.get_base_model()
    return m


def route_smoothing(trainer, model) -> None:
    """Move the Trainer's smoothing into a patched model; no-op for unpatched models."""
    from . import _patched_function, is_patched

    target = unwrap_model(model)
    if not is_patched(target):
        return
    b_args = float(getattr(trainer.args, "label_smoothing_factor", 0.0) or 0.0)
    explicit = getattr(target, "_lsce_explicit_smoothing", None)
    if explicit is None:
        target._lsce_label_smoothing = b_args
    elif b_args and b_args != explicit and not getattr(trainer, "_lsce_warned", False):
        logger.warning(f"apply_lsce_patch(label_smoothing={explicit}) overrides label_smoothing_factor={b_args}.")
        trainer._lsce_warned = True
    if not getattr(trainer, "_lsce_routed", False):
        logger.info(f"hf_lsce: {type(target).__name__} trains through the fused op, "
                    f"label_smoothing={getattr(target, '_lsce_label_smoothing', 0.0)}")
        trainer._lsce_routed = True
    trainer.label_smoother = None
    fwd = target.__dict__.get("forward")
    if fwd is not None and not getattr(getattr(fwd, "__func__", fwd), "_lsce", False):
        # Another forward (TRL's fused LM head) sits on the instance: ours answers its protocol.
        if "_lsce_original_forward" in target.__dict__:
            target.forward = types.MethodType(_patched_function(type(target).forward), target)
        else:
            del target.forward


def _hooked(orig):
    @functools.wraps(orig)
    def compute_loss(self, model, inputs, *args, **kwargs):
        route_smoothing(self, model)
        return orig(self, model, inputs, *args, **kwargs)
    compute_loss._lsce = True
    return compute_loss


def trainer_classes() -> list[type]:
    from transformers import Trainer

    out = [Trainer]
    try:
        from trl import SFTTrainer

        out.append(SFTTrainer)
    except Exception:  # noqa: BLE001 - TRL is optional at runtime
        pass
    return out


def install_trainer_hooks() -> None:
    for cls in trainer_classes():
        if cls not in ORIGINAL_COMPUTE_LOSS and "compute_loss" in cls.__dict__:
            ORIGINAL_COMPUTE_LOSS[cls] = cls.__dict__["compute_loss"]
            cls.compute_loss = _hooked(cls.__dict__["compute_loss"])


def remove_trainer_hooks() -> None:
    for cls, orig in list(ORIGINAL_COMPUTE_LOSS.items()):
        cls.compute_loss = orig
        del ORIGINAL_COMPUTE_LOSS[cls]
