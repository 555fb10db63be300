"""MobileNetV2 (FedWon's CIFAR-10 label-skew backbone, Table 15): PyTorch's default implementation.

torchvision's ``mobilenet_v2`` (random init) built with the normalization factory as ``norm_layer``.
FedAvg+GN follows FedWon's rule (App. A.2, :func:`~fednorm.models.norm.default_groups`): 32 groups,
8 for the 16- and 24-channel layers, 24 for the 144-channel expansion layers. ``ws`` builds the
model without normalization and converts every convolution, the depthwise ones (groups = channels)
included, to a :class:`~fednorm.models.wsconv.WSConv2d` with the same groups.

The network downsamples by 32, so a 32 x 32 input ends on a 1 x 1 map: ``norm="in"`` then cannot
train (instance norm needs more than one value per channel); use 64 x 64 inputs or larger.
"""

from __future__ import annotations

from torch import nn
from torchvision.models import mobilenet_v2 as tv_mobilenet_v2

from .norm import check_norm, norm_factory
from .wsconv import convert_to_ws


def mobilenet_v2(num_classes: int = 10, norm: str = "bn", in_channels: int = 3, width_mult: float = 1.0) -> nn.Module:
    """torchvision MobileNetV2 with ``norm`` layers (``none``/``ws``: none; ``ws``: WSConv2d everywhere).

    With ``norm="none"`` the convs keep torchvision's ``bias=False``; ``ws`` gives them a bias
    (:func:`convert_to_ws`, FedWon Listing 1).
    """
    check_norm(norm)
    model = tv_mobilenet_v2(weights=None, num_classes=num_classes, width_mult=width_mult, norm_layer=norm_factory(norm))
    if in_channels != 3:
        old = model.features[0][0]
        stem = nn.Conv2d(in_channels, old.out_channels, old.kernel_size, old.stride, old.padding, bias=False)
        nn.init.kaiming_normal_(stem.weight, mode="fan_out")  # torchvision's init for convs
        model.features[0][0] = stem
    if norm == "ws":
        convert_to_ws(model)
    return model
