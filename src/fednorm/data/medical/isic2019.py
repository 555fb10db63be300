"""Fed-ISIC2019 (FLamby; ISIC 2019 challenge + HAM10000) as six center domains: FedWon App. B.1.

FLamby (Ogier du Terrail et al. 2022) splits the ISIC 2019 training images (those whose data
center is known: 23,247) into 6 centers with a fixed train/test split, shipped as the CSV
``flamby/datasets/fed_isic2019/dataset_creation_scripts/train_test_split`` (columns ``image``,
the one-hot classes ``MEL .. UNK``, ``target`` 0..7, ``center`` 0..5, ``fold`` train/test,
``fold2`` = ``<fold>_<center>``). Centers, with FLamby's/FedWon's train/test counts:
0 ``bcn`` 9930/2483, 1 ``vidir_molemax`` 3163/791, 2 ``vidir_modern`` 2691/672,
3 ``rosendahl`` 1807/452, 4 ``msk`` 655/164, 5 ``vienna_dias`` 351/88. The split file has no
published checksum; its per-center counts are checked against these numbers instead.

Images: FLamby's ``ISIC_2019_Training_Input_preprocessed/<image>.jpg`` (its ``resize_images.py``
defaults: shorter side resized to 224 px, bilinear, aspect kept; Shades-of-Gray colour constancy
with power 6; saved as JPEG) are used as they are when present. Otherwise the raw
``ISIC_2019_Training_Input/`` folder or ``ISIC_2019_Training_Input.zip`` (public ISIC archive, 9.1 GB,
read in place) is preprocessed the same way here, with one difference: FLamby casts the colour-
corrected float image to uint8 without clipping (values above 255 wrap around); here they are
clipped to 255. The JPEG re-encoding (PIL's default quality) is kept so the pixels match FLamby's.

Fixed size: the in-memory path needs one size, so each preprocessed image is centre-cropped to
``size`` x ``size`` (default 224, the full short side; an image whose short side FLamby's ``int()``
resize left at 223 is first rescaled 0.4 % to 224, a larger shortfall is refused). FLamby trains on
``RandomCrop(200)`` after scale/rotate/flip/affine/colour/cut-out augmentations and tests on
``CenterCrop(200)``; training takes its 200 x 200 crops from the stored 224 x 224 (FedWon: "FLamby data
augmentations" and a weighted focal loss): ``training.augment: flamby_isic`` with ``data.center_crop: 200``,
as the ``fedwon_isic2019`` preset sets. FLamby has no validation split; :func:`load_fed_isic2019` can carve
one from train (``val_fraction``).

Data folder format, one file per center, ``fed_isic2019/<center>.npz``: ``x_train``/``x_test``
(N, 224, 224, 3) uint8, ``y_train``/``y_test`` (N,) uint8 in 0..7 (:data:`ISIC_CLASSES`),
``names_train``/``names_test`` (image ids), in the split file's row order.
"""

from __future__ import annotations

import csv
import io
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..datafolder import load_npz
from ..domain import DataError, Domain, Split
from ._common import RawFile, fetch, nhwc_to_nchw, read_image, write_dataset_file

ISIC_CENTERS = ("bcn", "vidir_molemax", "vidir_modern", "rosendahl", "msk", "vienna_dias")  # FLamby center 0..5
ISIC_CLASSES = ("MEL", "NV", "BCC", "AK", "BKL", "DF", "VASC", "SCC")  # target 0..7
FLAMBY_COUNTS = {0: (9930, 2483), 1: (3163, 791), 2: (2691, 672), 3: (1807, 452), 4: (655, 164), 5: (351, 88)}
ISIC_SIZE = 224
FLAMBY_COMMIT = "ed9c943f19236ec4dedb4a3bee30d9316d08e395"
# No digest is published for either file: url only (the split file's counts are checked instead).
FLAMBY_SPLIT = RawFile(f"https://raw.githubusercontent.com/owkin/FLamby/{FLAMBY_COMMIT}/flamby/datasets/"
                       "fed_isic2019/dataset_creation_scripts/train_test_split", "train_test_split")
ISIC_ZIP = RawFile("https://isic-challenge-data.s3.amazonaws.com/2019/ISIC_2019_Training_Input.zip",
                   "ISIC_2019_Training_Input.zip")
PREPROCESSED_DIR = "ISIC_2019_Training_Input_preprocessed"
RAW_DIR = "ISIC_2019_Training_Input"


def center_name(center: str | int) -> str:
    if isinstance(center, int) and not isinstance(center, bool):
        if center not in range(len(ISIC_CENTERS)):
            raise ValueError(f"Fed-ISIC2019 center index must be 0..5, got {center}")
        return ISIC_CENTERS[center]
    if center not in ISIC_CENTERS:
        raise ValueError(f"unknown Fed-ISIC2019 center {center!r}; choose one of {', '.join(ISIC_CENTERS)} (or 0..5)")
    return center


def isic_file(center: str | int) -> str:
    return f"fed_isic2019/{center_name(center)}.npz"


def read_split_csv(path: Path, *, check_counts: bool = True) -> list[dict]:
    """FLamby's ``train_test_split`` rows as dicts (image, target, center, fold), validated."""
    path = Path(path)
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            missing = [c for c in ("image", "target", "center", "fold", "fold2") if c not in (reader.fieldnames or [])]
            if missing:
                raise DataError(f"{path} lacks the column(s) {missing} of FLamby's train_test_split. Get it again "
                                f"from {FLAMBY_SPLIT.url}.")
            raw = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"Cannot read {path} ({exc}). Get it again from {FLAMBY_SPLIT.url}.") from exc
    rows = []
    for i, r in enumerate(raw):
        try:
            target, center = int(float(r["target"])), int(float(r["center"]))
        except ValueError as exc:
            raise DataError(f"{path}, data row {i + 1}: target and center must be integers, got {r.get('target')!r} "
                            f"and {r.get('center')!r}. Get it again from {FLAMBY_SPLIT.url}.") from exc
        if target not in range(len(ISIC_CLASSES)) or center not in range(len(ISIC_CENTERS)) \
                or r["fold"] not in ("train", "test") or r["fold2"] != f"{r['fold']}_{center}":
            raise DataError(f"{path}, data row {i + 1}: expected target 0..7, center 0..5, fold train/test and "
                            f"fold2 '<fold>_<center>', got {target}, {center}, {r['fold']!r}, {r['fold2']!r}. "
                            f"Get it again from {FLAMBY_SPLIT.url}.")
        rows.append({"image": r["image"].strip(), "target": target, "center": center, "fold": r["fold"]})
    if check_counts:
        counts = {c: (sum(1 for r in rows if r["center"] == c and r["fold"] == "train"),
                      sum(1 for r in rows if r["center"] == c and r["fold"] == "test")) for c in FLAMBY_COUNTS}
        if counts != FLAMBY_COUNTS:
            raise DataError(f"{path} does not hold FLamby's split: per-center (train, test) counts {counts}, "
                            f"expected {FLAMBY_COUNTS}. Get it again from {FLAMBY_SPLIT.url}.")
    return rows


def color_constancy(img: np.ndarray, power: int = 6) -> np.ndarray:
    """Shades-of-Gray colour constancy as FLamby's ``color_constancy`` (gamma None), clipped to
    uint8 (FLamby's cast wraps values above 255)."""
    f = img.astype(np.float32)
    rgb = np.power(np.mean(np.power(f, power), axis=(0, 1)), 1.0 / power)
    norm = np.sqrt(np.sum(rgb ** 2.0))
    if not norm > 0:
        return img.copy()  # an all-black image: FLamby would divide by zero
    scale = 1.0 / (rgb / norm * np.sqrt(3.0))
    return np.clip(f * scale, 0, 255).astype(np.uint8)


def flamby_preprocess(img: np.ndarray, short_side: int = ISIC_SIZE, jpeg: bool = True) -> np.ndarray:
    """FLamby's ``resize_and_maintain`` + colour constancy (+ its JPEG save, in memory)."""
    from PIL import Image

    h, w = img.shape[:2]
    ratio = float(short_side) / min(w, h)
    out = Image.fromarray(img).resize((int(w * ratio), int(h * ratio)), resample=Image.BILINEAR)
    out = Image.fromarray(color_constancy(np.asarray(out)))
    if jpeg:
        buf = io.BytesIO()
        out.save(buf, format="JPEG")
        return read_image(buf.getvalue(), "re-encoded image")
    return np.asarray(out, dtype=np.uint8)


def center_crop(img: np.ndarray, size: int, what: str) -> np.ndarray:
    """The central ``size`` x ``size`` square. FLamby's resize truncates (``int(w * ratio)``), so for
    about one aspect ratio in ten its short side is ``size - 1`` (e.g. 1024 x 767 -> 299 x 223); such
    an image is first scaled (bilinear, aspect kept) so its short side is ``size``: a 0.4 % rescale,
    where the alternative, FLamby's own ``CenterCrop(200)``, is ``size=200``. A larger shortfall is
    not FLamby's rounding and is refused."""
    h, w = img.shape[:2]
    if min(h, w) == size - 1:
        from PIL import Image

        ratio = size / min(h, w)
        img = np.asarray(Image.fromarray(img).resize((max(size, round(w * ratio)), max(size, round(h * ratio))),
                                                     resample=Image.BILINEAR), dtype=np.uint8)
        h, w = img.shape[:2]
    if min(h, w) < size:
        raise DataError(f"The image {what} is {w} x {h}, smaller than the {size} x {size} crop.")
    top, left = (h - size) // 2, (w - size) // 2
    return np.ascontiguousarray(img[top:top + size, left:left + size])


class _ImageSource:
    """Where the images come from: FLamby's preprocessed folder, the raw folder, or the raw zip."""

    def __init__(self, raw_dir: Path, download: bool, progress: bool):
        self.zip = None
        if (raw_dir / PREPROCESSED_DIR).is_dir():
            self.kind, self.root = "preprocessed", raw_dir / PREPROCESSED_DIR
        elif (raw_dir / RAW_DIR).is_dir():
            self.kind, self.root = "raw", raw_dir / RAW_DIR
        else:
            manual = (f"Put FLamby's preprocessed images in {raw_dir / PREPROCESSED_DIR}, or the ISIC 2019 training "
                      f"images ({ISIC_ZIP.url}, 9.1 GB, public) as {raw_dir / ISIC_ZIP.filename} or unzipped in "
                      f"{raw_dir / RAW_DIR}.")
            path = fetch(ISIC_ZIP, raw_dir, download=download, progress=progress, manual=manual)
            try:
                self.zip = zipfile.ZipFile(path)
            except (zipfile.BadZipFile, OSError) as exc:
                raise DataError(f"{path} is not a readable zip ({exc}). Delete it and download it again.") from exc
            self.members = {Path(n).name: n for n in self.zip.namelist() if n.lower().endswith(".jpg")}
            self.kind, self.root = "zip", path

    def describe(self) -> str:
        return {"preprocessed": f"FLamby-preprocessed images in {self.root}",
                "raw": f"raw ISIC 2019 images in {self.root}, preprocessed as FLamby",
                "zip": f"{ISIC_ZIP.url}, preprocessed as FLamby"}[self.kind]

    def load(self, image: str) -> np.ndarray:
        name = f"{image}.jpg"
        if self.kind == "zip":
            if name not in self.members:
                raise DataError(f"{self.root} lacks {name}, listed in FLamby's split: it is not the whole ISIC 2019 "
                                f"training zip. Delete it and download {ISIC_ZIP.url} again.")
            try:
                data = self.zip.read(self.members[name])
            except (zipfile.BadZipFile, OSError, EOFError) as exc:
                raise DataError(f"Cannot read {name} from {self.root} ({exc}). Download the zip again.") from exc
            return flamby_preprocess(read_image(data, f"{self.root}:{name}"))
        path = self.root / name
        if not path.is_file():
            fix = (f"re-run FLamby's resize_images.py over all of {RAW_DIR}" if self.kind == "preprocessed"
                   else f"unzip {ISIC_ZIP.filename} ({ISIC_ZIP.url}) again, whole")
            raise DataError(f"The image {path}, listed in FLamby's split, is missing: the folder is incomplete. "
                            f"Either {fix}, or move {self.root} aside to read {ISIC_ZIP.filename} instead.")
        img = read_image(path, str(path))
        return img if self.kind == "preprocessed" else flamby_preprocess(img)

    def close(self) -> None:
        if self.zip is not None:
            self.zip.close()


def prepare_fed_isic2019(data_dir: Path, *, raw_dir: Path | None = None, download: bool = True,
                         progress: bool = True, size: int = ISIC_SIZE, check_counts: bool = True,
                         centers: Sequence[str | int] = ISIC_CENTERS) -> list[Path]:
    """Write ``fed_isic2019/<center>.npz`` from FLamby's split file and the ISIC 2019 images in
    ``raw_dir`` (default ``data_dir/raw/fed_isic2019``), downloading what is missing if allowed."""
    data_dir = Path(data_dir)
    raw_dir = Path(raw_dir) if raw_dir is not None else data_dir / "raw" / "fed_isic2019"
    manual = f"Download FLamby's split file from {FLAMBY_SPLIT.url} as {raw_dir / FLAMBY_SPLIT.filename}."
    rows = read_split_csv(fetch(FLAMBY_SPLIT, raw_dir, download=download, progress=progress, manual=manual),
                          check_counts=check_counts)
    source = _ImageSource(raw_dir, download, progress)
    paths = []
    try:
        for center in centers:
            name = center_name(center)
            c = ISIC_CENTERS.index(name)
            arrays = {}
            for fold in ("train", "test"):
                chosen = [r for r in rows if r["center"] == c and r["fold"] == fold]
                x = np.empty((len(chosen), size, size, 3), dtype=np.uint8)
                for i, r in enumerate(chosen):
                    x[i] = center_crop(source.load(r["image"]), size, r["image"])
                arrays[f"x_{fold}"] = x
                arrays[f"y_{fold}"] = np.array([r["target"] for r in chosen], dtype=np.uint8)
                arrays[f"names_{fold}"] = np.array([r["image"] for r in chosen], dtype=str)
            paths.append(write_dataset_file(
                data_dir, isic_file(name), arrays, key=f"fed_isic2019_{name}",
                source=f"FLamby Fed-ISIC2019 center {c} ({FLAMBY_SPLIT.url}); {source.describe()}; "
                       f"centre crop {size}"))
    finally:
        source.close()
    return paths


def load_fed_isic2019(center: str | int, data_dir: Path, *, val_fraction: float = 0.0, seed: int = 0) -> Domain:
    """One center's FLamby train/test :class:`Split` s (8 classes); ``val_fraction`` of train
    (seeded) becomes validation (None when 0: FLamby and FedWon use none)."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    name = center_name(center)
    relpath = isic_file(name)
    path = Path(data_dir) / relpath
    arrays = load_npz(Path(data_dir), relpath, keys=["x_train", "y_train", "x_test", "y_test"])
    splits = {}
    for fold in ("train", "test"):
        x, y = arrays[f"x_{fold}"], arrays[f"y_{fold}"]
        if x.dtype != np.uint8 or x.ndim != 4 or x.shape[-1] != 3 or y.shape != (x.shape[0],) \
                or (y.size and y.max() >= len(ISIC_CLASSES)):
            raise DataError(f"In {path}, x_{fold} must be uint8 (N, H, W, 3) with N labels in 0..7; got "
                            f"{x.dtype} {x.shape}, labels {y.shape}. Prepare it again.")
        splits[fold] = Split(nhwc_to_nchw(x), torch.from_numpy(y.astype(np.int64)))
    train, val = splits["train"], None
    if val_fraction > 0:
        perm = torch.from_numpy(np.random.default_rng(seed).permutation(len(train)))
        n_val = int(len(train) * val_fraction)
        train, val = splits["train"].subset(perm[n_val:]), splits["train"].subset(perm[:n_val])
    return Domain(name=f"fed_isic2019/{name}", train=train, val=val, test=splits["test"], num_classes=len(ISIC_CLASSES),
                  description=f"Fed-ISIC2019 center {ISIC_CENTERS.index(name)} ({name}), FLamby split")
