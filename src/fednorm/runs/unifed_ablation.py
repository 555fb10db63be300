"""UniFed's test-time BN ablation (Fig. 6): external accuracy against the test batch size, the momentum and the
order of the test samples.

Re-evaluates the external clients of a finished run from its checkpoints (no training): every cell
(method, seed) of the run folder, (a) the one-batch study: each test batch normalized with its own statistics
only (momentum 0), for each test batch size of :data:`fednorm.methods.external.ABLATION_TEST_BATCH_SIZES`;
(b) each momentum of :data:`~fednorm.methods.external.ABLATION_MOMENTA` at test batch size 32; (c) UniFed's
default point (batch 32, momentum 0.9) under each seeded sample order of
:data:`~fednorm.methods.external.ABLATION_ORDERS`; the global model ("aggregated BN", flat in all three) is the
baseline row, FedBN App. G and the clients' averaged BN layers (``bn_average``) further ones. Writes
``unifed_ablation.md`` (a row per cell and setting, the orders summarized as mean (min-max)) and
``unifed_ablation.png`` (the three panels) into the run folder.

It takes minutes per cell on a small CPU, so each finished cell's rows are saved at once
(``unifed_ablation.json``) and a re-run computes only the (cell, setting, client) rows not there yet, so
settings added later are filled in without redoing the rest (``--fresh`` starts over).

Which model: by default each cell's last one (``checkpoint.pt``, the run's "final" scores); with ``--selected``
the validation-selected one (``selected.pt``, the round of the best mean validation score, as UniFed selects its
models; runs with validation data), into files of their own (``unifed_ablation_selected.*``).

    fednorm external-ablation RUN [--data-dir DIR] [--fresh] [--selected]
    python -m fednorm.runs.unifed_ablation RUN [--data-dir DIR] [--fresh] [--selected]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

from ..methods.external import (
    ABLATION_MOMENTA, ABLATION_ORDERS, ABLATION_TEST_BATCH_SIZES, CLIENT_AVERAGE_MODES, DEFAULT_MOMENTUM,
    DEFAULT_TEST_BATCH_SIZE, ExternalBN,
)
from . import store
from .runner import (RunError, build_engine, build_federation_data, load_cell_state, load_run_config, run_data_dir,
                     split_external, trained_by)

ROWS_FILE = "unifed_ablation.json"
TABLE_FILE = "unifed_ablation.md"
FIGURE_FILE = "unifed_ablation.png"
MODELS = ("final", "selected")  # which model of each cell is re-evaluated: checkpoint.pt, or selected.pt


def model_file(model: str) -> str:
    """The cell file that holds ``model`` (one of :data:`MODELS`)."""
    if model not in MODELS:
        raise ValueError(f"model {model!r}: use one of {MODELS}")
    return store.CHECKPOINT_FILE if model == "final" else store.SELECTED_FILE


def output_files(model: str) -> tuple[str, str, str]:
    """(rows, table, figure) file names of the ablation of ``model``: the selected model's get a suffix, so the
    rows of the two models never mix."""
    model_file(model)
    if model == "final":
        return ROWS_FILE, TABLE_FILE, FIGURE_FILE
    return tuple(name.replace("unifed_ablation", "unifed_ablation_selected") for name in (ROWS_FILE, TABLE_FILE,
                                                                                          FIGURE_FILE))

Row = tuple[str, str, str, float]  # (cell, setting, external client, accuracy %)


def ablation_settings(base: ExternalBN) -> list[tuple[str, str, ExternalBN | None]]:
    """(row name, external mode, BN re-estimation) of every row: the global model, FedBN App. G, the clients' averaged
    BN layers with their statistics (bn_average, FedWon Table 12's other reading), Fig. 6(a)'s test
    batch sizes, Fig. 6(b)'s momenta and Fig. 6(c)'s sample orders. The figure's settings are UniFed's, whatever
    the run's ``external`` says: statistics fresh from the first batch, updated batch by batch, each batch
    predicted with the statistics that include it, and the momentum in the history convention (tau = the weight
    of the tracked statistics), so that momentum 0 is Fig. 6(a)'s "each batch normalized with its own
    statistics". (a) and (b) keep the run's batch order (``shuffle_seed``); (c) replaces it with each of
    :data:`ABLATION_ORDERS` at UniFed's default batch size and momentum. The variance estimator is the run's."""
    unifed = replace(base, convention="history", reset=True, predict="online")
    settings: list[tuple[str, str, ExternalBN | None]] = [("global", "global", base),
                                                         ("fedbn_average (App. G)", "fedbn_average", None),
                                                         ("bn_average (averaged statistics)", "bn_average", None)]
    settings += [(f"batch {b}", "test_time_bn", replace(unifed, batch_size=b, momentum=0.0))
                 for b in ABLATION_TEST_BATCH_SIZES]
    settings += [(f"momentum {m}", "test_time_bn", replace(unifed, batch_size=DEFAULT_TEST_BATCH_SIZE, momentum=m))
                 for m in ABLATION_MOMENTA]
    default = replace(unifed, batch_size=DEFAULT_TEST_BATCH_SIZE, momentum=DEFAULT_MOMENTUM)
    settings += [(f"order {k}", "test_time_bn", replace(default, shuffle_seed=k)) for k in ABLATION_ORDERS]
    return settings


def iter_ablation(
    run_dir: Path,
    data_dir: str | None = None,
    done_rows: set[tuple[str, str, str]] = frozenset(),
    progress: Callable[[int, int], None] | None = None,
    model: str = "final",
) -> Iterator[tuple[str, list[Row]]]:
    """Yield (cell label, its new rows) for every cell with the ``model`` file (:func:`model_file`) that has a
    (setting, external client) row not in ``done_rows`` (a set of (cell, setting, client)); only the missing rows
    are computed.

    ``progress(done, total)`` is called after each evaluation (total = evaluations still to do)."""
    state_file = model_file(model)
    config = load_run_config(run_dir)
    if not config.external.domains:
        raise RunError(f"{run_dir}: the run has no external clients (external.domains); nothing to ablate")
    clients = build_federation_data(config, run_data_dir(run_dir, config, data_dir))
    _, external = split_external(clients)
    settings = ablation_settings(config.external.bn())
    missing = []  # (method, seed, [(external client, setting)] still to compute, in table order)
    for m in config.methods:
        for s in config.seeds:
            label = f"{m.display}/seed{s}"
            if (store.cell_dir(run_dir, m.display, s) / state_file).exists():
                rows_left = [(client, setting) for client in external for setting in settings
                             if (label, setting[0], client.name) not in done_rows]
                if rows_left:
                    missing.append((m, s, rows_left))
    total, done = sum(len(left) for *_, left in missing), 0
    flower = trained_by(run_dir) == "flower"
    for method_cfg, seed, rows_left in missing:
        engine = build_engine(config, method_cfg, seed, clients)
        cell = store.cell_dir(run_dir, method_cfg.display, seed)
        # the global model and test-time statistics need the server's state only; FedBN App. G's row averages the
        # internal clients' own BN affine parameters where the method keeps them local, the bn_average row their BN
        # affine and running statistics (SiloBN's statistics too). A Flower checkpoint has none (they stay on the
        # nodes), but the run itself scored those modes at every evaluation it listed them for, the server averaging
        # what the nodes sent (docs/flower.md): such a row is read from its metrics, at the checkpoint's round (the
        # same computation: the run's fedbn_average uses App. G's own statistics), and left out if the run did not
        # score it
        from_clients = {mode for mode in CLIENT_AVERAGE_MODES
                        if engine.local_bn_keys(statistics=mode == "bn_average")}
        from_run = from_clients if flower else set()
        load_cell_state(engine, cell / state_file, "fednorm external-ablation",
                        client_state=bool(from_clients) and not flower)
        recorded = {r["client"]: r["acc"] for r in store.read_metrics(cell / store.METRICS_FILE)
                    if r["split"] == "test" and r["round"] == engine.round} if from_run else {}
        prepare = engine.runner.evaluation_prepare(engine.input_state)
        label = f"{method_cfg.display}/seed{seed}"
        rows: list[Row] = []
        for client, (name, mode, bn) in rows_left:
            if mode in from_run:
                score = recorded.get(f"{client.name}:{mode}")  # None: the run's external.modes left it out
                if score is not None:
                    rows.append((label, name, client.name, 100 * score))
                done += 1
                if progress:
                    progress(done, total)
                continue
            # as the run evaluates (Per-FedAvg adapts first and leaves its adaptation samples out)
            result = engine.evaluate_external_client(client, mode, bn, prepare)
            if result is not None:  # None: no test sample left after Per-FedAvg's adaptation samples
                rows.append((label, name, client.name, 100 * result.accuracy))
            done += 1
            if progress:
                progress(done, total)
        yield label, rows


def ablation_rows(run_dir: Path, data_dir: str | None = None, model: str = "final") -> list[Row]:
    """Every (cell, setting, external client, accuracy %) row of the run, computed now (nothing saved)."""
    return [row for _, rows in iter_ablation(run_dir, data_dir, model=model) for row in rows]


def _is_order(setting: str) -> bool:
    return setting.startswith("order ")


def markdown_table(rows: list[Row]) -> str:
    """One line per (cell, setting), one column per external client, and their mean; Fig. 6(c)'s sample orders
    in one line per cell: the mean over the orders (min-max)."""
    clients = sorted({r[2] for r in rows})
    cells = list(dict.fromkeys(r[0] for r in rows))
    lines = ["| cell | setting | " + " | ".join(clients) + " | mean |", "|---|---|" + "---|" * (len(clients) + 1)]
    for cell in cells:
        settings = list(dict.fromkeys(r[1] for r in rows if r[0] == cell))
        for setting in [s for s in settings if not _is_order(s)]:
            accs = {r[2]: r[3] for r in rows if r[0] == cell and r[1] == setting}
            mean = sum(accs.values()) / len(accs)
            lines.append(f"| {cell} | {setting} | " + " | ".join(f"{accs.get(c, float('nan')):.2f}" for c in clients)
                         + f" | {mean:.2f} |")
        orders = [s for s in settings if _is_order(s)]
        if orders:
            spread = []
            for c in clients:
                accs = [r[3] for r in rows if r[0] == cell and r[2] == c and _is_order(r[1])]
                spread.append(f"{sum(accs) / len(accs):.2f} ({min(accs):.2f}-{max(accs):.2f})" if accs else "nan")
            per_order = order_means(rows, cell)
            mean = sum(per_order) / len(per_order)
            lines.append(f"| {cell} | {len(orders)} orders: mean (min-max) | " + " | ".join(spread)
                         + f" | {mean:.2f} ({min(per_order):.2f}-{max(per_order):.2f}) |")
    return "\n".join(lines) + "\n"


def order_means(rows: list[Row], cell: str) -> list[float]:
    """The cell's accuracy under each sample order of Fig. 6(c), averaged over its external clients."""
    by_order: dict[str, list[float]] = {}
    for r in rows:
        if r[0] == cell and _is_order(r[1]):
            by_order.setdefault(r[1], []).append(r[3])
    return [sum(v) / len(v) for v in by_order.values()]


def ablation_figure(rows: list[Row], path: Path, policies: dict[str, str] | None = None) -> Path:
    """UniFed Fig. 6 as three panels, accuracy averaged over the external clients: (a) against the one-batch test
    batch size and (b) against the momentum, a line per norm state policy (``policies``: method label -> its
    policy; cells of one policy averaged, since a model with client-specific BN has a very different global
    model than one with shared BN), each policy's global model dashed; (c) a box per method over its seeds and
    the sample orders (each point: one seed's model under one order)."""
    from ..figures import pyplot, save_figure

    plt = pyplot()
    policies = policies or {}

    def method_of(cell: str) -> str:
        return cell.rsplit("/seed", 1)[0]

    def group_of(cell: str) -> str:
        return policies.get(method_of(cell), "all cells")

    def mean_of(setting: str, group: str) -> float:
        accs = [r[3] for r in rows if r[1] == setting and group_of(r[0]) == group]
        return sum(accs) / len(accs) if accs else float("nan")

    groups = list(dict.fromkeys(group_of(r[0]) for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [(axes[0], "batch", list(ABLATION_TEST_BATCH_SIZES), "test batch size (one-batch, momentum 0)"),
              (axes[1], "momentum", list(ABLATION_MOMENTA),
               f"momentum (weight of the history), batch {DEFAULT_TEST_BATCH_SIZE}")]
    for ax, prefix, xs, xlabel in panels:
        for i, group in enumerate(groups):
            color = f"C{i}"
            ax.plot(xs, [mean_of(f"{prefix} {x}", group) for x in xs], marker="o", color=color,
                    label=f"{group}: test-time BN")
            ax.axhline(mean_of("global", group), color=color, linestyle="--", label=f"{group}: global model")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("external accuracy (%), mean over clients")
        ax.grid(alpha=0.3)
    axes[0].set_xscale("log", base=2)
    axes[0].set_title("(a) one-batch study")
    axes[1].set_title("(b) momentum")
    axes[0].legend(fontsize=7)
    cells = list(dict.fromkeys(r[0] for r in rows if _is_order(r[1])))
    methods = list(dict.fromkeys(method_of(cell) for cell in cells))
    if methods:
        boxes = [[acc for cell in cells if method_of(cell) == method for acc in order_means(rows, cell)]
                 for method in methods]
        axes[2].boxplot(boxes, tick_labels=methods)
        axes[2].tick_params(axis="x", labelrotation=60, labelsize=7)
    axes[2].set_title(f"(c) sample order: batch {DEFAULT_TEST_BATCH_SIZE}, momentum {DEFAULT_MOMENTUM}")
    axes[2].set_ylabel("external accuracy (%), mean over clients")
    axes[2].grid(alpha=0.3, axis="y")
    return save_figure(fig, path)


def run_ablation(run_dir: Path, data_dir: str | None = None, fresh: bool = False,
                 progress: Callable[[int, int], None] | None = None, model: str = "final") -> list[Row]:
    """Compute the rows not saved yet, saving rows, table and figure after each cell; return all rows."""
    rows_file, table_file, figure_file = output_files(model)
    rows_path = run_dir / rows_file
    rows: list[Row] = []
    if rows_path.exists() and not fresh:
        try:
            rows = [tuple(r) for r in json.loads(rows_path.read_text())]
        except (json.JSONDecodeError, TypeError) as err:
            raise RunError(f"{rows_path} is not a saved ablation ({err}); delete it or pass --fresh") from err

    policies = {m.display: m.build().policy for m in load_run_config(run_dir).methods}

    def save_outputs() -> None:
        table = markdown_table(rows).encode()
        store.atomic_write_bytes(run_dir / table_file, lambda fh: fh.write(table))
        ablation_figure(rows, run_dir / figure_file, policies)

    done_rows = {(r[0], r[1], r[2]) for r in rows}
    for _, cell_rows in iter_ablation(run_dir, data_dir, done_rows=done_rows, progress=progress, model=model):
        rows += cell_rows
        store.write_json(rows_path, rows)  # each cell as soon as it is done: a stopped ablation loses nothing
        save_outputs()
    if rows:
        save_outputs()  # also when nothing was left to compute (table and figure of the current code)
    return rows


def run_ablation_with_progress(run_dir: Path, data_dir: str | None = None, fresh: bool = False,
                               model: str = "final") -> list[Row]:
    """:func:`run_ablation` with a progress bar; a run folder where no cell has the model's file is an error."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("UniFed ablation"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()) as bar:
        task = bar.add_task("evaluations", total=None)
        rows = run_ablation(run_dir, data_dir, fresh,
                            progress=lambda done, total: bar.update(task, completed=done, total=total), model=model)
    if not rows:
        what, advice = ("a checkpoint", "") if model == "final" else (
            "a validation-selected model",
            ". A run with validation data (data.val_fraction > 0) keeps one per cell; runs without validation data "
            "or written by an older fednorm have none: leave out --selected to ablate each cell's last model")
        raise RunError(f"{run_dir}: no cell has {what} ({model_file(model)}); nothing to ablate{advice}")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--data-dir")
    parser.add_argument("--fresh", action="store_true", help="recompute every cell (ignore unifed_ablation.json)")
    parser.add_argument("--selected", action="store_true",
                        help="each cell's validation-selected model (selected.pt), not its last one")
    args = parser.parse_args(argv)
    try:
        rows = run_ablation_with_progress(args.run, args.data_dir, args.fresh,
                                          model="selected" if args.selected else "final")
    except RunError as err:
        raise SystemExit(f"error: {err}") from err
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
