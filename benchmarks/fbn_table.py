"""Tables of the FBN experiments from their run folders (benchmarks/results/fbn/<preset>-<setting>/).

    python benchmarks/fbn_table.py            # markdown: final and best test accuracy per method and setting
    python benchmarks/fbn_table.py --by-step benchmarks/results/fbn/fbn_mnistm-gamma0   # one setting, by step

Each run folder holds every method of its preset for one setting (gamma, Dirichlet alpha, attack);
a cell still running shows its last evaluated round, a diverged one (federation.on_divergence: record) the
step where it stopped (its final number is the server's last finite model there).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent / "results" / "fbn"


def test_by_round(cell: Path) -> dict[int, float]:
    """Test accuracy (%) by evaluated round of one method's seed folder, mean over clients."""
    metrics = cell / "metrics.jsonl"
    by_round: dict[int, list[float]] = {}
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            record = json.loads(line)
            if record.get("split") == "test":
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
    for run in table:
        print(f"| {run} | " + " | ".join(table[run].get(m, "") for m in methods) + " |")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--by-step":
        for folder in sys.argv[2:]:
            by_step(Path(folder))
            print()
    else:
        main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
