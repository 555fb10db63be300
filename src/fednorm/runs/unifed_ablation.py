"""UniFed's test-time BN ablation (Fig. 6): external accuracy against the test batch size and the momentum.

Re-evaluates the external clients of a finished run from its checkpoints (no training): every cell
(method, seed) of the run folder, (a) the one-batch study: each test batch normalized with its own statistics
only (momentum 0), for each test batch size of :data:`fednorm.methods.external.ABLATION_TEST_BATCH_SIZES`;
(b) each momentum of :data:`~fednorm.methods.external.ABLATION_MOMENTA` at test batch size 32; the global
model ("aggregated BN", flat in both) is the baseline row, FedBN App. G a further one. Writes
``unifed_ablation.md`` into the run folder.

It takes minutes per cell on a small CPU, so each finished cell's rows are saved at once
(``unifed_ablation.json``) and a re-run skips the cells already there (``--fresh`` starts over).

    python -m fednorm.runs.unifed_ablation RUN [--data-dir DIR] [--fresh]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

from ..methods.external import ABLATION_MOMENTA, ABLATION_TEST_BATCH_SIZES, ExternalBN
from . import store
from .runner import build_engine, build_federation_data, load_run_config, run_data_dir, split_external

ROWS_FILE = "unifed_ablation.json"
TABLE_FILE = "unifed_ablation.md"

Row = tuple[str, str, str, float]  # (cell, setting, external client, accuracy %)


def ablation_settings(base: ExternalBN) -> list[tuple[str, str, ExternalBN | None]]:
    """(row name, external mode, BN re-estimation) of every row: the global model, FedBN App. G, Fig. 6(a)'s test
    batch sizes and Fig. 6(b)'s momenta. The figure's settings are UniFed's, whatever the run's ``external`` says:
    statistics fresh from the first batch, updated batch by batch, each batch predicted with the statistics that
    include it, and the momentum in the history convention (tau = the weight of the tracked statistics), so that
    momentum 0 is Fig. 6(a)'s "each batch normalized with its own statistics". The run's batch order
    (``shuffle_seed``) and variance estimator are kept."""
    unifed = replace(base, convention="history", reset=True, predict="online")
    settings: list[tuple[str, str, ExternalBN | None]] = [("global", "global", base),
                                                         ("fedbn_average (App. G)", "fedbn_average", None)]
    settings += [(f"batch {b}", "test_time_bn", replace(unifed, batch_size=b, momentum=0.0))
                 for b in ABLATION_TEST_BATCH_SIZES]
    settings += [(f"momentum {m}", "test_time_bn", replace(unifed, batch_size=32, momentum=m))
                 for m in ABLATION_MOMENTA]
    return settings


def iter_ablation(
    run_dir: Path,
    data_dir: str | None = None,
    skip: set[str] = frozenset(),
    progress: Callable[[int, int], None] | None = None,
) -> Iterator[tuple[str, list[Row]]]:
    """Yield (cell label, its rows) for every cell with a checkpoint whose label is not in ``skip``.

    ``progress(done, total)`` is called after each evaluation (total = evaluations still to do)."""
    config = load_run_config(run_dir)
    if not config.external.domains:
        raise SystemExit(f"{run_dir}: the run has no external clients (external.domains); nothing to ablate")
    clients = build_federation_data(config, run_data_dir(run_dir, config, data_dir))
    _, external = split_external(clients)
    settings = ablation_settings(config.external.bn())
    todo = [(m, s) for m in config.methods for s in config.seeds
            if f"{m.display}/seed{s}" not in skip
            and (store.cell_dir(run_dir, m.display, s) / store.CHECKPOINT_FILE).exists()]
    total, done = len(todo) * len(external) * len(settings), 0
    for method_cfg, seed in todo:
        engine = build_engine(config, method_cfg, seed, clients)
        engine.load_state_dict(store.load_checkpoint(store.cell_dir(run_dir, method_cfg.display, seed) / store.CHECKPOINT_FILE))
        prepare = engine.runner.evaluation_prepare(engine.input_state)
        label = f"{method_cfg.display}/seed{seed}"
        rows: list[Row] = []
        for client in external:
            for name, mode, bn in settings:
                # as the run evaluates (Per-FedAvg adapts first and leaves its adaptation samples out)
                result = engine.evaluate_external_client(client, mode, bn, prepare)
                if result is not None:  # None: no test sample left after Per-FedAvg's adaptation samples
                    rows.append((label, name, client.name, 100 * result.accuracy))
                done += 1
                if progress:
                    progress(done, total)
        yield label, rows


def ablation_rows(run_dir: Path, data_dir: str | None = None) -> list[Row]:
    """Every (cell, setting, external client, accuracy %) row of the run, computed now (nothing saved)."""
    return [row for _, rows in iter_ablation(run_dir, data_dir) for row in rows]


def markdown_table(rows: list[Row]) -> str:
    """One line per (cell, setting), one column per external client, and their mean."""
    clients = sorted({r[2] for r in rows})
    cells = list(dict.fromkeys(r[0] for r in rows))
    lines = ["| cell | setting | " + " | ".join(clients) + " | mean |", "|---|---|" + "---|" * (len(clients) + 1)]
    for cell in cells:
        for setting in dict.fromkeys(r[1] for r in rows if r[0] == cell):
            accs = {r[2]: r[3] for r in rows if r[0] == cell and r[1] == setting}
            mean = sum(accs.values()) / len(accs)
            lines.append(f"| {cell} | {setting} | " + " | ".join(f"{accs[c]:.2f}" for c in clients) + f" | {mean:.2f} |")
    return "\n".join(lines) + "\n"


def run_ablation(run_dir: Path, data_dir: str | None = None, fresh: bool = False,
                 progress: Callable[[int, int], None] | None = None) -> list[Row]:
    """Compute the cells not saved yet, saving rows and table after each cell; return all rows."""
    rows_path = run_dir / ROWS_FILE
    rows: list[Row] = []
    if rows_path.exists() and not fresh:
        try:
            rows = [tuple(r) for r in json.loads(rows_path.read_text())]
        except (json.JSONDecodeError, TypeError) as err:
            raise SystemExit(f"{rows_path} is not a saved ablation ({err}); delete it or pass --fresh") from err
    for _, cell_rows in iter_ablation(run_dir, data_dir, skip={r[0] for r in rows}, progress=progress):
        rows += cell_rows
        store.write_json(rows_path, rows)
        table = markdown_table(rows).encode()
        store.atomic_write_bytes(run_dir / TABLE_FILE, lambda fh: fh.write(table))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--data-dir")
    parser.add_argument("--fresh", action="store_true", help="recompute every cell (ignore unifed_ablation.json)")
    args = parser.parse_args(argv)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("UniFed ablation"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()) as bar:
        task = bar.add_task("evaluations", total=None)
        rows = run_ablation(args.run, args.data_dir, args.fresh,
                            progress=lambda done, total: bar.update(task, completed=done, total=total))
    if not rows:
        raise SystemExit(f"{args.run}: no cell has a checkpoint ({store.CHECKPOINT_FILE}); nothing to ablate")
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
