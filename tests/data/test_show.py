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


def test_amplitude_figure_rebuilds_each_image_from_its_phase_and_the_domains_averaged_amplitude(tmp_path, monkeypatch):
    """HarmoFL Fig. 8: under each domain's originals, the same images from their own phase and the uniform mean of
    the domains' mean amplitudes (Alg. 1 line 17, Eq. 4)."""
    import matplotlib.pyplot as plt
    import pytest

    from fednorm.data.show import amplitude_figure
    from fednorm.methods.amplitude import amplitude, average_amplitudes, swap_amplitude

    views = [view_domain(d, data_dir=None, rendered_size=120) for d in ("rendered/print", "rendered/neon")]
    drawn = []
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    amplitude_figure(views, tmp_path / "amp.png", images=3, amplitude_images=20, seed=0)
    (fig,) = drawn
    # by hand: each domain's 20 seeded training images on [0, 1], their mean amplitude, the mean of the two
    rng_picks = []
    for view in views:
        n = len(view.splits["train"])
        pick = torch.from_numpy(np.sort(np.random.default_rng(0).permutation(n)[:20]).astype(np.int64))
        rng_picks.append(preview_images(view, "train", pick).double() / 255)
    target = average_amplitudes([amplitude(x).mean(0) for x in rng_picks])
    grid = np.array(fig.axes).reshape(4, 3)
    for d, x in enumerate(rng_picks):
        for j in range(3):
            original = grid[2 * d][j].get_images()[0].get_array()
            normalized = grid[2 * d + 1][j].get_images()[0].get_array()
            np.testing.assert_allclose(original, x[j].permute(1, 2, 0).numpy())
            expected = swap_amplitude(x[j:j + 1], target).clamp(0, 1)[0].permute(1, 2, 0).numpy()
            np.testing.assert_allclose(normalized, expected, atol=1e-12)
            assert not np.allclose(normalized, original, atol=0.02)  # the appearance did change
    from dataclasses import replace

    from fednorm.data.domain import Split

    larger = replace(views[1], splits={"train": Split(torch.zeros(4, 3, 32, 32, dtype=torch.uint8),
                                                      torch.zeros(4, dtype=torch.int64))})
    with pytest.raises(ValueError, match=r"one image shape .*\(3, 28, 28\), \(3, 32, 32\)"):
        amplitude_figure([views[0], larger], tmp_path / "x.png")
