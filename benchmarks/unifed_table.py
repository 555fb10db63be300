"""UniFed's internal and external tables from a run folder (preset unifed_digits or unifed_corrupt_*):
one row per algorithm, without and with client-specific BN (``+ours``), internal accuracy (mean over the
internal clients) and each external client under each mode (global model, test-time BN statistics, FedBN
App. G's average). ``--selected``: at the round of the best mean validation accuracy (UniFed's model
selection), else the final round. Several run folders of one protocol (a preset's methods split across
parallel runs) merge into one table, rows in the first folder's method order, then the others'.

    python benchmarks/unifed_table.py benchmarks/results/unifed/unifed_digits [--selected]
    python benchmarks/unifed_table.py benchmarks/results/unifed/unifed_corrupt_internal-{a,b}
    python benchmarks/unifed_table.py benchmarks/results/unifed/unifed_corrupt_external-blur --paper
    python benchmarks/unifed_table.py benchmarks/results/unifed/unifed_digits{,-seed1} --gain

``--gain`` (runs of several seeds) adds the add-on's internal gain per algorithm: internal accuracy without and
with client-specific BN, mean (sample std) over seeds, and the gain seed by seed (UniFed's claim: the add-on
improves internal accuracy for every algorithm).

``--paper`` (a leave-one-corruption-type-out fold) adds the summary against UniFed Table III: per algorithm, the
mean over the fold's external clients of each mode, beside the paper's mean over the same corruption type's
columns (global model and "+Ours"). The paper does not say which corruption is N1 / B2 / ..., so only the
type's mean compares.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from fednorm.data.corrupt import UNIFED_TYPES
from fednorm.runs.report import read_summaries

# UniFed Table III (CIFAR-10-C, pretrained AlexNet, 200 rounds), transcribed from
# ../shared/reference/unifed.md: columns N1-N3, B1-B4, W1-W3, D1-D5 = the types of UNIFED_TYPES in order,
# for each algorithm the global model's row and the "+Ours" (test-time BN statistics) row.
PAPER_TABLE_III = {
    "fedavg": ([58.30, 71.09, 30.46, 96.17, 66.46, 92.58, 88.50, 95.07, 95.16, 96.34, 96.30, 95.76, 91.31, 95.92, 94.13],
               [92.99, 94.20, 79.68, 96.29, 87.33, 95.79, 95.70, 95.77, 96.02, 96.38, 96.24, 96.20, 94.37, 96.11, 94.74]),
    "scaffold": ([62.05, 74.52, 36.24, 96.27, 70.64, 94.13, 91.38, 95.20, 95.42, 96.33, 96.35, 95.96, 93.00, 95.99, 94.82],
                 [94.13, 95.07, 82.76, 96.30, 88.27, 95.67, 95.52, 95.72, 95.91, 96.19, 96.18, 96.10, 94.35, 95.99, 94.77]),
    "fedprox": ([58.42, 71.21, 31.68, 96.22, 64.67, 91.83, 87.28, 95.00, 95.04, 96.34, 96.35, 95.70, 90.69, 95.98, 93.88],
                [92.65, 94.15, 79.30, 96.34, 86.37, 95.70, 95.65, 95.75, 95.99, 96.42, 96.28, 96.26, 94.36, 96.16, 94.74]),
    "fedadam": ([58.25, 70.78, 32.41, 96.37, 67.97, 92.81, 88.85, 93.70, 93.62, 95.63, 96.41, 95.87, 90.87, 96.05, 93.92],
                [93.24, 94.53, 80.40, 96.48, 87.58, 95.89, 95.85, 95.11, 95.60, 96.15, 96.45, 96.37, 94.38, 96.23, 94.87]),
    "fednova": ([75.82, 84.79, 32.62, 96.69, 75.69, 94.85, 92.88, 95.78, 95.47, 96.66, 96.83, 96.42, 94.43, 96.59, 95.75],
                [95.55, 96.09, 86.10, 96.75, 91.37, 96.24, 96.20, 96.39, 96.49, 96.76, 96.81, 96.71, 95.53, 96.64, 95.82]),
    "fedbn": ([55.87, 68.84, 28.44, 96.04, 64.56, 90.38, 84.95, 94.38, 94.42, 96.06, 96.11, 94.61, 87.26, 95.47, 91.99],
              [91.53, 93.01, 77.30, 96.42, 85.48, 95.71, 95.52, 95.46, 95.87, 96.35, 96.30, 96.17, 93.48, 96.06, 93.77]),
    "moon": ([62.45, 75.05, 35.14, 96.33, 66.80, 93.67, 90.71, 95.40, 95.38, 96.31, 96.27, 95.76, 92.30, 95.97, 94.65],
             [94.12, 95.07, 82.58, 96.44, 87.85, 95.82, 95.74, 95.96, 96.02, 96.35, 96.27, 96.19, 94.50, 96.12, 95.00]),
    "feddc": ([62.63, 74.53, 33.86, 96.27, 70.72, 94.18, 91.58, 95.21, 95.49, 96.31, 96.31, 95.89, 93.04, 96.04, 94.85],
              [93.95, 95.05, 82.73, 96.35, 88.72, 95.89, 95.65, 95.84, 96.03, 96.32, 96.31, 96.22, 94.80, 96.04, 95.09]),
    "perfedavg": ([85.82, 93.69, 54.99, 96.59, 82.36, 95.43, 94.91, 96.07, 96.17, 96.68, 96.81, 96.47, 95.14, 96.59, 95.77],
                  [95.76, 96.17, 87.70, 96.74, 92.07, 96.26, 96.14, 96.35, 96.47, 96.74, 96.81, 96.67, 95.64, 96.60, 95.81]),
}
MODES = ("global", "test_time_bn", "fedbn_average")


def paper_type_means(held_out: str) -> dict[str, tuple[float, float]]:
    """Per algorithm, UniFed Table III's (global, +Ours) mean over the columns of one corruption type."""
    start = 0
    for kind, corruptions in UNIFED_TYPES.items():
        if kind == held_out:
            span = slice(start, start + len(corruptions))
            return {m: (float(np.mean(g[span])), float(np.mean(o[span]))) for m, (g, o) in PAPER_TABLE_III.items()}
        start += len(corruptions)
    raise KeyError(held_out)


def held_out_type(external_clients: list[str]) -> str:
    """The corruption type a fold holds out, from its external clients' names (``corrupt/fog/3/mnistm:global``)."""
    corruptions = {column_name(c).partition(":")[0] for c in external_clients}
    for kind, members in UNIFED_TYPES.items():
        if corruptions == set(members):
            return kind
    raise SystemExit(f"--paper needs a leave-one-corruption-type-out fold; the external clients are {sorted(corruptions)}")


def print_paper_summary(rows: dict[str, dict[str, list[float]]], externals: list[str]) -> None:
    """Mean over the fold's external clients per mode, beside UniFed Table III's mean over the same type."""
    kind = held_out_type(externals)
    paper = paper_type_means(kind)
    print(f"\nMean over the external {kind} clients, ours against UniFed Table III's {kind} columns:\n")
    print("| algorithm | ours: internal | ours: global | ours: test-time BN | gain | ours: App. G "
          "| paper: global | paper: +Ours | gain |")
    print("|---" * 9 + "|")
    for method, row in rows.items():
        if method.endswith("+ours"):
            continue
        mean = {mode: float(np.mean([np.mean(v) for c, v in row.items() if c.endswith(f":{mode}")] or [np.nan]))
                for mode in MODES}
        internal = float(np.mean(row["internal"])) if row.get("internal") else np.nan
        cells = [100 * internal, 100 * mean["global"], 100 * mean["test_time_bn"]]
        ours = [f"{v:.2f}" for v in cells] + [f"{cells[2] - cells[1]:+.2f}", f"{100 * mean['fedbn_average']:.2f}"]
        theirs = [f"{paper[method][0]:.2f}", f"{paper[method][1]:.2f}", f"{paper[method][1] - paper[method][0]:+.2f}"] \
            if method in paper else ["", "", ""]
        print(f"| {method} | " + " | ".join(ours + theirs) + " |")


def print_add_on_gain(internal_by_seed: dict[str, dict[int, float]], methods: list[str]) -> None:
    """Internal accuracy without / with the add-on (mean (sample std) over the seeds both have) and the gain by seed."""
    print("\nInternal accuracy (%) without and with client-specific BN (+ours), seeds both ran; mean (sample std):\n")
    print("| algorithm | seeds | without | with (+ours) | gain | gain by seed |")
    print("|---" * 6 + "|")

    def spread(values: list[float], sign: str = "") -> str:
        return f"{np.mean(values):{sign}.2f}" + (f" ({np.std(values, ddof=1):.2f})" if len(values) > 1 else "")

    for method in methods:
        seeds = sorted(set(internal_by_seed.get(method, {})) & set(internal_by_seed.get(f"{method}+ours", {})))
        if not seeds:
            continue
        without = [100 * internal_by_seed[method][s] for s in seeds]
        with_ = [100 * internal_by_seed[f"{method}+ours"][s] for s in seeds]
        gains = [b - a for a, b in zip(without, with_, strict=True)]
        print(f"| {method} | {', '.join(map(str, seeds))} | {spread(without)} | {spread(with_)} | {spread(gains, '+')} | "
              + " / ".join(f"{g:+.2f}" for g in gains) + " |")


def column_name(client: str) -> str:
    """A corrupted domain's column is its corruption (``corrupt/fog/3/mnistm`` -> ``fog``,
    ``corrupt/fog/3/mnistm:global`` -> ``fog:global``, the released ``cifar10c/fog/3`` -> ``fog``); the base and
    severity are in the run's config."""
    if not client.startswith(("corrupt/", "cifar10c/")):
        return client
    domain, _, mode = client.partition(":")
    return domain.split("/")[1] + (f":{mode}" if mode else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dirs", type=Path, nargs="+", metavar="run_dir")
    parser.add_argument("--selected", action="store_true")
    parser.add_argument("--per-client", action="store_true",
                        help="a column per internal client too (UniFed Table II has one per corruption)")
    parser.add_argument("--gain", action="store_true",
                        help="the add-on's internal gain per algorithm, seed by seed and its mean (sample std)")
    parser.add_argument("--paper", action="store_true",
                        help="a leave-one-type-out fold's summary beside UniFed Table III's means over that type")
    args = parser.parse_args()
    key = "selected_acc" if args.selected else "final_acc"
    rows: dict[str, dict[str, list[float]]] = {}
    externals: list[str] = []
    internals: list[str] = []
    internal_by_seed: dict[str, dict[int, float]] = {}
    for summary in (s for run_dir in args.run_dirs for s in read_summaries(run_dir)):
        row = rows.setdefault(summary["method"], {})
        internal = []
        for c in summary["clients"]:
            if "test" not in c or key not in c["test"]:
                continue
            if c.get("external"):
                row.setdefault(c["name"], []).append(c["test"][key])
                if c["name"] not in externals:
                    externals.append(c["name"])
            else:
                internal.append(c["test"][key])
                row.setdefault(c["name"], []).append(c["test"][key])
                if c["name"] not in internals:
                    internals.append(c["name"])
        if internal:
            row.setdefault("internal", []).append(float(np.mean(internal)))
            internal_by_seed.setdefault(summary["method"], {})[summary["seed"]] = float(np.mean(internal))
    columns = (internals if args.per_client else []) + ["internal"] + externals
    print(f"Test accuracy (%), {'validation-selected' if args.selected else 'final'} round, mean over seeds "
          f"({', '.join(d.name for d in args.run_dirs)}). Internal: mean over the internal clients.\n")
    print("| method | " + " | ".join(column_name(c) for c in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    from fednorm.runs.config import ConfigError
    from fednorm.runs.runner import RunError, load_run_config

    try:  # the config's method order; a folder of cells without a (valid) run config keeps the files' order
        order = [m.display for run_dir in args.run_dirs for m in load_run_config(run_dir).methods]
    except (RunError, ConfigError):
        order = []
    rows = {m: rows[m] for m in sorted(rows, key=lambda m: order.index(m) if m in order else len(order))}
    base = [m for m in rows if not m.endswith("+ours")]
    for method in base + [m for m in rows if m.endswith("+ours") and m.removesuffix("+ours") not in base]:
        for label in (method, f"{method}+ours"):
            if label not in rows:
                continue
            cells = [f"{100 * np.mean(rows[label][c]):.2f}" if rows[label].get(c) else "" for c in columns]
            print(f"| {label} | " + " | ".join(cells) + " |")
    if args.gain:
        print_add_on_gain(internal_by_seed, [m for m in base if f"{m}+ours" in rows])
    if args.paper:
        print_paper_summary(rows, externals)


if __name__ == "__main__":
    main()
