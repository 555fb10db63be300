"""ResNets of FedWon: PyTorch's ResNet-18 (Office-Caltech-10, Fed-ISIC2019) and the CIFAR ResNet-20 (Table 13).

:func:`resnet18` is torchvision's default ResNet-18 (random init) built with the normalization
factory as ``norm_layer``; FedAvg+GN uses FedWon's rule (App. A.2,
:func:`~fednorm.models.norm.default_groups`). ``ws`` builds it without normalization and converts
every convolution, the 1x1 downsample convolutions included, to a :class:`~fednorm.models.wsconv.WSConv2d`.
It downsamples by 32: at 32 x 32 the last stage is 1 x 1 and ``norm="in"`` cannot train (use >= 64 x 64).

:class:`ResNet20` is the CIFAR-10 ResNet-20 of He et al. 2016 (Sec. 4.2), which FedWon does not
describe further: a 3x3 stem conv (16), three stages of three BasicBlocks (16, 32, 64 channels,
stride 2 at the start of stages 2 and 3), global average pool and FC(64, classes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models import resnet18 as tv_resnet18

from .norm import check_norm, make_conv, make_norm, norm_factory
from .wsconv import convert_to_ws

SHORTCUTS = ("A", "B")


def resnet18(num_classes: int = 10, norm: str = "bn", in_channels: int = 3) -> nn.Module:
    """torchvision ResNet-18 with ``norm`` layers (``none``/``ws``: none; ``ws``: WSConv2d everywhere).

    With ``norm="none"`` the convs keep torchvision's ``bias=False`` (BN simply removed, "FedAvg w/o
    BN"); ``ws`` gives them a bias (:func:`convert_to_ws`, FedWon Listing 1). ``in_channels != 3``
    replaces the stem conv.
    """
    check_norm(norm)
    model = tv_resnet18(weights=None, num_classes=num_classes, norm_layer=norm_factory(norm))
    if in_channels != 3:
        old = model.conv1
        model.conv1 = nn.Conv2d(in_channels, old.out_channels, old.kernel_size, old.stride, old.padding, bias=False)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")  # torchvision's init
    if norm == "ws":
        convert_to_ws(model)
    return model


class PadShortcut(nn.Module):
    """He et al.'s option A: parameter-free shortcut, stride subsampling and zero channels appended."""

    def __init__(self, stride: int, extra_channels: int) -> None:
        super().__init__()
        self.stride, self.extra = stride, extra_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, :, :: self.stride, :: self.stride]
        half = self.extra // 2
        return F.pad(x, (0, 0, 0, 0, half, self.extra - half))

    def extra_repr(self) -> str:
        return f"stride={self.stride}, extra_channels={self.extra}"


class BasicBlock(nn.Module):
    """Two 3x3 convs with ``norm`` after each, ReLU after the sum (He et al. 2016)."""

    def __init__(self, norm: str, in_planes: int, planes: int, stride: int = 1, shortcut: str = "A") -> None:
        super().__init__()
        bias = norm in ("ws", "none")  # no norm follows: keep the conv bias (the removed norm's shift)
        self.conv1 = make_conv(norm, in_planes, planes, 3, stride, 1, bias=bias)
        self.bn1 = make_norm(norm, planes)
        self.conv2 = make_conv(norm, planes, planes, 3, 1, 1, bias=bias)
        self.bn2 = make_norm(norm, planes)
        if stride == 1 and in_planes == planes:
            self.shortcut: nn.Module = nn.Identity()
        elif shortcut == "A":
            self.shortcut = PadShortcut(stride, planes - in_planes)
        else:
            self.shortcut = nn.Sequential(
                make_conv(norm, in_planes, planes, 1, stride, 0, bias=bias), make_norm(norm, planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet20(nn.Module):
    """CIFAR ResNet-20 (He et al. 2016, Sec. 4.2); 269,722 parameters with BN and 10 classes (option A).

    ``shortcut``: ``"A"`` (default) is the paper's CIFAR choice, the parameter-free identity shortcut
    (stride-2 subsampling, zero-padded channels), so the dimension-changing blocks add no weights
    and ``ws`` has nothing else to convert. ``"B"`` uses 1x1 projection conv + norm on the two
    dimension-changing blocks (272,474 parameters with BN); not needed for FedWon, offered for
    comparison with implementations that use it.

    Convs are ``bias=False`` when a norm follows (bn, gn, ln, in) and ``bias=True`` for ``ws`` and
    ``none`` (FedWon Listing 1's default: the removed norm carried the per-channel shift).
    """

    def __init__(self, num_classes: int = 10, norm: str = "bn", in_channels: int = 3, shortcut: str = "A") -> None:
        super().__init__()
        check_norm(norm)
        if shortcut not in SHORTCUTS:
            raise ValueError(f"unknown shortcut {shortcut!r}; choose one of {', '.join(SHORTCUTS)}")
        bias = norm in ("ws", "none")
        self.conv1 = make_conv(norm, in_channels, 16, 3, 1, 1, bias=bias)
        self.bn1 = make_norm(norm, 16)
        layers, in_planes = [], 16
        for planes, stride in ((16, 1), (32, 2), (64, 2)):
            blocks = []
            for i in range(3):
                blocks.append(BasicBlock(norm, in_planes, planes, stride if i == 0 else 1, shortcut))
                in_planes = planes
            layers.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = layers
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():
            if type(m) is nn.Conv2d:  # WSConv2d keeps its own (Xavier) init
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet20(num_classes: int = 10, norm: str = "bn", in_channels: int = 3, shortcut: str = "A") -> ResNet20:
    return ResNet20(num_classes=num_classes, norm=norm, in_channels=in_channels, shortcut=shortcut)
