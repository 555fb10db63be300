"""Pieces shared by the medical datasets: split types, split rules, fetching and image helpers.

* :class:`SegmentationSplit` — images (uint8, N x C x H x W) and per-pixel class masks (uint8,
  N x H x W). :class:`fednorm.data.domain.Split` holds one int64 label per image, so masks need
  their own type. Masks stay uint8 (8x less memory than int64); a training loop converts a batch
  with ``y.long()`` before a cross-entropy or Dice loss.
* :class:`FeatureSplit` — float32 feature vectors (N x D), int64 labels and optional int64 groups
  (e.g. the subject each ABIDE window comes from), for non-image data.
* :func:`harmofl_bounds` — HarmoFL's per-client 64/16/20 train/val/test rule, with the official
  code's exact rounding.

Every loader returns :class:`fednorm.data.domain.Domain` objects whose splits are one of these
types (or the plain :class:`Split` for classification), so the federation builder can wrap them in
:class:`ClientData` like any other domain.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ..domain import DataError, Domain, Split
from ..download import download as _download
from ..download import verify_file

# --- split types -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SegmentationSplit:
    """Images (uint8, N x C x H x W) and their class masks (uint8, N x H x W, values 0..K-1)."""

    x: torch.Tensor
    y: torch.Tensor

    def __post_init__(self) -> None:
        if self.x.dtype != torch.uint8 or self.x.ndim != 4:
            raise TypeError(f"SegmentationSplit images must be uint8 N x C x H x W, got {self.x.dtype} "
                            f"{tuple(self.x.shape)}")
        if self.y.dtype != torch.uint8 or self.y.ndim != 3:
            raise TypeError(f"SegmentationSplit masks must be uint8 N x H x W, got {self.y.dtype} "
                            f"{tuple(self.y.shape)}")
        if self.y.shape[0] != self.x.shape[0] or self.y.shape[1:] != self.x.shape[2:]:
            raise ValueError(f"masks {tuple(self.y.shape)} do not match images {tuple(self.x.shape)}")

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def subset(self, index: torch.Tensor) -> "SegmentationSplit":
        return SegmentationSplit(self.x[index], self.y[index])

    @staticmethod
    def concat(splits: list["SegmentationSplit"]) -> "SegmentationSplit":
        return SegmentationSplit(torch.cat([s.x for s in splits]), torch.cat([s.y for s in splits]))


@dataclass(frozen=True)
class FeatureSplit:
    """Feature vectors (float32, N x D), labels (int64, N) and optional groups (int64, N).

    ``groups`` names the unit a sample belongs to (an ABIDE subject: its sliding windows must stay
    in one split), so evaluation can also be done per group.
    """

    x: torch.Tensor
    y: torch.Tensor
    groups: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.x.dtype != torch.float32 or self.x.ndim != 2:
            raise TypeError(f"FeatureSplit features must be float32 N x D, got {self.x.dtype} "
                            f"{tuple(self.x.shape)}")
        if self.y.dtype != torch.int64 or self.y.ndim != 1 or self.y.shape[0] != self.x.shape[0]:
            raise ValueError(f"FeatureSplit labels must be int64 of length {self.x.shape[0]}, got "
                             f"{self.y.dtype} {tuple(self.y.shape)}")
        if self.groups is not None and (self.groups.ndim != 1 or self.groups.shape[0] != self.x.shape[0]):
            raise ValueError(f"FeatureSplit groups must be a vector of length {self.x.shape[0]}")

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def subset(self, index: torch.Tensor) -> "FeatureSplit":
        return FeatureSplit(self.x[index], self.y[index], None if self.groups is None else self.groups[index])

    @staticmethod
    def concat(splits: list["FeatureSplit"]) -> "FeatureSplit":
        groups = None
        if all(s.groups is not None for s in splits):
            groups = torch.cat([s.groups for s in splits])
        return FeatureSplit(torch.cat([s.x for s in splits]), torch.cat([s.y for s in splits]), groups)


# --- split rules -----------------------------------------------------------------------------------

HARMOFL_FRACTIONS = (0.64, 0.16, 0.20)


def harmofl_bounds(n: int) -> tuple[int, int]:
    """``(train_end, val_end)`` of HarmoFL's 64/16/20 split of ``n`` ordered samples.

    Exactly the official code (med-air/HarmoFL ``utils/dataset.py``, ``Prostate``):
    ``trainlen = 0.8 * n * 0.8``; ``vallen = 0.8 * n - trainlen``; train ``[:int(trainlen)]``,
    val ``[int(trainlen):int(trainlen + vallen)]``, test the rest. 100 -> 64 / 16 / 20.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    trainlen = 0.8 * n * 0.8
    vallen = 0.8 * n - trainlen
    return int(trainlen), int(trainlen + vallen)


def fraction_bounds(n: int, fractions: Sequence[float]) -> tuple[int, int]:
    """``(train_end, val_end)`` for (train, val, test) fractions summing to 1; ``int()`` rounding
    down as in the official codes, so the test split gets the remainder."""
    if len(fractions) != 3 or any(f < 0 for f in fractions) or abs(sum(fractions) - 1.0) > 1e-9:
        raise ValueError(f"fractions must be three non-negative numbers summing to 1, got {fractions}")
    # int() of the products as the official codes, but of the products of the decimal fractions: in binary floating
    # point 0.7 + 0.1 is 0.7999999999999999, whose int(10 x) would be 7 and leave a 10-sample site no validation
    train_end = int(fractions[0] * n + 1e-9)
    return train_end, max(train_end, int((fractions[0] + fractions[1]) * n + 1e-9))


def split_indices(n: int, fractions: str | Sequence[float], seed: int) -> tuple[np.ndarray, ...]:
    """Train/val/test indices of a seeded random permutation of ``n`` samples.

    ``fractions``: ``"harmofl"`` (:func:`harmofl_bounds`) or (train, val, test) fractions.
    """
    order = np.random.default_rng(seed).permutation(n)
    a, b = harmofl_bounds(n) if fractions == "harmofl" else fraction_bounds(n, fractions)
    return order[:a], order[a:b], order[b:]


def group_split_indices(groups: np.ndarray, fractions: str | Sequence[float], seed: int) -> tuple[np.ndarray, ...]:
    """Like :func:`split_indices`, but whole groups (slides, patients) go to one split.

    Groups are shuffled with ``seed`` and laid end to end; a group goes to the split whose share
    of the samples holds the group's midpoint (so split sizes are as close to the fractions as
    whole groups allow; with very few groups a split can be empty). Sample order within a split
    follows the shuffled groups.
    """
    fr = HARMOFL_FRACTIONS if fractions == "harmofl" else tuple(fractions)
    fraction_bounds(len(groups), fr)  # validates
    groups = np.asarray(groups)
    uniq = np.unique(groups)
    uniq = uniq[np.random.default_rng(seed).permutation(len(uniq))]
    n = len(groups)
    bounds = (fr[0] * n, (fr[0] + fr[1]) * n)
    parts: list[list[np.ndarray]] = [[], [], []]
    filled = 0
    for g in uniq:
        members = np.flatnonzero(groups == g)
        middle = filled + len(members) / 2
        parts[0 if middle < bounds[0] else (1 if middle < bounds[1] else 2)].append(members)
        filled += len(members)
    return tuple(np.concatenate(p) if p else np.zeros(0, dtype=np.int64) for p in parts)


def truncate_train_to_smallest(domains: Sequence[Domain]) -> list[Domain]:
    """Every domain's training split cut to the smallest one's size, keeping the first samples.

    HarmoFL (Camelyon17, prostate): "training-set size truncated to the smallest client"; the
    official ``fed_train.py`` takes ``Subset(trainset, range(min_len))`` (the first samples in
    split order, not a random subset). Val and test are untouched.
    """
    if not domains:
        return []
    n = min(len(d.train) for d in domains)
    keep = torch.arange(n)
    return [replace(d, train=d.train.subset(keep)) for d in domains]


# --- fetching and writing --------------------------------------------------------------------------


@dataclass(frozen=True)
class RawFile:
    """One official file: its URL (None = no direct download) and the digests known for it (None =
    not known). Same fields as :class:`fednorm.data.prepare.RawFile`, defined here so the medical
    loaders import nothing from the preparers of other datasets."""

    url: str | None
    filename: str
    sha256: str | None = None
    md5: str | None = None

    def expected_md5(self) -> str | None:
        return self.md5


def write_dataset_file(data_dir: Path, relpath: str, arrays: dict[str, np.ndarray], *, key: str,
                       source: str) -> Path:
    """:func:`fednorm.data.prepare.write_dataset_file` (npz + manifest entry), imported when a
    preparer runs."""
    from ..prepare import write_dataset_file as write

    return write(Path(data_dir), relpath, arrays, key=key, source=source)


def fetch(source: RawFile, raw_dir: Path, *, download: bool, progress: bool, manual: str,
          min_size: int | None = None) -> Path:
    """The file ``raw_dir/source.filename``: checked if present, else downloaded (if a URL is
    known and ``download``), else a :class:`DataError` whose message is ``manual`` (what to get
    and where to put it). ``min_size`` (bytes): a file smaller is refused as truncated (for a
    file with no published digest)."""
    path = Path(raw_dir) / source.filename
    md5 = source.expected_md5()
    if not path.is_file():
        if source.url is None or not download:
            raise DataError(f"{path} is missing. {manual}")
        _download(source.url, path, source.sha256, progress, md5=md5)
    else:
        verify_file(path, sha256=source.sha256, md5=md5)
    if min_size is not None and path.stat().st_size < min_size:
        raise DataError(f"{path} has {path.stat().st_size} bytes, fewer than the official file's {min_size:,}. It "
                        f"is truncated or not the official one: delete it and get it again. {manual}")
    return path


# --- images ----------------------------------------------------------------------------------------


def read_image(path_or_bytes, what: str, *, mode: str = "RGB") -> np.ndarray:
    """An image file (path or bytes) as a uint8 array (H, W, 3) for RGB, (H, W) for ``"L"``;
    a :class:`DataError` naming ``what`` if it cannot be decoded."""
    from PIL import Image, UnidentifiedImageError

    try:  # DecompressionBombError: a huge slide (e.g. a MoNuSAC .svs converted whole)
        src = io.BytesIO(path_or_bytes) if isinstance(path_or_bytes, (bytes, bytearray)) else path_or_bytes
        with Image.open(src) as im:
            im.load()
            if mode == "RGB":
                return np.asarray(im.convert("RGB"), dtype=np.uint8)
            if mode == "mask":  # any single-band or RGB mask: foreground = any channel > 0
                arr = np.asarray(im)
                if arr.ndim == 3:
                    arr = arr[..., :3].max(axis=-1) if arr.shape[-1] >= 3 else arr[..., 0]
                return arr
            return np.asarray(im.convert(mode), dtype=np.uint8)
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise DataError(f"Cannot decode the image {what} ({type(exc).__name__}: {exc}). The file is "
                        "corrupt or truncated: get it again from the official source.") from exc


def resize_image(img: np.ndarray, size: int) -> np.ndarray:
    """(H, W, 3) uint8 -> (size, size, 3), bilinear (PIL), unchanged when already that size."""
    if img.shape[:2] == (size, size):
        return img
    from PIL import Image

    return np.asarray(Image.fromarray(img).resize((size, size), Image.BILINEAR), dtype=np.uint8)


def resize_mask(mask: np.ndarray, size: int) -> np.ndarray:
    """(H, W) integer class mask -> (size, size) uint8, nearest neighbour (labels stay labels)."""
    mask = np.asarray(mask)
    if mask.size and (mask.min() < 0 or mask.max() > 255):
        raise ValueError(f"mask values must be in 0..255, found {mask.min()}..{mask.max()}")
    mask = mask.astype(np.uint8)
    if mask.shape == (size, size):
        return mask
    from PIL import Image

    return np.asarray(Image.fromarray(mask).resize((size, size), Image.NEAREST), dtype=np.uint8)


def nhwc_to_nchw(x: np.ndarray) -> torch.Tensor:
    """uint8 (N, H, W, C) array -> contiguous uint8 tensor (N, C, H, W)."""
    return torch.from_numpy(np.ascontiguousarray(x)).permute(0, 3, 1, 2).contiguous()


def empty_like_split(split):
    """A split of the same type with no samples (an external client's unused train split)."""
    return split.subset(torch.zeros(0, dtype=torch.int64))


def check_choice(value: str, choices: Sequence[str], what: str) -> str:
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}; choose one of {', '.join(choices)}")
    return value


__all__ = [
    "FeatureSplit", "SegmentationSplit", "Split", "HARMOFL_FRACTIONS", "harmofl_bounds",
    "fraction_bounds", "split_indices", "group_split_indices", "truncate_train_to_smallest",
]
