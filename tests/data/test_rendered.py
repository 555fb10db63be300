"""Tests for the procedurally rendered digit benchmark (fednorm.data.rendered)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from fednorm.data.domain import Split
from fednorm.data.rendered import RENDER_STYLES, RenderStyle, _font_path, render_digits, rendered_domain

STYLES = sorted(RENDER_STYLES)


def _digest(x: torch.Tensor) -> str:
    return hashlib.sha256(x.contiguous().numpy().tobytes()).hexdigest()


def _image_stats(x: torch.Tensor) -> torch.Tensor:
    """Per-image (brightness, contrast, saturation, high-frequency energy), all in [0, 1] units."""
    x = x.float() / 255.0
    g = x.mean(1)
    sat = (x.amax(1) - x.amin(1)).mean((1, 2))
    hf = (g[:, 1:, :] - g[:, :-1, :]).abs().mean((1, 2))
    return torch.stack([g.mean((1, 2)), g.flatten(1).std(1), sat, hf], 1)


def test_style_registry():
    assert {"print", "neon", "synth", "street"} <= set(RENDER_STYLES)
    for name, st in RENDER_STYLES.items():
        assert isinstance(st, RenderStyle)
        assert st.description and "\n" not in st.description, name
        assert st.fonts and all(_font_path(f).is_file() for f in st.fonts), name
    with pytest.raises(dataclasses.FrozenInstanceError):
        RENDER_STYLES["print"].rotation = 45.0  # type: ignore[misc]


@pytest.mark.parametrize("style", STYLES)
def test_shape_dtype_range(style):
    s = render_digits(style, 60, seed=3)
    assert isinstance(s, Split)
    assert s.x.shape == (60, 3, 28, 28) and s.x.dtype == torch.uint8
    assert s.y.shape == (60,) and s.y.dtype == torch.int64
    assert int(s.y.min()) >= 0 and int(s.y.max()) <= 9
    # every image has visible structure (no blank or saturated frames)
    std = (s.x.float() / 255.0).flatten(1).std(1)
    assert float(std.min()) > 0.03, f"{style}: near-blank image, std {float(std.min()):.3f}"


def test_other_sizes_and_empty():
    assert render_digits("synth", 7, seed=0, size=32).x.shape == (7, 3, 32, 32)
    assert render_digits("street", 5, seed=0, size=16).x.shape == (5, 3, 16, 16)
    empty = render_digits("print", 0, seed=0)
    assert empty.x.shape == (0, 3, 28, 28) and len(empty) == 0


def test_deterministic_and_seeded():
    a = render_digits("synth", 300, seed=5)
    b = render_digits("synth", 300, seed=5)
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    c = render_digits("synth", 300, seed=6)
    assert not torch.equal(a.y, c.y)
    assert (a.x != c.x).float().mean() > 0.5
    # the same seed in another style is a different stream, not just a recolouring
    assert not torch.equal(a.y, render_digits("print", 300, seed=5).y)


def test_global_rng_untouched():
    torch.manual_seed(123)
    expected = torch.rand(5)
    torch.manual_seed(123)
    render_digits("street", 50, seed=0)
    assert torch.equal(torch.rand(5), expected)


def test_identical_in_fresh_process_with_one_thread():
    code = (
        "import hashlib, torch; torch.set_num_threads(1);"
        "from fednorm.data.rendered import render_digits;"
        "s = render_digits('synth', 600, 11);"
        "print(hashlib.sha256(s.x.numpy().tobytes()).hexdigest(), s.y.tolist()[:20])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(" ", 1)
    s = render_digits("synth", 600, 11)
    assert out[0] == _digest(s.x)
    assert out[1].strip() == str(s.y.tolist()[:20])


def test_written_out_operations_are_torchs_up_to_the_last_bit():
    """Each operation rendering writes out in place of a CPU-dependent torch kernel gives torch's result to
    float32 rounding, and random normals take the same draws from the generator: the images stay those that
    torch's kernels drew (a different stream would give other digits, colours and positions)."""
    from fednorm.data.rendered import _bicubic_resize, _bilinear_sample, _normal

    # below one block of 16, one block, a partial last block, whole blocks
    for seed, shape in enumerate([(7,), (16,), (2, 369, 1), (512, 1, 3, 3)]):
        ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        torch.testing.assert_close(_normal(ours, *shape), torch.randn(*shape, generator=theirs), rtol=0, atol=1e-6)
        assert torch.equal(torch.rand(8, generator=ours), torch.rand(8, generator=theirs))  # the same draws
    g = torch.Generator().manual_seed(0)
    images = torch.rand(20, 1, 64, 64, generator=g)
    gx, gy = torch.rand(2, 20, 28, 28, generator=g) * 3 - 1.5  # partly outside the images: zeros there
    torch.testing.assert_close(_bilinear_sample(images, gx, gy),
                               F.grid_sample(images, torch.stack([gx, gy], -1), align_corners=False), rtol=0, atol=1e-6)
    for size_in, size_out in ((3, 6), (6, 12), (12, 28)):
        x = torch.randn(10, 3, size_in, size_in, generator=g)
        torch.testing.assert_close(_bicubic_resize(x, size_out),
                                   F.interpolate(x, size=(size_out, size_out), mode="bicubic", align_corners=False),
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("kernels", [
    # an AVX2 machine (MKL's, oneDNN's and torch's AVX2 kernels; the same as this process on an AVX2 CPU)
    {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    # torch's plain-C kernels, which ARM CPUs (and x86 ones without AVX2) run, with MKL's oldest code path
    {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ATEN_CPU_CAPABILITY": "default"},
], ids=["avx2", "plain-c"])
def test_same_bytes_with_other_cpu_kernels(kernels):
    """A run resumes on another machine only if rendering gives the same bytes there (resume checks every
    client's sha256). Other CPUs' kernels, forced in a fresh process, must render what this process renders. The
    rendering that used torch's kernels as they are differed, by one grey level: in about one pixel per thousand
    images between AVX2 and AVX-512 (MKL's exp/sin/cos, inverse, products, convolution), up to one pixel per 60,000
    with the plain-C kernels (random normals, grid sampling, bicubic resizing)."""
    code = (
        "import hashlib, torch; torch.set_num_threads(1);"
        "from fednorm.data.rendered import RENDER_STYLES, render_digits;"
        "print(*[hashlib.sha256(render_digits(s, 2000, 0).x.numpy().tobytes()).hexdigest() for s in sorted(RENDER_STYLES)])"
    )
    env = {**os.environ, **kernels}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout.split()
    assert dict(zip(STYLES, out)) == _digests_here()


@functools.lru_cache(maxsize=1)
def _digests_here() -> dict[str, str]:
    """Each style's 2,000 images of seed 0, rendered in this process with this CPU's own kernels."""
    return {s: _digest(render_digits(s, 2000, 0).x) for s in STYLES}


@pytest.mark.parametrize("n", [10, 1003, 2047])
def test_labels_balanced_and_shuffled(n):
    y = render_digits("neon", n, seed=1).y
    counts = torch.bincount(y, minlength=10)
    assert int(counts.sum()) == n
    assert set(counts.tolist()) <= {n // 10, n // 10 + 1}
    assert not torch.equal(y, torch.arange(n) % 10)
    assert not torch.equal(y, y.sort().values)


def test_unknown_style_lists_valid_ones():
    with pytest.raises(ValueError) as err:
        render_digits("mnist", 10, seed=0)
    msg = str(err.value)
    assert "mnist" in msg
    assert all(name in msg for name in RENDER_STYLES)


def test_rendered_domain_matches_render_digits():
    x, y = rendered_domain("street", n=40, seed=2)
    s = render_digits("street", 40, 2)
    assert torch.equal(x, s.x) and torch.equal(y, s.y)


def test_print_is_grey_on_light_neon_is_coloured_on_dark():
    st = {name: _image_stats(render_digits(name, 300, seed=0).x).mean(0) for name in ("print", "neon", "synth")}
    bright, sat = 0, 2
    assert st["print"][bright] > 0.6 and st["neon"][bright] < 0.3
    assert st["print"][sat] < 0.05
    assert st["neon"][sat] > 0.1 and st["synth"][sat] > 0.1
    assert st["neon"][sat] > 3 * st["print"][sat]


def test_every_pair_of_styles_is_distinguishable():
    """A nearest-centroid classifier on four global image statistics tells any two styles apart."""
    tr = {name: _image_stats(render_digits(name, 200, seed=1).x) for name in STYLES}
    te = {name: _image_stats(render_digits(name, 200, seed=2).x) for name in STYLES}
    for a, b in itertools.combinations(STYLES, 2):
        both = torch.cat([tr[a], tr[b]])
        mu, sd = both.mean(0), both.std(0) + 1e-6
        centroids = torch.stack([((tr[a] - mu) / sd).mean(0), ((tr[b] - mu) / sd).mean(0)])
        acc_a = (torch.cdist((te[a] - mu) / sd, centroids).argmin(1) == 0).float().mean()
        acc_b = (torch.cdist((te[b] - mu) / sd, centroids).argmin(1) == 1).float().mean()
        assert (acc_a + acc_b) / 2 > 0.62, f"{a} and {b} look alike ({float((acc_a + acc_b) / 2):.2f})"


def _linear_probe_accuracy(style: str, labels_shuffled: bool = False) -> float:
    """Ridge-regression classifier on standardized grey pixels: fit on 2000 images, score on 1000 others."""
    s = render_digits(style, 3000, seed=0)
    x = s.x.float().mean(1).flatten(1) / 255.0
    y = s.y[torch.randperm(3000, generator=torch.Generator().manual_seed(0))] if labels_shuffled else s.y
    mu, sd = x[:2000].mean(0), x[:2000].std(0) + 1e-3
    z = torch.cat([(x - mu) / sd, torch.ones(3000, 1)], dim=1)
    gram = z[:2000].T @ z[:2000] + 1000.0 * torch.eye(z.shape[1])
    w = torch.linalg.solve(gram, z[:2000].T @ F.one_hot(y[:2000], 10).float())
    return float(((z[2000:] @ w).argmax(1) == y[2000:]).float().mean())


@pytest.mark.parametrize(
    "style,threshold", [("print", 0.6), ("neon", 0.4), ("street", 0.35), ("textured", 0.5), ("outline", 0.6)]
)
def test_labels_match_pictures(style, threshold):
    """A linear probe is far above chance with the true labels and at chance with shuffled ones."""
    assert _linear_probe_accuracy(style) > threshold
    assert _linear_probe_accuracy(style, labels_shuffled=True) < 0.2
