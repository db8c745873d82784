"""``ATSCalibrator``: a small head on a frozen causal LM that predicts a per-token inverse temperature.

Calibrated logits are ``logits * s`` with ``s = exp(h)`` clamped to [``min_scale``, ``max_scale``] (1e-4, 10), h the
head's output on the base's last hidden state. ``s > 0``, so the ranking of tokens, and so greedy
decoding and accuracy, never change: only the confidence does.

The base model is held outside the module tree: ``parameters()``, ``state_dict()`` and
``save_pretrained`` see the head only (a few MB next to a multi-GB base), and the optimizer of a
Trainer never touches the base. Device and dtype moves (``.to``) are forwarded to the base.
"""
from __future__ import annotations

import copy
import inspect
import math
import os

import torch
from torch import nn
from transformers import AutoModelForCausalLM, DynamicCache, LogitsProcessor, LogitsProcessorList, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from ..patching.models import logit_scale_of, output_head, softcap_of, text_config
from .configuration_ats import ATSConfig
from .loss import fused_selective_smoothing_loss, selective_smoothing_loss

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _backbone(model) -> nn.Module:
    """The module of a causal LM that returns ``last_hidden_state`` (after the final norm)."""
    for path in (("model", "language_model"), ("model",), ("transformer",)):
        m = model
        for part in path:
            m = getattr(m, part, None)
        if isinstance(m, nn.Module) and m is not model and (hasattr(m, "embed_tokens") or hasattr(m, "wte")):
            return m
    raise ValueError(f"{type(model).__name__} exposes no backbone returning hidden states (looked for .model and "
                     ".transformer); ATS needs the base's last hidden state")


class _CacheIgnored(RuntimeError):
    """The head's decoder layer was given a KV cache and did not use it (a transformers that names it otherwise)."""


class _TransformerHead(nn.Module):
    """One decoder layer of the base's own architecture and size, then a linear map to one value."""

    def __init__(self, base_cfg, backbone: nn.Module):
        super().__init__()
        cfg = copy.deepcopy(base_cfg)
        cfg.num_hidden_layers = 1
        if getattr(cfg, "layer_types", None) is not None:
            cfg.layer_types = ["full_attention"]
        if getattr(cfg, "_attn_implementation", None) not in ("eager", "sdpa"):
            cfg._attn_implementation = "sdpa"  # the head passes an explicit 4-D mask
        self.cfg = cfg
        layer_cls, rotary_cls = self._classes(cfg, backbone)
        self.layer = layer_cls(cfg, layer_idx=0)
        self.rotary = rotary_cls(config=cfg)
        self.out = nn.Linear(cfg.hidden_size, 1)
        params = inspect.signature(self.layer.forward).parameters  # the layer's KV-cache argument, read once
        self._cache_name = next((a for a in ("cache", "past_key_values", "past_key_value") if a in params), None)

    @staticmethod
    def _classes(cfg, backbone):
        if not (hasattr(backbone, "layers") and hasattr(backbone, "rotary_emb")):
            raise ValueError(f"head_type='transformer' needs a rotary decoder (Llama, Mistral, Gemma, Qwen); "
                             f"{type(backbone).__name__} is not one. Use head_type='mlp'")
        return type(backbone.layers[0]), type(backbone.rotary_emb)

    def cache_argument(self) -> str | None:
        """The name under which this transformers' decoder layer takes a KV cache (None: it takes none)."""
        return self._cache_name

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor, cache=None) -> torch.Tensor:
        """The head's output at every position of ``hidden``; with ``cache`` (a transformers ``Cache``), ``hidden``
        holds the positions after the cached ones, which it attends to too, and the cache takes their keys and
        values (``attention_mask``: 2-D, over every position so far)."""
        b, q, _ = hidden.shape
        past = cache.get_seq_length() if cache is not None else 0
        keys = torch.arange(past + q, device=hidden.device)
        rows = past + torch.arange(q, device=hidden.device)
        keep = (keys[None, :] <= rows[:, None])[None].expand(b, q, past + q)
        if attention_mask is not None:
            keep = keep & attention_mask[:, :past + q].bool()[:, None, :]
        keep = keep | (keys[None, :] == rows[:, None])[None]  # no empty rows (padding)
        mask = torch.zeros(b, 1, q, past + q, dtype=hidden.dtype, device=hidden.device)
        mask = mask.masked_fill(~keep[:, None], torch.finfo(hidden.dtype).min)
        try:
            pe = self.rotary(hidden, position_ids)
        except TypeError:  # Gemma3's rotary takes the layer type
            pe = self.rotary(hidden, position_ids, "full_attention")
        kw = {}
        if cache is not None:
            kw = {self.cache_argument(): cache, "use_cache": True, "cache_position": rows}
        out = self.layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=pe, **kw)
        if cache is not None and cache.get_seq_length() != past + q:
            raise _CacheIgnored("the ATS head's decoder layer did not take its KV cache")  # (the processor falls back)
        out = out[0] if isinstance(out, tuple) else out
        return self.out(out).squeeze(-1)


class _MLPHead(nn.Module):
    def __init__(self, d: int, width: int):
        super().__init__()
        self.fc = nn.Linear(d, width)
        self.act = nn.GELU()
        self.out = nn.Linear(width, 1)

    def forward(self, hidden, attention_mask, position_ids):
        return self.out(self.act(self.fc(hidden))).squeeze(-1)


class _LinearHead(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.out = nn.Linear(d, 1)

    def forward(self, hidden, attention_mask, position_ids):
        return self.out(hidden).squeeze(-1)


class _ScalarHead(nn.Module):
    """Temperature scaling: one log inverse temperature for every token."""

    def __init__(self):
        super().__init__()
        self.log_scale = nn.Parameter(torch.zeros(()))

    def forward(self, hidden, attention_mask, position_ids):
        return self.log_scale.expand(hidden.shape[:-1])


_FINGERPRINT_KEYS = ("model_type", "hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "intermediate_size", "head_dim")


def base_fingerprint(base_model) -> dict:
    """The base's architecture as far as a head trained on its hidden states depends on it."""
    tc = text_config(base_model)
    out = {k: getattr(tc, k, None) for k in _FINGERPRINT_KEYS}
    out["vocab_size"] = output_head(base_model).weight.shape[0]
    return {k: v for k, v in out.items() if v is not None}


class ATSCalibrator(PreTrainedModel):
    """A frozen causal LM plus a head predicting a per-token inverse temperature.

    Build one with ``ATSCalibrator.from_base(base_model, head_type="transformer")``; restore one with
    ``ATSCalibrator.from_pretrained(head_dir, base_model=model_or_name)`` (or ``AutoModel``). The
    forward returns calibrated ``logits`` and, with ``labels``, the selective smoothing loss; in
    training it takes the fused path (no N x V logits) unless the base is soft-capped or
    ``config`` asks otherwise (``loss_path="materialise"``).
    """

    config_class = ATSConfig
    base_model_prefix = "ats"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    accepts_loss_kwargs = False  # the loss is a per-batch ratio of means: the Trainer averages micro-batches
    _no_split_modules = []

    def __init__(self, config: ATSConfig, base_model=None):
        super().__init__(config)
        if base_model is None:
            raise ValueError("ATSCalibrator needs its frozen base model: ATSCalibrator(config, base_model) or "
                             "ATSCalibrator.from_pretrained(path, base_model=...)")
        self._set_base(base_model)
        d = self.base_text_config.hidden_size
        if config.head_type == "transformer":
            self.head = _TransformerHead(self.base_text_config, _backbone(base_model))
        elif config.head_type == "mlp":
            self.head = _MLPHead(d, config.mlp_hidden_size or d)
        elif config.head_type == "linear":
            self.head = _LinearHead(d)
        else:
            self.head = _ScalarHead()
        self.loss_path = "auto"
        self.post_init()
        self._zero_output()
        dev = next(base_model.parameters()).device
        self.head.to(device=dev, dtype=_DTYPES[config.head_dtype])

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_base(cls, base_model, head_type: str = "transformer", **config_kwargs) -> "ATSCalibrator":
        """A fresh head (initially the identity: s = 1) on ``base_model`` (a model or a path/hub name)."""
        base = _require_causal_lm(_load_base(base_model))
        tc = text_config(base)
        cfg = ATSConfig(base_model_name_or_path=getattr(base.config, "_name_or_path", None) or None,
                        head_type=head_type, base_hidden_size=tc.hidden_size,
                        base_vocab_size=output_head(base).weight.shape[0], base_model_type=base.config.model_type,
                        base_config=tc.to_dict() if head_type == "transformer" else None,
                        base_fingerprint=base_fingerprint(base), **config_kwargs)
        return cls(cfg, base)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, base_model=None, config=None, **kwargs):
        """Restore a saved head onto ``base_model`` (a model, a path or hub name; default: the one the
        head was trained on, ``config.base_model_name_or_path``)."""
        from safetensors.torch import load_file
        from transformers.utils import cached_file

        from ..outputs import require_complete

        require_complete(pretrained_model_name_or_path)  # a head whose training did not finish is refused
        if config is None or not isinstance(config, ATSConfig):
            config = ATSConfig.from_pretrained(pretrained_model_name_or_path)
        if base_model is None:
            if not config.base_model_name_or_path:
                raise ValueError("this ATS head does not name its base model; pass base_model=")
            base_model = config.base_model_name_or_path
        base = _load_base(base_model, dtype=kwargs.get("dtype", kwargs.get("torch_dtype", "auto")))
        model = cls(config, base)
        weights = cached_file(pretrained_model_name_or_path, "model.safetensors")
        state = load_file(weights)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"the checkpoint in {pretrained_model_name_or_path} does not fit this ATS head: missing "
                             f"{missing[:5]}, unexpected {unexpected[:5]}")
        return model.eval()

    def _set_base(self, base_model):
        _require_causal_lm(base_model)
        tc = text_config(base_model)
        cfg = self.config
        v = output_head(base_model).weight.shape[0]
        checks = [("base_hidden_size", cfg.base_hidden_size, tc.hidden_size), ("base_vocab_size", cfg.base_vocab_size, v),
                  ("base_model_type", cfg.base_model_type, base_model.config.model_type)]
        have = base_fingerprint(base_model)
        checks += [(k, want, have.get(k)) for k, want in (getattr(cfg, "base_fingerprint", None) or {}).items()]
        bad = [(n, want, got) for n, want, got in checks if want is not None and want != got]
        if bad:
            raise ValueError("this ATS head was trained for a different base model: " +
                             "; ".join(f"{n} is {got}, the head expects {want}" for n, want, got in bad) +
                             f". Pass the base it was trained on ({cfg.base_model_name_or_path})")
        for p in base_model.parameters():
            p.requires_grad_(False)
        base_model.eval()
        self.__dict__["base_model_lm"] = base_model  # outside the module tree, on purpose
        self.__dict__["base_text_config"] = tc

    def _zero_output(self):
        with torch.no_grad():
            out = getattr(self.head, "out", None)
            if out is not None:
                out.weight.zero_()
                out.bias.zero_()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    def _apply(self, fn, *args, **kwargs):
        super()._apply(fn, *args, **kwargs)
        self.base_model_lm._apply(fn, *args, **kwargs)
        return self

    def train(self, mode: bool = True):
        super().train(mode)
        self.base_model_lm.eval()  # the base stays frozen: no dropout
        return self

    def get_input_embeddings(self):
        return self.base_model_lm.get_input_embeddings()

    # ------------------------------------------------------------------------------ forward
    def _base_hidden(self, input_ids, attention_mask, position_ids):
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
            else:
                position_ids = torch.arange(input_ids.shape[-1], device=input_ids.device)[None].expand_as(input_ids)
        with torch.no_grad():
            out = _backbone(self.base_model_lm)(input_ids=input_ids, attention_mask=attention_mask,
                                                position_ids=position_ids, use_cache=False)
        return out.last_hidden_state, position_ids

    def inverse_temperature(self, hidden: torch.Tensor, attention_mask=None, position_ids=None,
                            cache=None) -> torch.Tensor:
        """s = exp(h) clamped to [``min_scale``, ``max_scale``], per token, from the base's last hidden state
        (``cache``: the transformer head's KV cache, ``hidden`` the positions after it)."""
        dt = _DTYPES[self.config.head_dtype]
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device)[None].expand(hidden.shape[:2])
        h = (self.head(hidden.to(dt), attention_mask, position_ids, cache) if cache is not None
             else self.head(hidden.to(dt), attention_mask, position_ids)).float()
        return torch.exp(h.clamp(min=math.log(self.config.min_scale), max=math.log(self.config.max_scale)))

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, labels: torch.LongTensor | None = None,
                logits_to_keep: int = 0, return_dict: bool = True, **kwargs):
        """Calibrated logits (``logits``; none in fused training) and, with ``labels``, the selective
        smoothing loss. ``logits_to_keep`` as in Hugging Face causal LMs."""
        hidden, position_ids = self._base_hidden(input_ids, attention_mask, position_ids)
        s = self.inverse_temperature(hidden, attention_mask, position_ids)
        head = output_head(self.base_model_lm)
        cap = softcap_of(self.base_model_lm)
        k = logit_scale_of(self.base_model_lm)  # a family that scales its logits (Cohere, Granite)
        loss, logits = None, None
        fused = labels is not None and self.training and self._fused_ok(cap, head)
        if fused:
            loss = fused_selective_smoothing_loss(hidden, s if k is None else s * k, head.weight, labels,
                                                  alpha=self._alpha())
        else:
            sl = slice(-logits_to_keep, None) if logits_to_keep else slice(None)
            with torch.no_grad():
                base_logits = head(hidden[:, sl]).float()
                if k is not None:
                    base_logits = base_logits * k
                if cap is not None:
                    base_logits = cap * torch.tanh(base_logits / cap)
            logits = base_logits * s[:, sl, None]
            if labels is not None:
                if logits_to_keep:
                    raise ValueError("`labels` with `logits_to_keep` is not supported: the loss needs every position")
                loss = selective_smoothing_loss(logits, labels, alpha=self._alpha())
        if not return_dict:
            return tuple(x for x in (loss, logits) if x is not None)
        return CausalLMOutput(loss=loss, logits=logits)

    def _alpha(self) -> float | None:
        return None if self.config.loss_type == "nll" else self.config.loss_alpha

    def _fused_ok(self, cap, head) -> bool:
        if self.loss_path == "materialise":
            return False
        if cap is not None or head.bias is not None:
            if self.loss_path == "fused":
                raise ValueError("the fused ATS loss needs an lm_head without soft-cap or bias")
            return False
        return True

    def logits_processor(self, attention_mask: torch.Tensor | None = None) -> "ATSLogitsProcessor":
        """A ``LogitsProcessor`` for a ``base.generate`` call of your own: each step recomputes the base's backbone
        on the whole prefix (``attention_mask``: the prompt's, for left-padded batches). :meth:`generate` keeps the
        base's KV cache instead."""
        return ATSLogitsProcessor(self, attention_mask)

    @torch.no_grad()
    def generate(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None, **kwargs):
        """The base's ``generate`` with every step's scores scaled by the inverse temperature: sampling (and any
        warper after it) sees the calibrated distribution; greedy decoding is the base's. The head reads the hidden
        states the base computes with its KV cache (a hook on its backbone for the call), so a step costs the base's
        own step and the head; ``kwargs`` go to ``generate`` (a ``logits_processor`` list runs after this one)."""
        proc = ATSLogitsProcessor(self, attention_mask)
        given = kwargs.pop("logits_processor", None) or []
        handle = _backbone(self.base_model_lm).register_forward_hook(proc._capture)
        proc.capturing = True
        try:
            return self.base_model_lm.generate(input_ids, attention_mask=attention_mask,
                                               logits_processor=LogitsProcessorList([proc, *given]), **kwargs)
        finally:
            proc.capturing = False
            handle.remove()


class ATSLogitsProcessor(LogitsProcessor):
    """Rescale each step's scores by the calibrator's inverse temperature at the last position.

    Made by :meth:`ATSCalibrator.generate`, it takes the hidden states of the base's own forward (each step's new
    positions): a per-token head runs on the last position, a transformer head on the new positions against its own
    KV cache of the earlier ones (on every position where its layer takes no cache). Where a step's ``input_ids`` do
    not extend the previous step's (beam search reorders its beams) or no forward was seen (made by
    ``logits_processor()`` for a generate call of your own), it recomputes the backbone on the whole prefix and the
    head's cache anew. Greedy decoding is unchanged by construction (s > 0)."""

    def __init__(self, calibrator: ATSCalibrator, attention_mask: torch.Tensor | None = None):
        self.calibrator = calibrator
        self.prompt_mask = attention_mask
        self.capturing = False
        self.recomputed = 0  # steps that recomputed the backbone on the prefix
        self._pending = None  # the last hidden states the base's backbone returned (generate's forward)
        self._ids = self._hidden = self._cache = None  # the tokens seen so far; the transformer head's KV cache

    def _capture(self, module, args, output):
        if self.capturing:
            h = getattr(output, "last_hidden_state", None)
            self._pending = (h if h is not None else output[0]).detach()

    def _mask(self, ids: torch.Tensor) -> torch.Tensor | None:
        """The prompt's attention mask extended with ones over the generated tokens (None: no padding). ``generate``
        repeats each prompt for its beams or ``num_return_sequences`` (``repeat_interleave``; beams reorder only
        within their prompt's group), so the mask's rows are repeated the same way."""
        m = self.prompt_mask
        if m is None or ids.shape[0] % m.shape[0] or m.shape[1] > ids.shape[1]:
            return None
        if ids.shape[0] != m.shape[0]:
            m = m.repeat_interleave(ids.shape[0] // m.shape[0], dim=0)
        return torch.cat([m.to(ids.device), m.new_ones(m.shape[0], ids.shape[1] - m.shape[1])], 1)

    @torch.no_grad()
    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        new, self._pending = self._pending, None
        mask = self._mask(input_ids)
        n, seen = input_ids.shape[1], 0 if self._ids is None else self._ids.shape[1]
        extends = (new is not None and self._ids is not None and new.shape[0] == input_ids.shape[0]
                   and seen + new.shape[1] == n and torch.equal(input_ids[:, :seen], self._ids))
        if new is not None and (extends or new.shape[:2] == input_ids.shape):
            hidden = new  # the prompt's forward, or a step extending the same rows
        else:
            extends = False
            self.capturing, was = False, self.capturing  # (the recomputation is not generate's forward)
            try:
                hidden = self.calibrator._base_hidden(input_ids, mask, None)[0]
            finally:
                self.capturing = was
            self.recomputed += 1
        self._ids = input_ids
        pos = (mask.long().cumsum(-1) - 1).clamp_min(0) if mask is not None else torch.arange(
            n, device=input_ids.device)[None].expand(input_ids.shape)
        cal = self.calibrator
        if cal.config.head_type != "transformer":  # a per-token head: the last position alone
            s = cal.inverse_temperature(hidden[:, -1:], None, pos[:, -1:])[:, -1]
        elif extends and self._cache is not None:  # the head's KV cache holds the earlier positions
            s = cal.inverse_temperature(hidden, mask, pos[:, n - hidden.shape[1]:], cache=self._cache)[:, -1]
        elif extends:  # a head without a cache: it runs on every position
            self._hidden = torch.cat([self._hidden, hidden], 1)
            s = cal.inverse_temperature(self._hidden, mask, pos)[:, -1]
        else:  # every position: a new cache (none where the head's layer does not take one)
            self._cache = DynamicCache() if cal.head.cache_argument() else None
            try:
                s = cal.inverse_temperature(hidden, mask, pos, cache=self._cache)[:, -1]
            except _CacheIgnored:
                self._cache = None
                s = cal.inverse_temperature(hidden, mask, pos)[:, -1]
            self._hidden = hidden if self._cache is None else None  # (kept only where the head runs on every position)
        return scores * s[:, None].to(scores.dtype)


def _require_causal_lm(model):
    if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
        raise ValueError(f"{type(model).__name__} is not a causal LM with an lm_head; ATS calibrates the "
                         "logits of a causal LM (AutoModelForCausalLM)")
    _backbone(model)  # fails with a message if there is no hidden-state backbone
    return model


def _load_base(base, dtype="auto"):
    if isinstance(base, (str, os.PathLike)):
        try:
            return AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
        except OSError as e:
            raise ValueError(f"cannot load the base model {str(base)!r} ({e}); pass the loaded model as base_model=")
    if not isinstance(base, PreTrainedModel):
        raise TypeError(f"`base_model` must be a transformers causal LM or a path/hub name; got {type(base).__name__}")
    return base
