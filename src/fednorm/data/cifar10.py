"""CIFAR-10 (Krizhevsky 2009) from the data folder: the label-skew benchmark of FedWon and FBN.

``cifar10/cifar10.npz`` holds the official split as written by
:func:`fednorm.data.prepare.prepare_cifar10`: ``x_train`` (50000, 32, 32, 3), ``y_train``,
``x_test`` (10000, 32, 32, 3), ``y_test`` (uint8), and ``classes``. Unlike the digit domains the
official train/test split is kept: FedWon and FBN split the 50,000 training images over clients
and test on the 10,000 test images.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .datafolder import load_npz
from .domain import DataError

CIFAR10_FILE = "cifar10/cifar10.npz"
CIFAR10_CLASSES = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
)


def load_cifar10(data_dir: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_test, y_test)``: uint8 (N, 3, 32, 32) images, int64 labels in 0..9.

    The file is verified against the folder's manifest first (see :func:`load_npz`).
    """
    path = Path(data_dir) / CIFAR10_FILE
    keys = ["x_train", "y_train", "x_test", "y_test"]
    arrays = load_npz(Path(data_dir), CIFAR10_FILE, keys=keys)
    out = []
    for x_key, y_key in (("x_train", "y_train"), ("x_test", "y_test")):
        x, y = arrays[x_key], arrays[y_key]
        if x.dtype != np.uint8 or x.ndim != 4 or x.shape[1:] != (32, 32, 3):
            raise DataError(f"In {path}, {x_key} must be uint8 (N, 32, 32, 3) images, got {x.dtype} "
                            f"{x.shape}. Prepare the file again (fednorm data prepare cifar10).")
        if y.ndim != 1 or y.shape[0] != x.shape[0] or (y.size and (y.min() < 0 or y.max() > 9)):
            raise DataError(f"In {path}, {y_key} must hold one label in 0..9 per image of {x_key}. "
                            "Prepare the file again (fednorm data prepare cifar10).")
        out.append(torch.from_numpy(np.ascontiguousarray(x)).permute(0, 3, 1, 2).contiguous())
        out.append(torch.from_numpy(y.astype(np.int64)))
    return out[0], out[1], out[2], out[3]
