"""Reading NIfTI volumes (``.nii`` / ``.nii.gz``, NIfTI-1 and NIfTI-2) with nibabel: the prostate MRI volumes.

nibabel is the field's reader of NIfTI and a core dependency: it handles both header versions,
either byte order, gzip, every datatype and the scaling ``scl_slope`` / ``scl_inter`` (a
hand-written reader would have to re-implement and test all of that). :func:`read_nifti` adds what
the datasets need on top: the voxels read into memory (no memory map left on the file), in native
byte order, trailing singleton dimensions dropped, and a :class:`DataError` naming the file, what is
wrong and what to do when it is missing, truncated, corrupt or not a NIfTI file. A ``.gz`` file is
first decompressed to its end once: nibabel stops reading at the last voxel and so never checks the
gzip checksum, and would return wrong voxels from a corrupt file without an error.

Index order: :func:`read_nifti` returns nibabel's order, the array indexed ``[i, j, k]`` along the
header's ``dim[1]``, ``dim[2]``, ``dim[3]`` (``i`` fastest in the file). HarmoFL's official code reads
the volumes with SimpleITK, whose ``GetArrayFromImage`` is the transpose ``[k, j, i]``;
:func:`.prostate.volume_slices` transposes to that order to extract the slices as the official code.
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import nibabel as nib
import numpy as np
from nibabel.filebasedimages import ImageFileError
from nibabel.spatialimages import HeaderDataError, HeaderTypeError

from ..domain import DataError

# What to do about a bad file (the prostate MRI volumes are the only NIfTI files fednorm reads).
_GET_AGAIN = ("Get the file again from the dataset's release (the prostate MRI volumes: the SAML release, unchanged), "
              "put it in place of this one and run `fednorm data prepare prostate` again.")
# Errors of nibabel and of the file / decompression layers when a file is truncated or corrupt.
_READ_ERRORS = (OSError, EOFError, zlib.error, ValueError, MemoryError)


def _is_uncompressed(path: Path) -> bool:
    return path.name.lower().endswith(".nii")


def _check_gzip(path: Path) -> None:
    """Decompress ``path`` to its end (discarding the bytes): gzip checks the CRC-32 and length there."""
    try:
        with gzip.open(path, "rb") as fh:
            while fh.read(1 << 20):
                pass
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{path} is not an intact gzip file ({type(exc).__name__}: {exc}). It is truncated or "
                        f"corrupt. {_GET_AGAIN}") from exc


def read_nifti(path: str | Path) -> np.ndarray:
    """The voxel array of a single-file NIfTI-1 or NIfTI-2 image (``.nii`` / ``.nii.gz``), indexed
    [i, j, k] (nibabel's order), in native byte order; trailing singleton dimensions beyond the
    third are dropped ((X, Y, Z, 1) -> (X, Y, Z)).

    dtype: the file's datatype when the header sets no scaling (``scl_slope`` 0, NaN or 1 with
    ``scl_inter`` 0), else float64 ``scl_slope * raw + scl_inter``. Raises :class:`DataError` naming
    the file if it is missing, truncated, corrupt or not a single-file NIfTI image."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"The NIfTI file {path} is missing. {_GET_AGAIN}")
    if path.name.lower().endswith(".gz"):
        _check_gzip(path)
    try:
        img = nib.load(path, mmap=False)
    except ImageFileError as exc:
        raise DataError(f"{path} is not a readable NIfTI-1 or NIfTI-2 file (nibabel: {exc}). It is truncated, "
                        f"corrupt or another format. {_GET_AGAIN}") from exc
    except (HeaderDataError, HeaderTypeError) as exc:
        raise DataError(f"{path} has an invalid NIfTI header (nibabel {type(exc).__name__}: {exc}). The file is "
                        f"corrupt. {_GET_AGAIN}") from exc
    except _READ_ERRORS as exc:
        raise DataError(f"Cannot read the NIfTI file {path} ({type(exc).__name__}: {exc}). The file is "
                        f"truncated or corrupt. {_GET_AGAIN}") from exc
    # Nifti2Image is a Nifti1Image; the two-file .hdr/.img pairs, MGH, MINC, CIFTI, ... are not.
    if not isinstance(img, nib.Nifti1Image):
        raise DataError(f"{path} is read by nibabel as {type(img).__name__}, not a single-file NIfTI-1 or NIfTI-2 "
                        f"image. Use the release's .nii / .nii.gz volumes. {_GET_AGAIN}")
    proxy = img.dataobj
    shape, dtype = tuple(proxy.shape), np.dtype(proxy.dtype)
    if not shape or any(d < 1 for d in shape):
        raise DataError(f"{path} announces the shape {shape} in its NIfTI header: no voxels (a dimension below 1). "
                        f"The file is corrupt. {_GET_AGAIN}")
    count = int(np.prod(shape, dtype=np.int64))
    if _is_uncompressed(path):  # announced size checked before nibabel allocates it
        needed = int(proxy.offset) + count * dtype.itemsize
        if path.stat().st_size < needed:
            raise DataError(f"{path} has {path.stat().st_size} bytes, its NIfTI header announces {needed} "
                            f"({shape}, {dtype}, voxels from byte {int(proxy.offset)}). It is truncated. {_GET_AGAIN}")
    slope, inter = float(getattr(proxy, "slope", 1.0)), float(getattr(proxy, "inter", 0.0))
    try:
        if slope != 1.0 or inter != 0.0:
            data = img.get_fdata(dtype=np.float64)  # scl_slope * raw + scl_inter
        else:
            data = np.asanyarray(proxy)
    except _READ_ERRORS as exc:
        raise DataError(f"Cannot read the voxels of {path} ({type(exc).__name__}: {exc}; its header announces "
                        f"{shape}, {dtype}). The file is truncated or corrupt. {_GET_AGAIN}") from exc
    data = np.asarray(data)
    while data.ndim > 3 and data.shape[-1] == 1:
        data = data[..., 0]
    return data.astype(data.dtype.newbyteorder("="), copy=False)
