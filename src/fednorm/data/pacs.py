"""PACS (Li et al. 2017): four visual domains of seven object classes, from the offline data folder.

The object benchmark available offline here, standing in for Office-Caltech-10 and DomainNet (which
have no offline copy). The file ``pacs/pacs64.npz`` holds every image of the four domains,
bilinear-resized from 227 x 227 to 64 x 64 (``x_<domain>`` (N, 64, 64, 3) uint8, ``y_<domain>``),
and has no official split: the federation builder splits each domain with the same seeded
stratified 80/20 split as the digits (:mod:`fednorm.data.protocol`).

The papers' object pipelines resize to 256 x 256 and augment with random flips and rotations
(FedBN's Office/DomainNet code); here images stay at 64 x 64 (AlexNet's adaptive pool accepts
them) and are stored unaugmented: ``training.augment: fedbn_objects`` applies that flip and rotation
to the training batches (:mod:`fednorm.methods.augment`), off by default.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .datafolder import load_npz
from .domain import DataError

PACS_FILE = "pacs/pacs64.npz"
PACS_DOMAINS = ("art_painting", "cartoon", "photo", "sketch")
PACS_CLASSES = ("dog", "elephant", "giraffe", "guitar", "horse", "house", "person")
PACS_SIZE = 64


def load_pacs_pool(domain: str, data_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """All images of one PACS domain: (N, 3, 64, 64) uint8 and (N,) int64 labels in 0..6."""
    if domain not in PACS_DOMAINS:
        raise ValueError(f"unknown PACS domain {domain!r}; choose one of {', '.join(PACS_DOMAINS)}")
    path = Path(data_dir) / PACS_FILE
    arrays = load_npz(Path(data_dir), PACS_FILE, keys=[f"x_{domain}", f"y_{domain}"])
    x, y = arrays[f"x_{domain}"], arrays[f"y_{domain}"]
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[-1] != 3:
        raise DataError(f"In {path}, x_{domain} must be uint8 (N, H, W, 3) images, got {x.dtype} {x.shape}. "
                        "Re-download or re-copy the file.")
    if y.ndim != 1 or y.shape[0] != x.shape[0] or (y.size and (y.min() < 0 or y.max() >= len(PACS_CLASSES))):
        raise DataError(f"In {path}, y_{domain} must hold one label in 0..{len(PACS_CLASSES) - 1} per image. "
                        "Re-download or re-copy the file.")
    images = torch.from_numpy(np.ascontiguousarray(x)).permute(0, 3, 1, 2).contiguous()
    return images, torch.from_numpy(y.astype(np.int64))
