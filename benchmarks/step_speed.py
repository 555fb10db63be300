"""Time one local training step of the digit CNN (batch 32) in fp32 and bf16 autocast, NCHW and
channels_last: `python benchmarks/step_speed.py`. Prints ms per step (mean of 10 after 3 warm-up).
Shows whether this CPU computes bf16 natively (what `precision: auto` decides on)."""

import time

import torch
import torch.nn.functional as F

from fednorm.methods.local_update import native_bf16
from fednorm.models import DigitCNN


def step_ms(precision: str, channels_last: bool, batch: int = 32) -> float:
    torch.manual_seed(0)
    model = DigitCNN()
    x, y = torch.randn(batch, 3, 28, 28), torch.randint(0, 10, (batch,))
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(13):
        if i == 3:
            start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = model(x)
        loss = F.cross_entropy(out.float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return (time.perf_counter() - start) / 10 * 1000


if __name__ == "__main__":
    print(f"threads {torch.get_num_threads()}, capability {torch.backends.cpu.get_cpu_capability()}, "
          f"native bf16 {native_bf16()}")
    for precision in ("fp32", "bf16"):
        for cl in (False, True):
            print(f"{precision} {'channels_last' if cl else 'nchw':13s} {step_ms(precision, cl):8.1f} ms/step")
