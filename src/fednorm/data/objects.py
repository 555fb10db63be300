"""Office-Caltech10 and DomainNet (top-10 classes): FedBN's object benchmarks, from the data folder.

FedBN (Li et al., ICLR 2021, Sec. 5.2) and FedWon (Table 1) use

* **Office-Caltech10** (Gong et al. 2012): domains amazon, caltech, dslr, webcam; the ten classes
  Office-31 and Caltech-256 share;
* **DomainNet** (Peng et al. 2019): domains clipart, infograph, painting, quickdraw, real, sketch;
  the "top-10 classes based on data amount".

Each domain comes with a fixed train and test list. The official code (med-air/FedBN,
``utils/data_utils.py``, ``OfficeDataset`` / ``DomainNetDataset``) reads them from pickles
``{domain}_train.pkl`` / ``{domain}_test.pkl`` holding ``(paths, text_labels)``; the label order
below is its ``label_dict``. :func:`fednorm.data.prepare.prepare_office_caltech10` and
``prepare_domainnet`` convert those lists plus the images into one npz per domain and size,

    ``<dataset>/<domain>_<size>.npz``: ``x_train`` (N, size, size, 3) uint8, ``y_train`` (N,) uint8,
    ``x_test``, ``y_test``, ``classes`` (the class names, label order),

listed in the folder's ``manifest.json`` like every other file. The images are converted once,
exactly as the official ``__getitem__`` + transforms do: an image with three bands is used as
RGB, any other (grey, palette, RGBA, CMYK) becomes ``Grayscale(num_output_channels=3)``; then
PIL's bilinear ``resize`` to ``size x size`` (torchvision's ``Resize([256, 256])`` on a PIL image
is this call). The training augmentation of the official code (``RandomHorizontalFlip()``,
``RandomRotation((-30, 30))``, training images only) is not stored: it is applied to each training
batch by ``training.augment: fedbn_objects`` (:mod:`fednorm.methods.augment`: per image a flip with
probability 0.5, then a rotation uniform in [-30, 30] degrees about the centre, nearest, corners
black), on the uint8 images before normalization; evaluation sees the stored images. The default
(``none``) trains without it. The official code's validation images are a ``Subset`` of the augmented training
set, so they are scored under a fresh random flip and rotation at every evaluation: ``training.augment_validation``
does the same (the ``fedbn_office`` / ``fedwon_office`` presets set it; off, validation sees the stored images).

Size: the papers use 256 x 256. The default here is 64 (as the offline PACS copy): one DomainNet
domain at 256 x 256 is over a gigabyte of uint8 in memory, and AlexNet's adaptive pool accepts
64 x 64. Prepare with ``--size 256`` and use the domain name ``office_caltech10/amazon@256`` for
the papers' resolution.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np
import torch

from .datafolder import is_junk_path, load_npz
from .domain import DataError, Split

DEFAULT_SIZE = 64
MIN_SIZE, MAX_SIZE = 8, 1024
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")


@dataclass(frozen=True)
class ObjectDataset:
    """One object benchmark: its domains, class order and FedBN's per-client amounts.

    ``train_fraction`` / ``val_fraction``: the official ``prepare_data`` of ``fed_office.py`` /
    ``fed_domainnet.py`` trains each client on the first ``int(train_fraction * m)`` samples of its
    train list and validates on the last ``int(val_fraction * m)``, ``m`` the smallest train list
    of the federation (Office: 0.5 / 0.4 -> the paper's 62 training samples per client;
    DomainNet: 0.05 / 0.05 -> 105).
    """

    name: str
    title: str
    domains: tuple[str, ...]
    classes: tuple[str, ...]
    train_fraction: float
    val_fraction: float
    list_folder: str  # where FedBN's lists live inside its data folder
    paper: str

    def file(self, domain: str, size: int = DEFAULT_SIZE) -> str:
        return f"{self.name}/{domain}_{size}.npz"

    def prepare_hint(self, domain: str, size: int, data_dir: Path | str) -> str:
        size_opt = "" if size == DEFAULT_SIZE else f" --size {size}"
        return (f"fednorm data prepare {self.name}{size_opt} --domains {domain} --data-dir {data_dir}")


OFFICE_CALTECH10 = ObjectDataset(
    name="office_caltech10",
    title="Office-Caltech10",
    domains=("amazon", "caltech", "dslr", "webcam"),
    classes=("back_pack", "bike", "calculator", "headphones", "keyboard", "laptop_computer", "monitor",
             "mouse", "mug", "projector"),
    train_fraction=0.5,
    val_fraction=0.4,
    list_folder="office_caltech_10",
    paper="FedBN Table 1, FedWon Tables 1-4, 12-14, 17-20",
)

DOMAINNET = ObjectDataset(
    name="domainnet",
    title="DomainNet (top-10 classes)",
    domains=("clipart", "infograph", "painting", "quickdraw", "real", "sketch"),
    classes=("bird", "feather", "headphones", "ice_cream", "teapot", "tiger", "whale", "windmill",
             "wine_glass", "zebra"),
    train_fraction=0.05,
    val_fraction=0.05,
    list_folder="DomainNet",
    paper="FedBN Table 1, FedWon Table 1",
)

OBJECT_DATASETS: dict[str, ObjectDataset] = {d.name: d for d in (OFFICE_CALTECH10, DOMAINNET)}


def check_size(size: int) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or not MIN_SIZE <= size <= MAX_SIZE:
        raise ValueError(f"image size must be an integer in {MIN_SIZE}..{MAX_SIZE}, got {size!r}")
    return size


def _to_nchw(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)).permute(0, 3, 1, 2).contiguous()


def load_object_domain(dataset: str, domain: str, data_dir: Path, size: int = DEFAULT_SIZE) -> tuple[Split, Split]:
    """The official train and test lists of one domain: two :class:`Split` (uint8 N x 3 x size x size).

    The file is verified against the folder's manifest first (see :func:`load_npz`); a missing file
    says which ``fednorm data prepare`` command writes it.
    """
    ds = OBJECT_DATASETS[dataset]
    if domain not in ds.domains:
        raise ValueError(f"unknown {ds.title} domain {domain!r}; choose one of {', '.join(ds.domains)}")
    rel = ds.file(domain, size)
    path = Path(data_dir) / rel
    if Path(data_dir).is_dir() and not path.is_file():
        raise DataError(f"Data file {path} is missing: {ds.title} has no offline copy. Download and convert "
                        f"it with: {ds.prepare_hint(domain, size, data_dir)}")
    arrays = load_npz(Path(data_dir), rel, keys=["x_train", "y_train", "x_test", "y_test"])
    redo = f"Prepare it again: {ds.prepare_hint(domain, size, data_dir)}"
    out = []
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.dtype != np.uint8 or x.ndim != 4 or x.shape[1:] != (size, size, 3):
            raise DataError(f"In {path}, x_{split} must be uint8 (N, {size}, {size}, 3) images, got {x.dtype} "
                            f"{x.shape}. {redo}")
        if y.ndim != 1 or y.shape[0] != x.shape[0] or (y.size and (y.min() < 0 or y.max() >= len(ds.classes))):
            raise DataError(f"In {path}, y_{split} must hold one label in 0..{len(ds.classes) - 1} per image of "
                            f"x_{split}. {redo}")
        out.append(Split(_to_nchw(x), torch.from_numpy(y.astype(np.int64))))
    return out[0], out[1]


# --- reading the official files (used by fednorm.data.prepare) --------------------------------------


def image_to_array(image, size: int) -> np.ndarray:
    """One PIL image -> (size, size, 3) uint8, as FedBN's ``__getitem__`` + ``Resize([size, size])``.

    FedBN: ``if len(image.split()) != 3: image = Grayscale(num_output_channels=3)(image)``, so only a
    three-band image keeps its colours (a palette or RGBA image becomes grey, as there).
    """
    from PIL import Image

    if len(image.getbands()) == 3:
        image = image.convert("RGB")
    else:
        image = image.convert("L").convert("RGB")
    image = image.resize((size, size), Image.BILINEAR)
    return np.asarray(image, dtype=np.uint8)


# what a FedBN pickle may name: numpy's array and scalar reconstructors (numpy 1 and 2 module names; protocol 5's
# _frombuffer) and the bytes codec of protocol-2 pickles. Tuples, lists, strings and numbers need no global.
_ARRAY_GLOBALS = frozenset({
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
})


class ArraysOnlyUnpickler(pickle.Unpickler):
    """An unpickler that builds numpy arrays, tuples, lists, strings and numbers and refuses every other global, so
    a tampered file cannot run code (pickle's own loader calls whatever the file names)."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ARRAY_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is not part of a numpy array")


def _unpickle_arrays(data: bytes):
    """``np.load(..., allow_pickle=True)`` of FedBN's files, with the pickled parts read by :class:`ArraysOnlyUnpickler`:
    an ``.npy`` file (np.save pickles an object array's contents after its header) or a plain pickle."""
    if not data.startswith(b"\x93NUMPY"):
        return ArraysOnlyUnpickler(io.BytesIO(data)).load()
    fp = io.BytesIO(data)
    version = np.lib.format.read_magic(fp)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(fp)
    else:
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(fp)
    if not dtype.hasobject:
        return np.load(io.BytesIO(data), allow_pickle=False)
    array = ArraysOnlyUnpickler(fp).load()  # np.save: pickle.dump(array, fp) after the header
    if not isinstance(array, np.ndarray) or array.shape != shape:
        raise pickle.UnpicklingError(f"its header promises an array of shape {shape}, the pickle holds "
                                     f"{type(array).__name__}")
    return array


def load_fedbn_pair(data: bytes, what: str, pair: str) -> tuple:
    """A pickled pair as FedBN reads its files (``np.load(..., allow_pickle=True)``, then unpacked): a pickled
    tuple or list, a pickled 2 x N array, or an ``.npy`` file under a ``.pkl`` name. Only numpy arrays, tuples,
    lists, strings and numbers are unpickled (:class:`ArraysOnlyUnpickler`): a file naming anything else is refused before
    it can run code, since FedBN's files come from a mirror without checksums."""
    try:
        obj = _unpickle_arrays(data)
    except Exception as exc:  # noqa: BLE001 - unpickling can raise almost anything
        raise DataError(f"Cannot unpickle {what} ({type(exc).__name__}: {exc}). Get FedBN's files again.") from exc
    if isinstance(obj, np.ndarray) and obj.dtype == object and obj.ndim == 0:
        obj = obj.item()  # a pickled tuple saved through np.save
    if not isinstance(obj, (tuple, list, np.ndarray)) or len(obj) != 2:
        raise DataError(f"{what[0].upper()}{what[1:]} must hold a pickled pair {pair} as FedBN writes it, got "
                        f"{type(obj).__name__}.")
    return obj[0], obj[1]


class RawImages:
    """Images and FedBN list files found under a folder: loose files and members of any ``.zip``.

    Images are indexed by the last three parts of their path, ``(domain, class, file)``, which is
    how a path in FedBN's lists (``office_caltech_10/amazon/back_pack/frame_0001.jpg``, relative to
    its ``data/`` folder) is matched to the same image in the official zip or an extracted copy,
    wherever either sits. Lists are indexed by file name (``amazon_train.pkl``).
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.images: dict[tuple[str, str, str], tuple[object, str]] = {}
        self.lists: dict[str, tuple[object, str]] = {}
        self._zips: list[zipfile.ZipFile] = []
        if not self.root.is_dir():
            return
        for path in sorted(self.root.rglob("*")):
            if not path.is_file() or path.name.endswith(".part"):
                continue
            if path.suffix.lower() == ".zip":
                self._add_zip(path)
            else:
                self._add(path.relative_to(self.root).parts, None, str(path))

    def _add(self, parts: tuple[str, ...], container, member: str) -> None:
        if not parts or is_junk_path(parts):
            return
        name = parts[-1]
        if name.endswith(("_train.pkl", "_test.pkl", "_train.txt", "_test.txt")):
            self.lists.setdefault(name, (container, member))
        elif name.lower().endswith(IMAGE_SUFFIXES) and len(parts) >= 3:
            self.images.setdefault(tuple(parts[-3:]), (container, member))

    def _add_zip(self, path: Path) -> None:
        try:
            zf = zipfile.ZipFile(path)
        except (zipfile.BadZipFile, OSError) as exc:
            raise DataError(f"{path} is not a readable zip archive ({exc}). Delete it and download it again.") from exc
        self._zips.append(zf)
        for member in zf.namelist():
            if not member.endswith("/"):
                self._add(PurePosixPath(member).parts, zf, member)

    def read_txt_list(self, name: str, classes: tuple[str, ...]) -> tuple[list[tuple[str, str, str]], np.ndarray, str]:
        """DomainNet's official split file ``name`` (``<domain>_train.txt``: lines ``clipart/bird/x.jpg 12``)
        kept to ``classes``: image keys, labels in ``classes`` order (by class folder; the file's own
        numbers index all 345 classes) and where it was read."""
        ref = self.lists[name]
        try:
            with self._open(ref) as fh:
                lines = fh.read().decode("utf-8").splitlines()
        except (OSError, UnicodeDecodeError, zipfile.BadZipFile) as exc:
            raise DataError(f"Cannot read DomainNet's split file {self.where(ref)} ({exc}). Get it again.") from exc
        keys = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            parts = PurePosixPath(line.split()[0]).parts
            if len(parts) < 3:
                raise DataError(f"Line {number} of {self.where(ref)} is not '<domain>/<class>/<image> <label>': "
                                f"{line!r}. Is it DomainNet's official split file?")
            if parts[-2] in classes:
                keys.append(tuple(parts[-3:]))
        index = {c: i for i, c in enumerate(classes)}
        return keys, np.array([index[k[1]] for k in keys], dtype=np.uint8), self.where(ref)

    def close(self) -> None:
        for zf in self._zips:
            zf.close()
        self._zips.clear()

    def __enter__(self) -> "RawImages":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _open(self, ref: tuple[object, str]):
        container, member = ref
        if container is None:
            return open(member, "rb")
        return io.BytesIO(container.read(member))

    def where(self, ref: tuple[object, str]) -> str:
        container, member = ref
        return member if container is None else f"{container.filename}:{member}"

    def domain_keys(self, domain: str, classes: tuple[str, ...]) -> list[tuple[str, str, str]]:
        """Every image of ``domain`` in the image-folder layout ``<domain>/<class>/<file>``, sorted."""
        return sorted(k for k in self.images if k[0] == domain and k[1] in classes)

    def read_image(self, key: tuple[str, str, str], size: int) -> np.ndarray:
        from PIL import Image, UnidentifiedImageError

        ref = self.images[key]
        try:
            with self._open(ref) as fh, Image.open(fh) as image:
                return image_to_array(image, size)
        except (OSError, UnidentifiedImageError, zipfile.BadZipFile, ValueError) as exc:
            raise DataError(f"Cannot read the image {self.where(ref)} ({type(exc).__name__}: {exc}). Delete "
                            "the damaged file or archive and get it again.") from exc

    def read_list(self, name: str, classes: tuple[str, ...]) -> tuple[list[tuple[str, str, str]], np.ndarray, str]:
        """FedBN list ``name``: image keys, labels (uint8, in ``classes`` order) and where it was read.

        The file is a pickled ``(paths, text_labels)``, read as FedBN reads it: ``np.load(...,
        allow_pickle=True)``, which also takes a pickled 2 x N array or an ``.npy`` file under the
        ``.pkl`` name; only arrays, tuples, lists and strings are unpickled (:func:`load_fedbn_pair`).
        """
        ref = self.lists[name]
        try:
            with self._open(ref) as fh:
                data = fh.read()
        except (OSError, zipfile.BadZipFile, EOFError) as exc:
            raise DataError(f"Cannot read the FedBN list {self.where(ref)} ({exc}). Get FedBN's data archive "
                            "again.") from exc
        obj = load_fedbn_pair(data, f"the FedBN list {self.where(ref)}", "(paths, labels)")
        paths, labels = [str(p) for p in np.asarray(obj[0]).reshape(-1)], [str(t) for t in np.asarray(obj[1]).reshape(-1)]
        if len(paths) != len(labels):
            raise DataError(f"The FedBN list {self.where(ref)} has {len(paths)} paths but {len(labels)} labels.")
        index = {c: i for i, c in enumerate(classes)}
        unknown = sorted(set(labels) - set(index))
        if unknown:
            raise DataError(f"The FedBN list {self.where(ref)} has labels outside the {len(classes)} classes "
                            f"({', '.join(unknown[:5])}). Is it a list of this dataset?")
        keys = [tuple(PurePosixPath(p.replace("\\", "/")).parts[-3:]) for p in paths]
        return keys, np.array([index[t] for t in labels], dtype=np.uint8), self.where(ref)
