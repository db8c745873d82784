"""The Hugging Face side: ``apply_lsce_patch`` / ``revert_lsce_patch``.

``apply_lsce_patch(model)`` patches one instance; ``apply_lsce_patch()`` patches the classes of every
supported family (or of ``model_type``), so models created afterwards are patched too. Either way
the Trainer / SFTTrainer hooks that route ``label_smoothing_factor`` are installed. Applying twice
is harmless; ``revert_lsce_patch`` restores the originals.
"""
from __future__ import annotations

import math
import numbers
import types

import torch

from .forward import ENGAGEMENT, ORIGINAL_CLASS_FORWARDS, is_ours, make_patched_forward
from .liger import apply_liger_kernels
from .models import (MODEL_TABLE, check_supported, family_classes, supported_message, table_spec, unwrap_model,
                     verify_generic)
from .trainer import install_trainer_hooks, remove_trainer_hooks, route_smoothing
from .versions import check_versions

_SETTINGS = ("_lsce_label_smoothing", "_lsce_explicit_smoothing", "_lsce_fused_eval_loss", "_lsce_generic_spec",
             "_lsce_memory")


def _class_patched(cls: type) -> bool:
    return cls in ORIGINAL_CLASS_FORWARDS and is_ours(cls.__dict__.get("forward"))


def _carries_patch(module: torch.nn.Module) -> bool:
    if "_lsce_original_forward" in module.__dict__:
        return True
    return any(_class_patched(cls) for cls in type(module).__mro__)


def find_patched(*models):
    """The patched causal LM under ``models`` (a Trainer passes the model its step calls, then its own
    ``self.model``), or None. Looked up with :func:`unwrap_model` first; failing that, the first patched module
    of each tree, so that no wrapper (one accelerate and PEFT do not know included) hides the patch from the
    Trainer hooks and their run-time proof. Recognised by identity, so wrappers that copy a forward's attributes
    (TRL's fused LM head, accelerate's mixed-precision wrapper) neither hide the patch nor fake it."""
    modules = [m for m in models if isinstance(m, torch.nn.Module)]
    for m in modules:
        target = unwrap_model(m)
        if _carries_patch(target):
            return target
    for m in modules:
        for sub in m.modules():
            if _carries_patch(sub):
                return sub
    return None


def is_patched(model) -> bool:
    """True if ``model``, or a causal LM under any wrapper of it (PEFT, DDP, DeepSpeed, FSDP, compile), carries
    hf_lsce's patch, on the instance or on its class. Whether a training step really ran through the fused op is
    checked at run time by the Trainer hooks."""
    return find_patched(model) is not None


def validate_smoothing(value, name: str = "label_smoothing") -> float | None:
    """``value`` as a smoothing b (None stays None): TypeError for anything but a real number, ValueError outside
    [0, 1]; both name ``name`` (the argument, or a config key of the framework integrations)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be None or a float in [0, 1], got {value!r} ({type(value).__name__}).")
    b = float(value)
    if not (math.isfinite(b) and 0.0 <= b <= 1.0):
        raise ValueError(f"{name} must be None or a float in [0, 1], got {value!r}.")
    return b


def validate_memory(value, name: str = "memory") -> str:
    """``value`` as the op's memory budget (``"auto"``, ``"low"``, a number of bytes, or a string of one as a YAML or
    an environment variable gives it: ``2e9``), in the form the op takes; ValueError / TypeError naming ``name``."""
    from ..ops.budget import check_memory

    if isinstance(value, str) and value not in ("auto", "low"):
        try:
            value = float(value)
        except ValueError:
            pass
    try:
        return check_memory(value)
    except (TypeError, ValueError) as e:
        raise type(e)(str(e).replace("memory", name, 1)) from None


def apply_lsce_patch(model=None, *, model_type: str | None = None, label_smoothing: float | None = None,
                     fused_eval_loss: bool = False, memory: str | int = "auto", liger_kernels: bool | dict = False):
    """Make supported causal LMs compute their training loss with the fused op.

    Args:
        model: a model instance to patch (a PEFT ``PeftModel`` or a wrapped model patches the causal LM
            inside it); None patches the classes of every family in the table (or only ``model_type``'s), so
            models created afterwards are patched too. A causal LM outside the table is patched only as an
            instance, after ``verify_generic`` ran its own forward once on a short random input and found its loss
            to be the fused op's (its logits the head's output unchanged, its loss their shifted cross-entropy).
        model_type: restrict the class patch to one family (e.g. ``"llama"``).
        label_smoothing: fixed smoothing b. None: take the Trainer's ``label_smoothing_factor``
            (or 0 outside a Trainer). A float set here wins over the Trainer's flag, and drives TRL's
            ``SFTTrainer`` without its deprecated ``label_smoothing_factor``.
        fused_eval_loss: also compute the evaluation loss (model in eval mode, labels given) with the
            fused op; the outputs then carry no logits.
        memory: the op's memory budget at every training step: ``"auto"`` (the fastest computation that fits the
            GPU's free memory), ``"low"`` or a number of bytes (``linear_cross_entropy``'s ``memory``).
        liger_kernels: also put Liger-Kernel's other kernels (RMSNorm, RoPE, SwiGLU / GeGLU...) on the model (or, for
            a class patch, on the families' classes), its loss kernels off: the whole step fused, for code outside a
            Trainer (a Trainer or SFTTrainer does this for ``use_liger_kernel=True``). A dict is Liger's kernel
            configuration (``{"rope": False}``). Needs liger-kernel (``patching.liger.LIGER_TESTED``).

    Returns the model (or None for a class patch). Raises ValueError for unsupported models, TypeError for
    arguments of the wrong kind, ImportError for a transformers or TRL older than the tested floors
    (``versions.MIN_VERSIONS``).
    """
    check_versions()
    b = validate_smoothing(label_smoothing)
    memory = validate_memory(memory)
    if not isinstance(fused_eval_loss, bool):
        raise TypeError(f"fused_eval_loss must be True or False, got {fused_eval_loss!r}.")
    if model_type is not None and not isinstance(model_type, str):
        raise TypeError(f"model_type must be a string such as 'llama', got {model_type!r}.")
    if not isinstance(liger_kernels, (bool, dict)):
        raise TypeError(f"liger_kernels must be True, False or a dict of Liger-Kernel's kernel switches, got "
                        f"{liger_kernels!r}.")
    liger_config = liger_kernels if isinstance(liger_kernels, dict) else None  # (Liger's switches; {}: its defaults)
    if liger_kernels is not False:
        from .versions import installed_version

        if installed_version("liger-kernel") is None:
            raise ImportError("apply_lsce_patch(liger_kernels=...) puts Liger-Kernel's kernels beside the fused loss, "
                              "and liger-kernel is not installed: pip install liger-kernel, or leave liger_kernels "
                              "out.")
    if model is not None:
        if isinstance(model, (str, bytes)) or not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"model must be a loaded transformers model (or None to patch the classes), got {type(model).__name__} "
                f"{model!r:.80}. Load it first, e.g. apply_lsce_patch(AutoModelForCausalLM.from_pretrained(name)).")
        target = unwrap_model(model)
        if not hasattr(target, "config"):
            raise TypeError(f"model must be a transformers causal LM with a .config; got {type(target).__name__}.")
        if model_type is not None and getattr(target.config, "model_type", None) != model_type:
            raise ValueError(f"model_type={model_type!r} does not match the model's {target.config.model_type!r}.")
        if table_spec(target) is None and "_lsce_generic_spec" not in target.__dict__:
            target._lsce_generic_spec = verify_generic(target)  # a family outside the table: checked on the model
        check_supported(target)
        if "_lsce_original_forward" not in target.__dict__:
            target._lsce_had_instance_forward = "forward" in target.__dict__
            target._lsce_original_forward = target.forward
            target.forward = types.MethodType(make_patched_forward(type(target).forward), target)
        if b is not None:
            target._lsce_label_smoothing = b
            target._lsce_explicit_smoothing = b
        target._lsce_fused_eval_loss = fused_eval_loss
        target._lsce_memory = memory
        if liger_kernels is not False:
            apply_liger_kernels(target, config=liger_config, where="apply_lsce_patch(liger_kernels=...)")
    else:
        types_ = [model_type] if model_type is not None else list(MODEL_TABLE)
        for mt in types_:
            for cls in family_classes(mt, missing_ok=model_type is None):
                if cls not in ORIGINAL_CLASS_FORWARDS:
                    ORIGINAL_CLASS_FORWARDS[cls] = cls.__dict__["forward"]
                    cls.forward = make_patched_forward(cls.__dict__["forward"])
                if b is not None:
                    cls._lsce_label_smoothing = b
                    cls._lsce_explicit_smoothing = b
                if fused_eval_loss:
                    cls._lsce_fused_eval_loss = True
                if memory != "auto":
                    cls._lsce_memory = memory
        if liger_kernels is not False:
            apply_liger_kernels(model_types=[mt for mt in types_ if family_classes(mt, missing_ok=True)],
                                config=liger_config, where="apply_lsce_patch(liger_kernels=...)")
    install_trainer_hooks()
    return model


def revert_lsce_patch(model=None, *, model_type: str | None = None) -> None:
    """Undo :func:`apply_lsce_patch`: for one instance, or (no model) for the classes and Trainer hooks."""
    if model is not None:
        target = unwrap_model(model) if isinstance(model, torch.nn.Module) else model
        d = getattr(target, "__dict__", {})
        if "_lsce_original_forward" in d:
            if not is_ours(d.get("forward")):
                raise RuntimeError(
                    f"the forward of this {type(target).__name__} was wrapped after patching (by accelerate's "
                    "mixed-precision wrapper or another library); reverting would drop that wrapper. Revert before "
                    "handing the model to a Trainer / Accelerator, or unwrap it first.")
            original = d.pop("_lsce_original_forward")
            if d.pop("_lsce_had_instance_forward", False):
                target.forward = original  # e.g. TRL's fused LM head from before the patch
            else:
                del d["forward"]
        for attr in _SETTINGS:
            d.pop(attr, None)
        return
    for cls in list(ORIGINAL_CLASS_FORWARDS):
        if model_type is None or cls in family_classes(model_type):
            cls.forward = ORIGINAL_CLASS_FORWARDS.pop(cls)
            for attr in _SETTINGS:
                if attr in cls.__dict__:
                    delattr(cls, attr)
    if not ORIGINAL_CLASS_FORWARDS:
        remove_trainer_hooks()


__all__ = ["apply_lsce_patch", "revert_lsce_patch", "is_patched", "find_patched", "route_smoothing",
           "supported_message", "validate_smoothing", "validate_memory",
           "MODEL_TABLE", "ENGAGEMENT", "unwrap_model"]
