"""Histology nuclei segmentation: HarmoFL's six clients (MoNuSAC2020 x 4 organs, MoNuSeg 2018, TNBC).

HarmoFL (Sec. 4) uses MoNuSAC2020 (Verma et al. 2021) "divided into 4 clients according to the
official multi-organ split" (its organs: breast, kidney, lung, prostate), the 2018 Multi-Organ
Nucleus Segmentation challenge (Kumar et al. 2019; the paper calls it "MoNuSAC2018", it is
MoNuSeg) and TNBC (Naylor et al. 2018): six clients, images resized to 256 x 256, each dataset's
original train/test split, 20 % of the training data for validation, client sizes left unequal.

What is not documented, and what this module does about it:

* The authors' preprocessed release (https://meiruijiang.github.io/MeiruiJiang/NucSeg/) and its
  folder layout are not documented anywhere we could read, and HarmoFL's public code has no nuclei
  pipeline. :func:`prepare_nuclei` therefore reads one documented layout, into which any of the
  sources can be put::

      <raw_dir>/<client>/train/images/<name>.{png,tif,tiff,jpg,jpeg,bmp}
      <raw_dir>/<client>/train/masks/<name>.{png,tif,...}   (or labels/; or <name>.xml)
      <raw_dir>/<client>/test/images/...  and  test/masks/...

  and MoNuSeg 2018's two official zips as they extract, both unzipped into
  ``<raw_dir>/monuseg2018/``::

      MoNuSeg 2018 Training Data/Tissue Images/<name>.tif
      MoNuSeg 2018 Training Data/Annotations/<name>.xml
      MoNuSegTestData/<name>.tif  beside  MoNuSegTestData/<name>.xml

  (the accepted folder names are :data:`_TRAIN_DIRS`, :data:`_TEST_DIRS`, :data:`_IMAGE_DIRS`
  and :data:`_MASK_DIRS`; a split folder without an image folder may hold its images beside their
  ``.xml`` annotations, as ``MoNuSegTestData/`` does). Every image needs its mask and every mask
  its image (a missing one is an error naming the file, not a silently dropped sample).

  A mask image is binarized (any non-zero value is nucleus). A ``<name>.xml`` mask is an
  official MoNuSeg / MoNuSAC annotation (``Annotation/Regions/Region/Vertices/Vertex X= Y=``);
  every region polygon is filled as nucleus (MoNuSAC's four cell classes are merged: the task is
  binary). MoNuSAC ships ``.svs`` slides and no organ tag per file: convert its images to TIFF/PNG
  and sort them into the four organ client folders by hand (the organ of each patient is listed
  on the challenge site).
* TNBC has no official train/test split. Its release (Zenodo record 1175282,
  ``TNBC_NucleiSegmentation.zip``: ``Slide_<nn>/*.png`` images, ``GT_<nn>/*.png`` masks) is read
  directly (:func:`read_tnbc_zip` / ``Slide_*``/``GT_*`` folders), and a seeded 20 % of its
  images becomes the test split (our choice; image level).
* A client folder without a test folder (``test/`` or ``MoNuSegTestData/``) likewise gets a
  seeded 20 % test split.

Resizing: images bilinear, masks nearest (after rasterizing at full resolution).

Data folder format, one file per client, ``nuclei/<client>.npz``: ``x_train``/``x_test``
(N, 256, 256, 3) uint8, ``y_train``/``y_test`` (N, 256, 256) uint8 masks (0/1), and
``names_train``/``names_test`` (the source file names). :func:`load_nuclei` carves the validation
split (20 % of train, seeded) at load time.
"""

from __future__ import annotations

import re
import zipfile
from collections.abc import Sequence
from pathlib import Path
from xml.etree import ElementTree

import numpy as np
import torch

from ..datafolder import is_junk_path, load_npz
from ..domain import DataError, Domain
from ._common import (RawFile, SegmentationSplit, check_choice, fetch, nhwc_to_nchw, read_image, resize_image,
                      resize_mask, write_dataset_file)

NUCLEI_CLIENTS = ("monusac2020_breast", "monusac2020_kidney", "monusac2020_lung", "monusac2020_prostate",
                  "monuseg2018", "tnbc")
NUCLEI_SIZE = 256
NUCLEI_VAL_FRACTION = 0.2
NUCLEI_TEST_FRACTION = 0.2  # only for sources without an official test split (TNBC)
NUCLEI_RELEASE_URL = "https://meiruijiang.github.io/MeiruiJiang/NucSeg/"
TNBC_ZIP = RawFile("https://zenodo.org/record/1175282/files/TNBC_NucleiSegmentation.zip",
                   "TNBC_NucleiSegmentation.zip")  # no digest known: url only
MONUSEG_URL = "https://monuseg.grand-challenge.org/Data/"
MONUSAC_URL = "https://monusac-2020.grand-challenge.org/Data/"
_IMAGE_EXTS = (".png", ".tif", ".tiff", ".jpg", ".jpeg", ".bmp")
# The folder names a client folder may use, first match wins: the documented layout's, then the
# official MoNuSeg 2018 zips' as they extract ("MoNuSeg 2018 Training Data/{Tissue Images,
# Annotations}/" and "MoNuSegTestData/", whose images lie beside their .xml annotations).
_MONUSEG_TRAIN, _MONUSEG_TEST = "MoNuSeg 2018 Training Data", "MoNuSegTestData"
_MONUSEG_IMAGES, _MONUSEG_ANNOTATIONS = "Tissue Images", "Annotations"
_TRAIN_DIRS = ("train", _MONUSEG_TRAIN)
_TEST_DIRS = ("test", _MONUSEG_TEST)
_IMAGE_DIRS = ("images", _MONUSEG_IMAGES)
_MASK_DIRS = ("masks", "labels", _MONUSEG_ANNOTATIONS)
_PREPARE_COMMAND = "fednorm data prepare nuclei"


def nuclei_file(client: str) -> str:
    return f"nuclei/{check_choice(client, NUCLEI_CLIENTS, 'nuclei client')}.npz"


def rasterize_xml(xml: bytes | Path, height: int, width: int, what: str) -> np.ndarray:
    """Binary (H, W) uint8 mask of every ``Region`` polygon of a MoNuSeg/MoNuSAC XML file."""
    from PIL import Image, ImageDraw

    try:
        root = ElementTree.fromstring(xml) if isinstance(xml, bytes) else ElementTree.parse(xml).getroot()
    except (ElementTree.ParseError, OSError) as exc:
        raise DataError(f"Cannot parse the annotation {what} ({exc}). The file is corrupt: get it again.") from exc
    canvas = Image.new("L", (width, height), 0)
    draw = ImageDraw.Draw(canvas)
    regions = 0
    for region in root.iter("Region"):
        points = []
        for v in region.iter("Vertex"):
            try:
                points.append((float(v.attrib["X"]), float(v.attrib["Y"])))
            except (KeyError, ValueError) as exc:
                raise DataError(f"{what}: a Vertex lacks numeric X/Y attributes.") from exc
        if len(points) >= 3:
            draw.polygon(points, fill=1, outline=1)
            regions += 1
    if regions == 0:
        raise DataError(f"{what} holds no Region polygon (Annotation/Regions/Region/Vertices/Vertex). Is it a "
                        "MoNuSeg/MoNuSAC annotation file?")
    return np.asarray(canvas, dtype=np.uint8)


def _sample(image, mask_src, what: str, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(image (size, size, 3), mask (size, size)) from an image file and a mask file or XML."""
    img = read_image(image, what)
    if isinstance(mask_src, Path) and mask_src.suffix.lower() == ".xml":
        mask = rasterize_xml(mask_src, img.shape[0], img.shape[1], str(mask_src))
    else:
        mask = read_image(mask_src, f"mask of {what}", mode="mask")
        mask = (np.asarray(mask) > 0).astype(np.uint8)
        if mask.shape != img.shape[:2]:
            raise DataError(f"The mask of {what} is {mask.shape[1]} x {mask.shape[0]}, the image "
                            f"{img.shape[1]} x {img.shape[0]}.")
    return resize_image(img, size), resize_mask(mask, size)


def _first_dir(root: Path, names: Sequence[str]) -> Path | None:
    """The first of ``root/<name>`` (``names`` in order) that is a folder, else None."""
    return next((root / n for n in names if (root / n).is_dir()), None)


def _files(folder: Path, exts: Sequence[str]) -> list[Path]:
    return sorted(p for p in folder.iterdir()
                  if p.is_file() and p.suffix.lower() in exts and not is_junk_path((p.name,)))


def _rerun(client_dir: Path) -> str:
    """The prepare command to run again once the files of ``client_dir`` are in place."""
    domains = f" --domains {client_dir.name}" if client_dir.name in NUCLEI_CLIENTS else ""
    return (f"then run `{_PREPARE_COMMAND}{domains}` again (with --raw-dir {client_dir.parent} unless that is "
            "DATA_DIR/raw/nuclei)")


def _layouts(client_dir: Path) -> str:
    """The accepted layouts of a client folder (from the folder-name constants) and what to do."""
    def names(dirs):
        return " or ".join(f"'{d}/'" for d in dirs)

    return (f"Accepted layouts of a client folder: a training folder ({names(_TRAIN_DIRS)}) and optionally a "
            f"test folder ({names(_TEST_DIRS)}; without one a seeded {NUCLEI_TEST_FRACTION:.0%} of the training "
            "images is the test split), or one split's files directly in the client folder; in each, the images "
            f"({', '.join(_IMAGE_EXTS)}) in {names(_IMAGE_DIRS)} and their masks of the same name (mask images or "
            f"official .xml annotations) in {names(_MASK_DIRS)}, or the images beside their <name>.xml "
            "annotations; or TNBC's 'Slide_<nn>/' and 'GT_<nn>/' folders. The official MoNuSeg 2018 zips extract "
            f"to such folders: '{_MONUSEG_TRAIN}/{_MONUSEG_IMAGES}/<name>.tif' with "
            f"'{_MONUSEG_TRAIN}/{_MONUSEG_ANNOTATIONS}/<name>.xml', and '{_MONUSEG_TEST}/<name>.tif' beside "
            f"'{_MONUSEG_TEST}/<name>.xml'. For MoNuSeg, unzip the official MoNuSeg 2018 training and test zips "
            f"({MONUSEG_URL}) into {client_dir} as they are; otherwise put the files in one of these layouts; "
            f"{_rerun(client_dir)}.")


def _holds(folder: Path) -> str:
    entries = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir() if not is_junk_path((p.name,)))
    shown = ", ".join(entries[:12]) + (f", ... ({len(entries)} entries)" if len(entries) > 12 else "")
    return f"it holds {shown}" if entries else "it is empty"


def _pairs(folder: Path, client_dir: Path | None = None) -> list[tuple[Path, Path]]:
    """(image, mask) pairs of one split folder, by file stem: images in one of :data:`_IMAGE_DIRS`
    with masks in one of :data:`_MASK_DIRS`, or images beside their ``.xml`` annotations (the
    official ``MoNuSegTestData/``). Every image needs a mask and every mask an image."""
    client_dir = folder if client_dir is None else client_dir
    images_dir, mask_dir = _first_dir(folder, _IMAGE_DIRS), _first_dir(folder, _MASK_DIRS)
    beside = images_dir is None and mask_dir is None
    if beside:  # images and their .xml annotations side by side (a mask image there would pass for an image)
        images_dir = mask_dir = folder
        mask_exts: tuple[str, ...] = (".xml",)
        if not (_files(folder, _IMAGE_EXTS) and _files(folder, mask_exts)):
            raise DataError(f"No nuclei layout was found in {folder}: no image folder ({' or '.join(_IMAGE_DIRS)}) "
                            f"with a mask folder ({' or '.join(_MASK_DIRS)}), and no images beside their .xml "
                            f"annotations ({_holds(folder)}). {_layouts(client_dir)}")
    else:
        mask_exts = (*_IMAGE_EXTS, ".xml")
        if images_dir is None or mask_dir is None:
            have, need = (images_dir, _MASK_DIRS) if mask_dir is None else (mask_dir, _IMAGE_DIRS)
            raise DataError(f"{folder} holds {have.name}/ but no {' or '.join(f'{d}/' for d in need)} folder beside "
                            f"it. {_layouts(client_dir)}")
    masks = {p.stem: p for p in _files(mask_dir, mask_exts)}
    images = _files(images_dir, _IMAGE_EXTS)
    if not images:
        raise DataError(f"{images_dir} holds no image ({', '.join(_IMAGE_EXTS)}). {_layouts(client_dir)}")
    pairs = []
    for img in images:
        if img.stem not in masks:
            raise DataError(
                f"The image {img} has no mask: expected {mask_dir / img.stem}.xml"
                f"{' beside it' if beside else ' (or .png, .tif, ...)'}. Put its mask or official annotation there or "
                f"remove the image (for MoNuSeg, unzip the official zips into {client_dir} again: is the "
                f"extraction complete?); {_rerun(client_dir)}.")
        pairs.append((img, masks.pop(img.stem)))
    if masks:
        orphan = masks[min(masks)]
        raise DataError(
            f"The mask {orphan} has no image: expected {images_dir / orphan.stem}.tif (or "
            f"{', '.join(_IMAGE_EXTS)}){f'; {len(masks)} masks lack their image' if len(masks) > 1 else ''}. Put "
            f"its image there or remove the mask (for MoNuSeg, unzip the official zips into {client_dir} again: is "
            f"the extraction complete?); {_rerun(client_dir)}.")
    return pairs


def _stack(samples: list[tuple[np.ndarray, np.ndarray]], size: int) -> tuple[np.ndarray, np.ndarray]:
    if not samples:
        return np.zeros((0, size, size, 3), np.uint8), np.zeros((0, size, size), np.uint8)
    return np.stack([s[0] for s in samples]), np.stack([s[1] for s in samples])


def _holdout(n: int, seed: int) -> np.ndarray:
    """Boolean test mask: a seeded 20 % of ``n`` samples (at least one when n > 1)."""
    k = int(n * NUCLEI_TEST_FRACTION) or (1 if n > 1 else 0)
    test = np.zeros(n, dtype=bool)
    test[np.random.default_rng(seed).permutation(n)[:k]] = True
    return test


def _tnbc_members(names: list[str]) -> list[tuple[str, str]]:
    """(image, mask) member pairs of the TNBC release: ``Slide_nn/x.png`` with ``GT_nn/x.png``
    (macOS ``__MACOSX/`` and ``._x.png`` entries skipped)."""
    names = [n for n in names if not is_junk_path(n.split("/"))]
    pattern = re.compile(r"(?:^|/)Slide_(\d+)/([^/]+\.png)$", re.IGNORECASE)
    index = {n.lower(): n for n in names}
    pairs = []
    for name in sorted(names):
        m = pattern.search(name)
        if not m:
            continue
        gt = name[: m.start()] + ("/" if m.group(0).startswith("/") else "") + f"GT_{m.group(1)}/{m.group(2)}"
        if gt.lower() not in index:
            raise DataError(f"The TNBC image {name} has no mask GT_{m.group(1)}/{m.group(2)}.")
        pairs.append((name, index[gt.lower()]))
    return pairs


def read_tnbc_zip(archive: Path, *, size: int = NUCLEI_SIZE, seed: int = 0) -> dict[str, np.ndarray]:
    """TNBC's ``TNBC_NucleiSegmentation.zip`` (read in place) as train/test arrays; a seeded 20 %
    of the images is the test split (TNBC has no official one)."""
    try:
        with zipfile.ZipFile(archive) as zf:
            pairs = _tnbc_members([i.filename for i in zf.infolist() if not i.is_dir()])
            if not pairs:
                raise DataError(f"{archive} holds no Slide_nn/*.png image. Is it TNBC_NucleiSegmentation.zip?")
            samples = [_sample(zf.read(i), zf.read(m), f"{archive}:{i}", size) for i, m in pairs]
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise DataError(f"Cannot read {archive} ({type(exc).__name__}: {exc}). Delete it and download it again "
                        f"from {TNBC_ZIP.url}.") from exc
    return _split_arrays(samples, [Path(i).as_posix() for i, _ in pairs], seed, size)


def _split_arrays(samples, names, seed, size, test_samples=None, test_names=None) -> dict[str, np.ndarray]:
    if test_samples is None:
        test = _holdout(len(samples), seed)
        test_samples = [s for s, t in zip(samples, test) if t]
        test_names = [n for n, t in zip(names, test) if t]
        samples = [s for s, t in zip(samples, test) if not t]
        names = [n for n, t in zip(names, test) if not t]
    x_train, y_train = _stack(samples, size)
    x_test, y_test = _stack(test_samples, size)
    return {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test,
            "names_train": np.array(names, dtype=str), "names_test": np.array(test_names, dtype=str)}


def read_client_folder(folder: Path, *, size: int = NUCLEI_SIZE, seed: int = 0) -> dict[str, np.ndarray]:
    """One client folder in the documented layout (``train/`` + ``test/``, or one split held out
    20 % seeded), MoNuSeg's official zips as extracted (``MoNuSeg 2018 Training Data/`` +
    ``MoNuSegTestData/``), or TNBC's ``Slide_nn``/``GT_nn`` folders, as train/test arrays. A
    :class:`DataError` names the folder and the accepted layouts when none is found."""
    folder = Path(folder)
    slide_dirs = sorted(folder.glob("Slide_*"))
    if slide_dirs:
        files = [p.relative_to(folder).as_posix() for d in (*slide_dirs, *folder.glob("GT_*")) for p in d.iterdir()]
        pairs = _tnbc_members(files)
        samples = [_sample(folder / i, folder / m, str(folder / i), size) for i, m in pairs]
        return _split_arrays(samples, [i for i, _ in pairs], seed, size)
    train_dir, test_dir = _first_dir(folder, _TRAIN_DIRS), _first_dir(folder, _TEST_DIRS)
    if train_dir is not None:
        train_pairs = _pairs(train_dir, folder)
        samples = [_sample(i, m, str(i), size) for i, m in train_pairs]
        names = [i.name for i, _ in train_pairs]
        if test_dir is not None:
            test_pairs = _pairs(test_dir, folder)
            return _split_arrays(samples, names, seed, size, [_sample(i, m, str(i), size) for i, m in test_pairs],
                                 [i.name for i, _ in test_pairs])
        return _split_arrays(samples, names, seed, size)
    if test_dir is not None:
        raise DataError(f"{folder} holds the test folder {test_dir.name}/ but no training folder "
                        f"({' or '.join(f'{d}/' for d in _TRAIN_DIRS)}). For MoNuSeg, unzip the official training "
                        f"zip too. {_layouts(folder)}")
    pairs = _pairs(folder)
    return _split_arrays([_sample(i, m, str(i), size) for i, m in pairs], [i.name for i, _ in pairs], seed, size)


def prepare_nuclei(data_dir: Path, *, raw_dir: Path | None = None, download: bool = True, progress: bool = True,
                   clients: Sequence[str] = NUCLEI_CLIENTS, size: int = NUCLEI_SIZE, seed: int = 0) -> list[Path]:
    """Write ``nuclei/<client>.npz`` for each client from ``raw_dir/<client>`` (default
    ``data_dir/raw/nuclei``) in the layout of the module docstring. TNBC may instead be the
    release zip ``raw_dir/TNBC_NucleiSegmentation.zip`` (downloaded from Zenodo when neither is
    there and downloading is allowed). The other sources need registration (grand-challenge.org)
    and are put in place by hand."""
    data_dir = Path(data_dir)
    raw_dir = Path(raw_dir) if raw_dir is not None else data_dir / "raw" / "nuclei"
    paths = []
    for client in clients:
        check_choice(client, NUCLEI_CLIENTS, "nuclei client")
        folder = raw_dir / client
        if folder.is_dir():
            arrays = read_client_folder(folder, size=size, seed=seed)
            source = f"{folder} (documented layout; HarmoFL release {NUCLEI_RELEASE_URL} or official sources)"
        elif client == "tnbc":
            manual = (f"Download TNBC_NucleiSegmentation.zip (Naylor et al. 2018) from {TNBC_ZIP.url} into {raw_dir}, "
                      f"or put the unzipped Slide_nn/GT_nn folders in {folder}.")
            archive = fetch(TNBC_ZIP, raw_dir, download=download, progress=progress, manual=manual)
            arrays = read_tnbc_zip(archive, size=size, seed=seed)
            source = f"TNBC {TNBC_ZIP.url} (no official split: seeded 20 % test, seed {seed})"
        else:
            where = MONUSEG_URL if client == "monuseg2018" else MONUSAC_URL
            official = (f" For MoNuSeg, unzipping the official MoNuSeg 2018 training and test zips into {folder} as "
                        f"they are ('{_MONUSEG_TRAIN}/', '{_MONUSEG_TEST}/') is enough."
                        if client == "monuseg2018" else "")
            raise DataError(
                f"The nuclei client folder {folder} is missing. Get the images and annotations from HarmoFL's "
                f"release ({NUCLEI_RELEASE_URL}) or the official challenge ({where}, registration needed) and "
                f"put them in {folder}/train/images + train/masks (mask images or the official .xml "
                f"annotations) and {folder}/test/images + test/masks.{official} MoNuSAC2020 images go into one "
                f"client folder per organ (breast, kidney, lung, prostate); {_rerun(folder)}.")
        if not len(arrays["y_train"]):
            raise DataError(f"{client}: no training image was found in {folder}.")
        paths.append(write_dataset_file(data_dir, nuclei_file(client), arrays, key=f"nuclei_{client}", source=source))
    return paths


def load_nuclei(client: str, data_dir: Path, *, val_fraction: float = NUCLEI_VAL_FRACTION, seed: int = 0) -> Domain:
    """One client's train/val/test :class:`SegmentationSplit` s: the stored train/test split, and
    ``val_fraction`` of train (seeded; ``int()`` rounding) as validation."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    relpath = nuclei_file(client)
    path = Path(data_dir) / relpath
    arrays = load_npz(Path(data_dir), relpath, keys=["x_train", "y_train", "x_test", "y_test"])
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.dtype != np.uint8 or x.ndim != 4 or x.shape[-1] != 3 or y.dtype != np.uint8 or y.shape != x.shape[:3]:
            raise DataError(f"In {path}, x_{split} must be uint8 (N, H, W, 3) and y_{split} uint8 (N, H, W); got "
                            f"{x.dtype} {x.shape} and {y.dtype} {y.shape}. Prepare it again.")
    x, y = nhwc_to_nchw(arrays["x_train"]), torch.from_numpy(arrays["y_train"])
    perm = torch.from_numpy(np.random.default_rng(seed).permutation(len(y)))
    n_val = int(len(y) * val_fraction)
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    test = SegmentationSplit(nhwc_to_nchw(arrays["x_test"]), torch.from_numpy(arrays["y_test"]))
    return Domain(name=f"nuclei/{client}", train=SegmentationSplit(x[train_idx], y[train_idx]),
                  val=SegmentationSplit(x[val_idx], y[val_idx]), test=test, num_classes=2,
                  description=f"nuclei {client}, stored train/test, {val_fraction:.0%} of train as val (seed {seed})")
