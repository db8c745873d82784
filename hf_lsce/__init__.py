"""hf_lsce: cheap label-smoothed fine-tuning of large-vocabulary LLMs, and calibration measurement."""
from .ops import LCEStats, linear_cross_entropy

__version__ = "0.1.0"

__all__ = ["LCEStats", "linear_cross_entropy", "__version__"]
