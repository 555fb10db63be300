"""Time one local training step of the digit CNN (batch 32) in fp32 and bf16 autocast, NCHW and
channels_last, eager and (``--compile``) ``torch.compile``d: `python benchmarks/step_speed.py [--compile]`.
Prints ms per step (mean of --steps after 3 warm-up steps; a compiled model's warm-up includes its
compilation). Shows whether this CPU computes bf16 natively (what `precision: auto` decides on) and
whether compilation is a speed lever for the papers' small CNNs on it. Under load, compare rows taken
together, not with older records."""

import argparse
import time

import torch
import torch.nn.functional as F

from fednorm.methods.local_update import native_bf16
from fednorm.models import DigitCNN


def step_ms(precision: str, channels_last: bool, compiled: bool = False, batch: int = 32, steps: int = 10) -> float:
    torch.manual_seed(0)
    model = DigitCNN()
    x, y = torch.randn(batch, 3, 28, 28), torch.randint(0, 10, (batch,))
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    forward = torch.compile(model) if compiled else model
    for i in range(3 + steps):
        if i == 3:
            start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = forward(x)
        loss = F.cross_entropy(out.float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return (time.perf_counter() - start) / steps * 1000


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile", action="store_true", help="add torch.compile rows (fp32; bf16 only where native)")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    print(f"threads {torch.get_num_threads()}, capability {torch.backends.cpu.get_cpu_capability()}, "
          f"native bf16 {native_bf16()}")
    modes = [False, True] if args.compile else [False]
    for precision in ("fp32", "bf16"):
        for cl in (False, True):
            for compiled in modes:
                if compiled and precision == "bf16" and not native_bf16():
                    continue  # emulated bf16 is 20-30x slower; compiling it measures nothing useful
                layout = "channels_last" if cl else "nchw"
                ms = step_ms(precision, cl, compiled, steps=args.steps)
                print(f"{precision} {layout:13s} {'compiled' if compiled else 'eager':8s} {ms:8.1f} ms/step", flush=True)
