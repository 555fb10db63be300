"""How far fp32 gradients are from float64 in NCHW and in channels_last (NHWC), on this CPU.

Why: the fast-path accuracy check (performance.md) found channels_last FedBN runs lower than NCHW ones;
this measures the cause directly. For each case the same weights and inputs run in float64 (the
reference), fp32 NCHW and fp32 channels_last; printed is max |g - g64| / max |g64| for the output and
each gradient. (Float64 itself gives the same numbers in both layouts, to 1e-14: the layouts compute the
same function; the difference is fp32 rounding.)

    OMP_NUM_THREADS=1 python benchmarks/layout_precision.py
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from torch import nn

from fednorm.models.registry import build_model


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.double() - reference).abs().max() / reference.abs().max()).item()


def gradients(module: nn.Module, x: torch.Tensor, loss_fn, dtype: torch.dtype, channels_last: bool):
    """Gradients of the input and of every parameter with a real gradient, in ``dtype`` and layout."""
    module = copy.deepcopy(module).to(dtype)
    x = x.to(dtype).clone()
    if channels_last:
        module = module.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_(True)
    out = module(x)
    loss_fn(out).backward()
    return {"output (forward)": out.detach(), "input": x.grad,
            **{n: p.grad for n, p in module.named_parameters() if p.grad is not None}}


def compare(name: str, module: nn.Module, x: torch.Tensor, loss_fn) -> None:
    ref = gradients(module, x, loss_fn, torch.float64, False)
    nchw = gradients(module, x, loss_fn, torch.float32, False)
    nhwc = gradients(module, x, loss_fn, torch.float32, True)
    print(f"\n{name}: max relative error of fp32 output and gradients against float64")
    print(f"  {'gradient':28s} {'NCHW':>9s} {'NHWC':>9s} {'NHWC/NCHW':>9s}")
    for key, r in ref.items():
        if r.abs().max() < 1e-12:  # e.g. a conv bias followed by BatchNorm: no gradient to speak of
            continue
        a, b = relative_error(nchw[key], r), relative_error(nhwc[key], r)
        print(f"  {key:28s} {a:9.1e} {b:9.1e} {b / a:9.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
    b = args.batch

    def probe(out: torch.Tensor) -> torch.Tensor:
        """A fixed random linear read-out (drawn in float64, then cast), so every dtype sees the same one."""
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        return (out * weights.to(out.dtype)).sum()

    compare("Conv2d 3->64, 5x5, 28x28", nn.Conv2d(3, 64, 5, padding=2), torch.randn(b, 3, 28, 28), probe)
    compare("Conv2d 64->128, 5x5, 7x7", nn.Conv2d(64, 128, 5, padding=2), torch.randn(b, 64, 7, 7), probe)
    compare("BatchNorm2d(64), train mode, 28x28", nn.BatchNorm2d(64), torch.randn(b, 64, 28, 28), probe)
    model = build_model("digit_cnn", norm="bn", num_classes=10)
    y = torch.randint(0, 10, (b,))
    compare("digit CNN (FedBN's, BN), cross-entropy at initialization", model, torch.randn(b, 3, 28, 28),
            lambda out: F.cross_entropy(out, y))


if __name__ == "__main__":
    main()
