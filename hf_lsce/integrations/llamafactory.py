"""LLaMA-Factory's route: ``llamafactory-cli train`` with hf_lsce's fused label-smoothed loss.

    hf-lsce llamafactory train cfg.yaml [key=value ...]                      # one GPU, or the CPU
    torchrun --nproc-per-node 8 -m hf_lsce.integrations.llamafactory train cfg.yaml   # several GPUs

LLaMA-Factory's YAML takes ``label_smoothing_factor`` (a ``Seq2SeqTrainingArguments`` key) and hands it to its
Trainer. This route checks the YAML first (LLaMA-Factory's version, the smoothing's value, a model family in hf_lsce's
table, no ``use_asft_loss`` beside it: each a one-line error before anything loads), then patches every supported
model class (as ``hf-lsce run`` does) and runs LLaMA-Factory's own training entry
(``run_exp``, what ``llamafactory.launcher`` runs) in this process. The ``lsce_calibration_*`` keys
(``calibration_keys``) attach ``CalibrationCallback``; they are taken out of the configuration handed to
LLaMA-Factory, whose parser refuses keys it does not know. ``enable_liger_kernel: true`` keeps Liger-Kernel's other
kernels (RMSNorm, RoPE, SwiGLU, ...) and leaves the loss to hf_lsce (``patching.liger.apply_liger_kernels``).
``llamafactory-cli train`` itself would start ``torchrun`` children on a machine with several GPUs, which a patch in
this process does not reach; launched by ``torchrun`` as above, each rank runs this module and patches itself.
``lsce_memory`` sets the op's memory budget (``auto``, ``low`` or bytes). The YAML is read, never written.
"""
from __future__ import annotations

import os
import sys

from .calibration_keys import KEYS, calibration_callback, validate_calibration_keys

# LLaMA-Factory versions this route is tested with (tools/frameworks_e2e.py): its SFT workflow and training entry
MIN_LLAMAFACTORY = "0.9.5"
NEWEST_LLAMAFACTORY = "0.9.5"
USAGE = "usage: hf-lsce llamafactory train CONFIG.yaml [key=value ...]"


def _config(argv: list[str]) -> dict:
    """The YAML (or JSON) config with the command line's ``key=value`` overrides, as LLaMA-Factory reads it."""
    from omegaconf import OmegaConf

    path = argv[0]
    if not os.path.isfile(path):
        raise SystemExit(f"hf-lsce llamafactory: no such config file: {path}")
    return OmegaConf.to_container(OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_cli(argv[1:])))


def check_config(cfg: dict, model_type: str | None = None) -> None:
    """Raise ValueError (one line, naming the key) for what the route cannot train: a stage other than ``sft`` or
    ``pt``, a ``label_smoothing_factor`` outside [0, 1], another loss replacement (``use_asft_loss``),
    ``enable_liger_kernel`` without Liger-Kernel installed, an ``lsce_memory`` that is no budget, a calibration key that is wrong or has no evaluation to
    run at (``calibration_keys``), or a model type outside hf_lsce's table (``model_type``: the config's, when
    known)."""
    from ..patching import MODEL_TABLE, validate_memory, validate_smoothing
    from ..patching.versions import installed_version, quantization_problem

    validate_calibration_keys(cfg)
    if cfg.get("lsce_calibration_tasks") is not None and (
            str(cfg.get("eval_strategy", cfg.get("evaluation_strategy", "no"))) == "no"
            or not (cfg.get("val_size") or cfg.get("eval_dataset"))):
        raise ValueError("lsce_calibration_tasks scores the model at each evaluation, and this config has none: set "
                         "eval_strategy: steps, eval_steps and val_size (or eval_dataset), or remove "
                         "lsce_calibration_tasks.")

    stage = cfg.get("stage", "sft")
    if stage not in ("sft", "pt"):
        raise ValueError(f"stage: {stage!r}: hf_lsce's fused loss replaces the language-model loss of stage sft or pt "
                         "only; run other stages with llamafactory-cli train.")
    try:
        validate_smoothing(cfg.get("label_smoothing_factor"), "label_smoothing_factor")
        if cfg.get("lsce_memory") is not None:
            validate_memory(cfg["lsce_memory"], "lsce_memory")
    except TypeError as e:
        raise ValueError(str(e)) from None
    if cfg.get("use_asft_loss"):
        raise ValueError("use_asft_loss: true replaces the training loss with the ASFT loss, as hf_lsce does; keep "
                         "one: remove use_asft_loss or train with llamafactory-cli train.")
    if cfg.get("enable_liger_kernel"):
        if installed_version("liger-kernel") is None:
            raise ValueError("enable_liger_kernel: true asks for Liger-Kernel's kernels, and liger-kernel is not "
                             "installed: pip install liger-kernel, or remove enable_liger_kernel.")
        from ..patching.liger import liger_problem

        problem = liger_problem()
        if problem is not None:
            raise ValueError(f"enable_liger_kernel: {problem}")
    if cfg.get("quantization_bit") is not None and cfg.get("quantization_method", "bnb") == "bnb":
        problem = quantization_problem(f"quantization_bit: {cfg['quantization_bit']}")
        if problem is not None:
            raise ValueError(problem)
    if model_type is not None and model_type not in MODEL_TABLE:
        raise ValueError(f"model type {model_type!r} (model_name_or_path) is not in hf_lsce's table "
                         f"({', '.join(sorted(MODEL_TABLE))}); train it with llamafactory-cli train.")


def _model_type(cfg: dict) -> str | None:
    from transformers import AutoConfig

    name = cfg.get("model_name_or_path")
    if not name:
        return None
    return AutoConfig.from_pretrained(name, trust_remote_code=bool(cfg.get("trust_remote_code"))).model_type


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]) or not argv:
        sys.stdout.write(f"{USAGE}\n\n{__doc__}")
        raise SystemExit(0 if argv else 2)
    if argv[0] != "train" or len(argv) < 2:
        raise SystemExit(f"hf-lsce llamafactory: only 'train CONFIG.yaml' is routed. {USAGE}")
    from ..patching.versions import environment_problem, installed_version

    if installed_version("llamafactory") is None:
        raise SystemExit("hf-lsce llamafactory: LLaMA-Factory is not installed: pip install "
                         f"'llamafactory>={MIN_LLAMAFACTORY}'")
    # and transformers / TRL, before anything loads
    problem = environment_problem("llamafactory", MIN_LLAMAFACTORY, NEWEST_LLAMAFACTORY)
    if problem is not None:
        raise SystemExit(f"hf-lsce llamafactory: {problem}")
    cfg = _config(argv[1:])
    try:
        check_config(cfg)
        model_type = _model_type(cfg)
        check_config(cfg, model_type)
        callback = calibration_callback({k: cfg.get(k) for k in KEYS})  # (its sets load now, before the model)
    except ValueError as e:
        raise SystemExit(f"hf-lsce llamafactory: {e}") from None
    from ..patching.liger import apply_liger_kernels
    from ..run import patch_classes
    from llamafactory.train.tuner import run_exp

    patch_classes("hf-lsce llamafactory", memory=cfg.pop("lsce_memory", None))
    if cfg.pop("enable_liger_kernel", False):  # (not handed on: LLaMA-Factory's own call would fuse Liger's loss)
        apply_liger_kernels(model_types=[model_type], where="enable_liger_kernel")
    # LLaMA-Factory's own training entry (what its launcher runs), with the configuration it would read, less the
    # route's keys (its parser refuses keys it does not know); the callback is bound to the trainer at train()
    run_exp(args={k: v for k, v in cfg.items() if k not in KEYS}, callbacks=[callback] if callback else None)


if __name__ == "__main__":
    main()
