"""The FBN paper's 2-D Gaussian toy (Figs. 1-2c): normalization error vs heterogeneity and separability.

`OMP_NUM_THREADS=1 python benchmarks/fbn_toy.py [--seeds 0 1 2] [--rounds 100] [--plot PATH]`
prints a markdown table (metrics averaged over the seeds) and the wall time, and writes the
Fig. 1/2-style PNG (default `benchmarks/results/fbn_toy/fbn_toy.png`, extreme heterogeneity, first seed).
See `fednorm.runs.fbn_toy` for the setting and the heterogeneity construction.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from fednorm.runs.fbn_toy import DEFAULT_LEVELS, format_table, plot_toy, toy_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=float, nargs="+", default=list(DEFAULT_LEVELS),
                        help="heterogeneity levels, 1 - gamma (0 = iid, 1 = one Gaussian per client)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--plot", type=Path, default=Path(__file__).parent / "results" / "fbn_toy" / "fbn_toy.png")
    args = parser.parse_args()

    start = time.perf_counter()
    rows = toy_table(args.levels, seeds=args.seeds, rounds=args.rounds)
    table_s = time.perf_counter() - start
    print(f"n = 10 clients, m = 30 points per client per round, beta = 0.1, {args.rounds} rounds, "
          f"seeds {args.seeds}; errors = mean distance to centralized BN (mean over rounds), "
          f"acc = nearest-class-mean accuracy on the normalized points (mean over rounds)")
    print(format_table(rows))
    print(f"table wall time: {table_s:.1f} s")
    if args.plot:
        # the error panel shows the first seed only (the table's rows when there is a single seed)
        path = plot_toy(args.plot, level=max(args.levels), levels=args.levels, rounds=args.rounds,
                        seed=args.seeds[0], rows=rows if len(args.seeds) == 1 else None)
        print(f"plot: {path} (total wall time {time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
