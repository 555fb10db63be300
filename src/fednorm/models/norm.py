"""One place that builds normalization layers by name.

Names: ``bn`` (BatchNorm), ``gn`` (GroupNorm), ``ln`` (layer norm as GroupNorm(1, C), as FedWon's
FedAvg+LN), ``none`` (identity). Models take a ``norm`` name and call :func:`make_norm`; nothing
else in the library hard-codes a normalization class.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

NORM_KINDS = ("bn", "gn", "ln", "none")


def _check(kind: str) -> None:
    if kind not in NORM_KINDS:
        raise ValueError(f"unknown normalization {kind!r}; choose one of {', '.join(NORM_KINDS)}")


def default_groups(num_channels: int) -> int:
    """GroupNorm group count of FedWon's CNN/AlexNet tables: 32 groups up to 64 channels, else 64.

    FedWon Table 5: GN(32, 64) after 64-channel convs and GN(64, 128) after the 128-channel conv.
    The count is reduced until it divides the channel count.
    """
    groups = 32 if num_channels <= 64 else 64
    groups = min(groups, num_channels)
    while num_channels % groups:
        groups -= 1
    return groups


def make_norm(kind: str, num_features: int, *, spatial: bool = True, groups: int | None = None) -> nn.Module:
    """A normalization layer over ``num_features`` channels.

    ``spatial`` selects BatchNorm2d (after convolutions) vs BatchNorm1d (after linear layers); group
    and layer norm normalize (N, C, ...) inputs of either rank.
    """
    _check(kind)
    if kind == "bn":
        return nn.BatchNorm2d(num_features) if spatial else nn.BatchNorm1d(num_features)
    if kind == "gn":
        return nn.GroupNorm(groups or default_groups(num_features), num_features)
    if kind == "ln":
        return nn.GroupNorm(1, num_features)
    return nn.Identity()


def norm_factory(kind: str) -> Callable[..., nn.Module]:
    """``norm_layer``-style factory, for model builders that take one (torchvision convention)."""
    _check(kind)
    return lambda num_features, spatial=True: make_norm(kind, num_features, spatial=spatial)
