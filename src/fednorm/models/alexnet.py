"""The AlexNet of FedBN (Table 9) and FedWon (Table 6) for Office-Caltech-10 and DomainNet.

Five convolutions (64, 192, 384, 256, 256 channels; kernels 11, 5, 3, 3, 3; max-pool after convs
1, 2 and 5), an adaptive average pool to 6 x 6 and three linear layers (9216 -> 4096 -> 4096 ->
classes). The normalization after each convolution is a parameter; FedAvg+GN uses FedWon Table 6's
group counts (32 after convs 1-2, 64 after convs 3-5). The classifier comes in two variants:

- ``fedbn``: the normalization also follows FC1 and FC2 (FedBN Table 9: "BN layer after each
  convolutional layer and fully-connected layer (except the last layer)"), no dropout;
- ``fedwon``: Dropout before FC1 and FC2 and no normalization in the classifier (FedWon Table 6,
  used for all of FedWon's methods). The dropout probability is not stated; PyTorch's 0.5 is used.

The papers resize to 256 x 256; thanks to the adaptive pool any input of at least 63 x 63 works
(PACS is 64 x 64 here). Smaller inputs vanish in the third max-pool and are refused.
"""

from __future__ import annotations

import torch
from torch import nn

from .classifier import check_classifier, three_layer_classifier
from .norm import check_norm, make_conv, make_norm

MIN_INPUT = 63  # smallest side whose feature map survives conv1 (stride 4) and the three 3/2 max-pools


class AlexNet(nn.Module):
    def __init__(
        self,
        num_classes: int = 10,
        norm: str = "bn",
        in_channels: int = 3,
        classifier: str = "fedbn",
        plain_conv3: bool = False,
        dropout: float = 0.5,
        width: float = 1.0,
    ) -> None:
        """``width`` scales every channel and feature count (1.0 = the papers' model; tests use less).

        ``norm="in"`` with the ``fedbn`` classifier raises ``ValueError`` (no instance norm after a
        linear layer); use ``classifier="fedwon"``.
        """
        super().__init__()
        check_classifier(classifier)
        check_norm(norm)
        c1, c2, c3, c4, c5, f = (max(1, round(c * width)) for c in (64, 192, 384, 256, 256, 4096))
        flat = c5 * 6 * 6
        # FedWon Table 6 prints layer 3 of the FedWon column as a plain Conv2D(192, 384, 3, 1, 1) while
        # convs 1, 2, 4, 5 are WSConv2D; the text says FedWon replaces *the* convolutions, so this is
        # almost certainly a typo. Default: WSConv everywhere; plain_conv3=True reproduces the table
        # literally (only has an effect with norm="ws": for the other kinds every conv is plain anyway).
        conv3 = nn.Conv2d(c2, c3, 3, 1, 1) if plain_conv3 and norm == "ws" else make_conv(norm, c2, c3, 3, 1, 1)
        self.features = nn.Sequential(
            make_conv(norm, in_channels, c1, 11, 4, 2),
            make_norm(norm, c1, groups=32),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2),
            make_conv(norm, c1, c2, 5, 1, 2),
            make_norm(norm, c2, groups=32),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2),
            conv3,
            make_norm(norm, c3, groups=64),
            nn.ReLU(inplace=True),
            make_conv(norm, c3, c4, 3, 1, 1),
            make_norm(norm, c4, groups=64),
            nn.ReLU(inplace=True),
            make_conv(norm, c4, c5, 3, 1, 1),
            make_norm(norm, c5, groups=64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = three_layer_classifier(classifier, norm, flat, f, f, num_classes, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if min(x.shape[-2:]) < MIN_INPUT:
            raise ValueError(f"AlexNet needs inputs of at least {MIN_INPUT} x {MIN_INPUT}, got {tuple(x.shape[-2:])}")
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))
