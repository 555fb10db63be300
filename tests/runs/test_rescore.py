"""``fednorm rescore``: a run's cells scored again from their checkpoints with stored and recomputed BN statistics."""

import json
from dataclasses import replace

import pytest
import torch

from fednorm.runs import store
from fednorm.runs.rescore import RESULT_FILE, TABLE_FILE, markdown_table, rescore_run
from fednorm.runs.runner import RunError, RunWarning, build_engine, build_federation_data, load_run_config, start_run

from ..conftest import tiny_run_config as tiny_config


def test_stored_reproduces_the_run_and_recomputed_is_the_engines_recalibrated_evaluation(tmp_path):
    run = tmp_path / "run"
    start_run(tiny_config("methods=[fedbn, fedavg]", "federation.rounds=2"), run)
    rows = {row["method"]: row for row in rescore_run(run)}
    config = load_run_config(run)
    clients = build_federation_data(config, None)
    for method in config.methods:
        row = rows[method.display]
        summary = json.loads((run / method.display / "seed0" / store.SUMMARY_FILE).read_text())
        recorded = {c["name"]: 100 * c["test"]["final_acc"] for c in summary["clients"]}
        assert row["round"] == 2 and row["stored"] == pytest.approx(recorded, abs=1e-9)
    # FedBN's recomputed row is its engine's evaluation with the option on, from the same checkpoint
    fedbn = next(m for m in config.methods if m.display == "fedbn")
    engine = build_engine(config, fedbn, 0, clients)
    engine.load_state_dict(store.load_checkpoint(run / "fedbn" / "seed0" / store.CHECKPOINT_FILE))
    engine.federation = replace(engine.federation, recompute_bn_statistics=True)
    expected = {e.client: 100 * e.accuracy for e in engine.evaluate(("test",))}
    assert rows["fedbn"]["recomputed"] == expected
    assert rows["fedbn"]["recomputed"] != rows["fedbn"]["stored"]
    # FedAvg shares its statistics: nothing per client to recompute
    assert rows["fedavg"]["recomputed"] is None
    assert json.loads((run / RESULT_FILE).read_text()) == list(rows.values())
    table = (run / TABLE_FILE).read_text()
    assert "| fedbn/seed0 | 2 | recomputed |" in table and "| fedavg/seed0 | 2 | stored |" in table
    assert "| fedavg/seed0 | 2 | recomputed |" not in table


def test_a_run_without_checkpoints_or_without_local_statistics_is_named(tmp_path):
    run = tmp_path / "run"
    start_run(tiny_config("methods=[fedavg]", "federation.rounds=1", "federation.eval_every=1"), run)
    with pytest.raises(RunError, match="no method of the run keeps BN statistics on each client"):
        rescore_run(run)
    (run / "fedavg" / "seed0" / store.CHECKPOINT_FILE).unlink()
    with pytest.raises(RunError, match="no cell has a checkpoint.pt"):
        rescore_run(run)
    # the FedBN cell's checkpoint gone: not "no method keeps BN statistics", but which cells could not be scored
    both = tmp_path / "both"
    start_run(tiny_config("methods=[fedavg, fedbn]", "federation.rounds=1", "federation.eval_every=1"), both)
    (both / "fedbn" / "seed0" / store.CHECKPOINT_FILE).unlink()
    with pytest.raises(RunError, match=r"no method among the cells with a checkpoint.pt here \(fedavg; fedbn ha\(s\) "
                                       r"none, e.g. deleted or trained elsewhere\) keeps BN statistics"):
        rescore_run(both)


def test_one_unreadable_checkpoint_costs_its_cell_only(tmp_path):
    run = tmp_path / "run"
    start_run(tiny_config("methods=[fedbn, silobn]", "federation.rounds=1", "federation.eval_every=1"), run)
    whole = {row["method"]: row for row in rescore_run(run)}
    silobn_file = run / "silobn" / "seed0" / store.CHECKPOINT_FILE
    state = store.load_checkpoint(silobn_file)
    silobn_file.write_bytes(b"cut off")
    with pytest.warns(RunWarning, match=r"skipped silobn seed 0: .*checkpoint.*unreadable"):
        rows = rescore_run(run)
    assert [row["method"] for row in rows] == ["fedbn"] and rows[0] == whole["fedbn"]
    assert json.loads((run / RESULT_FILE).read_text()) == rows
    # a checkpoint of another version of the model (one entry more) costs its cell only too
    extra = {**state["global_state"], "extra.weight": torch.ones(1)}
    store.save_checkpoint(silobn_file, {**state, "global_state": extra})
    with pytest.warns(RunWarning, match=r"skipped silobn seed 0: .*does not match the model.*extra.weight"):
        assert rescore_run(run) == rows
    (run / "fedbn" / "seed0" / store.CHECKPOINT_FILE).write_bytes(b"cut off")
    with pytest.warns(RunWarning), pytest.raises(RunError, match=r"no checkpoint.pt could be read \(fedbn seed 0, "
                                                                 r"silobn seed 0;"):
        rescore_run(run)


def test_rescore_scores_only_the_internal_clients(tmp_path):
    """An external client never trained and keeps no BN statistics of its own: it is not part of the rows."""
    run = tmp_path / "run"
    start_run(tiny_config("methods=[fedbn]", "federation.rounds=1", "external.domains=[rendered/street]"), run)
    clients = build_federation_data(load_run_config(run), None)
    internal = [c.name for c in clients if not c.meta.get("external")]
    assert len(internal) < len(clients)  # the external client is in the federation's data
    [row] = rescore_run(run)
    assert list(row["stored"]) == internal and list(row["recomputed"]) == internal


def test_table_average_and_gain_are_over_the_clients_of_each_row():
    rows = [{"method": "fedbn", "seed": 0, "round": 5,
             "stored": {"digits/a": 80.0, "digits/b": 60.0, "digits/c": 70.0},
             "recomputed": {"digits/a": 90.0, "digits/b": 63.0, "digits/c": 72.0}},
            {"method": "fedavg", "seed": 1, "round": 4,
             "stored": {"digits/a": 50.0, "digits/b": 40.0, "digits/c": 30.0}, "recomputed": None}]
    lines = markdown_table(rows).splitlines()
    assert lines[0] == "| cell | round | BN statistics | a | b | c | Avg | gain |"
    assert lines[2:] == ["| fedbn/seed0 | 5 | stored | 80.00 | 60.00 | 70.00 | 70.00 |  |",
                         "| fedbn/seed0 | 5 | recomputed | 90.00 | 63.00 | 72.00 | 75.00 | +5.00 |",
                         "| fedavg/seed1 | 4 | stored | 50.00 | 40.00 | 30.00 | 40.00 |  |"]
