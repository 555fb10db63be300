"""Tables of the FBN experiments from their run folders (benchmarks/results/fbn/<preset>-<setting>/).

    python benchmarks/fbn_table.py            # markdown: final and best test accuracy per method and setting
    python benchmarks/fbn_table.py --by-step benchmarks/results/fbn/fbn_mnistm-gamma0   # one setting, by step
    python benchmarks/fbn_table.py --robust 0      # robust FBN vs robust naive BN at gamma 0 (the folder suffix: 0, 0.01, 0.1, 1)
    python benchmarks/fbn_table.py --robust-full 0.01   # the same over the full-protocol cells (fbn_full_queue.sh)
    python benchmarks/fbn_table.py --summary <run folders>   # per method and seed: final, mean of the last 5 and
                                                   # 10 evaluations, best (first step at it); then means over seeds
    python benchmarks/fbn_table.py --heterogeneity # the paper's Fig. 3 / Fig. 5 as a table: final accuracy against
                                                   # gamma (1 -> 0) and Dirichlet alpha, mean (sample std) over seeds
    python benchmarks/fbn_table.py --full          # the same over the full-protocol cells (one folder per method)
    python benchmarks/fbn_table.py --rows <run>/<method>/seed0 ...   # the full-protocol sections' by-step rows

Each run folder holds every method of its preset for one setting (gamma, Dirichlet alpha, attack);
a cell still running shows its last evaluated round, a diverged one (federation.on_divergence: record) the
step where it stopped (its final number is the server's last finite model there).
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from fednorm.runs import store

ROOT = Path(__file__).resolve().parent / "results" / "fbn"


def test_by_round(cell: Path) -> dict[int, float]:
    """Test accuracy (%) by evaluated round of one method's seed folder, mean over the internal clients (as the
    reports' Avg: external clients, never trained, left out); damaged lines skipped as fednorm's reader does."""
    external = store.external_clients(cell)
    by_round: dict[int, list[float]] = {}
    for record in store.read_metrics(cell / store.METRICS_FILE):
        if record.get("split") == "test" and record.get("acc") is not None and record["client"] not in external:
            by_round.setdefault(record["round"], []).append(record["acc"])
    return {r: 100 * sum(v) / len(v) for r, v in sorted(by_round.items())}


def cell_numbers(cell: Path) -> tuple[float, float, int] | None:
    """(final, best, round of final) test accuracy (%) of one method's seed folder, mean over clients."""
    means = test_by_round(cell)
    if not means:
        return None
    last = max(means)
    return means[last], max(means.values()), last


def by_step(run: Path) -> None:
    """One setting's methods (rows) by evaluated step (columns)."""
    curves = {seed_dir.parent.name: test_by_round(seed_dir) for seed_dir in sorted(run.glob("*/seed*"))}
    steps = sorted({s for curve in curves.values() for s in curve})
    print(f"{run.name} (test accuracy %, by step)\n")
    print("| method | " + " | ".join(map(str, steps)) + " |")
    print("|---" * (len(steps) + 1) + "|")
    for method, curve in curves.items():
        print(f"| {method} | " + " | ".join(f"{curve[s]:.2f}" if s in curve else "" for s in steps) + " |")


def summary(runs: list[Path]) -> None:
    """The end-of-run numbers of fbn.md's full-protocol sections, for the seed folders of the given run folders."""
    rows: dict[str, list[tuple[float, float, float]]] = {}
    print("| method | seed | final (step) | mean of last 5 evaluations | mean of last 10 | best (first step) |")
    print("|---|---|---|---|---|---|")
    for run in runs:
        for seed_dir in sorted(run.glob("*/seed*")):
            curve = test_by_round(seed_dir)
            if not curve:
                continue
            steps = sorted(curve)
            best = max(curve.values())
            last5 = statistics.mean(curve[s] for s in steps[-5:])
            last10 = statistics.mean(curve[s] for s in steps[-10:])
            first_best = min(s for s in steps if curve[s] == best)
            method = seed_dir.parent.name
            rows.setdefault(method, []).append((curve[steps[-1]], last5, last10))
            print(f"| {method} | {seed_dir.name} | {curve[steps[-1]]:.2f} ({steps[-1]}) | {last5:.2f} | {last10:.2f} "
                  f"| {best:.2f} ({first_best}) |")
    print("\n| method | seeds | mean final | mean of last 5 | mean of last 10 |\n|---|---|---|---|---|")
    for method, values in rows.items():
        means = [statistics.mean(v[i] for v in values) for i in range(3)]
        print(f"| {method} | {len(values)} | " + " | ".join(f"{m:.2f}" for m in means) + " |")


ATTACKS = {"sf": "SF", "foe": "FOE", "alie": "ALIE", "alie-z1.5": "ALIE with z = 1.5 (byzfl)"}
DEFENSES = {"mean": "mean: no defense", "median-stats": "NNM + median (mean): `-stats`",
            "trimmed-stats": "NNM + trimmed mean (mean): `-stats`", "median-all": "NNM + median (NNM + median): `-all`"}


def _final_best(cell: Path) -> str:
    numbers = cell_numbers(cell)
    if numbers is None:
        return ""
    final, best, last = numbers
    summary = cell / "summary.json"
    diverged = json.loads(summary.read_text()).get("diverged") if summary.exists() else None
    text = f"{final:.2f}" + (f" (best {best:.2f})" if best - final >= 0.5 else "")
    if diverged:
        text += f", diverged at step {diverged['round']}"
    elif not summary.exists():
        text += f" (at step {last}, running)"
    return text


def robust(gamma: str, root: Path = ROOT, full: bool = False) -> None:
    """Robust FBN against robust naive BN at one gamma: the no-attack cells of fbn_mnistm-gamma<gamma> and
    every attack folder fbn_robust_mnistm-<attack>-gamma<gamma>[-suffix] (rows: attack x aggregation).
    ``full``: the full-protocol cells instead, one folder per cell, fbn_robust_mnistm-full-<attack>-gamma<gamma>-
    <label> (benchmarks/fbn_full_queue.sh), the no-attack row from their own noattack cells (same precision)."""
    protocol = "full protocol (width 1, T = 3000)" if full else "shortened protocol (width 0.5, T = 500)"
    print(f"gamma = {gamma}, f = 3 of 10, {protocol}; test accuracy % at the last step (best over the run where "
          ">= 0.5 higher)\n")
    print("| attack, aggregation of the statistics (parameters) | FBN | naive BN |\n| --- | --- | --- |")
    if full:
        clean_fbn = root / f"fbn_robust_mnistm-full-noattack-gamma{gamma}-fbn-mean" / "fbn-mean" / "seed0"
        clean_naive = root / f"fbn_robust_mnistm-full-noattack-gamma{gamma}-naive-mean" / "naive-mean" / "seed0"
    else:
        clean_fbn, clean_naive = (root / f"fbn_mnistm-gamma{gamma}" / m / "seed0" for m in ("fbn", "naive_bn"))
    print(f"| no attack, mean (mean) | {_final_best(clean_fbn)} | {_final_best(clean_naive)} |")
    for key, attack in ATTACKS.items():
        if full:
            folders = sorted(root.glob(f"fbn_robust_mnistm-full-{key}-gamma{gamma}-*"))
        else:
            folders = sorted(root.glob(f"fbn_robust_mnistm-{key}-gamma{gamma}")) + sorted(
                root.glob(f"fbn_robust_mnistm-{key}-gamma{gamma}-*"))
        for defense, label in DEFENSES.items():
            fbn = [f / f"fbn-{defense}" / "seed0" for f in folders if (f / f"fbn-{defense}" / "seed0").exists()]
            naive = [f / f"naive-{defense}" / "seed0" for f in folders if (f / f"naive-{defense}" / "seed0").exists()]
            if fbn or naive:
                print(f"| {attack}, {label} | {_final_best(fbn[0]) if fbn else ''} | "
                      f"{_final_best(naive[0]) if naive else ''} |")


def heterogeneity(root: Path = ROOT, preset: str = "fbn_mnistm", full: bool = False) -> None:
    """Final test accuracy against heterogeneity: one row per setting (gamma from 1 to 0, then Dirichlet alpha
    from 1 to 0.1), one column per method, mean (sample std, ddof 1) over the seeds of every run folder
    <preset>-<setting>[-seedN]; a cell still running or diverged is left out and counted in brackets.
    ``full``: the full-protocol folders instead, one per method, <preset>-full-<setting>[-seedN]-<method>.
    A Dirichlet setting named ``dirichlet<alpha>-hsu`` (data.dirichlet_form: per_client) is its own row."""
    if full:
        pattern = re.compile(rf"{re.escape(preset)}-full-(gamma|dirichlet)([0-9.]+)(-hsu)?(?:-seed\d+)?-[a-z_]+")
    else:
        pattern = re.compile(rf"{re.escape(preset)}-(gamma|dirichlet)([0-9.]+)(-hsu)?(?:-seed\d+)?")
    finals: dict[tuple[str, float, bool], dict[str, list[float]]] = {}
    unfinished: dict[tuple[str, float, bool], dict[str, int]] = {}
    methods: list[str] = []
    for run in sorted(root.iterdir()):
        match = pattern.fullmatch(run.name)
        if not match or not (run / "config.yaml").exists():
            continue
        setting = (match.group(1), float(match.group(2)), bool(match.group(3)))
        for seed_dir in sorted(run.glob("*/seed*")):
            method = seed_dir.parent.name
            if method not in methods:
                methods.append(method)
            summary = seed_dir / "summary.json"
            numbers = cell_numbers(seed_dir)
            if numbers is None or not summary.exists() or json.loads(summary.read_text()).get("diverged"):
                unfinished.setdefault(setting, {}).setdefault(method, 0)
                unfinished[setting][method] += 1
                continue
            finals.setdefault(setting, {}).setdefault(method, []).append(numbers[0])

    def cell(setting: tuple[str, float, bool], method: str) -> str:
        values = finals.get(setting, {}).get(method, [])
        text = ""
        if len(values) == 1:
            text = f"{values[0]:.2f} (1 seed)"
        elif values:
            text = f"{statistics.mean(values):.2f} ({statistics.stdev(values):.2f}, {len(values)} seeds)"
        missing = unfinished.get(setting, {}).get(method, 0)
        return text + (f" [+{missing} unfinished or diverged]" if missing else "")

    paper_order = ["fbn", "fixbn", "naive_bn", "centralized_bn"]  # the preset's (and the paper's legend's) order
    methods.sort(key=lambda m: paper_order.index(m) if m in paper_order else len(paper_order))
    order = sorted(set(finals) | set(unfinished), key=lambda s: (s[0] == "dirichlet", s[2], -s[1]))
    protocol = "full protocol (width 1, T = 3000)" if full else "shortened protocol"
    print(f"{preset}, {protocol}: test accuracy % at the last step, mean (sample std, number of seeds)\n")
    print("| setting | " + " | ".join(methods) + " |")
    print("| --- | " + " | ".join("---" for _ in methods) + " |")
    for setting in order:
        label = f"gamma = {setting[1]:g}" if setting[0] == "gamma" else f"Dirichlet alpha = {setting[1]:g}"
        label += ", per client (Hsu et al.)" if setting[2] else ""
        print(f"| {label} | " + " | ".join(cell(setting, m) for m in methods) + " |")


def main(root: Path = ROOT) -> None:
    runs = sorted(p for p in root.iterdir() if (p / "config.yaml").exists())
    methods: list[str] = []
    table: dict[str, dict[str, str]] = {}
    for run in runs:
        for seed_dir in sorted(run.glob("*/seed*")):
            method = seed_dir.parent.name
            numbers = cell_numbers(seed_dir)
            if numbers is None:
                continue
            final, best, last = numbers
            if method not in methods:
                methods.append(method)
            summary = seed_dir / "summary.json"
            diverged = json.loads(summary.read_text()).get("diverged") if summary.exists() else None
            status = (f" (diverged at {diverged['round']})" if diverged
                      else "" if summary.exists() else f" (round {last})")
            table.setdefault(run.name, {})[method] = f"{final:.2f} / {best:.2f}{status}"
    print("| setting | " + " | ".join(methods) + " |")
    print("| --- | " + " | ".join("---" for _ in methods) + " |")
    for run, cells in table.items():
        print(f"| {run} | " + " | ".join(cells.get(m, "") for m in methods) + " |")


ROW_STEPS = (100, 300, 600, 900, 1200, 1500, 1800, 2100, 2400, 2700, 3000)


def rows(cells: list[Path], steps: tuple[int, ...] = ROW_STEPS) -> None:
    """The full-protocol sections' by-step table: one row per seed folder (<run>/<method>/seedN) with the test
    accuracy at ``steps``, the final one in bold, the mean of the last 5 and 10 evaluations and the best (first
    step at it); the row is labelled <method>, <run folder>, <seed>."""
    print("| cell | " + " | ".join(map(str, steps)) + " | mean of last 5 evaluations | mean of last 10 | best (step) |")
    print("|---" * (len(steps) + 4) + "|")
    for cell in cells:
        curve = test_by_round(cell)
        if not curve:
            print(f"| {cell} | no test evaluation yet |")
            continue
        evaluated = sorted(curve)
        last = evaluated[-1]
        best = max(curve.values())
        first_best = min(s for s in evaluated if curve[s] == best)
        shown = [f"**{curve[s]:.2f}**" if s == last else f"{curve[s]:.2f}" if s in curve else "" for s in steps]
        label = f"{cell.parent.name}, {cell.parent.parent.name}, {cell.name}"
        print(f"| {label} | " + " | ".join(shown) + f" | {statistics.mean(curve[s] for s in evaluated[-5:]):.2f} | "
              f"{statistics.mean(curve[s] for s in evaluated[-10:]):.2f} | {best:.2f} ({first_best}) |")


def parse_args(argv: list[str] | None = None):
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--heterogeneity", action="store_true", help="final accuracy against gamma and Dirichlet alpha")
    mode.add_argument("--full", action="store_true", help="--heterogeneity over the full-protocol folders "
                      "(<preset>-full-<setting>[-seedN]-<method>)")
    mode.add_argument("--robust", metavar="GAMMA", help="robust FBN vs robust naive BN at one gamma (0, 0.01, ...)")
    mode.add_argument("--robust-full", metavar="GAMMA", help="--robust over the full-protocol cells "
                      "(fbn_robust_mnistm-full-<attack>-gamma<GAMMA>-<label>)")
    mode.add_argument("--summary", nargs="+", type=Path, metavar="RUN", help="per method and seed: final, mean of "
                      "the last 5 and 10 evaluations, best; then means over seeds")
    mode.add_argument("--by-step", nargs="+", type=Path, metavar="RUN", help="one setting's methods by step")
    mode.add_argument("--rows", nargs="+", type=Path, metavar="SEED_FOLDER", help="the full-protocol table: one row "
                      "per <run>/<method>/seedN folder at steps " + ", ".join(map(str, ROW_STEPS)))
    parser.add_argument("root", nargs="?", type=Path, default=ROOT, help=f"folder of run folders (default {ROOT})")
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    if args.heterogeneity or args.full:
        heterogeneity(args.root, full=args.full)
    elif args.robust is not None:
        robust(args.robust, args.root)
    elif args.robust_full is not None:
        robust(args.robust_full, args.root, full=True)
    elif args.summary:
        summary(args.summary)
    elif args.by_step:
        for folder in args.by_step:
            by_step(folder)
            print()
    elif args.rows:
        rows(args.rows)
    else:
        main(args.root)
