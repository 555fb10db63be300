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


class DataWarning(UserWarning):
    """Data that load but could not be checked (a file no manifest lists): results may rest on a wrong file."""


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


# ``data.input_norm``: the per-channel (mean, std) a uint8 batch is standardized with after /255
INPUT_NORMS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "half": ((0.5,), (0.5,)),  # [-1, 1]: FedBN's digits code, Normalize((0.5,) * 3, (0.5,) * 3)
    "unit": ((0.0,), (1.0,)),  # [0, 1], ToTensor only: FedBN's Office-Caltech-10 / DomainNet code
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),  # torchvision's ImageNet weights; FLamby's Normalize
    "raw": ((0.0,), (1.0 / 255.0,)),  # [0, 255], the uint8 values as floats: HarmoFL's prostate code
}


@dataclass(frozen=True)
class Standardize:
    """The ``prepare`` step of image domains: uint8 (N, C, H, W) -> central ``crop`` -> /255 -> (x - mean) / std
    per channel.

    One mean and std for every channel, or one per channel (``imagenet``: RGB images only). ``crop``
    (``data.center_crop``) cuts every larger batch to its central ``crop`` x ``crop`` (offset ``(side - crop) // 2``,
    albumentations' ``CenterCrop``; torchvision's rounds ``(side - crop) / 2``, one pixel apart for odd margins) and
    leaves a batch of that size as it is (training batches an augmentation already cropped). Every path to the
    model goes through ``prepare``: training, evaluation, external clients, diagnostics."""

    mean: tuple[float, ...] = (0.5,)
    std: tuple[float, ...] = (0.5,)
    crop: int | None = None

    def center_crop(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (uint8, N x C x H x W) cut to its central ``crop`` x ``crop``; as it is without ``crop``."""
        if self.crop is None:
            return x
        h, w = x.shape[-2:]
        if h < self.crop or w < self.crop:
            raise ValueError(f"data.center_crop {self.crop} is larger than the {h} x {w} images")
        top, left = (h - self.crop) // 2, (w - self.crop) // 2
        return x[..., top:top + self.crop, left:left + self.crop]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.mean) > 1 and x.shape[1] != len(self.mean):
            raise ValueError(f"the input normalization has {len(self.mean)} channel means, the images have "
                             f"{x.shape[1]} channels: data.input_norm imagenet is for RGB images (use half or unit)")
        return normalize_batch(self.center_crop(x), self.mean, self.std)


def input_normalization(name: str = "half", crop: int | None = None) -> Standardize:
    """The ``prepare`` step named by ``data.input_norm`` (:data:`INPUT_NORMS`), with ``data.center_crop``."""
    if name not in INPUT_NORMS:
        raise ValueError(f"unknown input normalization {name!r}; choose one of {', '.join(INPUT_NORMS)}")
    return Standardize(*INPUT_NORMS[name], crop=crop)


def normalize_batch(
    x: torch.Tensor, mean: tuple[float, ...] = (0.5,), std: tuple[float, ...] = (0.5,)
) -> torch.Tensor:
    """uint8 (N, C, H, W) -> float32 scaled to [0, 1] then standardized per channel."""
    out = x.float().div_(255.0)
    m = torch.tensor(mean, dtype=out.dtype).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=out.dtype).view(1, -1, 1, 1)
    return out.sub_(m).div_(s)
