"""The ``fednorm`` command: run, resume and report experiments; list methods."""

from __future__ import annotations

import enum
import sys
import time
import warnings
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.measure import Measurement
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from ..data.domain import DataError, DataWarning
from ..engines.device import DeviceError
from ..methods.aggregation import DivergenceError, UpdateError
from ..methods.presets import PRESETS
from ..runs.config import (ON_DIVERGENCE, ConfigError, ConfigWarning, apply_overrides, load_config, preset_names,
                           validate)
from ..runs.store import CorruptFileError
from ..runs.report import ResultsTable, build_table, collect_runs, no_finished_cell, read_summaries
from ..runs.runner import (RunBusy, RunError, RunWarning, busy_error, load_run_config, resolved_hardware, resume_run,
                           run_holder, start_run, unfinished_cells, with_device)

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)

# Choices as Enums: typer reads them the same in every version (its `click_type=click.Choice(...)` is gone in
# typer 0.29, which a fresh `pip install -e .` picks without Flower's cap)
OnDivergenceChoice = enum.Enum("OnDivergenceChoice", {v: v for v in ON_DIVERGENCE}, type=str)
AvgStdChoice = enum.Enum("AvgStdChoice", {v: v for v in ("seeds", "clients")}, type=str)

# not a terminal (a pipe, a log file, CI): wide enough that result tables never wrap
console = Console() if sys.stdout.isatty() else Console(width=200)
# --data-dir of the commands that build a federation from a config (runs.runner, engines.flower.node)
_CONFIGURED_DATA_DIR = "data folder (else the config's data.data_dir, else FEDNORM_DATA, else the user cache)"
err_console = Console(stderr=True)

_USER_ERRORS = (ConfigError, DataError, DeviceError, RunError, UpdateError, FloatingPointError, CorruptFileError)
# run and resume also show ValueError as a message: the data protocol's and the checkpoint's checks raise it with
# what is wrong and what to do (e.g. "cannot give 1000 clients ..."), as the other commands already do
_RUN_ERRORS = (*_USER_ERRORS, ValueError)


_python_showwarning = warnings.showwarning


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A ConfigWarning, RunWarning or DataWarning as one ``warning:`` line: its location (pydantic's, the runner's,
    the loader's) tells a user nothing."""
    if issubclass(category, (ConfigWarning, RunWarning, DataWarning)):
        err_console.print(f"[bold yellow]warning:[/] {escape(str(message))}", highlight=False, soft_wrap=True)
    else:
        _python_showwarning(message, category, filename, lineno, file, line)


@app.callback()
def _cli() -> None:
    # every command loads a config: its warnings are shown the CLI's way (the app's help stays the module's)
    warnings.showwarning = _show_warning


def _fail(exc: Exception, run_dir: Path | None = None) -> None:
    # the message is plain text: escaped, so that a "[global]" in it is printed, not read as a style tag
    err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True, markup=True)
    if run_dir is not None and (run_dir / "config.yaml").exists() and not isinstance(exc, RunBusy):
        # (RunBusy: the folder is another process's now; its message says to wait, there is nothing to fix)
        if isinstance(exc, DivergenceError):
            # resume goes on with the run's own config: the same settings diverge again at the same round
            err_console.print(
                f"what finished is kept in {run_dir}. A plain `fednorm resume` goes on with the run's own config, so "
                f"it would diverge again: for a lower learning rate (training.lr, or a method's own lr) start a new run "
                f"from that config, e.g. `fednorm run {run_dir / 'config.yaml'} --set training.lr=... --out NEW_DIR`",
                highlight=False, soft_wrap=True)
        else:
            err_console.print(f"what finished is kept in {run_dir}; once fixed, `fednorm resume {run_dir}` goes on",
                              highlight=False, soft_wrap=True)
    raise typer.Exit(code=2)


def _interrupted(run_dir: Path | None) -> None:
    where = (f"; `fednorm resume {run_dir}` goes on from the last checkpoint"
             if run_dir is not None and (run_dir / "config.yaml").exists() else "")
    err_console.print(f"stopped{where}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=130)


def _print_table(table: ResultsTable, title: str) -> None:
    rows = table.text_rows()
    t = Table(title=title, show_lines=False)
    for i, head in enumerate(rows[0]):
        t.add_column(head, justify="left" if i == 0 else "right", no_wrap=True)
    for row in rows[1:]:
        t.add_row(*row, style="dim" if row[0].strip() == "paper" else None)
    if Measurement.get(console, console.options.update_width(10**6), t).maximum > console.width:
        # wider than the terminal: rich would shrink the columns and cut the numbers; markdown lines wrap whole
        console.print(f"{title}\n\n{table.markdown()}", highlight=False, markup=False, soft_wrap=True)
        return
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
        if key not in self.done and rnd > 0:  # a cell's first call: where a resumed run picks it up
            state = ("done earlier, kept (its summary.json)" if rnd >= rounds  # finished, or recorded as diverged
                     else f"resuming from its checkpoint at round {rnd} of {rounds}")
            self.bar.console.print(f"{label} seed {seed}: {state}", highlight=False)
        advance = max(0, rnd - self.done.get(key, 0))
        self.done[key] = max(rnd, self.done.get(key, 0))
        info = " ".join(f"{k}={v:.3f}" for k, v in last.items())
        self.bar.update(self.task, advance=advance, description=f"{label} seed {seed}", info=info)


def _hardware_line(config) -> str:
    """Where and how the run trains, with ``auto`` resolved: 'training on cpu, fp32, NCHW'."""
    hw = resolved_hardware(config)
    where = f"{hw['device']} ({hw['gpu']})" if "gpu" in hw else hw["device"]
    return f"training on {where}, {hw['precision']}, {'channels_last' if hw['channels_last'] else 'NCHW'}"


def _print_run_table(config, summaries, engine: str = "") -> None:
    """A run's per-client table with the paper's numbers for its setting beside ours."""
    paper, paper_source = config.paper_for_setting()
    table = build_table(summaries, paper=paper, paper_source=paper_source)
    _print_table(table, f"{config.name}{engine}: test {table.score_label} (%) after round {config.federation.rounds}, "
                        "mean (population std) over seeds")


def _train(run_dir: Path, config, rounds: int, quiet: bool, train) -> None:
    """``train(progress)`` (a start or a resume) under a progress bar over every round of every cell, then the
    run's table: what `run` and `resume` share. The table's config is the folder's own (a resume with --rounds
    has just rewritten it)."""
    progress = _Progress(rounds * len(config.methods) * len(config.seeds), quiet)
    with progress.bar:
        results = train(progress)
    _print_run_table(load_run_config(run_dir), [r.summary for r in results])
    console.print(f"run folder: {run_dir}  (results.md, comparison.png, <method>/seed<k>/metrics.jsonl)")


@app.command()
def run(
    config: Optional[str] = typer.Argument(None, help="YAML config file or preset name (default: the 'default' preset)"),
    set_: list[str] = typer.Option([], "--set", help="override a config key, e.g. --set federation.rounds=5"),
    out: Optional[Path] = typer.Option(None, "--out", help="run folder (default: runs/<name>-<time>)"),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help=_CONFIGURED_DATA_DIR),
    quiet: bool = typer.Option(False, "--quiet", help="no progress bar"),
) -> None:
    """Run an experiment: every method x seed of the config, into a run folder."""
    run_dir = None
    try:
        cfg = load_config(config, set_)
        run_dir = out or Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        console.print(f"[bold]{cfg.name}[/]: {cfg.description or ''}", highlight=False)
        if set_:  # the description is the preset's: say what this run changed (data.domains, rounds, ...)
            console.print(f"changed here: {', '.join(set_)}", highlight=False, markup=False)
        console.print(f"[dim]{_hardware_line(cfg)}; run folder {run_dir}[/]", highlight=False)
        _train(run_dir, cfg, cfg.federation.rounds, quiet,
               lambda progress: start_run(cfg, run_dir, data_dir=data_dir, progress=progress))
    except _RUN_ERRORS as exc:
        _fail(exc, run_dir)
    except KeyboardInterrupt:
        _interrupted(run_dir)


@app.command()
def resume(
    run_dir: Path = typer.Argument(..., help="a run folder written by `fednorm run`"),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="data folder, if it moved since the run started"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress bar"),
    device: Optional[str] = typer.Option(None, "--device", help="train on another device than the run's config says "
                                         "(auto, cpu, cuda, cuda:N): a GPU run finishing on a CPU machine"),
    rounds: Optional[int] = typer.Option(None, "--rounds", min=1, help="extend the run to this many rounds: "
                                         "finished cells go on from their last checkpoint (a shortened run "
                                         "grows towards the paper's protocol)"),
    on_divergence: Optional[OnDivergenceChoice] = typer.Option(None, "--on-divergence",
                                                help="stop or record: what a NaN/inf "
                                                "loss, update or evaluation loss does from here on (record: a run stopped by a diverged cell "
                                                "marks it diverged and goes on with the next cells)"),
) -> None:
    """Continue a stopped run from its last checkpoints; the results equal an uninterrupted run (on another
    --device: to float rounding). With --rounds, also a finished run, to more rounds."""
    try:
        cfg = with_device(load_run_config(run_dir), device)
        holder = run_holder(run_dir)
        if holder is not None:  # refused before anything is printed about training (run_lock refuses it again)
            raise busy_error(run_dir, holder)
        if (rounds is None or rounds == cfg.federation.rounds) and not unfinished_cells(run_dir, cfg):
            console.print(f"every cell of {run_dir} finished earlier ({len(cfg.methods) * len(cfg.seeds)} cells, "
                          f"{cfg.federation.rounds} rounds): nothing to train (--rounds N extends it to N rounds); "
                          "its table:", highlight=False)
        else:
            console.print(f"[dim]{_hardware_line(cfg)}[/]", highlight=False)
        _train(run_dir, cfg, rounds or cfg.federation.rounds, quiet,
               lambda progress: resume_run(run_dir, data_dir=data_dir, progress=progress, device=device,
                                           rounds=rounds,
                                           on_divergence=on_divergence.value if on_divergence else None))
    except _RUN_ERRORS as exc:
        _fail(exc, run_dir)
    except KeyboardInterrupt:
        _interrupted(run_dir)


@app.command()
def report(
    run_dirs: list[Path] = typer.Argument(..., help="run folders (or cell folders) to combine"),
    best: bool = typer.Option(False, "--best", help="test scores at the round with the best mean test score "
                              "(one model for every client; an oracle choice of round) instead of the final ones"),
    selected: bool = typer.Option(False, "--selected", help="test accuracy at the round of the best mean "
                                  "validation accuracy (model selection, UniFed; needs validation data)"),
    markdown: bool = typer.Option(False, "--markdown", help="print a markdown table"),
    sample_std: bool = typer.Option(False, "--sample-std", help="std over seeds with ddof 1 (sample) instead of "
                                    "the population std (ddof 0, numpy's default)"),
    avg_std: AvgStdChoice = typer.Option(AvgStdChoice.seeds, "--avg-std", help="the Avg column's std: over seeds (of the per-seed means "
                                "over clients), or across clients (sample std of the clients' means over seeds, "
                                "HarmoFL's Tables 1-2)"),
    split_by: Optional[str] = typer.Option(None, "--split-by", help="a config key (e.g. federation.channels_last): "
                                           "one row per method and value of that key, to compare runs that differ "
                                           "in it (otherwise a (method, seed) found twice counts once)"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="also write a PNG of the rows' curves: mean test score "
                                        "over the clients and training loss by round, mean over each row's seeds, "
                                        "to the final round (comparison.png across run folders)"),
) -> None:
    """Mean (std) over seeds per client and on average, in the papers' table layout. Folders without a
    finished cell (a run still going, e.g. matched by a glob) are skipped with a warning; duplicates, rows that
    mix settings and unfinished cells are named (see fednorm.runs.report.collect_runs)."""
    try:
        found = collect_runs(run_dirs, split_by, best_from_metrics=best)
    except (RunError, ConfigError, CorruptFileError) as exc:
        _fail(exc)
    if not found.summaries:
        _fail(RunError("; ".join(no_finished_cell(d) for d in found.unfinished)))
    for d in found.unfinished:
        found.notes.append(f"skipped {no_finished_cell(d)}")
    metric = "selected_acc" if selected else "best_mean_acc" if best else "final_acc"
    table = build_table(found.summaries, paper=found.paper or None, metric=metric,
                        paper_source="; ".join(found.paper_sources) or None, ddof=int(sample_std), avg_std=avg_std.value)
    if table.lacking:
        cells = ", ".join(f"{m} seed {seed}" for m, seed in table.lacking[:6]) + (", ..." if len(table.lacking) > 6
                                                                                   else "")
        why = ("--selected needs validation data (set data.val_fraction, or a dataset with a validation split)"
               if selected else "--best reads the round with the best mean test score from the cell's metrics.jsonl"
               if best else "the cell has no test evaluation")
        if not table.rows:
            _fail(RunError(f"no cell has {metric} ({cells}): {why}"))
        found.notes.append(f"left out, no {metric}: {cells} ({why})")
    for note in found.notes:
        err_console.print(f"[yellow]{note}[/yellow]", soft_wrap=True, highlight=False)
    which = "validation-selected" if selected else "best round" if best else "final"
    # the title names the round chosen and the std, in both renderings: a pasted markdown table must not read as
    # final-round population-std numbers when it is not
    title = f"test {table.score_label} (%), {which}, mean ({'sample' if sample_std else 'population'} std) over seeds"
    if markdown:
        console.print(f"{title}\n\n{table.markdown()}", highlight=False, markup=False, soft_wrap=True)
    else:
        _print_table(table, title)
    if plot is not None:
        from ..runs.plots import draw_comparison, row_curves

        curves, score = row_curves([(s["method"], cell) for s, cell in zip(found.summaries, found.cells)
                                    if s["method"] in table.rows])
        names = ", ".join(dict.fromkeys(Path(d).resolve().name for d in run_dirs))
        written = draw_comparison(curves, score, names if len(names) <= 100 else names[:97] + "...", plot)
        err_console.print(f"curves: {written}" if written else "no curves: the cells recorded no test score",
                          highlight=False, soft_wrap=True)


@app.command()
def landscape(
    run_dir: Path = typer.Argument(..., help="a run folder written by `fednorm run`"),
    method: Optional[str] = typer.Option(None, "--method", help="method label (default: the run's first)"),
    seed: Optional[int] = typer.Option(None, "--seed", help="seed (default: the run's first)"),
    span: float = typer.Option(1.0, "--span", help="grid half-width in filter-normalized units (HarmoFL Fig. 6: 8)"),
    points: int = typer.Option(11, "--points", help="grid points per axis"),
    samples: int = typer.Option(256, "--samples", help="training samples per client"),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="data folder, if it moved since the run"),
) -> None:
    """Each client's training loss on a 2-D slice around a cell's global model (HarmoFL Fig. 1 / Fig. 6),
    from the cell's last checkpoint, as a PNG in the cell folder."""
    from ..diagnostics.landscape import landscape_of_cell

    try:
        path = landscape_of_cell(run_dir, method, seed, data_dir, span=span, points=points, samples=samples)
    except (*_USER_ERRORS, ValueError) as exc:
        _fail(exc)
    console.print(f"landscape: {path}")


@app.command("bn-stats")
def bn_stats(
    run_dir: Path = typer.Argument(..., help="a run folder written by `fednorm run`"),
    method: Optional[str] = typer.Option(None, "--method", help="method label (default: the run's first)"),
    seed: Optional[int] = typer.Option(None, "--seed", help="seed (default: the run's first)"),
    layers: Optional[str] = typer.Option(None, "--layers", help="BN layers by module path, comma-separated "
                                         "(default: the model's last two, as FedWon Fig. 1b)"),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="data folder, if it moved since the run"),
) -> None:
    """Each client's BN statistics of its own data against the running statistics the model holds (the server's,
    or each client's under FedBN), per channel (FedWon Fig. 1b / Fig. 12), from the cell's last checkpoint:
    bn_statistics.png and .json in the cell folder."""
    from ..diagnostics.bn_statistics import bn_statistics_of_cell

    chosen = [name.strip() for name in layers.split(",") if name.strip()] if layers else None
    try:
        path = bn_statistics_of_cell(run_dir, method, seed, data_dir, chosen)
    except (*_USER_ERRORS, ValueError) as exc:
        _fail(exc)
    console.print(f"BN statistics: {path}")


@app.command("external-ablation")
def external_ablation(
    run_dir: Path = typer.Argument(..., help="a finished run folder with external clients (external.domains)"),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="data folder, if it moved since the run"),
    fresh: bool = typer.Option(False, "--fresh", help="recompute every row (ignore the saved rows)"),
    selected: bool = typer.Option(False, "--selected", help="each cell's validation-selected model (selected.pt, "
                                  "UniFed's model selection) instead of its last one (checkpoint.pt)"),
) -> None:
    """UniFed's Fig. 6 from a run's checkpoints (no training): each external client's accuracy against the test
    batch size, the momentum and the sample order; unifed_ablation.md / .json / .png in the run folder
    (unifed_ablation_selected.* with --selected). Re-running computes only the rows not saved yet."""
    from ..runs.unifed_ablation import markdown_table, output_files, run_ablation_with_progress

    model = "selected" if selected else "final"
    try:
        rows = run_ablation_with_progress(run_dir, data_dir, fresh, model=model)
    except (*_USER_ERRORS, ValueError) as exc:
        _fail(exc)
    _, table_file, figure_file = output_files(model)
    console.print(markdown_table(rows), markup=False, highlight=False)
    console.print(f"table: {run_dir / table_file}; figure: {run_dir / figure_file}", highlight=False)


@app.command()
def rescore(
    run_dir: Path = typer.Argument(..., help="a run folder with checkpoints (written where the run ran)"),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="data folder, if it moved since the run"),
    selected: bool = typer.Option(False, "--selected", help="each cell's validation-selected model (selected.pt) "
                                  "instead of its last one (checkpoint.pt)"),
) -> None:
    """Each cell's test scores again from its checkpoint (no training), with each client's BN statistics as
    stored and recomputed over its training split (BN recalibration, federation.evaluation_bn); rescore_bn.md /
    .json in the run folder."""
    from ..runs.rescore import TABLE_FILE, markdown_table, rescore_run

    try:
        with Progress(console=err_console, transient=True) as bar:
            task = bar.add_task("rescoring cells", total=None)
            rows = rescore_run(run_dir, data_dir, model="selected" if selected else "final",
                               progress=lambda done, total: bar.update(task, completed=done, total=total))
    except (*_USER_ERRORS, ValueError) as exc:
        _fail(exc)
    console.print(markdown_table(rows), markup=False, highlight=False)
    console.print(f"table: {run_dir / TABLE_FILE}", highlight=False)


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
    names = preset_names()
    width = max(map(len, names))
    with warnings.catch_warnings():  # a preset's config warnings belong to running it, not to this list
        warnings.simplefilter("ignore", ConfigWarning)
        descriptions = [load_config(name).description for name in names]
    for name, description in zip(names, descriptions):
        console.print(f"[bold]{name:{width}s}[/] {description}", highlight=False, soft_wrap=True)


from .bench import bench  # noqa: E402 - next to its registration
app.command("bench")(bench)


data_app = typer.Typer(no_args_is_help=True, help="Prepare datasets in the data folder.")
app.add_typer(data_app, name="data")


@data_app.command("list")
def data_list(
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="data folder (else FEDNORM_DATA, else the user cache)"),
) -> None:
    """The domains fednorm knows, the file each reads, whether it is in the data folder, and how to get it."""
    from ..data.datafolder import resolve_data_dir
    from ..data.federation import domain_file, known_domains
    from ..data.prepare import preparer_for

    folder = resolve_data_dir(data_dir)
    t = Table(title=f"domains (data folder {folder})")
    for head in ("domain", "file", "here", "get it with"):
        t.add_column(head)
    for domain in known_domains():
        rel = domain_file(domain)
        if rel is None:
            t.add_row(domain, "(rendered in memory)", "yes", "-")
            continue
        name = preparer_for(domain)
        t.add_row(domain, rel, "yes" if (folder / rel).is_file() else "no",
                  f"fednorm data prepare {name}" if name else "the offline copy (docs/datasets.md)")
    cifar10c = sorted((folder / "cifar10c").glob("*.npz")) if (folder / "cifar10c").is_dir() else []
    t.add_row("cifar10c/<corruption>/<severity>", "cifar10c/<corruption>.npz",
              f"{len(cifar10c)} of 19" if cifar10c else "no", "fednorm data prepare cifar10c [--domains fog,snow]")
    t.add_row("corrupt/<corruption>/<severity>/<domain>", "(generated from the domain, cached)", "-", "its base domain")
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
    dataset: str = typer.Argument(..., help="svhn, synthdigits, morpho_global, morpho_local, cifar10, cifar10c, "
                                  "office_caltech10, domainnet, camelyon17, prostate, nuclei, abide or fed_isic2019"),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="data folder (else FEDNORM_DATA, else the user cache)"),
    raw_dir: Optional[str] = typer.Option(None, "--raw-dir", help="folder of the official files (default DATA_DIR/raw/DATASET)"),
    fedbn_dir: Optional[str] = typer.Option(None, "--fedbn-dir", help="svhn/synthdigits: read med-air/FedBN's partition files"),
    size: Optional[int] = typer.Option(None, "--size", help="office_caltech10/domainnet: image side (default 64; papers 256)"),
    domains: Optional[str] = typer.Option(None, "--domains", help="office_caltech10/domainnet (domains), prostate/nuclei/"
                                          "fed_isic2019 (sites), cifar10c (corruptions): comma-separated (default all)"),
    no_download: bool = typer.Option(False, "--no-download", help="never download; use the files in --raw-dir"),
    seeded_order: bool = typer.Option(False, "--seeded-order", help="prostate: volumes in name order and a seeded "
                                      "split, instead of HarmoFL's slice order files"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress bar"),
) -> None:
    """Download (resumable, checksummed) and convert a dataset into the data folder's npz format.

    The medical datasets need files that cannot all be fetched automatically (registration, Google Drive):
    the error then says what to download and where to put it (--raw-dir)."""
    from ..data.datafolder import resolve_data_dir
    from ..data.prepare import PREPARERS, prepare_dataset

    if dataset not in PREPARERS:
        _fail(ValueError(f"unknown dataset {dataset!r}; choose one of {', '.join(PREPARERS)}"))
    try:
        paths = prepare_dataset(dataset, resolve_data_dir(data_dir), raw_dir=raw_dir, download=not no_download,
                                progress=not quiet, size=size, domains=domains, fedbn_dir=fedbn_dir,
                                seeded_order=seeded_order)
    except (DataError, ValueError) as exc:
        _fail(exc)
    for p in paths:
        console.print(f"wrote {p} and its manifest entry", highlight=False)


@data_app.command("show")
def data_show(
    domains: list[str] = typer.Argument(..., help="one or more domain names, e.g. mnistm, pacs/photo, corrupt/fog/3/mnistm; "
                                         "several are compared on one histogram figure"),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="data folder (else FEDNORM_DATA, else the user cache)"),
    out: Optional[Path] = typer.Option(None, "--out", help="PNG file of the sample grid (default <domain>.png here); the "
                                       "histograms go to <stem>_hist.png, several domains' grids to <stem>_<domain>.png"),
    per_class: int = typer.Option(8, "--per-class", min=1, max=32, help="images per class in the grid"),
    seed: int = typer.Option(0, "--seed", help="split, rendering and corruption seed (data.split_seed of a run)"),
    hist_images: int = typer.Option(100, "--hist-images", min=0, help="random training images per domain in the pixel "
                                    "histograms (FedBN Fig. 6: 100; 0 = all)"),
    linear_hist: bool = typer.Option(False, "--linear-hist", help="linear y axis for the pixel histograms (default "
                                     "logarithmic: the background spike of digits flattens the rest)"),
    amplitude_norm: bool = typer.Option(False, "--amplitude-norm", help="also <stem>_ampnorm.png: sample images before "
                                        "and after HarmoFL's amplitude normalization with the domains' averaged "
                                        "amplitude (HarmoFL Fig. 8)"),
) -> None:
    """Image counts per split and class of each domain, a PNG grid of sample images per domain, and the
    domains' per-channel pixel histograms on one PNG next to it (FedBN's Fig. 6)."""
    from ..data.datafolder import resolve_data_dir
    from ..data.federation import is_rendered
    from ..data.show import amplitude_figure, histogram_figure, output_paths, pixel_histogram, sample_grid, view_domain

    try:
        grids, hist_png = output_paths(domains, out)
        views, hists = [], []
        for domain, grid in zip(domains, grids):
            folder = None if is_rendered(domain) else resolve_data_dir(data_dir)
            view = view_domain(domain, data_dir=folder, seed=seed)
            sample_grid(view, grid, per_class=per_class, seed=seed)
            views.append(view)
            hists.append(pixel_histogram(view, max_images=hist_images, seed=seed))
        histogram_figure(hists, hist_png, log=not linear_hist)
        amp_png = hist_png.with_name(hist_png.name.removesuffix("_hist.png") + "_ampnorm.png")
        if amplitude_norm:
            amplitude_figure(views, amp_png, seed=seed)
    except (DataError, ValueError) as exc:
        _fail(exc)
    for domain, view, png in zip(domains, views, grids):
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
    console.print(f"pixel histograms ({', '.join(f'{h.domain}: {h.images} {h.split} images' for h in hists)}): "
                  f"{hist_png}", highlight=False, soft_wrap=True)
    if amplitude_norm:
        console.print(f"amplitude normalization: {amp_png}", highlight=False)



# ------------------------------------------------------------------------------------------ flower
flower_app = typer.Typer(no_args_is_help=True, help="Run experiments on Flower: its simulation runtime, or a "
                         "deployment with a SuperLink and SuperNodes (docs/flower.md).")
app.add_typer(flower_app, name="flower")


def _flower():
    """The Flower engine module, or a clear error when the ``flower`` extra is not installed."""
    try:
        from ..engines.flower import runtime
    except ImportError as exc:
        _fail(RunError(f"Flower is not installed ({exc}); install it with: pip install 'fednorm[flower]'"))
    return runtime


def _flower_options(round_timeout: float, node_wait: float):
    from ..engines.flower.server import FlowerOptions

    return FlowerOptions(round_timeout=round_timeout if round_timeout > 0 else None, node_wait=node_wait)


def _flower_finish(run_dir: Path, cfg) -> None:
    summaries = read_summaries(run_dir)
    if summaries:
        _print_run_table(cfg, summaries, engine=" on Flower")
    console.print(f"run folder: {run_dir}  (results.md, <method>/seed<k>/metrics.jsonl, participation.jsonl)",
                  highlight=False)


def _flower_config(config: Optional[str], set_: list[str], out: Path, resume: bool):
    """The experiment: with --resume and no config given, the one the run folder was started with (with the --set
    values on it: the server then names any edit a resume refuses, rather than comparing the default preset). Its methods
    are checked here, before Ray or a SuperLink starts (a centralized reference needs every client's data in one
    process: refused, where the server's refusal would only reach a log)."""
    from ..engines.flower.node import check_flower_method

    if resume and config is None:
        if not (out / "config.yaml").is_file():
            raise ValueError(f"--resume without a config reads it from the run folder, but {out} has no config.yaml "
                             "on this machine (the run folder lives where the server runs: the SuperLink's machine "
                             "for `flower app`); run this there, or give the original config and --set values again")
        cfg = load_run_config(out)
        if set_:
            cfg = validate(apply_overrides(cfg.model_dump(mode="json"), set_), source=f"config {out / 'config.yaml'}")
    else:
        cfg = load_config(config, set_)
    for method_cfg in cfg.methods:
        check_flower_method(method_cfg)
    return cfg


_RESUME = typer.Option(False, "--resume", help="continue the stopped run in --out from its checkpoints (the config "
                       "is read from the run folder; the clients' state is kept under RUN/node_state (sim) or "
                       "WORKDIR/node_state (local))")
_ROUND_TIMEOUT = typer.Option(600.0, "--round-timeout", min=0.0, help="seconds to wait for a round's replies before leaving "
                              "the missing clients out (0: wait forever)")
_NODE_WAIT = typer.Option(300.0, "--node-wait", min=0.0, help="seconds to wait at the start for SuperNodes holding every client")


@flower_app.command("sim")
def flower_sim(
    config: Optional[str] = typer.Argument(None, help="YAML config file or preset name"),
    set_: list[str] = typer.Option([], "--set", help="override a config key, e.g. --set federation.rounds=5"),
    out: Path = typer.Option(..., "--out", help="run folder"),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help=_CONFIGURED_DATA_DIR),
    nodes: Optional[int] = typer.Option(None, "--nodes", min=1, help="virtual SuperNodes (default one per client)"),
    cpus_per_node: float = typer.Option(1.0, "--cpus-per-node", help="CPUs of each Ray actor running a ClientApp"),
    round_timeout: float = _ROUND_TIMEOUT,
    resume: bool = _RESUME,
) -> None:
    """Run an experiment on Flower's simulation runtime (Ray), every client a virtual SuperNode."""
    runtime = _flower()
    try:
        cfg = _flower_config(config, set_, out, resume)
        runtime.simulate(cfg, out, data_dir=data_dir, nodes=nodes, cpus_per_node=cpus_per_node,
                         options=_flower_options(round_timeout, 300.0), resume=resume)
    except (*_USER_ERRORS, ValueError) as exc:
        _fail(exc)
    _flower_finish(out, cfg)


@flower_app.command("app")
def flower_app_folder(
    app_dir: Path = typer.Argument(..., help="folder to write the Flower app (pyproject.toml) into"),
    config: Optional[str] = typer.Argument(None, help="YAML config file or preset name"),
    set_: list[str] = typer.Option([], "--set", help="override a config key, e.g. --set federation.rounds=5"),
    out: Path = typer.Option(..., "--out", help="run folder, on the SuperLink's machine (made absolute)"),
    round_timeout: float = _ROUND_TIMEOUT,
    node_wait: float = _NODE_WAIT,
    resume: bool = typer.Option(False, "--resume", help="the app continues the stopped run in --out (the config is "
                                "read from it when the SuperLink's run folder is on this machine)"),
) -> None:
    """Write a Flower app folder that runs the experiment with `flwr run APP_DIR SUPERLINK` (deployment)."""
    runtime = _flower()
    try:
        cfg = _flower_config(config, set_, out, resume)
        if (out / "config.yaml").is_file():  # the run folder is on this machine: refuse what the server would now
            runtime.check_out(out.resolve(), resume)
        path = runtime.write_app(app_dir, cfg, out, _flower_options(round_timeout, node_wait), resume=resume)
    except (*_USER_ERRORS, ValueError) as exc:
        _fail(exc)
    console.print(f"wrote {path}; run it with: flwr run {app_dir} <superlink connection> --stream", highlight=False)


@flower_app.command("clients")
def flower_clients(
    config: Optional[str] = typer.Argument(None, help="YAML config file or preset name"),
    set_: list[str] = typer.Option([], "--set", help="override a config key"),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help=_CONFIGURED_DATA_DIR),
) -> None:
    """The federation's clients, each with the --node-config of a SuperNode that holds it."""
    _flower()
    from ..data.datafolder import resolve_data_dir
    from ..runs.runner import build_federation_data

    try:
        cfg = load_config(config, set_)
        clients = build_federation_data(cfg, resolve_data_dir(data_dir or cfg.data.data_dir))
    except (*_USER_ERRORS, ValueError) as exc:
        _fail(exc)
    t = Table(title=f"{cfg.name}: {len(clients)} clients")
    for head in ("index", "client", "domain", "train", "test", "role", "--node-config"):
        t.add_column(head, justify="right" if head in ("index", "train", "test") else "left")
    for i, c in enumerate(clients):
        t.add_row(str(i), c.name, c.domain, str(c.num_train), str(len(c.test)),
                  "external" if c.meta.get("external") else "trains", f"client-index={i} data-dir='DIR'")
    console.print(t)


@flower_app.command("local")
def flower_local(
    config: Optional[str] = typer.Argument(None, help="YAML config file or preset name"),
    set_: list[str] = typer.Option([], "--set", help="override a config key, e.g. --set federation.rounds=5"),
    out: Path = typer.Option(..., "--out", help="run folder"),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="data folder of every SuperNode"),
    workdir: Optional[Path] = typer.Option(None, "--workdir", help="logs, Flower's files and the nodes' client "
                                           "state (default OUT-flower)"),
    round_timeout: float = _ROUND_TIMEOUT,
    resume: bool = _RESUME,
) -> None:
    """Run an experiment on Flower's deployment runtime on this machine (a SuperLink, a SuperNode per client)."""
    runtime = _flower()
    try:
        cfg = _flower_config(config, set_, out, resume)
        runtime.run_local(cfg, out, workdir or Path(f"{out}-flower"), data_dir=data_dir,
                          options=_flower_options(round_timeout, 300.0), resume=resume)
    except (*_USER_ERRORS, ValueError) as exc:
        _fail(exc)
    _flower_finish(out, cfg)


if __name__ == "__main__":
    app()
