"""Mean test score over a cell's internal clients at each evaluated round, in % (what comparison.png draws):
the "Avg at rounds ..." and "rounds 10 / 20 / 30" columns of the benchmark docs.

    python benchmarks/round_averages.py RUN_DIR [RUN_DIR ...]     # one line per (run folder, method)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fednorm.runs.plots import comparison_curves
from fednorm.runs.runner import load_run_config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args(argv)
    for run in args.runs:
        config = load_run_config(run)
        cells = [(m.display, s) for m in config.methods for s in config.seeds]
        curves, _ = comparison_curves(run, cells)
        for label, by_round in curves["acc"].items():
            print(f"{run.name} {label}: " + " / ".join(f"r{rnd} {100 * acc:.2f}" for rnd, acc in by_round.items()))


if __name__ == "__main__":
    main()
