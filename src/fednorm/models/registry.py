"""Models by name: ``build_model(name, num_classes=..., norm=..., **options)``.

Every model takes any normalization of :data:`fednorm.models.norm.NORM_KINDS`. Options a model does
not have (``classifier`` exists for the digit CNN and AlexNet only, ``width`` for all but the ResNets and
MobileNetV2 (``width_mult``), ``pretrained`` and ``input_size`` for AlexNet only) are dropped when they are left at
their defaults, and refused otherwise.
"""

from __future__ import annotations

import inspect
from importlib import import_module
from typing import Callable

from torch import nn

# name -> (module, builder); imported on use so that the registry costs nothing at start-up
_BUILDERS: dict[str, tuple[str, str]] = {
    "digit_cnn": ("digit_cnn", "DigitCNN"),      # FedBN Table 3 / FedWon Table 5, 3 x 28 x 28
    "alexnet": ("alexnet", "AlexNet"),           # FedBN Table 9 / FedWon Table 6, 256 x 256 (any >= 63 or input_size)
    "resnet18": ("resnet", "resnet18"),          # torchvision ResNet-18 (FedWon, Office / Fed-ISIC2019)
    "resnet20": ("resnet", "resnet20"),          # CIFAR-style ResNet-20 (FedWon Table 13)
    "mobilenet_v2": ("mobilenet", "mobilenet_v2"),  # torchvision MobileNetV2 (FedWon label skew)
    "unet": ("unet", "UNet"),                    # HarmoFL U-Net (official code layout), segmentation, side % 16 == 0
    "densenet121": ("densenet", "densenet121"),  # torchvision DenseNet-121 (HarmoFL Camelyon17, 2 classes, 96 x 96)
    "fbn_cnn": ("fbn_cnn", "FBNCNN"),            # FBN paper Table 1 (Conv-ReLU-BN), 3 x 32 x 32 (28 for digits)
    "mlp": ("mlp", "MLP"),                       # FedBN ABIDE I: FC-16-BN-ReLU, FC-16-BN-ReLU, FC (feature vectors)
}
MODEL_NAMES = tuple(_BUILDERS)
_OPTIONAL_DEFAULTS = {"classifier": "fedbn", "width": 1.0, "bn_mode": "running", "code_zero_pad": False,
                      "pretrained": "none", "input_size": None}
# facts about the data that a model may need (the FBN CNN's flatten size, the MLP's input length); dropped for
# models without them
_CONTEXT_OPTIONS = ("image_size", "in_features")


def model_builder(name: str) -> Callable[..., nn.Module]:
    try:
        module, attr = _BUILDERS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}") from None
    return getattr(import_module(f"{__package__}.{module}"), attr)


def unsupported_options(name: str, options: dict) -> list[str]:
    """The keys of ``options`` that model ``name`` does not take, leaving out the data facts it may not need and the
    optional settings left at their defaults (those are dropped when the model is built)."""
    accepted = inspect.signature(model_builder(name)).parameters
    return [key for key in options if key not in accepted and key not in _CONTEXT_OPTIONS
            and not (key in _OPTIONAL_DEFAULTS and options[key] == _OPTIONAL_DEFAULTS[key])]


def build_model(name: str, **options) -> nn.Module:
    builder = model_builder(name)
    accepted = inspect.signature(builder).parameters
    bad = unsupported_options(name, options)
    if bad:
        raise ValueError(f"model {name!r} has no option {bad[0]!r} (it takes {', '.join(accepted)})")
    return builder(**{k: v for k, v in options.items() if k in accepted})
