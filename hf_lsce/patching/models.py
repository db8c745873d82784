"""The one table of supported model families and their quirks.

A family is supported when the fused op reproduces its causal-LM loss exactly: logits are
``lm_head(last_hidden_state)`` (no scaling), optionally soft-capped by ``final_logit_softcapping``.
Anything else fails closed with a message listing what is supported.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FamilySpec:
    module: str  # transformers module holding the classes
    classes: tuple[str, ...]  # the *ForCausalLM (and text-path) classes we patch
    backbone: str = "model"  # attribute of the causal LM that returns last_hidden_state


MODEL_TABLE: dict[str, FamilySpec] = {
    "llama": FamilySpec("transformers.models.llama.modeling_llama", ("LlamaForCausalLM",)),
    "mistral": FamilySpec("transformers.models.mistral.modeling_mistral", ("MistralForCausalLM",)),
    "gemma": FamilySpec("transformers.models.gemma.modeling_gemma", ("GemmaForCausalLM",)),
    "gemma2": FamilySpec("transformers.models.gemma2.modeling_gemma2", ("Gemma2ForCausalLM",)),
    "gemma3_text": FamilySpec("transformers.models.gemma3.modeling_gemma3", ("Gemma3ForCausalLM",)),
    "gemma3": FamilySpec("transformers.models.gemma3.modeling_gemma3", ("Gemma3ForConditionalGeneration",)),
    "qwen2": FamilySpec("transformers.models.qwen2.modeling_qwen2", ("Qwen2ForCausalLM",)),
    "qwen3": FamilySpec("transformers.models.qwen3.modeling_qwen3", ("Qwen3ForCausalLM",)),
}

# Config attributes that scale logits in some families: the fused op does not reproduce them.
_LOGIT_SCALING_ATTRS = ("logit_scale", "logits_scaling", "output_multiplier", "lm_head_multiplier")


def supported_message() -> str:
    names = ", ".join(f"{k} ({'/'.join(v.classes)})" for k, v in MODEL_TABLE.items())
    return f"hf_lsce supports: {names}."


def family_classes(model_type: str) -> list[type]:
    """The classes of one family (import errors surface as a clear message)."""
    if model_type not in MODEL_TABLE:
        raise ValueError(f"model_type={model_type!r} is not supported. {supported_message()}")
    spec = MODEL_TABLE[model_type]
    try:
        mod = importlib.import_module(spec.module)
    except ImportError as e:  # pragma: no cover - depends on the installed transformers
        raise ValueError(f"transformers has no module {spec.module} ({e}); upgrade transformers.") from e
    return [getattr(mod, c) for c in spec.classes if hasattr(mod, c)]


def text_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def softcap_of(model) -> float | None:
    cap = getattr(text_config(model), "final_logit_softcapping", None)
    return float(cap) if cap else None


def output_head(model) -> torch.nn.Module:
    """The module whose weight (and bias) the op uses: the lm_head, or under PEFT's
    ``modules_to_save=["lm_head"]`` the trainable copy of the active adapter (the original when adapters are
    disabled), exactly the module PEFT's wrapper would call."""
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (lm_head); nothing to fuse.")
    if hasattr(head, "modules_to_save") and hasattr(head, "original_module"):  # peft ModulesToSaveWrapper
        active = list(getattr(head, "active_adapters", []) or [])
        if head.disable_adapters or not active or any(a not in head.modules_to_save for a in active):
            return head.original_module
        if len(active) > 1:
            raise ValueError(f"the lm_head has {len(active)} active modules_to_save adapters {active}; hf_lsce uses one "
                             "head. Activate one adapter (model.set_adapter(name)).")
        return head.modules_to_save[active[0]]
    return head


def own_class(module) -> type:
    """The module's own class, looking through wrappers that subclass it dynamically (FSDP2's
    ``fully_shard`` turns a ``LlamaForCausalLM`` into an ``FSDPLlamaForCausalLM``, an ``nn.Linear``
    into an ``FSDPLinear``)."""
    return next((c for c in type(module).__mro__ if not c.__module__.startswith("torch.distributed")),
                type(module))


def unwrap_model(model):
    """The causal LM under the wrappers users train through, found with what the ecosystem provides rather than a
    list of wrapper types: accelerate's ``extract_model_from_parallel`` (DDP, DataParallel, DeepSpeed's engine,
    FSDP1, ``torch.compile``) and PEFT's ``get_base_model()``, repeated until neither changes the model. FSDP2 needs
    nothing: ``fully_shard`` keeps the module itself (see :func:`own_class`)."""
    from accelerate.utils import extract_model_from_parallel

    m = model
    for _ in range(16):
        inner = extract_model_from_parallel(m, keep_torch_compile=False)
        if inner is m and callable(getattr(type(m), "get_base_model", None)):
            inner = m.get_base_model()
        if inner is m or not isinstance(inner, torch.nn.Module):
            break
        m = inner
    return m


def check_supported(model) -> FamilySpec:
    """Raise ValueError (fail closed) unless the fused op reproduces this model's loss exactly."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in MODEL_TABLE:
        raise ValueError(f"{type(model).__name__} (model_type={model_type!r}) is not supported. {supported_message()}")
    spec = MODEL_TABLE[model_type]
    name = own_class(model).__name__
    if name not in spec.classes:
        raise ValueError(
            f"{name} is not a supported class for model_type={model_type!r}; "
            f"expected one of {spec.classes}. {supported_message()}")
    cfg = text_config(model)
    tp = getattr(cfg, "pretraining_tp", 1) or 1
    if tp > 1:
        raise ValueError(
            f"config.pretraining_tp={tp}: the model splits its lm_head into slices; hf_lsce does not reproduce "
            "that. Set config.pretraining_tp = 1 (the same function, computed in one piece) and patch again.")
    for attr in _LOGIT_SCALING_ATTRS:
        val = getattr(cfg, attr, None)
        if val is not None and val != 1:
            raise ValueError(f"config.{attr}={val} scales the logits; hf_lsce does not reproduce logit scaling.")
    if name == "Gemma3ForConditionalGeneration" and softcap_of(model) is not None:
        raise ValueError(
            "Gemma3ForConditionalGeneration with final_logit_softcapping: its gradients through the fused op are "
            "not yet verified against Hugging Face's, so hf_lsce refuses it. Train the text model "
            "(Gemma3ForCausalLM) or set text_config.final_logit_softcapping = None.")
    head = output_head(model)
    if own_class(head) is not torch.nn.Linear:  # FSDPLinear (a separately wrapped head) is one
        if hasattr(head, "lora_A") or hasattr(head, "base_layer"):
            raise ValueError(
                f"the lm_head carries a PEFT adapter ({type(head).__module__}.{type(head).__name__}); hf_lsce computes "
                "the loss from the head's weight and cannot apply an adapter to it. Keep \"lm_head\" out of the "
                "LoRA target_modules; to train the head, use modules_to_save=[\"lm_head\"] (supported exactly).")
        raise ValueError(
            f"the lm_head is a {type(head).__module__}.{type(head).__name__}, not a plain nn.Linear (a quantised "
            "or wrapped head?). hf_lsce cannot reproduce it exactly: keep the lm_head a plain nn.Linear "
            "(unquantised, not an adapter's target), then patch.")
    return spec
