"""Pure torch + Triton: the fused linear + label-smoothed cross-entropy op (no transformers import)."""
from .linear_cross_entropy import LCEStats, linear_cross_entropy

__all__ = ["LCEStats", "linear_cross_entropy"]
