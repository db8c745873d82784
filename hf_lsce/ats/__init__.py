"""Adaptive temperature scaling (Xie et al. 2024): a per-token temperature head on a frozen causal LM."""
from transformers import AutoConfig, AutoModel

from .configuration_ats import HEAD_TYPES, ATSConfig
from .loss import fused_selective_smoothing_loss, selective_smoothing_loss
from .modeling_ats import ATSCalibrator, ATSLogitsProcessor

AutoConfig.register(ATSConfig.model_type, ATSConfig, exist_ok=True)
AutoModel.register(ATSConfig, ATSCalibrator, exist_ok=True)

__all__ = ["ATSConfig", "ATSCalibrator", "ATSLogitsProcessor", "HEAD_TYPES", "selective_smoothing_loss",
           "fused_selective_smoothing_loss"]
