"""``fednorm rescore``: a run's cells scored again from their checkpoints with stored and recomputed BN statistics."""

import json
from dataclasses import replace

import pytest

from fednorm.runs import store
from fednorm.runs.rescore import RESULT_FILE, TABLE_FILE, rescore_run
from fednorm.runs.runner import RunError, build_engine, build_federation_data, load_run_config, start_run

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
