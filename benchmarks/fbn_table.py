"""Tables of the FBN experiments from their run folders (benchmarks/results/fbn/<preset>-<setting>/).

    python benchmarks/fbn_table.py            # markdown: final and best test accuracy per method and setting

Each run folder holds every method of its preset for one setting (gamma, Dirichlet alpha, attack);
a cell still running shows its last evaluated round, a diverged one (federation.on_divergence: record) the
step where it stopped (its final number is the server's last finite model there).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent / "results" / "fbn"


def cell_numbers(cell: Path) -> tuple[float, float, int] | None:
    """(final, best, round of final) test accuracy (%) of one method's seed folder, mean over clients."""
    metrics = cell / "metrics.jsonl"
    if not metrics.exists():
        return None
    by_round: dict[int, list[float]] = {}
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if record.get("split") == "test":
            by_round.setdefault(record["round"], []).append(record["acc"])
    if not by_round:
        return None
    means = {r: 100 * sum(v) / len(v) for r, v in by_round.items()}
    last = max(means)
    return means[last], max(means.values()), last


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
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
