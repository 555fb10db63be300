"""The ``fednorm`` command: run, resume and report experiments; list methods."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from ..data.domain import DataError
from ..methods.aggregation import UpdateError
from ..methods.presets import PRESETS
from ..runs.config import ConfigError, load_config, preset_names
from ..runs.report import ResultsTable, build_table, read_summaries
from ..runs.runner import RunError, load_run_config, resume_run, start_run

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)

# not a terminal (a pipe, a log file, CI): wide enough that result tables never wrap
console = Console() if sys.stdout.isatty() else Console(width=200)
err_console = Console(stderr=True)

_USER_ERRORS = (ConfigError, DataError, RunError, UpdateError, FloatingPointError)


def _fail(exc: Exception) -> None:
    err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True, markup=True)
    raise typer.Exit(code=2)


def _print_table(table: ResultsTable, title: str) -> None:
    rows = table.text_rows()
    t = Table(title=title, show_lines=False)
    for i, head in enumerate(rows[0]):
        t.add_column(head, justify="left" if i == 0 else "right", no_wrap=True)
    for row in rows[1:]:
        t.add_row(*row, style="dim" if row[0].strip() == "paper" else None)
    console.print(t)
    if table.footnote():
        console.print(table.footnote(), style="italic")


class _Progress:
    """A rich progress bar over every round of every (method, seed) cell."""

    def __init__(self, total: int, quiet: bool) -> None:
        self.bar = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=console, disable=quiet,
        )
        self.task = self.bar.add_task("preparing data", total=total, info="")
        self.done: dict[tuple[str, int], int] = {}

    def __call__(self, label: str, seed: int, rnd: int, rounds: int, last: dict) -> None:
        key = (label, seed)
        advance = max(0, rnd - self.done.get(key, 0))
        self.done[key] = max(rnd, self.done.get(key, 0))
        info = " ".join(f"{k}={v:.3f}" for k, v in last.items())
        self.bar.update(self.task, advance=advance, description=f"{label} seed {seed}", info=info)


def _finish(run_dir: Path, results, config) -> None:
    table = build_table([r.summary for r in results], paper=config.paper)
    _print_table(table, f"{config.name}: test {table.score_label} (%) after round {config.federation.rounds}, "
                        "mean (std) over seeds")
    console.print(f"run folder: {run_dir}  (results.md, comparison.png, <method>/seed<k>/metrics.jsonl)")


@app.command()
def run(
    config: Optional[str] = typer.Argument(None, help="YAML config file or preset name (default: the 'default' preset)"),
    set_: list[str] = typer.Option([], "--set", help="override a config key, e.g. --set federation.rounds=5"),
    out: Optional[Path] = typer.Option(None, "--out", help="run folder (default: runs/<name>-<time>)"),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="data folder (else FEDNORM_DATA, else the user cache)"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress bar"),
) -> None:
    """Run an experiment: every method x seed of the config, into a run folder."""
    try:
        cfg = load_config(config, set_)
        run_dir = out or Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        console.print(f"[bold]{cfg.name}[/]: {cfg.description or ''}", highlight=False)
        progress = _Progress(cfg.federation.rounds * len(cfg.methods) * len(cfg.seeds), quiet)
        with progress.bar:
            results = start_run(cfg, run_dir, data_dir=data_dir, progress=progress)
    except _USER_ERRORS as exc:
        _fail(exc)
    _finish(run_dir, results, cfg)


@app.command()
def resume(
    run_dir: Path = typer.Argument(..., help="a run folder written by `fednorm run`"),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="data folder, if it moved since the run started"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress bar"),
) -> None:
    """Continue a stopped run from its last checkpoints; the results equal an uninterrupted run."""
    try:
        cfg = load_run_config(run_dir)
        progress = _Progress(cfg.federation.rounds * len(cfg.methods) * len(cfg.seeds), quiet)
        with progress.bar:
            results = resume_run(run_dir, data_dir=data_dir, progress=progress)
    except _USER_ERRORS as exc:
        _fail(exc)
    _finish(run_dir, results, cfg)


@app.command()
def report(
    run_dirs: list[Path] = typer.Argument(..., help="run folders (or cell folders) to combine"),
    best: bool = typer.Option(False, "--best", help="best test accuracy over rounds instead of the final one"),
    selected: bool = typer.Option(False, "--selected", help="test accuracy at the round of the best mean "
                                  "validation accuracy (model selection, UniFed; needs validation data)"),
    markdown: bool = typer.Option(False, "--markdown", help="print a markdown table"),
) -> None:
    """Mean (std) over seeds per client and on average, in the papers' table layout."""
    summaries, paper = [], {}
    for d in run_dirs:
        if not d.exists():
            _fail(RunError(f"{d} does not exist"))
        found = read_summaries(d)
        if not found:
            _fail(RunError(f"{d} holds no finished cell (no summary.json); finish it with `fednorm resume {d}`"))
        summaries += found
        try:
            paper.update(load_run_config(d).paper or {})
        except (RunError, ConfigError):
            pass
    metric = "selected_acc" if selected else "best_acc" if best else "final_acc"
    table = build_table(summaries, paper=paper or None, metric=metric)
    which = "validation-selected" if selected else "best" if best else "final"
    if markdown:
        console.print(table.markdown(), highlight=False, markup=False)
    else:
        _print_table(table, f"test {table.score_label} (%), {which}, mean (std) over seeds")


@app.command()
def methods() -> None:
    """List the methods, one line each."""
    for name, m in PRESETS.items():
        axes = [f"policy {m.policy}"] + ([f"norm {m.norm}"] if m.norm else []) + (
            [f"AGC {m.agc_clip:g}"] if m.agc_clip else [])
        console.print(f"[bold]{name:12s}[/] {m.summary}  [dim]({m.paper}; {', '.join(axes)})[/]", highlight=False,
                      soft_wrap=True)


@app.command()
def presets() -> None:
    """List the experiment presets shipped with fednorm."""
    for name in preset_names():
        console.print(f"[bold]{name:20s}[/] {load_config(name).description}", highlight=False, soft_wrap=True)


from .bench import bench  # noqa: E402 - next to its registration
app.command("bench")(bench)


data_app = typer.Typer(no_args_is_help=True, help="Prepare datasets in the data folder.")
app.add_typer(data_app, name="data")


@data_app.command("list")
def data_list(
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="data folder (else FEDNORM_DATA, else the user cache)"),
) -> None:
    """The domains fednorm knows, the file each reads, and whether it is in the data folder."""
    from ..data.datafolder import resolve_data_dir
    from ..data.federation import domain_file, known_domains

    folder = resolve_data_dir(data_dir)
    t = Table(title=f"domains (data folder {folder})")
    for head in ("domain", "file", "here"):
        t.add_column(head)
    for domain in known_domains():
        rel = domain_file(domain)
        if rel is None:
            t.add_row(domain, "(rendered in memory)", "yes")
            continue
        t.add_row(domain, rel, "yes" if (folder / rel).is_file() else "no")
    t.add_row("corrupt/<corruption>/<severity>/<domain>", "(generated from the domain, cached)", "-")
    console.print(t)
    console.print("office_caltech10/<d>@<size>, domainnet/<d>@<size>: another prepared size (default 64); "
                  "docs/datasets.md lists every name", highlight=False, soft_wrap=True)


@data_app.command("verify")
def data_verify(
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="data folder (else FEDNORM_DATA, else the user cache)"),
) -> None:
    """Check the size and sha256 of every file the folder's manifest lists; exit 1 if one is wrong."""
    from ..data.datafolder import resolve_data_dir, verify_folder

    try:
        report = verify_folder(resolve_data_dir(data_dir))
    except DataError as exc:
        _fail(exc)
    for file, status in report:
        console.print(f"{'[green]ok[/]' if status == 'ok' else '[red]BAD[/]'}  {file}  {'' if status == 'ok' else status}",
                      highlight=False)
    if any(status != "ok" for _, status in report):
        raise typer.Exit(code=1)


@data_app.command("prepare")
def data_prepare(
    dataset: str = typer.Argument(..., help="svhn, synthdigits, cifar10, office_caltech10 or domainnet"),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="data folder (else FEDNORM_DATA, else the user cache)"),
    raw_dir: Optional[str] = typer.Option(None, "--raw-dir", help="folder of the official files (default DATA_DIR/raw/DATASET)"),
    fedbn_dir: Optional[str] = typer.Option(None, "--fedbn-dir", help="svhn/synthdigits: read med-air/FedBN's partition files"),
    size: Optional[int] = typer.Option(None, "--size", help="office_caltech10/domainnet: image side (default 64; papers 256)"),
    domains: Optional[str] = typer.Option(None, "--domains", help="office_caltech10/domainnet: comma-separated domains (default all)"),
    no_download: bool = typer.Option(False, "--no-download", help="never download; use the files in --raw-dir"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress bar"),
) -> None:
    """Download (resumable, checksummed) and convert a dataset into the data folder's npz format."""
    from ..data.datafolder import resolve_data_dir
    from ..data.prepare import OBJECT_PREPARERS, PREPARERS, prepare_fedbn_digits

    if dataset not in PREPARERS:
        _fail(ValueError(f"unknown dataset {dataset!r}; choose one of {', '.join(PREPARERS)}"))
    if (size is not None or domains is not None) and dataset not in OBJECT_PREPARERS:
        _fail(ValueError(f"--size and --domains apply to {' and '.join(OBJECT_PREPARERS)} only"))
    try:
        folder = resolve_data_dir(data_dir)
        if fedbn_dir is not None:
            if dataset not in ("svhn", "synthdigits"):
                _fail(ValueError("--fedbn-dir applies to svhn and synthdigits only"))
            path = prepare_fedbn_digits(dataset, folder, Path(fedbn_dir))
        elif dataset in OBJECT_PREPARERS:
            extra = {"domains": [d.strip() for d in domains.split(",") if d.strip()] if domains else None}
            if size is not None:
                extra["size"] = size
            path = PREPARERS[dataset](folder, raw_dir=raw_dir, download=not no_download, progress=not quiet, **extra)
        else:
            path = PREPARERS[dataset](folder, raw_dir=raw_dir, download=not no_download, progress=not quiet)
    except (DataError, ValueError) as exc:
        _fail(exc)
    for p in path if isinstance(path, list) else [path]:
        console.print(f"wrote {p} and its manifest entry", highlight=False)


@data_app.command("show")
def data_show(
    domain: str = typer.Argument(..., help="a domain name, e.g. mnistm, pacs/photo, corrupt/fog/3/mnistm"),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="data folder (else FEDNORM_DATA, else the user cache)"),
    out: Optional[Path] = typer.Option(None, "--out", help="PNG file of the sample grid (default <domain>.png here)"),
    per_class: int = typer.Option(8, "--per-class", min=1, max=32, help="images per class in the grid"),
    seed: int = typer.Option(0, "--seed", help="split, rendering and corruption seed (data.split_seed of a run)"),
) -> None:
    """Image counts per split and class of a domain, and a PNG grid of sample images."""
    from ..data.datafolder import resolve_data_dir
    from ..data.federation import is_rendered
    from ..data.show import sample_grid, view_domain

    try:
        folder = None if is_rendered(domain) else resolve_data_dir(data_dir)
        view = view_domain(domain, data_dir=folder, seed=seed)
        png = sample_grid(view, out or Path(domain.replace("/", "_").replace("@", "_") + ".png"),
                          per_class=per_class, seed=seed)
    except (DataError, ValueError) as exc:
        _fail(exc)
    counts = view.counts
    t = Table(title=domain)
    t.add_column("class")
    for name in counts:
        t.add_column(name, justify="right")
    t.add_column("total", justify="right")
    for label, cls in enumerate(view.classes):
        row = [counts[name][label] for name in counts]
        t.add_row(f"{label} {cls}", *map(str, row), str(sum(row)))
    totals = [sum(c) for c in counts.values()]
    t.add_row("all", *map(str, totals), str(sum(totals)), style="bold")
    console.print(t)
    console.print(f"{view.spec.image_size} x {view.spec.image_size} images, origin {view.spec.origin}; {view.note}",
                  style="italic", highlight=False, soft_wrap=True)
    console.print(f"sample grid: {png}", highlight=False)


if __name__ == "__main__":
    app()
