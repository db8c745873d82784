"""hf_lsce: cheap label-smoothed fine-tuning of large-vocabulary LLMs, and calibration measurement."""
from .ops import LCEStats, linear_cross_entropy
from .patching import apply_lsce_patch, is_patched, revert_lsce_patch

__version__ = "1.0.0"


def __getattr__(name):  # heavier parts load on first use
    if name == "CalibrationCallback":
        from .calibration.callback import CalibrationCallback

        return CalibrationCallback
    if name in ("ATSConfig", "ATSCalibrator"):
        from . import ats

        return getattr(ats, name)
    raise AttributeError(f"module 'hf_lsce' has no attribute {name!r}")


__all__ = ["LCEStats", "linear_cross_entropy", "apply_lsce_patch", "revert_lsce_patch", "is_patched",
           "CalibrationCallback", "ATSConfig", "ATSCalibrator", "__version__"]
