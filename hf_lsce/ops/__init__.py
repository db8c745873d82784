"""Pure torch + Triton: the fused linear + label-smoothed cross-entropy op (no transformers import)."""
from .config import torch_problem

if torch_problem() is not None:  # (older torch cannot register the op's custom operators)
    raise ImportError(torch_problem())

from .checks import raise_pending_errors  # noqa: E402
from .linear_cross_entropy import LCEStats, divide_summed_loss, linear_cross_entropy  # noqa: E402

__all__ = ["LCEStats", "divide_summed_loss", "linear_cross_entropy", "raise_pending_errors"]
