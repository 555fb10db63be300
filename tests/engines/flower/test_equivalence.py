"""The Flower engine gives the in-process engine's numbers, message by message (ClientApps in this process)."""

import json

import pytest

from fednorm.engines.flower.app import make_client_app
from fednorm.engines.flower.node import experiment_text
from fednorm.engines.flower.server import FlowerOptions, ServerSettings, run_experiment
from fednorm.runs import store
from fednorm.runs.runner import PARTITIONS_FILE, load_run_config, start_run

from .conftest import tiny_config
from .fakegrid import FakeGrid


def in_process_and_flower(tmp_path, config, nodes=None):
    start_run(config, tmp_path / "in_process")
    nodes = nodes or [{"client-index": i} for i in range(len(config.data.domains) * config.data.clients_per_domain)]
    grid = FakeGrid(make_client_app(), nodes)
    run_experiment(grid, ServerSettings(experiment_text(config), str(tmp_path / "flower"), FlowerOptions(node_wait=5)))
    return grid


def partitions(run):
    records = json.loads((run / PARTITIONS_FILE).read_text())
    assert all(len(r["test"]["sha256"]) == 64 for r in records)  # records of data, whatever the partition scheme
    return records


def metrics(run, config):
    return {m.display: store.read_metrics(run / m.display / "seed0" / store.METRICS_FILE) for m in config.methods}


@pytest.mark.parametrize("extra", [
    ["methods=[fedbn, fedavg]", "diagnostics.drift=true"],  # HarmoFL's client drift travels in the reply
    ["methods=[scaffold, silobn, fednova]", "federation.persistent_optimizer=true", "training.momentum=0.9"],
    # an external client under every mode, fedbn_average from the nodes' BN affine parameters under FedBN, from
    # the global affine under SiloBN (its nodes keep only BN statistics); bn_average from the nodes' BN affine and
    # statistics under FedBN, their statistics with the global affine under SiloBN, the global model under FedAvg
    ["methods=[fedbn, fedavg, silobn]", "external.domains=[rendered/street]", "federation.eval_every=1",
     "federation.rounds=2", "external.modes=[global, test_time_bn, fedbn_average, bn_average]"],
    ["methods=[harmofl, fixbn]", "federation.rounds=2", "federation.eval_every=1", "data.val_fraction=0.2"],
    # SingleSet, and UniFed's add-on on the stateful client algorithms (MOON's previous model, FedDC's drift),
    # each evaluated with its BN statistics recomputed on the node's training data
    ["methods=[singleset, {name: moon, policy: local_bn, label: moon+ours}, "
     "{name: feddc, policy: local_bn, label: feddc+ours}]", "federation.rounds=2", "federation.eval_every=1",
     "federation.evaluation_bn=recomputed"],
    # FedProx, no-BN models, a server optimizer with client-specific BN, FixBN over several rounds after its switch
    ["methods=[fedprox, fedwon, fedavg_gn, {name: fedadam, policy: local_bn, label: fedadam+ours}, "
     "{name: fixbn, freeze_bn_stats_at: 2}]", "federation.rounds=3", "federation.eval_every=1"],
    # kept momentum under local BN; Per-FedAvg adapting on each split's own samples before scoring it
    ["methods=[fedbn, perfedavg]", "federation.persistent_optimizer=true", "training.momentum=0.9",
     "federation.rounds=2", "data.val_fraction=0.2", "federation.eval_every=1"],
    ["methods=[{name: fbn, server: {rule: median, nnm: true}}]", "data.domains=[rendered/print]",
     "data.partition=gamma", "data.num_clients=4", "training.steps=2", "federation.weighting=uniform",
     "federation.byzantine={count: 1, attack: sign_flip}", "federation.fraction=0.75"],
])
def test_flower_metrics_equal_the_in_process_engine(tmp_path, extra):
    config = tiny_config(*extra)
    nodes = [{"partition-id": i, "num-partitions": 2} for i in range(2)]  # a node may hold several clients
    in_process_and_flower(tmp_path, config, nodes)
    assert metrics(tmp_path / "flower", config) == metrics(tmp_path / "in_process", config)
    assert partitions(tmp_path / "flower") == partitions(tmp_path / "in_process")  # the nodes' data, not placeholders


def test_bn_statistics_leave_a_node_only_when_bn_average_is_asked(tmp_path):
    """Under FedBN, external clients' fedbn_average needs the clients' BN weight and bias from their nodes, and
    bn_average their running statistics too: a node sends the statistics only when bn_average is among the
    modes, never anything else it keeps locally."""
    from fednorm.engines.flower import messages as m

    sent = {}
    for modes in ("[global, fedbn_average]", "[global, bn_average]"):
        config = tiny_config("external.domains=[rendered/street]", f"external.modes={modes}", "federation.rounds=1",
                             "federation.eval_every=1")
        grid = FakeGrid(make_client_app(), [{"client-index": i} for i in range(3)])  # the external client's too
        run_experiment(grid, ServerSettings(experiment_text(config), str(tmp_path / modes[9:-1]),
                                            FlowerOptions(node_wait=5)))
        replies = [r.content.array_records[m.BN_LAYERS] for r in grid.received if m.BN_LAYERS in r.content.array_records]
        assert len(replies) == 2  # one per internal client, after its one round
        sent[modes] = {key.rsplit(".", 1)[-1] for reply in replies for key in reply.keys()}
        run = tmp_path / modes[9:-1] / "fedbn" / "seed0" / store.METRICS_FILE
        scored = {r["client"] for r in store.read_metrics(run) if r["split"] == "test"}
        assert f"rendered/street:{modes[9:-1]}" in scored
    assert sent == {"[global, fedbn_average]": {"weight", "bias"},
                    "[global, bn_average]": {"weight", "bias", "running_mean", "running_var"}}


def test_a_node_that_keeps_its_label_counts_to_itself_reports_sizes_and_sha256_only(tmp_path):
    # node config share-labels=false: the label counts per class never leave the node; the run's numbers and the
    # sizes and sha256 in partitions.json (what a resume checks) are those of the in-process run
    config = tiny_config("methods=[fedavg]", "federation.rounds=1")
    grid = in_process_and_flower(tmp_path, config, [{"client-index": 0, "share-labels": False},
                                                   {"client-index": 1, "share-labels": "false"}])
    assert metrics(tmp_path / "flower", config) == metrics(tmp_path / "in_process", config)
    without_labels = [{k: ({kk: vv for kk, vv in v.items() if kk != "labels"} if isinstance(v, dict) else v)
                       for k, v in record.items()} for record in partitions(tmp_path / "in_process")]
    assert partitions(tmp_path / "flower") == without_labels != partitions(tmp_path / "in_process")
    rosters = [r for r in grid.received if "roster" in r.content.config_records]
    assert rosters and all('"labels"' not in p and '"pixels"' not in p
                           for r in rosters for p in r.content.config_records["roster"]["partition"])


def test_cross_device_sampling_gives_the_in_process_numbers(tmp_path):
    """8 stateless clients, half of them sampled each round, one client per node."""
    config = tiny_config("methods=[fixbn, fedavg]", "federation.setting=cross_device", "data.partition=even",
                         "data.clients_per_domain=4", "federation.fraction=0.5", "training.batch_size=4",
                         "federation.rounds=3", "federation.eval_every=1")
    in_process_and_flower(tmp_path, config)
    assert metrics(tmp_path / "flower", config) == metrics(tmp_path / "in_process", config)
    assert partitions(tmp_path / "flower") == partitions(tmp_path / "in_process")


def test_a_domains_validation_score_is_the_union_of_its_clients_validation_splits(tmp_path):
    """Cross-device with validation data: the domain's validation score is over every client's validation slice
    (each node scores its own, the server combines them by size), as in-process; the test score is unchanged."""
    config = tiny_config("methods=[fedavg]", "federation.setting=cross_device", "data.partition=even",
                         "data.clients_per_domain=4", "federation.fraction=0.5", "training.batch_size=4",
                         "federation.rounds=2", "federation.eval_every=1", "data.val_fraction=0.2")
    in_process_and_flower(tmp_path, config)
    flower, local = metrics(tmp_path / "flower", config), metrics(tmp_path / "in_process", config)
    for a, b in zip(flower["fedavg"], local["fedavg"], strict=True):
        assert {k: v for k, v in a.items() if k not in ("acc", "loss")} == \
            {k: v for k, v in b.items() if k not in ("acc", "loss")}
        if "acc" in a:  # float32 losses summed in another order: equal up to rounding
            assert a["acc"] == pytest.approx(b["acc"], rel=1e-12) and a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    from fednorm.runs.runner import build_federation_data

    vals = [r for r in local["fedavg"] if r["split"] == "val"]
    clients = build_federation_data(config, None)
    for r in vals:  # the four clients' slices of the domain, not the first client's alone
        slices = [len(c.val) for c in clients if c.domain == r["client"]]
        assert len(slices) == 4 and min(slices) > 0 and r["n"] == sum(slices)
    assert {r["client"] for r in vals} == {c.domain for c in clients}


def test_diagnostics_that_need_every_clients_data_are_refused_on_flower(tmp_path):
    from fednorm.runs.runner import RunError

    config = tiny_config("diagnostics.gradient_dissimilarity=true")
    grid = FakeGrid(make_client_app(), [{"client-index": 0}, {"client-index": 1}])
    with pytest.raises(RunError, match="in-process engine"):
        run_experiment(grid, ServerSettings(experiment_text(config), str(tmp_path / "f"), FlowerOptions(node_wait=5)))
    assert not (tmp_path / "f").exists()


def model_keys(config):
    """Every state entry of the cell's model."""
    from fednorm.runs.runner import build_engine, build_federation_data

    engine = build_engine(config, config.methods[0], 0, build_federation_data(config, None))
    return set(engine.model.state_dict())


def bn_keys(config):
    """Every BatchNorm entry of the cell's model (affine, running statistics, counter), found by module type."""
    from fednorm.runs.runner import build_engine, build_federation_data

    from ...conftest import batchnorm_keys

    return batchnorm_keys(build_engine(config, config.methods[0], 0, build_federation_data(config, None)).model)


def test_fedbn_state_never_leaves_the_nodes(tmp_path):
    config = tiny_config("methods=[fedbn]", "federation.rounds=2")
    grid = in_process_and_flower(tmp_path, config)
    bn = bn_keys(config)
    assert bn
    for msg in grid.sent + grid.received:  # everything that went over the wire, both ways
        for record in msg.content.array_records.values():
            assert not bn & set(record), sorted(bn & set(record))
    for context in grid.contexts.values():  # ... and it is on the nodes
        local = [r for name, r in context.state.array_records.items() if name.endswith("/local")]
        assert local and set(local[0]) == bn


def test_a_diverging_client_settles_as_in_process_by_on_divergence(tmp_path):
    """A node whose local loss turns NaN is the run's divergence on Flower too (not a faulty node left out):
    under `record` the cell is marked diverged at the same round with the same metrics; under `stop` the run
    stops with the cell named."""
    from fednorm.methods.aggregation import DivergenceError

    methods = "methods=[{name: fedavg, label: fedavg-lr1e9, lr: 1.0e9}, fedbn]"
    config = tiny_config(methods, "federation.on_divergence=record")
    in_process_and_flower(tmp_path, config)
    assert metrics(tmp_path / "flower", config) == metrics(tmp_path / "in_process", config)
    records = {run: store.read_metrics(tmp_path / run / "fedavg-lr1e9" / "seed0" / store.METRICS_FILE)
                 for run in ("flower", "in_process")}
    assert any(r.get("diverged") for r in records["flower"])
    stop = tiny_config(methods)
    grid = FakeGrid(make_client_app(), [{"client-index": i} for i in range(2)])
    with pytest.raises(DivergenceError, match=r"fedavg-lr1e9 seed 0 diverged in round \d: client .* "
                                              "DivergenceError.*lower the learning rate") as err:
        run_experiment(grid, ServerSettings(experiment_text(stop), str(tmp_path / "stop"), FlowerOptions(node_wait=5)))
    # its way on is a Flower resume (the in-process `fednorm resume` refuses a Flower run), and it works: with the
    # edit it names, the resumed run records the divergence and goes on, as if run with `record` from the start
    assert "federation.on_divergence: record" in str(err.value) and "fednorm flower sim --out" in str(err.value)
    assert "fednorm resume" not in str(err.value)
    config_path = tmp_path / "stop" / store.CONFIG_FILE
    config_path.write_text(config_path.read_text().replace("on_divergence: stop", "on_divergence: record"))
    edited = load_run_config(tmp_path / "stop")
    assert edited.federation.on_divergence == "record"
    grid = FakeGrid(make_client_app(), [{"client-index": i} for i in range(2)])
    run_experiment(grid, ServerSettings(experiment_text(edited), str(tmp_path / "stop"), FlowerOptions(node_wait=5),
                                        resume=True))
    assert metrics(tmp_path / "stop", config) == metrics(tmp_path / "flower", config)
