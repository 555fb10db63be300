"""Model architectures of the papers, the normalization factory and the model registry."""

from .digit_cnn import DigitCNN
from .norm import NORM_KINDS, make_conv, make_norm, norm_factory
from .wsconv import WSConv2d, convert_to_ws
from .registry import MODEL_NAMES, build_model

__all__ = ["DigitCNN", "NORM_KINDS", "make_norm", "norm_factory", "MODEL_NAMES", "build_model", "WSConv2d", "convert_to_ws", "make_conv"]
