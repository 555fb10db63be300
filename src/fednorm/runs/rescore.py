"""``fednorm rescore``: a finished run's cells scored again from their checkpoints, without training, with each
client's BN statistics as stored and recomputed (``federation.evaluation_bn``, BN recalibration).

For a run made with the papers' protocol (``evaluation_bn: stored``) this shows what recalibration would give,
on the very models the run trained: the ``stored`` row reproduces the run's recorded test scores of that round,
the ``recomputed`` row is each client's model with its BN running statistics recomputed over its training split
(:meth:`fednorm.engines.simulation.InProcessEngine.recompute_bn_statistics`). Cells whose method shares its BN
statistics (FedAvg, FixBN, FBN) or has no BatchNorm have no per-client statistics: their recomputed row is empty.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Callable

from . import store
from .runner import (RunError, RunWarning, build_engine, build_federation_data, load_cell_state, load_run_config,
                     run_data_dir)
from .unifed_ablation import model_file

RESULT_FILE = "rescore_bn.json"
TABLE_FILE = "rescore_bn.md"
STATISTICS = ("stored", "recomputed")


def rescore_run(run_dir: Path, data_dir: str | None = None, model: str = "final",
                progress: Callable[[int, int], None] | None = None) -> list[dict]:
    """One entry per cell with the ``model`` file (``final``: checkpoint.pt, ``selected``: selected.pt): method,
    seed, round, and for ``stored`` and ``recomputed`` each internal client's test score in percent (``None``
    for ``recomputed`` where the method keeps no BN statistics per client). Writes :data:`RESULT_FILE` and
    :data:`TABLE_FILE` into the run folder. A cell whose file cannot be read is left out with a
    :class:`~fednorm.runs.runner.RunWarning` naming it (an error when it is the only cell, or when no file reads)."""
    run_dir = Path(run_dir)
    config = load_run_config(run_dir)
    state_file = model_file(model)
    cells = [(m, s) for m in config.methods for s in config.seeds
             if (store.cell_dir(run_dir, m.display, s) / state_file).exists()]
    if not cells:
        raise RunError(f"{run_dir}: no cell has a {state_file} to score (checkpoints are written where the run ran "
                       "and are not shared by git; run or resume the cells on this machine first)")
    clients = build_federation_data(config, run_data_dir(run_dir, config, data_dir))
    internal = {c.name for c in clients if not c.meta.get("external")}
    rows: list[dict] = []
    unreadable: list[str] = []  # one bad file costs its cell only: the others are still scored
    for done, (method_cfg, seed) in enumerate(cells):
        engine = build_engine(config, method_cfg, seed, clients)
        path = store.cell_dir(run_dir, method_cfg.display, seed) / state_file
        try:
            try:
                load_cell_state(engine, path, "fednorm rescore", client_state=True)  # each client with its own BN
            except ValueError as exc:  # the engine's: entries or shapes other than the run's model has
                raise store.CorruptFileError(f"{path}: {exc} (the file does not fit the run's model: train the cell "
                                             "again to score it)") from exc
        except store.CorruptFileError as exc:  # a damaged file; a refusal (a Flower run's file) is not skipped
            if len(cells) == 1:
                raise
            unreadable.append(f"{method_cfg.display} seed {seed}")
            warnings.warn(f"skipped {method_cfg.display} seed {seed}: {exc}", RunWarning, stacklevel=2)
            continue
        row: dict = {"method": method_cfg.display, "seed": seed, "round": engine.round}
        for statistics in STATISTICS:
            engine.federation = replace(engine.federation, recompute_bn_statistics=statistics == "recomputed")
            if statistics == "recomputed" and not engine.recomputes_bn_statistics:
                row[statistics] = None
                continue
            row[statistics] = {e.client: 100 * e.accuracy for e in engine.evaluate(("test",))
                               if e.client in internal}
        rows.append(row)
        if progress:
            progress(done + 1, len(cells))
    if not rows:
        raise RunError(f"{run_dir}: no {state_file} could be read ({', '.join(unreadable)}; the warnings above say "
                       "why and what to do)")
    if all(row["recomputed"] is None for row in rows):
        scored = {row["method"] for row in rows}
        unscored = [m.display for m in config.methods if m.display not in scored]
        which = (f" among the cells with a {state_file} here ({', '.join(sorted(scored))}; "
                 f"{', '.join(unscored)} ha(s) none, e.g. deleted or trained elsewhere)" if unscored else " of the run")
        raise RunError(f"{run_dir}: no method{which} keeps BN statistics on each client (FedBN, SiloBN, "
                       "SingleSet, a local_bn add-on): there are none to recompute")
    (run_dir / RESULT_FILE).write_text(json.dumps(rows, indent=1))
    (run_dir / TABLE_FILE).write_text(markdown_table(rows) + "\n")
    return rows


def markdown_table(rows: list[dict]) -> str:
    """Per cell, the test scores with stored and with recomputed BN statistics, per client and on average."""
    clients = list(next(iter(rows))["stored"])
    short = [c.split("/")[-1] for c in clients]
    lines = [f"| cell | round | BN statistics | {' | '.join(short)} | Avg | gain |",
             "|---|---|---|" + "---|" * (len(clients) + 2)]
    for row in rows:
        stored_avg = _mean(row["stored"].values())
        for statistics in STATISTICS:
            scores = row[statistics]
            if scores is None:
                continue
            avg = _mean(scores.values())
            gain = "" if statistics == "stored" else f"{avg - stored_avg:+.2f}"
            lines.append(f"| {row['method']}/seed{row['seed']} | {row['round']} | {statistics} | "
                         + " | ".join(f"{scores[c]:.2f}" for c in clients) + f" | {avg:.2f} | {gain} |")
    return "\n".join(lines)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)
