"""The offline commands on a Flower run folder (rescore, landscape, external-ablation), whose checkpoints hold the
server's state only: the clients' local state stays on their nodes."""

import json

import pytest

from fednorm.diagnostics.landscape import landscape_of_cell
from fednorm.runs.rescore import rescore_run
from fednorm.runs.runner import RunError
from fednorm.runs.unifed_ablation import ablation_rows, run_ablation

from .conftest import tiny_config
from .test_equivalence import in_process_and_flower

NODES = [{"partition-id": i, "num-partitions": 2} for i in range(2)]  # the external client is on a node too


def test_commands_that_score_clients_with_their_own_bn_refuse_a_flower_checkpoint(tmp_path):
    """FedBN's checkpoint from Flower has no client BN layers: scored offline, the clients would get the global
    model's never-aggregated BN entries, numbers of no model. Each command names why and the way on."""
    config = tiny_config("methods=[fedbn]", "federation.rounds=2", "external.domains=[rendered/street]")
    in_process_and_flower(tmp_path, config, NODES)
    flower = tmp_path / "flower"
    for command, call in [("rescore", lambda: rescore_run(flower)),
                          ("landscape", lambda: landscape_of_cell(flower, "fedbn", points=3, samples=8))]:
        with pytest.raises(RunError, match=rf"from a Flower run: it holds the server's state only, and the clients "
                                           rf"of 'fedbn' keep their own BN state .* `fednorm {command}` needs .*"
                                           rf"fednorm run .*flower/config.yaml --out NEW_DIR"):
            call()
    assert not list(flower.glob("fedbn/seed0/landscape*")) and not list(flower.glob("*rescore*"))
    rescore_run(tmp_path / "in_process")  # the same cell trained in-process has its clients' state


def test_the_external_ablation_of_a_flower_fedbn_cell_reads_app_g_from_the_run(tmp_path):
    """FedBN App. G's row averages the clients' own BN affine parameters, and the bn_average row their BN layers
    with the running statistics, which stay on the nodes; the Flower run scored them from what the nodes sent, so
    the ablation reads them from the run's metrics and computes the other rows (global model, test-time
    statistics) from the server's state: every row as in-process, where they come from the clients' states."""
    config = tiny_config("methods=[fedbn]", "federation.rounds=2", "external.domains=[rendered/street]",
                         "external.modes=[global, test_time_bn, fedbn_average, bn_average]")
    in_process_and_flower(tmp_path, config, NODES)
    rows = ablation_rows(tmp_path / "flower")
    assert rows == ablation_rows(tmp_path / "in_process")
    averaged = {r[1]: r[3] for r in rows if r[1] in ("fedbn_average (App. G)", "bn_average (averaged statistics)")}
    assert len(averaged) == 2  # both rows there, not dropped
    # a run that did not score bn_average: its Flower ablation leaves that row out (the clients' statistics are on
    # the nodes), in-process it is computed from the clients' states
    plain = tiny_config("methods=[fedbn]", "federation.rounds=2", "external.domains=[rendered/street]")
    in_process_and_flower(tmp_path / "plain", plain, NODES)
    flower_rows, local_rows = ablation_rows(tmp_path / "plain" / "flower"), ablation_rows(tmp_path / "plain" / "in_process")
    assert [r for r in local_rows if r[1] != "bn_average (averaged statistics)"] == flower_rows
    assert [r[1] for r in local_rows if r[1] == "bn_average (averaged statistics)"]


def test_what_needs_only_the_servers_state_gives_the_in_process_numbers_from_a_flower_run(tmp_path):
    """FedAvg's checkpoint is the whole model; SiloBN keeps only BN statistics on its clients, so the external
    ablation (global model, test-time statistics, App. G's average of the global affine) needs the server only."""
    config = tiny_config("methods=[fedavg, silobn]", "federation.rounds=2", "external.domains=[rendered/street]",
                         "external.modes=[global, test_time_bn, fedbn_average, bn_average]")
    in_process_and_flower(tmp_path, config, NODES)
    # SiloBN's bn_average row needs its clients' statistics: read from the Flower run's metrics, as in-process
    assert ablation_rows(tmp_path / "flower") == ablation_rows(tmp_path / "in_process")
    read = lambda run: json.loads((run / "fedavg" / "seed0" / "landscape.json").read_text())  # noqa: E731
    for run in ("flower", "in_process"):
        landscape_of_cell(tmp_path / run, "fedavg", points=3, samples=8)
    assert read(tmp_path / "flower") == read(tmp_path / "in_process")
    with pytest.raises(RunError, match="clients of 'silobn' keep their own BN state"):  # scored with their own
        rescore_run(tmp_path / "flower")
