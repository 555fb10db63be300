"""The CIFAR-10 CNN of Guerraoui et al. 2024 (FBN paper, Table 1).

Four 3x3 convolutions (64, 64, 128, 128 channels, stride 1, padding 1), each followed by ReLU and THEN
the normalization (the paper's Conv-ReLU-BN order, kept to reproduce it), a 2x2 max-pool and
Dropout(0.25) after the second and the fourth, and two linear layers (128*(S/4)^2 -> 128 -> classes).
At 3 x 32 x 32 and ``norm="bn"`` this is 1,310,922 trainable parameters (flatten 8192).

The paper ends with LogSoftmax and an NLL loss; this model returns the LOGITS instead because fednorm's
engine applies ``cross_entropy`` to the model output, and ``cross_entropy(z) == nll_loss(log_softmax(z))``
exactly, so training is the same (and argmax predictions are unchanged).

The normalization is a parameter (any kind of :func:`fednorm.models.norm.make_norm`: bn, gn, ln, in,
none, ws, fbn...); the classifier has no normalization, as in Table 1.
"""

from __future__ import annotations

import torch
from torch import nn

from .norm import make_conv, make_norm


class FBNCNN(nn.Module):
    def __init__(
        self,
        num_classes: int = 10,
        norm: str = "bn",
        in_channels: int = 3,
        image_size: int = 32,
        width: float = 1.0,
        dropout: float = 0.25,
    ) -> None:
        """``image_size`` is the square input side (32 for CIFAR-10, 28 for MNIST-M / digits); it must be
        divisible by 4 (two 2x2 max-pools) and fixes the flatten size 128*(image_size/4)^2.
        ``width`` scales every channel and the hidden FC size (1.0 = the paper's model; tests use less)."""
        super().__init__()
        if image_size < 4 or image_size % 4:
            raise ValueError(f"FBNCNN needs an image_size divisible by 4 (two 2x2 max-pools), got {image_size}")
        if width <= 0:
            raise ValueError(f"width must be positive, got {width}")
        self.image_size = image_size
        c1, c3, hidden = (max(1, round(c * width)) for c in (64, 128, 128))

        def block(cin: int, cout: int) -> list[nn.Module]:
            # Table 1 order: Conv -> ReLU -> Norm (not the usual Conv -> Norm -> ReLU)
            return [make_conv(norm, cin, cout, 3, 1, 1), nn.ReLU(inplace=True), make_norm(norm, cout)]

        self.features = nn.Sequential(
            *block(in_channels, c1),
            *block(c1, c1),
            nn.MaxPool2d(2, 2),
            nn.Dropout(dropout),
            *block(c1, c3),
            *block(c3, c3),
            nn.MaxPool2d(2, 2),
            nn.Dropout(dropout),
        )
        flat = c3 * (image_size // 4) ** 2
        self.classifier = nn.Sequential(
            nn.Linear(flat, hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, num_classes),  # logits; the paper's LogSoftmax is folded into cross-entropy
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = self.image_size
        if x.shape[-2:] != (side, side):
            raise ValueError(
                f"FBNCNN was built for {side} x {side} inputs, got {tuple(x.shape[-2:])}; "
                f"pass image_size={x.shape[-1]} (32 for CIFAR-10, 28 for MNIST-M)"
            )
        return self.classifier(torch.flatten(self.features(x), 1))
