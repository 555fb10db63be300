"""Models by name: ``build_model(name, num_classes=..., norm=..., **options)``."""

from __future__ import annotations

from typing import Callable

from torch import nn

from .digit_cnn import DigitCNN

MODELS: dict[str, Callable[..., nn.Module]] = {
    "digit_cnn": DigitCNN,
}


def build_model(name: str, **options) -> nn.Module:
    try:
        builder = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}") from None
    return builder(**options)
