"""Results tables in the papers' layout: one row per method, one column per client, mean (std) over seeds.

Accuracy (Dice for segmentation runs: the ``metric`` their summaries name) is in percent. The std is over seeds:
the population std (numpy's default, ddof=0) unless the table asks for the sample std (ddof=1, ``fednorm report
--sample-std``; the papers' "mean (std) of 3 runs" does not say which), and shown only where a cell has two or more seeds (a single seed's "(0.00)" would read as no spread); the ``Avg``
column is the mean over clients within each seed, then mean (std) over seeds; with ``avg_std="clients"`` (``fednorm
report --avg-std clients``) its std is instead the sample std across the clients of their means over seeds, the
convention of HarmoFL's Tables 1-2 (e.g. its FedAvg 83.71 (6.16) on Camelyon17 is the ddof-1 std of the five
hospitals' scores). Domains that are not real data are
marked with a dagger and a footnote. Where the run's config carries the paper's numbers, a
``paper`` row follows each method with them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..methods.tasks import metric_label
from . import store

DAGGER = "†"
DIVERGED = "‡"


@dataclass
class ResultsTable:
    columns: list[str]  # client names
    origins: dict[str, str]
    rows: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # method -> column -> per-seed acc
    seeds: dict[str, list[int]] = field(default_factory=dict)
    paper: dict[str, dict[str, float]] = field(default_factory=dict)
    paper_source: str | None = None  # what the paper rows are (table, dataset, setting)
    metric: str = "final_acc"
    score: str = "accuracy"  # what the numbers are: the cells' task metric (accuracy, dice; "score" if mixed)
    diverged: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # method -> (seed, round) that diverged
    ddof: int = 0  # std over seeds: 0 population (numpy's default), 1 sample
    lacking: list[tuple[str, int]] = field(default_factory=list)  # (method, seed) cells without ``metric``: left out
    # the Avg column's std: "seeds" (of the per-seed client means) or "clients" (sample std across the clients'
    # means over seeds, HarmoFL's Tables 1-2)
    avg_std: str = "seeds"
    internal: list[str] = field(default_factory=list)  # the clients Avg is over (external clients are not)

    @property
    def score_label(self) -> str:
        return metric_label(self.score)

    def cell(self, method: str, column: str) -> tuple[float, float, int] | None:
        """(mean %, std %, number of seeds) of a cell, or None without values."""
        values = self.rows.get(method, {}).get(column)
        if not values:
            return None
        if column == "Avg" and self.avg_std == "clients":
            row = self.rows[method]
            means = [float(np.mean(row[c])) for c in self.internal if row.get(c)]
            std = float(np.std(means, ddof=1)) if len(means) > 1 else 0.0
            return float(np.mean(means)) * 100, std * 100, len(values)
        std = float(np.std(values, ddof=self.ddof)) if len(values) > self.ddof else 0.0  # one seed: no spread shown
        return float(np.mean(values)) * 100, std * 100, len(values)

    def header(self, column: str) -> str:
        """Column title: the client name; rendered clients lose the ``rendered/`` prefix and get a dagger."""
        if self.origins.get(column, "real") == "real":
            return column
        return column.removeprefix("rendered/") + DAGGER

    def to_dict(self) -> dict:
        out = {"metric": self.metric, "score": self.score, "std_ddof": self.ddof, "avg_std": self.avg_std,
               "columns": self.columns, "methods": {}}
        if self.diverged:
            out["diverged"] = {m: [{"seed": seed, "round": rnd} for seed, rnd in where] for m, where in self.diverged.items()}
        for method in self.rows:
            out["methods"][method] = {
                "seeds": self.seeds[method],
                **{c: dict(zip(("mean", "std", "n"), self.cell(method, c))) for c in self.columns + ["Avg"]
                   if self.cell(method, c)},
            }
        if self.paper:
            out["paper"] = self.paper
            if self.paper_source:
                out["paper_source"] = self.paper_source
        return out

    def text_rows(self) -> list[list[str]]:
        """Header plus body rows as strings (shared by the markdown and terminal renderings)."""
        head = ["Method", "seeds"] + [self.header(c) for c in self.columns] + ["Avg"]
        body = []
        for method in self.rows:
            row = [method + (DIVERGED if method in self.diverged else ""), str(len(self.seeds[method]))]
            for c in self.columns + ["Avg"]:
                v = self.cell(method, c)
                spread = v is not None and (v[2] > 1 or (c == "Avg" and self.avg_std == "clients"
                                                          and len(self.internal) > 1))
                row.append("-" if v is None else f"{v[0]:.2f} ({v[1]:.2f})" if spread else f"{v[0]:.2f}")
            body.append(row)
            if method in self.paper:
                numbers = self.paper[method]
                body.append(["  paper", ""] + [f"{numbers[c]:.2f}" if c in numbers else "" for c in self.columns]
                            + [f"{numbers['Avg']:.2f}" if "Avg" in numbers else ""])
        return [head] + body

    def footnote(self) -> str:
        notes = ["(std): sample standard deviation over seeds (ddof 1)"] if self.ddof else []
        if self.avg_std == "clients":
            notes.append("Avg (std): mean over the clients of their means over seeds, and the sample standard "
                         "deviation (ddof 1) across those clients (HarmoFL's Tables 1-2)")
        marked = [c for c in self.columns if self.origins.get(c, "real") != "real"]
        if marked:
            notes.append(f"{DAGGER} rendered stand-in domain (procedurally drawn digits), not a real dataset: "
                         + ", ".join(marked))
        if self.paper:
            notes.append("paper rows: " + (self.paper_source or "the numbers the config quotes from its paper")
                         + " (the paper's own setting: this run's overrides in config.yaml do not change them)")
        if self.diverged:
            cells = "; ".join(f"{m} seed {seed} in round {rnd}" for m, where in self.diverged.items()
                              for seed, rnd in where)
            notes.append(f"{DIVERGED} training diverged, the cell stopped there: {cells}. Its numbers are, for a NaN/inf "
                         "loss or update in training, the server's model before that round, evaluated then; for a "
                         "NaN/inf evaluation loss (finite weights, overflowing outputs), its last finite evaluation "
                         "(at most eval_every rounds earlier)")
        return "\n\n".join(notes)

    def markdown(self) -> str:
        rows = self.text_rows()
        lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
        lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
        note = self.footnote()
        return "\n".join(lines) + (f"\n\n{note}\n" if note else "\n")


def build_table(summaries: list[dict], paper: dict | None = None, metric: str = "final_acc",
                paper_source: str | None = None, ddof: int = 0, avg_std: str = "seeds") -> ResultsTable:
    """Combine cell summaries (any runs, any seeds) into one table, merging rows by method label. ``avg_std``: the
    Avg column's std over "seeds" (default) or across "clients" (see the module docstring)."""
    if ddof not in (0, 1):
        raise ValueError(f"ddof must be 0 (population std) or 1 (sample std), got {ddof}")
    if avg_std not in ("seeds", "clients"):
        raise ValueError(f"avg_std must be 'seeds' or 'clients', got {avg_std!r}")
    columns: list[str] = []
    origins: dict[str, str] = {}
    table = ResultsTable(columns=columns, origins=origins, metric=metric, paper_source=paper_source, ddof=ddof,
                         avg_std=avg_std)
    scores = {s.get("metric", "accuracy") for s in summaries}  # summaries before tasks existed: accuracy
    table.score = scores.pop() if len(scores) == 1 else "score"
    for s in summaries:
        method = s["method"]
        if s["seed"] in table.seeds.get(method, []):
            continue  # the same (method, seed) from two folders counts once (collect_runs says which)
        if not any(metric in c.get("test", {}) for c in s["clients"]):
            table.lacking.append((method, s["seed"]))  # e.g. selected_acc of a cell without validation data
            continue
        table.seeds.setdefault(method, []).append(s["seed"])
        if "diverged" in s:
            table.diverged.setdefault(method, []).append((s["seed"], s["diverged"]["round"]))
        row = table.rows.setdefault(method, {})
        accs = []
        for c in s["clients"]:
            if "test" not in c:
                continue
            if c["name"] not in columns:
                columns.append(c["name"])
                origins[c["name"]] = c.get("origin", "real")
            acc = c["test"].get(metric)
            if acc is None:  # a client the chosen round did not evaluate
                continue
            row.setdefault(c["name"], []).append(acc)
            if not c.get("external"):  # Avg is over the internal clients; external ones are their own columns
                accs.append(acc)
                if c["name"] not in table.internal:
                    table.internal.append(c["name"])
        if accs:
            row.setdefault("Avg", []).append(float(np.mean(accs)))
    if paper:
        for method, numbers in paper.items():
            if method in table.rows:
                table.paper[method] = dict(numbers)
    return table


# Config keys that differ between the cells of one study without changing what a cell computes (a cell that
# diverged says so in its summary, whatever on_divergence was).
_NOT_A_SETTING = ("name", "description", "seeds", "methods", "paper", "paper_source", "paper_variants",
                  "data.data_dir", "federation.on_divergence", "federation.checkpoint_every")


def flat_config(config) -> dict[str, object]:
    """An ExperimentConfig (or its dump) as dotted key -> value, e.g. ``federation.rounds -> 50``."""
    flat: dict[str, object] = {}

    def walk(node, prefix):
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            flat[prefix[:-1]] = node

    walk(config if isinstance(config, dict) else config.model_dump(), "")
    return flat


def config_differences(a, b) -> list[str]:
    """The dotted keys whose values differ between two run configs (settings only, see _NOT_A_SETTING)."""
    fa, fb = flat_config(a), flat_config(b)
    keys = [k for k in dict.fromkeys([*fa, *fb])
            if not any(k == n or k.startswith(n + ".") for n in _NOT_A_SETTING)]
    return [k for k in keys if fa.get(k) != fb.get(k)]


def method_config(config, label: str) -> dict | None:
    """The method entry of a run config whose table label is ``label`` (its lr, agc_clip, ... overrides)."""
    return next((m.model_dump(mode="json") for m in config.methods if m.display == label), None)


def row_differences(a, b, label: str) -> list[str]:
    """What differs between two runs that both put seeds into the table row ``label``: their settings and the
    row's own method entry (``method.lr``, ...); empty when the seeds are comparable."""
    differ = config_differences(a, b)
    ma, mb = method_config(a, label), method_config(b, label)
    if ma is not None and mb is not None:
        fa, fb = flat_config(ma), flat_config(mb)
        differ += [f"method.{k}" for k in dict.fromkeys([*fa, *fb]) if fa.get(k) != fb.get(k)]
    return differ


def split_label(method: str, key: str, config) -> str:
    """The row label of ``method`` in a table split by config ``key``: ``fedbn [channels_last=false]``."""
    flat = flat_config(config)
    if key not in flat:
        near = [k for k in flat if k.endswith("." + key) or k.startswith(key + ".")]
        raise KeyError(f"--split-by {key}: not a config key" + (f" (did you mean {', '.join(near[:5])}?)" if near else
                       " (keys look like federation.rounds, training.lr, model.norm)"))
    value = flat[key]
    shown = str(value).lower() if isinstance(value, bool) or value is None else value
    return f"{method} [{key.rsplit('.', 1)[-1]}={shown}]"


# what every summary.json that fednorm writes holds (store.write_summary); other files of that name are not cells
CELL_SUMMARY_KEYS = ("method", "seed", "clients")


def read_cells(run_dir: Path, skipped: list[Path] | None = None) -> list[tuple[Path, dict]]:
    """(cell folder, summary) of every finished cell under ``run_dir`` (a run folder, a cell folder, or a folder
    of runs). A summary.json that is not a cell's (no method, seed and clients: another tool's file in a project
    folder) is left out and appended to ``skipped``; one inside a run folder is a damaged cell and raises."""
    from .runner import find_run_folder, resume_command

    cells = []
    for path in sorted(Path(run_dir).glob(f"**/{store.SUMMARY_FILE}")):
        redo = (f"re-create it by resuming the run, {resume_command(path.parent.parent.parent).removeprefix('with ')}, "
                "or delete the cell folder")
        try:
            summary = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise store.CorruptFileError(f"cannot read {path} ({exc}); {redo}") from exc
        if not isinstance(summary, dict) or not all(k in summary for k in CELL_SUMMARY_KEYS):
            if find_run_folder(path.parent) is not None and path.parent.name.startswith("seed"):
                raise store.CorruptFileError(f"{path} is not a cell summary (it lacks {', '.join(CELL_SUMMARY_KEYS)}); "
                                             f"{redo}")
            if skipped is not None:
                skipped.append(path)
            continue
        cells.append((path.parent, summary))
    return cells


def read_summaries(run_dir: Path) -> list[dict]:
    """Every finished cell summary under ``run_dir`` (a run folder or a single cell folder)."""
    return [summary for _, summary in read_cells(run_dir)]


def no_finished_cell(path: Path) -> str:
    """Why ``path`` gave a report no finished cell, and what to do: a run (or a cell of one) still going, runs
    below it none of which finished, or no run at all (a file, or a folder `fednorm run` did not write)."""
    from .runner import find_run_folder, resume_command, run_holder

    path = Path(path)
    if path.is_file():
        return f"{path} is a file: give run folders (the --out of `fednorm run`) or cell folders in them"
    run = find_run_folder(path)
    if run is not None:
        holder = run_holder(run)
        return f"{path}: no finished cell yet; " + (f"{holder} is running it now" if holder else
                                                    f"finish it: {resume_command(run)}")
    runs = sorted({p.parent for p in path.glob(f"**/{store.CONFIG_FILE}")})
    if runs:
        return (f"{path}: none of its {len(runs)} run folder(s) has a finished cell yet; resume one, e.g. "
                f"{resume_command(runs[0])}")
    return (f"{path} holds no run (no {store.CONFIG_FILE} in it, above it or below it): give run folders written by "
            "`fednorm run --out`")


@dataclass
class Collected:
    """The finished cells of several folders, each (method, seed) once, and what a reader must know about them."""

    summaries: list[dict] = field(default_factory=list)
    cells: list[Path] = field(default_factory=list)  # the folder of each summary, in the same order
    paper: dict[str, dict[str, float]] = field(default_factory=dict)
    paper_sources: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # duplicates dropped, rows mixing settings, unfinished cells
    unfinished: list[Path] = field(default_factory=list)  # folders without a finished cell


def _scores(summary: dict) -> list:
    return [(c["name"], c.get("test")) for c in summary["clients"]]


def with_best_mean(summary: dict, cell: Path) -> dict:
    """``summary`` with each client's ``best_mean_acc`` (report --best) read from the cell's metrics.jsonl when
    it lacks them (summaries written before --best meant one round for every client)."""
    clients = summary["clients"]
    if all("best_mean_acc" in c.get("test", {}) for c in clients if "test" in c):
        return summary
    from .runner import scores_at_best_mean_round

    records = store.read_metrics(cell / store.METRICS_FILE)
    if not records:
        return summary
    clients = [{**c, "test": dict(c["test"])} if "test" in c else dict(c) for c in clients]
    scores_at_best_mean_round(clients, records, "test", "best_mean",
                             among={c["name"] for c in clients if not c.get("external")})
    return {**summary, "clients": clients}


def _under_any(path: Path, folders: list[Path]) -> bool:
    """Whether ``path`` is one of ``folders`` or inside one."""
    return any(f == path or f in path.parents for f in folders)


def _split_hint(differ: list[str], config) -> str:
    """How to give two runs that differ their own rows: ``--split-by`` a config key that differs, or labels."""
    keys = ["federation.rounds" if k.startswith("rounds (") else k for k in differ]
    flat = flat_config(config) if config is not None else {}
    key = next((k for k in keys if k in flat), None)
    if key is not None:
        return f"`--split-by {key}` gives each its own row"
    return "give the methods distinct labels (methods=[{name: ..., label: ...}]) to see both"


def collect_runs(run_dirs: list[Path], split_by: str | None = None, best_from_metrics: bool = False) -> Collected:
    """Gather the finished cells of ``run_dirs`` for one table (``fednorm report``). Each cell is checked against
    the config of the run it belongs to (found above it, so a folder holding several runs works):

    * a (row, seed) found twice counts once, from the first folder, and a note says so: with the settings that
      differ (``--split-by KEY`` gives each its own row) or, when none do, whether the numbers differ;
    * seeds of one row from runs with other settings or rounds are averaged together, and a note names them;
    * cells a run's config lists but that have not finished, or finished fewer rounds than it asks, are named;
    * the paper rows come from each run's config; sources that disagree on a method keep the first, noted.

    ``best_from_metrics`` fills in the best-mean-round scores of older summaries (:func:`with_best_mean`).

    Raises :class:`~fednorm.runs.runner.RunError` for a folder that does not exist, and for ``split_by`` with a
    cell outside any run folder; :class:`~fednorm.runs.config.ConfigError` for an unknown ``split_by`` key."""
    from .config import ConfigError
    from .runner import RunError, find_run_folder, load_run_config, resume_command, run_holder

    out = Collected()
    configs: dict[Path, object] = {}  # run folder -> its config (None: unreadable, noted once)

    def run_of(cell: Path) -> tuple[Path | None, object]:
        folder = find_run_folder(cell)
        if folder is not None and folder not in configs:
            try:
                configs[folder] = load_run_config(folder)
            except (RunError, ConfigError, store.CorruptFileError) as exc:
                configs[folder] = None
                out.notes.append(f"{folder / store.CONFIG_FILE} cannot be read ({exc}): its cells are reported "
                                 "without the settings checks and paper rows")
        return folder, configs.get(folder)

    seen: dict[tuple[str, int], tuple[Path, object, dict]] = {}  # (row, seed) -> first cell, its config, summary
    rows: dict[str, tuple[Path | None, object, int, int | None]] = {}  # row -> first run, config, seed, rounds
    warned: set[tuple[str, Path | None]] = set()
    finished: dict[Path, dict[tuple[str, int], int | None]] = {}  # run -> (label, seed) -> rounds finished
    for d in map(Path, run_dirs):
        if not d.exists():
            raise RunError(f"{d} does not exist")
        foreign: list[Path] = []
        cells = read_cells(d, foreign)
        if foreign:
            out.notes.append(f"skipped {len(foreign)} {store.SUMMARY_FILE} file(s) that fednorm did not write (no "
                             f"method, seed and clients): {', '.join(map(str, foreign[:3]))}"
                             f"{', ...' if len(foreign) > 3 else ''}")
        if not cells:
            out.unfinished.append(d)
            continue
        for cell, s in cells:
            if best_from_metrics:
                s = with_best_mean(s, cell)
            run_dir, config = run_of(cell)
            if run_dir is not None:
                finished.setdefault(run_dir, {})[(s["method"], s["seed"])] = s.get("rounds")
            label = s["method"]
            if split_by:
                if config is None:
                    raise RunError(f"{cell}: --split-by reads each run's config.yaml, and this cell has none above "
                                   "it; give the run folder that `fednorm run --out` made")
                try:
                    s = dict(s, method=split_label(label, split_by, config))
                except KeyError as exc:
                    raise ConfigError(exc.args[0]) from exc
            key = (s["method"], s["seed"])
            if key in seen:
                first_cell, first_config, first = seen[key]
                if first_cell.resolve() == cell.resolve():
                    continue  # the same folder given twice (a run and its parent)
                differ = row_differences(first_config, config, label) if first_config and config else []
                if first.get("rounds") != s.get("rounds"):
                    differ = [f"rounds ({first.get('rounds')} and {s.get('rounds')})"] + \
                             [k for k in differ if k != "federation.rounds"]
                why = (f"their settings differ in {', '.join(differ)}: {_split_hint(differ, config)}" if differ else
                       "same settings, same numbers" if _scores(first) == _scores(s) else
                       "same settings but other numbers (another engine, machine or code version): report them "
                       "one at a time to compare")
                out.notes.append(f"{s['method']} seed {s['seed']} is in {first_cell} and in {cell}: counted once, "
                                 f"from {first_cell} ({why})")
                continue
            seen[key] = (cell, config, s)
            out.summaries.append(s)
            out.cells.append(cell)
            # seeds of one row from runs that differ (another lr, fewer rounds): averaged together, so say so
            row_run, row_config, row_seed, row_rounds = rows.setdefault(
                s["method"], (run_dir, config, s["seed"], s.get("rounds")))
            if (s["method"], run_dir) in warned or (row_run == run_dir and s.get("rounds") == row_rounds):
                continue
            differ = (row_differences(row_config, config, label)
                      if row_run != run_dir and row_config and config else [])
            if s.get("rounds") != row_rounds:
                differ = [f"rounds ({row_rounds} and {s.get('rounds')})"] + [k for k in differ if k != "federation.rounds"]
            if differ:
                warned.add((s["method"], run_dir))
                out.notes.append(f"{s['method']}: seed {s['seed']} ({run_dir or cell}) and seed {row_seed} "
                                 f"({row_run}) ran with different {', '.join(differ)}; the row averages them")
    for run_dir, done in finished.items():
        config = configs.get(run_dir)
        if config is None:
            continue
        numbers, source = config.paper_for_setting()
        for method, values in (numbers or {}).items():
            rows_of = [split_label(method, split_by, config)] if split_by else [method]
            for row in rows_of:
                if row in out.paper and out.paper[row] != dict(values):
                    out.notes.append(f"the paper rows of {row} differ between the runs' configs ({run_dir}"
                                     f"{f': {source}' if source else ''}); the table shows the first")
                    continue
                out.paper.setdefault(row, dict(values))
        if numbers and source and source not in out.paper_sources:
            out.paper_sources.append(source)
        # only the cells under the folders given: reporting one cell of a run does not make the others unfinished
        given = [Path(d).resolve() for d in run_dirs]
        expected = [(m.display, seed) for m in config.methods for seed in config.seeds
                    if _under_any(store.cell_dir(run_dir, m.display, seed).resolve(), given)]
        missing = [f"{label} seed {seed}" for label, seed in expected if (label, seed) not in done]
        short = [f"{label} seed {seed} ({r} rounds)" for (label, seed), r in done.items()
                 if r is not None and r < config.federation.rounds]
        if missing:
            holder = run_holder(run_dir)
            out.notes.append(f"{run_dir}: {len(missing)} of its {len(expected)} cells have not finished "
                             f"({', '.join(missing[:6])}{', ...' if len(missing) > 6 else ''}); " +
                             (f"{holder} is running it now" if holder else
                              f"finish them: {resume_command(run_dir)}"))
        if short:
            out.notes.append(f"{run_dir}: its config asks for {config.federation.rounds} rounds; "
                             f"{', '.join(short[:6])} finished fewer (an extension still going?)")
    return out


def write_run_report(run_dir: Path, config, results) -> ResultsTable:
    from .plots import plot_comparison, plot_diagnostics

    paper, paper_source = config.paper_for_setting()
    table = build_table([r.summary for r in results], paper=paper, paper_source=paper_source)
    title = f"# {config.name}\n\n{config.description}\n\nTest {table.score_label} (%) after round " \
            f"{config.federation.rounds}, mean (population std, ddof 0) over seeds.\n\n"
    (Path(run_dir) / "results.md").write_text(title + table.markdown())
    store.write_json(Path(run_dir) / "results.json", table.to_dict())
    plot_comparison(run_dir, [(r.label, r.seed) for r in results])
    plot_diagnostics(run_dir, [(r.label, r.seed) for r in results])
    return table
