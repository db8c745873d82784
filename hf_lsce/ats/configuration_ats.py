"""``ATSConfig``: the configuration of an adaptive-temperature-scaling head (the base LM is not in it)."""
from __future__ import annotations

import math

from transformers import PretrainedConfig

HEAD_TYPES = ("transformer", "mlp", "linear", "scalar")


class ATSConfig(PretrainedConfig):
    """Configuration of :class:`~hf_lsce.ats.ATSCalibrator`.

    Args:
        base_model_name_or_path: the frozen causal LM the head calibrates (path or hub name);
            ``from_pretrained`` loads it from here unless a base is given.
        head_type: ``"transformer"`` (one decoder layer of the base's own architecture and size,
            then a linear map to one value: the reference design), ``"mlp"``, ``"linear"``, or
            ``"scalar"`` (one learned temperature for every token: classic temperature scaling).
        max_scale: the largest inverse temperature ``exp(h)`` may reach (the reference clamps at 10).
        min_scale: the smallest (1e-4). The reference has no lower clamp; without one, a head that
            learns "this token is hopeless" drives ``exp(h)`` to an underflowing 0, every logit
            becomes 0 and the argmax turns into a tie; the floor keeps the ranking intact.
        loss_alpha: alpha of the selective smoothing loss (0.5 in the reference).
        mlp_hidden_size: width of the ``mlp`` head (default: the base's hidden size).
        base_hidden_size, base_vocab_size, base_model_type: a fingerprint of the base, checked when
            the head is restored, so that a head is never put on a different base silently.
        base_config: the base's text config (a dict), needed to rebuild a ``transformer`` head.
        loss_type: ``"selective"`` (the paper's selective smoothing loss) or ``"nll"`` (plain
            cross-entropy of the calibrated logits: classic temperature scaling's objective).
        head_dtype: dtype of the head's parameters ("float32" by default: a small module trained
            with AdamW; the base keeps its own dtype).
    """

    model_type = "ats_calibrator"

    def __init__(self, base_model_name_or_path: str | None = None, head_type: str = "transformer",
                 max_scale: float = 10.0, min_scale: float = 1e-4, loss_alpha: float = 0.5, mlp_hidden_size: int | None = None,
                 base_hidden_size: int | None = None, base_vocab_size: int | None = None,
                 base_model_type: str | None = None, base_config: dict | None = None,
                 head_dtype: str = "float32", loss_type: str = "selective", base_fingerprint: dict | None = None,
                 **kwargs):
        if head_type not in HEAD_TYPES:
            raise ValueError(f"`head_type` must be one of {HEAD_TYPES}; got {head_type!r}")
        for name, v in (("max_scale", max_scale), ("min_scale", min_scale), ("loss_alpha", loss_alpha)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"`{name}` must be a finite number; got {v!r}")
        if not max_scale > 1:
            raise ValueError(f"`max_scale` must exceed 1; got {max_scale}")
        if not 0 < min_scale < 1:
            raise ValueError(f"`min_scale` must lie in (0, 1); got {min_scale}")
        if not 0 <= loss_alpha <= 1:
            raise ValueError(f"`loss_alpha` must lie in [0, 1]; got {loss_alpha}")
        if loss_type not in ("selective", "nll"):
            raise ValueError(f"`loss_type` must be 'selective' or 'nll'; got {loss_type!r}")
        if head_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"`head_dtype` must be float32, bfloat16 or float16; got {head_dtype!r}")
        self.base_model_name_or_path = base_model_name_or_path
        self.head_type = head_type
        self.max_scale = float(max_scale)
        self.min_scale = float(min_scale)
        self.loss_alpha = float(loss_alpha)
        self.mlp_hidden_size = mlp_hidden_size
        self.base_hidden_size = base_hidden_size
        self.base_vocab_size = base_vocab_size
        self.base_model_type = base_model_type
        self.base_config = base_config
        self.head_dtype = head_dtype
        self.loss_type = loss_type
        # the base's architecture (model type, sizes, layer and head counts) the head was trained on
        self.base_fingerprint = base_fingerprint
        super().__init__(**kwargs)
