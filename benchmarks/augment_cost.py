"""Cost of a training-time augmentation (``training.augment``) against the training step it feeds: ms per batch
of the batched augmentation and of one SGD step of the model on the augmented batch, alternated.

    OMP_NUM_THREADS=1 python benchmarks/augment_cost.py                      # flamby_isic: ResNet-18, 64 x 224 px
    OMP_NUM_THREADS=1 python benchmarks/augment_cost.py --augment fedbn_objects --model alexnet --size 256 --batch 32
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from fednorm.data.domain import normalize_batch
from fednorm.methods.augment import AUGMENTS, BatchAugment
from fednorm.models.registry import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--augment", choices=[a for a in AUGMENTS if a != "none"], default="flamby_isic")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--size", type=int, default=224, help="stored image side")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--classes", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (args.batch, 3, args.size, args.size), generator=g, dtype=torch.uint8)
    y = torch.randint(0, args.classes, (args.batch,), generator=g)
    augment = BatchAugment(args.augment, torch.Generator().manual_seed(1))
    model = build_model(args.model, norm="bn", num_classes=args.classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    augment_ms, step_ms = [], []
    for repeat in range(args.repeats + 1):  # the first pass warms up
        start = time.perf_counter()
        batch = augment(x)
        middle = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(normalize_batch(batch)), y).backward()
        optimizer.step()
        end = time.perf_counter()
        if repeat:
            augment_ms.append((middle - start) * 1e3)
            step_ms.append((end - middle) * 1e3)
    a, s = min(augment_ms), min(step_ms)
    print(f"{args.augment}: {args.batch} images of {args.size} px -> {tuple(batch.shape[-2:])}: "
          f"augmentation {a:.0f} ms, {args.model} training step {s:.0f} ms (best of {args.repeats}, {torch.get_num_threads()} threads): "
          f"the augmentation is {100 * a / s:.1f} % of the step")


if __name__ == "__main__":
    main()
