"""Wall time per round of one small FedBN digits experiment: in-process, Flower's simulation runtime (Ray)
and Flower's deployment runtime on localhost (a SuperLink and one SuperNode process per client).

A round here is local training of every client, the server update and the evaluation of every client
(eval_every 1), so the three engines do the same work; the first round (warm-up: imports, data, Ray actors)
is left out of the mean. Flower's rounds are timed from the server's ``participation.jsonl``, the
in-process ones from the runner's progress callback. The three runs must give the same metrics; the
script checks it.

    OMP_NUM_THREADS=1 python benchmarks/flower_round_time.py --out /tmp/flower-bench
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from fednorm.engines.flower.runtime import run_local, simulate
from fednorm.engines.flower.server import PARTICIPATION_FILE, FlowerOptions
from fednorm.runs import store
from fednorm.runs.config import load_config
from fednorm.runs.runner import start_run

EXPERIMENT = [  # the default preset's four rendered digit domains (120 training images each), FedBN, fp32
    "methods=[fedbn]",
    "model.width=0.5",
    "data.percent=0.05",
    "data.rendered_size=3000",
    "training.precision=fp32",
    "federation.eval_every=1",
    "federation.checkpoint_every=1000",
]


def per_round(times: list[float]) -> dict:
    """Mean and spread of the round durations after the first (warm-up) round."""
    gaps = [b - a for a, b in itertools.pairwise(times)][1:]
    return {"rounds_timed": len(gaps), "mean_s": statistics.mean(gaps), "min_s": min(gaps), "max_s": max(gaps)}


def flower_times(run: Path, start: float) -> list[float]:
    records = store.read_metrics(run / "fedbn" / "seed0" / PARTICIPATION_FILE)
    return [start] + [r["time"] for r in records if r["kind"] == "evaluate"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--set", action="append", default=[], help="more config overrides")
    parser.add_argument("--out", type=Path, required=True, help="folder for the three run folders")
    parser.add_argument("--skip", action="append", default=[], choices=["in_process", "simulation", "deployment"])
    args = parser.parse_args()
    config = load_config("default", EXPERIMENT + [f"federation.rounds={args.rounds}"] + args.set)
    options = FlowerOptions(round_timeout=1800, node_wait=300)
    result: dict = {"config": EXPERIMENT + [f"federation.rounds={args.rounds}"] + args.set,
                    "machine": {"cpus": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
                                "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()},
                    "engines": {}}
    runs = {}
    if "in_process" not in args.skip:
        stamps: list[float] = []
        start = time.time()
        start_run(config, args.out / "in_process", progress=lambda *a: stamps.append(time.time()))
        runs["in_process"] = args.out / "in_process"
        result["engines"]["in_process"] = {**per_round(stamps[-(args.rounds + 1):]), "total_s": time.time() - start}
    if "simulation" not in args.skip:
        start = time.time()
        simulate(config, args.out / "simulation", options=options)
        runs["simulation"] = args.out / "simulation"
        result["engines"]["simulation"] = {**per_round(flower_times(runs["simulation"], start)),
                                           "total_s": time.time() - start}
    if "deployment" not in args.skip:
        start = time.time()
        run_local(config, args.out / "deployment", args.out / "deployment-work", options=options)
        runs["deployment"] = args.out / "deployment"
        result["engines"]["deployment"] = {**per_round(flower_times(runs["deployment"], start)),
                                           "total_s": time.time() - start}
    metrics = {name: store.read_metrics(run / "fedbn" / "seed0" / store.METRICS_FILE) for name, run in runs.items()}
    result["same_metrics"] = len({json.dumps(v, sort_keys=True) for v in metrics.values()}) == 1
    (args.out / "flower_round_time.json").write_text(json.dumps(result, indent=2))
    print("| engine | s per round (mean, rounds 2-N) | min | max | whole run (s) |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in result["engines"].items():
        print(f"| {name} | {r['mean_s']:.1f} | {r['min_s']:.1f} | {r['max_s']:.1f} | {r['total_s']:.0f} |")
    print(f"same metrics in every engine: {result['same_metrics']}")


if __name__ == "__main__":
    main()
