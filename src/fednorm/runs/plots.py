"""Plots of a run: per-client test accuracy and training loss over rounds, and a method comparison."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from . import store  # noqa: E402


def _series(records: list[dict], split: str, key: str) -> dict[str, tuple[list[int], list[float]]]:
    out: dict[str, tuple[list[int], list[float]]] = {}
    for r in sorted(records, key=lambda r: r["round"]):
        if r["split"] == split and key in r:
            xs, ys = out.setdefault(r["client"], ([], []))
            xs.append(r["round"])
            ys.append(r[key] * (100 if key == "acc" else 1))
    return out


def _score(records: list[dict]) -> str:
    """What the records' ``acc`` holds: accuracy, or Dice for segmentation (their ``metric``)."""
    metric = next((r["metric"] for r in records if "metric" in r), "accuracy")
    return {"dice": "Dice"}.get(metric, metric)


def plot_cell(records: list[dict], cell: Path) -> None:
    """accuracy.png (test accuracy, or Dice for segmentation, per client) and loss.png (training loss per client)
    in ``cell``."""
    for name, split, key, ylabel in (
        ("accuracy.png", "test", "acc", f"test {_score(records)} (%)"),
        ("loss.png", "train", "loss", "training loss (mean over local steps)"),
    ):
        series = _series(records, split, key)
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for client, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=client)
        ax.set_xlabel("round")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(cell / name, dpi=110)
        plt.close(fig)


def plot_comparison(run_dir: Path, cells: list[tuple[str, int]]) -> None:
    """comparison.png: mean-over-clients test accuracy and training loss per method (mean over seeds)."""
    curves: dict[str, dict[str, dict[int, list[float]]]] = {"acc": defaultdict(dict), "loss": defaultdict(dict)}
    score = "accuracy"
    for label, seed in cells:
        records = store.read_metrics(store.cell_dir(run_dir, label, seed) / store.METRICS_FILE)
        score = _score(records)
        for kind, split in (("acc", "test"), ("loss", "train")):
            by_round: dict[int, list[float]] = defaultdict(list)
            for r in records:
                if r["split"] == split and kind in r:
                    by_round[r["round"]].append(r[kind])
            for rnd, vals in by_round.items():
                curves[kind][label].setdefault(rnd, []).append(float(np.mean(vals)))
    if not curves["acc"]:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, kind, ylabel in ((axes[0], "acc", f"mean test {score} over clients (%)"),
                             (axes[1], "loss", "mean training loss over clients")):
        for label, by_round in curves[kind].items():
            rounds = sorted(by_round)
            ys = [np.mean(by_round[r]) * (100 if kind == "acc" else 1) for r in rounds]
            ax.plot(rounds, ys, label=label)
        ax.set_xlabel("round")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(Path(run_dir) / "comparison.png", dpi=110)
    plt.close(fig)
