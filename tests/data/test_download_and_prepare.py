"""Preparing SVHN, SynthDigits and CIFAR-10 (fednorm.data.prepare) from tiny files in the real
on-disk formats, then loading them through the normal checked loaders. No network: downloads go to
a localhost server."""

from __future__ import annotations

import io
import json
import pickle
import tarfile

import numpy as np
import pytest
import scipy.io
import torch

from fednorm.data import prepare
from fednorm.data.cifar10 import CIFAR10_CLASSES, load_cifar10
from fednorm.data.digits import load_digit_pool
from fednorm.data.domain import DataError
from fednorm.data.download import md5_of, sha256_of
from fednorm.data.federation import known_domains, load_domain, load_pool
from fednorm.data.prepare import RawFile

from ..conftest import write_data_folder
from .local_http import serve_folder

COLOUR = (200, 10, 255)  # a constant-colour image: channel order must survive every step


def _mat_images(rng, n: int) -> np.ndarray:
    """SVHN layout: X is (32, 32, 3, N), uint8; image 0 is the constant COLOUR."""
    x = rng.integers(0, 256, size=(32, 32, 3, n), dtype=np.uint8)
    x[:, :, :, 0] = np.array(COLOUR, dtype=np.uint8)
    x[5, 7, 2, 1] = 201  # row 5, column 7, blue, of image 1
    x[5, 7, 0, 1] = 3
    return x


def _write_mat(path, x, y) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    scipy.io.savemat(path, {"X": x, "y": y}, format="5")


@pytest.fixture()
def svhn_raw(tmp_path):
    rng = np.random.default_rng(0)
    raw = tmp_path / "raw_svhn"
    x_tr, x_te = _mat_images(rng, 5), _mat_images(rng, 3)
    y_tr = np.array([[10], [1], [2], [10], [9]], dtype=np.uint8)  # (N, 1), 10 = digit 0
    y_te = np.array([[3], [10], [4]], dtype=np.uint8)
    _write_mat(raw / "train_32x32.mat", x_tr, y_tr)
    _write_mat(raw / "test_32x32.mat", x_te, y_te)
    return raw, x_tr, x_te


@pytest.fixture()
def no_official_md5(monkeypatch):
    """The tiny test files are not the official ones: drop the torchvision md5 from the registries."""
    for registry in (prepare.SVHN_SOURCES, prepare.CIFAR10_SOURCES):
        for key, src in list(registry.items()):
            monkeypatch.setitem(registry, key, RawFile(src.url, src.filename))


def _manifest(data_dir) -> dict:
    return json.loads((data_dir / "manifest.json").read_text())


def _corrupt(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# --- SVHN ------------------------------------------------------------------------------------------


def test_svhn_prepare_layout_labels_manifest_and_load(svhn_raw, tmp_path, no_official_md5):
    raw, x_tr, x_te = svhn_raw
    data = tmp_path / "data"
    path = prepare.prepare_svhn(data, raw_dir=raw, download=False, progress=False)
    assert path == data / "digits/svhn.npz"
    with np.load(path) as f:
        assert f["x_train"].shape == (5, 32, 32, 3) and f["x_train"].dtype == np.uint8
        assert f["x_test"].shape == (3, 32, 32, 3)
        np.testing.assert_array_equal(f["x_train"], np.transpose(x_tr, (3, 0, 1, 2)))
        np.testing.assert_array_equal(f["x_test"], np.transpose(x_te, (3, 0, 1, 2)))
        assert f["x_train"][1, 5, 7, 2] == 201 and f["x_train"][1, 5, 7, 0] == 3
        assert f["y_train"].tolist() == [0, 1, 2, 0, 9] and f["y_test"].tolist() == [3, 0, 4]
    entry = _manifest(data)["svhn"]
    assert entry["file"] == "digits/svhn.npz"
    assert entry["sha256"] == sha256_of(path) and entry["bytes"] == path.stat().st_size
    assert entry["arrays"] == {"x_train": [5, 32, 32, 3], "y_train": [5], "x_test": [3, 32, 32, 3],
                               "y_test": [3]}
    assert "ufldl.stanford.edu/housenumbers/train_32x32.mat" in entry["source"]

    x, y = load_pool("svhn", data_dir=data)
    assert x.shape == (8, 3, 28, 28) and x.dtype == torch.uint8
    assert y.dtype == torch.int64 and y.tolist() == [0, 1, 2, 0, 9, 3, 0, 4]
    for i in (0, 5):  # the constant-colour images (first of train, first of test)
        assert [int(v) for v in x[i].amin(dim=(1, 2))] == list(COLOUR)
        assert [int(v) for v in x[i].amax(dim=(1, 2))] == list(COLOUR)

    _corrupt(path)
    with pytest.raises(DataError, match="Checksum mismatch") as info:
        load_digit_pool("svhn", data)
    assert str(path) in str(info.value)


def test_svhn_label_zero_is_rejected(tmp_path, no_official_md5):
    raw = tmp_path / "raw"
    x = _mat_images(np.random.default_rng(1), 2)
    _write_mat(raw / "train_32x32.mat", x, np.array([[0], [1]], dtype=np.uint8))
    _write_mat(raw / "test_32x32.mat", x, np.array([[1], [2]], dtype=np.uint8))
    with pytest.raises(DataError, match=r"1\.\.10") as info:
        prepare.prepare_svhn(tmp_path / "data", raw_dir=raw, download=False)
    assert "train_32x32.mat" in str(info.value)


def test_svhn_downloaded_from_registry_and_md5_checked(svhn_raw, tmp_path, monkeypatch):
    raw, _, _ = svhn_raw
    with serve_folder(raw) as server:
        for split in ("train", "test"):
            name = f"{split}_32x32.mat"
            monkeypatch.setitem(prepare.SVHN_SOURCES, split,
                                RawFile(server.url(name), name, None, md5_of(raw / name)))
        data = tmp_path / "data"
        prepare.prepare_svhn(data, progress=False)
        assert sorted(e["path"] for e in server.log) == ["/test_32x32.mat", "/train_32x32.mat"]
        assert (data / "raw/svhn/train_32x32.mat").read_bytes() == (raw / "train_32x32.mat").read_bytes()
        x, y = load_digit_pool("svhn", data)
        assert x.shape == (8, 3, 28, 28)

        other = tmp_path / "data2"
        monkeypatch.setitem(prepare.SVHN_SOURCES, "train",
                            RawFile(server.url("train_32x32.mat"), "train_32x32.mat", None, "0" * 32))
        with pytest.raises(DataError, match="expected md5 0{32}"):
            prepare.prepare_svhn(other, progress=False)
        assert not (other / "raw/svhn/train_32x32.mat").exists()
        assert not (other / "raw/svhn/train_32x32.mat.part").exists()


def test_registry_reads_md5_from_torchvision(tmp_path):
    from torchvision.datasets import CIFAR10, SVHN

    assert prepare.SVHN_SOURCES["train"].expected_md5() == SVHN.split_list["train"][2]
    assert prepare.SVHN_SOURCES["test"].expected_md5() == SVHN.split_list["test"][2]
    assert prepare.CIFAR10_SOURCES["archive"].expected_md5() == CIFAR10.tgz_md5
    assert prepare.SVHN_SOURCES["train"].url == SVHN.split_list["train"][0]
    assert prepare.CIFAR10_SOURCES["archive"].url == CIFAR10.url
    assert all(s.url is None and s.expected_md5() is None for s in prepare.SYNTHDIGITS_SOURCES.values())
    # A file that is not the official one is refused before it is parsed.
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "cifar-10-python.tar.gz").write_bytes(b"not the archive")
    with pytest.raises(DataError, match=f"expected md5 {CIFAR10.tgz_md5}"):
        prepare.prepare_cifar10(tmp_path / "data", raw_dir=raw, download=False)


# --- SynthDigits -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "y_train, y_test, expected",
    [
        ([0, 1, 9, 0], [5, 0], [0, 1, 9, 0, 5, 0]),  # SynNumbers: already 0..9, kept
        ([10, 1, 9, 10], [5, 10], [0, 1, 9, 0, 5, 0]),  # SVHN's convention: 10 -> 0
    ],
)
def test_synthdigits_both_label_conventions(tmp_path, y_train, y_test, expected):
    rng = np.random.default_rng(2)
    raw = tmp_path / "raw"
    x_tr, x_te = _mat_images(rng, 4), _mat_images(rng, 2)
    _write_mat(raw / "synth_train_32x32.mat", x_tr, np.array(y_train, dtype=np.float64).reshape(-1, 1))
    _write_mat(raw / "synth_test_32x32.mat", x_te, np.array(y_test, dtype=np.float64).reshape(-1, 1))
    data = tmp_path / "data"
    path = prepare.prepare_synthdigits(data, raw_dir=raw, progress=False)
    assert path == data / "digits/synthdigits.npz"
    with np.load(path) as f:
        np.testing.assert_array_equal(f["x_train"], np.moveaxis(x_tr, 3, 0))
        assert f["x_train"][1, 5, 7, 2] == 201
        assert f["y_train"].dtype == np.uint8
    assert _manifest(data)["synthdigits"]["sha256"] == sha256_of(path)
    x, y = load_pool("synthdigits", data_dir=data)
    assert x.shape == (6, 3, 28, 28) and y.tolist() == expected
    assert [int(v) for v in x[0].amin(dim=(1, 2))] == list(COLOUR)


def test_synthdigits_mat_with_float_pixels_is_read_as_bytes(tmp_path):
    """A SynthDigits .mat whose X is double 0..255 (MATLAB's default type) gives the same uint8 images."""
    rng = np.random.default_rng(7)
    raw = tmp_path / "raw"
    x_tr, x_te = _mat_images(rng, 3), _mat_images(rng, 2)
    _write_mat(raw / "synth_train_32x32.mat", x_tr.astype(np.float64), np.array([[0], [1], [2]], dtype=np.float64))
    _write_mat(raw / "synth_test_32x32.mat", x_te.astype(np.float64), np.array([[3], [4]], dtype=np.float64))
    path = prepare.prepare_synthdigits(tmp_path / "data", raw_dir=raw, progress=False)
    with np.load(path) as f:
        assert f["x_train"].dtype == np.uint8
        np.testing.assert_array_equal(f["x_train"], np.moveaxis(x_tr, 3, 0))
        np.testing.assert_array_equal(f["x_test"], np.moveaxis(x_te, 3, 0))


def test_synthdigits_ambiguous_labels_rejected(tmp_path):
    raw = tmp_path / "raw"
    x = _mat_images(np.random.default_rng(3), 2)
    _write_mat(raw / "synth_train_32x32.mat", x, np.array([[0], [10]], dtype=np.uint8))
    _write_mat(raw / "synth_test_32x32.mat", x, np.array([[1], [2]], dtype=np.uint8))
    with pytest.raises(DataError, match="0..9 or 1..10"):
        prepare.prepare_synthdigits(tmp_path / "data", raw_dir=raw)


def test_synthdigits_missing_files_say_where_to_put_them(tmp_path):
    raw = tmp_path / "nowhere"
    with pytest.raises(DataError) as info:
        prepare.prepare_synthdigits(tmp_path / "data", raw_dir=raw)
    msg = str(info.value)
    assert "synth_train_32x32.mat" in msg and str(raw) in msg and "fedbn" in msg.lower()


def test_not_a_mat_file_is_a_data_error(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "synth_train_32x32.mat").write_bytes(b"garbage" * 50)
    (raw / "synth_test_32x32.mat").write_bytes(b"garbage" * 50)
    with pytest.raises(DataError, match="MATLAB") as info:
        prepare.prepare_synthdigits(tmp_path / "data", raw_dir=raw)
    assert "synth_train_32x32.mat" in str(info.value)


def _write_fedbn(folder, parts, test) -> None:
    (folder / "partitions").mkdir(parents=True)
    for i, pair in enumerate(parts):
        with (folder / "partitions" / f"train_part{i}.pkl").open("wb") as fh:
            pickle.dump(pair, fh, pickle.HIGHEST_PROTOCOL)
    with (folder / "test.pkl").open("wb") as fh:
        pickle.dump(test, fh, pickle.HIGHEST_PROTOCOL)


def test_fedbn_partitions_to_npz(tmp_path):
    rng = np.random.default_rng(4)
    # As med-air/FedBN utils/data_preprocess.py writes them: (images NHWC uint8, int64 labels).
    parts = [(rng.integers(0, 256, (2, 32, 32, 3), dtype=np.uint8), np.array([i, (i + 1) % 10]))
             for i in range(10)]
    parts[3][0][1, 4, 6, 1] = 77
    test = (rng.integers(0, 256, (3, 32, 32, 3), dtype=np.uint8), np.array([7, 8, 9]))
    fedbn = tmp_path / "FedBN/data/SynthDigits"
    _write_fedbn(fedbn, parts, test)
    data = write_data_folder(tmp_path / "data", {"digits/usps.npz": {
        "x_train": np.zeros((2, 16, 16), np.uint8), "y_train": np.array([1, 2], np.uint8),
        "x_test": np.zeros((1, 16, 16), np.uint8), "y_test": np.array([3], np.uint8)}})
    path = prepare.prepare_fedbn_digits("synthdigits", data, fedbn)
    with np.load(path) as f:
        np.testing.assert_array_equal(f["x_train"], np.concatenate([p[0] for p in parts]))
        assert f["x_train"][7, 4, 6, 1] == 77  # partition 3, image 1
        assert f["y_train"].tolist() == [v for i in range(10) for v in (i, (i + 1) % 10)]
        np.testing.assert_array_equal(f["x_test"], test[0])
    manifest = _manifest(data)
    assert set(manifest) == {"usps", "synthdigits"}  # existing entries are kept
    assert "FedBN" in manifest["synthdigits"]["source"]
    x, y = load_digit_pool("synthdigits", data)
    assert x.shape == (23, 3, 28, 28) and y[-3:].tolist() == [7, 8, 9]
    assert load_digit_pool("usps", data)[0].shape == (3, 3, 28, 28)


def test_fedbn_files_keep_their_own_split_in_the_federation(tmp_path):
    """Prepared from FedBN's files, client 0 at percent 0.1 trains on exactly train_part0 and tests on
    test.pkl (the protocol does not re-split the union)."""
    from fednorm.data.federation import build_clients

    rng = np.random.default_rng(6)
    parts = [(rng.integers(0, 256, (8, 32, 32, 3), dtype=np.uint8), rng.integers(0, 10, 8)) for _ in range(10)]
    test = (rng.integers(0, 256, (20, 32, 32, 3), dtype=np.uint8), rng.integers(0, 10, 20))
    fedbn = tmp_path / "FedBN/data/SVHN"
    _write_fedbn(fedbn, parts, test)
    data = tmp_path / "data"
    prepare.prepare_fedbn_digits("svhn", data, fedbn)
    x, y = load_digit_pool("svhn", data)  # 80 training images in partition order, then the 20 test images
    for percent, clients_per_domain in ((0.1, 1), (0.2, 2)):
        clients = build_clients(["svhn"], data_dir=data, percent=percent, pool_size=80,
                                clients_per_domain=clients_per_domain, split_seed=3)
        for j, client in enumerate(clients):
            k = int(percent * 10)  # partitions per client: client j holds parts j*k .. j*k + k - 1
            torch.testing.assert_close(client.train.x, x[8 * j * k : 8 * (j + 1) * k])
            assert client.train.y.tolist() == [int(v) for p in parts[j * k : (j + 1) * k] for v in p[1]]
            torch.testing.assert_close(client.test.x, x[80:])
            assert client.test.y.tolist() == test[1].tolist()
    even = build_clients(["svhn"], data_dir=data, partition="even", percent=1.0, pool_size=80, clients_per_domain=4)
    torch.testing.assert_close(torch.cat([c.train.x for c in even]), x[:80])
    # label skew keeps the stored split too: the clients share FedBN's 80 training images, test on test.pkl
    from fednorm.data.federation import load_domain
    from fednorm.data.partition import label_skew_clients

    loaded = load_domain("svhn", data_dir=data)
    assert loaded.presplit == 80
    skew = label_skew_clients("svhn", x, y, scheme="gamma", num_clients=4, gamma=0.5, seed=3, presplit=loaded.presplit)
    images = sorted(t.numpy().tobytes() for c in skew for t in c.train.x)
    assert images == sorted(t.numpy().tobytes() for t in x[:80])
    assert all(torch.equal(c.test.x, x[80:]) for c in skew)


def test_fedbn_missing_partition_is_named(tmp_path):
    rng = np.random.default_rng(5)
    pair = (rng.integers(0, 256, (1, 32, 32, 3), dtype=np.uint8), np.array([1]))
    fedbn = tmp_path / "SVHN"
    _write_fedbn(fedbn, [pair] * 9, pair)  # train_part9.pkl missing
    with pytest.raises(DataError, match="train_part9.pkl"):
        prepare.prepare_fedbn_digits("svhn", tmp_path / "data", fedbn)


def test_fedbn_files_of_different_image_sizes_are_named(tmp_path):
    rng = np.random.default_rng(7)
    pair = (rng.integers(0, 256, (1, 32, 32, 3), dtype=np.uint8), np.array([1]))
    small = (rng.integers(0, 256, (1, 28, 28, 3), dtype=np.uint8), np.array([2]))
    fedbn = tmp_path / "SVHN"
    _write_fedbn(fedbn, [pair] * 4 + [small] + [pair] * 5, pair)
    with pytest.raises(DataError, match="different image sizes") as info:
        prepare.prepare_fedbn_digits("svhn", tmp_path / "data", fedbn)
    message = str(info.value)
    assert "partitions/train_part4.pkl 28x28x3" in message and "test.pkl 32x32x3" in message
    assert "Get FedBN's data/<Dataset> folder again" in message
    assert not (tmp_path / "data" / "digits/svhn.npz").exists()


def test_fedbn_images_stored_as_whole_valued_floats_are_read_as_bytes(tmp_path):
    """Some redistributions of FedBN's SynthDigits hold float 0..255 images: read as the same uint8 pixels; a
    rescaled copy (fractions) is refused by name rather than truncated."""
    rng = np.random.default_rng(5)
    parts = [(rng.integers(0, 256, (2, 32, 32, 3), dtype=np.uint8), np.array([i, i])) for i in range(10)]
    test = (rng.integers(0, 256, (1, 32, 32, 3), dtype=np.uint8), np.array([4]))
    floats = tmp_path / "float/SynthDigits"
    _write_fedbn(floats, [(x.astype(np.float32), y) for x, y in parts], (test[0].astype(np.float64), test[1]))
    path = prepare.prepare_fedbn_digits("synthdigits", tmp_path / "data", floats)
    with np.load(path) as f:
        assert f["x_train"].dtype == np.uint8
        np.testing.assert_array_equal(f["x_train"], np.concatenate([x for x, _ in parts]))
        np.testing.assert_array_equal(f["x_test"], test[0])
    scaled = tmp_path / "scaled/SynthDigits"
    _write_fedbn(scaled, [(x / 255.0, y) for x, y in parts], test)
    with pytest.raises(DataError, match="not whole pixel values 0..255") as info:
        prepare.prepare_fedbn_digits("synthdigits", tmp_path / "data2", scaled)
    assert "train_part0.pkl" in str(info.value)


# --- CIFAR-10 --------------------------------------------------------------------------------------


def _cifar_archive(path, rng, sizes=(2, 2, 2, 2, 2), n_test=3):
    """A tiny cifar-10-python.tar.gz: pickled dicts with bytes keys, data (N, 3072) uint8 rows of
    1024 red, 1024 green, 1024 blue values."""
    batches = {}
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name, n in zip(names, [*sizes, n_test]):
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, n)]
        batches[name] = {b"batch_label": name.encode(), b"labels": labels, b"data": data,
                         b"filenames": [f"img{i}.png".encode() for i in range(n)]}
    batches["data_batch_2"][b"data"][1, 2 * 1024 + 5 * 32 + 7] = 250  # image 1, blue, row 5, col 7
    batches["data_batch_2"][b"data"][1, 0 * 1024 + 5 * 32 + 7] = 4  # red of the same pixel
    meta = {b"label_names": [c.encode() for c in CIFAR10_CLASSES], b"num_cases_per_batch": 10000}
    with tarfile.open(path, "w:gz") as tar:
        for name, obj in [*batches.items(), ("batches.meta", meta)]:
            blob = pickle.dumps(obj, protocol=2)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    return batches


def test_cifar10_prepare_and_load(tmp_path, no_official_md5):
    raw = tmp_path / "raw"
    raw.mkdir()
    batches = _cifar_archive(raw / "cifar-10-python.tar.gz", np.random.default_rng(6))
    data = tmp_path / "data"
    path = prepare.prepare_cifar10(data, raw_dir=raw, download=False, progress=False)
    assert path == data / "cifar10/cifar10.npz"
    with np.load(path) as f:
        assert f["x_train"].shape == (10, 32, 32, 3) and f["x_test"].shape == (3, 32, 32, 3)
        assert f["x_train"][3, 5, 7, 2] == 250 and f["x_train"][3, 5, 7, 0] == 4
        assert f["classes"].tolist() == list(CIFAR10_CLASSES)
    entry = _manifest(data)["cifar10"]
    assert entry["sha256"] == sha256_of(path) and entry["arrays"]["x_train"] == [10, 32, 32, 3]

    x_tr, y_tr, x_te, y_te = load_cifar10(data)
    assert x_tr.shape == (10, 3, 32, 32) and x_tr.dtype == torch.uint8 and y_tr.dtype == torch.int64
    assert x_te.shape == (3, 3, 32, 32) and y_te.dtype == torch.int64
    assert int(x_tr[3, 2, 5, 7]) == 250 and int(x_tr[3, 0, 5, 7]) == 4
    train_batches = [batches[f"data_batch_{i}"] for i in range(1, 6)]
    expected = np.concatenate([b[b"data"] for b in train_batches]).reshape(-1, 3, 32, 32)
    np.testing.assert_array_equal(x_tr.numpy(), expected)
    assert y_tr.tolist() == [v for b in train_batches for v in b[b"labels"]]
    assert y_te.tolist() == batches["test_batch"][b"labels"]
    # the domains the CIFAR-10 presets federate: cifar10/train is the 50,000 training images, cifar10/test the 10,000
    for domain, (x, y) in (("cifar10/train", (x_tr, y_tr)), ("cifar10/test", (x_te, y_te))):
        pool = load_domain(domain, data_dir=data).pool
        assert torch.equal(pool.x, x) and torch.equal(pool.y, y), domain

    _corrupt(path)
    with pytest.raises(DataError, match="Checksum mismatch") as info:
        load_cifar10(data)
    assert str(path) in str(info.value)


def _py2_str(b: bytes) -> bytes:
    """A Python 2 ``str`` in pickle protocol 2 (SHORT_BINSTRING / BINSTRING), as the official batches hold."""
    return (b"U" + bytes([len(b)]) + b) if len(b) < 256 else (b"T" + len(b).to_bytes(4, "little") + b)


def _py2_cifar_batch(data: np.ndarray, labels: list[int]) -> bytes:
    """One batch as the official cifar-10-python.tar.gz stores it: a Python 2 cPickle (protocol 2) of a dict with
    str keys, numpy's ``_reconstruct`` of a uint8 (N, 3072) array whose bytes are a Python 2 str, and a list of
    int labels (Python 3's pickle cannot write this: its keys would be bytes or unicode objects)."""
    n, width = data.shape
    array = (b"cnumpy.core.multiarray\n_reconstruct\nq\x01cnumpy\nndarray\nq\x02K\x00\x85" + _py2_str(b"b")
             + b"\x87R(K\x01(J" + n.to_bytes(4, "little") + b"J" + width.to_bytes(4, "little") + b"t"
             + b"cnumpy\ndtype\n" + _py2_str(b"u1") + b"K\x00K\x01\x87R(K\x03" + _py2_str(b"|")
             + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb\x89" + _py2_str(data.tobytes()) + b"tb")
    return (b"\x80\x02}q\x00(" + _py2_str(b"data") + array + _py2_str(b"labels") + b"]("
            + b"".join(b"K" + bytes([v]) for v in labels) + b"e" + _py2_str(b"batch_label")
            + _py2_str(b"training batch 1 of 5") + b"u.")


def test_cifar10_batches_pickled_by_python2_as_the_official_archive_are_read(tmp_path, no_official_md5):
    rng = np.random.default_rng(8)
    raw = tmp_path / "raw"
    raw.mkdir()
    batches = _cifar_archive(raw / "cifar-10-python.tar.gz", rng)
    data, labels = rng.integers(0, 256, (4, 3072), dtype=np.uint8), [3, 1, 9, 0]
    with tarfile.open(raw / "cifar-10-python.tar.gz", "r:gz") as old:
        members = {m.name: old.extractfile(m).read() for m in old.getmembers()}
    members["cifar-10-batches-py/data_batch_1"] = _py2_cifar_batch(data, labels)
    with tarfile.open(raw / "cifar-10-python.tar.gz", "w:gz") as tar:
        for name, blob in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    path = prepare.prepare_cifar10(tmp_path / "data", raw_dir=raw, download=False, progress=False)
    with np.load(path) as f:
        np.testing.assert_array_equal(f["x_train"][:4], data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
        assert f["y_train"][:4].tolist() == labels
        assert f["y_train"][4:].tolist() == [v for i in range(2, 6) for v in batches[f"data_batch_{i}"][b"labels"]]


def test_cifar10_archive_missing_batch(tmp_path, no_official_md5):
    raw = tmp_path / "raw"
    raw.mkdir()
    with tarfile.open(raw / "cifar-10-python.tar.gz", "w:gz") as tar:
        blob = pickle.dumps({b"data": np.zeros((1, 3072), np.uint8), b"labels": [0]}, protocol=2)
        info = tarfile.TarInfo("cifar-10-batches-py/data_batch_1")
        info.size = len(blob)
        tar.addfile(info, io.BytesIO(blob))
    with pytest.raises(DataError, match="data_batch_2"):
        prepare.prepare_cifar10(tmp_path / "data", raw_dir=raw, download=False)


@pytest.mark.parametrize("batch, what", [
    ({b"images": np.zeros((1, 3072), np.uint8), b"labels": [0]}, r"lacks 'data' or 'labels' \(it has \['images', 'labels'\]\)"),
    ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [3, 10]}, r"labels 3..10, outside CIFAR-10's 0..9"),
    ([np.zeros((1, 3072), np.uint8)], "a pickled list, not the dict"),
    ({b"data": print, b"labels": [0]}, r"cannot be read \(it names (__builtin__|builtins)\.print, which is not part of a numpy array"),
])
def test_cifar10_batch_not_in_the_official_layout_says_what_to_do(tmp_path, no_official_md5, batch, what):
    raw = tmp_path / "raw"
    raw.mkdir()
    with tarfile.open(raw / "cifar-10-python.tar.gz", "w:gz") as tar:
        blob = pickle.dumps(batch, protocol=2)
        info = tarfile.TarInfo("cifar-10-batches-py/data_batch_1")
        info.size = len(blob)
        tar.addfile(info, io.BytesIO(blob))
    with pytest.raises(DataError, match=what) as info:
        prepare.prepare_cifar10(tmp_path / "data", raw_dir=raw, download=False)
    assert "batch data_batch_1" in str(info.value) and "download cifar-10-python.tar.gz again" in str(info.value)


def test_command_line_prepares_cifar10(tmp_path, no_official_md5):
    from typer.testing import CliRunner

    from fednorm.cli.main import app

    raw = tmp_path / "raw"
    raw.mkdir()
    _cifar_archive(raw / "cifar-10-python.tar.gz", np.random.default_rng(7))
    data = tmp_path / "data"
    runner = CliRunner()
    ok = runner.invoke(app, ["data", "prepare", "cifar10", "--data-dir", str(data), "--raw-dir", str(raw),
                             "--no-download", "--quiet"])
    assert ok.exit_code == 0, ok.output
    assert load_cifar10(data)[0].shape == (10, 3, 32, 32)
    missing = runner.invoke(app, ["data", "prepare", "svhn", "--data-dir", str(data), "--raw-dir",
                                  str(tmp_path / "none"), "--no-download", "--quiet"])
    assert missing.exit_code == 2 and "train_32x32.mat" in missing.output


def test_new_domains_are_registered():
    assert {"svhn", "synthdigits"} <= set(known_domains())


def test_missing_prepared_file_says_how_to_make_it(tmp_path):
    with pytest.raises(DataError, match="fednorm data prepare synthdigits") as info:
        load_pool("synthdigits", data_dir=tmp_path)
    assert str(tmp_path / "digits/synthdigits.npz") in str(info.value)


def test_concurrent_prepares_keep_every_manifest_entry(tmp_path):
    """Two `fednorm data prepare` runs on one folder each add their entry: the manifest's read-modify-write is
    locked, so none is lost (threads here; processes take the same OS lock)."""
    import threading

    arrays = {"x_train": np.zeros((1, 2, 2, 3), np.uint8), "y_train": np.zeros(1, np.uint8)}
    names = [f"set{i}" for i in range(8)]
    start = threading.Barrier(len(names))

    def write(name):
        start.wait()
        prepare.write_dataset_file(tmp_path, f"{name}/{name}.npz", arrays, key=name, source="test")

    threads = [threading.Thread(target=write, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert sorted(manifest) == names and all(manifest[n]["file"] == f"{n}/{n}.npz" for n in names)
