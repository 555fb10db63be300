"""Real digit pools from a data folder (fednorm.data.digits)."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from PIL import Image

from fednorm.data import digits
from fednorm.data.digits import REAL_DIGIT_DOMAINS, load_digit_pool
from fednorm.data.domain import DataError

from ..conftest import real_data_dir, write_data_folder






def _images(rng, n, *shape):
    return rng.integers(0, 256, size=(n, *shape), dtype=np.uint8)


@pytest.fixture()
def fake_folder(tmp_path):
    """Small files with the real names, keys, dtypes and image sizes."""
    rng = np.random.default_rng(0)
    files = {
        "digits/mnist.npz": {
            "x_train": _images(rng, 5, 28, 28),
            "y_train": np.array([0, 1, 2, 3, 4], dtype=np.uint8),
            "x_test": _images(rng, 3, 28, 28),
            "y_test": np.array([7, 8, 9], dtype=np.uint8),
        },
        "digits/mnistm.npz": {
            "x_train": _images(rng, 4, 32, 32, 3),
            "y_train": np.array([1, 2, 3, 4], dtype=np.uint8),
            "x_test": _images(rng, 2, 32, 32, 3),
            "y_test": np.array([5, 6], dtype=np.uint8),
        },
        "digits/usps.npz": {
            "x_train": _images(rng, 4, 16, 16),
            "y_train": np.array([9, 8, 7, 6], dtype=np.uint8),
            "x_test": _images(rng, 3, 16, 16),
            "y_test": np.array([0, 0, 1], dtype=np.uint8),
        },
        "digits/semeion.npz": {
            "x": (rng.integers(0, 2, size=(5, 16, 16)) * 255).astype(np.uint8),
            "y": np.array([3, 1, 4, 1, 5], dtype=np.uint8),
        },
    }
    return write_data_folder(tmp_path, files), files


def _pil_resize(img: np.ndarray) -> np.ndarray:
    """What the official code's torchvision Resize([28, 28]) gives on a PIL image."""
    mode = "L" if img.ndim == 2 else "RGB"
    return np.asarray(Image.fromarray(img, mode=mode).resize((28, 28), Image.BILINEAR))


def test_mnist_grey_replicated_and_union_order(fake_folder):
    root, files = fake_folder
    x, y = load_digit_pool("mnist", root)
    src = files["digits/mnist.npz"]
    assert x.shape == (8, 3, 28, 28) and x.dtype == torch.uint8
    assert y.dtype == torch.int64
    assert y.tolist() == [0, 1, 2, 3, 4, 7, 8, 9]  # train first, then test
    expected = np.concatenate([src["x_train"], src["x_test"]])
    for c in range(3):  # 28 x 28 already: no resize, the grey image in every channel
        np.testing.assert_array_equal(x[:, c].numpy(), expected)


def test_usps_resized_once_like_pil(fake_folder):
    root, files = fake_folder
    x, y = load_digit_pool("usps", root)
    src = files["digits/usps.npz"]
    assert x.shape == (7, 3, 28, 28) and x.dtype == torch.uint8
    assert y.tolist() == [9, 8, 7, 6, 0, 0, 1]
    assert torch.equal(x[:, 0], x[:, 1]) and torch.equal(x[:, 0], x[:, 2])
    expected = np.stack([_pil_resize(a) for a in np.concatenate([src["x_train"], src["x_test"]])])
    diff = np.abs(x[:, 0].numpy().astype(int) - expected.astype(int))
    assert diff.max() <= 1  # bilinear + antialias on tensors vs PIL: at most one grey level


def test_mnistm_rgb_resized_channels_kept(fake_folder):
    root, files = fake_folder
    x, y = load_digit_pool("mnistm", root)
    src = files["digits/mnistm.npz"]
    assert x.shape == (6, 3, 28, 28)
    assert y.tolist() == [1, 2, 3, 4, 5, 6]
    expected = np.stack([_pil_resize(a) for a in np.concatenate([src["x_train"], src["x_test"]])])
    got = x.permute(0, 2, 3, 1).numpy().astype(int)
    assert np.abs(got - expected.astype(int)).max() <= 1
    assert not torch.equal(x[:, 0], x[:, 1])  # colour is not collapsed to grey


def test_mnistm_constant_colour_survives_resize(tmp_path):
    img = np.zeros((1, 32, 32, 3), dtype=np.uint8)
    img[..., 0], img[..., 1], img[..., 2] = 200, 10, 255
    root = write_data_folder(
        tmp_path,
        {
            "digits/mnistm.npz": {
                "x_train": img,
                "y_train": np.array([2], dtype=np.uint8),
                "x_test": img[:0],
                "y_test": np.zeros(0, dtype=np.uint8),
            }
        },
    )
    x, _ = load_digit_pool("mnistm", root)
    assert x.shape == (1, 3, 28, 28)
    assert [int(v) for v in x[0].amin(dim=(1, 2))] == [200, 10, 255]
    assert [int(v) for v in x[0].amax(dim=(1, 2))] == [200, 10, 255]


def test_semeion_single_set(fake_folder):
    root, files = fake_folder
    x, y = load_digit_pool("semeion", root)
    assert x.shape == (5, 3, 28, 28) and x.dtype == torch.uint8
    assert y.tolist() == [3, 1, 4, 1, 5]
    expected = np.stack([_pil_resize(a) for a in files["digits/semeion.npz"]["x"]])
    assert np.abs(x[:, 2].numpy().astype(int) - expected.astype(int)).max() <= 1


def test_chunking_does_not_change_result(fake_folder, monkeypatch):
    root, _ = fake_folder
    x_one_chunk, _ = load_digit_pool("usps", root)
    monkeypatch.setattr(digits, "_CHUNK", 2)  # chunks split both the train and the test arrays
    x_chunked, _ = load_digit_pool("usps", root)
    assert torch.equal(x_one_chunk, x_chunked)


def test_unknown_domain_lists_valid_names(tmp_path):
    with pytest.raises(ValueError) as info:
        load_digit_pool("notadomain", tmp_path)
    for name in REAL_DIGIT_DOMAINS:
        assert name in str(info.value)


def test_corrupt_file_fails_with_data_error(fake_folder):
    root, _ = fake_folder
    path = root / "digits/usps.npz"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match="Checksum mismatch") as info:
        load_digit_pool("usps", root)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    "arrays, match",
    [
        ({"x": np.zeros((2, 16, 16), np.uint8), "y": np.array([1, 10], np.uint8)}, "outside 0..9"),
        ({"x": np.zeros((2, 16, 16), np.float32), "y": np.array([1, 2], np.uint8)}, "uint8"),
        ({"x": np.zeros((2, 16, 16), np.uint8), "y": np.array([1, 2, 3], np.uint8)}, "one label"),
        ({"x": np.zeros((2, 16, 16), np.uint8)}, r"\['y'\]"),
    ],
)
def test_malformed_file_is_rejected(tmp_path, arrays, match):
    root = write_data_folder(tmp_path, {"digits/semeion.npz": arrays})
    with pytest.raises(DataError, match=match) as info:
        load_digit_pool("semeion", root)
    assert str(root / "digits/semeion.npz") in str(info.value)


# --- real data -------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize(
    "name, size", [("mnist", 70000), ("mnistm", 18000), ("usps", 9298), ("semeion", 1593)]
)
def test_real_pool_sizes(name, size):
    x, y = load_digit_pool(name, real_data_dir())
    assert x.shape == (size, 3, 28, 28) and x.dtype == torch.uint8
    assert y.shape == (size,) and y.dtype == torch.int64
    assert torch.bincount(y, minlength=10).min() > 0 and int(y.max()) == 9


@pytest.mark.integration
def test_real_usps_union_order():
    root = real_data_dir()
    x, y = load_digit_pool("usps", root)
    with np.load(root / "digits/usps.npz") as f:
        first, last = f["x_train"][0], f["x_test"][-1]
        y_all = np.concatenate([f["y_train"], f["y_test"]])
    assert y.tolist() == y_all.tolist()
    assert np.abs(x[0, 0].numpy().astype(int) - _pil_resize(first).astype(int)).max() <= 1
    assert np.abs(x[-1, 1].numpy().astype(int) - _pil_resize(last).astype(int)).max() <= 1
