"""FedBN's convergence claim checked numerically: Corollary 4.6's Gram-matrix eigenvalues and App. F's synthetic
experiment (Fig. 9), FedAvg against FedBN.

`OMP_NUM_THREADS=1 python benchmarks/fedbn_theory.py [--seeds 0 1 2] [--steps 600] [--out DIR]`
prints two markdown tables and the wall time and writes DIR/fedbn_synthetic.png (default
benchmarks/results/fedbn_theory). See `fednorm.runs.fedbn_theory` for the settings and the choices made where
the paper is silent.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from fednorm.runs.fedbn_theory import gram_table, plot_synthetic, synthetic_run

REPORT_STEPS = (10, 50, 100, 300, 600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "fedbn_theory")
    args = parser.parse_args()
    start = time.perf_counter()

    print("Corollary 4.6: lambda_min of G_inf (FedAvg, mu0) and of its client block diagonal G*_inf (FedBN, mu0*),")
    print("alpha = 1, 50 centred Gaussian points per client in R^10, client 0 identity covariance, the others random\n")
    print("| clients | seed | mu0 | mu0* | mu0* / mu0 |")
    print("| --- | --- | --- | --- | --- |")
    for clients in (2, 5):
        for row in gram_table(num_clients=clients, seeds=args.seeds):
            print(f"| {clients} | {row['seed']} | {row['mu0']:.4g} | {row['mu0_star']:.4g} | {row['ratio']:.2f} |")

    curves = {m: [synthetic_run(m, steps=args.steps, seed=s) for s in args.seeds] for m in ("fedavg", "fedbn")}
    shown = [s for s in REPORT_STEPS if s <= args.steps]
    print(f"\nApp. F / Fig. 9: training loss (mean over the 2 clients) of step t (its forward pass, before the "
          f"update), and the final test accuracy; "
          f"mean (population std) over seeds {args.seeds}\n")
    print("| method | " + " | ".join(f"loss, t = {s}" for s in shown) + " | test acc (%) |")
    print("|---" * (len(shown) + 2) + "|")
    for method, runs in curves.items():
        losses = [np.array([r["loss"][s - 1] for r in runs]) for s in shown]
        acc = np.array([100 * r["acc"][-1] for r in runs])
        print(f"| {method} | " + " | ".join(f"{v.mean():.3f} ({v.std():.3f})" for v in losses)
              + f" | {acc.mean():.2f} ({acc.std():.2f}) |")
    mean_curves = {m: {k: list(np.mean([r[k] for r in runs], axis=0)) for k in ("loss", "acc")}
                   for m, runs in curves.items()}
    path = plot_synthetic(mean_curves, args.out / "fedbn_synthetic.png")
    print(f"\nplot: {path}; wall time {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
