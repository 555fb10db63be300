"""DenseNet-121 for HarmoFL's histology classification (Camelyon17, 2 classes, 96 x 96 x 3).

torchvision's DenseNet-121 (random init: growth rate 32, blocks (6, 12, 24, 16), 64 initial
features, bottleneck factor 4, no dropout), whose architecture and init match the official code's
DenseNet except for two code quirks offered as options:

* the code's BatchNorm is ``BatchNorm2d(affine=False, track_running_stats=False)`` (batch
  statistics at evaluation too): ``bn_mode="batch"``; the default ``"running"`` is fednorm's BN;
* the code inserts ``ZeroPad2d(2)`` after the first dense block (96 x 96 inputs: 24 -> 28 before
  the first transition): ``code_zero_pad=True``.

torchvision's DenseNet has no ``norm_layer`` argument, so every BatchNorm2d it builds is replaced
by type: ``gn``/``ln``/``in`` by :func:`~fednorm.models.norm.make_norm` (the DenseNet norms sit
*before* their convs, on the concatenated features), ``none`` by
:func:`~fednorm.models.wsconv.remove_norm_layers` (convs keep torchvision's ``bias=False``, as
ResNet-18 ``none``) and ``ws`` by :func:`~fednorm.models.wsconv.convert_to_ws`. ``width`` scales
the growth rate and the initial features (1.0 = DenseNet-121; tests use less). The network
downsamples by 32: at 32 x 32 the last block is 1 x 1, too small for ``norm="in"``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from torch import nn
from torchvision.models import DenseNet

from .norm import check_norm
from .unet import check_bn_mode, model_norm
from .wsconv import convert_to_ws, remove_norm_layers

DENSENET121_BLOCKS = (6, 12, 24, 16)


def replace_batchnorm(model: nn.Module, build: Callable[[int], nn.Module]) -> nn.Module:
    """Replace every ``BatchNorm2d`` of ``model`` (in place, selected by type) by ``build(num_features)``."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.BatchNorm2d):
            setattr(model, name, build(child.num_features))
        else:
            replace_batchnorm(child, build)
    return model


def densenet121(
    num_classes: int = 2,
    norm: str = "bn",
    in_channels: int = 3,
    width: float = 1.0,
    bn_mode: str = "running",
    code_zero_pad: bool = False,
) -> DenseNet:
    """torchvision DenseNet-121 with ``norm`` layers; see the module docstring for the options."""
    check_norm(norm)
    check_bn_mode(norm, bn_mode)
    if width <= 0:
        raise ValueError(f"width must be > 0, got {width}")
    growth, init = max(1, round(32 * width)), max(1, round(64 * width))
    model = DenseNet(growth_rate=growth, block_config=DENSENET121_BLOCKS, num_init_features=init, num_classes=num_classes)
    if in_channels != 3:
        old = model.features.conv0
        model.features.conv0 = nn.Conv2d(in_channels, old.out_channels, old.kernel_size, old.stride, old.padding, bias=False)
        nn.init.kaiming_normal_(model.features.conv0.weight)  # torchvision's DenseNet init
    if code_zero_pad:
        layers = OrderedDict()
        for name, module in model.features.named_children():
            layers[name] = module
            if name == "denseblock1":
                layers["zero_padding"] = nn.ZeroPad2d(2)
        model.features = nn.Sequential(layers)
    if norm == "ws":
        convert_to_ws(model)
    elif norm == "none":
        remove_norm_layers(model)
    elif norm != "bn" or bn_mode != "running":
        replace_batchnorm(model, lambda c: model_norm(norm, c, bn_mode))
    return model
