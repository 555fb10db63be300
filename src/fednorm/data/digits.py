"""Real digit domains (MNIST, MNIST-M, USPS, Semeion, SVHN, SynthDigits, Morpho-MNIST) from a data folder.

Each domain is returned as one pool: the union of the file's train and test arrays (train first,
then test), because the FedBN protocol (:mod:`fednorm.data.protocol`) ignores the official splits
and re-splits that union 80/20 with a stratified shuffle. Images are brought to the FedBN digit
CNN's input once, at load time: uint8, 3 x 28 x 28. The official code does this per sample with
torchvision transforms on PIL images (med-air/FedBN ``federated/fed_digits.py``,
``prepare_data``): MNIST ``Grayscale(3)``; USPS ``Resize([28, 28])`` then ``Grayscale(3)``;
MNIST-M no transform (its pickled MNIST-M is 28 x 28 already); SVHN and SynthDigits
``Resize([28, 28])`` of the 32 x 32 RGB images. Here the resize is bilinear with
antialiasing on float tensors, rounded back to uint8; it differs from PIL's ``Resize`` by at most
one grey level.

Choices where the official code has nothing to copy:

* MNIST-M in the offline folder is the 32 x 32 release (Ganin & Lempitsky), not the 28 x 28
  pickle the official code reads, so it is resized 32 -> 28 like SVHN/SynthDigits are there.
* Semeion is not a FedBN domain; it is loaded like USPS (16 x 16 grey, resized, replicated).
* SVHN and SynthDigits have no offline copy; :mod:`fednorm.data.prepare` writes their files from
  the official ones (or FedBN's partitions), and they load like MNIST-M (32 x 32 RGB -> 28 x 28).
* Morpho-MNIST's global and local sets (:mod:`fednorm.data.morpho`, FedBN App. G) have no offline copy either;
  prepared from the authors' zips, they load like MNIST.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fednorm.data.datafolder import load_npz
from fednorm.data.domain import DataError
from fednorm.data.morpho import MORPHO_FILES

IMAGE_SIZE = 28
NUM_CLASSES = 10

REAL_DIGIT_DOMAINS: dict[str, str] = {
    "mnist": "digits/mnist.npz",
    "mnistm": "digits/mnistm.npz",
    "usps": "digits/usps.npz",
    "semeion": "digits/semeion.npz",
    "svhn": "digits/svhn.npz",
    "synthdigits": "digits/synthdigits.npz",
    **MORPHO_FILES,  # Morpho-MNIST's global and local sets (FedBN App. G), MNIST's layout
}

# (image key, label key) pairs of each file, concatenated in this order.
_ARRAY_PAIRS: dict[str, tuple[tuple[str, str], ...]] = {
    "mnist": (("x_train", "y_train"), ("x_test", "y_test")),
    "mnistm": (("x_train", "y_train"), ("x_test", "y_test")),
    "usps": (("x_train", "y_train"), ("x_test", "y_test")),
    "semeion": (("x", "y"),),
    "svhn": (("x_train", "y_train"), ("x_test", "y_test")),
    "synthdigits": (("x_train", "y_train"), ("x_test", "y_test")),
    **{name: (("x_train", "y_train"), ("x_test", "y_test")) for name in MORPHO_FILES},
}

# Domains whose file is written by fednorm.data.prepare from the official files.
_PREPARED = ("svhn", "synthdigits", *MORPHO_FILES)
# the array that marks a file prepared from FedBN's preprocessed partitions (x_train = FedBN's training pool
# in partition order, x_test = its test split): the protocol keeps that split
FEDBN_PRESPLIT_KEY = "fedbn_presplit"

_CHUNK = 2048  # images converted at a time: bounds the float32 working memory to ~25 MB


def _check_images(images: np.ndarray, path: Path, key: str) -> None:
    if images.dtype != np.uint8 or not (
        images.ndim == 3 or (images.ndim == 4 and images.shape[-1] == 3)
    ):
        raise DataError(
            f"In {path}, {key} must be uint8 images (N, H, W) or (N, H, W, 3), got "
            f"{images.dtype} {images.shape}. Re-download or re-copy the file."
        )


def _fill_3x28(images: np.ndarray, out: torch.Tensor) -> None:
    """Write (N, H, W) grey or (N, H, W, 3) RGB uint8 images into ``out`` (N, 3, 28, 28) uint8,
    resizing once where the size differs."""
    for start in range(0, images.shape[0], _CHUNK):
        chunk = torch.from_numpy(images[start : start + _CHUNK])
        chunk = chunk.unsqueeze(1) if chunk.ndim == 3 else chunk.permute(0, 3, 1, 2)
        if tuple(chunk.shape[-2:]) != (IMAGE_SIZE, IMAGE_SIZE):
            # Resize grey images before replicating them (USPS: Resize then Grayscale(3) in the
            # official code), so a grey image is interpolated once, not three times.
            resized = F.interpolate(
                chunk.float(),
                size=(IMAGE_SIZE, IMAGE_SIZE),
                mode="bilinear",
                align_corners=False,
                antialias=True,
            )
            chunk = resized.round_().clamp_(0, 255).to(torch.uint8)
        out[start : start + chunk.shape[0]] = chunk  # broadcasts 1 grey channel to 3


def load_digit_pool(name: str, data_dir: Path, *, with_presplit: bool = False):
    """All images of one real digit domain: (N, 3, 28, 28) uint8 and (N,) int64 labels.

    The pool is the file's train arrays followed by its test arrays (Semeion has one set only).
    The file is verified against the folder's manifest first (see :func:`load_npz`). With
    ``with_presplit``, a third value: the number of training images when the file was prepared from
    FedBN's own partitions (``FEDBN_PRESPLIT_KEY``), whose split the protocol must keep; else None.
    """
    if name not in REAL_DIGIT_DOMAINS:
        raise ValueError(
            f"Unknown real digit domain {name!r}; valid names: {', '.join(REAL_DIGIT_DOMAINS)}"
        )
    relpath = REAL_DIGIT_DOMAINS[name]
    path = Path(data_dir) / relpath
    pairs = _ARRAY_PAIRS[name]
    if name in _PREPARED and Path(data_dir).is_dir() and not path.is_file():
        raise DataError(
            f"Data file {path} is missing: {name} has no offline copy. Create it from the official "
            f"files with: fednorm data prepare {name} --data-dir {data_dir}"
        )
    keys = [k for pair in pairs for k in pair]
    # prepared files may carry the FedBN marker; the others are read by their documented keys only
    arrays = load_npz(Path(data_dir), relpath, keys=None if name in _PREPARED else keys)
    missing = [k for k in keys if k not in arrays]
    if missing:
        raise DataError(f"Data file {path} lacks the array(s) {missing}; re-create it with: "
                        f"fednorm data prepare {name} --data-dir {data_dir}")
    for x_key, y_key in pairs:
        x, y = arrays[x_key], arrays[y_key]
        _check_images(x, path, x_key)
        if y.ndim != 1 or y.shape[0] != x.shape[0]:
            raise DataError(
                f"In {path}, {y_key} must be a vector with one label per image of {x_key} "
                f"({x.shape[0]}), got shape {y.shape}. Re-download or re-copy the file."
            )
        if y.size and (y.min() < 0 or y.max() >= NUM_CLASSES):
            raise DataError(
                f"In {path}, {y_key} has labels outside 0..{NUM_CLASSES - 1} "
                f"(min {y.min()}, max {y.max()}). Re-download or re-copy the file."
            )
    total = sum(arrays[x_key].shape[0] for x_key, _ in pairs)
    images = torch.empty((total, 3, IMAGE_SIZE, IMAGE_SIZE), dtype=torch.uint8)
    labels = torch.empty(total, dtype=torch.int64)
    start = 0
    for x_key, y_key in pairs:
        n = arrays[x_key].shape[0]
        _fill_3x28(arrays[x_key], images[start : start + n])
        labels[start : start + n] = torch.from_numpy(arrays[y_key].astype(np.int64))
        start += n
    if not with_presplit:
        return images, labels
    presplit = int(arrays["x_train"].shape[0]) if FEDBN_PRESPLIT_KEY in arrays else None
    return images, labels, presplit
