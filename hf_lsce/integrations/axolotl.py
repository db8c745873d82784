"""hf_lsce as an Axolotl plugin: the fused label-smoothed loss in ``axolotl train``.

    plugins:
      - hf_lsce.integrations.axolotl.LscePlugin
    label_smoothing_factor: 0.1        # the plugin hands it to the fused op (Axolotl's own config drops it)

Axolotl loads the plugin in the process that trains (``axolotl train`` launches it through accelerate, where a patch
applied by ``hf-lsce run`` in the launching process would not reach). Its keys (``axolotl_args.LsceArgs``) are
validated with Axolotl's config; before the model loads the plugin checks the versions, the model family, what a
4-bit base needs, and a ZeRO-3 config that would train in fp32 under a bf16 YAML; once Axolotl has built the model
(LoRA and QLoRA adapters included) it applies ``apply_lsce_patch`` to it, and every training step then checks that
the fused op ran with the smoothing asked for (``hf_lsce.patching.trainer``). The ``lsce_calibration_*`` keys
(``calibration_keys``) add ``CalibrationCallback`` to Axolotl's trainer: accuracy, ECE and RMS on held-out
multiple-choice sets at each evaluation, through Axolotl's logging.
"""
from __future__ import annotations

import logging

from ..patching.versions import environment_problem

try:
    from axolotl.integrations.base import BasePlugin
except ImportError as e:  # one line for a user who lists the plugin without Axolotl, or imports this by mistake
    raise ImportError(f"hf_lsce.integrations.axolotl is a plugin for Axolotl, which is not importable here ({e}); "
                      "pip install 'axolotl>=0.19' or remove the plugin from plugins:") from None

from .axolotl_args import LsceArgs, deepspeed_precision_problem, validate_lsce_keys

logger = logging.getLogger("hf_lsce")

# The oldest and newest Axolotl the plugin is tested with (tools/frameworks_e2e.py, docs/frameworks.md's versions).
MIN_AXOLOTL = "0.19.0"
NEWEST_AXOLOTL = "0.21.0"
__all__ = ["LscePlugin", "LsceArgs", "MIN_AXOLOTL", "NEWEST_AXOLOTL", "check_environment", "check_family",
           "check_quantization"]


def check_environment() -> None:
    """Raise ValueError (one line) when Axolotl is outside the releases the plugin is tested with, or transformers or
    TRL older."""
    problem = environment_problem("axolotl", MIN_AXOLOTL, NEWEST_AXOLOTL)
    if problem is not None:
        raise ValueError(problem)


def check_family(model_type: str | None) -> None:
    """Raise ValueError (one line) for a model family outside hf_lsce's table: under Axolotl the plugin patches the
    families whose loss it has checked (``hf_lsce.patching.MODEL_TABLE``)."""
    from ..patching import MODEL_TABLE

    if model_type is not None and model_type not in MODEL_TABLE:
        raise ValueError(f"hf_lsce's Axolotl plugin does not support model type {model_type!r} (supported: "
                         f"{', '.join(sorted(MODEL_TABLE))}); remove the plugin or set lsce: false.")


def check_quantization(cfg) -> None:
    """Raise ValueError (one line, naming the key) for a 4- or 8-bit base (``adapter: qlora``, ``load_in_4bit``,
    ``load_in_8bit``) where bitsandbytes or a CUDA GPU is missing, before the model loads."""
    from ..patching.versions import quantization_problem

    key = next((k for k, v in (("adapter: qlora", cfg.get("adapter") == "qlora"),
                               ("load_in_4bit: true", cfg.get("load_in_4bit")),
                               ("load_in_8bit: true", cfg.get("load_in_8bit"))) if v), None)
    problem = quantization_problem(key) if key else None
    if problem is not None:
        raise ValueError(problem)


class LscePlugin(BasePlugin):
    """Axolotl plugin: ``plugins: [hf_lsce.integrations.axolotl.LscePlugin]``."""

    def get_input_args(self) -> str:
        return "hf_lsce.integrations.axolotl_args.LsceArgs"

    def register(self, cfg: dict):  # Axolotl calls it with the raw YAML, before validation
        check_environment()
        validate_lsce_keys(dict(cfg))

    def pre_model_load(self, cfg):
        from .calibration_keys import calibration_tasks

        # the calibration sets load now, before the model: a file missing in the folder stops the run here
        self._calibration = (cfg, calibration_tasks(_keys(cfg)))
        check_quantization(cfg)
        problem = deepspeed_precision_problem(cfg)  # (stock trains in fp32 there too; the fix is one key)
        if problem is not None:
            raise ValueError(problem)
        if cfg.lsce is False:
            return
        check_family(cfg.model_config_type)

    def post_model_load(self, cfg, model):
        if cfg.lsce is False:
            logger.info("lsce: false: hf_lsce's plugin leaves the model unpatched")
            return
        from ..patching import apply_lsce_patch

        # Axolotl hands no label_smoothing_factor to the Trainer (its config has no such key; LsceArgs keeps it):
        # the YAML's value reaches the op here, as the model's own b
        key = "lsce_label_smoothing" if cfg.lsce_label_smoothing is not None else "label_smoothing_factor"
        b = cfg.get(key)
        memory = cfg.get("lsce_memory") or "auto"
        apply_lsce_patch(model, label_smoothing=b, fused_eval_loss=bool(cfg.lsce_fused_eval_loss), memory=memory)
        source = f"{key}={b or 0.0}"
        logger.info("hf_lsce: %s patched; %s drives the fused op (memory=%s)", type(model).__name__, source, memory)

    def add_callbacks_post_trainer(self, cfg, trainer):
        """``CalibrationCallback`` from the ``lsce_calibration_*`` keys, attached to Axolotl's trainer (its metrics go
        through ``trainer.log``: Axolotl's ``report_to`` and log history), also with ``lsce: false``."""
        from .calibration_keys import calibration_callback

        loaded = getattr(self, "_calibration", (None, None))
        tasks = loaded[1] if loaded[0] is cfg else None
        callback = calibration_callback(_keys(cfg), tasks=tasks, trainer=trainer)
        if callback is None:
            return []
        logger.info("hf_lsce: calibration on %s logged at each evaluation", ", ".join(t.name for t in callback.tasks))
        return [callback]


def _keys(cfg) -> dict:
    from .calibration_keys import KEYS

    return {key: cfg.get(key) for key in KEYS}
