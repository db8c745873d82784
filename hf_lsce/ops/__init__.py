"""Pure torch + Triton: the fused linear + label-smoothed cross-entropy op (no transformers import)."""
from .linear_cross_entropy import LCEStats, divide_summed_loss, linear_cross_entropy

__all__ = ["LCEStats", "divide_summed_loss", "linear_cross_entropy"]
