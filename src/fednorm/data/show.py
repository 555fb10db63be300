"""What a domain looks like: image counts per split and class, a PNG grid of samples, and pixel histograms.

Backs ``fednorm data show <domain> [<domain> ...]``. Besides each domain's sample grid, the pixel
histograms of all the domains named are drawn on one figure (as FedBN's Fig. 6 (b), "over random
100 samples for each dataset"): one panel per channel (red, green, blue), one curve per domain,
the fraction of pixels at each intensity 0..255 over a seeded random sample of the domain's
training images (:func:`pixel_histogram`, :func:`histogram_figure`).

The splits shown are the ones the federation builder starts from: a domain with official lists
(Office-Caltech10, DomainNet) shows its train and test lists; a pooled domain (digits, PACS,
CIFAR-10, rendered) shows the stratified 80/20 split of the FedBN protocol with the given seed. A
corrupted domain is counted from its base, and only the images drawn in the grid or the histogram
sample are corrupted (equal to the same images of the whole corrupted pool, see
:mod:`fednorm.data.corrupt`), so a preview does not generate the whole pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..figures import pyplot, save_figure
from .domain import Split
from .federation import DEFAULT_RENDERED_SIZE, DomainSpec, class_names, load_domain, parse_domain
from .protocol import pool_split


@dataclass(frozen=True)
class DomainView:
    """A domain's splits (base images for a corrupted domain) with each image's position in the pool."""

    spec: DomainSpec
    classes: tuple[str, ...]
    splits: dict[str, Split]
    positions: dict[str, torch.Tensor]  # index of each split image in the domain's whole pool
    note: str

    @property
    def counts(self) -> dict[str, list[int]]:
        """``counts[split][label]``: images per class in each split."""
        return {name: torch.bincount(s.y, minlength=len(self.classes)).tolist() for name, s in self.splits.items()}


def _root(spec: DomainSpec) -> DomainSpec:
    while spec.base is not None:
        spec = spec.base
    return spec


def view_domain(domain: str, *, data_dir: Path | None, seed: int = 0,
                rendered_size: int = DEFAULT_RENDERED_SIZE) -> DomainView:
    """The splits of ``domain`` as the federation builder sees them (uncorrupted for a corrupted domain)."""
    spec = parse_domain(domain)
    if spec.task != "classification":
        raise ValueError(f"{domain!r} holds {'segmentation masks' if spec.task == 'segmentation' else 'feature vectors'}"
                         "; `data show` counts and draws labelled images only")
    loaded = load_domain(_root(spec).name, data_dir=data_dir, rendered_size=rendered_size, seed=seed)
    if spec.medical:
        splits = {name: s for name, s in (("train", loaded.train), ("val", loaded.val), ("test", loaded.test))
                  if s is not None}
        positions = {name: torch.arange(len(s)) for name, s in splits.items()}
        note = f"the loader's own splits: {loaded.description}"
    elif loaded.pool is not None:
        train_idx, test_idx = pool_split(loaded.pool.y, seed, loaded.presplit)
        splits = {"train": loaded.pool.subset(train_idx), "test": loaded.pool.subset(test_idx)}
        positions = {"train": train_idx, "test": test_idx}
        note = (f"one pool of {len(loaded.pool)} images split 80/20 by class (seed {seed}) as the FedBN protocol "
                "does; clients then take percent of the first pool_size training images")
        if loaded.presplit is not None:
            note = (f"FedBN's own files: its {loaded.presplit} training images in partition order and its test "
                    "split, kept as stored; clients take percent of the first pool_size training images")
    else:
        n = len(loaded.train)
        splits = {"train": loaded.train, "test": loaded.test}
        positions = {"train": torch.arange(n), "test": n + torch.arange(len(loaded.test))}
        note = "FedBN's fixed train/test lists; clients train on a prefix of train and validate on its end"
    if spec.corruption:
        note += f"; corrupted with {spec.corruption}, severity {spec.severity}, seed {seed}"
    return DomainView(spec, class_names(domain), splits, positions, note)


def preview_images(view: DomainView, split: str, index: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Images ``index`` of ``split``, corrupted as in the whole corrupted domain (nested: innermost first)."""
    x = view.splits[split].x[index]
    chain = []
    spec = view.spec
    while spec.base is not None:
        chain.append(spec)
        spec = spec.base
    if chain:
        from .corrupt import corrupt_images

        positions = view.positions[split][index].tolist()
        for layer in reversed(chain):
            x = corrupt_images(x, layer.corruption, layer.severity, seed=seed, base=layer.base.name,
                               positions=positions)
    return x


def sample_grid(view: DomainView, out: Path, *, per_class: int = 8, seed: int = 0) -> Path:
    """Write a PNG grid of ``view``'s training images (one row per class, ``per_class`` each) to ``out``."""
    plt = pyplot()

    split = "train" if len(view.splits["train"]) else "test"
    labels = view.splits[split].y.numpy()
    rng = np.random.default_rng(seed)
    rows = [np.sort(rng.permutation(np.flatnonzero(labels == c))[:per_class]) for c in range(len(view.classes))]
    chosen = torch.from_numpy(np.concatenate(rows).astype(np.int64))
    images = preview_images(view, split, chosen, seed)
    side = 1.0
    fig, axes = plt.subplots(len(view.classes), per_class, squeeze=False,
                             figsize=(per_class * side + 1.5, len(view.classes) * side + 0.5))
    k = 0
    for r, (name, idx) in enumerate(zip(view.classes, rows)):
        for c in range(per_class):
            ax = axes[r][c]
            ax.set_xticks([])
            ax.set_yticks([])
            for spine in ax.spines.values():
                spine.set_visible(False)
            if c < len(idx):
                ax.imshow(images[k].permute(1, 2, 0).numpy(), interpolation="nearest")
                k += 1
        axes[r][0].set_ylabel(name, rotation=0, ha="right", va="center", fontsize=8)
    fig.suptitle(f"{view.spec.name} ({split}, {view.spec.image_size} x {view.spec.image_size})", fontsize=10)
    return save_figure(fig, out, dpi=100)


# --- pixel histograms (FedBN Fig. 6 (b)) -----------------------------------------------------------

# FedBN's Fig. 6 (b) draws its histograms "over random 100 samples for each dataset".
HIST_IMAGES = 100
CHANNEL_NAMES = {1: ("intensity",), 3: ("red", "green", "blue")}


@dataclass(frozen=True)
class PixelHistogram:
    """``fractions[c, v]``: the fraction of channel ``c``'s pixels with value ``v`` (0..255) over
    ``images`` images of ``split`` of ``domain`` (each row sums to 1)."""

    domain: str
    split: str
    images: int
    fractions: np.ndarray  # (C, 256) float64


def _shown_split(view: DomainView) -> str:
    return "train" if len(view.splits["train"]) else "test"


def pixel_histogram(view: DomainView, *, max_images: int | None = HIST_IMAGES, seed: int = 0,
                    split: str | None = None) -> PixelHistogram:
    """The per-channel intensity histogram of a seeded random sample of ``max_images`` images
    (None or 0: all) of ``split`` (default: train, the split of the sample grid; test if train is
    empty). A corrupted domain is histogrammed after corruption, image by image as in its pool."""
    split = split or _shown_split(view)
    if split not in view.splits:
        raise ValueError(f"{view.spec.name!r} has no split {split!r}; it has {', '.join(view.splits)}")
    n = len(view.splits[split])
    if n == 0:
        raise ValueError(f"{view.spec.name!r}: the {split} split is empty, nothing to histogram")
    if max_images is not None and max_images < 0:
        raise ValueError(f"max_images must be >= 0 (0 or None: all images), got {max_images}")
    take = n if not max_images else min(max_images, n)
    order = np.random.default_rng(seed).permutation(n)[:take] if take < n else np.arange(n)
    chosen = torch.from_numpy(np.sort(order).astype(np.int64))
    counts = None
    for start in range(0, take, 256):  # chunks bound the int64 copies bincount needs
        x = preview_images(view, split, chosen[start:start + 256], seed)
        part = torch.stack([torch.bincount(x[:, c].reshape(-1).long(), minlength=256)
                            for c in range(x.shape[1])])
        counts = part if counts is None else counts + part
    counts = counts.double().numpy()
    return PixelHistogram(view.spec.name, split, take, counts / counts.sum(axis=1, keepdims=True))


def histogram_figure(hists: list[PixelHistogram], out: Path, *, log: bool = True) -> Path:
    """Write one PNG with a panel per channel and a curve per domain (FedBN's Fig. 6 (b)).

    A one-channel (grey) domain next to colour domains is drawn in every panel, as its image would
    be shown in colour. ``log``: logarithmic y axis, the default because the background spike of
    digit images (about 80 % of MNIST's pixels are 0) flattens every other curve on a linear one."""
    if not hists:
        raise ValueError("no histogram to draw")
    plt = pyplot()

    channels = max(h.fractions.shape[0] for h in hists)
    names = CHANNEL_NAMES.get(channels, tuple(f"channel {c}" for c in range(channels)))
    fig, axes = plt.subplots(1, channels, squeeze=False, sharey=True, figsize=(4.2 * channels + 0.6, 3.4))
    values = np.arange(256)
    for c, ax in enumerate(axes[0]):
        for h in hists:
            row = h.fractions[c if h.fractions.shape[0] > 1 else 0]
            ax.plot(values, row, drawstyle="steps-mid", linewidth=1.0, label=f"{h.domain} ({h.images})")
        ax.set_title(names[c], fontsize=10)
        ax.set_xlim(0, 255)
        ax.set_xlabel("pixel value")
        if log:
            ax.set_yscale("log")
    axes[0][0].set_ylabel("fraction of pixels")
    axes[0][-1].legend(fontsize=7, loc="upper right", title="domain (images)", title_fontsize=7)
    splits = sorted({h.split for h in hists})
    fig.suptitle(f"pixel histograms per channel, random {'/'.join(splits)} images of each domain", fontsize=10)
    return save_figure(fig, out, dpi=100)


def _slug(domain: str) -> str:
    return domain.replace("/", "_").replace("@", "_")


def output_paths(domains: list[str], out: Path | None = None) -> tuple[list[Path], Path]:
    """Where ``fednorm data show`` writes each domain's sample grid and the histogram figure.

    One domain: the grid at ``out`` (default ``<domain>.png``), the histograms next to it at
    ``<stem>_hist.png``. Several: each grid at ``<stem>_<domain>.png`` with ``out`` given, else at
    ``<domain>.png``; the shared histograms at ``<stem>_hist.png``, the default stem joining the
    domain names (``mnist_svhn_hist.png``; ``domains_hist.png`` when that is too long)."""
    if not domains:
        raise ValueError("name at least one domain")
    if len(set(domains)) != len(domains):
        raise ValueError(f"a domain is named twice: {domains}")
    if len(domains) == 1:
        grid = Path(out) if out is not None else Path(_slug(domains[0]) + ".png")
        return [grid], grid.with_name(grid.stem + "_hist.png")
    if out is not None:
        out = Path(out)
        return [out.with_name(f"{out.stem}_{_slug(d)}.png") for d in domains], out.with_name(out.stem + "_hist.png")
    stem = "_".join(_slug(d) for d in domains)
    if len(stem) > 120:
        stem = "domains"
    return [Path(_slug(d) + ".png") for d in domains], Path(stem + "_hist.png")


def amplitude_figure(views: list[DomainView], out: Path, *, images: int = 6, amplitude_images: int = HIST_IMAGES,
                     seed: int = 0) -> Path:
    """HarmoFL Fig. 8: ``images`` training images of each domain as they are (top row) and after amplitude
    normalization (bottom row): each image rebuilt from its own phase and the domains' averaged amplitude (Eq. 4,
    full spectrum), that amplitude being the uniform mean (Alg. 1 line 17) of each domain's mean amplitude over a
    seeded sample of ``amplitude_images`` of its training images, on [0, 1] pixels (HarmoFL's ToTensor input).
    The rebuilt images leave [0, 1] a little; they are clipped for display only."""
    from ..methods.amplitude import amplitude, average_amplitudes, swap_amplitude

    if not views:
        raise ValueError("name at least one domain")
    shapes = {tuple(v.splits[_shown_split(v)].x.shape[1:]) for v in views}
    if len(shapes) > 1:
        raise ValueError(f"amplitude normalization needs one image shape (C x H x W) across the domains shown, got "
                         f"{', '.join(str(s) for s in sorted(shapes))}")
    shown, means = [], []
    for view in views:
        split = _shown_split(view)
        n = len(view.splits[split])
        rng = np.random.default_rng(seed)
        sample = torch.from_numpy(np.sort(rng.permutation(n)[:min(n, amplitude_images or n)]).astype(np.int64))
        means.append(amplitude(preview_images(view, split, sample, seed).double() / 255).mean(0))
        shown.append(preview_images(view, split, sample[:images], seed).double() / 255)
    target = average_amplitudes(means)
    plt = pyplot()
    cols = max(len(x) for x in shown)
    fig, axes = plt.subplots(2 * len(views), cols, figsize=(1.3 * cols, 2.8 * len(views)), squeeze=False)
    for d, (view, x) in enumerate(zip(views, shown)):
        for row, images_ in ((2 * d, x), (2 * d + 1, swap_amplitude(x, target).clamp(0, 1))):
            for j in range(cols):
                ax = axes[row][j]
                ax.axis("off")
                if j < len(images_):
                    img = images_[j].permute(1, 2, 0).numpy()
                    ax.imshow(img[..., 0] if img.shape[-1] == 1 else img, cmap="gray" if img.shape[-1] == 1 else None,
                              vmin=0, vmax=1)
            axes[row][0].set_title(f"{view.spec.name}: {'original' if row == 2 * d else 'AmpNorm'}", fontsize=8,
                                   loc="left")
    fig.suptitle("HarmoFL amplitude normalization with the domains' averaged amplitude (Fig. 8)", fontsize=10)
    return save_figure(fig, out, dpi=100)
