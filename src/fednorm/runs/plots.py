"""Plots of a run: per-client test accuracy and training loss over rounds, and a method comparison."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

from ..figures import pyplot, save_figure
from ..methods.tasks import metric_label
from . import store

plt = pyplot()


MAX_LEGEND_CLIENTS = 20  # more clients than this: thin unlabelled lines and their mean


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
    return metric_label(metric)


def plot_cell(records: list[dict], cell: Path) -> None:
    """accuracy.png (test accuracy, or Dice for segmentation, per client) and loss.png (training loss per client)
    in ``cell``; with the run's diagnostics, drift.png (client drift per round) and dissimilarity.png."""
    for name, split, key, ylabel in (
        ("accuracy.png", "test", "acc", f"test {_score(records)} (%)"),
        ("loss.png", "train", "loss", "training loss (mean over local steps)"),
        ("drift.png", "train", "drift", "client drift Γ_i = mean_k ||θ_k - θ||²"),
        ("dissimilarity.png", "diagnostics", "dissimilarity", "gradient dissimilarity Σp_i||g_i||² / ||g||²"),
    ):
        series = _series(records, split, key)
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        many = len(series) > MAX_LEGEND_CLIENTS  # cross-device: hundreds of clients, no readable legend
        for client, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="." if len(xs) < 30 and not many else None, label=None if many else client,
                    **({"lw": 0.5, "alpha": 0.3} if many else {}))
        if many:
            by_round: dict[int, list[float]] = defaultdict(list)
            for xs, ys in series.values():
                for x, y in zip(xs, ys):
                    by_round[x].append(y)
            rounds = sorted(by_round)
            ax.plot(rounds, [np.mean(by_round[r]) for r in rounds], color="black", lw=1.5,
                    label=f"mean over the clients ({len(series)}, each a thin line)")
        ax.set_xlabel("round")
        ax.set_ylabel(ylabel)
        ax.set_title(cell_title(cell), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        save_figure(fig, cell / name)


def cell_title(cell: Path) -> str:
    """"<run folder>: <method>, seed <k>" of a cell folder (run/<method>/seed<k>): a plot opened on its own, or
    pasted, still says what it shows."""
    cell = Path(cell).resolve()
    return f"{cell.parent.parent.name}: {cell.parent.name}, seed {cell.name.removeprefix('seed')}"


def _run_title(fig, run_dir: Path) -> None:
    fig.suptitle(Path(run_dir).resolve().name, fontsize=10)


def comparison_curves(run_dir: Path, cells: list[tuple[str, int]]) -> tuple[dict[str, dict[str, dict[int, float]]], str]:
    """What comparison.png draws: per kind ("acc": mean test score over the internal clients, "loss": mean
    training loss over the participants) and method label, round -> the mean over seeds; and the score's name.

    A seed that stopped early (diverged) keeps its last test score in the later rounds of the others, as the
    table keeps its last finite model: the last point is the table's Avg, not a mean over fewer seeds."""
    return row_curves([(label, store.cell_dir(run_dir, label, seed)) for label, seed in cells])


def row_curves(cells: list[tuple[str, Path]]) -> tuple[dict[str, dict[str, dict[int, float]]], str]:
    """:func:`comparison_curves` over (row label, cell folder) pairs from any run folders (``fednorm report
    --plot``): the seeds of a row are the cells given under its label."""
    per_seed: dict[str, dict[str, list[dict[int, float]]]] = {"acc": defaultdict(list), "loss": defaultdict(list)}
    score = "accuracy"
    for label, cell in cells:
        records = store.read_metrics(cell / store.METRICS_FILE)
        score = _score(records)
        external = store.external_clients(cell)  # never trained: the table's Avg leaves them out, so does the curve
        for kind, split in (("acc", "test"), ("loss", "train")):
            by_round: dict[int, list[float]] = defaultdict(list)
            for r in records:
                if r["split"] == split and kind in r and r["client"] not in external:
                    by_round[r["round"]].append(r[kind])
            if by_round:
                per_seed[kind][label].append({rnd: float(np.mean(v)) for rnd, v in sorted(by_round.items())})
    curves: dict[str, dict[str, dict[int, float]]] = {"acc": {}, "loss": {}}
    for kind, methods in per_seed.items():
        for label, seeds in methods.items():
            rounds = sorted({rnd for series in seeds for rnd in series})
            by_round = defaultdict(list)
            for series in seeds:
                last = max(series)
                for rnd in rounds:
                    if rnd in series:
                        by_round[rnd].append(series[rnd])
                    elif kind == "acc" and rnd > last:
                        by_round[rnd].append(series[last])
            curves[kind][label] = {rnd: float(np.mean(by_round[rnd])) for rnd in rounds if by_round[rnd]}
    return curves, score


def plot_comparison(run_dir: Path, cells: list[tuple[str, int]]) -> None:
    """comparison.png: mean-over-clients test accuracy and training loss per method (mean over seeds)."""
    curves, score = comparison_curves(run_dir, cells)
    draw_comparison(curves, score, Path(run_dir).resolve().name, Path(run_dir) / "comparison.png")


def draw_comparison(curves: dict[str, dict[str, dict[int, float]]], score: str, title: str, path: Path) -> Path | None:
    """The two panels of comparison.png (test score and training loss per row, by round) under ``title``, written
    to ``path``; None (nothing written) when no row has a test score."""
    if not curves["acc"]:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, kind, ylabel in ((axes[0], "acc", f"mean test {score} over clients (%)"),
                             (axes[1], "loss", "mean training loss over clients")):
        for label, by_round in curves[kind].items():
            ax.plot(list(by_round), [y * (100 if kind == "acc" else 1) for y in by_round.values()],
                    marker="." if len(by_round) < 30 else None, label=label)
        ax.set_xlabel("round")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if curves[kind]:
            ax.legend()
        else:  # e.g. every cell diverged in its first round: test scores were recorded, no finite training loss
            ax.text(0.5, 0.5, "none recorded", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


DIAGNOSTICS = (("drift", "train", "mean client drift Γ (HarmoFL Eq. 9)"),
               ("dissimilarity", "diagnostics", "gradient dissimilarity B² at the global model"),
               ("pairwise", "diagnostics", "mean pairwise ||g_i - g_j||"))


def plot_diagnostics(run_dir: Path, cells: list[tuple[str, int]]) -> bool:
    """diagnostics.png: per method (mean over seeds), the mean client drift and the gradient dissimilarity per
    round, for runs with the ``diagnostics`` section on; False (no file) when no cell recorded any."""
    curves: dict[str, dict[str, dict[int, list[float]]]] = {key: defaultdict(dict) for key, _, _ in DIAGNOSTICS}
    for label, seed in cells:
        records = store.read_metrics(store.cell_dir(run_dir, label, seed) / store.METRICS_FILE)
        for key, split, _ in DIAGNOSTICS:
            by_round: dict[int, list[float]] = defaultdict(list)
            for r in records:
                if r["split"] == split and key in r:
                    by_round[r["round"]].append(r[key])
            for rnd, vals in by_round.items():
                curves[key][label].setdefault(rnd, []).append(float(np.mean(vals)))
    shown = [(key, title) for key, _, title in DIAGNOSTICS if curves[key]]
    if not shown:
        return False
    fig, axes = plt.subplots(1, len(shown), figsize=(5 * len(shown), 4), squeeze=False)
    for ax, (key, title) in zip(axes[0], shown):
        for label, by_round in curves[key].items():
            rounds = sorted(by_round)
            ax.plot(rounds, [np.mean(by_round[r]) for r in rounds], marker="." if len(rounds) < 30 else None,
                    label=label)
        ax.set_xlabel("round")
        ax.set_ylabel(title)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _run_title(fig, run_dir)
    save_figure(fig, Path(run_dir) / "diagnostics.png")
    return True
