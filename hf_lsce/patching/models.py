"""The one table of supported model families and their quirks.

A family is supported when the fused op reproduces its causal-LM loss exactly: logits are
``lm_head(last_hidden_state)`` (no scaling), optionally soft-capped by ``final_logit_softcapping``.
Anything else fails closed with a message listing what is supported.
"""
from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FamilySpec:
    """One family's classes and the quirks of its head that change the loss.

    ``scale``: where the family's forward reads a factor its logits are multiplied by (``"mul"``) or divided by
    (``"div"``), as ``(attribute path from the causal LM, op)``; the op then sees ``hidden * factor`` (and the bias
    times it), which is the same logits. ``router_aux``: a mixture-of-experts family whose forward, when
    ``output_router_logits`` is on and labels are given, adds ``router_aux_loss_coef * load_balancing_loss_func(...)``
    (the function of ``module``) to the loss; the patched forward adds the same term."""

    module: str  # transformers module holding the classes
    classes: tuple[str, ...]  # the *ForCausalLM (and text-path) classes we patch
    backbone: str = "model"  # attribute of the causal LM that returns last_hidden_state
    scale: tuple[str, str] | None = None
    router_aux: bool = False
    generic: bool = False  # not from the table: verified on the model itself (verify_generic)


def _spec(name: str, cls: str, **quirks) -> FamilySpec:
    return FamilySpec(f"transformers.models.{name}.modeling_{name}", (cls,), **quirks)


MODEL_TABLE: dict[str, FamilySpec] = {
    "llama": _spec("llama", "LlamaForCausalLM"),
    "mistral": _spec("mistral", "MistralForCausalLM"),
    "gemma": _spec("gemma", "GemmaForCausalLM"),
    "gemma2": _spec("gemma2", "Gemma2ForCausalLM"),  # final_logit_softcapping (read by softcap_of)
    "gemma3_text": _spec("gemma3", "Gemma3ForCausalLM"),
    "gemma3": _spec("gemma3", "Gemma3ForConditionalGeneration"),
    "qwen2": _spec("qwen2", "Qwen2ForCausalLM"),
    "qwen3": _spec("qwen3", "Qwen3ForCausalLM"),
    "phi3": _spec("phi3", "Phi3ForCausalLM"),
    "smollm3": _spec("smollm3", "SmolLM3ForCausalLM"),
    "olmo2": _spec("olmo2", "Olmo2ForCausalLM"),
    "olmo3": _spec("olmo3", "Olmo3ForCausalLM"),
    "glm4": _spec("glm4", "Glm4ForCausalLM"),
    "starcoder2": _spec("starcoder2", "Starcoder2ForCausalLM"),
    "granite": _spec("granite", "GraniteForCausalLM", scale=("config.logits_scaling", "div")),
    "cohere": _spec("cohere", "CohereForCausalLM", scale=("logit_scale", "mul")),
    "cohere2": _spec("cohere2", "Cohere2ForCausalLM", scale=("logit_scale", "mul")),
    "llama4_text": _spec("llama4", "Llama4ForCausalLM"),  # returns router logits, adds no auxiliary loss
    "mixtral": _spec("mixtral", "MixtralForCausalLM", router_aux=True),
    "qwen2_moe": _spec("qwen2_moe", "Qwen2MoeForCausalLM", router_aux=True),
    "qwen3_moe": _spec("qwen3_moe", "Qwen3MoeForCausalLM", router_aux=True),
    "olmoe": _spec("olmoe", "OlmoeForCausalLM", router_aux=True),
    "gpt_oss": _spec("gpt_oss", "GptOssForCausalLM", router_aux=True),
}

# Config attributes that scale logits in some families: a family whose spec does not name the one it has is refused.
_LOGIT_SCALING_ATTRS = ("logit_scale", "logits_scaling", "output_multiplier", "lm_head_multiplier")


def supported_message() -> str:
    return (f"hf_lsce supports: {', '.join(MODEL_TABLE)} (model_type); a causal LM of another family is patched by "
            "apply_lsce_patch(model) after a check on the model itself that the fused loss is its own.")


def family_classes(model_type: str, missing_ok: bool = False) -> list[type]:
    """The classes of one family. A family the installed transformers lacks raises a clear message, or gives no
    classes with ``missing_ok`` (the class patch of every family)."""
    if model_type not in MODEL_TABLE:
        raise ValueError(f"model_type={model_type!r} is not in hf_lsce's table of families, so its classes cannot be "
                         "patched ahead of time; patch the loaded model instead (apply_lsce_patch(model)), which "
                         f"verifies it. {supported_message()}")
    spec = MODEL_TABLE[model_type]
    try:
        mod = importlib.import_module(spec.module)
    except ImportError as e:
        if missing_ok:
            return []
        raise ValueError(f"transformers has no module {spec.module} ({e}); upgrade transformers.") from e
    return [getattr(mod, c) for c in spec.classes if hasattr(mod, c)]


def text_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def softcap_of(model) -> float | None:
    """The soft-cap the model's own forward applies to its logits: the config's ``final_logit_softcapping`` where the
    class's forward (Hugging Face's, read through the patch's ``__wrapped__``) applies it, else None. A config may
    carry the attribute for a class that ignores it: transformers 5.x's ``Gemma3ForConditionalGeneration`` returns
    the head's logits uncapped where ``Gemma3ForCausalLM`` caps them, and a converted checkpoint can carry a stray
    one. Where the forward's source cannot be read, the config's value (``check_supported`` refuses that case)."""
    return config_softcap(model.config, own_class(model))


def config_softcap(config, cls: type | None = None) -> float | None:
    """:func:`softcap_of` from a config alone: the class is ``cls``, else the config's first ``architectures`` entry
    in transformers (none found: the config's value)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    cap = getattr(cfg, "final_logit_softcapping", None)
    if not cap:
        return None
    if cls is None:
        import transformers

        cls = getattr(transformers, (getattr(config, "architectures", None) or [""])[0] or "", None)
    return float(cap) if cls is None or _applies_softcap(cls) is not False else None


@functools.lru_cache(maxsize=None)
def _applies_softcap(cls: type) -> bool | None:
    """Whether the forward ``cls`` runs (the first in its MRO, unwrapped past decorators and the patch) reads
    ``final_logit_softcapping``; None where its source cannot be read, or is not a forward that makes logits (a
    decorator that hides the function it wraps)."""
    fn = next((k.__dict__["forward"] for k in cls.__mro__ if "forward" in k.__dict__), None)
    try:
        src = inspect.getsource(inspect.unwrap(fn))
    except (OSError, TypeError):
        return None
    return "final_logit_softcapping" in src if "logits" in src else None


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
    cls = type(module)
    if not cls.__module__.startswith("torch.distributed"):  # (first: torch 2.6's dynamo cannot read object.__module__)
        return cls
    return next((c for c in cls.__mro__ if not c.__module__.startswith("torch.distributed")), cls)


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


def table_spec(model) -> FamilySpec | None:
    """The table's entry for this model's class, or None (a family or a class the table does not list)."""
    spec = MODEL_TABLE.get(getattr(model.config, "model_type", None))
    return spec if spec is not None and own_class(model).__name__ in spec.classes else None


def check_supported(model) -> FamilySpec:
    """The model's :class:`FamilySpec`; raise ValueError (fail closed) unless the fused op reproduces its loss exactly:
    a class of the table, or a model :func:`verify_generic` verified (``apply_lsce_patch(model)`` runs it)."""
    spec = table_spec(model) or model.__dict__.get("_lsce_generic_spec")
    if spec is None:
        model_type = getattr(model.config, "model_type", None)
        raise ValueError(f"{own_class(model).__name__} (model_type={model_type!r}) is not in hf_lsce's table and was "
                         f"not verified. {supported_message()}")
    cfg = text_config(model)
    tp = getattr(cfg, "pretraining_tp", 1) or 1
    if tp > 1:
        raise ValueError(
            f"config.pretraining_tp={tp}: the model splits its lm_head into slices; hf_lsce does not reproduce "
            "that. Set config.pretraining_tp = 1 (the same function, computed in one piece) and patch again.")
    if not spec.generic:  # a verified model's logits were seen to be the head's output, whatever its config says
        own = spec.scale[0].rsplit(".", 1)[-1] if spec.scale else None
        for attr in _LOGIT_SCALING_ATTRS:
            val = getattr(cfg, attr, None)
            if attr != own and val is not None and val != 1:
                raise ValueError(f"config.{attr}={val} scales the logits, and {own_class(model).__name__}'s entry in "
                                 "hf_lsce's table does not say how; hf_lsce does not reproduce that scaling.")
    if getattr(cfg, "final_logit_softcapping", None) and _applies_softcap(own_class(model)) is None:
        raise ValueError(
            f"config.final_logit_softcapping={cfg.final_logit_softcapping}, and the source of "
            f"{own_class(model).__name__}.forward cannot be read to tell whether it applies it (transformers "
            "installed without its .py files?); hf_lsce does not guess. Install transformers from its wheel.")
    _check_head(output_head(model))
    return spec


def _check_head(head) -> None:
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


def logit_scale_of(model, spec: FamilySpec | None = None) -> float | None:
    """The factor the family's forward multiplies its logits by (None: 1), read where that forward reads it.
    ``spec`` defaults to the table's entry (a model outside the table scales nothing: its check proved it)."""
    spec = spec or table_spec(model)
    if spec is None or spec.scale is None:
        return None
    path, op = spec.scale
    value = model
    for part in path.split("."):
        value = getattr(value, part)
    factor = float(value) if op == "mul" else 1.0 / float(value)
    return None if factor == 1.0 else factor


def router_aux_loss(model, spec: FamilySpec, router_logits, attention_mask):
    """A mixture-of-experts family's load-balancing loss, by the function and the attributes its own forward uses."""
    balance = importlib.import_module(spec.module).load_balancing_loss_func
    return balance(router_logits, model.num_experts, model.num_experts_per_tok, attention_mask)


# The short random input verify_generic runs the model's own forward on.
_VERIFY_TOKENS = 16


def verify_generic(model) -> FamilySpec:
    """Verify, on the model itself, that a causal LM outside the table computes its loss the way the fused op does,
    and return its :class:`FamilySpec`; otherwise raise ValueError with the reason.

    Structure first: a backbone module (``.model``, else the ``base_model_prefix`` attribute), a plain ``nn.Linear``
    head, no ``final_logit_softcapping`` its forward applies (:func:`softcap_of`). Then the model's own forward runs
    once (evaluation mode, no gradient) on a short random input with labels, with hooks on the backbone and the
    head: the head must be called once, on the backbone's last hidden state unchanged; the returned logits must be
    the head's output unchanged (no scaling, soft-cap or other transform, whatever its size); the returned loss must
    be the shifted cross-entropy of those logits (no extra term, such as a router's auxiliary loss). These are
    equalities, so a transform that changes the logits little (a soft-cap of small logits) fails them as surely as a
    large one."""
    name = own_class(model).__name__
    prefix = getattr(model, "base_model_prefix", "") or ""
    attr = next((a for a in ("model", prefix) if a and isinstance(getattr(model, a, None), torch.nn.Module)), None)
    if attr is None or getattr(model, attr) is model:
        raise ValueError(f"{name} is not in hf_lsce's table and has no backbone module (.model or .{prefix or '?'}) "
                         f"returning the last hidden state, so the patch cannot verify it. {supported_message()}")
    backbone, head = getattr(model, attr), output_head(model)
    _check_head(head)
    if softcap_of(model) is not None:
        raise ValueError(f"{name} is not in hf_lsce's table and its config sets final_logit_softcapping="
                         f"{softcap_of(model)}; the table does not say how this family applies it. "
                         f"{supported_message()}")
    weight = head.weight
    if weight.is_meta or weight.numel() == 0:
        raise ValueError(f"{name}'s lm_head weight is not materialised (meta device, or partitioned by DeepSpeed "
                         "ZeRO-3), so the check cannot run its forward; apply_lsce_patch(model) before sharding it.")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, weight.shape[0], (1, _VERIFY_TOKENS), generator=g)
    emb = model.get_input_embeddings()
    ids = ids.to(emb.weight.device if emb is not None else weight.device)
    labels = ids.clone()
    labels[:, :3] = -100
    seen: dict[str, list] = {"head": [], "backbone": []}
    hooks = [head.register_forward_hook(lambda m, i, o: seen["head"].append((i[0], o))),
             backbone.register_forward_hook(lambda m, i, o: seen["backbone"].append(o))]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(input_ids=ids, labels=labels, return_dict=True)
    except Exception as e:
        raise ValueError(f"{name} is not in hf_lsce's table, and the check could not run its forward on a short random "
                         f"input ({type(e).__name__}: {e}). {supported_message()}") from e
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)

    def refuse(why: str):
        raise ValueError(f"{name} is not in hf_lsce's table and failed the check on the model itself: {why}. The fused "
                         f"loss would not be this model's loss, so it is not patched. {supported_message()}")

    if len(seen["head"]) != 1 or len(seen["backbone"]) != 1:
        refuse(f"its forward called the backbone {len(seen['backbone'])} and the lm_head {len(seen['head'])} times "
               "(once each expected)")
    (head_in, head_out), bb = seen["head"][0], seen["backbone"][0]
    last = getattr(bb, "last_hidden_state", None)
    if last is None and isinstance(bb, (tuple, list)):
        last = bb[0]
    if not (torch.is_tensor(last) and head_in.shape == last.shape and torch.equal(head_in, last)):
        refuse("the lm_head's input is not the backbone's last hidden state (the forward transforms it first)")
    logits = getattr(out, "logits", None)
    if not (torch.is_tensor(logits) and logits.shape == head_out.shape and torch.equal(logits.float(), head_out.float())):
        refuse("the logits it returns are not the lm_head's output (a scaling, soft-cap or other transform that the "
               "table does not know)")
    if getattr(out, "aux_loss", None) is not None:
        refuse("it returns an auxiliary (router) loss, which the table does not know how to add")
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                            labels[:, 1:].reshape(-1).to(logits.device), ignore_index=-100)
    loss = getattr(out, "loss", None)
    if not (torch.is_tensor(loss) and torch.isfinite(ref) and abs(float(loss) - float(ref)) <= 1e-5 * abs(float(ref)) + 1e-6):
        refuse(f"its loss ({None if loss is None else float(loss)}) is not the shifted cross-entropy of its logits "
               f"({float(ref)}): its loss function is not the one the fused op computes")
    return FamilySpec(type(model).__module__, (name,), backbone=attr, generic=True)
