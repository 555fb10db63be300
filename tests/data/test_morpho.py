"""Morpho-MNIST (FedBN App. G's unseen clients): the authors' dataset zips, built here in their real format (IDX
files, gzip'ed, in a zip), prepared into the data folder and loaded as digit domains."""

from __future__ import annotations

import gzip
import struct
import zipfile

import numpy as np
import pytest
import torch

from fednorm.data import morpho
from fednorm.data.digits import load_digit_pool
from fednorm.data.domain import DataError
from fednorm.data.prepare import prepare_dataset

from .local_http import serve_folder


def _idx(array: np.ndarray) -> bytes:
    """The IDX (MNIST) encoding of a uint8 array: magic 0x0000_08_<ndim>, big-endian int32 dims, the bytes."""
    return struct.pack(">I", 0x0800 + array.ndim) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def _sets(rng, kind: str, n_train: int = 12, n_test: int = 5) -> dict[str, np.ndarray]:
    codes = morpho.KIND_PERTURBATIONS[kind]
    out = {}
    for split, n in (("train", n_train), ("t10k", n_test)):
        out[f"{split}-images-idx3-ubyte.gz"] = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        out[f"{split}-labels-idx1-ubyte.gz"] = rng.permutation(np.arange(n) % 10).astype(np.uint8)  # every digit
        out[f"{split}-pert-idx1-ubyte.gz"] = rng.choice(np.array(codes, dtype=np.uint8), n)
    return out


def _zip(path, arrays: dict[str, np.ndarray], folder: str = "global/", extra: dict[str, bytes] | None = None):
    """A dataset zip as the authors distribute it: the IDX files gzip'ed (plus their csv and README) in a folder."""
    with zipfile.ZipFile(path, "w") as zf:
        for name, array in arrays.items():
            zf.writestr(folder + name, gzip.compress(_idx(array)))
        zf.writestr(folder + "README-global.txt", "Morpho-MNIST: 'Global' dataset")
        for name, blob in (extra or {}).items():
            zf.writestr(folder + name, blob)
    return path


def test_prepared_morpho_set_loads_as_a_digit_domain_with_train_then_test_images(tmp_path):
    rng = np.random.default_rng(0)
    arrays = _sets(rng, "global")
    raw = tmp_path / "raw"
    raw.mkdir()
    _zip(raw / "morpho_global.zip", arrays)
    data = tmp_path / "data"
    (path,) = prepare_dataset("morpho_global", data, raw_dir=raw, download=False, progress=False)
    assert path == data / "digits/morpho_global.npz"
    stored = np.load(path)
    assert np.array_equal(stored["x_train"], arrays["train-images-idx3-ubyte.gz"])
    assert np.array_equal(stored["pert_test"], arrays["t10k-pert-idx1-ubyte.gz"])
    x, y = load_digit_pool("morpho_global", data)
    # grey 28 x 28 replicated to three channels, the training images first, as MNIST
    expected = np.concatenate([arrays["train-images-idx3-ubyte.gz"], arrays["t10k-images-idx3-ubyte.gz"]])
    assert x.shape == (17, 3, 28, 28) and torch.equal(x[:, 0], torch.from_numpy(expected))
    assert torch.equal(x[:, 0], x[:, 2])
    labels = np.concatenate([arrays["train-labels-idx1-ubyte.gz"], arrays["t10k-labels-idx1-ubyte.gz"]])
    assert torch.equal(y, torch.from_numpy(labels.astype(np.int64)))


def test_the_other_kinds_zip_a_missing_member_and_damaged_files_are_named(tmp_path):
    rng = np.random.default_rng(1)
    local = _zip(tmp_path / "local.zip", _sets(rng, "local"))
    with pytest.raises(DataError, match=r"\((swollen|fractured)[a-z, ]*\) that the global dataset does not have; "
                                        r"is this the other Morpho-MNIST zip"):
        morpho.read_morpho_zip(local, "global")
    assert set(np.unique(morpho.read_morpho_zip(local, "local")["pert_train"])) <= {0, 3, 4}
    partial = _sets(rng, "global")
    del partial["t10k-pert-idx1-ubyte.gz"]
    with pytest.raises(DataError, match="lacks t10k-pert-idx1-ubyte.gz"):
        morpho.read_morpho_zip(_zip(tmp_path / "partial.zip", partial), "global")
    short = _sets(rng, "global")
    short["train-labels-idx1-ubyte.gz"] = short["train-labels-idx1-ubyte.gz"][:-1]
    with pytest.raises(DataError, match="12 images but 11 labels"):
        morpho.read_morpho_zip(_zip(tmp_path / "short.zip", short), "global")
    cut = tmp_path / "cut.zip"
    with zipfile.ZipFile(cut, "w") as zf:
        for name, array in _sets(rng, "global").items():
            zf.writestr(name, gzip.compress(_idx(array))[:-9] if name.startswith("t10k-images") else gzip.compress(_idx(array)))
    with pytest.raises(DataError, match="t10k-images-idx3-ubyte.gz is not a readable gzip"):
        morpho.read_morpho_zip(cut, "global")
    (tmp_path / "page.zip").write_text("<html>quota exceeded</html>")
    with pytest.raises(DataError, match="not a zip file"):
        morpho.read_morpho_zip(tmp_path / "page.zip", "global")


def test_missing_zip_without_download_says_where_to_put_it(tmp_path):
    with pytest.raises(DataError, match=r"(?s)Download the 'local' dataset zip.*raw/morpho/morpho_local.zip"):
        prepare_dataset("morpho_local", tmp_path / "data", download=False, progress=False)


def test_download_of_the_zip_and_a_drive_page_instead_of_it(tmp_path, monkeypatch):
    served = tmp_path / "served"
    served.mkdir()
    _zip(served / "g.zip", _sets(np.random.default_rng(2), "global"))
    (served / "page.html").write_text("<html>Google Drive - Quota exceeded</html>")
    with serve_folder(served) as server:
        monkeypatch.setitem(morpho.MORPHO_URLS, "global", server.url("g.zip"))
        data = tmp_path / "data"
        prepare_dataset("morpho_global", data, progress=False)
        assert (data / "raw/morpho/morpho_global.zip").read_bytes() == (served / "g.zip").read_bytes()
        assert load_digit_pool("morpho_global", data)[0].shape == (17, 3, 28, 28)
        monkeypatch.setitem(morpho.MORPHO_URLS, "global", server.url("page.html"))
        other = tmp_path / "other"
        with pytest.raises(DataError, match=r"(?s)answered with a page, not the zip.*save it as .*morpho_global.zip"):
            prepare_dataset("morpho_global", other, progress=False)
        assert not (other / "raw/morpho/morpho_global.zip").exists()  # the page is not kept as the zip


def test_a_morpho_domain_missing_from_the_data_folder_names_its_prepare_command(tmp_path):
    (tmp_path / "digits").mkdir()
    with pytest.raises(DataError, match="fednorm data prepare morpho_local"):
        load_digit_pool("morpho_local", tmp_path)
