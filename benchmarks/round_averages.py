"""Mean test score over a cell's internal clients at each evaluated round, in % (what comparison.png draws):
the "Avg at rounds ..." and "rounds 10 / 20 / 30" columns of the benchmark docs.

    python benchmarks/round_averages.py RUN_DIR [RUN_DIR ...]     # one line per (run folder, method)
    python benchmarks/round_averages.py --last 5 RUN_DIR ...      # and the exact mean of the last 5 evaluations
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fednorm.runs.plots import comparison_curves
from fednorm.runs.runner import load_run_config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--last", type=int, default=0, help="also print the mean of the last N evaluated rounds, "
                        "from the unrounded averages (the docs' 'mean of rounds 60-100' with N=5 of 100 rounds)")
    args = parser.parse_args(argv)
    for run in args.runs:
        config = load_run_config(run)
        cells = [(m.display, s) for m in config.methods for s in config.seeds]
        curves, _ = comparison_curves(run, cells)
        for label, by_round in curves["acc"].items():
            line = f"{run.name} {label}: " + " / ".join(f"r{rnd} {100 * acc:.2f}" for rnd, acc in by_round.items())
            if args.last > 0:
                last = list(by_round.values())[-args.last:]
                line += f" | mean of the last {len(last)}: {100 * sum(last) / len(last):.2f}"
            print(line)


if __name__ == "__main__":
    main()
