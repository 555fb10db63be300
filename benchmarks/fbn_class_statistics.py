"""How much of a BatchNorm layer's input variance lies between one-class clients (what naive BN misses).

At gamma = 0 every client of the FBN protocol holds one class. Naive BN trains each client's batch with that
client's own channel statistics, and tests with the average of the clients' running statistics, whose
variance lacks the between-client term (FBN paper, Sec. 3). The mismatch a test image of class k meets is
its class mean's offset from the average, in units of the within-class spread: sqrt(B / W) per channel, with
B the variance of the clients' channel means and W the mean of their channel variances. When B / (B + W) is
small, naive BN's training and test normalizations nearly agree and label skew cannot hurt it much.

This script measures that fraction per BatchNorm layer of the FBN CNN, for one class per client on MNIST-M
(the offline stand-in of the FBN benchmark) and on PACS (natural images, where a class's colour and texture
differ more), at initialization and, for MNIST-M, for a trained run's global model:

    python benchmarks/fbn_class_statistics.py --run benchmarks/results/fbn/fbn_mnistm-gamma0 --methods naive_bn centralized_bn

It tests the reading in benchmarks/fbn.md of why naive BN does not collapse on MNIST-M.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

from fednorm.data.domain import normalize_batch
from fednorm.data.federation import load_pool
from fednorm.models.registry import build_model
from fednorm.runs import store

ROOT = Path(__file__).resolve().parent.parent


@torch.no_grad()
def class_statistics(model: nn.Module, groups: list[torch.Tensor], batch: int = 500) -> list[dict]:
    """Per BatchNorm layer (in order): median over channels of B / (B + W) and of sqrt(B / W), where each
    group is one client's (one class's) images, uint8 N x C x H x W, fed through the model in eval mode."""
    layers = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    sums: list[list] = [[] for _ in layers]  # per layer, per group: (count, sum, sum of squares) per channel

    def hook(index):
        def record(_module, inputs, _output):
            x = inputs[0].double()
            dims = [0] + list(range(2, x.ndim))
            count = x.numel() // x.shape[1]
            sums[index][-1] = [a + b for a, b in zip(sums[index][-1], (count, x.sum(dims), (x * x).sum(dims)))]
        return record

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    model.eval()
    try:
        for images in groups:
            for s in sums:
                s.append([0, 0.0, 0.0])
            for start in range(0, len(images), batch):
                model(normalize_batch(images[start:start + batch]))
    finally:
        for h in handles:
            h.remove()
    rows = []
    for s in sums:
        means = torch.stack([total / n for n, total, _ in s])                      # groups x channels
        variances = torch.stack([sq / n for n, _, sq in s]) - means ** 2
        weights = torch.tensor([float(n) for n, _, _ in s], dtype=torch.float64)
        weights = (weights / weights.sum()).unsqueeze(1)
        pooled = (weights * means).sum(0)
        between = (weights * (means - pooled) ** 2).sum(0)
        within = (weights * variances).sum(0).clamp_min(1e-12)
        rows.append({"between_fraction": (between / (between + within)).median().item(),
                     "offset_in_sd": (between / within).sqrt().median().item()})
    return rows


def by_class(x: torch.Tensor, y: torch.Tensor, per_class: int) -> list[torch.Tensor]:
    """The first ``per_class`` images of each class, one tensor per class (one class per client)."""
    return [x[y == c][:per_class] for c in torch.unique(y).tolist()]


def fbn_cnn(num_classes: int, image_size: int, width: float, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return build_model("fbn_cnn", num_classes=num_classes, norm="bn", width=width, image_size=image_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
    parser.add_argument("--run", default=str(ROOT / "benchmarks/results/fbn/fbn_mnistm-gamma0"),
                        help="a finished fbn_mnistm run folder whose global model is measured as trained")
    parser.add_argument("--methods", nargs="+", default=["naive_bn", "centralized_bn"],
                        help="cells of the run whose trained global models are measured (standard-BN methods)")
    parser.add_argument("--per-class", type=int, default=300)
    parser.add_argument("--width", type=float, default=0.5)
    args = parser.parse_args()
    data_dir = Path(args.data_dir)

    mnistm_x, mnistm_y = load_pool("mnistm", data_dir=data_dir)
    mnistm_groups = by_class(mnistm_x, mnistm_y, args.per_class)
    pools = [load_pool(f"pacs/{d}", data_dir=data_dir) for d in ("art_painting", "cartoon", "photo", "sketch")]
    pacs_x = torch.cat([x for x, _ in pools])
    pacs_groups = by_class(pacs_x, torch.cat([y for _, y in pools]), args.per_class)
    side = mnistm_x.shape[-1]

    cases = [("MNIST-M, init", fbn_cnn(10, side, args.width, 0), mnistm_groups),
             ("PACS (4 domains), init", fbn_cnn(7, pacs_x.shape[-1], args.width, 0), pacs_groups)]
    for method in args.methods:
        checkpoint = Path(args.run) / method / "seed0" / store.CHECKPOINT_FILE
        if not checkpoint.exists():
            print(f"(no checkpoint at {checkpoint}: that trained case is skipped)")
            continue
        trained = fbn_cnn(10, side, args.width, 0)
        trained.load_state_dict(store.load_checkpoint(checkpoint)["global_state"])
        cases.append((f"MNIST-M, trained ({Path(args.run).name} {method})", trained, mnistm_groups))

    results = [(name, class_statistics(model, groups)) for name, model, groups in cases]
    layers = len(results[0][1])
    header = " | ".join(f"BN{i + 1}" for i in range(layers))
    print(f"median over channels of B / (B + W), and sqrt(B / W) in brackets, one class per client, "
          f"{args.per_class} images per class\n")
    print(f"| case | {header} |\n|---|" + "---|" * layers)
    for name, rows in results:
        cells = " | ".join(f"{r['between_fraction']:.3f} ({r['offset_in_sd']:.2f})" for r in rows)
        print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
