"""UniFed's internal and external tables from a run folder (preset unifed_digits or unifed_corrupt_*):
one row per algorithm, without and with client-specific BN (``+ours``), internal accuracy (mean over the
internal clients) and each external client under each mode (global model, test-time BN statistics, FedBN
App. G's average). ``--selected``: at the round of the best mean validation accuracy (UniFed's model
selection), else the final round.

    python benchmarks/unifed_table.py benchmarks/results/unifed/unifed_digits [--selected]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from fednorm.runs.report import read_summaries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--selected", action="store_true")
    args = parser.parse_args()
    key = "selected_acc" if args.selected else "final_acc"
    rows: dict[str, dict[str, list[float]]] = {}
    externals: list[str] = []
    for summary in read_summaries(args.run_dir):
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
        if internal:
            row.setdefault("internal", []).append(float(np.mean(internal)))
    columns = ["internal"] + externals
    print(f"Test accuracy (%), {'validation-selected' if args.selected else 'final'} round, mean over seeds "
          f"({args.run_dir.name}). Internal: mean over the internal clients.\n")
    print("| method | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    try:  # the config's method order
        from fednorm.runs.runner import load_run_config

        order = [m.display for m in load_run_config(args.run_dir).methods]
        rows = {m: rows[m] for m in sorted(rows, key=lambda m: order.index(m) if m in order else len(order))}
    except Exception:  # noqa: BLE001 - a folder of cells without a run config keeps the files' order
        pass
    base = [m for m in rows if not m.endswith("+ours")]
    for method in base + [m for m in rows if m.endswith("+ours") and m.removesuffix("+ours") not in base]:
        for label in (method, f"{method}+ours"):
            if label not in rows:
                continue
            cells = [f"{100 * np.mean(rows[label][c]):.2f}" if rows[label].get(c) else "" for c in columns]
            print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
