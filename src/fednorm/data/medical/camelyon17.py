"""Camelyon17 patches (Bandi et al. 2018) as five hospital domains: HarmoFL's and UniFed's setting.

Source: the WILDS ``camelyon17`` v1.0 bundle (Koh et al. 2021), the download HarmoFL's README
points at: one ``tar.gz`` (10,658,709,504 bytes as WILDS lists it; no checksum is published, so a file
much shorter is refused) holding ``metadata.csv`` and 455,954 RGB PNG patches of 96 x 96 at
``patches/patient_<PPP>_node_<N>/patch_patient_<PPP>_node_<N>_x_<X>_y_<Y>.png``. ``metadata.csv``
columns: (index), ``patient``, ``node``, ``x_coord``, ``y_coord``, ``tumor`` (label: 1 if the
central 32 x 32 region contains tumour), ``slide``, ``center`` (hospital 0..4), ``split``.

Hospitals: ``hospital1`` .. ``hospital5`` = WILDS ``center`` 0 .. 4. HarmoFL's code names its
sites '1'..'5' and reads them from a ``data.pkl`` that is not public; that '1'..'5' is WILDS' 0..4
in order is our reading (the paper never maps its clients A-E to hospitals). UniFed trains on its
"hospital1-3" and tests on its "hospital4-5", "following the setting of source/target domains in literature
[WILDS]": the WILDS paper numbers its hospitals from 1 and labels its OOD validation and test hospitals 4 and 5
(its code: "we used a 1-indexed scheme and just labeled the test hospital as 5"), which are WILDS ``center`` 1
(validation) and 2 (test). So UniFed's external clients are our ``hospital2`` and ``hospital3`` and its internal
ones ``hospital1``, ``hospital4``, ``hospital5`` (:data:`UNIFED_INTERNAL`, :data:`UNIFED_EXTERNAL`). The other
reading, UniFed's names as WILDS centers 3-4 plus one, holds out two of WILDS' training hospitals.

Data folder format (written by :func:`prepare_camelyon17`), one file per hospital,
``camelyon17/hospital<k>.npz``: ``x`` (N, 96, 96, 3) uint8, ``y`` (N,) uint8 (tumour),
``slide``, ``patient``, ``node``, ``x_coord``, ``y_coord`` (N,) int32 and ``wilds_split`` (N,)
int8, in ``metadata.csv`` order.

Splits (:func:`load_camelyon17`): HarmoFL's per-hospital 64/16/20 train/val/test. The official
train/test lists (``data.pkl``) are not public, so a seeded random permutation of the hospital's
patches is cut with the official code's rounding (:func:`harmofl_bounds`). The paper splits
patches, so patches of one slide can land in train and test; ``split_by="slide"`` keeps slides
whole instead (an option, not the paper). Images stay in [0, 255] uint8; HarmoFL feeds
``ToTensor()`` values in [0, 1] and uses no augmentation.
"""

from __future__ import annotations

import csv
import tarfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..datafolder import load_npz
from ..domain import DataError, Domain, Split
from ._common import (RawFile, check_choice, empty_like_split, fetch, group_split_indices, nhwc_to_nchw,
                      read_image, split_indices, write_dataset_file)

CAMELYON17_HOSPITALS = ("hospital1", "hospital2", "hospital3", "hospital4", "hospital5")
# WILDS ``center`` of each hospital (0-indexed in WILDS' metadata.csv).
CAMELYON17_CENTER = {name: i for i, name in enumerate(CAMELYON17_HOSPITALS)}
# UniFed's internal / external hospitals: WILDS' training centers 0, 3, 4 and its OOD validation and test centers
# 1, 2 (the WILDS paper's hospitals 4 and 5, UniFed's "hospital4-5"; see the module docstring)
UNIFED_INTERNAL = ("hospital1", "hospital4", "hospital5")
UNIFED_EXTERNAL = ("hospital2", "hospital3")
# UniFed's internal clients: train/val/test 0.7/0.1/0.2 as in its CIFAR-10-C benchmark ("keep other
# training settings the same as the benchmark experiment"); not restated for Camelyon17 [inferred].
UNIFED_INTERNAL_FRACTIONS = (0.7, 0.1, 0.2)
CAMELYON17_CLASSES = ("normal", "tumor")
CAMELYON17_SIZE = 96

CAMELYON17_ARCHIVE = RawFile(
    "https://worksheets.codalab.org/rest/bundles/0xe45e15f39fb54e9d9e919556af67aabe/contents/blob/",
    "camelyon17_v1.0.tar.gz",
)
# No sha256/md5 is published; WILDS lists a compressed size, 10,658,709,504 bytes (a multiple of 4096: perhaps a disk
# usage, and CodaLab builds a folder bundle's tar.gz on request, so its length need not repeat to the byte). A download
# of 99 % of it or less is refused as truncated; a longer one goes on, and a damaged one fails at extraction or at
# its metadata.csv / patch checks, each with its own error (an exact-size check was the alternative).
CAMELYON17_ARCHIVE_BYTES = 10_658_709_504
CAMELYON17_MIN_BYTES = int(0.99 * CAMELYON17_ARCHIVE_BYTES)
CAMELYON17_DIRNAME = "camelyon17_v1.0"
_COLUMNS = ("patient", "node", "x_coord", "y_coord", "tumor", "slide", "center")
_INT_ARRAYS = ("slide", "patient", "node", "x_coord", "y_coord")


def camelyon17_file(hospital: str) -> str:
    return f"camelyon17/{check_choice(hospital, CAMELYON17_HOSPITALS, 'Camelyon17 hospital')}.npz"


def patch_path(patient: str, node: str, x: str, y: str) -> str:
    """The patch PNG's path relative to the bundle root, as WILDS builds it."""
    return f"patches/patient_{patient}_node_{node}/patch_patient_{patient}_node_{node}_x_{x}_y_{y}.png"


def read_metadata(path: Path) -> list[dict[str, str]]:
    """Rows of WILDS' ``metadata.csv`` (strings; patient zero-padded to 3 digits as in the file)."""
    path = Path(path)
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            missing = [c for c in _COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                raise DataError(f"{path} lacks the column(s) {missing} of WILDS' camelyon17 metadata.csv "
                                f"(it has {reader.fieldnames}). Is this the WILDS v1.0 bundle?")
            rows = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"Cannot read {path} ({exc}). Get the WILDS camelyon17 v1.0 bundle again.") from exc
    for i, row in enumerate(rows):
        try:
            for c in _COLUMNS:
                int(row[c])
        except (TypeError, ValueError) as exc:
            raise DataError(f"{path}, data row {i + 1}: column {c!r} must be an integer, got {row.get(c)!r}. "
                            "The file is corrupt: get the bundle again.") from exc
        if row["patient"].isdigit():
            row["patient"] = row["patient"].zfill(3)
        if int(row["center"]) not in range(len(CAMELYON17_HOSPITALS)) or int(row["tumor"]) not in (0, 1):
            raise DataError(f"{path}, data row {i + 1}: center must be 0..4 and tumor 0 or 1, got "
                            f"{row['center']!r} and {row['tumor']!r}. The file is corrupt: get the bundle again.")
    return rows


def _find_root(raw_dir: Path) -> Path | None:
    # the bundle's files sit at the archive's top level; also accept one more folder level
    for root in (raw_dir / CAMELYON17_DIRNAME, raw_dir, raw_dir / CAMELYON17_DIRNAME / CAMELYON17_DIRNAME):
        if (root / "metadata.csv").is_file():
            return root
    return None


def _extract(archive: Path, dest: Path) -> None:
    try:
        with tarfile.open(archive, "r:*") as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(dest, filter="data")
            else:  # Python < 3.10.12 / 3.11.4 has no extraction filters: refuse what "data" would refuse
                unsafe = [m.name for m in tar.getmembers() if m.name.startswith(("/", "\\")) or ".." in
                          Path(m.name).parts or m.issym() or m.islnk() or m.isdev()]
                if unsafe:
                    raise DataError(f"{archive} has members that would be written outside {dest} or are links "
                                    f"({', '.join(unsafe[:3])}). It is not the WILDS bundle: delete it and "
                                    "download it again.")
                tar.extractall(dest)
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise DataError(f"Cannot extract {archive} ({type(exc).__name__}: {exc}). Delete it and "
                        "download the bundle again.") from exc


def prepare_camelyon17(data_dir: Path, *, raw_dir: Path | None = None, download: bool = True,
                       progress: bool = True, max_per_hospital: int | None = None,
                       seed: int = 0) -> list[Path]:
    """Write ``camelyon17/hospital1..5.npz`` from the WILDS camelyon17 v1.0 bundle.

    The bundle is looked for, extracted, in ``raw_dir/camelyon17_v1.0`` or ``raw_dir`` (default
    ``data_dir/raw/camelyon17``); else ``raw_dir/camelyon17_v1.0.tar.gz`` is extracted there
    (downloaded first when absent and allowed: 10.7 GB, plus as much again extracted). The full set
    is ~12.6 GB as uint8 arrays; ``max_per_hospital`` keeps a seeded random subset of each
    hospital (in metadata order) for smaller machines. Returns the written paths.
    """
    data_dir = Path(data_dir)
    raw_dir = Path(raw_dir) if raw_dir is not None else data_dir / "raw" / "camelyon17"
    root = _find_root(raw_dir)
    source = f"WILDS camelyon17 v1.0 ({CAMELYON17_ARCHIVE.url})"
    if root is None:
        manual = (f"Download the WILDS camelyon17 v1.0 bundle from {CAMELYON17_ARCHIVE.url} "
                  f"(10.7 GB) as {raw_dir / CAMELYON17_ARCHIVE.filename}, or extract it so that "
                  f"{raw_dir / CAMELYON17_DIRNAME / 'metadata.csv'} and its patches/ folder exist.")
        archive = fetch(CAMELYON17_ARCHIVE, raw_dir, download=download, progress=progress, manual=manual,
                        min_size=CAMELYON17_MIN_BYTES)
        _extract(archive, raw_dir / CAMELYON17_DIRNAME)
        root = _find_root(raw_dir)
        if root is None:
            raise DataError(f"{archive} did not contain metadata.csv. Is it the WILDS camelyon17 v1.0 bundle?")
    rows = read_metadata(root / "metadata.csv")
    rng = np.random.default_rng(seed)
    paths = []
    for hospital in CAMELYON17_HOSPITALS:
        center = CAMELYON17_CENTER[hospital]
        chosen = [r for r in rows if int(r["center"]) == center]
        if not chosen:
            raise DataError(f"{root / 'metadata.csv'} has no patch of center {center} ({hospital}). "
                            "Is the file complete?")
        if max_per_hospital is not None and len(chosen) > max_per_hospital:
            keep = np.sort(rng.choice(len(chosen), size=max_per_hospital, replace=False))
            chosen = [chosen[i] for i in keep]
        x = np.empty((len(chosen), CAMELYON17_SIZE, CAMELYON17_SIZE, 3), dtype=np.uint8)
        for i, r in enumerate(chosen):
            rel = patch_path(r["patient"], r["node"], r["x_coord"], r["y_coord"])
            path = root / rel
            if not path.is_file():
                raise DataError(f"The patch {path} listed in metadata.csv is missing. The bundle is "
                                f"incompletely extracted: extract {CAMELYON17_ARCHIVE.filename} again.")
            img = read_image(path, str(path))
            if img.shape != (CAMELYON17_SIZE, CAMELYON17_SIZE, 3):
                raise DataError(f"The patch {path} is {img.shape[1]} x {img.shape[0]}, expected 96 x 96 (WILDS' patches): it "
                                f"was replaced or resized. Extract {CAMELYON17_ARCHIVE.filename} again.")
            x[i] = img
        arrays = {"x": x, "y": np.array([int(r["tumor"]) for r in chosen], dtype=np.uint8)}
        for key in _INT_ARRAYS:
            arrays[key] = np.array([int(r[key]) for r in chosen], dtype=np.int32)
        arrays["wilds_split"] = np.array([int(r.get("split") or -1) for r in chosen], dtype=np.int8)
        subset = "" if max_per_hospital is None else f"; seeded subset of {len(chosen)} (seed {seed})"
        paths.append(write_dataset_file(data_dir, camelyon17_file(hospital), arrays,
                                        key=f"camelyon17_{hospital}", source=f"{source}, center {center}{subset}"))
    return paths


def load_camelyon17_pool(hospital: str, data_dir: Path) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """All patches of one hospital: (N, 3, 96, 96) uint8, (N,) int64 labels, (N,) slide ids."""
    relpath = camelyon17_file(hospital)
    arrays = load_npz(Path(data_dir), relpath, keys=["x", "y", "slide"])
    x, y, slide = arrays["x"], arrays["y"], arrays["slide"]
    path = Path(data_dir) / relpath
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[1:] != (CAMELYON17_SIZE, CAMELYON17_SIZE, 3):
        raise DataError(f"In {path}, x must be uint8 (N, 96, 96, 3), got {x.dtype} {x.shape}. Prepare it again.")
    if y.shape != (x.shape[0],) or slide.shape != (x.shape[0],) or (y.size and y.max() > 1):
        raise DataError(f"In {path}, y and slide must hold one value per patch (y 0 or 1). Prepare it again.")
    return nhwc_to_nchw(x), torch.from_numpy(y.astype(np.int64)), slide


def load_camelyon17(hospital: str, data_dir: Path, *, fractions: str | Sequence[float] = "harmofl",
                    seed: int = 0, split_by: str = "patch") -> Domain:
    """One hospital's train/val/test :class:`Split` s.

    ``fractions``: ``"harmofl"`` (64/16/20 with the official rounding) or (train, val, test).
    ``split_by``: ``"patch"`` (the papers) or ``"slide"`` (no slide in two splits).
    """
    check_choice(split_by, ("patch", "slide"), "split_by")
    x, y, slide = load_camelyon17_pool(hospital, data_dir)
    if split_by == "patch":
        parts = split_indices(len(y), fractions, seed)
    else:
        parts = group_split_indices(slide, fractions, seed)
    train, val, test = (Split(x[torch.from_numpy(p)], y[torch.from_numpy(p)]) for p in parts)
    return Domain(name=f"camelyon17/{hospital}", train=train, val=val, test=test, num_classes=2,
                  description=f"Camelyon17 (WILDS v1.0) {hospital}, split {fractions} by {split_by}, seed {seed}")


def load_unifed_camelyon17(data_dir: Path, *, seed: int = 0,
                           internal_fractions: Sequence[float] = UNIFED_INTERNAL_FRACTIONS) -> dict[str, Domain]:
    """UniFed's Camelyon17 protocol: the internal hospitals (WILDS' training centers) split ``internal_fractions``;
    the external ones (WILDS' OOD validation and test centers) hold every patch in ``test`` (empty train and val)."""
    out = {h: load_camelyon17(h, data_dir, fractions=internal_fractions, seed=seed) for h in UNIFED_INTERNAL}
    for h in UNIFED_EXTERNAL:
        x, y, _ = load_camelyon17_pool(h, data_dir)
        test = Split(x, y)
        out[h] = Domain(name=f"camelyon17/{h}", train=empty_like_split(test), val=empty_like_split(test),
                        test=test, num_classes=2, description=f"Camelyon17 {h}, UniFed external client (all test)")
    return out
