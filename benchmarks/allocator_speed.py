"""Time a training step with glibc's default allocator settings and with ``federation.reuse_freed_memory``
(:mod:`fednorm.engines.allocator`): `python benchmarks/allocator_speed.py [--repeats 3] [--steps 20]`.

Each (model, batch, setting) is timed in a fresh interpreter (glibc's heap and thresholds depend on what a
process did before, so one process cannot switch back to a clean "off"), alternating off / on ``--repeats``
times so that load changes hit both alike. A step is SGD with momentum on cross-entropy, fp32, NCHW, the
batch fixed (the engine's step minus data loading). Per row: ms per step (median of the repeats), the
system (kernel) time and the minor page faults per step, and the speed-up on / off.
"""

import argparse
import json
import statistics
import subprocess
import sys

CHILD = """
import json, resource, sys, time
import torch, torch.nn.functional as F
from fednorm.engines.allocator import reuse_freed_memory
from fednorm.models import build_model
name, size, classes, batch, steps, setting = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \\
    int(sys.argv[5]), sys.argv[6]
reuse_freed_memory(setting == "on")
torch.manual_seed(0)
model = build_model(name, num_classes=classes, norm="bn", classifier="fedwon")
x, y = torch.randn(batch, 3, size, size), torch.randint(0, classes, (batch,))
opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
for i in range(3 + steps):
    if i == 3:
        start, usage = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()
end = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"ms": (time.perf_counter() - start) / steps * 1000, "sys_ms": (end.ru_stime - usage.ru_stime) /
                  steps * 1000, "faults": (end.ru_minflt - usage.ru_minflt) / steps}))
"""

CASES = [  # model, image side, classes, batch: the digit CNN of the digits benchmarks, AlexNet of PACS / Office
    ("digit_cnn", 28, 10, 32),
    ("digit_cnn", 28, 10, 2),
    ("alexnet", 64, 7, 32),
    ("alexnet", 64, 7, 2),
]


def measure(case, steps: int, setting: str) -> dict:
    name, size, classes, batch = case
    done = subprocess.run([sys.executable, "-c", CHILD, name, str(size), str(classes), str(batch), str(steps),
                           setting], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args()
    import torch  # only for the thread count line
    print(f"torch threads {torch.get_num_threads()}")
    print("| model | batch | off ms/step | on ms/step | speed-up | off / on sys ms/step | off / on page faults/step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for case in CASES:
        runs = {"off": [], "on": []}
        for _ in range(args.repeats):
            for setting in ("off", "on"):
                runs[setting].append(measure(case, args.steps, setting))
        med = {s: {k: statistics.median(r[k] for r in runs[s]) for k in runs[s][0]} for s in runs}
        row = {"model": case[0], "batch": case[3], "off": med["off"], "on": med["on"],
               "speedup": med["off"]["ms"] / med["on"]["ms"]}
        rows.append(row)
        print(f"| {case[0]} | {case[3]} | {med['off']['ms']:.1f} | {med['on']['ms']:.1f} | {row['speedup']:.2f}x | "
              f"{med['off']['sys_ms']:.1f} / {med['on']['sys_ms']:.1f} | "
              f"{med['off']['faults']:.0f} / {med['on']['faults']:.0f} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "steps": args.steps, "repeats": args.repeats,
                       "rows": rows}, f, indent=1)
