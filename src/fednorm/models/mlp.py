"""The three-layer MLP of FedBN's ABIDE I experiment (feature vectors, e.g. 5,995 connectome values).

FedBN (Sec. 5.2): "three-layer fully connected neural network as the classifier with the hidden
layers of 16 with two BN layers after the first two fully connected layers". The paper states
neither the activation nor the order; like its digit CNN and AlexNet (norm after the layer, then
ReLU) this is FC(D, 16) -> norm -> ReLU -> FC(16, 16) -> norm -> ReLU -> FC(16, classes)
[inferred, as the FedBN extraction reads it]. The norm is any kind with a 1-D form (``bn``, ``fbn``,
``gn``, ``ln``, ``none``; ``ws`` has no convolution to standardize and acts as ``none``; ``in`` is
refused). ``width`` scales the hidden size (1.0 = 16). ``in_features`` comes from the data (the
runner passes the prepared vectors' length: 5,995 for FedBN's atlas, another value if other ROIs
were dropped when preparing).
"""

from __future__ import annotations

import torch
from torch import nn

from .norm import check_norm, make_norm

FEDBN_HIDDEN = 16


class MLP(nn.Module):
    """Logits ``N x num_classes`` for feature vectors ``N x in_features``."""

    def __init__(self, num_classes: int = 2, norm: str = "bn", in_features: int = 5995, width: float = 1.0,
                 hidden: int = FEDBN_HIDDEN) -> None:
        super().__init__()
        check_norm(norm)
        if norm == "in":  # make_norm's message points to a classifier option, which the MLP does not have
            raise ValueError("the MLP has linear layers only: instance norm would normalize single values; choose "
                             "bn, fbn, gn, ln or none")
        if in_features < 1:
            raise ValueError(f"in_features must be >= 1, got {in_features}")
        if width <= 0:
            raise ValueError(f"width must be > 0, got {width}")
        h = max(1, round(hidden * width))
        self.in_features = in_features
        self.layers = nn.Sequential(
            nn.Linear(in_features, h),
            make_norm(norm, h, spatial=False),
            nn.ReLU(inplace=True),
            nn.Linear(h, h),
            make_norm(norm, h, spatial=False),
            nn.ReLU(inplace=True),
            nn.Linear(h, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"MLP expects N x {self.in_features} feature vectors, got shape {tuple(x.shape)}")
        return self.layers(x)
