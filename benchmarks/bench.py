"""Engine speed vs a plain PyTorch loop, FLOP rate vs the machine's matmul peak, time per round by phase and
peak memory: the same command as `fednorm bench`, runnable from a checkout.

    python benchmarks/bench.py [CONFIG] [--set key=value ...] [--method fedbn] [--mode speed|memory|all] --out F.json

Results and the commands that produced them: benchmarks/performance.md.
"""

import typer

from fednorm.cli.bench import bench

if __name__ == "__main__":
    typer.run(bench)
