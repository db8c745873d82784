"""The calibration keys of both frameworks' YAML files (Axolotl's plugin, LLaMA-Factory's route): they attach
``CalibrationCallback``, so that accuracy, ECE, RMS and the rest on held-out multiple-choice sets are logged at each
evaluation through the framework's own logging (``report_to``, ``logging_steps``, the trainer's log history).

    lsce_calibration_tasks: arc_easy,mmlu        # (or a list) turns it on
    lsce_calibration_limit: 200                  # items per task (default 200)
    lsce_calibration_data_dir: /data/eval        # a local folder of the tasks' files (unset: the Hugging Face hub)
    lsce_calibration_diagrams: false             # reliability diagrams under output_dir/calibration (default true)

Checked before the model loads: each a one-line ``ValueError`` naming the key. No framework import here.
"""
from __future__ import annotations

import os

PREFIX = "lsce_calibration_"
KEYS = ("lsce_calibration_tasks", "lsce_calibration_limit", "lsce_calibration_data_dir", "lsce_calibration_diagrams")


def validate_calibration_keys(data: dict) -> None:
    """Raise ValueError (one line, naming the key) for a calibration key with a wrong type or value, an unknown task,
    a missing data folder, or an unknown ``lsce_calibration_*`` key (a misspelt one would otherwise do nothing).
    ``data``: the YAML's mapping."""
    unknown = sorted(k for k in data if isinstance(k, str) and k.startswith(PREFIX) and k not in KEYS)
    if unknown:
        raise ValueError(f"{unknown[0]} is not a calibration key of hf_lsce; the keys are {', '.join(KEYS)}.")
    tasks = data.get("lsce_calibration_tasks")
    others = [k for k in KEYS[1:] if data.get(k) is not None]
    if tasks is None:
        if others:
            raise ValueError(f"{others[0]} is set but lsce_calibration_tasks is not: name the tasks to score "
                             "(e.g. lsce_calibration_tasks: arc_easy,mmlu) or remove it.")
        return
    from ..calibration.tasks import parse_task_names

    try:
        parse_task_names(tasks)
    except (TypeError, ValueError) as e:
        raise ValueError(f"lsce_calibration_tasks: {e}") from None
    limit = data.get("lsce_calibration_limit")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"lsce_calibration_limit must be a whole number of items per task, at least 1, got {limit!r} "
                         f"({type(limit).__name__}).")
    folder = data.get("lsce_calibration_data_dir")
    if folder is not None:
        if not isinstance(folder, str):
            raise ValueError(f"lsce_calibration_data_dir must be a folder's path, got {folder!r} "
                             f"({type(folder).__name__}).")
        if not os.path.isdir(folder):
            raise ValueError(f"lsce_calibration_data_dir: no such folder: {folder} (a folder of the tasks' files; "
                             "remove the key to load them from the Hugging Face hub).")
    diagrams = data.get("lsce_calibration_diagrams")
    if diagrams is not None and not isinstance(diagrams, bool):
        raise ValueError(f"lsce_calibration_diagrams must be true or false, got {diagrams!r} "
                         f"({type(diagrams).__name__}).")


def calibration_tasks(data: dict):
    """The tasks ``data``'s keys name, loaded (a file missing or malformed inside the folder: a ValueError naming
    ``lsce_calibration_tasks``, before the model loads), or None when the keys are absent."""
    validate_calibration_keys(data)
    if data.get("lsce_calibration_tasks") is None:
        return None
    from ..calibration.tasks import resolve_tasks

    limit = data.get("lsce_calibration_limit")
    try:
        return resolve_tasks(data["lsce_calibration_tasks"], data.get("lsce_calibration_data_dir"),
                             limit=200 if limit is None else limit)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"lsce_calibration_tasks: {str(e).strip().splitlines()[0]}") from None


def calibration_callback(data: dict, tasks=None, trainer=None):
    """``CalibrationCallback`` for ``data``'s keys (``tasks``: already loaded by ``calibration_tasks``), attached to
    ``trainer`` when given (else at ``Trainer.train`` by the patch's hook), or None when the keys are absent."""
    tasks = calibration_tasks(data) if tasks is None else tasks
    if tasks is None:
        return None
    from ..calibration.callback import CalibrationCallback

    diagrams = data.get("lsce_calibration_diagrams")
    return CalibrationCallback(tasks, save_diagrams=True if diagrams is None else diagrams, trainer=trainer)
