"""Corrupted domains (fednorm.data.corrupt): the 15 corruptions on small images, determinism, the
domain-name scheme, the cache, and corrupted copies of pooled and official-split domains."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fednorm.data import corrupt
from fednorm.data.corrupt import (CORRUPTIONS, UNIFED_TYPES, corrupt_images, corrupt_pool, corruption_domains,
                                  corruption_type_fold)
from fednorm.data.domain import DataError
from fednorm.data.federation import (build_clients, domain_file, image_size, is_rendered, load_domain, num_classes,
                                     parse_domain)

from ..conftest import real_data_dir, write_data_folder


@pytest.fixture(autouse=True)
def tmp_cache(tmp_path, monkeypatch):
    """Never write into the user's cache folder."""
    monkeypatch.setenv(corrupt.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache" / "corrupted"


def _images(n=3, h=28, w=28, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(40, 216, (n, 3, h, w), generator=g, dtype=torch.uint8)
    x[:, :, h // 4: 3 * h // 4, w // 3: w // 2] = 250  # some structure for the blurs to smear
    return x


def test_fifteen_corruptions_in_four_types():
    assert len(CORRUPTIONS) == 15 and len(set(CORRUPTIONS)) == 15
    assert sorted(c for group in corrupt.CORRUPTION_TYPES.values() for c in group) == sorted(CORRUPTIONS)
    assert sorted(c for group in UNIFED_TYPES.values() for c in group) == sorted(CORRUPTIONS)
    assert [len(g) for g in UNIFED_TYPES.values()] == [3, 4, 3, 5]  # UniFed's N1-3, B1-4, W1-3, D1-5
    assert corruption_domains("mnistm", 3)[:2] == ["corrupt/gaussian_noise/3/mnistm", "corrupt/shot_noise/3/mnistm"]


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_every_corruption_works_on_small_images_and_is_deterministic(corruption):
    x = torch.cat([_images(2, 28, 28), _images(1, 28, 28, seed=5)])
    state = np.random.get_state()
    a = corrupt_images(x, corruption, 5, seed=0, base="b")
    assert a.shape == x.shape and a.dtype == torch.uint8
    assert (a.float() - x.float()).abs().mean() > 1.0  # visibly corrupted
    assert torch.equal(a, corrupt_images(x, corruption, 5, seed=0, base="b"))
    # Image i depends only on its own position: corrupting a subset gives the same images.
    assert torch.equal(a[2:], corrupt_images(x[2:], corruption, 5, seed=0, base="b", positions=[2]))
    after = np.random.get_state()
    assert after[0] == state[0] and np.array_equal(after[1], state[1]) and after[2:] == state[2:]
    # Non-square and tiny (16 x 20, upsampled to 32 x 40 and back) and already large enough (36 x 33).
    for h, w in ((16, 20), (36, 33)):
        y = corrupt_images(_images(1, h, w), corruption, 2, seed=1, base="b")
        assert y.shape == (1, 3, h, w)


def test_contrast_is_imagenet_cs_formula_at_each_severity():
    """Contrast is deterministic: per image and channel, (x - mean) * c + mean on [0, 1], with ImageNet-C's
    c = 0.4, 0.3, 0.2, 0.1, 0.05 for severities 1..5 (Hendrycks & Dietterich), truncated back to uint8.
    36 x 33 images need no resizing (at least 32 x 32), so the output is the formula exactly."""
    x = _images(2, 36, 33)
    a = x.permute(0, 2, 3, 1).double().numpy() / 255.0
    mean = a.mean(axis=(1, 2), keepdims=True)
    for severity, c in zip(range(1, 6), [0.4, 0.3, 0.2, 0.1, 0.05]):
        got = corrupt_images(x, "contrast", severity, seed=0, base="b").permute(0, 2, 3, 1).numpy()
        np.testing.assert_array_equal(got, np.uint8(np.clip((a - mean) * c + mean, 0, 1) * 255))


def test_random_corruptions_depend_on_the_seed_and_severity():
    x = _images(2)
    for c in ("gaussian_noise", "impulse_noise", "glass_blur", "frost", "fog", "snow"):
        assert not torch.equal(corrupt_images(x, c, 3, seed=0, base="b"), corrupt_images(x, c, 3, seed=1, base="b"))
    weak = corrupt_images(x, "gaussian_noise", 1, seed=0, base="b")
    strong = corrupt_images(x, "gaussian_noise", 5, seed=0, base="b")
    assert (strong.float() - x.float()).abs().mean() > (weak.float() - x.float()).abs().mean()


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown corruption"):
        corrupt_images(_images(1), "rain", 1, seed=0, base="b")
    with pytest.raises(ValueError, match="1..5"):
        corrupt_images(_images(1), "fog", 6, seed=0, base="b")
    with pytest.raises(ValueError, match="uint8"):
        corrupt_images(_images(1).float(), "fog", 1, seed=0, base="b")


def test_domain_names():
    spec = parse_domain("corrupt/frost/2/pacs/photo")
    assert (spec.corruption, spec.severity, spec.base.name) == ("frost", 2, "pacs/photo")
    assert spec.image_size == 64 and spec.num_classes == 7 and spec.origin == "real"
    assert domain_file("corrupt/fog/1/office_caltech10/amazon@256") == "office_caltech10/amazon_256.npz"
    assert parse_domain("corrupt/fog/1/office_caltech10/amazon@256").official_split
    assert is_rendered("corrupt/snow/4/rendered/print") and not is_rendered("corrupt/snow/4/mnistm")
    assert parse_domain("corrupt/fog/1/corrupt/snow/2/usps").base.base.name == "usps"
    assert num_classes(corruption_domains("cifar10/test", 3)) == 10 and image_size(["corrupt/fog/3/cifar10/test"]) == 32
    with pytest.raises(ValueError, match="mix benchmarks"):
        num_classes(["corrupt/fog/3/mnist", "corrupt/fog/3/pacs/photo"])
    for bad, match in [("corrupt/rain/3/mnist", "unknown corruption 'rain'"), ("corrupt/fog/0/mnist", "1..5"),
                       ("corrupt/fog/3/mnist2", "unknown domain 'mnist2'"), ("corrupt/fog/3", "corrupt/<corruption>"),
                       ("corrupt/fog//mnist", "corrupt/<corruption>")]:
        with pytest.raises(ValueError, match=match):
            parse_domain(bad)


def test_corrupted_rendered_domain_in_a_federation():
    domains = ["rendered/print", "corrupt/contrast/4/rendered/print", "corrupt/gaussian_noise/2/rendered/print"]
    clients = build_clients(domains, data_dir=None, percent=1.0, pool_size=60, rendered_size=100)
    base, contrast, noise = clients
    assert contrast.origin == "rendered" and contrast.name == domains[1]
    assert torch.equal(contrast.train.y, base.train.y) and torch.equal(contrast.test.y, base.test.y)
    assert contrast.train.x.shape == base.train.x.shape
    assert contrast.train.x.float().std() < base.train.x.float().std()  # contrast reduced
    assert not torch.equal(noise.train.x, base.train.x)
    again = build_clients(domains[2:], data_dir=None, percent=1.0, pool_size=60, rendered_size=100)
    assert torch.equal(again[0].train.x, noise.train.x)


def test_cache_is_written_reused_and_keyed(tmp_cache, monkeypatch):
    x = _images(4)
    first = corrupt_pool(x, "fog", 2, seed=0, base="b")
    files = list(tmp_cache.glob("fog_s2_*.npz"))
    assert len(files) == 1

    def fail(*args, **kwargs):
        raise AssertionError("regenerated instead of read from the cache")

    monkeypatch.setattr(corrupt, "corrupt_images", fail)
    assert torch.equal(corrupt_pool(x, "fog", 2, seed=0, base="b"), first)
    for changed in (dict(seed=1, base="b"), dict(seed=0, base="c")):
        with pytest.raises(AssertionError, match="regenerated"):
            corrupt_pool(x, "fog", 2, **changed)
    other = x.clone()
    other[0, 0, 0, 0] ^= 1  # a different base image: a different key
    with pytest.raises(AssertionError, match="regenerated"):
        corrupt_pool(other, "fog", 2, seed=0, base="b")
    files[0].write_bytes(b"damaged")
    monkeypatch.undo()
    monkeypatch.setenv(corrupt.CACHE_ENV, str(tmp_cache.parent))
    assert torch.equal(corrupt_pool(x, "fog", 2, seed=0, base="b"), first)  # a damaged file is regenerated


def test_corrupted_official_split_keeps_train_and_test(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"x_train": rng.integers(0, 256, (6, 32, 32, 3), dtype=np.uint8), "y_train": np.arange(6, dtype=np.uint8),
              "x_test": rng.integers(0, 256, (3, 32, 32, 3), dtype=np.uint8), "y_test": np.arange(3, dtype=np.uint8),
              "classes": np.array(["a"] * 10)}
    folder = write_data_folder(tmp_path / "data", {"office_caltech10/dslr_32.npz": arrays})
    base = load_domain("office_caltech10/dslr@32", data_dir=folder)
    bad = load_domain("corrupt/pixelate/5/office_caltech10/dslr@32", data_dir=folder)
    assert len(bad.train) == 6 and len(bad.test) == 3 and torch.equal(bad.test.y, base.test.y)
    whole = corrupt_images(base.all().x, "pixelate", 5, seed=0, base="office_caltech10/dslr@32")
    assert torch.equal(torch.cat([bad.train.x, bad.test.x]), whole)


def test_missing_package_is_a_clear_error(monkeypatch):
    import sys

    monkeypatch.setattr(corrupt, "_PACKAGE", None)
    monkeypatch.setitem(sys.modules, "imagecorruptions", None)
    with pytest.raises(DataError, match="pip install imagecorruptions"):
        corrupt_images(_images(1), "fog", 1, seed=0, base="b")


@pytest.mark.integration
def test_real_pacs_photos_corrupted():
    folder = real_data_dir()
    base = load_domain("pacs/photo", data_dir=folder)
    bad = load_domain("corrupt/brightness/3/pacs/photo", data_dir=folder)
    assert bad.pool.x.shape == base.pool.x.shape == (1670, 3, 64, 64)
    assert torch.equal(bad.pool.y, base.pool.y)
    assert bad.pool.x.float().mean() > base.pool.x.float().mean()  # brighter


def test_corruption_type_fold_is_unifeds_leave_one_type_out():
    """Each fold: the held-out type's corruptions are external, the other three types' internal, together UniFed's
    15 at the named set and severity (12, 11, 12, 10 internal clients for noise, blur, weather, digital)."""
    sizes = {}
    for held in UNIFED_TYPES:
        internal, external = corruption_type_fold(held, ["corrupt/fog/2/usps"])
        assert external == [f"corrupt/{c}/2/usps" for c in UNIFED_TYPES[held]]
        assert not set(internal) & set(external)
        assert sorted(internal + external) == sorted(f"corrupt/{c}/2/usps" for c in CORRUPTIONS)
        sizes[held] = len(internal)
        released = corruption_type_fold(held, ["cifar10c/snow/4", "cifar10c/fog/4"])
        assert released == ([d.replace("corrupt/", "cifar10c/").replace("/2/usps", "/4") for d in internal],
                            [f"cifar10c/{c}/4" for c in UNIFED_TYPES[held]])
    assert sizes == {"noise": 12, "blur": 11, "weather": 12, "digital": 10}
    with pytest.raises(ValueError, match="unknown corruption type 'rain'"):
        corruption_type_fold("rain", ["corrupt/fog/2/usps"])
    with pytest.raises(ValueError, match="one set at one severity; the domains give usps severity 2, usps severity 3"):
        corruption_type_fold("noise", ["corrupt/fog/2/usps", "corrupt/snow/3/usps"])
    with pytest.raises(ValueError, match="'mnistm' is not one"):
        corruption_type_fold("noise", ["mnistm"])
