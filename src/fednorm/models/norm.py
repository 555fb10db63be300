"""One place that builds normalization layers (and the matching convolution) by name.

| kind   | layer after a conv / after a linear layer                     | paper            |
| ------ | ------------------------------------------------------------- | ---------------- |
| ``bn`` | BatchNorm2d / BatchNorm1d                                     | FedAvg, FedBN... |
| ``gn`` | GroupNorm (FedWon's group counts, see :func:`default_groups`) | FedAvg+GN        |
| ``ln`` | GroupNorm(1, C), as FedWon's FedAvg+LN (not ``nn.LayerNorm``) | FedAvg+LN        |
| ``in`` | InstanceNorm2d with affine parameters (convs only)            | zoo extra        |
| ``none``| Identity, plain convs ("FedAvg w/o BN")                      | FedWon Fig. 3    |
| ``ws`` | Identity, and every conv is a :class:`WSConv2d`               | FedWon           |
| ``fbn``| FederatedBatchNorm2d / 1d (:mod:`fednorm.models.fbn`)         | FBN              |

Models take a ``norm`` name and build their layers with :func:`make_norm` and :func:`make_conv`;
torchvision models, which build their own convs, are converted with
:func:`fednorm.models.wsconv.convert_to_ws`. Nothing else in the library hard-codes a normalization
class.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from .wsconv import WSConv2d

NORM_KINDS = ("bn", "gn", "ln", "in", "none", "ws", "fbn")
BATCHNORM_KINDS = ("bn", "fbn")  # kinds whose layers are _BatchNorm (batch statistics, running stats)


def check_norm(kind: str) -> str:
    if kind not in NORM_KINDS:
        raise ValueError(f"unknown normalization {kind!r}; choose one of {', '.join(NORM_KINDS)}")
    return kind


def default_groups(num_channels: int) -> int:
    """FedWon's GroupNorm rule for ResNet-18 / MobileNetV2 (App. A.2): 32 groups, 8 when the layer has
    fewer than 32 channels, 24 when it has 144 (MobileNetV2's expansion layer).

    The digit CNN and AlexNet pass their tables' counts explicitly instead (FedWon Tables 5 and 6:
    32 groups after the first two convs, 64 after the others). If a count does not divide the
    channels (a width multiplier), :func:`fitted_groups` lowers it until it does, with a warning.
    """
    return 8 if num_channels < 32 else 24 if num_channels == 144 else 32


def fitted_groups(requested: int, num_channels: int) -> int:
    """``requested`` GroupNorm groups over ``num_channels``, lowered to the largest count that divides the channels
    (and at most the channels) when it does not, with a warning naming both: the papers' counts assume width 1."""
    groups = min(requested, num_channels)
    while num_channels % groups:
        groups -= 1
    if groups != requested:
        # Python shows a given message once per place, so a model of many such layers warns once per layer size
        warnings.warn(f"GroupNorm over {num_channels} channels uses {groups} groups instead of {requested}, which does "
                      f"not divide {num_channels} (a width multiplier changed the channel count; the papers' group "
                      "counts assume width 1)", stacklevel=3)
    return groups


def make_norm(kind: str, num_features: int, *, spatial: bool = True, groups: int | None = None) -> nn.Module:
    """A normalization layer over ``num_features`` channels.

    ``spatial`` selects the layer after a convolution (N, C, H, W) vs after a linear layer (N, C);
    ``groups`` overrides the GroupNorm group count of :func:`default_groups`.
    """
    check_norm(kind)
    if kind == "bn":
        return nn.BatchNorm2d(num_features) if spatial else nn.BatchNorm1d(num_features)
    if kind == "fbn":
        from .fbn import FederatedBatchNorm1d, FederatedBatchNorm2d

        return FederatedBatchNorm2d(num_features) if spatial else FederatedBatchNorm1d(num_features)
    if kind == "gn":
        return nn.GroupNorm(fitted_groups(groups or default_groups(num_features), num_features), num_features)
    if kind == "ln":
        return nn.GroupNorm(1, num_features)
    if kind == "in":
        if not spatial:
            raise ValueError(
                "instance norm after a linear layer would normalize single values; use a classifier "
                "without normalization (classifier: fedwon) or another norm"
            )
        return nn.InstanceNorm2d(num_features, affine=True)
    return nn.Identity()  # none, ws


def make_conv(kind: str, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, **kw) -> nn.Conv2d:
    """The convolution that goes with ``kind``: :class:`WSConv2d` for ``ws``, ``nn.Conv2d`` otherwise."""
    check_norm(kind)
    cls = WSConv2d if kind == "ws" else nn.Conv2d
    return cls(in_channels, out_channels, kernel_size, stride, padding, **kw)


def norm_factory(kind: str) -> Callable[..., nn.Module]:
    """``norm_layer``-style factory (torchvision convention: called with the channel count)."""
    check_norm(kind)
    return lambda num_features, spatial=True: make_norm(kind, num_features, spatial=spatial)


@contextmanager
def buffers_kept(model: nn.Module) -> Iterator[None]:
    """Forward passes inside leave every buffer of ``model`` as it was: BatchNorm's (and FBN's) running statistics
    and batch counters are restored on exit, while training-mode layers still normalize with their batch
    statistics. For passes whose activations are not the model's own: the perturbed pass of SAM / HarmoFL's
    weight perturbation, Per-FedAvg's finite differences, a diagnostic's measurement. Exit after ``backward``:
    native BatchNorm's backward may read the buffers."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)
