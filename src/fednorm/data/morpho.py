"""Morpho-MNIST (Castro et al., JMLR 2019): MNIST digits with measured morphological perturbations.

FedBN App. G (Table 17) scores two unseen-domain clients on it: *Morpho-global* (plain, thinned and thickened
digits, interleaved at random) and *Morpho-local* (plain, swollen and fractured ones). Both are the authors'
released datasets (github.com/dccastro/Morpho-MNIST, "global" and "local"): zips of MNIST-format IDX files,
``{train,t10k}-images-idx3-ubyte.gz`` (28 x 28 uint8), ``-labels-idx1-ubyte.gz`` (the MNIST digit labels) and
``-pert-idx1-ubyte.gz`` (the perturbation of each image: 0 plain, 1 thinned, 2 thickened, 3 swollen, 4
fractured). ``fednorm data prepare morpho_global`` / ``morpho_local`` writes ``digits/morpho_<kind>.npz`` with
``x_train``, ``y_train``, ``x_test``, ``y_test`` (as ``digits/mnist.npz``) and ``pert_train``, ``pert_test``; the
digit loaders read it like MNIST (grey, replicated to 3 x 28 x 28), as domains ``morpho_global`` and
``morpho_local``.

The zips are shared through Google Drive links (no digest published). Files this small come straight from the
``uc?export=download`` link; where Drive answers with a page instead (a quota or confirmation page), the page is
discarded and the error says to download the zip by hand into the raw folder.
"""

from __future__ import annotations

import gzip
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

import numpy as np

from .domain import DataError

MORPHO_KINDS = ("global", "local")
MORPHO_FILES = {f"morpho_{kind}": f"digits/morpho_{kind}.npz" for kind in MORPHO_KINDS}
# the README's download links (dccastro/Morpho-MNIST, "Datasets"): plain+thinning+thickening, plain+swelling+fractures
MORPHO_URLS = {
    "global": "https://drive.google.com/uc?export=download&id=1fFGJW0IHoBmLuD6CEKCB8jz3Y5LJ5Duk",
    "local": "https://drive.google.com/uc?export=download&id=1ECYmtpPvGH0AkK0JfrGfA2FpOCZK1VX2",
}
PERTURBATIONS = ("plain", "thinned", "thickened", "swollen", "fractured")  # the pert files' codes 0..4
# each dataset's perturbation codes (its README): global mixes plain, thinning, thickening; local plain, swelling,
# fractures
KIND_PERTURBATIONS = {"global": (0, 1, 2), "local": (0, 3, 4)}
_MEMBERS = {  # npz array -> the IDX file inside the zip (found by file name, in any folder)
    "x_train": "train-images-idx3-ubyte.gz", "y_train": "train-labels-idx1-ubyte.gz",
    "pert_train": "train-pert-idx1-ubyte.gz",
    "x_test": "t10k-images-idx3-ubyte.gz", "y_test": "t10k-labels-idx1-ubyte.gz", "pert_test": "t10k-pert-idx1-ubyte.gz",
}


def zip_name(kind: str) -> str:
    return f"morpho_{kind}.zip"


def _read_idx(blob: bytes, what: str, archive: Path) -> np.ndarray:
    """An IDX array (torchvision's MNIST reader) from a member's gzip bytes; DataError naming it when damaged."""
    from torchvision.datasets.mnist import read_sn3_pascalvincent_tensor

    try:
        raw = gzip.decompress(blob)
    except (OSError, EOFError) as exc:
        raise DataError(f"{archive}: {what} is not a readable gzip file ({exc}); download the zip again") from None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "idx"
        path.write_bytes(raw)
        try:
            return read_sn3_pascalvincent_tensor(str(path), strict=True).numpy()
        except (AssertionError, KeyError, ValueError, RuntimeError) as exc:
            raise DataError(f"{archive}: {what} is not an IDX array ({type(exc).__name__} {exc}); "
                            "download the zip again") from None


def read_morpho_zip(archive: Path, kind: str) -> dict[str, np.ndarray]:
    """The six arrays of a Morpho-MNIST dataset zip, checked: 28 x 28 uint8 images, one digit label (0..9) and one
    perturbation code of the dataset's kind per image."""
    archive = Path(archive)
    try:
        with zipfile.ZipFile(archive) as zf:
            by_name = {PurePosixPath(n).name: n for n in zf.namelist() if not n.endswith("/")}
            missing = [m for m in _MEMBERS.values() if m not in by_name]
            if missing:
                raise DataError(f"{archive} is not a Morpho-MNIST dataset zip: it lacks {', '.join(missing)}")
            arrays = {key: _read_idx(zf.read(by_name[member]), member, archive) for key, member in _MEMBERS.items()}
    except zipfile.BadZipFile as exc:
        raise DataError(f"{archive} is not a zip file ({exc}); download it again") from None
    for split in ("train", "test"):
        x, y, pert = arrays[f"x_{split}"], arrays[f"y_{split}"], arrays[f"pert_{split}"]
        if x.dtype != np.uint8 or x.ndim != 3 or x.shape[1:] != (28, 28):
            raise DataError(f"{archive}: {split} images must be uint8 (N, 28, 28), got {x.dtype} {x.shape}")
        if y.shape != (len(x),) or pert.shape != (len(x),):
            raise DataError(f"{archive}: {split} has {len(x)} images but {len(y)} labels and {len(pert)} "
                            "perturbation codes")
        if y.size and int(y.max()) > 9:
            raise DataError(f"{archive}: {split} labels must be digits 0..9, got up to {int(y.max())}")
        foreign = sorted(set(np.unique(pert).tolist()) - set(KIND_PERTURBATIONS[kind]))
        if foreign:
            names = ", ".join(PERTURBATIONS[c] if c < len(PERTURBATIONS) else str(c) for c in foreign)
            raise DataError(f"{archive}: {split} holds perturbations ({names}) that the {kind} dataset does not "
                            f"have; is this the other Morpho-MNIST zip? ({', '.join(MORPHO_KINDS)})")
    return {k: v.astype(np.uint8, copy=False) for k, v in arrays.items()}
