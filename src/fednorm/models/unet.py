"""The 2-D U-Net of HarmoFL's segmentation tasks (nuclei, prostate MRI).

The paper only cites Ronneberger et al. 2015; the layout is the official code's (``nets/models.py``,
the widely used ``brain-segmentation-pytorch`` U-Net): four encoder blocks of 32, 64, 128, 256
channels with 2x2 max-pooling, a 512-channel bottleneck, four decoder stages of a 2x2 stride-2
transposed convolution, concatenation with the encoder skip and a block, and a 1x1 convolution to
``num_classes`` logits (2: softmax over background / foreground). A block is
``conv3x3 -> norm -> ReLU -> conv3x3 -> norm -> ReLU`` with padding 1 (the output has the input's
size, which must be divisible by 16). ``width`` scales every channel count (1.0 = the code's 32 base
channels; tests use less). The amplitude normalization that the code puts first in the network is
kept out of the model here (:mod:`fednorm.methods.amplitude`), so that aggregation never averages it.

Normalization: any :data:`~fednorm.models.norm.NORM_KINDS`. Convs followed by a norm have no bias
(code); with ``none``/``ws`` they keep one. The transposed convs keep their bias and the final 1x1
conv is a plain ``Conv2d`` with bias under every norm (it is the classifier, as a Linear head).
The code's BatchNorm is ``BatchNorm2d(affine=False, track_running_stats=False)``: no gamma/beta and
batch statistics even at evaluation. ``bn_mode="batch"`` builds that; the default ``"running"`` is
fednorm's usual BatchNorm (affine, running statistics for evaluation, which FedBN-style policies can
keep local).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from .norm import check_norm, make_conv, make_norm

BN_MODES = ("running", "batch")


def check_bn_mode(norm: str, bn_mode: str) -> None:
    if bn_mode not in BN_MODES:
        raise ValueError(f"unknown bn_mode {bn_mode!r}; choose one of {', '.join(BN_MODES)}")
    if bn_mode == "batch" and norm != "bn":
        raise ValueError(f"bn_mode='batch' (HarmoFL code's BatchNorm) needs norm='bn', got norm={norm!r}")


def model_norm(norm: str, num_features: int, bn_mode: str = "running") -> nn.Module:
    """:func:`~fednorm.models.norm.make_norm`, or the HarmoFL code's batch-statistics BatchNorm for ``bn_mode="batch"``."""
    if norm == "bn" and bn_mode == "batch":
        return nn.BatchNorm2d(num_features, affine=False, track_running_stats=False)
    return make_norm(norm, num_features)


def _block(norm: str, bn_mode: str, in_channels: int, features: int) -> nn.Sequential:
    bias = norm in ("none", "ws")  # no norm follows: keep the conv bias
    return nn.Sequential(OrderedDict([
        ("conv1", make_conv(norm, in_channels, features, 3, 1, 1, bias=bias)),
        ("norm1", model_norm(norm, features, bn_mode)),
        ("relu1", nn.ReLU(inplace=True)),
        ("conv2", make_conv(norm, features, features, 3, 1, 1, bias=bias)),
        ("norm2", model_norm(norm, features, bn_mode)),
        ("relu2", nn.ReLU(inplace=True)),
    ]))


class UNet(nn.Module):
    """HarmoFL's U-Net: logits ``N x num_classes x H x W`` for inputs ``N x in_channels x H x W`` (H, W % 16 == 0)."""

    DEPTH = 4

    def __init__(
        self,
        num_classes: int = 2,
        norm: str = "bn",
        in_channels: int = 3,
        width: float = 1.0,
        bn_mode: str = "running",
    ) -> None:
        super().__init__()
        check_norm(norm)
        check_bn_mode(norm, bn_mode)
        if num_classes < 2:
            raise ValueError(f"UNet predicts softmax logits over >= 2 classes (background included), got {num_classes}")
        if width <= 0:
            raise ValueError(f"width must be > 0, got {width}")
        f = max(1, round(32 * width))
        chans = [f * 2**i for i in range(self.DEPTH + 1)]  # 32, 64, 128, 256, 512
        self.encoders = nn.ModuleList()
        prev = in_channels
        for c in chans[:-1]:
            self.encoders.append(_block(norm, bn_mode, prev, c))
            prev = c
        self.pool = nn.MaxPool2d(2, 2)
        self.bottleneck = _block(norm, bn_mode, chans[-2], chans[-1])
        self.upconvs = nn.ModuleList()
        self.decoders = nn.ModuleList()
        for c in reversed(chans[:-1]):
            self.upconvs.append(nn.ConvTranspose2d(2 * c, c, kernel_size=2, stride=2))
            self.decoders.append(_block(norm, bn_mode, 2 * c, c))
        self.head = nn.Conv2d(chans[0], num_classes, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 4:
            raise ValueError(f"UNet expects N x C x H x W inputs, got shape {tuple(x.shape)}")
        factor = 2**self.DEPTH
        if x.shape[-2] % factor or x.shape[-1] % factor:
            raise ValueError(f"UNet needs H and W divisible by {factor}, got {tuple(x.shape[-2:])}")
        skips = []
        for encoder in self.encoders:
            x = encoder(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottleneck(x)
        for upconv, decoder, skip in zip(self.upconvs, self.decoders, reversed(skips)):
            x = decoder(torch.cat((upconv(x), skip), dim=1))  # (upsampled, skip) order as the code
        return self.head(x)
