"""Trace NNM's neighbour sets in robust FBN runs: why the median and the trimmed mean can agree exactly.

In benchmarks/fbn.md, under FOE at gamma 0.01, NNM + median and NNM + trimmed mean gave the same accuracy at
every evaluation. The explanation offered there: when each honest client's n - f nearest neighbours are
exactly the honest clients, NNM maps every honest row to the same honest mean; those h = n - f identical rows
then fill the middle of every coordinate's sorted values, and both rules (median: the middle 1-2 values;
trimmed mean: the middle n - 2f) return that mean exactly. This script runs the robust preset for a few
steps with ``nearest_neighbor_mixing`` wrapped, and counts, over every aggregation NNM is applied to (each BN
layer's means, variances and, for FBN, squared deviations, at every step):

- "honest closed": every honest row's n - f nearest rows are the honest rows;
- "rules agree": median and trimmed mean of the mixed rows are identical (max |difference| == 0).

    python benchmarks/fbn_nnm_trace.py --attacks fall_of_empires a_little_is_enough sign_flip --steps 100

Training itself is the preset's (shortened: width 0.5), with the trimmed mean as the rule; the comparison of
the two rules is made on the same mixed rows at each call.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from fednorm.methods import robust
from fednorm.runs.config import load_config
from fednorm.runs.runner import build_federation_data, start_run, threat

ROOT = Path(__file__).resolve().parent.parent


def trace(attack: str, gamma: float, steps: int, method: str, data_dir: Path) -> dict:
    config = load_config("fbn_robust_mnistm", [
        f"data.gamma={gamma}", f"federation.byzantine.attack={attack}", "model.width=0.5",
        f"federation.rounds={steps}", f"federation.eval_every={steps}", f"federation.checkpoint_every={steps}",
        "seeds=[0]",
        f"methods=[{{name: {method}, server: {{rule: trimmed_mean, nnm: true, robust_scope: statistics}}}}]",
    ])
    clients = build_federation_data(config, data_dir)
    byzantine = threat(config, clients).byzantine
    byz_rows = [i for i, c in enumerate(clients) if c.name in byzantine]
    n, f = len(clients), len(byz_rows)
    honest = set(range(n)) - set(byz_rows)
    counts = {"calls": 0, "honest_closed": 0, "rules_agree": 0, "max_rule_gap": 0.0}
    original = robust.nearest_neighbor_mixing

    def traced(x: torch.Tensor, f_: int) -> torch.Tensor:
        mixed = original(x, f_)
        nearest = robust.nearest_neighbors(x, f_)
        closed = all(set(nearest[i].tolist()) == honest for i in honest)
        gap = float((robust.coordinate_median(mixed) - robust.trimmed_mean(mixed, f_)).abs().max())
        counts["calls"] += 1
        counts["honest_closed"] += int(closed)
        counts["rules_agree"] += int(gap == 0.0)
        counts["max_rule_gap"] = max(counts["max_rule_gap"], gap)
        return mixed

    robust.nearest_neighbor_mixing = traced
    try:
        with tempfile.TemporaryDirectory() as tmp:
            start_run(config, Path(tmp) / "run", str(data_dir), clients=clients)
    finally:
        robust.nearest_neighbor_mixing = original
    return {"attack": attack, "gamma": gamma, "method": method, "steps": steps, "n": n, "f": f,
            "byzantine_rows": byz_rows, **counts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attacks", nargs="+", default=["fall_of_empires", "a_little_is_enough", "sign_flip"])
    parser.add_argument("--gamma", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--methods", nargs="+", default=["fbn", "naive_bn"])
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    args = parser.parse_args()
    print("| method | attack | NNM calls | honest rows' neighbours = honest set | median == trimmed mean | max gap |")
    print("|---|---|---|---|---|---|")
    for method in args.methods:
        for attack in args.attacks:
            r = trace(attack, args.gamma, args.steps, method, args.data_dir)
            print(f"| {method} | {attack} | {r['calls']} | {r['honest_closed']} | {r['rules_agree']} | "
                  f"{r['max_rule_gap']:.3g} |", flush=True)


if __name__ == "__main__":
    main()
