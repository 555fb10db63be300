"""The six-layer digit CNN of FedBN (Table 3) and FedWon (Table 5).

Three 5x5 convolutions (plain, or WSConv with ``norm="ws"``) (64, 64, 128 channels; max-pool after the first two) and three linear layers
(6272 -> 2048 -> 512 -> classes) on 3 x 28 x 28 inputs. The normalization after each convolution is
a parameter. The classifier comes in two variants:

- ``fedbn``: the normalization also follows FC1 and FC2 (FedBN Table 3: "BN layers are added
  following each feature extraction layer"), no dropout;
- ``fedwon``: Dropout before FC1 and FC2 and no normalization in the classifier (FedWon Table 5,
  used for all of FedWon's "methods with BN"). The dropout probability is not stated in FedWon;
  PyTorch's default 0.5 is used.
"""

from __future__ import annotations

import torch
from torch import nn

from .classifier import check_classifier, three_layer_classifier
from .norm import check_norm, make_conv, make_norm



class DigitCNN(nn.Module):
    def __init__(
        self,
        num_classes: int = 10,
        norm: str = "bn",
        classifier: str = "fedbn",
        in_channels: int = 3,
        dropout: float = 0.5,
        width: float = 1.0,
    ) -> None:
        """``width`` scales every layer's channel count (1.0 = the paper's model; tests use less)."""
        super().__init__()
        check_classifier(classifier)
        check_norm(norm)
        c1, c3, f1, f2 = (max(1, round(c * width)) for c in (64, 128, 2048, 512))
        flat = c3 * 7 * 7
        # GroupNorm counts of FedWon Table 5: GN(32, 64), GN(32, 64), GN(64, 128)
        self.features = nn.Sequential(
            make_conv(norm, in_channels, c1, 5, 1, 2),
            make_norm(norm, c1, groups=32),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2, 2),
            make_conv(norm, c1, c1, 5, 1, 2),
            make_norm(norm, c1, groups=32),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2, 2),
            make_conv(norm, c1, c3, 5, 1, 2),
            make_norm(norm, c3, groups=64),
            nn.ReLU(inplace=True),
        )
        self.classifier = three_layer_classifier(classifier, norm, flat, f1, f2, num_classes, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2:] != (28, 28):
            raise ValueError(f"DigitCNN expects 28 x 28 inputs, got {tuple(x.shape[-2:])}")
        return self.classifier(torch.flatten(self.features(x), 1))
