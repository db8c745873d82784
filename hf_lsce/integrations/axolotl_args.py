"""The Axolotl plugin's config keys, validated when Axolotl loads the YAML (before any model loads).

Axolotl merges this pydantic model into its own config model (``plugins:`` lists the plugin, whose
``get_input_args`` names this class), so a wrong key value is reported by Axolotl's own validation, with the message
below. No Axolotl import here: the keys are tested without it.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, model_validator

from ..patching import validate_memory, validate_smoothing
from .calibration_keys import validate_calibration_keys

# Other plugins' keys that replace the same loss: the fused op cannot run under either.
CONFLICTS = {
    "cut_cross_entropy": "Cut Cross-Entropy (cut_cross_entropy: true)",
    "liger_fused_linear_cross_entropy": "Liger's fused linear cross-entropy (liger_fused_linear_cross_entropy: true)",
}


def _smoothing(key: str, value) -> None:
    try:
        validate_smoothing(value, key)
    except TypeError as e:  # pydantic reports a validator's ValueError as the config's error, not a TypeError
        raise ValueError(str(e)) from None


def _flag(key: str, value) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r} ({type(value).__name__}).")


def validate_lsce_keys(data: dict) -> None:
    """Raise ValueError (one line, naming the key) for a bad value of the plugin's keys (the calibration keys
    included, with an evaluation to run them at) or of ``label_smoothing_factor``, or for another loss-replacing plugin
    enabled beside it. ``data``: the YAML's mapping."""
    _flag("lsce", data.get("lsce"))
    _flag("lsce_fused_eval_loss", data.get("lsce_fused_eval_loss"))
    _smoothing("lsce_label_smoothing", data.get("lsce_label_smoothing"))
    _smoothing("label_smoothing_factor", data.get("label_smoothing_factor"))
    if data.get("lsce_memory") is not None:
        try:
            validate_memory(data["lsce_memory"], "lsce_memory")
        except TypeError as e:  # (pydantic reports a validator's ValueError)
            raise ValueError(str(e)) from None
    validate_calibration_keys(data)
    if data.get("lsce_calibration_tasks") is not None and not (data.get("val_set_size") or data.get("test_datasets")):
        raise ValueError("lsce_calibration_tasks scores the model at each evaluation, and this config has none: set "
                         "val_set_size (or test_datasets) and eval_steps, or remove lsce_calibration_tasks.")
    if data.get("lsce") is False:
        key = next((k for k in ("lsce_label_smoothing", "label_smoothing_factor") if data.get(k)), None)
        if key:  # Axolotl alone would drop the key and train at b = 0 without a word
            raise ValueError(f"{key}: {data[key]} with lsce: false would train unsmoothed: Axolotl has no label "
                             "smoothing of its own (its config drops label_smoothing_factor), only hf_lsce's op reads "
                             f"it. Set lsce: true, or remove {key} to train at b = 0.")
        return
    for key, name in CONFLICTS.items():
        if data.get(key):
            raise ValueError(f"hf_lsce and {name} both replace the training loss; keep one: remove {key} or set "
                             "lsce: false.")


def deepspeed_precision_problem(cfg: Mapping) -> str | None:
    """One line when the YAML asks for bf16 (or fp16) and its DeepSpeed ZeRO-3 config leaves that precision "auto" or
    unset; else None. Axolotl (0.19 to 0.21) loads the model under ZeRO-3 before the Trainer fills the config's "auto"
    fields, and DeepSpeed reads an unfilled "auto" as off: the weights are partitioned in fp32 and the whole run trains
    in fp32 while the YAML says bf16 (measured, Llama-3-8B on 2 H200s: about 6 x slower, stock and hf_lsce alike;
    docs/frameworks.md). ``cfg``: Axolotl's validated config, its ``deepspeed`` a path or the mapping itself."""
    ds = cfg.get("deepspeed")
    if isinstance(ds, (str, os.PathLike)):
        try:
            conf, name = json.loads(Path(ds).read_text()), str(ds)
        except (OSError, ValueError):  # a missing or unreadable file: Axolotl and DeepSpeed report it themselves
            return None
    elif isinstance(ds, Mapping):
        conf, name = ds, "the deepspeed: mapping"
    else:
        return None
    if not isinstance(conf, Mapping) or str((conf.get("zero_optimization") or {}).get("stage")) != "3":
        return None
    for key in ("bf16", "fp16"):
        enabled = (conf.get(key) or {}).get("enabled", "unset")
        if cfg.get(key) is True and enabled is not True:
            return (f"{key}: true with the DeepSpeed ZeRO-3 config {name}, whose {key}.enabled is {enabled!r}: Axolotl "
                    f"loads the model before the Trainer fills it, so DeepSpeed partitions fp32 weights and the run "
                    f'trains in fp32 (about 6 x slower, measured); set "{key}": {{"enabled": true}} in {name}.')
    return None


class LsceArgs(BaseModel):
    """hf_lsce's keys in an Axolotl YAML.

    ``lsce``: the fused label-smoothed loss on (the default once the plugin is listed) or off; off, a smoothing
    factor above 0 is refused (nothing else in Axolotl would apply it).
    ``lsce_label_smoothing``: fixes b; unset, the YAML's ``label_smoothing_factor`` drives it.
    ``label_smoothing_factor``: declared here because Axolotl's own config (0.19 to 0.21) has no such key and drops it
    before the Trainer is built: without this field a YAML's ``label_smoothing_factor: 0.1`` trained at b = 0, with
    the plugin and without it. ``lsce_fused_eval_loss``: the evaluation loss through the op too (no logits in
    evaluation). ``lsce_memory``: the op's memory budget (``auto``, ``low`` or bytes: ``linear_cross_entropy``'s
    ``memory``).
    ``lsce_calibration_*``: ``CalibrationCallback`` at each evaluation (``calibration_keys``).
    """

    lsce: bool | None = None
    lsce_label_smoothing: float | None = None
    label_smoothing_factor: float | None = None
    lsce_fused_eval_loss: bool | None = None
    lsce_memory: str | float | None = None
    lsce_calibration_tasks: str | list[str] | None = None
    lsce_calibration_limit: int | None = None
    lsce_calibration_data_dir: str | None = None
    lsce_calibration_diagrams: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _check(cls, data):
        if isinstance(data, dict):
            validate_lsce_keys(data)
        return data
