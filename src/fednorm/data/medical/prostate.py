"""Multi-site prostate MRI segmentation (Liu et al. 2020, SAML release) as six site domains: HarmoFL.

Source: the "multi-site dataset for prostate MRI segmentation" of Liu, Dou & Heng (MICCAI 2020,
https://liuquande.github.io/SAML/), six sources from NCI-ISBI 2013, I2CVB and PROMISE12, already
resampled to 384 x 384 in the axial plane. It is shared through a Google Drive link, so it is put in
place by hand: folders ``BIDMC``, ``HK``, ``I2CVB``, ``ISBI``, ``ISBI_1.5``, ``UCL``, each holding
``CaseNN.nii.gz`` volumes and ``CaseNN_segmentation.nii.gz`` (some sites: ``_Segmentation``)
masks. Volumes are read with nibabel (:func:`.nifti.read_nifti`, indexed ``[i, j, k]``); HarmoFL's code
reads them with SimpleITK, whose ``GetArrayFromImage`` is the transpose ``[k, j, i]``, the order
:func:`volume_slices` extracts the slices in.

Slice extraction follows HarmoFL's official code (med-air/HarmoFL ``utils/dataset.py``,
``Prostate``) exactly:

* image intensities: clipped at the volume's 99th percentile (``np.quantile``, linear), then
  ``(v - min) / (p99 - min) * 255`` cast to uint8 (truncation) — ``convert_from_nii_to_png``;
* masks: values > 1 set to 1 (binary prostate vs background);
* 2.5-D samples: for every slice ``i`` in ``1 .. D-2`` whose mask is not empty, the image slices
  ``i-1, i, i+1`` become 3 channels and the mask of slice ``i`` the target;
* volumes are taken in the order of the authors' ``<site>-dir.npy`` file listing and all slices
  of a site are then permuted by their stored ``<site>-index.npy`` (both in the public HarmoFL
  repository, downloaded by :func:`prepare_prostate`); the permuted slices are split 64/16/20 into
  train/val/test with the official rounding (:func:`harmofl_bounds`). This is a slice-level split:
  slices of one patient can be in train and test. ``split_by="case"`` keeps patients whole (an
  option, not the paper's protocol).
* Size: 384 x 384, the size of the release and of HarmoFL's U-Net input. The official code does
  not resize; slices of another size are resized here (bilinear image, nearest mask).

HarmoFL's augmentation (random 90-degree rotations and flips of image and mask, training only) is
left to the training loop. HarmoFL feeds the uint8 values unscaled (0..255) to its U-Net.

Data folder format, one file per site, ``prostate/<site>.npz``: ``x`` (N, 384, 384, 3) uint8,
``y`` (N, 384, 384) uint8 masks (0 background, 1 prostate), ``case`` (N,) int32 index into
``cases`` (the volume file names), ``slice`` (N,) int32, and, when the authors' files were used,
``harmofl_index`` (N,) int64.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..datafolder import load_npz
from ..domain import DataError, Domain
from ._common import (RawFile, SegmentationSplit, check_choice, fetch, group_split_indices, harmofl_bounds,
                      nhwc_to_nchw, resize_image, resize_mask, write_dataset_file)
from .nifti import read_nifti

PROSTATE_SITES = ("BIDMC", "HK", "I2CVB", "ISBI", "ISBI_1.5", "UCL")  # HarmoFL's order (fed_train.py)
PROSTATE_SIZE = 384
PROSTATE_CLASSES = ("background", "prostate")
SAML_URL = "https://liuquande.github.io/SAML/"
# The authors' per-site file listing and slice permutation, pinned to the commit that added them.
HARMOFL_COMMIT = "ff8cfa3f30a19dd4fa2eab3b4ca69abadd593ad7"
_HARMOFL_RAW = f"https://raw.githubusercontent.com/med-air/HarmoFL/{HARMOFL_COMMIT}/data/prostate"
# No digest of these files is published: url only.
HARMOFL_PROSTATE_FILES = {
    site: {kind: RawFile(f"{_HARMOFL_RAW}/{site}-{kind}.npy", f"{site}-{kind}.npy") for kind in ("dir", "index")}
    for site in PROSTATE_SITES
}
_MASK_SUFFIXES = ("_segmentation.nii.gz", "_segmentation.nii")


def prostate_file(site: str) -> str:
    return f"prostate/{check_choice(site, PROSTATE_SITES, 'prostate site')}.npz"


def _is_mask(name: str) -> bool:
    return name.lower().endswith(_MASK_SUFFIXES)


def _image_name(mask_name: str) -> str:
    low = mask_name.lower()
    for suffix in _MASK_SUFFIXES:
        if low.endswith(suffix):
            return mask_name[: -len(suffix)] + suffix[len("_segmentation"):]
    raise ValueError(mask_name)


def find_site_dir(raw_dir: Path, site: str) -> Path | None:
    """``raw_dir/<site>``, or ``raw_dir/<any>/<site>`` (the unzipped release may add a top folder)."""
    direct = raw_dir / site
    if direct.is_dir():
        return direct
    for child in sorted(p for p in raw_dir.glob("*") if p.is_dir()):
        if (child / site).is_dir():
            return child / site
    return None


def to_uint8_volume(volume: np.ndarray, what: str) -> np.ndarray:
    """HarmoFL's ``convert_from_nii_to_png``: clip at the 99th percentile, min-max to 0..255, uint8."""
    volume = np.asarray(volume, dtype=np.float64)
    high = np.quantile(volume, 0.99)
    low = np.min(volume)
    if not high > low:
        raise DataError(f"The volume {what} is constant below its 99th percentile ({low}); it cannot be "
                        "scaled. The file is corrupt or not an MRI volume.")
    volume = np.where(volume > high, high, volume)
    return ((volume - low) / (high - low) * 255).astype(np.uint8)


def volume_slices(image_ijk: np.ndarray, mask_ijk: np.ndarray, what: str,
                  size: int = PROSTATE_SIZE, *, mask_what: str | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """2.5-D samples of one volume: images (n, size, size, 3) uint8, masks (n, size, size) uint8
    and the slice numbers, for the slices with a non-empty mask (HarmoFL's rule). ``what`` names
    the image (its file) in errors, ``mask_what`` the mask (default: "the mask of <what>")."""
    mask_what = mask_what if mask_what is not None else f"the mask of {what}"
    if image_ijk.shape != mask_ijk.shape or image_ijk.ndim != 3:
        raise DataError(f"{what}: the image {image_ijk.shape} and its mask {mask_ijk.shape} must be 3-D "
                        "volumes of the same shape.")
    # SimpleITK's GetArrayFromImage order [k, j, i], as the official code sees the volume.
    image = to_uint8_volume(np.transpose(image_ijk, (2, 1, 0)), what)
    mask = np.transpose(mask_ijk, (2, 1, 0))
    if mask.min() < 0:
        raise DataError(f"The mask {mask_what} has negative labels (minimum {mask.min()}); a prostate mask holds 0 "
                        "(background) and 1 or more (prostate). The file is corrupt or not a segmentation of the SAML "
                        f"release: get it again unchanged ({SAML_URL}) and run `fednorm data prepare prostate` again.")
    mask = np.where(mask > 1, 1, mask)
    xs, ys, ks = [], [], []
    for i in range(1, mask.shape[0] - 1):
        if np.all(mask[i] == 0):
            continue
        stack = np.transpose(image[i - 1:i + 2], (1, 2, 0))
        xs.append(resize_image(np.ascontiguousarray(stack), size))
        ys.append(resize_mask(mask[i], size))
        ks.append(i)
    if not xs:
        return (np.zeros((0, size, size, 3), np.uint8), np.zeros((0, size, size), np.uint8),
                np.zeros(0, np.int32))
    return np.stack(xs), np.stack(ys), np.array(ks, dtype=np.int32)


def _load_listing(path: Path, site: str) -> list[str]:
    try:
        names = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise DataError(f"Cannot read HarmoFL's file listing {path} ({exc}). Delete it and get "
                        f"{HARMOFL_PROSTATE_FILES[site]['dir'].url} again.") from exc
    if names.ndim != 1 or names.dtype.kind not in "US":
        raise DataError(f"{path} must hold a 1-D array of file names, got {names.dtype} {names.shape}.")
    return [str(n) for n in names.tolist()]


def _load_index(path: Path, site: str, n: int) -> np.ndarray:
    try:
        index = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise DataError(f"Cannot read HarmoFL's slice permutation {path} ({exc}). Delete it and get "
                        f"{HARMOFL_PROSTATE_FILES[site]['index'].url} again.") from exc
    index = np.asarray(index).reshape(-1)
    if index.dtype.kind not in "iu" or index.shape != (n,) or not np.array_equal(np.sort(index), np.arange(n)):
        raise DataError(f"{path} is not a permutation of the {n} slices extracted for {site} (it has "
                        f"{index.size} entries). The volumes differ from the authors' release, or the file is "
                        "wrong: use the SAML release unchanged, or prepare with harmofl_order=False (fednorm data "
                        "prepare prostate --seeded-order).")
    return index.astype(np.int64)


def prepare_prostate(data_dir: Path, *, raw_dir: Path | None = None, download: bool = True,
                     progress: bool = True, harmofl_order: bool = True,
                     sites: tuple[str, ...] = PROSTATE_SITES) -> list[Path]:
    """Write ``prostate/<site>.npz`` for each site from the SAML release in ``raw_dir`` (default
    ``data_dir/raw/prostate``), which must be placed there by hand (Google Drive).

    ``harmofl_order``: take volumes in the order of HarmoFL's ``<site>-dir.npy`` and store its
    ``<site>-index.npy`` slice permutation (both fetched into ``raw_dir/harmofl`` if absent and
    allowed), reproducing the official split; otherwise volumes are taken in sorted name order and
    loaders split with a seeded permutation.
    """
    data_dir = Path(data_dir)
    raw_dir = Path(raw_dir) if raw_dir is not None else data_dir / "raw" / "prostate"
    manual = (f"Download the multi-site prostate MRI dataset (SAML release, Liu et al. 2020) from {SAML_URL} "
              f"(a Google Drive link), unzip it and put the site folders {', '.join(PROSTATE_SITES)} (each with "
              f"CaseNN.nii.gz and CaseNN_segmentation.nii.gz) in {raw_dir}.")
    paths = []
    for site in sites:
        check_choice(site, PROSTATE_SITES, "prostate site")
        site_dir = find_site_dir(raw_dir, site)
        if site_dir is None:
            raise DataError(f"The prostate site folder {raw_dir / site} is missing. {manual}")
        present = sorted(p.name for p in site_dir.iterdir() if p.is_file() and _is_mask(p.name))
        if not present:
            raise DataError(f"{site_dir} holds no *_segmentation.nii.gz mask. {manual}")
        index_path = None
        if harmofl_order:
            hdir = raw_dir / "harmofl"
            hint = (f"Get it from the HarmoFL repository ({{url}}) into {hdir}, or prepare with "
                    "harmofl_order=False (fednorm data prepare prostate --seeded-order: a seeded split instead of the "
                    "authors' slice order).")
            files = HARMOFL_PROSTATE_FILES[site]
            listing_path = fetch(files["dir"], hdir, download=download, progress=progress,
                                 manual=hint.format(url=files["dir"].url))
            index_path = fetch(files["index"], hdir, download=download, progress=progress,
                               manual=hint.format(url=files["index"].url))
            masks = [n for n in _load_listing(listing_path, site) if _is_mask(n)]
            missing = sorted(set(masks) - set(present))
            if missing or len(masks) != len(present):
                raise DataError(f"{site_dir} does not hold the volumes HarmoFL's {listing_path.name} lists "
                                f"(missing: {missing[:5]}, listed {len(masks)}, present {len(present)}). "
                                "Use the SAML release unchanged, or prepare with harmofl_order=False (fednorm data "
                                "prepare prostate --seeded-order).")
        else:
            masks = present
        xs, ys, cases, slices = [], [], [], []
        for c, mask_name in enumerate(masks):
            image_path = site_dir / _image_name(mask_name)
            if not image_path.is_file():
                raise DataError(f"The image {image_path} of the mask {site_dir / mask_name} is missing. {manual}")
            mask_path = site_dir / mask_name
            x, y, k = volume_slices(read_nifti(image_path), read_nifti(mask_path), str(image_path),
                                    mask_what=str(mask_path))
            xs.append(x)
            ys.append(y)
            slices.append(k)
            cases.append(np.full(len(k), c, dtype=np.int32))
        arrays = {"x": np.concatenate(xs), "y": np.concatenate(ys), "case": np.concatenate(cases),
                  "slice": np.concatenate(slices), "cases": np.array([_image_name(m) for m in masks])}
        source = f"SAML multi-site prostate MRI ({SAML_URL}), site {site}"
        if index_path is not None:
            arrays["harmofl_index"] = _load_index(index_path, site, len(arrays["y"]))
            source += f"; slice order from med-air/HarmoFL@{HARMOFL_COMMIT[:7]} {site}-dir.npy/-index.npy"
        paths.append(write_dataset_file(data_dir, prostate_file(site), arrays, key=f"prostate_{site}", source=source))
    return paths


def load_prostate(site: str, data_dir: Path, *, order: str = "auto", split_by: str = "slice",
                  seed: int = 0) -> Domain:
    """One site's train/val/test :class:`SegmentationSplit` s (64/16/20, HarmoFL's rounding).

    ``order``: ``"harmofl"`` (the authors' stored slice permutation; needs a file prepared with
    ``harmofl_order=True``), ``"seeded"`` (a permutation from ``seed``) or ``"auto"`` (harmofl when
    stored, else seeded). ``split_by``: ``"slice"`` (the paper) or ``"case"`` (patients whole;
    seeded only).
    """
    check_choice(order, ("auto", "harmofl", "seeded"), "order")
    check_choice(split_by, ("slice", "case"), "split_by")
    relpath = prostate_file(site)
    path = Path(data_dir) / relpath
    arrays = load_npz(Path(data_dir), relpath)
    for key in ("x", "y", "case"):
        if key not in arrays:
            raise DataError(f"{path} lacks the array {key!r}. Prepare it again.")
    x, y, case = arrays["x"], arrays["y"], arrays["case"]
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[-1] != 3 or y.dtype != np.uint8 or y.shape != x.shape[:3]:
        raise DataError(f"In {path}, x must be uint8 (N, H, W, 3) and y uint8 (N, H, W); got {x.dtype} {x.shape} "
                        f"and {y.dtype} {y.shape}. Prepare it again.")
    stored = arrays.get("harmofl_index")
    if order == "auto":
        order = "harmofl" if stored is not None and split_by == "slice" else "seeded"
    if order == "harmofl":
        if stored is None:
            raise DataError(f"{path} has no HarmoFL slice order; prepare it with harmofl_order=True or load "
                            "with order='seeded'.")
        if split_by != "slice":
            raise ValueError("the HarmoFL order is a slice-level split; use order='seeded' with split_by='case'")
        perm = stored
        a, b = harmofl_bounds(len(perm))
        parts = (perm[:a], perm[a:b], perm[b:])
    elif split_by == "slice":
        perm = np.random.default_rng(seed).permutation(len(y))
        a, b = harmofl_bounds(len(perm))
        parts = (perm[:a], perm[a:b], perm[b:])
    else:
        parts = group_split_indices(case, "harmofl", seed)
    images, masks = nhwc_to_nchw(x), torch.from_numpy(np.ascontiguousarray(y))
    train, val, test = (SegmentationSplit(images[torch.from_numpy(p)], masks[torch.from_numpy(p)]) for p in parts)
    return Domain(name=f"prostate/{site}", train=train, val=val, test=test, num_classes=2,
                  description=f"prostate MRI {site}, 64/16/20 by {split_by}, order {order}"
                              + ("" if order == "harmofl" else f", seed {seed}"))
