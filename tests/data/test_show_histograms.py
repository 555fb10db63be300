"""``fednorm data show`` pixel histograms (FedBN Fig. 6 (b)): exact per-channel fractions, the seeded
sample of images, corrupted domains, the figure and where the files go."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fednorm.data.corrupt import CACHE_ENV
from fednorm.data.federation import load_domain
from fednorm.data.show import (HIST_IMAGES, PixelHistogram, histogram_figure, output_paths, pixel_histogram,
                               view_domain)

from ..conftest import write_data_folder

PNG = b"\x89PNG\r\n\x1a\n"


def _object_folder(root: Path) -> Path:
    """domainnet/sketch_16.npz whose training images have known pixel values per channel."""
    x_train = np.zeros((4, 16, 16, 3), np.uint8)
    x_train[..., 0] = 10                 # red: every pixel 10
    x_train[..., 1] = 200                # green: every pixel 200 ...
    x_train[:2, :8, :, 1] = 20           # ... but the top half of images 0 and 1 is 20
    x_train[..., 2] = np.arange(16, dtype=np.uint8)[None, None, :]  # blue: columns 0..15
    arrays = {"x_train": x_train, "y_train": np.array([0, 1, 2, 3], np.uint8),
              "x_test": np.full((2, 16, 16, 3), 255, np.uint8), "y_test": np.array([0, 1], np.uint8)}
    return write_data_folder(root, {"domainnet/sketch_16.npz": arrays})


def test_pixel_histogram_counts_every_pixel_of_every_channel(tmp_path):
    view = view_domain("domainnet/sketch@16", data_dir=_object_folder(tmp_path / "data"))
    h = pixel_histogram(view, max_images=0)
    assert isinstance(h, PixelHistogram) and (h.domain, h.split, h.images) == ("domainnet/sketch@16", "train", 4)
    assert h.fractions.shape == (3, 256) and np.allclose(h.fractions.sum(axis=1), 1.0)
    assert h.fractions[0, 10] == 1.0
    # green: 2 images x half their pixels at 20, the rest at 200
    assert h.fractions[1, 20] == pytest.approx(0.25) and h.fractions[1, 200] == pytest.approx(0.75)
    assert np.allclose(h.fractions[2, :16], 1 / 16) and h.fractions[2, 16:].sum() == 0
    test = pixel_histogram(view, split="test")
    assert (test.split, test.images, test.fractions[:, 255].tolist()) == ("test", 2, [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="no split 'val'"):
        pixel_histogram(view, split="val")
    with pytest.raises(ValueError, match="max_images must be >= 0"):
        pixel_histogram(view, max_images=-1)


def test_pixel_histogram_draws_a_seeded_sample_of_the_training_split():
    view = view_domain("rendered/neon", data_dir=None, rendered_size=300)
    assert HIST_IMAGES == 100  # FedBN Fig. 6: "over random 100 samples for each dataset"
    a = pixel_histogram(view, seed=3)
    assert (a.split, a.images) == ("train", 100)
    # the sample: the first 100 of NumPy's seeded permutation of the 240 training images, every pixel counted
    pick = torch.from_numpy(np.random.default_rng(3).permutation(240)[:100])
    sample = view.splits["train"].x[pick]
    counts = np.stack([np.bincount(sample[:, c].reshape(-1).numpy(), minlength=256) for c in range(3)])
    assert np.allclose(a.fractions, counts / counts.sum(axis=1, keepdims=True), rtol=0, atol=1e-12)
    assert np.array_equal(a.fractions, pixel_histogram(view, seed=3).fractions)
    assert not np.array_equal(a.fractions, pixel_histogram(view, seed=4).fractions)
    whole = pixel_histogram(view, max_images=None)
    assert whole.images == len(view.splits["train"]) == 240
    # more images than the split holds: all of them
    assert np.array_equal(pixel_histogram(view, max_images=10_000).fractions, whole.fractions)
    # the whole split, counted directly
    x = view.splits["train"].x
    direct = np.stack([np.bincount(x[:, c].reshape(-1).numpy(), minlength=256) for c in range(3)])
    assert np.allclose(whole.fractions, direct / direct.sum(axis=1, keepdims=True))


def test_corrupted_domain_is_histogrammed_after_corruption(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    name = "corrupt/brightness/5/rendered/print"
    view = view_domain(name, data_dir=None, rendered_size=60)
    h = pixel_histogram(view, max_images=0)
    pool = load_domain(name, data_dir=None, rendered_size=60).pool
    x = pool.x[view.positions["train"]]
    direct = np.stack([np.bincount(x[:, c].reshape(-1).numpy(), minlength=256) for c in range(3)])
    assert np.allclose(h.fractions, direct / direct.sum(axis=1, keepdims=True))
    clean = pixel_histogram(view_domain("rendered/print", data_dir=None, rendered_size=60), max_images=0)
    brighter = (h.fractions * np.arange(256)).sum(axis=1) > (clean.fractions * np.arange(256)).sum(axis=1)
    assert brighter.all()


def test_histogram_figure_draws_colour_and_grey_domains(tmp_path):
    colour = PixelHistogram("a", "train", 5, np.full((3, 256), 1 / 256))
    grey = PixelHistogram("b", "train", 7, np.eye(1, 256, 40))
    out = histogram_figure([colour, grey], tmp_path / "sub" / "h.png")
    assert out == tmp_path / "sub" / "h.png" and out.read_bytes()[:8] == PNG
    assert histogram_figure([grey], tmp_path / "grey.png", log=False).read_bytes()[:8] == PNG
    with pytest.raises(ValueError, match="no histogram"):
        histogram_figure([], tmp_path / "none.png")


def test_output_paths_put_the_histograms_next_to_the_grids():
    assert output_paths(["mnist"]) == ([Path("mnist.png")], Path("mnist_hist.png"))
    assert output_paths(["pacs/photo"], Path("out/p.png")) == ([Path("out/p.png")], Path("out/p_hist.png"))
    grids, hist = output_paths(["mnist", "office_caltech10/amazon@256"])
    assert grids == [Path("mnist.png"), Path("office_caltech10_amazon_256.png")]
    assert hist == Path("mnist_office_caltech10_amazon_256_hist.png")
    grids, hist = output_paths(["mnist", "usps"], Path("figs/digits.png"))
    assert grids == [Path("figs/digits_mnist.png"), Path("figs/digits_usps.png")] and hist == Path("figs/digits_hist.png")
    many = [f"corrupt/{c}/5/pacs/photo" for c in ("fog", "frost", "snow", "contrast", "pixelate", "zoom_blur")]
    assert output_paths(many)[1] == Path("domains_hist.png")
    with pytest.raises(ValueError, match="named twice"):
        output_paths(["mnist", "mnist"])
    with pytest.raises(ValueError, match="at least one"):
        output_paths([])


def test_one_channel_images_get_one_histogram_row(tmp_path):
    from fednorm.data.domain import Split
    from fednorm.data.show import DomainView

    spec = view_domain("rendered/print", data_dir=None, rendered_size=50).spec
    x = torch.zeros(3, 1, 4, 4, dtype=torch.uint8)
    x[0] = 255
    view = DomainView(spec, tuple("0123456789"), {"train": Split(x, torch.zeros(3, dtype=torch.long))},
                      {"train": torch.arange(3)}, "")
    h = pixel_histogram(view, max_images=0)
    assert h.fractions.shape == (1, 256) and h.fractions[0, 0] == pytest.approx(2 / 3)
    assert h.fractions[0, 255] == pytest.approx(1 / 3)
