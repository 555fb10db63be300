"""A minimal NIfTI-1 reader (``.nii`` / ``.nii.gz``): enough for the prostate MRI volumes.

No third-party reader is needed (nibabel and SimpleITK are not dependencies): the NIfTI-1 header
is 348 bytes at fixed offsets (https://nifti.nimh.nih.gov/nifti-1), followed at ``vox_offset`` by
the voxels in Fortran order (first index fastest). :func:`read_nifti` returns the array indexed
``[i, j, k]`` like nibabel's ``img.dataobj``; SimpleITK's ``GetArrayFromImage`` (used by HarmoFL)
is the transpose ``[k, j, i]``. Like both, it applies ``scl_slope`` / ``scl_inter`` when set.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

import numpy as np

from ..domain import DataError

NIFTI1_HEADER_BYTES = 348
# NIfTI-1 datatype codes -> numpy kinds (nifti1.h, DT_*).
_DTYPES = {2: "u1", 4: "i2", 8: "i4", 16: "f4", 64: "f8", 256: "i1", 512: "u2", 768: "u4",
           1024: "i8", 1280: "u8"}


def _read_bytes(path: Path) -> bytes:
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as fh:
                return fh.read()
        return path.read_bytes()
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"Cannot read the NIfTI file {path} ({type(exc).__name__}: {exc}). It is corrupt "
                        "or truncated: get it again from the official source.") from exc


def read_nifti(path: str | Path) -> np.ndarray:
    """The voxel array of a single-file NIfTI-1 image, indexed [i, j, k] (3-D; a trailing
    singleton 4th dimension is dropped). Raises :class:`DataError` naming the file if it is not
    a readable NIfTI-1 file."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"The NIfTI file {path} is missing.")
    raw = _read_bytes(path)
    if len(raw) < NIFTI1_HEADER_BYTES:
        raise DataError(f"{path} is too short for a NIfTI-1 header ({len(raw)} bytes). It is truncated.")
    for endian in ("<", ">"):
        if struct.unpack(endian + "i", raw[:4])[0] == NIFTI1_HEADER_BYTES:
            break
    else:
        size = struct.unpack("<i", raw[:4])[0]
        kind = "a NIfTI-2 file" if size in (540, 0x1C020000) else "not a NIfTI-1 file"
        raise DataError(f"{path} is {kind} (header size field {size}); only NIfTI-1 is supported.")
    if raw[344:347] not in (b"n+1", b"ni1"):
        raise DataError(f"{path} lacks the NIfTI-1 magic 'n+1' (found {raw[344:348]!r}).")
    if raw[344:347] == b"ni1":
        raise DataError(f"{path} is a two-file NIfTI (.hdr/.img) header; use the single-file .nii(.gz).")
    dim = struct.unpack(endian + "8h", raw[40:56])
    datatype = struct.unpack(endian + "h", raw[70:72])[0]
    vox_offset = int(struct.unpack(endian + "f", raw[108:112])[0])
    slope, inter = struct.unpack(endian + "2f", raw[112:120])
    ndim = dim[0]
    if not 1 <= ndim <= 7 or any(d < 1 for d in dim[1:ndim + 1]):
        raise DataError(f"{path} has an invalid NIfTI dim field {dim}.")
    if datatype not in _DTYPES:
        raise DataError(f"{path} has the unsupported NIfTI datatype code {datatype}.")
    shape = dim[1:ndim + 1]
    dtype = np.dtype(endian + _DTYPES[datatype])
    count = int(np.prod(shape))
    start = max(vox_offset, NIFTI1_HEADER_BYTES)
    if len(raw) < start + count * dtype.itemsize:
        raise DataError(f"{path} holds {len(raw) - start} bytes of voxels, its header announces "
                        f"{count * dtype.itemsize} ({shape}, {dtype}). It is truncated.")
    data = np.frombuffer(raw, dtype=dtype, count=count, offset=start).reshape(shape, order="F")
    while data.ndim > 3 and data.shape[-1] == 1:
        data = data[..., 0]
    data = data.astype(dtype.newbyteorder("="), copy=True)
    if np.isfinite(slope) and slope != 0 and (slope != 1 or inter != 0):
        data = data * np.float64(slope) + np.float64(inter)
    return data
