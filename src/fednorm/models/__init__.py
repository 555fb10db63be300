"""Model architectures of the papers, the normalization factory and the model registry."""

from .digit_cnn import DigitCNN
from .norm import NORM_KINDS, make_norm, norm_factory
from .registry import MODELS, build_model

__all__ = ["DigitCNN", "NORM_KINDS", "make_norm", "norm_factory", "MODELS", "build_model"]
