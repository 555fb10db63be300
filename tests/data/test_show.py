"""``fednorm data show`` internals: counts per split and class, and the sample grid."""

from __future__ import annotations

import numpy as np
import torch

from fednorm.data.corrupt import CACHE_ENV
from fednorm.data.federation import load_domain
from fednorm.data.show import preview_images, sample_grid, view_domain

from ..conftest import write_data_folder


def test_pooled_domain_counts_follow_the_protocol_split(tmp_path):
    view = view_domain("rendered/neon", data_dir=None, rendered_size=200)
    counts = view.counts
    assert sum(counts["train"]) == 160 and sum(counts["test"]) == 40
    assert counts["test"] == [4] * 10 and view.classes[3] == "3"
    png = sample_grid(view, tmp_path / "grid.png", per_class=3)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_corrupted_preview_equals_the_whole_corrupted_pool(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    name = "corrupt/gaussian_noise/3/corrupt/zoom_blur/1/rendered/print"
    view = view_domain(name, data_dir=None, rendered_size=100)
    whole = load_domain(name, data_dir=None, rendered_size=100).pool
    pick = torch.tensor([0, 5, 17])
    preview = preview_images(view, "train", pick)
    assert torch.equal(preview, whole.x[view.positions["train"][pick]])
    assert "gaussian_noise" in view.note
    sample_grid(view, tmp_path / "noisy.png", per_class=2)


def test_official_split_counts(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"x_train": rng.integers(0, 256, (7, 16, 16, 3), dtype=np.uint8),
              "y_train": np.array([0, 0, 1, 2, 2, 2, 9], np.uint8),
              "x_test": rng.integers(0, 256, (2, 16, 16, 3), dtype=np.uint8), "y_test": np.array([9, 1], np.uint8)}
    folder = write_data_folder(tmp_path / "data", {"domainnet/sketch_16.npz": arrays})
    view = view_domain("domainnet/sketch@16", data_dir=folder)
    assert view.counts == {"train": [2, 1, 3, 0, 0, 0, 0, 0, 0, 1], "test": [0, 1, 0, 0, 0, 0, 0, 0, 0, 1]}
    assert view.classes[9] == "zebra" and "lists" in view.note
    sample_grid(view, tmp_path / "sketch.png")
