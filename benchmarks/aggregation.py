"""Server aggregation cost per client: fednorm's WeightedMean.add (float32 accumulators, one-pass finiteness
check) against the float64 form it replaced (element-wise isfinite, a float64 copy and a product per entry),
on the state of a config's model; then one cross-device round of 1,000 clients.

    OMP_NUM_THREADS=1 python benchmarks/aggregation.py [--round]
"""

from __future__ import annotations

import argparse
import time

import torch

from fednorm.methods.aggregation import WeightedMean
from fednorm.runs.bench import memory_config
from fednorm.runs.config import load_config
from fednorm.runs.runner import build_engine, build_federation_data


def float64_reference_add(sums: dict, state: dict, weight: float) -> None:
    """The previous aggregation step, kept here only as the benchmark's reference."""
    for k, v in state.items():
        if not torch.isfinite(v).all():
            raise ValueError(k)
        contrib = v.to(torch.float64) * weight
        sums[k] = contrib if k not in sums else sums[k].add_(contrib)


def per_client_ms(add, states, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for s in states:
            add(s)
        best = min(best, (time.perf_counter() - start) / len(states) * 1000)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="default")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--round", action="store_true", help="also time a 1,000-client cross-device round")
    args = parser.parse_args()
    cfg = load_config(args.config)
    model = cfg.model.build(norm=cfg.methods[0].build().norm)
    state = {k: v.detach() for k, v in model.state_dict().items() if v.is_floating_point()}
    states = [{k: v + 0.01 * i for k, v in state.items()} for i in range(args.clients)]
    n = sum(v.numel() for v in state.values())
    mean = WeightedMean(state)
    fast = per_client_ms(lambda s: mean.add(s, 1.0 / args.clients), states)
    sums: dict = {}
    slow = per_client_ms(lambda s: float64_reference_add(sums, s, 1.0 / args.clients), states)
    print(f"{args.config} model, {n / 1e6:.1f} M floats, {torch.get_num_threads()} thread(s): WeightedMean.add "
          f"{fast:.1f} ms per client, float64 reference {slow:.1f} ms ({slow / fast:.1f}x)")
    if args.round:
        method = cfg.methods[0]
        c = memory_config(cfg, method, 0, 1000)
        engine = build_engine(c, c.methods[0], 0, build_federation_data(c, None))
        engine.run_round()  # warm-up
        start = time.perf_counter()
        engine.run_round()
        print(f"cross-device round, 1,000 clients (100 sampled, 37 samples each): {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
