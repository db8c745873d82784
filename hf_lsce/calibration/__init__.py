"""Calibration measurement: metrics, multiple-choice scoring, a TrainerCallback, reliability diagrams."""
import os

from .metrics import (CalibrationResult, PairedDifference, ReliabilityData, adaptive_calibration_error, brier_score,
                      calibration_metrics, expected_calibration_error, maximum_calibration_error,
                      negative_log_likelihood, paired_bootstrap, reliability_data, rms_calibration_error,
                      signed_gap_interval, static_calibration_error, top_label, top_label_brier_score)
from .plots import reliability_diagram, reliability_grid
from .scoring import TaskScores, evaluate_calibration, score_task
from .tasks import TASKS, MultipleChoiceItem, Task, load_task, parse_task_names, resolve_tasks


def evaluate_metric_path() -> str:
    """Path of the local `evaluate` metric module: ``evaluate.load(evaluate_metric_path())``."""
    return os.path.join(os.path.dirname(__file__), "evaluate_metric", "calibration.py")


def __getattr__(name):  # the callback imports transformers: load it on first use
    if name == "CalibrationCallback":
        from .callback import CalibrationCallback

        return CalibrationCallback
    raise AttributeError(name)


__all__ = ["CalibrationResult", "ReliabilityData", "adaptive_calibration_error", "brier_score", "calibration_metrics",
           "expected_calibration_error", "maximum_calibration_error", "negative_log_likelihood", "reliability_data",
           "rms_calibration_error", "static_calibration_error", "top_label", "top_label_brier_score",
           "reliability_diagram", "reliability_grid", "paired_bootstrap", "signed_gap_interval", "PairedDifference", "TaskScores", "evaluate_calibration", "score_task", "TASKS", "MultipleChoiceItem",
           "Task", "load_task", "parse_task_names", "resolve_tasks", "evaluate_metric_path", "CalibrationCallback"]
