"""Writers of tiny files in the medical datasets' real on-disk formats (PNG/JPEG, NIfTI-1, CSV)."""

from __future__ import annotations

import gzip
import json
import struct
from pathlib import Path

import numpy as np
from PIL import Image

_NIFTI_CODES = {np.dtype("uint8"): 2, np.dtype("int16"): 4, np.dtype("int32"): 8, np.dtype("float32"): 16,
                np.dtype("float64"): 64}


def write_image(path: Path, array: np.ndarray, **save) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.asarray(array, dtype=np.uint8)).save(path, **save)
    return path


def write_nifti(path: Path, array: np.ndarray, *, slope: float = 0.0, inter: float = 0.0) -> Path:
    """A single-file NIfTI-1 (``.nii`` or ``.nii.gz``) built from the spec's fixed header offsets,
    voxels in Fortran order after a 352-byte offset (header + 4-byte extension flag)."""
    array = np.asarray(array)
    header = bytearray(348)
    struct.pack_into("<i", header, 0, 348)
    dims = [array.ndim, *array.shape] + [1] * (7 - array.ndim)
    struct.pack_into("<8h", header, 40, *dims)
    struct.pack_into("<2h", header, 70, _NIFTI_CODES[array.dtype], array.dtype.itemsize * 8)
    struct.pack_into("<8f", header, 76, 1, 1, 1, 1, 1, 1, 1, 1)
    struct.pack_into("<3f", header, 108, 352.0, slope, inter)
    header[344:348] = b"n+1\x00"
    payload = bytes(header) + b"\x00" * 4 + array.astype(array.dtype.newbyteorder("<")).tobytes(order="F")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.name.endswith(".gz"):
        with gzip.open(path, "wb") as fh:
            fh.write(payload)
    else:
        path.write_bytes(payload)
    return path


def manifest(data_dir: Path) -> dict:
    return json.loads((data_dir / "manifest.json").read_text())


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
