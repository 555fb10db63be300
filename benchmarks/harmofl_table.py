"""HarmoFL's ablation with its drift diagnostics, from a run folder made with the ``diagnostics`` section on
(preset harmofl_digits / harmofl_pacs with --set diagnostics.drift=true ...): per method the mean final test
accuracy, the mean client drift Gamma (HarmoFL Eq. 9) over the first and the last evaluation interval, the
gradient dissimilarity B^2 and mean pairwise ||g_i - g_j|| at the last evaluation, and the landscape's
flatness (mean rise of the loss over the slice, and how far each client's minimum lies from the global model).
Each method's weight-perturbation alpha is read from the run's config; "± SE" is the standard error of the
final accuracy across clients (HarmoFL Fig. 5c's error bar), from the first seed. Several run folders give
one table (e.g. an alpha sweep beside the ablation run that holds alpha = 0.05):

    python benchmarks/harmofl_table.py benchmarks/results/harmofl/harmofl_digits-short
    python benchmarks/harmofl_table.py benchmarks/results/harmofl/harmofl_digits-short{,-alpha-paper}
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from fednorm.diagnostics.landscape import RESULT_FILE, read_result, sharpness
from fednorm.runs import store
from fednorm.runs.runner import RunError, load_run_config


def alphas(run_dir: Path) -> dict[str, float]:
    """Weight-perturbation alpha of each method of the run (0 = off), by method label."""
    config = load_run_config(run_dir)
    return {m.display: m.build().weight_perturbation for m in config.methods}


def client_standard_error(summary: dict) -> float:
    """Standard error (%) of the final test accuracy across the cell's clients."""
    accs = np.array([c["test"]["final_acc"] * 100 for c in summary["clients"] if "test" in c])
    return float(accs.std(ddof=1) / np.sqrt(len(accs))) if len(accs) > 1 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dirs", type=Path, nargs="+")
    args = parser.parse_args()
    try:  # every folder is checked before the table starts, so a wrong path gives one clear line
        alpha_by_run = {run_dir: alphas(run_dir) for run_dir in args.run_dirs}
    except RunError as err:
        parser.error(str(err))
    print("| method | alpha | seeds | test acc (%) | ± SE | drift Γ, first interval | drift Γ, last interval | B² (last eval) | "
          "pairwise ‖g_i−g_j‖ (last eval) | landscape: mean rise | landscape: minimum offset |")
    print("|---" * 11 + "|")
    methods = [(method_dir, alpha) for run_dir, alpha in alpha_by_run.items()
               for method_dir in sorted(p for p in run_dir.iterdir() if p.is_dir())]
    for method_dir, alpha in methods:
        cells = sorted(method_dir.glob("seed*"))
        stats: dict[str, list[float]] = {}
        for cell in cells:
            summary_path = cell / store.SUMMARY_FILE
            if not summary_path.exists():
                continue
            summary = json.loads(summary_path.read_text())
            records = store.read_metrics(cell / store.METRICS_FILE)
            stats.setdefault("acc", []).append(summary["mean_final_test_acc"] * 100)
            stats.setdefault("se", []).append(client_standard_error(summary))
            evals = sorted({r["round"] for r in records if r["split"] == "test"})
            drift = [(r["round"], r["drift"]) for r in records if r["split"] == "train" and "drift" in r]
            if drift and evals:
                first = [d for rnd, d in drift if rnd <= evals[0]]
                last = [d for rnd, d in drift if len(evals) > 1 and rnd > evals[-2]]
                stats.setdefault("drift_first", []).append(float(np.mean(first)))
                if last:
                    stats.setdefault("drift_last", []).append(float(np.mean(last)))
            diag = [r for r in records if r["split"] == "diagnostics"]
            if diag:
                stats.setdefault("b2", []).append(diag[-1]["dissimilarity"])
                stats.setdefault("pairwise", []).append(diag[-1]["pairwise"])
            land = cell / RESULT_FILE
            if land.exists():
                sharp = sharpness(read_result(land))
                stats.setdefault("rise", []).append(float(np.mean([s["mean_rise"] for s in sharp.values()])))
                stats.setdefault("offset", []).append(float(np.mean([s["minimum_offset"] for s in sharp.values()])))
        if not stats:
            continue

        def cell_text(name: str, fmt: str = "{:.4g}", stats: dict = stats) -> str:
            return fmt.format(np.mean(stats[name])) if name in stats else ""

        print(f"| {method_dir.name} | {alpha.get(method_dir.name, float('nan')):g} | {len(stats['acc'])} | "
              f"{cell_text('acc', '{:.2f}')} | {stats['se'][0]:.2f} | {cell_text('drift_first')} | "
              f"{cell_text('drift_last')} | {cell_text('b2', '{:.3f}')} | {cell_text('pairwise')} | "
              f"{cell_text('rise', '{:.2f}')} | {cell_text('offset', '{:.2f}')} |")


if __name__ == "__main__":
    main()
