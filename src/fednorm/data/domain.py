"""In-memory data types shared by every dataset, partitioner and engine.

Images live as ``uint8`` tensors of shape (N, C, H, W) and labels as ``int64`` tensors of shape (N,).
They are resized once at load time; batches are converted to float and normalized on the fly
(:func:`normalize_batch`), so no per-sample PIL transform or DataLoader worker runs in the hot loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class DataError(RuntimeError):
    """A data file is missing, corrupt or not in the expected format; the message says what to do."""


@dataclass(frozen=True)
class Split:
    """Images (uint8, N x C x H x W) and their labels (int64, N)."""

    x: torch.Tensor
    y: torch.Tensor

    def __post_init__(self) -> None:
        if self.x.dtype != torch.uint8:
            raise TypeError(f"Split images must be uint8, got {self.x.dtype}")
        if self.x.ndim != 4:
            raise ValueError(f"Split images must be N x C x H x W, got shape {tuple(self.x.shape)}")
        if self.y.ndim != 1 or self.y.shape[0] != self.x.shape[0]:
            raise ValueError(
                f"Split labels must be a vector of length {self.x.shape[0]}, got shape {tuple(self.y.shape)}"
            )

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def subset(self, index: torch.Tensor) -> "Split":
        return Split(self.x[index], self.y[index])

    @staticmethod
    def concat(splits: list["Split"]) -> "Split":
        return Split(torch.cat([s.x for s in splits]), torch.cat([s.y for s in splits]))


@dataclass(frozen=True)
class Domain:
    """One data source (a dataset, a hospital, a rendering style) with its train/test(/val) splits.

    ``origin`` says where the images come from, e.g. ``"real"`` or ``"rendered"``; results tables
    show a domain whose origin is not real with a marker, so rendered stand-ins are never mistaken
    for the paper's datasets.
    """

    name: str
    train: Split
    test: Split
    val: Split | None = None
    num_classes: int = 10
    origin: str = "real"
    description: str = ""


@dataclass(frozen=True)
class ClientData:
    """What one federated client holds: its training data and its own held-out splits."""

    name: str
    domain: str
    train: Split
    test: Split
    val: Split | None = None
    origin: str = "real"
    meta: dict = field(default_factory=dict)

    @property
    def num_train(self) -> int:
        return len(self.train)


def normalize_batch(
    x: torch.Tensor, mean: tuple[float, ...] = (0.5,), std: tuple[float, ...] = (0.5,)
) -> torch.Tensor:
    """uint8 (N, C, H, W) -> float32 scaled to [0, 1] then standardized per channel."""
    out = x.float().div_(255.0)
    m = torch.tensor(mean, dtype=out.dtype).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=out.dtype).view(1, -1, 1, 1)
    return out.sub_(m).div_(s)
