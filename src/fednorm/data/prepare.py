"""Turn the official dataset files into the data folder's npz format (``../shared/data/README.md``).

Each ``prepare_*`` function gets the official files (downloading them with
:func:`fednorm.data.download.download` when a URL is known and allowed), converts them once to a
NumPy ``.npz`` of uint8 arrays, and records the file's sha256, size, array shapes and source in the
folder's ``manifest.json``, so the normal loaders (:func:`fednorm.data.datafolder.load_npz`) verify
it like any other file:

* SVHN (Netzer et al. 2011) ``train_32x32.mat`` / ``test_32x32.mat`` -> ``digits/svhn.npz``;
* SynthDigits (SynNumbers, Ganin & Lempitsky 2015) ``synth_{train,test}_32x32.mat`` ->
  ``digits/synthdigits.npz``; or the FedBN authors' preprocessed partitions (both digit sets);
* CIFAR-10 (Krizhevsky 2009) ``cifar-10-python.tar.gz`` -> ``cifar10/cifar10.npz``;
* CIFAR-10-C (Hendrycks & Dietterich 2019) ``CIFAR-10-C.tar`` -> ``cifar10c/<corruption>.npz``;
* Office-Caltech10 (FedBN's ``office_caltech_10_dataset.zip``: images + train/test lists, or an
  extracted image folder) -> ``office_caltech10/<domain>_<size>.npz``;
* DomainNet top-10 classes (the official per-domain zips + FedBN's ``domainnet_dataset.zip``
  lists; without them DomainNet's own ``<domain>_train.txt`` / ``_test.txt`` kept to the ten classes,
  without either a seeded 80/20 split) -> ``domainnet/<domain>_<size>.npz`` (see :mod:`fednorm.data.objects`).

The conversions follow med-air/FedBN ``utils/data_preprocess.py`` (``process_svhn``,
``process_synth``): ``X`` (32, 32, 3, N) -> (N, 32, 32, 3), SVHN label 10 -> 0. The official
train/test files are stored as ``x_train``/``x_test``; the digit loaders pool them and re-split
80/20 like FedBN. Command line: ``fednorm data prepare NAME`` (:func:`prepare_dataset`) for these and for the
medical datasets of :mod:`fednorm.data.medical` (camelyon17, prostate, nuclei, abide, fed_isic2019),
whose preparers are registered in :data:`PREPARERS` too.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import tarfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np

from .cifar10 import CIFAR10_CLASSES, CIFAR10_FILE
from .datafolder import MANIFEST_NAME
from .digits import FEDBN_PRESPLIT_KEY, REAL_DIGIT_DOMAINS
from .morpho import MORPHO_FILES
from .domain import DataError
from .objects import (DEFAULT_SIZE, DOMAINNET, OFFICE_CALTECH10, ArraysOnlyUnpickler, ObjectDataset, RawImages,
                      check_size, load_fedbn_pair)
from .download import download as _download
from .download import sha256_of, verify_file


@dataclass(frozen=True)
class RawFile:
    """One official file: where it comes from and the digests known for it (None = not known).

    ``md5`` may be a zero-argument function, so digests published by torchvision are read from the
    installed torchvision when needed rather than copied here.
    """

    url: str | None
    filename: str
    sha256: str | None = None
    md5: str | Callable[[], str | None] | None = None

    def expected_md5(self) -> str | None:
        return self.md5() if callable(self.md5) else self.md5


def _torchvision_md5(get: Callable) -> Callable[[], str | None]:
    """A lookup of an md5 that torchvision's dataset classes publish (None if unavailable)."""

    def lookup() -> str | None:
        try:
            import torchvision.datasets as tvd

            return str(get(tvd))
        except (ImportError, AttributeError, KeyError, IndexError, TypeError):
            return None

    return lookup


# No sha256 of the official files is published by their authors or known here: None, and the md5
# that torchvision lists (torchvision.datasets.SVHN.split_list) is verified instead.
SVHN_SOURCES: dict[str, RawFile] = {
    "train": RawFile(
        "http://ufldl.stanford.edu/housenumbers/train_32x32.mat", "train_32x32.mat", None,
        _torchvision_md5(lambda tv: tv.SVHN.split_list["train"][2]),
    ),
    "test": RawFile(
        "http://ufldl.stanford.edu/housenumbers/test_32x32.mat", "test_32x32.mat", None,
        _torchvision_md5(lambda tv: tv.SVHN.split_list["test"][2]),
    ),
}

# SynNumbers has no stable direct-download URL known here (the authors and FedBN share it through
# Google Drive: FedBN's data zip, file id 1P8g7uHyVxQJPcBKE8TAzfdKbimpRbj0I in med-air/FedBN
# utils/data_preprocess.py, which urllib cannot fetch without Drive's confirmation step), and no
# digest of these files is known: url, sha256 and md5 are None, and the files are placed by hand.
SYNTHDIGITS_SOURCES: dict[str, RawFile] = {
    "train": RawFile(None, "synth_train_32x32.mat"),
    "test": RawFile(None, "synth_test_32x32.mat"),
}

# The archive's md5 is the one torchvision.datasets.CIFAR10.tgz_md5 lists; no sha256 is known.
CIFAR10_SOURCES: dict[str, RawFile] = {
    "archive": RawFile(
        "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz", "cifar-10-python.tar.gz", None,
        _torchvision_md5(lambda tv: tv.CIFAR10.tgz_md5),
    ),
}

DIGIT_FILES = {name: REAL_DIGIT_DOMAINS[name] for name in ("svhn", "synthdigits")}
_SYNTH_HINT = (
    "No direct download URL is known for SynthDigits: get synth_train_32x32.mat and "
    "synth_test_32x32.mat (SynNumbers, Ganin & Lempitsky 2015; also inside the data zip of "
    "med-air/FedBN) and put them in {raw_dir}, or prepare from FedBN's preprocessed partitions "
    "(--fedbn-dir)."
)


# --- writing into the data folder ----------------------------------------------------------------


def _update_manifest(data_dir: Path, key: str, entry: dict) -> None:
    """Set ``manifest[key] = entry`` (dropping other entries for the same file), atomically and under a lock:
    two ``prepare`` processes on one folder (two datasets at once) each add their entry, none is lost."""
    import fcntl

    with open(data_dir / (MANIFEST_NAME + ".lock"), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # waits for the other writer: a read-modify-write of one file
        try:
            _update_manifest_locked(data_dir, key, entry)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _update_manifest_locked(data_dir: Path, key: str, entry: dict) -> None:
    path = data_dir / MANIFEST_NAME
    manifest: dict = {}
    if path.is_file():
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DataError(f"Cannot read the data manifest {path}: {exc}. Fix or delete it, then "
                            "prepare the data again.") from exc
        if not isinstance(manifest, dict):
            raise DataError(f"The data manifest {path} is not a JSON object of file entries. Fix or "
                            "delete it, then prepare the data again.")
    manifest = {k: v for k, v in manifest.items()
                if not (isinstance(v, dict) and v.get("file") == entry["file"])}
    manifest[key] = entry
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def write_dataset_file(data_dir: Path, relpath: str, arrays: dict[str, np.ndarray], *, key: str,
                       source: str) -> Path:
    """Write ``arrays`` to ``data_dir/relpath`` (compressed npz, atomic rename) and list the file
    in ``manifest.json`` under ``key`` with its sha256, size, array shapes and ``source``."""
    data_dir = Path(data_dir)
    path = data_dir / relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as fh:
        np.savez_compressed(fh, **arrays)
    os.replace(tmp, path)
    _update_manifest(data_dir, key, {
        "file": relpath,
        "sha256": sha256_of(path),
        "bytes": path.stat().st_size,
        "arrays": {k: list(v.shape) for k, v in arrays.items()},
        "source": source,
    })
    return path


def _fetch(source: RawFile, raw_dir: Path, *, download: bool, progress: bool, hint: str) -> Path:
    """The official file in ``raw_dir``, checked against its known digests; downloaded if absent
    (and allowed and a URL is known)."""
    path = raw_dir / source.filename
    md5 = source.expected_md5()
    if path.is_file():
        verify_file(path, sha256=source.sha256, md5=md5)
        return path
    if source.url is None or not download:
        raise DataError(f"The official file {path} is missing. " + hint.format(raw_dir=raw_dir))
    return _download(source.url, path, source.sha256, progress, md5=md5)


def _describe(source: RawFile, path: Path) -> str:
    md5 = source.expected_md5()
    checked = f"md5 {md5} verified" if md5 else "no official digest known"
    if source.sha256:
        checked = f"sha256 {source.sha256} verified"
    return f"{source.url or path.name} ({checked})"


# --- SVHN and SynthDigits (.mat) -----------------------------------------------------------------


def _digit_labels(y: np.ndarray, path: Path, convention: str) -> np.ndarray:
    """Labels 0..9 as uint8. ``svhn``: official 1..10 with 10 meaning digit 0 (SVHN's README).
    ``zero_or_svhn``: 0..9 as in SynNumbers (FedBN uses them unmapped), or SVHN's 1..10."""
    y = np.asarray(y).reshape(-1)
    if y.size == 0:
        return y.astype(np.uint8)
    if not np.issubdtype(y.dtype, np.number) or not np.all(np.equal(np.mod(y, 1), 0)):
        raise DataError(f"{path}: labels y must be integers, got {y.dtype}. Is this the official file?")
    y = y.astype(np.int64)
    lo, hi = int(y.min()), int(y.max())
    if convention == "svhn":
        if lo < 1 or hi > 10:
            raise DataError(f"{path}: SVHN labels must be 1..10 (10 = digit 0), found {lo}..{hi}. "
                            "Is this the official file?")
        return np.where(y == 10, 0, y).astype(np.uint8)
    if 0 <= lo and hi <= 9:
        return y.astype(np.uint8)
    if 1 <= lo and hi <= 10:  # SVHN's convention
        return np.where(y == 10, 0, y).astype(np.uint8)
    raise DataError(f"{path}: digit labels must be 0..9 or 1..10 (10 = digit 0), found {lo}..{hi}. "
                    "Is this the official file?")


def read_digits_mat(path: Path, convention: str) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 32, 32, 3) uint8 and labels 0..9 (uint8) from an SVHN-layout MATLAB v5 file:
    ``X`` (32, 32, 3, N) uint8, ``y`` (N, 1). ``convention``: see :func:`_digit_labels`."""
    from scipy.io import loadmat

    path = Path(path)
    try:
        mat = loadmat(path, variable_names=["X", "y"])
    except Exception as exc:  # noqa: BLE001 - scipy raises many types for a bad file
        raise DataError(f"Cannot read {path} as a MATLAB v5 file ({type(exc).__name__}: {exc}). "
                        "Delete it and get the official file again.") from exc
    if "X" not in mat or "y" not in mat:
        raise DataError(f"{path} lacks the variables X and y of the SVHN layout. Is this the "
                        "official file?")
    x, y = mat.pop("X"), mat.pop("y")
    x = _pixel_bytes(x, path)
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[:3] != (32, 32, 3):
        raise DataError(f"{path}: X must be uint8 (32, 32, 3, N), got {x.dtype} {x.shape}. "
                        "Is this the official file?")
    labels = _digit_labels(y, path, convention)
    if labels.shape[0] != x.shape[3]:
        raise DataError(f"{path}: y has {labels.shape[0]} labels for {x.shape[3]} images; the file is truncated or "
                        "not the official one. Delete it and get the official file again.")
    return np.ascontiguousarray(np.moveaxis(x, 3, 0)), labels


def _prepare_mat_digits(name: str, sources: dict[str, RawFile], convention: str, data_dir: Path,
                        raw_dir: Path | None, download: bool, progress: bool, hint: str) -> Path:
    data_dir = Path(data_dir)
    raw_dir = Path(raw_dir) if raw_dir is not None else data_dir / "raw" / name
    paths = {split: _fetch(src, raw_dir, download=download, progress=progress, hint=hint)
             for split, src in sources.items()}
    arrays: dict[str, np.ndarray] = {}
    for split in ("train", "test"):
        arrays[f"x_{split}"], arrays[f"y_{split}"] = read_digits_mat(paths[split], convention)
    source = "; ".join(_describe(sources[s], paths[s]) for s in ("train", "test"))
    return write_dataset_file(data_dir, DIGIT_FILES[name], arrays, key=name, source=source)


def prepare_svhn(data_dir: Path, *, raw_dir: Path | None = None, download: bool = True,
                 progress: bool = True) -> Path:
    """Write ``digits/svhn.npz`` from the official SVHN cropped-digit files (73,257 train and
    26,032 test images, label 10 -> 0), downloading them into ``raw_dir`` (default
    ``data_dir/raw/svhn``) if absent. Returns the npz path."""
    hint = "Download it from {url} into {{raw_dir}}, or allow downloading.".format(
        url=SVHN_SOURCES["train"].url.rsplit("/", 1)[0] + "/")
    return _prepare_mat_digits("svhn", SVHN_SOURCES, "svhn", data_dir, raw_dir, download, progress,
                               hint)


def prepare_synthdigits(data_dir: Path, *, raw_dir: Path | None = None, download: bool = True,
                        progress: bool = True) -> Path:
    """Write ``digits/synthdigits.npz`` from SynNumbers' ``synth_{train,test}_32x32.mat`` in
    ``raw_dir`` (default ``data_dir/raw/synthdigits``; no download URL is known). Returns the path."""
    return _prepare_mat_digits("synthdigits", SYNTHDIGITS_SOURCES, "zero_or_svhn", data_dir,
                               raw_dir, download, progress, _SYNTH_HINT)


# --- FedBN's preprocessed partitions ---------------------------------------------------------------


def _pixel_bytes(x: np.ndarray, path: Path) -> np.ndarray:
    """Images stored as floats or wider integers holding whole values 0..255 (some redistributions of FedBN's
    SynthDigits store float 0..255) as uint8; anything else unchanged, for the caller's uint8 check to name."""
    if x.dtype == np.uint8 or x.dtype.kind not in "fiu" or x.size == 0:
        return x
    if x.min() < 0 or x.max() > 255 or (x.dtype.kind == "f" and not np.array_equal(x, np.round(x))):
        raise DataError(f"{path}: images are {x.dtype} with values {x.min():g}..{x.max():g}, not whole pixel values "
                        "0..255 (a rescaled or normalized copy?). Get the official file again.")
    return x.astype(np.uint8)


def _read_pickle_pair(path: Path) -> tuple[np.ndarray, np.ndarray]:
    if not path.is_file():
        raise DataError(f"The FedBN partition file {path} is missing. Point --fedbn-dir at FedBN's "
                        "data/<Dataset> folder holding partitions/train_part0..9.pkl and test.pkl.")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"Cannot read {path} ({exc}). Get FedBN's files again.") from exc
    x, y = load_fedbn_pair(data, str(path), "(images, labels)")
    x, y = _pixel_bytes(np.asarray(x), path), np.asarray(y)
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[-1] != 3 or x.shape[1] != x.shape[2]:
        raise DataError(f"{path}: images must be uint8 (N, H, W, 3), got {x.dtype} {x.shape}. Is this FedBN's "
                        "file? Get FedBN's data/<Dataset> folder again.")
    y = y.reshape(-1)
    if y.shape[0] != x.shape[0] or (y.size and (y.min() < 0 or y.max() > 9)):
        raise DataError(f"{path}: labels must be one digit 0..9 per image, got {y.shape[0]} label(s) for "
                        f"{x.shape[0]} image(s)" + (f", values {int(y.min())}..{int(y.max())}" if y.size else "")
                        + ". Is this FedBN's file? Get FedBN's data/<Dataset> folder again.")
    return x, y.astype(np.uint8)


def read_fedbn_partitions(folder: Path, parts: int = 10) -> dict[str, np.ndarray]:
    """``x_train``/``y_train`` (``partitions/train_part0..9.pkl`` concatenated in order: FedBN's
    7,438-sample training pool) and ``x_test``/``y_test`` (``test.pkl``: FedBN's 20 % test split)
    from a med-air/FedBN ``data/<Dataset>`` folder (``utils/data_preprocess.py``, ``split``).

    Each file is a pickled tuple ``(images, labels)``; FedBN's SVHN and SynthDigits images are
    (N, 32, 32, 3) uint8 (its training code resizes to 28 x 28 on the fly; a copy storing them as
    whole-valued floats is read as the same bytes). Only arrays, tuples, lists,
    strings and numbers are unpickled (:func:`fednorm.data.objects.load_fedbn_pair`): a file naming any other
    global is refused before it runs.
    """
    folder = Path(folder)
    xs, ys = zip(*(_read_pickle_pair(folder / "partitions" / f"train_part{i}.pkl")
                   for i in range(parts)))
    x_test, y_test = _read_pickle_pair(folder / "test.pkl")
    sizes = {name: x.shape[1:] for name, x in zip([*(f"partitions/train_part{i}.pkl" for i in range(parts)),
                                                     "test.pkl"], (*xs, x_test))}
    if len(set(sizes.values())) != 1:
        shown = ", ".join(f"{name} {'x'.join(map(str, shape))}" for name, shape in sizes.items())
        raise DataError(f"The FedBN files in {folder} have different image sizes ({shown}): they come from "
                        "different datasets or versions. Get FedBN's data/<Dataset> folder again, whole.")
    return {"x_train": np.concatenate(xs), "y_train": np.concatenate(ys),
            "x_test": x_test, "y_test": y_test}


def prepare_fedbn_digits(name: str, data_dir: Path, fedbn_dir: Path) -> Path:
    """Write ``digits/<name>.npz`` (``svhn`` or ``synthdigits``) from FedBN's preprocessed files.

    The file holds FedBN's 7,438 training images in partition order and its test split (19,858
    SVHN, 97,791 SynthDigits), marked with ``FEDBN_PRESPLIT_KEY``: the protocol keeps that split
    (client 0 at ``percent`` 0.1 trains on ``train_part0``, every client tests on ``test.pkl``)
    instead of re-splitting the union.
    """
    if name not in DIGIT_FILES:
        raise ValueError(f"unknown digit set {name!r}; choose one of {', '.join(DIGIT_FILES)}")
    arrays = read_fedbn_partitions(Path(fedbn_dir))
    arrays[FEDBN_PRESPLIT_KEY] = np.array(1, dtype=np.uint8)
    source = f"med-air/FedBN preprocessed partitions (train_part0..9.pkl + test.pkl) from {fedbn_dir}"
    return write_dataset_file(Path(data_dir), DIGIT_FILES[name], arrays, key=name, source=source)


# --- CIFAR-10 --------------------------------------------------------------------------------------


def _cifar_batch(tar: tarfile.TarFile, name: str, archive: Path) -> tuple[np.ndarray, np.ndarray]:
    """(N, 32, 32, 3) uint8 images and uint8 labels of one python-version batch."""
    try:
        fh = tar.extractfile(f"cifar-10-batches-py/{name}")
    except KeyError:
        fh = None
    if fh is None:
        raise DataError(f"{archive} lacks cifar-10-batches-py/{name}. Delete it and download the "
                        "official archive again.")
    with fh:
        # Python 2 pickles (the official "python version"); latin1 keeps numpy arrays intact. Arrays, dicts, strings
        # and numbers only: anything else the file names is refused, not run
        try:
            batch = ArraysOnlyUnpickler(fh, encoding="latin1").load()
        except pickle.UnpicklingError as exc:
            raise DataError(f"{archive}: batch {name} cannot be read ({exc}). Delete the archive and download "
                            "cifar-10-python.tar.gz again.") from exc
    if not isinstance(batch, dict):
        raise DataError(f"{archive}: batch {name} is a pickled {type(batch).__name__}, not the dict of the official "
                        "CIFAR-10 python version. Delete the archive and download cifar-10-python.tar.gz again.")
    batch = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in batch.items()}
    if "data" not in batch or "labels" not in batch:
        raise DataError(f"{archive}: batch {name} lacks 'data' or 'labels' (it has {sorted(map(str, batch))[:6]}); "
                        "it is not the official CIFAR-10 python version. Delete the archive and download "
                        "cifar-10-python.tar.gz again.")
    data = np.asarray(batch["data"])
    labels = np.asarray(batch["labels"]).reshape(-1)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072 or labels.shape[0] != data.shape[0]:
        raise DataError(f"{archive}: batch {name} must hold uint8 data (N, 3072) and N labels, got "
                        f"{data.dtype} {data.shape} and {labels.shape[0]} labels.")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise DataError(f"{archive}: batch {name} has labels {int(labels.min())}..{int(labels.max())}, outside "
                        "CIFAR-10's 0..9. Delete the archive and download cifar-10-python.tar.gz again.")
    # Each row: 1024 red, 1024 green, 1024 blue values, each a 32 x 32 image in row-major order.
    images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(images), labels.astype(np.uint8)


def read_cifar10_archive(archive: Path) -> dict[str, np.ndarray]:
    """The official split from ``cifar-10-python.tar.gz`` as NHWC uint8 arrays (members are read,
    never extracted). Its batches are pickles: only read an archive whose md5 was verified or that
    you trust."""
    archive = Path(archive)
    try:
        with tarfile.open(archive, "r:gz") as tar:
            train = [_cifar_batch(tar, f"data_batch_{i}", archive) for i in range(1, 6)]
            x_test, y_test = _cifar_batch(tar, "test_batch", archive)
    except (tarfile.TarError, OSError, EOFError, pickle.UnpicklingError) as exc:
        raise DataError(f"Cannot read {archive} ({type(exc).__name__}: {exc}). Delete it and "
                        "download the official archive again.") from exc
    return {"x_train": np.concatenate([x for x, _ in train]),
            "y_train": np.concatenate([y for _, y in train]),
            "x_test": x_test, "y_test": y_test, "classes": np.array(CIFAR10_CLASSES)}


def prepare_cifar10(data_dir: Path, *, raw_dir: Path | None = None, download: bool = True,
                    progress: bool = True) -> Path:
    """Write ``cifar10/cifar10.npz`` from the official python-version archive, downloading it into
    ``raw_dir`` (default ``data_dir/raw/cifar10``) if absent. Returns the npz path."""
    data_dir = Path(data_dir)
    raw_dir = Path(raw_dir) if raw_dir is not None else data_dir / "raw" / "cifar10"
    src = CIFAR10_SOURCES["archive"]
    hint = f"Download it from {src.url} into {{raw_dir}}, or allow downloading."
    archive = _fetch(src, raw_dir, download=download, progress=progress, hint=hint)
    return write_dataset_file(data_dir, CIFAR10_FILE, read_cifar10_archive(archive), key="cifar10",
                              source=_describe(src, archive))



# --- CIFAR-10-C (the released corruptions) ---------------------------------------------------------

# Zenodo record 2535967 (v1, 9 January 2019): md5 as Zenodo lists it, sha256 as TensorFlow Datasets lists it,
# 2,918,471,680 bytes.
CIFAR10C_SOURCES: dict[str, RawFile] = {
    "archive": RawFile(
        "https://zenodo.org/records/2535967/files/CIFAR-10-C.tar?download=1", "CIFAR-10-C.tar",
        "c72763e101c723b7c507b96205f7e938912a5d587376173b825850cf3cb876a7", "56bf5dcef84df0e2308c6dcbcbbd8499",
    ),
}


def _read_npy_member(tar: tarfile.TarFile, member: str, archive: Path) -> np.ndarray:
    try:
        fh = tar.extractfile(member)
    except KeyError:
        fh = None
    if fh is None:
        raise DataError(f"{archive} lacks {member}. Delete it and download the release again (Zenodo record 2535967).")
    with fh:
        try:  # read whole (150 MB): numpy's read_array fails on tar members (they have no fileno)
            return np.load(io.BytesIO(fh.read()), allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise DataError(f"{archive}: {member} is not a readable .npy array ({exc}). Delete the archive and "
                            "download it again.") from exc


def read_cifar10c(raw: Path, corruptions: tuple[str, ...]) -> dict[str, dict[str, np.ndarray]]:
    """The data-folder arrays (:func:`fednorm.data.cifar10c.release_arrays`) of ``corruptions`` from the release:
    ``raw`` is ``CIFAR-10-C.tar`` (members read, never extracted) or its extracted ``CIFAR-10-C`` folder."""
    from .cifar10c import RELEASE_FOLDER, release_arrays

    raw = Path(raw)
    if raw.is_dir():
        def read(name: str) -> np.ndarray:
            path = raw / f"{name}.npy"
            if not path.is_file():
                raise DataError(f"{path} is missing: {raw} should be the release's extracted {RELEASE_FOLDER} folder.")
            try:
                return np.load(path, allow_pickle=False)
            except (ValueError, OSError, EOFError) as exc:
                raise DataError(f"{path} is not a readable .npy array ({exc}); extract the release again.") from exc

        labels = read("labels")
        return {c: release_arrays(read(c), labels, c, str(raw)) for c in corruptions}
    try:
        with tarfile.open(raw, "r:") as tar:
            labels = _read_npy_member(tar, f"{RELEASE_FOLDER}/labels.npy", raw)
            return {c: release_arrays(_read_npy_member(tar, f"{RELEASE_FOLDER}/{c}.npy", raw), labels, c, str(raw))
                    for c in corruptions}
    except (tarfile.TarError, OSError) as exc:
        raise DataError(f"Cannot read {raw} ({type(exc).__name__}: {exc}). Delete it and download the release "
                        "again (Zenodo record 2535967).") from exc


def prepare_cifar10c(data_dir: Path, *, raw_dir: Path | None = None, download: bool = True, progress: bool = True,
                     corruptions: tuple[str, ...] | None = None) -> list[Path]:
    """Write ``cifar10c/<corruption>.npz`` for ``corruptions`` (default: all 19 of the release) from
    ``CIFAR-10-C.tar`` in ``raw_dir`` (default ``data_dir/raw/cifar10c``; downloaded from Zenodo, 2.9 GB, if
    absent), or from the extracted release: ``raw_dir/CIFAR-10-C/`` or ``raw_dir`` itself holding ``labels.npy``
    and the ``<corruption>.npy`` files. Returns the files written."""
    from .cifar10c import CORRUPTIONS, RELEASE_FOLDER, cifar10c_file

    data_dir = Path(data_dir)
    raw_dir = Path(raw_dir) if raw_dir is not None else data_dir / "raw" / "cifar10c"
    wanted = tuple(corruptions) if corruptions else CORRUPTIONS
    unknown = [c for c in wanted if c not in CORRUPTIONS]
    if unknown:
        raise ValueError(f"unknown CIFAR-10-C corruption(s) {unknown}; choose from {', '.join(CORRUPTIONS)}")
    src = CIFAR10C_SOURCES["archive"]
    # already extracted (by the user): raw_dir holds the CIFAR-10-C folder, or is it; no archive, no digest to check
    folder = next((f for f in (raw_dir / RELEASE_FOLDER, raw_dir) if (f / "labels.npy").is_file()), None)
    if folder is not None:
        raw, source = folder, f"{folder} (the release's extracted folder; no digest checked)"
    else:
        hint = (f"Download it from {src.url} (Zenodo record 2535967) into {{raw_dir}}, or extract it there as "
                f"{{raw_dir}}/{RELEASE_FOLDER}/, or allow downloading.")
        raw = _fetch(src, raw_dir, download=download, progress=progress, hint=hint)
        source = _describe(src, raw)
    written = []
    for corruption in wanted:  # one corruption at a time: 150 MB each, the whole release is 2.9 GB
        arrays = read_cifar10c(raw, (corruption,))[corruption]
        written.append(write_dataset_file(data_dir, cifar10c_file(corruption), arrays, key=f"cifar10c/{corruption}",
                                          source=f"{corruption}.npy of {source}"))
    return written

# --- Office-Caltech10 and DomainNet (image lists) --------------------------------------------------

# The FedBN authors' archives, from the Hugging Face mirror their README links (the Google Drive
# originals need a confirmation step urllib cannot do). No digest is published: none is checked,
# and the sha256 of the archive used is written into the manifest's source instead.
FEDBN_MIRROR = "https://huggingface.co/datasets/Jemary/FedBN_Dataset/resolve/main/"
OFFICE_SOURCES: dict[str, RawFile] = {
    "archive": RawFile(FEDBN_MIRROR + "office_caltech_10_dataset.zip", "office_caltech_10_dataset.zip"),
}
# The official DomainNet zips (Peng et al. 2019), with the URLs FedBN's README gives: the cleaned
# ("groundtruth") versions of clipart and painting. FedBN's split lists are a separate archive.
_VISDA = "http://csr.bu.edu/ftp/visda/2019/multi-source/"
DOMAINNET_SOURCES: dict[str, RawFile] = {
    "lists": RawFile(FEDBN_MIRROR + "domainnet_dataset.zip", "domainnet_dataset.zip"),
    "clipart": RawFile(_VISDA + "groundtruth/clipart.zip", "clipart.zip"),
    "infograph": RawFile(_VISDA + "infograph.zip", "infograph.zip"),
    "painting": RawFile(_VISDA + "groundtruth/painting.zip", "painting.zip"),
    "quickdraw": RawFile(_VISDA + "quickdraw.zip", "quickdraw.zip"),
    "real": RawFile(_VISDA + "real.zip", "real.zip"),
    "sketch": RawFile(_VISDA + "sketch.zip", "sketch.zip"),
}
# Split of a domain whose FedBN lists are not available: stratified 80/20 with this seed.
OWN_SPLIT_SEED = 0


def _check_domains(ds: ObjectDataset, domains) -> list[str]:
    if domains is None:
        return list(ds.domains)
    domains = [domains] if isinstance(domains, str) else list(domains)
    bad = [d for d in domains if d not in ds.domains]
    if bad or not domains:
        raise DataError(f"unknown {ds.title} domain(s) {bad or domains}; choose from {', '.join(ds.domains)}")
    return domains


def _sha_note(path: Path) -> str:
    return f"{path.name} sha256 {sha256_of(path)}"


def _image_progress(progress: bool, total: int, label: str):
    if not progress:
        return None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    bar.start()
    bar.add_task(label, total=total)
    return bar


def _convert(raw: RawImages, keys: list, size: int, progress: bool, label: str) -> np.ndarray:
    out = np.empty((len(keys), size, size, 3), dtype=np.uint8)
    bar = _image_progress(progress, len(keys), label)
    try:
        for i, key in enumerate(keys):
            out[i] = raw.read_image(key, size)
            if bar is not None and (i % 50 == 49 or i == len(keys) - 1):
                bar.update(bar.task_ids[0], completed=i + 1)
    finally:
        if bar is not None:
            bar.stop()
    return out


def _listed_split(ds: ObjectDataset, raw: RawImages, names: tuple[str, str], fetch_hint: str, kind: str):
    """``({"train": (keys, labels), "test": ...}, where)`` from a pair of split files, every image present."""
    read = raw.read_list if kind == "FedBN list" else raw.read_txt_list
    split, where = {}, []
    for part, name in zip(("train", "test"), names):
        keys, labels, origin = read(name, ds.classes)
        missing = [k for k in keys if k not in raw.images]
        if missing:
            raise DataError(
                f"{len(missing)} image(s) of the {kind} {origin} are not in {raw.root}, e.g. "
                f"{'/'.join(missing[0])}. {fetch_hint}")
        split[part] = (keys, labels)
        where.append(origin)
    return split, ", ".join(where)


def _domain_split(ds: ObjectDataset, raw: RawImages, domain: str, fetch_hint: str):
    """``{"train": (keys, labels), "test": ...}`` of a domain and a description of the split used:
    FedBN's lists, else (DomainNet) the official ``<domain>_train.txt`` / ``_test.txt`` kept to the ten
    classes, else a seeded stratified 80/20 split of the image folder."""
    names = (f"{domain}_train.pkl", f"{domain}_test.pkl")
    if all(n in raw.lists for n in names):
        split, where = _listed_split(ds, raw, names, fetch_hint, "FedBN list")
        return split, f"FedBN's train/test lists ({where})"
    official = (f"{domain}_train.txt", f"{domain}_test.txt")
    if ds is DOMAINNET and all(n in raw.lists for n in official):
        split, where = _listed_split(ds, raw, official, fetch_hint, "DomainNet split file")
        warnings.warn(f"{ds.title} {domain}: FedBN's lists {names[0]} / {names[1]} were not found in {raw.root}; "
                      f"using DomainNet's official train/test split ({where}) kept to FedBN's ten classes",
                      stacklevel=3)
        return split, f"DomainNet's official train/test split ({where}), ten classes (FedBN's lists not found)"
    keys = raw.domain_keys(domain, ds.classes)
    if not keys:
        raise DataError(f"No {ds.title} image of domain {domain!r} (<{domain}>/<class>/<image>) is in {raw.root}. "
                        + fetch_hint)
    from .protocol import stratified_split
    import torch

    labels = np.array([ds.classes.index(k[1]) for k in keys], dtype=np.uint8)
    try:
        train_idx, test_idx = stratified_split(torch.from_numpy(labels.astype(np.int64)), 0.2, OWN_SPLIT_SEED)
    except ValueError as exc:
        raise DataError(f"Cannot split the {len(keys)} images of {ds.title} {domain!r} 80/20 by class ({exc}); "
                        "the domain needs more images per class.") from exc
    warnings.warn(f"{ds.title} {domain}: FedBN's lists {names[0]} / {names[1]} were not found in {raw.root}; "
                  f"using a stratified 80/20 split (seed {OWN_SPLIT_SEED}) of the image folder instead",
                  stacklevel=3)
    split = {"train": ([keys[i] for i in train_idx.tolist()], labels[train_idx.numpy()]),
             "test": ([keys[i] for i in test_idx.tolist()], labels[test_idx.numpy()])}
    return split, (f"image-folder layout <domain>/<class>/<image>, stratified 80/20 split with seed "
                   f"{OWN_SPLIT_SEED} (FedBN's lists not found)")


def _write_object_domain(ds: ObjectDataset, data_dir: Path, raw: RawImages, domain: str, size: int,
                         progress: bool, fetch_hint: str, archives: str) -> Path:
    split, how = _domain_split(ds, raw, domain, fetch_hint)
    arrays: dict[str, np.ndarray] = {}
    for part in ("train", "test"):
        keys, labels = split[part]
        arrays[f"x_{part}"] = _convert(raw, keys, size, progress, f"{ds.name} {domain} {part}")
        arrays[f"y_{part}"] = labels
    arrays["classes"] = np.array(ds.classes)
    source = (f"{ds.title} {domain}: {how}; images from {archives or raw.root}; converted as FedBN "
              f"(three-band images as RGB, others Grayscale(3)), PIL bilinear resize to {size}x{size}")
    return write_dataset_file(data_dir, ds.file(domain, size), arrays, key=f"{ds.name}_{domain}_{size}",
                              source=source)


def prepare_office_caltech10(data_dir: Path, *, raw_dir: Path | None = None, download: bool = True,
                             progress: bool = True, size: int = DEFAULT_SIZE, domains=None) -> list[Path]:
    """Write ``office_caltech10/<domain>_<size>.npz`` for each domain; returns their paths.

    Reads ``raw_dir`` (default ``data_dir/raw/office_caltech10``): FedBN's
    ``office_caltech_10_dataset.zip`` (images and ``{domain}_train.pkl`` / ``_test.pkl`` lists,
    read inside the zip) and/or an extracted copy or the official image folders
    ``<domain>/<class>/<image>``. The zip is downloaded (resumable) when the folder lacks a
    domain's images or lists and downloading is allowed. A domain without FedBN's lists is split
    80/20 by class with seed 0 (a warning says so and the manifest records it).
    """
    ds = OFFICE_CALTECH10
    size = check_size(size)
    wanted = _check_domains(ds, domains)
    data_dir = Path(data_dir)
    raw_dir = Path(raw_dir) if raw_dir is not None else data_dir / "raw" / ds.name
    src = OFFICE_SOURCES["archive"]
    hint = (f"Download {src.url} (FedBN's Office-Caltech10 archive) into {raw_dir}, or put the official "
            f"image folders <domain>/<class>/<image> there.")

    def complete(raw: RawImages) -> bool:
        return all(raw.domain_keys(d, ds.classes) and {f"{d}_train.pkl", f"{d}_test.pkl"} <= raw.lists.keys()
                   for d in wanted)

    archive = raw_dir / src.filename
    raw = RawImages(raw_dir)
    if archive.is_file() or (download and not complete(raw)):
        raw.close()
        archive = _fetch(src, raw_dir, download=download, progress=progress, hint=hint)
        raw = RawImages(raw_dir)
    with raw:
        note = _sha_note(archive) if archive.is_file() else ""
        return [_write_object_domain(ds, data_dir, raw, d, size, progress, hint, note) for d in wanted]


def _without_fedbn_lists(raw_dir: Path, wanted: list[str], found_lists, failure: DataError) -> None:
    """FedBN's ``domainnet_dataset.zip`` could not be had (``failure``): go on, with a warning, only if
    DomainNet's official ``<domain>_train.txt`` / ``_test.txt`` give every wanted domain its split; a
    seeded split of our own would silently change the benchmark's test sets, so otherwise stop."""
    lists = DOMAINNET_SOURCES["lists"]
    official = [f"{d}_{part}.txt" for d in wanted for part in ("train", "test")]
    missing = [name for name in official if name not in found_lists]
    if missing:
        raise DataError(
            f"FedBN's DomainNet split lists {lists.filename} could not be fetched ({failure}), and {raw_dir} "
            f"lacks DomainNet's official split file(s) {', '.join(missing)}. Put {lists.filename} ({lists.url}) "
            f"or the official <domain>_train.txt / _test.txt into {raw_dir}; to split the images 80/20 with "
            f"seed {OWN_SPLIT_SEED} instead (not FedBN's test sets), run again with --no-download.") from failure
    warnings.warn(f"FedBN's DomainNet lists {lists.filename} could not be fetched ({failure}); using DomainNet's "
                  f"official split files in {raw_dir} instead", stacklevel=3)


def prepare_domainnet(data_dir: Path, *, raw_dir: Path | None = None, download: bool = True,
                      progress: bool = True, size: int = DEFAULT_SIZE, domains=None) -> list[Path]:
    """Write ``domainnet/<domain>_<size>.npz`` (FedBN's ten classes) for each domain; returns the paths.

    Reads ``raw_dir`` (default ``data_dir/raw/domainnet``): the official per-domain zips
    (``clipart.zip`` ...; only the ten classes' images are read, inside the zip) or extracted
    folders, and FedBN's split lists (``domainnet_dataset.zip`` or its ``{domain}_train.pkl`` /
    ``_test.pkl``). Missing zips are downloaded (resumable) when allowed: the official zips are
    large (about 0.4 to 6 GB each), so ``domains`` can restrict the work. Without FedBN's lists,
    DomainNet's official ``<domain>_train.txt`` / ``_test.txt`` in ``raw_dir`` give the split (kept to
    the ten classes); without either, a seeded stratified 80/20 split (a warning says which).
    """
    ds = DOMAINNET
    size = check_size(size)
    wanted = _check_domains(ds, domains)
    data_dir = Path(data_dir)
    raw_dir = Path(raw_dir) if raw_dir is not None else data_dir / "raw" / ds.name
    lists = DOMAINNET_SOURCES["lists"]
    with RawImages(raw_dir) as raw:
        need_images = [d for d in wanted if not raw.domain_keys(d, ds.classes)]
        need_lists = any(f"{d}_train.pkl" not in raw.lists for d in wanted)
    fetched = []
    for d in need_images:
        src = DOMAINNET_SOURCES[d]
        hint = f"Download {src.url} (official DomainNet {d}) into {{raw_dir}}, or allow downloading."
        fetched.append(_fetch(src, raw_dir, download=download, progress=progress, hint=hint))
    if need_lists and (download or (raw_dir / lists.filename).is_file()):
        try:
            fetched.append(_fetch(lists, raw_dir, download=download, progress=progress, hint=""))
        except DataError as failure:
            with RawImages(raw_dir) as raw:
                _without_fedbn_lists(raw_dir, wanted, raw.lists, failure)
    hint = (f"Put the official DomainNet zips ({_VISDA}...) and FedBN's {lists.filename} ({lists.url}) "
            f"into {raw_dir}, or allow downloading.")
    with RawImages(raw_dir) as raw:
        note = "; ".join(_sha_note(p) for p in fetched)
        return [_write_object_domain(ds, data_dir, raw, d, size, progress, hint, note) for d in wanted]


# --- command line ----------------------------------------------------------------------------------


# --- Morpho-MNIST (FedBN App. G's unseen-domain clients) ------------------------------------------------------


def _morpho_preparer(kind: str) -> Callable[..., Path]:
    """``prepare_morpho_<kind>``: ``digits/morpho_<kind>.npz`` from the authors' dataset zip (see
    :mod:`fednorm.data.morpho`), downloaded into ``raw_dir`` (default ``data_dir/raw/morpho``) if absent."""
    import zipfile

    from .morpho import MORPHO_URLS, read_morpho_zip, zip_name

    def prepare(data_dir: Path, *, raw_dir: Path | None = None, download: bool = True, progress: bool = True) -> Path:
        data_dir = Path(data_dir)
        raw_dir = Path(raw_dir) if raw_dir is not None else data_dir / "raw" / "morpho"
        src = RawFile(MORPHO_URLS[kind], zip_name(kind))
        by_hand = (f"Download the '{kind}' dataset zip of github.com/dccastro/Morpho-MNIST ({src.url}) and save it "
                   f"as {{raw_dir}}/{src.filename}.")
        placed = (raw_dir / src.filename).is_file()
        archive = _fetch(src, raw_dir, download=download, progress=progress, hint=by_hand)
        if not placed and not zipfile.is_zipfile(archive):
            archive.unlink()  # Drive's quota or confirmation page, not the zip: nothing worth keeping
            raise DataError(f"{src.url} answered with a page, not the zip (Google Drive's quota or confirmation "
                            "step). " + by_hand.format(raw_dir=raw_dir))
        name = f"morpho_{kind}"
        return write_dataset_file(data_dir, MORPHO_FILES[name], read_morpho_zip(archive, kind), key=name,
                                  source=_describe(src, archive))

    prepare.__name__ = prepare.__qualname__ = f"prepare_morpho_{kind}"
    return prepare


def _medical_preparers() -> dict[str, Callable]:
    """The ``prepare_*`` of every dataset of :data:`fednorm.data.medical.MEDICAL_DATASETS`: same call
    ``(data_dir, *, raw_dir, download, progress)``; each raises a :class:`DataError` saying what to
    download by hand and where to put it when a source cannot be fetched (registration, Google Drive)."""
    from .medical import MEDICAL_DATASETS

    return {name: ds.prepare for name, ds in MEDICAL_DATASETS.items()}


PREPARERS = {"svhn": prepare_svhn, "synthdigits": prepare_synthdigits, "cifar10": prepare_cifar10,
             "cifar10c": prepare_cifar10c, "office_caltech10": prepare_office_caltech10, "domainnet": prepare_domainnet,
             "morpho_global": _morpho_preparer("global"), "morpho_local": _morpho_preparer("local"),
             **_medical_preparers()}
# Preparers that write one file per domain and take size= and domains=.
OBJECT_PREPARERS = ("office_caltech10", "domainnet")
# Medical preparers that write one file per site and can be limited to some sites (--domains), with
# the keyword each takes. Camelyon17 reads one bundle for all five hospitals, and ABIDE writes all
# its sites into one file (whose dropped-ROI layout depends on every site): neither is limited.
MEDICAL_SITE_OPTIONS = {"prostate": "sites", "nuclei": "clients", "fed_isic2019": "centers"}
# Other preparers that write one file per domain and take --domains, with their keyword: CIFAR-10-C's corruptions.
PART_OPTIONS = {**MEDICAL_SITE_OPTIONS, "cifar10c": "corruptions"}
MEDICAL_PREPARERS = tuple(name for name in PREPARERS if name not in ("svhn", "synthdigits", "cifar10", "cifar10c")
                          and name not in OBJECT_PREPARERS and not name.startswith("morpho_"))


def preparer_for(domain: str) -> str | None:
    """The ``fednorm data prepare`` name that writes the file a domain reads (a corrupted domain:
    its base's); None for a domain that comes with the offline copy or is rendered in memory."""
    from .federation import parse_domain

    spec = parse_domain(domain)
    while spec.base is not None:
        spec = spec.base
    if spec.file is None:
        return None
    # the file's folder names its dataset (cifar10c/fog.npz is benchmark cifar10 but prepared by cifar10c)
    for name in (spec.name, PurePosixPath(spec.file).parts[0], spec.benchmark):
        if name in PREPARERS:
            return name
    return None


def prepare_command(relpath: str, data_dir: Path | str) -> str | None:
    """The ``fednorm data prepare`` command that writes ``relpath`` of a data folder (what a missing or
    damaged file's error names), or None for a file that only comes with the offline copy."""
    path = PurePosixPath(str(relpath).replace("\\", "/"))
    top, stem = path.parts[0], path.stem
    name, options = None, ""
    for dataset, file in {**DIGIT_FILES, **MORPHO_FILES}.items():
        if path.as_posix() == file:
            name = dataset
    if top in OBJECT_PREPARERS and "_" in stem:
        domain, size = stem.rsplit("_", 1)
        name = top
        options = ("" if size == str(DEFAULT_SIZE) else f" --size {size}") + f" --domains {domain}"
    elif top in PREPARERS and top not in DIGIT_FILES:
        name = top
        if top in PART_OPTIONS:
            options = f" --domains {stem}"
    return None if name is None else f"fednorm data prepare {name}{options} --data-dir {data_dir}"


def check_data_files(domains, data_dir: Path) -> None:
    """DataError naming every file ``domains`` read that is missing from ``data_dir``, with the fewest
    ``fednorm data prepare`` commands that write them (one per dataset, its ``--domains`` joined); nothing when all
    are there. A run checks this before loading anything, so fifteen missing corruption files are one message,
    not fifteen attempts."""
    import re

    from .federation import domain_file

    data_dir = Path(data_dir)
    if not data_dir.is_dir():  # the loaders' own error says how to choose a data folder
        return
    missing = list(dict.fromkeys(f for f in (domain_file(d) for d in domains)
                                 if f is not None and not (data_dir / f).is_file()))
    if not missing:
        return
    commands: dict[tuple[str, str], list[str]] = {}
    offline = []
    for relpath in missing:
        command = prepare_command(relpath, data_dir)
        if command is None:
            offline.append(relpath)
            continue
        parts = re.fullmatch(r"(.*) --domains (\S+)( --data-dir .*)", command)
        key = (parts.group(1), parts.group(3)) if parts else (command, "")
        commands.setdefault(key, []).extend([parts.group(2)] if parts else [])
    lines = [f"  {head}{' --domains ' + ','.join(names) if names else ''}{tail}" for (head, tail), names in
             commands.items()]
    if offline:
        lines.append(f"  {', '.join(offline)}: these come with the offline copy (../shared/data/README.md); "
                     "pass --data-dir to a folder that holds them")
    raise DataError(f"the data folder {data_dir} lacks {len(missing)} file(s) this run reads: {', '.join(missing)}. "
                    "To get them:\n" + "\n".join(lines))


def prepare_dataset(dataset: str, data_dir: Path, *, raw_dir: Path | None = None, download: bool = True,
                    progress: bool = True, size: int | None = None, domains=None,
                    fedbn_dir: Path | None = None, seeded_order: bool = False) -> list[Path]:
    """``fednorm data prepare DATASET``: run the dataset's preparer and return the files written.

    ``size`` applies to the object benchmarks; ``domains`` to them, to the medical datasets of
    :data:`MEDICAL_SITE_OPTIONS` (their sites) and to cifar10c (its corruptions); ``fedbn_dir`` to svhn and synthdigits; ``seeded_order``
    (``harmofl_order=False``) to prostate. Raises
    ValueError for an unknown dataset or an option that does not apply, and the preparer's
    :class:`DataError` (what to download, where to put it) when files are missing.
    """
    if dataset not in PREPARERS:
        raise ValueError(f"unknown dataset {dataset!r}; choose one of {', '.join(PREPARERS)}")
    site_sets = (*OBJECT_PREPARERS, *PART_OPTIONS)
    if (size is not None and dataset not in OBJECT_PREPARERS) or (domains is not None and dataset not in site_sets):
        raise ValueError(f"{dataset}: --size and --domains apply to {' and '.join(OBJECT_PREPARERS)} only "
                         f"(--domains also to the sites of {', '.join(MEDICAL_SITE_OPTIONS)} and the corruptions "
                         "of cifar10c)")
    if isinstance(domains, str):
        domains = [d.strip() for d in domains.split(",") if d.strip()]
    if fedbn_dir is not None:
        if dataset not in DIGIT_FILES:
            raise ValueError("--fedbn-dir applies to svhn and synthdigits only")
        return [prepare_fedbn_digits(dataset, Path(data_dir), Path(fedbn_dir))]
    if seeded_order and dataset != "prostate":
        raise ValueError("--seeded-order applies to prostate only")
    extra: dict = {"harmofl_order": False} if seeded_order else {}
    if dataset in OBJECT_PREPARERS:
        extra["domains"] = domains or None
        if size is not None:
            extra["size"] = size
    elif dataset in PART_OPTIONS and domains:
        extra[PART_OPTIONS[dataset]] = tuple(domains)
    raw = Path(raw_dir) if raw_dir is not None else None
    written = PREPARERS[dataset](Path(data_dir), raw_dir=raw, download=download, progress=progress, **extra)
    return list(written) if isinstance(written, (list, tuple)) else [written]
