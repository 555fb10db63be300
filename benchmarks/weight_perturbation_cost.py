"""Compute of HarmoFL's weight perturbation: ms per local step of the digit CNN at batch 32 with and without
it (two forward/backward passes per step against one), alternating the two to share the machine's load.

    OMP_NUM_THREADS=1 python benchmarks/weight_perturbation_cost.py [--width 1.0] [--steps 20]
"""

from __future__ import annotations

import argparse
import time

import torch

from fednorm.data.domain import Split, normalize_batch
from fednorm.methods.local_update import LocalTraining, train_locally
from fednorm.models import DigitCNN


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    data = Split(torch.randint(0, 256, (32 * args.steps, 3, 28, 28), generator=g, dtype=torch.uint8),
                 torch.randint(0, 10, (32 * args.steps,), generator=g))
    cfg = LocalTraining(batch_size=32, lr=0.01, momentum=0.9)
    times: dict[float, list[float]] = {0.0: [], 0.05: []}
    for _ in range(args.repeats + 1):  # the first pass warms up
        for alpha, durations in times.items():
            model = DigitCNN(width=args.width)
            start = time.perf_counter()
            train_locally(model, data, cfg, generator=torch.Generator().manual_seed(1), prepare=normalize_batch,
                          weight_perturbation=alpha)
            durations.append((time.perf_counter() - start) / args.steps * 1000)
    plain, wp = min(times[0.0][1:]), min(times[0.05][1:])
    print(f"digit CNN width {args.width}, batch 32, {torch.get_num_threads()} thread(s): plain {plain:.1f} ms/step, "
          f"weight perturbation {wp:.1f} ms/step ({wp / plain:.2f}x)")


if __name__ == "__main__":
    main()
