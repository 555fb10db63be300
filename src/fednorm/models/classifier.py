"""The three-layer classifier head shared by the digit CNN and AlexNet, in the papers' two variants.

- ``fedbn``: the normalization also follows FC1 and FC2 (FedBN Tables 3 and 9: "BN layers are added
  following each feature extraction layer" / "after each ... fully-connected layer (except the
  last)"), no dropout;
- ``fedwon``: Dropout before FC1 and FC2 and no normalization (FedWon Tables 5 and 6, used for all
  of FedWon's "methods with BN"). FedWon does not state the dropout probability; PyTorch's 0.5 is
  the default.
"""

from __future__ import annotations

from torch import nn

from .norm import make_norm

CLASSIFIERS = ("fedbn", "fedwon")


def check_classifier(kind: str) -> str:
    if kind not in CLASSIFIERS:
        raise ValueError(f"unknown classifier {kind!r}; choose one of {', '.join(CLASSIFIERS)}")
    return kind


def three_layer_classifier(
    kind: str, norm: str, in_features: int, hidden1: int, hidden2: int, num_classes: int, dropout: float = 0.5
) -> nn.Sequential:
    """FC(in, h1) -> FC(h1, h2) -> FC(h2, classes) with ReLUs, in the ``kind`` variant."""
    check_classifier(kind)
    if kind == "fedbn":
        return nn.Sequential(
            nn.Linear(in_features, hidden1),
            make_norm(norm, hidden1, spatial=False),
            nn.ReLU(inplace=True),
            nn.Linear(hidden1, hidden2),
            make_norm(norm, hidden2, spatial=False),
            nn.ReLU(inplace=True),
            nn.Linear(hidden2, num_classes),
        )
    return nn.Sequential(
        nn.Dropout(dropout),
        nn.Linear(in_features, hidden1),
        nn.ReLU(inplace=True),
        nn.Dropout(dropout),
        nn.Linear(hidden1, hidden2),
        nn.ReLU(inplace=True),
        nn.Linear(hidden2, num_classes),
    )
