"""CIFAR-10-C (Hendrycks & Dietterich, ICLR 2019) as released: UniFed's benchmark, one client per corruption.

The release (Zenodo record 2535967, ``CIFAR-10-C.tar``) holds, for each of 19 corruptions, the
10,000 CIFAR-10 test images corrupted at severities 1 to 5: ``CIFAR-10-C/<corruption>.npy``
(50000, 32, 32, 3) uint8, severity 1 in rows 0-9,999 up to severity 5 in rows 40,000-49,999, and one
``CIFAR-10-C/labels.npy`` (50000,) with the test labels repeated for each severity. UniFed uses 15
of them (the benchmark's; the other four, ``gaussian_blur``, ``saturate``, ``spatter`` and
``speckle_noise``, are the release's extra validation corruptions and also load here).

Domain ``cifar10c/<corruption>/<severity>`` reads ``cifar10c/<corruption>.npz`` of the data folder:
``x`` (5, 10000, 32, 32, 3), one block per severity, and ``y`` (10000,), written by
:func:`fednorm.data.prepare.prepare_cifar10c`. It is a pool of 10,000 images re-split by the
federation's protocol, like ``cifar10/test`` (UniFed splits each corruption client's images
randomly, 0.7 / 0.1 / 0.2 for internal clients; a held-out corruption is all test data).

These are the released files, with CIFAR-specific corruption constants. ``corrupt/<c>/<s>/cifar10/test``
(:mod:`fednorm.data.corrupt`) generates the same corruptions of the same images with ImageNet-C's
constants, which are much harsher on 32 x 32 images: use ``cifar10c/...`` to compare with UniFed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .datafolder import load_npz
from .domain import DataError

PREFIX = "cifar10c/"
# The 15 corruptions of the benchmark (Hendrycks & Dietterich Fig. 1), then the release's four extra ones.
BENCHMARK_CORRUPTIONS = (
    "gaussian_noise", "shot_noise", "impulse_noise",
    "defocus_blur", "glass_blur", "motion_blur", "zoom_blur",
    "snow", "frost", "fog", "brightness",
    "contrast", "elastic_transform", "pixelate", "jpeg_compression",
)
EXTRA_CORRUPTIONS = ("gaussian_blur", "saturate", "spatter", "speckle_noise")
CORRUPTIONS = BENCHMARK_CORRUPTIONS + EXTRA_CORRUPTIONS
SEVERITIES = (1, 2, 3, 4, 5)
IMAGES_PER_SEVERITY = 10000  # the CIFAR-10 test set
RELEASE_FOLDER = "CIFAR-10-C"  # the archive's top folder


def cifar10c_file(corruption: str) -> str:
    """The data-folder file of one corruption (all five severities)."""
    return f"{PREFIX}{corruption}.npz"


def parse_cifar10c_name(name: str) -> tuple[str, int]:
    """``cifar10c/<corruption>/<severity>`` -> ``(corruption, severity)``; ValueError naming the choices."""
    parts = name[len(PREFIX):].split("/") if name.startswith(PREFIX) else []
    if len(parts) != 2:
        raise ValueError(f"CIFAR-10-C domains are cifar10c/<corruption>/<severity>, e.g. cifar10c/fog/3; got {name!r}")
    corruption, severity = parts
    if corruption not in CORRUPTIONS:
        raise ValueError(f"unknown CIFAR-10-C corruption {corruption!r} in {name!r}; choose one of "
                         f"{', '.join(CORRUPTIONS)}")
    if severity not in {str(s) for s in SEVERITIES}:
        raise ValueError(f"the severity must be 1..5 in {name!r}, got {severity!r}")
    return corruption, int(severity)


def cifar10c_domains(severity: int, corruptions: tuple[str, ...] = BENCHMARK_CORRUPTIONS) -> list[str]:
    """Domain names of ``corruptions`` (default: UniFed's 15 clients) at ``severity``."""
    return [f"{PREFIX}{c}/{severity}" for c in corruptions]


def release_arrays(images: np.ndarray, labels: np.ndarray, corruption: str, source: str) -> dict[str, np.ndarray]:
    """The data-folder arrays of one corruption from the release's ``<corruption>.npy`` and ``labels.npy``:
    ``x`` (5, N, 32, 32, 3) by severity and ``y`` (N,). DataError (naming ``source``) if the shapes are not the
    release's or the labels differ between severities."""
    n = len(SEVERITIES)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1:] != (32, 32, 3) or images.shape[0] % n:
        raise DataError(f"{source}: {corruption}.npy must hold uint8 (5 N, 32, 32, 3) images (N per severity), got "
                        f"{images.dtype} {images.shape}. Download the release again (Zenodo record 2535967).")
    per = images.shape[0] // n
    labels = np.asarray(labels).reshape(-1)
    if labels.shape[0] != images.shape[0]:
        raise DataError(f"{source}: labels.npy holds {labels.shape[0]} labels for {images.shape[0]} images of "
                        f"{corruption}.npy. Download the release again (Zenodo record 2535967).")
    blocks = labels.reshape(n, per)
    if not (blocks == blocks[0]).all():
        raise DataError(f"{source}: labels.npy is not the same {per} labels repeated for the five severities, as "
                        "the release's is. Download the release again (Zenodo record 2535967).")
    if per and (blocks[0].min() < 0 or blocks[0].max() > 9):
        raise DataError(f"{source}: labels.npy has labels {int(blocks[0].min())}..{int(blocks[0].max())}, outside "
                        "CIFAR-10's 0..9. Download the release again (Zenodo record 2535967).")
    return {"x": images.reshape(n, per, 32, 32, 3), "y": blocks[0].astype(np.uint8)}


def load_cifar10c(corruption: str, severity: int, data_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` of one corruption at one severity: uint8 (N, 3, 32, 32) images and int64 labels, in the
    CIFAR-10 test order. The file is verified against the folder's manifest first (see :func:`load_npz`)."""
    relpath = cifar10c_file(corruption)
    arrays = load_npz(Path(data_dir), relpath, keys=["x", "y"])
    x, y = arrays["x"], arrays["y"]
    hint = f"Prepare it again (fednorm data prepare cifar10c --domains {corruption} --data-dir {data_dir})."
    if x.dtype != np.uint8 or x.ndim != 5 or x.shape[0] != len(SEVERITIES) or x.shape[2:] != (32, 32, 3):
        raise DataError(f"{Path(data_dir) / relpath}: x must be uint8 (5, N, 32, 32, 3), got {x.dtype} {x.shape}. {hint}")
    if y.ndim != 1 or y.shape[0] != x.shape[1]:
        raise DataError(f"{Path(data_dir) / relpath}: y must hold one label per image of a severity. {hint}")
    images = torch.from_numpy(np.ascontiguousarray(x[severity - 1])).permute(0, 3, 1, 2).contiguous()
    return images, torch.from_numpy(y.astype(np.int64))
