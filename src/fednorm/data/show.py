"""What a domain looks like: image counts per split and class, and a PNG grid of samples.

Backs ``fednorm data show <domain>``. The splits shown are the ones the federation builder starts
from: a domain with official lists (Office-Caltech10, DomainNet) shows its train and test lists; a
pooled domain (digits, PACS, CIFAR-10, rendered) shows the stratified 80/20 split of the FedBN
protocol with the given seed. A corrupted domain is counted from its base, and only the images drawn
in the grid are corrupted (equal to the same images of the whole corrupted pool, see
:mod:`fednorm.data.corrupt`), so a preview does not generate the whole pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .domain import Split
from .federation import DEFAULT_RENDERED_SIZE, DomainSpec, class_names, load_domain, parse_domain
from .protocol import FEDBN_TEST_FRACTION, stratified_split


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
        train_idx, test_idx = stratified_split(loaded.pool.y, FEDBN_TEST_FRACTION, seed)
        splits = {"train": loaded.pool.subset(train_idx), "test": loaded.pool.subset(test_idx)}
        positions = {"train": train_idx, "test": test_idx}
        note = (f"one pool of {len(loaded.pool)} images split 80/20 by class (seed {seed}) as the FedBN protocol "
                "does; clients then take percent of the first pool_size training images")
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
