"""Trainer / SFTTrainer glue: ``label_smoothing_factor`` (or ``apply_lsce_patch(label_smoothing=b)``) drives
the fused op, and every training step proves that it did.

Unpatched, ``Trainer`` with ``label_smoothing_factor=b`` pops the labels, builds the full logits and
applies its ``LabelSmoother``; TRL's ``SFTTrainer`` does the same and runs a second, fused forward for
its metrics. With a patched model the hook on ``compute_loss`` (the point where the loss is computed)
hands b to the model and switches the ``LabelSmoother`` off, so the labels reach the patched forward,
the loss is ``sum / num_items_in_batch`` (exact under gradient accumulation) and no logits are built.

Engagement is checked, not assumed: around each training ``compute_loss`` the hook counts the fused
calls of the patched forward. If none ran, or one ran with another smoothing than the one asked for,
training stops with the reason (b > 0: the loss would be wrong or silently unfused) or warns once
(b = 0: the loss is Hugging Face's own, only the memory saving is lost).

TRL: ``SFTTrainer`` installs its own fused LM head on the model (``add_fused_lm_head``), which has no
smoothing and, built with ``functools.wraps``, looks like the forward it wraps. For a patched model the
hook skips it, because the patched forward answers TRL's ``fused_lm_head=True`` protocol itself (per-token
``log_probs`` = minus the smoothed loss, ``entropy``, ``is_top1``), so TRL's loss, ``entropy`` and
``mean_token_accuracy`` logs come from the fused op. TRL's warning that ``label_smoothing_factor`` costs
an extra forward pass is replaced by one accurate line when the patch handles the smoothing.
"""
from __future__ import annotations

import functools
import inspect
import logging
import warnings

import torch

logger = logging.getLogger(__name__)

# (class, attribute) -> original, for everything the hooks replace
_ORIGINALS: dict[tuple[object, str], object] = {}
_HOOKS: set = set()  # the hook functions, recognised by identity

_TRL_SMOOTHING_WARNING = "`label_smoothing_factor` is deprecated in `SFTTrainer`"


class LsceNotEngagedError(RuntimeError):
    """A training step of a patched model did not run through the fused op with the smoothing asked for."""


def requested_smoothing(trainer, target) -> tuple[float, str]:
    """(b, where it came from): ``apply_lsce_patch(label_smoothing=...)`` wins over the Trainer's flag."""
    explicit = getattr(target, "_lsce_explicit_smoothing", None)
    b_args = float(getattr(trainer.args, "label_smoothing_factor", 0.0) or 0.0)
    if explicit is not None:
        if b_args and b_args != explicit and not getattr(trainer, "_lsce_warned_override", False):
            logger.warning("apply_lsce_patch(label_smoothing=%s) overrides label_smoothing_factor=%s.", explicit, b_args)
            trainer._lsce_warned_override = True
        return float(explicit), "apply_lsce_patch(label_smoothing=...)"
    return b_args, "label_smoothing_factor"


def route_smoothing(trainer, model):
    """Move the Trainer's smoothing into a patched model and switch its LabelSmoother off.

    ``model`` is what the step calls (wrapped by DDP, DeepSpeed, FSDP, PEFT...); the Trainer's own ``self.model`` is
    looked at too. Returns ``(target, b, source)`` for a patched model, None otherwise (the Trainer then runs as
    stock)."""
    from . import find_patched

    target = find_patched(model, getattr(trainer, "model", None))
    if target is None:
        return None
    b, source = requested_smoothing(trainer, target)
    if getattr(target, "_lsce_explicit_smoothing", None) is None:
        target._lsce_label_smoothing = b
    trainer.label_smoother = None
    return target, b, source


def _where(f) -> str:
    """A function's real name and place, from its code object (functools.wraps copies names, not code)."""
    code = getattr(f, "__code__", None)
    if code is None:
        return f"{type(f).__module__}.{type(f).__qualname__} object"
    parts = code.co_filename.replace("\\", "/").split("/")
    short = "/".join(parts[-3:]) if "site-packages" not in parts else "/".join(parts[parts.index("site-packages") + 1:])
    return f"{code.co_name} ({short}:{code.co_firstlineno})"


def describe_forward(model) -> str:
    """The functions a call of ``model.forward`` goes through, outermost first (for messages)."""
    from .forward import is_ours

    names, fn = [], model.__dict__.get("forward", None)
    if fn is None:
        fn = type(model).forward
    for _ in range(8):
        f = getattr(fn, "__func__", fn)
        if is_ours(f):
            names.append("hf_lsce's patched forward")
            break
        names.append(_where(f))
        nxt = getattr(f, "model_forward", None) or getattr(f, "__wrapped__", None)  # accelerate, then wraps
        if nxt is None or nxt is f:
            break
        fn = nxt
    return " -> ".join(dict.fromkeys(names))


def _not_engaged_reason(trainer, target) -> str:
    from .forward import ENGAGEMENT

    if getattr(trainer, "compute_loss_func", None) is not None:
        return ("the Trainer has a compute_loss_func, which needs the full logits; hf_lsce cannot compute a custom "
                "loss. Remove compute_loss_func to train through the fused op")
    if ENGAGEMENT.last_unfused_reason:
        return f"the patched forward ran but did not fuse: {ENGAGEMENT.last_unfused_reason}"
    return (f"the patched forward was never called: the model's forward is {describe_forward(target)}, and what "
            "runs does not reach hf_lsce's forward (a wrapper installed before the patch, or another library's fused "
            "loss such as Liger-Kernel's?). Apply the patch before creating the Trainer, and do not combine it with "
            "another fused loss")


# torch.compile modes whose steps are CUDA-graph replays (after the recorded warm-up calls)
_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def _replays_cuda_graphs(trainer) -> bool:
    """The Trainer compiles the model with a mode that captures CUDA graphs: its replayed steps run no Python, so the
    op cannot report them (it reported the recorded calls, which captured it)."""
    args = getattr(trainer, "args", None)
    return bool(getattr(args, "torch_compile", False)) and getattr(args, "torch_compile_mode", None) in \
        _CUDA_GRAPH_MODES and torch.cuda.is_available()


def _verify_engaged(trainer, target, b: float, source: str, before: int) -> None:
    from .forward import ENGAGEMENT

    ran = ENGAGEMENT.fused_calls - before
    used = list(ENGAGEMENT.smoothing)
    name = type(target).__name__
    if not ran and getattr(trainer, "_lsce_confirmed", False) and _replays_cuda_graphs(trainer):
        if not getattr(trainer, "_lsce_replay_noted", False):
            logger.info("%s: this step replayed a captured CUDA graph (torch_compile_mode=%r), which runs no Python: "
                        "the fused op is in that graph (it ran when the graph was recorded); replayed steps are not "
                        "counted", name, trainer.args.torch_compile_mode)
            trainer._lsce_replay_noted = True
        return
    if ran and all(abs(x - b) <= 1e-12 for x in used):
        if not getattr(trainer, "_lsce_confirmed", False):
            logger.info("%s: the first training step ran through the fused op (label_smoothing=%s from %s; no logits "
                        "built)", name, b, source)
            trainer._lsce_confirmed = True
        return
    if ran:
        raise LsceNotEngagedError(
            f"{name}: the fused op ran with label_smoothing={sorted(set(used))}, but {source} asks for {b}. A "
            "label_smoothing argument passed to the forward overrides it; remove it, or patch with the value you want.")
    reason = _not_engaged_reason(trainer, target)
    if b > 0 or getattr(trainer.args, "use_liger_kernel", False):  # (Liger beside the patch: its loss must not run)
        raise LsceNotEngagedError(
            f"{name} is patched by hf_lsce and {source} asks for smoothing {b}, but this training step did not run "
            f"through the fused op: {reason}.")
    if not getattr(trainer, "_lsce_warned_unfused", False):
        logger.warning("%s is patched by hf_lsce but this training step did not run through the fused op: %s. The "
                       "loss is Hugging Face's own (no smoothing asked for), computed from full logits.", name, reason)
        trainer._lsce_warned_unfused = True


def _warn_unsupported(trainer, model) -> None:
    from .forward import ORIGINAL_CLASS_FORWARDS
    from .models import supported_message, unwrap_model

    if ORIGINAL_CLASS_FORWARDS and not getattr(trainer, "_lsce_warned_unsupported", False):
        trainer._lsce_warned_unsupported = True
        target = unwrap_model(model)
        logger.warning("%s is not patched by hf_lsce (not a supported class); it trains with Hugging Face's own loss "
                       "on full logits. %s", type(target).__name__, supported_message())


def trl_defaults_to_chunked_loss() -> bool:
    """Whether the installed TRL's SFTTrainer defaults to its chunked loss (``loss_type="chunked_nll"``: TRL 1.x after
    that loss and before its fused head, 1.9 to 1.14), which stock TRL cannot smooth (it crashes under the
    LabelSmoother; its ``"nll"`` loss smooths)."""
    try:
        import trl.trainer.sft_trainer as sft_module
    except Exception:  # noqa: BLE001 - TRL is optional at runtime
        return False
    return hasattr(sft_module, "_patch_chunked_ce_lm_head") and not hasattr(sft_module, "add_fused_lm_head")


def sft_protocol(trainer) -> str | None:
    """How the installed TRL's ``SFTTrainer.compute_loss`` reads its logged token statistics, for a patched model
    (None for any other trainer): ``"fused"`` (TRL with ``add_fused_lm_head``: the model is called with
    ``fused_lm_head=True``, which the patched forward answers), ``"chunked"`` (TRL 1.x before that, with
    ``loss_type="chunked_nll"``: it reads ``num_valid_tokens``, ``entropy_sum`` and ``num_correct_tokens`` from the
    output, which the patched forward then returns, :class:`~.forward.TokenStatsCausalLMOutput`) or ``"logits"``
    (TRL 0.x, or TRL 1.x with ``loss_type="nll"``: it computes them from the output's logits, which the patch does not
    build; the hook then hands it a view of its arguments with ``use_liger_kernel=True``, TRL's own switch for a
    model without logits, and logs the two statistics, and a mixture of experts' ``aux_loss`` that TRL logs beside
    them, itself from the op's)."""
    try:
        import trl.trainer.sft_trainer as sft_module
        from trl import SFTTrainer
    except Exception:  # noqa: BLE001 - TRL is optional at runtime
        return None
    if not isinstance(trainer, SFTTrainer) or getattr(trainer.args, "use_liger_kernel", False):
        return None
    if hasattr(sft_module, "add_fused_lm_head"):
        return "fused"
    if trl_defaults_to_chunked_loss() and getattr(trainer.args, "loss_type", None) == "chunked_nll":
        return "chunked"
    return "logits"


class _ArgsView:
    """``args`` with some attributes read as other values, for the duration of one call; the object itself (the
    user's) is not changed."""

    def __init__(self, args, **values):
        self.__dict__["_args"], self.__dict__["_values"] = args, values

    def __getattr__(self, name):
        values = self.__dict__["_values"]
        return values[name] if name in values else getattr(self.__dict__["_args"], name)

    def __setattr__(self, name, value):
        setattr(self.__dict__["_args"], name, value)


def _call_with_token_stats(self, orig, target, protocol, model, inputs, args, kwargs):
    """``orig`` (TRL's compute_loss) with the patched model returning its token statistics; for the ``"logits"``
    protocol (:func:`sft_protocol`), TRL's logits-based statistics switched off for the call and the op's logged in
    their place."""
    target.__dict__["_lsce_token_stats"] = protocol
    try:
        if protocol == "chunked":
            return orig(self, model, inputs, *args, **kwargs)
        return_outputs = kwargs.pop("return_outputs", args[0] if args else False)
        rest = dict(kwargs, num_items_in_batch=args[1]) if len(args) > 1 else kwargs
        saved = self.args
        self.args = _ArgsView(saved, use_liger_kernel=True)
        try:
            loss, outputs = orig(self, model, inputs, return_outputs=True, **rest)
        finally:
            self.args = saved
    finally:
        target.__dict__.pop("_lsce_token_stats", None)
    n = getattr(outputs, "num_valid_tokens", None)
    metrics = getattr(self, "_metrics", None)
    if n is not None and isinstance(metrics, dict):
        mode = "train" if self.model.training else "eval"
        gather = self.accelerator.gather_for_metrics
        n, ent, ok = (gather(t.detach()).sum() for t in (n, outputs.entropy_sum, outputs.num_correct_tokens))
        if n > 0:
            metrics[mode]["entropy"].append((ent / n).item())
            metrics[mode]["mean_token_accuracy"].append((ok / n).item())
        if getattr(self, "aux_loss_enabled", False) and getattr(outputs, "aux_loss", None) is not None:
            metrics[mode]["aux_loss"].append(gather(outputs.aux_loss.detach()).mean().item())  # skipped with them
    return (loss, outputs) if return_outputs else loss


def _hooked_compute_loss(orig):
    @functools.wraps(orig)
    def compute_loss(self, model, inputs, *args, **kwargs):
        if getattr(self, "_lsce_in_compute_loss", False):  # SFTTrainer -> Trainer.compute_loss: checked outside
            return orig(self, model, inputs, *args, **kwargs)
        routed = route_smoothing(self, model)
        if routed is None:
            _warn_unsupported(self, model)
            return orig(self, model, inputs, *args, **kwargs)
        target, b, source = routed
        from .forward import ENGAGEMENT

        training = bool(getattr(model, "training", False)) and torch.is_grad_enabled()
        before = ENGAGEMENT.start() if training else 0
        protocol = sft_protocol(self)
        self._lsce_in_compute_loss = True
        try:
            if protocol in ("chunked", "logits"):
                out = _call_with_token_stats(self, orig, target, protocol, model, inputs, args, kwargs)
            else:
                out = orig(self, model, inputs, *args, **kwargs)
        finally:
            self._lsce_in_compute_loss = False
        if training:
            _verify_engaged(self, target, b, source, before)
        return out
    _HOOKS.add(compute_loss)
    return compute_loss


def _shifted_count_batch(batch):
    """A micro-batch whose ``labels`` count as the shifted loss scores them: the first position of each row masked
    (no position predicts it), or the collator's ``shift_labels`` where it gives them. Other keys shared, not
    copied."""
    if not isinstance(batch, dict) or not torch.is_tensor(batch.get("labels")):
        return batch
    if torch.is_tensor(batch.get("shift_labels")):
        return {**batch, "labels": batch["shift_labels"]}
    labels = batch["labels"].clone()
    labels[..., 0] = -100
    return {**batch, "labels": labels}


def _hooked_num_items(orig):
    @functools.wraps(orig)
    def _get_num_items_in_batch(self, batch_samples, *args, **kwargs):
        """For a patched model, the Trainer's ``num_items_in_batch`` counts the labels the shifted loss scores.
        transformers before 5.x (4.57, 5.6) counted every label not -100, the first of each row too, which no position
        predicts: the fused loss, ``sum / num_items_in_batch``, would then be smaller than the LabelSmoother's mean
        by one token per row (4.31 against 5.27 on the test model). Later versions count ``labels[..., 1:]``, which
        the masked first column leaves unchanged. The installed Trainer still does the counting (and its gathering
        across processes)."""
        from . import find_patched

        if find_patched(getattr(self, "model", None)) is None:
            return orig(self, batch_samples, *args, **kwargs)
        return orig(self, [_shifted_count_batch(b) for b in batch_samples], *args, **kwargs)
    _HOOKS.add(_get_num_items_in_batch)
    return _get_num_items_in_batch


def _hooked_sft_init(orig):
    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        from . import find_patched

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            orig(self, *args, **kwargs)
        target = find_patched(self.model)
        handled = target is not None
        for w in caught:
            if handled and _TRL_SMOOTHING_WARNING in str(w.message):
                continue
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if handled:
            b, source = requested_smoothing(self, target)
            logger.info("SFTTrainer: %s is patched by hf_lsce; its loss (label_smoothing=%s from %s), entropy and "
                        "token accuracy come from the fused op in the model's forward: no logits, no extra forward "
                        "pass.", type(target).__name__, b, source)
    _HOOKS.add(__init__)
    return __init__


def _hooked_patch_chunked(orig):
    @functools.wraps(orig)
    def _patch_chunked_ce_lm_head(model, *args, **kwargs):
        from . import is_patched

        if is_patched(model):
            return None  # the patched forward returns the chunked loss's statistics itself (sft_protocol)
        return orig(model, *args, **kwargs)
    _HOOKS.add(_patch_chunked_ce_lm_head)
    return _patch_chunked_ce_lm_head


def _hooked_add_fused_lm_head(orig):
    @functools.wraps(orig)
    def add_fused_lm_head(model, *args, **kwargs):
        from . import is_patched

        if is_patched(model):
            return None  # the patched forward answers fused_lm_head=True itself, with the smoothing
        return orig(model, *args, **kwargs)
    _HOOKS.add(add_fused_lm_head)
    return add_fused_lm_head


def _bind_calibration_callbacks(trainer) -> None:
    """A ``CalibrationCallback`` handed to the Trainer's constructor (LLaMA-Factory's route passes it to
    ``run_exp(callbacks=...)``) has no trainer to log through; bound here, its metrics reach ``trainer.log`` (the
    ``report_to`` integrations and the log history), as ``.attach(trainer)`` would."""
    from ..calibration.callback import CalibrationCallback

    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, CalibrationCallback) and callback.trainer is None:
            callback.trainer = trainer


def _hooked_init(orig):
    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        """A patched model and ``use_liger_kernel``: the Trainer gets arguments whose ``liger_kernel_config`` turns
        Liger's loss kernels off (``liger.trainer_args``), for a Trainer that applies Liger in ``__init__``
        (transformers before 5.x); later ones apply it when ``train()`` starts, which ``_hooked_train`` covers."""
        from . import find_patched
        from .liger import trainer_args

        try:
            bound = inspect.signature(orig).bind(self, *args, **kwargs)
        except TypeError:  # (the Trainer's own error, unchanged)
            return orig(self, *args, **kwargs)
        given = bound.arguments.get("args")
        if given is not None and find_patched(bound.arguments.get("model")) is not None:
            bound.arguments["args"] = trainer_args(given)
        orig(*bound.args, **bound.kwargs)
    _HOOKS.add(__init__)
    return __init__


def _hooked_train(orig):
    @functools.wraps(orig)
    def train(self, *args, **kwargs):
        from . import find_patched
        from .liger import trainer_args

        if find_patched(getattr(self, "model", None)) is not None:  # (also a model patched after the Trainer was built)
            self.args = trainer_args(self.args)
        _bind_calibration_callbacks(self)
        out = orig(self, *args, **kwargs)
        # The op checks its targets on the device and reports a bad batch at its next call (ops/checks.py); the last
        # step has no next call, so training ends by waiting for those checks (one synchronisation per run).
        from ..ops.checks import raise_pending_errors

        raise_pending_errors(block=True)
        return out
    _HOOKS.add(train)
    return train


def _targets():
    """(owner, attribute, hook factory) for everything hooked; TRL's only when it is installed."""
    from transformers import Trainer

    out = [(Trainer, "__init__", _hooked_init), (Trainer, "compute_loss", _hooked_compute_loss),
           (Trainer, "train", _hooked_train)]
    if "_get_num_items_in_batch" in Trainer.__dict__:
        out.append((Trainer, "_get_num_items_in_batch", _hooked_num_items))
    try:
        import trl.trainer.sft_trainer as sft_module
        from trl import SFTTrainer
    except Exception:  # noqa: BLE001 - TRL is optional at runtime
        return out
    out.append((SFTTrainer, "compute_loss", _hooked_compute_loss))
    out.append((SFTTrainer, "__init__", _hooked_sft_init))
    if hasattr(sft_module, "add_fused_lm_head"):
        out.append((sft_module, "add_fused_lm_head", _hooked_add_fused_lm_head))
    if hasattr(sft_module, "_patch_chunked_ce_lm_head"):
        out.append((sft_module, "_patch_chunked_ce_lm_head", _hooked_patch_chunked))
    return out


def install_trainer_hooks() -> None:
    for owner, attr, factory in _targets():
        current = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        if current is None or (owner, attr) in _ORIGINALS or current in _HOOKS:
            continue
        _ORIGINALS[(owner, attr)] = current
        setattr(owner, attr, factory(current))


def remove_trainer_hooks() -> None:
    for (owner, attr), orig in list(_ORIGINALS.items()):
        setattr(owner, attr, orig)
        del _ORIGINALS[(owner, attr)]
