"""Liger-Kernel's other kernels (RMSNorm, RoPE, SwiGLU / GeGLU, layer norm, ...) beside hf_lsce's loss: the one place
that puts them on a model for every entry point.

The switch users already set asks for them: ``use_liger_kernel=True`` in ``TrainingArguments`` / TRL's ``SFTConfig``
(also through ``hf-lsce run train.py --use_liger_kernel``), ``enable_liger_kernel: true`` in LLaMA-Factory's YAML,
``apply_lsce_patch(model, liger_kernels=True)`` outside a Trainer. Liger's own loss kernels would take the model's
forward (``fused_linear_cross_entropy``) or the loss function (``cross_entropy``) from hf_lsce, so they are switched
off through Liger's own kernel configuration, which the Trainer hands to Liger (``TrainingArguments.
liger_kernel_config``): the Trainer still applies Liger wherever its version does (in ``__init__``, or when
``train()`` starts), and its every step checks that hf_lsce's op ran. A family Liger has no kernels for trains with
hf_lsce alone, with one log line.
"""
from __future__ import annotations

import copy
import inspect
import logging

from packaging.version import Version

from .versions import installed_version, untested_ceiling

logger = logging.getLogger("hf_lsce")

# The liger-kernel releases hf_lsce's patch ran beside (benchmarks/bench_trainer.py, the frameworks' GPU grids); a
# newer minor release may patch a family differently (its forward rather than its modules), so it is refused unless
# HF_LSCE_UNTESTED_FRAMEWORK=1, as the framework integrations' newer releases are
LIGER_TESTED = ("0.8.1", "0.8.5")
# Liger's loss kernels: each would replace the loss hf_lsce computes
LOSS_KERNELS = ("fused_linear_cross_entropy", "cross_entropy")


def liger_problem() -> str | None:
    """One line saying why the installed liger-kernel cannot run beside the patch (outside the tested range), or None
    (tested, or not installed: the caller says what that means where it matters)."""
    found = installed_version("liger-kernel")
    if found is None:
        return None
    low, high = LIGER_TESTED
    if Version(found) < Version(low):
        return (f"hf_lsce runs beside liger-kernel {low} to {high}, found {found}: pip install -U "
                f"'liger-kernel>={low}'")
    ceiling = untested_ceiling(found, high)
    if ceiling is not None:
        return (f"hf_lsce runs beside liger-kernel {low} to {high}, found {found}: pip install "
                f"'liger-kernel<{ceiling}', or set HF_LSCE_UNTESTED_FRAMEWORK=1 to try it untested")
    return None


def without_its_loss(config: dict | None, where: str) -> dict:
    """Liger's kernel configuration ``config`` with its loss kernels off. A ``ValueError`` naming ``where`` (the
    argument or key the configuration came from) where it asks for one of them, or where liger-kernel is outside the
    tested range."""
    config = dict(config or {})
    asked = [k for k in LOSS_KERNELS if config.get(k)]
    if asked:
        raise ValueError(
            f"{where} asks for Liger-Kernel's own loss ({', '.join(f'{k}=True' for k in asked)}) beside hf_lsce's "
            "patch: hf_lsce's fused label-smoothed loss runs, Liger's RMSNorm / RoPE / MLP kernels beside it. Remove "
            f"{' and '.join(asked)} from {where}, or revert the patch to train with Liger's loss.")
    problem = liger_problem()
    if problem is not None:
        raise ValueError(f"{where}: {problem}")
    return {**config, **{k: False for k in LOSS_KERNELS}}


def _apply_fn(model_type: str | None):
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)


def apply_liger_kernels(model=None, *, model_types=(), config: dict | None = None,
                        where: str = "liger_kernels") -> list[str]:
    """Liger-Kernel's kernels with its loss kernels off, on ``model`` (an instance: its modules, under any wrapper
    accelerate or PEFT know) or, without one, on the classes of ``model_types`` (before the model loads). ``config``:
    Liger's kernel switches (``{"rope": False}``...). Returns the model types Liger had kernels for; the others train
    with hf_lsce alone, said in one log line."""
    from .models import unwrap_model

    off = without_its_loss(config, where)
    target = unwrap_model(model) if model is not None else None
    if target is not None:
        model_types = [getattr(getattr(target, "config", None), "model_type", None)]
    done, without = [], []
    for model_type in model_types:
        apply = _apply_fn(model_type)
        if apply is None:
            without.append(str(model_type))
            continue
        params = inspect.signature(apply).parameters
        apply(**{k: v for k, v in off.items() if k in params}, **({"model": target} if target is not None else {}))
        done.append(model_type)
    if done:
        logger.info("%s: Liger-Kernel's kernels for %s, its loss kernels off (%s); hf_lsce computes the loss", where,
                    ", ".join(done), ", ".join(f"{k}=False" for k in LOSS_KERNELS))
    if without:
        logger.warning("%s: Liger-Kernel has no kernels for model type %s; %s with hf_lsce's loss alone", where,
                       ", ".join(without), "it trains" if len(without) == 1 else "they train")
    return done


def trainer_args(args, where: str = "use_liger_kernel"):
    """The Trainer's arguments for a patched model: ``args`` itself unless it sets ``use_liger_kernel`` with
    liger-kernel installed; then a shallow copy whose ``liger_kernel_config`` turns Liger's loss kernels off (the
    user's object is not changed), which the Trainer hands to Liger when it applies its kernels. Without liger-kernel
    the Trainer raises its own ImportError, unchanged."""
    if not getattr(args, "use_liger_kernel", False) or installed_version("liger-kernel") is None:
        return args
    current = getattr(args, "liger_kernel_config", None)
    off = without_its_loss(current, "liger_kernel_config" if current else where)
    if current == off:
        return args
    args = copy.copy(args)
    args.liger_kernel_config = off
    return args
