"""Pure torch + Triton: the fused linear + label-smoothed cross-entropy op (no transformers import)."""
from .checks import raise_pending_errors
from .linear_cross_entropy import LCEStats, divide_summed_loss, linear_cross_entropy

__all__ = ["LCEStats", "divide_summed_loss", "linear_cross_entropy", "raise_pending_errors"]
