import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from typer.testing import CliRunner

from fednorm.cli.main import app
from fednorm.runs.runner import run_lock

from ..runs.test_runner import TINY

runner = CliRunner()
SETS = [arg for item in TINY for arg in ("--set", item)]


def test_methods_lists_every_preset_with_one_line():
    from fednorm.methods.presets import PRESETS

    result = runner.invoke(app, ["methods"])
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert [line.split()[0] for line in lines] == list(PRESETS)  # one line each, in order, nothing else
    for line, (name, method) in zip(lines, PRESETS.items()):
        assert method.summary and method.summary in line and f"policy {method.policy}" in line, name
    for name in ("fedavg", "fedprox", "fedbn", "silobn", "singleset", "centralized", "fedwon", "fedavg_gn",
                 "fedavg_ln", "fedavg_nobn", "fixbn", "scaffold", "fednova", "moon", "fbn", "harmofl"):
        assert name in PRESETS


def test_run_prints_the_per_client_table_and_report_reads_it(tmp_path):
    out = tmp_path / "run"
    paper = ["--set", "paper={fedbn: {rendered/neon: 50.0}}", "--set", "paper_source=Example Table 9 for its own setting"]
    result = runner.invoke(app, ["run", *SETS, *paper, "--set", "federation.rounds=2", "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "fedbn" in result.output and "rendered/neon" in result.output and "rendered stand-in" in result.output
    # under the preset's description, what this run changed of it
    header = " ".join(result.output.split("training on")[0].split())
    assert "changed here: data.domains=[rendered/print, rendered/neon]," in header
    assert header.endswith("federation.rounds=2")
    # where it trained, `auto` resolved, as run.json records it
    info = json.loads((out / "run.json").read_text())
    layout = "channels_last" if info["channels_last"] else "NCHW"
    assert f"training on {info['device']}, {info['precision']}, {layout}" in result.output
    result = runner.invoke(app, ["report", str(out), "--markdown"])
    assert result.exit_code == 0
    # the paper row beside ours, and under the table what it is
    assert "|   paper |  |  | 50.00 |  |" in result.output and "paper rows: Example Table 9 for its own setting" in result.output
    table = json.loads((out / "results.json").read_text())
    fedbn_avg = table["methods"]["fedbn"]["Avg"]["mean"]
    # one seed: the mean alone (no "(0.00)" that would read as no spread over seeds)
    assert f"| {fedbn_avg:.2f} |" in result.output and "(0.00)" not in result.output
    # a folder without a finished cell (a run still going, caught by a glob) is skipped, not fatal ...
    going = tmp_path / "going"
    going.mkdir()
    (going / "config.yaml").write_text((out / "config.yaml").read_text())
    result = runner.invoke(app, ["report", str(out), str(going), "--markdown"], terminal_width=400)
    assert result.exit_code == 0, result.output
    assert f"skipped {going}: no finished cell yet; finish it: `fednorm resume {going}`" in result.output
    assert f"| {fedbn_avg:.2f} |" in result.output
    # ... unless nothing is finished at all; and what is not a run is not sent to `fednorm resume`
    result = runner.invoke(app, ["report", str(going)], terminal_width=400)
    assert result.exit_code == 2 and f"finish it: `fednorm resume {going}`" in result.output
    empty = tmp_path / "empty"
    empty.mkdir()
    result = runner.invoke(app, ["report", str(empty)], terminal_width=400)
    assert result.exit_code == 2 and f"{empty} holds no run" in result.output and "resume" not in result.output
    result = runner.invoke(app, ["report", str(tmp_path), "--markdown"], terminal_width=400)  # a folder of runs
    assert result.exit_code == 0 and f"| {fedbn_avg:.2f} |" in result.output
    result = runner.invoke(app, ["report", str(going.parent / "runs")], terminal_width=400)
    assert result.exit_code == 2 and "does not exist" in result.output
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "going").mkdir()
    (tmp_path / "runs" / "going" / "config.yaml").write_text((out / "config.yaml").read_text())
    result = runner.invoke(app, ["report", str(tmp_path / "runs")], terminal_width=400)  # runs below, none done
    assert result.exit_code == 2 and "none of its 1 run folder(s) has a finished cell yet" in result.output
    result = runner.invoke(app, ["report", str(out / "fedbn" / "seed0" / "metrics.jsonl")], terminal_width=400)
    assert result.exit_code == 2 and "metrics.jsonl is a file: give run folders" in result.output


def test_report_sample_std_over_two_seeds(tmp_path):
    # two finished cells of one method, as `fednorm run` writes their summaries (known accuracies)
    for seed, acc in ((0, 0.90), (1, 0.94)):
        cell = tmp_path / "run" / "fedavg" / f"seed{seed}"
        cell.mkdir(parents=True)
        client = {"name": "mnist", "origin": "real", "test": {"final_acc": acc, "best_acc": acc, "best_mean_acc": acc}}
        (cell / "summary.json").write_text(json.dumps({"method": "fedavg", "seed": seed, "clients": [client]}))
    population = runner.invoke(app, ["report", str(tmp_path / "run"), "--markdown"])
    sample = runner.invoke(app, ["report", str(tmp_path / "run"), "--markdown", "--sample-std"])
    assert population.exit_code == 0 and sample.exit_code == 0, sample.output
    # 90 and 94: population std |a - b| / 2 = 2, sample std |a - b| / sqrt(2) = 2.83
    assert "| fedavg | 2 | 92.00 (2.00) | 92.00 (2.00) |" in population.output
    assert "| fedavg | 2 | 92.00 (2.83) | 92.00 (2.83) |" in sample.output and "sample standard deviation" in sample.output
    assert "standard deviation" not in population.output
    # a pasted markdown table says which std and which round it holds
    assert "final, mean (population std) over seeds" in population.output
    assert "final, mean (sample std) over seeds" in sample.output
    best = runner.invoke(app, ["report", str(tmp_path / "run"), "--markdown", "--best"])
    assert "best round, mean (population std)" in best.output, best.output


def test_report_plot_draws_each_row_across_run_folders(tmp_path, monkeypatch):
    """One run folder per method (as the FBN full-protocol cells): `report A B --plot` draws both rows in one
    figure, each the mean over its seeds of the clients' mean test score, ending at the table's Avg."""
    import matplotlib.pyplot as plt

    from fednorm.runs import plots, store

    from ..runs.test_plots import _cell

    for folder, method, accs in (("a", "fbn", ({1: 0.5, 2: 0.7}, {1: 0.3, 2: 0.5})),
                                 ("b", "naive_bn", ({1: 0.4, 2: 0.6}, {1: 0.2, 2: 0.2}))):
        for seed, curve in enumerate(accs):
            _cell(tmp_path / folder, method, seed, curve)
            clients = [{"name": c, "origin": "real", "test": {"final_acc": curve[2]}} for c in "ab"]
            (store.cell_dir(tmp_path / folder, method, seed) / "summary.json").write_text(
                json.dumps({"method": method, "seed": seed, "clients": clients}))
    drawn = []
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, path, **k: drawn.append((fig, path)))
    spy = []
    real = plots.row_curves
    monkeypatch.setattr(plots, "row_curves", lambda cells: spy.append(real(cells)) or spy[-1])
    out = tmp_path / "figs" / "both.png"
    result = runner.invoke(app, ["report", str(tmp_path / "a"), str(tmp_path / "b"), "--plot", str(out)])
    assert result.exit_code == 0, result.output
    (fig, path), = drawn
    assert str(path) == str(out) and fig.get_suptitle() == "a, b"
    curves, score = spy[0]
    assert curves["acc"] == {"fbn": pytest.approx({1: 0.4, 2: 0.6}), "naive_bn": pytest.approx({1: 0.3, 2: 0.4})}
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["fbn", "naive_bn"]
    assert "| fbn | 2 | 60.00 (10.00) | 60.00 (10.00) | 60.00 (10.00) |" in runner.invoke(
        app, ["report", str(tmp_path / "a"), "--markdown"]).output  # the curve's last point is the table's Avg


def test_report_avg_std_across_clients(tmp_path):
    """--avg-std clients: Avg's std is the sample std across the clients' means over seeds (HarmoFL's tables)."""
    for seed, accs in ((0, (0.80, 0.60)), (1, (0.90, 0.70))):
        cell = tmp_path / "run" / "fedavg" / f"seed{seed}"
        cell.mkdir(parents=True)
        clients = [{"name": name, "origin": "real", "test": {"final_acc": acc}} for name, acc in zip("ab", accs)]
        (cell / "summary.json").write_text(json.dumps({"method": "fedavg", "seed": seed, "clients": clients}))
    over_seeds = runner.invoke(app, ["report", str(tmp_path / "run"), "--markdown"])
    across = runner.invoke(app, ["report", str(tmp_path / "run"), "--markdown", "--avg-std", "clients"])
    assert over_seeds.exit_code == 0 and across.exit_code == 0, across.output
    # seed means 70 and 80: 75.00 (5.00) over seeds; client means 85 and 65: sample std 14.14 across clients
    assert "| fedavg | 2 | 85.00 (5.00) | 65.00 (5.00) | 75.00 (5.00) |" in over_seeds.output
    assert "| fedavg | 2 | 85.00 (5.00) | 65.00 (5.00) | 75.00 (14.14) |" in across.output
    assert "across those clients" in across.output and "across those clients" not in over_seeds.output
    bad = runner.invoke(app, ["report", str(tmp_path / "run"), "--avg-std", "hospitals"])
    assert bad.exit_code == 2 and "hospitals" in bad.output


def test_run_and_report_quote_the_paper_rows_of_the_setting_a_variant_names(tmp_path):
    out = tmp_path / "run"
    paper = ["--set", "paper={fedbn: {rendered/neon: 50.0}}", "--set", "paper_source=Example Table 9, lr 0.01",
             "--set", "paper_variants=[{when: {training.lr: 0.03}, paper: {fedbn: {rendered/neon: 61.0}}, "
                      "paper_source: 'Example Table 9, lr 0.03'}]"]
    result = runner.invoke(app, ["run", *SETS, *paper, "--set", "methods=[fedbn]", "--set", "training.lr=0.03",
                                 "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "61.00" in result.output and "paper rows: Example Table 9, lr 0.03" in result.output
    for text in ((out / "results.md").read_text(), runner.invoke(app, ["report", str(out), "--markdown"]).output):
        paper_rows = [line for line in text.splitlines() if line.startswith("|   paper |")]
        assert paper_rows == ["|   paper |  |  | 61.00 |  |"] and "paper rows: Example Table 9, lr 0.03" in text


def table_row(markdown: str, label: str) -> list[str]:
    """The cells of the markdown table row labelled ``label``."""
    line = next(line for line in markdown.splitlines() if line.startswith(f"| {label} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_report_split_by_a_config_key_keeps_runs_that_differ_in_it_apart(tmp_path):
    # two runs of the same method and seed that differ in one setting (the fast-path accuracy check's shape)
    for name, lr in (("slow", "0.01"), ("fast", "0.03")):
        result = runner.invoke(app, ["run", *SETS, "--set", "methods=[fedbn]",
                                     "--set", f"training.lr={lr}", "--out", str(tmp_path / name), "--quiet"])
        assert result.exit_code == 0, result.output
    accs = {name: json.loads((tmp_path / name / "results.json").read_text())["methods"]["fedbn"]["Avg"]["mean"]
            for name in ("slow", "fast")}
    assert accs["slow"] != accs["fast"]
    both = [str(tmp_path / "slow"), str(tmp_path / "fast")]
    # merged by label, the second run's seed 0 is dropped: the report says so and which key differs
    merged = runner.invoke(app, ["report", *both, "--markdown"], terminal_width=400)
    assert merged.exit_code == 0, merged.output
    assert "differ in training.lr" in merged.output and "--split-by training.lr" in merged.output
    row = table_row(merged.output, "fedbn")
    assert row[1] == "1" and row[-1] == f"{accs['slow']:.2f}"
    # split by it, each run is its own row with its own number
    split = runner.invoke(app, ["report", *both, "--markdown", "--split-by", "training.lr"], terminal_width=400)
    assert split.exit_code == 0, split.output
    assert "differ in" not in split.output
    for lr, name in (("0.01", "slow"), ("0.03", "fast")):
        row = table_row(split.output, f"fedbn [lr={lr}]")
        assert row[1] == "1" and row[-1] == f"{accs[name]:.2f}"
    # an unknown key names the near ones
    bad = runner.invoke(app, ["report", *both, "--split-by", "lr"], terminal_width=400)
    assert bad.exit_code == 2 and "training.lr" in bad.output


def test_report_warns_when_the_seeds_of_a_row_ran_with_different_settings(tmp_path):
    # seed 0 at lr 0.01 for 4 rounds, seed 1 at lr 0.03 for 2 rounds: one row, averaged, and the report says so
    for name, seed, extra in (("a", 0, []), ("b", 1, ["--set", "training.lr=0.03", "--set", "federation.rounds=2"])):
        result = runner.invoke(app, ["run", *SETS, "--set", "methods=[fedbn]", "--set", f"seeds=[{seed}]", *extra,
                                     "--out", str(tmp_path / name), "--quiet"])
        assert result.exit_code == 0, result.output
    merged = runner.invoke(app, ["report", str(tmp_path / "a"), str(tmp_path / "b"), "--markdown"], terminal_width=400)
    assert merged.exit_code == 0, merged.output
    assert "fedbn: seed 1" in merged.output and "rounds (4 and 2), training.lr; the row averages them" in merged.output
    assert table_row(merged.output, "fedbn")[1] == "2"
    # the same settings: no warning
    same = runner.invoke(app, ["report", str(tmp_path / "a"), "--markdown"], terminal_width=400)
    assert "averages them" not in same.output


def _summary(folder, method, seed, accs: dict[str, float], **test):
    """A finished cell as `fednorm run` writes its summary.json (known scores)."""
    cell = folder / method / f"seed{seed}"
    cell.mkdir(parents=True)
    clients = [{"name": name, "origin": "real", "test": {"final_acc": acc, **test}} for name, acc in accs.items()]
    (cell / "summary.json").write_text(json.dumps({"method": method, "seed": seed, "rounds": 2, "clients": clients}))


def test_report_names_a_duplicate_cell_it_drops_and_never_claims_to_average_it(tmp_path):
    # the same method and seed, once with the preset's lr and once with a per-method lr, inside one parent folder
    for name, methods in (("a", "[fedbn]"), ("b", "[{name: fedbn, lr: 0.05}]")):
        result = runner.invoke(app, ["run", *SETS, "--set", f"methods={methods}", "--set", "federation.rounds=2",
                                     "--out", str(tmp_path / "runs" / name), "--quiet"])
        assert result.exit_code == 0, result.output
    acc_a = json.loads((tmp_path / "runs" / "a" / "results.json").read_text())["methods"]["fedbn"]["Avg"]["mean"]
    for args in ([str(tmp_path / "runs" / "a"), str(tmp_path / "runs" / "b")], [str(tmp_path / "runs")]):
        merged = runner.invoke(app, ["report", *args, "--markdown"], terminal_width=400)
        assert merged.exit_code == 0, merged.output
        text = " ".join(merged.output.split())
        assert "fedbn seed 0 is in" in text and "counted once" in text and "method.lr" in text
        assert "averages them" not in text
        assert table_row(merged.output, "fedbn")[1] == "1" and table_row(merged.output, "fedbn")[-1] == f"{acc_a:.2f}"
    # the same folder twice is not a duplicate worth a word
    again = runner.invoke(app, ["report", str(tmp_path / "runs" / "a"), str(tmp_path / "runs"), "--markdown"],
                          terminal_width=400)
    assert "counted once, from" in again.output and again.output.count("counted once") == 1


def test_report_names_unfinished_cells_and_survives_a_damaged_config(tmp_path):
    out = tmp_path / "run"
    result = runner.invoke(app, ["run", *SETS, "--set", "federation.rounds=1", "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    (out / "fedbn" / "seed0" / "summary.json").unlink()  # as if fedbn were still running
    partial = runner.invoke(app, ["report", str(out), "--markdown"], terminal_width=400)
    assert partial.exit_code == 0, partial.output
    assert "1 of its 2 cells have not finished (fedbn seed 0); finish them: `fednorm resume" in " ".join(partial.output.split())
    with run_lock(out):  # a process running the folder now: a resume would be refused, so none is advised
        going = runner.invoke(app, ["report", str(out), "--markdown"], terminal_width=400)
        busy = runner.invoke(app, ["resume", str(out), "--quiet"], terminal_width=400)
    busy_text = " ".join(busy.output.split())
    assert busy.exit_code == 2 and f"is being run by process {os.getpid()} on " in busy_text
    assert "once fixed" not in busy_text  # nothing to fix: wait for the other process
    assert "training on" not in busy_text  # refused before it says how it would train
    going_text = " ".join(going.output.split())
    assert going.exit_code == 0 and f"(fedbn seed 0); process {os.getpid()} on " in going_text
    assert "is running it now" in going_text and "fednorm resume" not in going_text
    one_cell = runner.invoke(app, ["report", str(out / "fedavg" / "seed0"), "--markdown"], terminal_width=400)
    assert one_cell.exit_code == 0 and "have not finished" not in one_cell.output  # the others were not asked for
    (out / "config.yaml").write_text("")
    damaged = runner.invoke(app, ["report", str(out), "--markdown"], terminal_width=400)
    assert damaged.exit_code == 0, damaged.output
    assert "config.yaml cannot be read" in " ".join(damaged.output.split()) and "| fedavg | 1 |" in damaged.output


def test_report_selected_without_validation_data_is_an_error_not_a_table_of_dashes(tmp_path):
    _summary(tmp_path / "run", "fedbn", 0, {"mnist": 0.9})
    result = runner.invoke(app, ["report", str(tmp_path / "run"), "--selected"], terminal_width=400)
    assert result.exit_code == 2 and "data.val_fraction" in " ".join(result.output.split())
    _summary(tmp_path / "run", "fedbn", 1, {"mnist": 0.8}, selected_acc=0.7)
    mixed = runner.invoke(app, ["report", str(tmp_path / "run"), "--selected", "--markdown"], terminal_width=400)
    assert mixed.exit_code == 0 and "left out, no selected_acc: fedbn seed 0" in " ".join(mixed.output.split())
    assert "| fedbn | 1 | 70.00 | 70.00 |" in mixed.output


def test_best_reads_older_summaries_round_from_their_metrics(tmp_path):
    """A summary written before --best meant one round lacks best_mean_acc: the round with the best mean test
    score is read from the cell's metrics.jsonl (client a peaks in round 1, the mean in round 2)."""
    _summary(tmp_path / "run", "fedbn", 0, {"a": 0.8, "b": 0.7})
    records = [{"round": rnd, "client": c, "split": "test", "acc": acc, "loss": 0.1, "n": 5}
               for rnd, c, acc in ((1, "a", 0.9), (1, "b", 0.5), (2, "a", 0.8), (2, "b", 0.7))]
    (tmp_path / "run" / "fedbn" / "seed0" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    best = runner.invoke(app, ["report", str(tmp_path / "run"), "--best", "--markdown"], terminal_width=400)
    assert best.exit_code == 0, best.output
    assert "| fedbn | 1 | 80.00 | 70.00 | 75.00 |" in best.output


def test_wide_tables_are_never_wrapped_or_cut(tmp_path):
    domains = {f"corrupt/gaussian_noise/{k}/rendered/domain-number-{k}": 0.5 + k / 100 for k in range(15)}
    _summary(tmp_path / "run", "fedbn", 0, domains)
    md = runner.invoke(app, ["report", str(tmp_path / "run"), "--markdown"])  # not a terminal: console width 200
    lines = [line for line in md.output.splitlines() if line.startswith("|")]
    assert len(lines) == 3 and all(line.endswith("|") for line in lines) and "64.00" in md.output
    terminal = runner.invoke(app, ["report", str(tmp_path / "run")], terminal_width=120)
    assert terminal.exit_code == 0 and "64.00" in terminal.output and "…" not in terminal.output


def test_run_names_its_folder_first_and_a_data_protocol_error_is_a_message(tmp_path):
    out = tmp_path / "r"
    result = runner.invoke(app, ["run", *SETS, "--set", "data.partition=even", "--set", "data.clients_per_domain=1000",
                                 "--out", str(out)],
                           terminal_width=400)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)  # no traceback
    assert f"run folder {out}" in result.output
    assert "cannot give 1000 clients" in result.output and "use fewer clients per domain" in result.output


def test_bad_config_exits_with_a_clear_message(tmp_path):
    result = runner.invoke(app, ["run", "--set", "training.lrr=0.1", "--out", str(tmp_path / "r")])
    assert result.exit_code == 2
    assert "training.lrr: unknown key" in result.output
    assert not (tmp_path / "r").exists()
    # a message's square brackets are text, not style tags: the suggested value reaches the user whole
    result = runner.invoke(app, ["run", "unifed_camelyon17", "--set", "model.bn_mode=batch", "--out",
                                 str(tmp_path / "r")])
    assert result.exit_code == 2 and "use external.modes: [global], or model.bn_mode: running" in result.output


def test_a_device_this_machine_lacks_exits_with_what_to_set(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = runner.invoke(app, ["run", "--set", "federation.device=cuda", "--out", str(tmp_path / "r")])
    assert result.exit_code == 2 and result.exception is not None and isinstance(result.exception, SystemExit)
    assert "no CUDA GPU" in result.output and "device: cpu or auto" in result.output
    assert not (tmp_path / "r").exists()


def test_a_run_warning_is_one_line_not_the_runners_file(tmp_path):
    """A resume on another thread count than the checkpoints were trained with says so as one warning line."""
    out = tmp_path / "r"
    result = runner.invoke(app, ["run", *SETS, "--set", "methods=[fedavg]", "--set", "federation.rounds=1",
                                 "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    info = json.loads((out / "run.json").read_text())
    info["sessions"][-1]["torch_threads"] += 1  # as if trained with one thread more than this process has
    (out / "run.json").write_text(json.dumps(info))
    result = runner.invoke(app, ["resume", str(out), "--rounds", "2", "--quiet"])
    output = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    assert "warning: " in output and "fedavg/seed0 go(es) on from checkpoints" in output
    assert "UserWarning" not in output and "runner.py" not in output


def test_missing_data_folder_exits_with_a_clear_message(tmp_path):
    result = runner.invoke(app, ["run", *SETS, "--set", "data.domains=[usps]", "--data-dir", str(tmp_path / "none"),
                                 "--out", str(tmp_path / "r"), "--quiet"])
    assert result.exit_code == 2
    assert str(tmp_path / "none") in result.output.replace("\n", "")


def test_a_config_warning_is_one_line_naming_what_to_set_not_pydantics_file(tmp_path):
    """FedNova with a carried-over momentum buffer runs but warns; Python's own format would point at pydantic."""
    result = runner.invoke(app, ["run", *SETS, "--set", "methods=[fednova]", "--set", "training.momentum=0.9",
                                 "--set", "federation.persistent_optimizer=true", "--set", "data.domains=[usps]",
                                 "--data-dir", str(tmp_path / "none"), "--out", str(tmp_path / "r"), "--quiet"])
    output = " ".join(result.output.split())
    assert "warning: method 'fednova' normalizes updates by FedNova's a_k" in output
    assert "set persistent_optimizer: false" in output
    assert "pydantic" not in output and "RuntimeWarning" not in output


def test_a_divergence_names_the_way_out_that_works_not_a_resume_that_diverges_again(tmp_path):
    out = tmp_path / "run"
    result = runner.invoke(app, ["run", *SETS, "--set", "methods=[fedavg]", "--set", "training.lr=1e9",
                                 "--out", str(out), "--quiet"], terminal_width=400)
    output = " ".join(result.output.split())
    assert result.exit_code == 2 and "fedavg seed 0 diverged in round" in output
    assert "once fixed" not in output and "would diverge again" in output
    advice = f"fednorm run {out / 'config.yaml'} --set training.lr=... --out NEW_DIR"
    assert advice in output
    # the advice, followed, finishes; the resume it warns about diverges again
    fixed = runner.invoke(app, advice.replace("...", "0.01").replace("NEW_DIR", str(tmp_path / "new")).split()[1:]
                          + ["--quiet"])
    assert fixed.exit_code == 0, fixed.output
    assert (tmp_path / "new" / "fedavg" / "seed0" / "summary.json").exists()
    again = runner.invoke(app, ["resume", str(out), "--quiet"], terminal_width=400)
    assert again.exit_code == 2 and "diverged in round" in again.output
    # the runner's own way on (record the divergence as the cell's outcome) reaches it through the CLI and finishes
    assert f"fednorm resume {out} --on-divergence record" in " ".join(again.output.split())
    recorded = runner.invoke(app, ["resume", str(out), "--on-divergence", "record", "--quiet"], terminal_width=400)
    assert recorded.exit_code == 0, recorded.output
    assert "diverged" in json.loads((out / "fedavg" / "seed0" / "summary.json").read_text())
    assert "on_divergence: record" in (out / "config.yaml").read_text()


def test_resume_of_a_non_run_folder_fails_clearly(tmp_path):
    result = runner.invoke(app, ["resume", str(tmp_path)])
    assert result.exit_code == 2 and "not a run folder" in result.output


def test_external_ablation_writes_unifeds_fig6_and_names_a_run_it_cannot_ablate(tmp_path):
    from fednorm.methods.external import ABLATION_MOMENTA, ABLATION_ORDERS, ABLATION_TEST_BATCH_SIZES
    from fednorm.runs.unifed_ablation import ablation_rows

    out = tmp_path / "run"
    one_round = [*SETS, "--set", "methods=[fedavg]", "--set", "federation.rounds=1", "--set", "federation.eval_every=1"]
    result = runner.invoke(app, ["run", *one_round, "--set", "external.domains=[rendered/street]", "--out", str(out),
                                 "--quiet"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["external-ablation", str(out)])
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "unifed_ablation.json").read_text())
    assert len(saved) == 3 + len(ABLATION_TEST_BATCH_SIZES) + len(ABLATION_MOMENTA) + len(ABLATION_ORDERS)
    assert [tuple(r) for r in saved] == ablation_rows(out)  # the saved rows are the recomputed ones
    table = (out / "unifed_ablation.md").read_text()
    assert table in result.output and "| fedavg/seed0 | 10 orders: mean (min-max) |" in table
    assert (out / "unifed_ablation.png").stat().st_size > 0
    # a run without external clients, and a folder that is no run, are errors that say so
    plain = tmp_path / "plain"
    assert runner.invoke(app, ["run", *one_round, "--out", str(plain), "--quiet"]).exit_code == 0
    result = runner.invoke(app, ["external-ablation", str(plain)])
    assert result.exit_code == 2 and "has no external clients (external.domains)" in " ".join(result.output.split())
    result = runner.invoke(app, ["external-ablation", str(tmp_path / "nothing")])
    assert result.exit_code == 2 and "not a run folder" in result.output


def test_external_ablation_of_the_validation_selected_models_has_files_of_its_own(tmp_path):
    out = tmp_path / "run"
    run = [*SETS, "--set", "methods=[fedavg]", "--set", "federation.rounds=1", "--set", "federation.eval_every=1",
           "--set", "external.domains=[rendered/street]", "--out", str(out), "--quiet"]
    assert runner.invoke(app, ["run", *run]).exit_code == 0
    result = runner.invoke(app, ["external-ablation", str(out), "--selected"])  # no validation data: no selection
    assert result.exit_code == 2 and "no cell has a validation-selected model" in " ".join(result.output.split())
    with_val = tmp_path / "val"
    assert runner.invoke(app, ["run", *run[:-3], "--set", "data.val_fraction=0.25", "--out", str(with_val),
                               "--quiet"]).exit_code == 0
    result = runner.invoke(app, ["external-ablation", str(with_val), "--selected"])
    assert result.exit_code == 0, result.output
    assert (with_val / "unifed_ablation_selected.json").exists() and (with_val / "unifed_ablation_selected.png").exists()
    assert "unifed_ablation_selected.md" in result.output and not (with_val / "unifed_ablation.json").exists()


def test_resume_with_rounds_extends_a_finished_run_and_refuses_to_shorten_it(tmp_path):
    out = tmp_path / "run"
    result = runner.invoke(app, ["run", *SETS, "--set", "methods=[fedavg]", "--set", "federation.rounds=1",
                                 "--set", "federation.eval_every=1", "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["resume", str(out), "--rounds", "2", "--quiet"])
    assert result.exit_code == 0, result.output
    assert "after round 2" in result.output
    assert "fedavg seed 0: resuming from its checkpoint at round 1 of 2" in result.output  # says where it goes on
    again = runner.invoke(app, ["resume", str(out), "--quiet"])
    assert again.exit_code == 0 and "fedavg seed 0: done earlier, kept" in again.output
    records = [json.loads(line) for line in (out / "fedavg" / "seed0" / "metrics.jsonl").read_text().splitlines()]
    assert sorted({r["round"] for r in records if r["split"] == "train"}) == [1, 2]
    result = runner.invoke(app, ["resume", str(out), "--rounds", "1", "--quiet"])
    assert result.exit_code == 2 and "not shortened" in result.output


def test_a_run_whose_device_is_missing_here_resumes_on_the_device_given(tmp_path, monkeypatch):
    from fednorm.runs.runner import start_run

    from ..runs.test_runner import Stop, stop_after, tiny_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run = tmp_path / "run"
    try:  # a run stopped after its first round, as if started on a GPU machine
        start_run(tiny_config("methods=[fedbn]", "federation.rounds=2", "federation.eval_every=1"), run,
                  progress=stop_after(1))
    except Stop:
        pass
    config = run / "config.yaml"
    assert "device: auto" in config.read_text()
    config.write_text(config.read_text().replace("device: auto", "device: cuda"))
    result = runner.invoke(app, ["resume", str(run), "--quiet"])
    assert result.exit_code == 2 and "no CUDA GPU" in result.output
    result = runner.invoke(app, ["resume", str(run), "--quiet", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "training on cpu" in result.output and (run / "fedbn" / "seed0" / "summary.json").exists()
    assert "device: cuda" in config.read_text()  # the run's config is kept as started


def test_kill_minus_9_then_resume_equals_an_uninterrupted_run(tmp_path):
    base = [sys.executable, "-m", "fednorm.cli.main", "run", *SETS, "--set", "methods=[fedbn]",
            "--set", "federation.rounds=6", "--quiet"]
    subprocess.run(base + ["--out", str(tmp_path / "straight")], check=True, capture_output=True)
    proc = subprocess.Popen(base + ["--out", str(tmp_path / "killed")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = tmp_path / "killed" / "fedbn" / "seed0" / "metrics.jsonl"
    deadline = time.time() + 600  # generous: a loaded 2-core machine starts torch slowly
    while time.time() < deadline:
        if metrics.exists() and len({json.loads(l)["round"] for l in metrics.read_text().splitlines() if l.endswith("}")}) >= 2:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "killed" / "fedbn" / "seed0" / "summary.json").exists(), "run finished before the kill"
    # killed between checkpoints (each round's) with rounds of metrics on disk; the resume starts from the checkpoint
    # (that it does not retrain from round 0 is tests/runs/test_runner.py's resume test)
    killed_at = torch.load(tmp_path / "killed" / "fedbn" / "seed0" / "checkpoint.pt", weights_only=False)["round"]
    assert 1 <= killed_at < 6
    result = runner.invoke(app, ["resume", str(tmp_path / "killed"), "--quiet"])
    assert result.exit_code == 0, result.output
    assert f"fedbn seed 0: resuming from its checkpoint at round {killed_at} of 6" in result.output
    assert torch.load(tmp_path / "killed" / "fedbn" / "seed0" / "checkpoint.pt", weights_only=False)["round"] == 6
    straight = (tmp_path / "straight" / "fedbn" / "seed0" / "metrics.jsonl").read_text()
    assert metrics.read_text() == straight


def test_data_verify_flags_a_corrupt_file_and_list_shows_presence(tmp_path):
    import numpy as np

    from ..conftest import write_data_folder

    folder = write_data_folder(tmp_path, {"digits/usps.npz": {"x_train": np.zeros((2, 16, 16), np.uint8),
                                                              "y_train": np.zeros(2, np.uint8)}})
    ok = runner.invoke(app, ["data", "verify", "--data-dir", str(folder)])
    assert ok.exit_code == 0 and "ok" in ok.output and "digits/usps.npz" in ok.output
    listed = runner.invoke(app, ["data", "list", "--data-dir", str(folder)])
    assert listed.exit_code == 0
    rows = {line.split("│")[1].strip(): line for line in listed.output.splitlines() if line.count("│") >= 3}
    assert "yes" in rows["usps"] and "no" in rows["mnist"] and "yes" in rows["rendered/print"]
    (folder / "digits/usps.npz").write_bytes(b"corrupt")
    bad = runner.invoke(app, ["data", "verify", "--data-dir", str(folder)])
    assert bad.exit_code == 1 and "BAD" in bad.output


def test_data_show_prints_counts_and_writes_a_grid(tmp_path):
    png = tmp_path / "print.png"
    result = runner.invoke(app, ["data", "show", "rendered/print", "--out", str(png), "--per-class", "2"])
    assert result.exit_code == 0, result.output
    assert "7438" in result.output and "1860" in result.output and str(png) in result.output.replace("\n", "")
    assert png.read_bytes()[:4] == b"\x89PNG"
    bad = runner.invoke(app, ["data", "show", "corrupt/rain/1/mnist"])
    assert bad.exit_code == 2 and "unknown corruption" in bad.output
    missing = runner.invoke(app, ["data", "show", "office_caltech10/dslr", "--data-dir", str(tmp_path)])
    assert missing.exit_code == 2 and "fednorm data prepare office_caltech10" in missing.output.replace("\n", "")


def test_data_list_shows_the_object_and_corrupted_domains(tmp_path):
    listed = runner.invoke(app, ["data", "list", "--data-dir", str(tmp_path)])
    assert listed.exit_code == 0
    for name in ("office_caltech10/amazon", "domainnet/quickdraw", "cifar10/test", "corrupt/<corruption>"):
        assert name in listed.output


def test_data_prepare_object_options(tmp_path):
    result = runner.invoke(app, ["data", "prepare", "svhn", "--size", "32", "--data-dir", str(tmp_path)])
    assert result.exit_code == 2 and "--size and --domains" in result.output
    result = runner.invoke(app, ["data", "prepare", "office_caltech10", "--domains", "dslr,nowhere", "--no-download",
                                 "--data-dir", str(tmp_path), "--quiet"])
    assert result.exit_code == 2 and "nowhere" in result.output
    result = runner.invoke(app, ["data", "prepare", "domainnet", "--domains", "real", "--no-download",
                                 "--data-dir", str(tmp_path), "--quiet"])
    assert result.exit_code == 2 and "real.zip" in result.output.replace("\n", "")


def test_rescore_prints_and_writes_stored_and_recomputed_bn_scores(tmp_path):
    out = tmp_path / "run"
    result = runner.invoke(app, ["run", *SETS, "--set", "methods=[fedbn]", "--set", "federation.rounds=2",
                                 "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["rescore", str(out)])
    assert result.exit_code == 0, result.output
    table = (out / "rescore_bn.md").read_text()
    assert table.strip() in result.output and "| fedbn/seed0 | 2 | recomputed |" in table
    result = runner.invoke(app, ["rescore", str(out), "--selected"])  # no validation data: no selected model
    assert result.exit_code == 2 and "no cell has a selected.pt" in " ".join(result.output.split())


def test_run_help_says_what_its_config_argument_may_be():
    """The arguments' help reaches --help (typer 0.20, which Flower 1.41 caps, drops it with click 8.5)."""
    result = runner.invoke(app, ["run", "--help"], terminal_width=200)
    assert result.exit_code == 0 and "YAML config file or preset name" in result.output
    result = runner.invoke(app, ["resume", "--help"], terminal_width=200)
    assert "a run folder written by `fednorm run`" in result.output


def test_presets_lists_one_aligned_line_per_preset_and_no_warnings():
    from fednorm.runs.config import preset_names

    result = runner.invoke(app, ["presets"], terminal_width=400)
    assert result.exit_code == 0 and "warning" not in result.output
    lines = result.output.splitlines()
    names = preset_names()
    assert [line.split()[0] for line in lines] == names
    width = max(map(len, names))
    assert all(line[width] == " " and line[width + 1] != " " for line in lines)  # descriptions start in one column


def test_a_folder_given_as_config_is_a_message_naming_resume_for_a_run_folder(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    result = runner.invoke(app, ["run", str(plain), "--out", str(tmp_path / "r")])
    assert result.exit_code == 2 and "is a folder, not a config file" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "r").exists()
    (plain / "config.yaml").write_text("name: x\n")
    result = runner.invoke(app, ["run", str(plain)], terminal_width=400)
    assert result.exit_code == 2 and f"`fednorm resume {plain}` continues it" in result.output


def test_out_on_an_existing_file_fails_before_the_data_are_built(tmp_path, monkeypatch):
    from fednorm.runs import runner as run_module

    monkeypatch.setattr(run_module, "build_federation_data", lambda *a, **k: pytest.fail("built the data first"))
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    for out in (taken, taken / "run"):
        result = runner.invoke(app, ["run", *SETS, "--out", str(out), "--quiet"], terminal_width=400)
        assert result.exit_code == 2 and f"{taken} is a file; choose another --out" in result.output, result.output
    assert taken.read_text() == "mine"


def test_resume_of_a_finished_run_says_so_and_builds_no_data(tmp_path, monkeypatch):
    from fednorm.runs import runner as run_module

    out = tmp_path / "run"
    result = runner.invoke(app, ["run", *SETS, "--set", "methods=[fedavg]", "--set", "federation.rounds=1",
                                 "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    (out / "results.md").unlink()
    monkeypatch.setattr(run_module, "build_federation_data", lambda *a, **k: pytest.fail("built the data"))
    result = runner.invoke(app, ["resume", str(out), "--quiet"], terminal_width=400)
    assert result.exit_code == 0, result.output
    assert f"every cell of {out} finished earlier (1 cells, 1 rounds): nothing to train" in result.output
    assert (out / "results.md").exists()  # the table is written again from the summaries


def test_resume_names_the_run_folder_when_given_one_of_its_files_and_checks_its_options_first(tmp_path):
    out = tmp_path / "run"
    result = runner.invoke(app, ["run", *SETS, "--set", "methods=[fedavg]", "--set", "federation.rounds=1",
                                 "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["resume", str(out / "config.yaml")], terminal_width=400)
    assert result.exit_code == 2 and f"is a file of a run: give its run folder, {out}" in result.output
    result = runner.invoke(app, ["resume", str(out), "--on-divergence", "recrod"], terminal_width=400)
    said = " ".join(result.output.replace("│", " ").split())  # the usage error is a rich panel: unwrap it
    assert result.exit_code == 2 and "'recrod' is not one of 'stop', 'record'" in said, said
    assert "preparing data" not in result.output


def test_report_skips_summary_files_fednorm_did_not_write_and_names_a_damaged_cell(tmp_path):
    out = tmp_path / "project" / "run"
    result = runner.invoke(app, ["run", *SETS, "--set", "methods=[fedavg]", "--set", "federation.rounds=1",
                                 "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    other = tmp_path / "project" / "tool" / "summary.json"
    other.parent.mkdir()
    other.write_text("{}")
    result = runner.invoke(app, ["report", str(tmp_path / "project"), "--markdown"], terminal_width=400)
    assert result.exit_code == 0, result.output
    assert "fedavg" in result.output and "skipped 1 summary.json file(s) that fednorm did not write" in result.output
    alone = runner.invoke(app, ["report", str(other.parent)], terminal_width=400)
    assert alone.exit_code == 2 and "holds no run" in alone.output and "Traceback" not in alone.output
    (out / "fedavg" / "seed0" / "summary.json").write_text('{"note": "overwritten"}')
    result = runner.invoke(app, ["report", str(out)], terminal_width=400)
    assert result.exit_code == 2 and "is not a cell summary" in result.output and "fednorm resume" in result.output


def test_a_failure_after_the_run_folder_is_written_says_what_is_kept_and_how_to_go_on(tmp_path, monkeypatch):
    from fednorm.cli import main as cli_main
    from fednorm.data.domain import DataError

    def failing(write):
        def start(config, run_dir, **kwargs):
            if write:
                run_dir.mkdir(parents=True)
                (run_dir / "config.yaml").write_text("name: x\n")
            raise DataError("the data folder moved")
        return start

    out = tmp_path / "run"
    monkeypatch.setattr(cli_main, "start_run", failing(write=False))
    nothing = runner.invoke(app, ["run", *SETS, "--out", str(out), "--quiet"], terminal_width=400)
    assert nothing.exit_code == 2 and "error: the data folder moved" in nothing.output
    assert "resume" not in nothing.output  # no folder to resume: no hint that points at one
    monkeypatch.setattr(cli_main, "start_run", failing(write=True))
    kept = runner.invoke(app, ["run", *SETS, "--out", str(out), "--quiet"], terminal_width=400)
    assert kept.exit_code == 2
    assert f"what finished is kept in {out}; once fixed, `fednorm resume {out}` goes on" in kept.output
    assert "diverge" not in kept.output


def test_ctrl_c_before_anything_is_written_or_during_a_resume_exits_130(tmp_path, monkeypatch):
    from fednorm.cli import main as cli_main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_main, "start_run", interrupted)
    early = runner.invoke(app, ["run", *SETS, "--out", str(tmp_path / "none"), "--quiet"], terminal_width=400)
    assert early.exit_code == 130 and "stopped" in early.output and "resume" not in early.output
    out = tmp_path / "run"
    monkeypatch.undo()
    assert runner.invoke(app, ["run", *SETS, "--set", "federation.rounds=1", "--set", "methods=[fedavg]",
                               "--out", str(out), "--quiet"]).exit_code == 0
    monkeypatch.setattr(cli_main, "resume_run", interrupted)
    result = runner.invoke(app, ["resume", str(out), "--rounds", "2", "--quiet"], terminal_width=400)
    assert result.exit_code == 130
    assert f"stopped; `fednorm resume {out}` goes on from the last checkpoint" in result.output


def test_ctrl_c_during_a_run_exits_130_and_says_how_to_go_on(tmp_path, monkeypatch):
    from fednorm.cli import main as cli_main

    out = tmp_path / "run"

    def started_then_interrupted(config, run_dir, **kwargs):
        run_dir.mkdir(parents=True)
        (run_dir / "config.yaml").write_text("name: x\n")
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_main, "start_run", started_then_interrupted)
    result = runner.invoke(app, ["run", *SETS, "--out", str(out), "--quiet"], terminal_width=400)
    assert result.exit_code == 130
    assert f"stopped; `fednorm resume {out}` goes on from the last checkpoint" in result.output


def test_flower_commands_without_the_flower_extra_say_how_to_install_it(tmp_path, monkeypatch):
    # as on a machine with `pip install fednorm` only: importing the Flower engine fails
    monkeypatch.setitem(sys.modules, "fednorm.engines.flower", None)
    monkeypatch.setitem(sys.modules, "fednorm.engines.flower.runtime", None)
    for command in (["sim", *SETS, "--out", str(tmp_path / "run")], ["clients", *SETS]):
        result = runner.invoke(app, ["flower", *command], terminal_width=400)
        output = " ".join(result.output.split())
        assert result.exit_code == 2 and "Flower is not installed" in output, output
        assert "install it with: pip install 'fednorm[flower]'" in output
    assert not (tmp_path / "run").exists()


def test_ctrl_c_while_the_command_starts_is_one_line_not_a_traceback(monkeypatch, capsys):
    import importlib.metadata

    import fednorm.cli as cli

    [script] = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "fednorm"]
    assert script.load() is cli.entry_point  # the installed command goes through the guard

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_load_app", interrupted)
    with pytest.raises(SystemExit) as stopped:
        cli.entry_point()
    assert stopped.value.code == 130 and capsys.readouterr().err == "stopped while starting; nothing was run\n"
