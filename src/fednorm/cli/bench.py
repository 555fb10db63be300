"""``fednorm bench``: engine speed against a plain PyTorch loop, FLOPs and the machine's peak, time per
round by phase, and peak memory (also across 10 / 100 / 1,000 cross-device clients).

Registered on the main app by :mod:`fednorm.cli.main`; ``benchmarks/bench.py`` runs the same command.
Measurements go to a rich table and a JSON file; nothing here asserts a speed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

console = Console() if sys.stdout.isatty() else Console(width=200)
err_console = Console(stderr=True)

_DEFAULT_DOMAINS = "rendered/print,rendered/textured,rendered/neon,rendered/street,rendered/synth"


def _fail(exc: Exception) -> None:
    # the message is plain text: escaped, so that a "[global]" in it is printed, not read as a style tag
    err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True, markup=True)
    raise typer.Exit(code=2)


def _counts(text: str) -> list[int]:
    try:
        counts = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"--clients takes comma-separated integers, e.g. 10,100,1000; got {text!r}") from None
    if not counts or min(counts) < 1:
        raise ValueError(f"--clients needs at least one positive count, got {text!r}")
    return counts


def bench(
    config: Optional[str] = typer.Argument(None, help="YAML config file or preset name (default: the 'default' preset)"),
    set_: list[str] = typer.Option([], "--set", help="override a config key, e.g. --set training.batch_size=64"),
    method: Optional[str] = typer.Option(None, "--method", help="the method to measure (default: the config's first)"),
    seed: Optional[int] = typer.Option(None, "--seed", help="the seed (default: the config's first)"),
    mode: str = typer.Option("speed", "--mode", help="speed (engine, reference, FLOPs, phases), memory (client "
                             "counts in fresh processes) or all"),
    rounds: int = typer.Option(3, "--rounds", min=1, help="measured rounds, after the warm-up"),
    warmup: int = typer.Option(1, "--warmup", min=0, help="warm-up rounds, not measured"),
    peak_size: int = typer.Option(2048, "--peak-size", min=16, help="side of the square matmul timed as the peak"),
    clients: str = typer.Option("10,100,1000", "--clients", help="memory mode: total client counts"),
    memory_domains: str = typer.Option(_DEFAULT_DOMAINS, "--memory-domains",
                                       help="memory mode: comma-separated domains the clients split evenly over"),
    memory_rounds: int = typer.Option(2, "--memory-rounds", min=1, help="memory mode: rounds per client count"),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="torch threads (default: PyTorch's)"),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="data folder, for domains that are not rendered"),
    out: Optional[Path] = typer.Option(None, "--out", help="JSON file (default: runs/bench-<name>-<time>.json)"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress lines"),
) -> None:
    """Measure a config's engine speed, FLOP rate, time per round by phase and peak memory."""
    from ..data.domain import DataError
    from ..methods.aggregation import UpdateError
    from ..runs.bench import BenchError, run_bench
    from ..runs.config import ConfigError, load_config
    from ..runs.runner import RunError

    def log(msg: str) -> None:
        if not quiet:
            err_console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {msg}", highlight=False)

    try:
        cfg = load_config(config, set_)
        domains = tuple(d.strip() for d in memory_domains.split(",") if d.strip())
        result = run_bench(cfg, source=config, overrides=set_, method=method, seed=seed, mode=mode, rounds=rounds,
                           warmup=warmup, peak_size=peak_size, counts=_counts(clients), memory_domains=domains,
                           memory_rounds=memory_rounds, data_dir=data_dir, threads=threads, log=log)
    except (BenchError, ConfigError, DataError, RunError, UpdateError, FloatingPointError, ValueError) as exc:
        _fail(exc)
    path = out or Path("runs") / f"bench-{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print_result(result)
    console.print(f"results: {path}", highlight=False)


def print_result(result: dict) -> None:
    """The rich tables of a :func:`fednorm.runs.bench.run_bench` result."""
    m, c = result["machine"], result["config"]
    load = m.get("load_average") or []
    console.print(
        f"[bold]{c['name']}[/] {c['method']} seed {c['seed']}: {c['model']} ({c['norm']}), batch {c['batch_size']}, "
        f"{c['precision']}{', channels_last' if c['channels_last'] else ''}"
        f"{', reuse_freed_memory' if c.get('reuse_freed_memory') else ''} | {m['cpu_model']}, "
        f"{m['cpu_capability']}, native bf16 {m['native_bf16']}, {m['torch_threads']} threads, "
        f"load {' '.join(f'{x:.2f}' for x in load)}", highlight=False, soft_wrap=True)
    if "speed" in result:
        s, t = result["speed"], result["throughput"]
        table = Table(title=f"speed ({s['rounds']} rounds after {s['warmup_rounds']} warm-up)")
        for head, justify in (("measure", "left"), ("value", "right"), ("note", "left")):
            table.add_column(head, justify=justify)
        ratio = s["overhead_ratio"]
        per = s["overhead_ratio_per_round"]
        rows = [
            ("engine samples/s", f"{s['engine_samples_per_s']:.1f}", "run_round wall time (training + aggregation)"),
            ("local training samples/s", f"{s['local_training_samples_per_s']:.1f}", "inside ClientRunner.run"),
            ("plain loop samples/s", f"{s['reference_samples_per_s']:.1f}", "same model, batches, optimizer"),
            ("engine overhead ratio", f"{ratio:.3f}",
             f"target >= {s['target_overhead_ratio']} ({'met' if ratio >= s['target_overhead_ratio'] else 'NOT met'});"
             f" per round {per['min']:.3f}-{per['max']:.3f}"),
            ("FLOPs / training sample", f"{s['flops']['train_per_sample'] / 1e6:.2f} M",
             f"forward {s['flops']['forward_per_sample'] / 1e6:.2f} M"),
            ("achieved GFLOP/s (engine)", f"{t['gflops']['engine']:.2f}",
             f"{100 * t['share_of_peak']['engine']:.1f}% of the {t['peak_dtype']} peak"),
            ("achieved GFLOP/s (plain loop)", f"{t['gflops']['reference']:.2f}",
             f"{100 * t['share_of_peak']['reference']:.1f}% of the {t['peak_dtype']} peak"),
        ]
        for name, p in result["peak"].items():
            rows.append((f"peak {name} matmul GFLOP/s", f"{p['gflops']:.1f}",
                         f"{p['size']}-square, best of {p['repeats']}" + (f"; {p['note']}" if p["note"] else "")))
        mem = s["memory"]
        rows += [
            ("peak RSS (process) MiB", f"{mem['ru_maxrss_mib']:.0f}", "ru_maxrss: imports + data + rounds"),
            ("RSS during rounds MiB", _mib(mem["rounds_rss_peak_mib"]), f"after data {_mib(mem['rss_after_data_mib'])}"),
            ("kept client state", f"{s['client_state_bytes'] / 1024:.1f} KiB", "local entries + optimizer states"),
        ]
        for row in rows:
            table.add_row(*row)
        console.print(table)
        phases = Table(title="time per round by phase", caption="every measured round is evaluated and checkpointed")
        for head in ("phase", "s / round", "share"):
            phases.add_column(head, justify="left" if head == "phase" else "right")
        total = s["phases_mean_s"]["round"]
        for name in ("training", "aggregation", "evaluation", "checkpointing", "other"):
            v = s["phases_mean_s"][name]
            phases.add_row(name, f"{v:.3f}", f"{100 * v / total:.1f}%")
        phases.add_row("round", f"{total:.3f}", "100%", style="bold")
        console.print(phases)
    if "memory_scaling" in result:
        ms = result["memory_scaling"]
        table = Table(title=f"peak memory by client count (cross-device, {len(ms['domains'])} domains, "
                            f"{ms['rounds']} rounds, fresh process each)")
        for head in ("clients", "per round", "peak RSS MiB", "RSS rounds MiB", "RSS after data MiB",
                     "client state", "s / round"):
            table.add_column(head, justify="right")
        for r in ms["runs"]:
            table.add_row(str(r["clients"]), str(r["participants_per_round"]), f"{r['ru_maxrss_mib']:.0f}",
                          _mib(r["rounds_rss_peak_mib"]), _mib(r["rss_after_data_mib"]),
                          f"{r['client_state_bytes']} B", f"{r['round_s']:.2f}")
        console.print(table)


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"
