"""Results tables in the papers' layout: one row per method, one column per client, mean (std) over seeds.

Accuracy (Dice for segmentation runs: the ``metric`` their summaries name) is in percent. The std is over seeds:
the population std (numpy's default, ddof=0) unless the table asks for the sample std (ddof=1, ``fednorm report
--sample-std``; the papers' "mean (std) of 3 runs" does not say which), and shown only where a cell has two or more seeds (a single seed's "(0.00)" would read as no spread); the ``Avg``
column is the mean over clients within each seed, then mean (std) over seeds. Domains that are not real data are
marked with a dagger and a footnote. Where the run's config carries the paper's numbers, a
``paper`` row follows each method with them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

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

    @property
    def score_label(self) -> str:
        return {"dice": "Dice"}.get(self.score, self.score)

    def cell(self, method: str, column: str) -> tuple[float, float, int] | None:
        values = self.rows.get(method, {}).get(column)
        if not values:
            return None
        std = float(np.std(values, ddof=self.ddof)) if len(values) > self.ddof else 0.0  # one seed: no spread shown
        return float(np.mean(values)) * 100, std * 100, len(values)

    def header(self, column: str) -> str:
        """Column title: the client name; rendered clients lose the ``rendered/`` prefix and get a dagger."""
        if self.origins.get(column, "real") == "real":
            return column
        return column.removeprefix("rendered/") + DAGGER

    def to_dict(self) -> dict:
        out = {"metric": self.metric, "score": self.score, "std_ddof": self.ddof, "columns": self.columns, "methods": {}}
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
                row.append("-" if v is None else f"{v[0]:.2f}" if v[2] == 1 else f"{v[0]:.2f} ({v[1]:.2f})")
            body.append(row)
            if method in self.paper:
                numbers = self.paper[method]
                body.append(["  paper", ""] + [f"{numbers[c]:.2f}" if c in numbers else "" for c in self.columns]
                            + [f"{numbers['Avg']:.2f}" if "Avg" in numbers else ""])
        return [head] + body

    def footnote(self) -> str:
        notes = ["(std): sample standard deviation over seeds (ddof 1)"] if self.ddof else []
        marked = [c for c in self.columns if self.origins.get(c, "real") != "real"]
        if marked:
            notes.append(f"{DAGGER} rendered stand-in domain (procedurally drawn digits), not a real dataset: "
                         + ", ".join(marked))
        if self.paper:
            notes.append("paper rows: " + (self.paper_source or "the numbers the config quotes from its paper")
                         + " (the paper's own setting: this run's overrides in config.yaml do not change them)")
        if self.diverged:
            cells = "; ".join(f"{m} seed {seed} in round {rnd} (numbers: the model after round {rnd - 1})"
                              for m, where in self.diverged.items() for seed, rnd in where)
            notes.append(f"{DIVERGED} training diverged (NaN/inf loss or update), the cell stopped there and its numbers "
                         f"are the server's last finite model: {cells}")
        return "\n\n".join(notes)

    def markdown(self) -> str:
        rows = self.text_rows()
        lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
        lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
        note = self.footnote()
        return "\n".join(lines) + (f"\n\n{note}\n" if note else "\n")


def build_table(summaries: list[dict], paper: dict | None = None, metric: str = "final_acc",
                paper_source: str | None = None, ddof: int = 0) -> ResultsTable:
    """Combine cell summaries (any runs, any seeds) into one table, merging rows by method label."""
    if ddof not in (0, 1):
        raise ValueError(f"ddof must be 0 (population std) or 1 (sample std), got {ddof}")
    columns: list[str] = []
    origins: dict[str, str] = {}
    table = ResultsTable(columns=columns, origins=origins, metric=metric, paper_source=paper_source, ddof=ddof)
    scores = {s.get("metric", "accuracy") for s in summaries}  # summaries before tasks existed: accuracy
    table.score = scores.pop() if len(scores) == 1 else "score"
    for s in summaries:
        method = s["method"]
        if s["seed"] in table.seeds.get(method, []):
            continue  # the same (method, seed) from two folders counts once
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
            if acc is None:  # e.g. selected_acc of a cell without validation data
                continue
            row.setdefault(c["name"], []).append(acc)
            if not c.get("external"):  # Avg is over the internal clients; external ones are their own columns
                accs.append(acc)
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


def read_summaries(run_dir: Path) -> list[dict]:
    """Every finished cell summary under ``run_dir`` (a run folder or a single cell folder)."""
    paths = sorted(Path(run_dir).glob(f"**/{store.SUMMARY_FILE}"))
    return [json.loads(p.read_text()) for p in paths]


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
