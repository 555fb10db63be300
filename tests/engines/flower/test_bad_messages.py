"""The bad-reply policy, on a grid that runs the ClientApps in this process (no network, fast).

A reply that is missing, an error, or malformed (missing arrays, wrong shape or dtype, NaN / Inf) is left
out of its round with a log line; the remaining weights are renormalized; with no reply left the global
model stays; a node that missed a reply is not asked again. Every round's participation is recorded.
"""

import json
from types import SimpleNamespace

import pytest
import torch
from flwr.app import Error, Message

from fednorm.engines.flower import messages as m
from fednorm.engines.flower.app import make_client_app
from fednorm.engines.flower.node import experiment_text
from fednorm.engines.flower.server import PARTICIPATION_FILE, FlowerOptions, ServerSettings, run_experiment
from fednorm.methods.aggregation import UpdateError
from fednorm.methods.server import ClientReply, ServerSpec, ServerUpdate
from fednorm.models.registry import build_model
from fednorm.runs import store
from fednorm.runs.runner import RunError

from ...conftest import batchnorm_keys
from .conftest import tiny_config
from .fakegrid import FakeGrid, Late

THREE = "data.domains=[rendered/print, rendered/neon, rendered/synth]"


def run_fake(tmp_path, config, tamper=None, nodes=None, timeout=2.0):
    nodes = nodes or [{"client-index": i} for i in range(len(config.data.domains))]
    grid = FakeGrid(make_client_app(), nodes, tamper)
    out = tmp_path / "run"
    run_experiment(grid, ServerSettings(experiment_text(config), str(out), FlowerOptions(round_timeout=timeout,
                                                                                         node_wait=5)))
    return grid, out / config.methods[0].display / "seed0"


def participation(cell):
    return [r for r in store.read_metrics(cell / PARTICIPATION_FILE) if r["kind"] == "train"]


def edit_arrays(record: str, edit):
    """A tamper hook applying ``edit`` to one array record of a reply (its state, or its algorithm message)."""
    def change(reply):
        arrays = m.from_arrays(reply.content, record)
        edit(arrays)
        reply.content[record] = m.to_arrays(arrays)
        return reply
    return change


def edit_state(edit):
    return edit_arrays(m.STATE, edit)


def first_conv(state):
    return next(k for k in state if k.endswith("weight") and state[k].ndim == 4)


@pytest.mark.parametrize("edit, reason", [
    (lambda s: s[first_conv(s)].view(-1).__setitem__(0, float("nan")), "non-finite"),
    (lambda s: s[first_conv(s)].view(-1).__setitem__(0, float("inf")), "non-finite"),
    (lambda s: s.__setitem__(first_conv(s), torch.zeros(3, 3)), "shape"),
    (lambda s: s.__setitem__(first_conv(s), s[first_conv(s)].double()), "float64"),
    (lambda s: s.pop(first_conv(s)), "missing"),
])
def test_a_malformed_reply_is_left_out_and_the_weights_renormalized(tmp_path, caplog, edit, reason):
    """Three clients of unequal size (one domain, gamma partition), weighted by sample count: the middle one's
    reply is malformed, and the global model is the mean of the other two by THEIR sample counts."""
    from fednorm.runs.runner import build_federation_data

    config = tiny_config("data.domains=[rendered/print]", "data.partition=gamma", "data.num_clients=3",
                         "federation.weighting=samples", "federation.rounds=2", "federation.eval_every=2")
    clients = build_federation_data(config, None)
    names = [c.name for c in clients]
    sizes = {100: clients[0].num_train, 102: clients[2].num_train}
    assert sizes[100] != sizes[102]  # sample-count and uniform weights differ
    kept: dict = {}

    def tamper(node_id, msg, reply):
        if msg.metadata.group_id == "train-1":
            if node_id == 101:
                return edit_state(edit)(reply)
            kept[node_id] = m.decode_reply(reply.content, reply.content[m.CELL]["client"], 0.0)[0]
        return reply

    grid, cell = run_fake(tmp_path, config, tamper, nodes=[{"client-index": i} for i in range(3)])
    rounds = participation(cell)
    assert [r["clients_used"] for r in rounds] == [3, 2]
    assert list(rounds[1]["dropped"]) == [names[1]] and reason in rounds[1]["dropped"][names[1]]
    assert "left out of the round" in caplog.text and reason in caplog.text
    # the global model is the renormalized weighted mean of the two replies left (FedAvg by sample count)
    final = torch.load(cell / "checkpoint.pt", weights_only=False)["global_state"]
    total = sum(sizes.values())
    for k in [k for k in kept[100].state if kept[100].state[k].is_floating_point()]:
        expected = sum(kept[n].state[k].double() * sizes[n] / total for n in kept)
        assert torch.allclose(final[k].double(), expected, atol=1e-6), k
    # the run went on: the evaluation after the last round covers every client
    tests = [r for r in store.read_metrics(cell / "metrics.jsonl") if r["split"] == "test"]
    assert {r["client"] for r in tests} == set(names)


def test_an_error_reply_is_left_out(tmp_path):
    config = tiny_config(THREE, "federation.rounds=2", "federation.eval_every=2")

    def tamper(node_id, msg, reply):
        if node_id == 102 and msg.metadata.group_id == "train-0":
            return Message(Error(code=2, reason="Traceback ...\nFloatingPointError: loss became nan"), reply_to=msg)
        return reply

    grid, cell = run_fake(tmp_path, config, tamper)
    rounds = participation(cell)
    assert [r["clients_used"] for r in rounds] == [2, 3]
    assert "FloatingPointError: loss became nan" in rounds[0]["dropped"]["rendered/synth"]


def test_a_node_that_dies_is_left_out_and_the_run_finishes(tmp_path, caplog):
    config = tiny_config(THREE, "federation.rounds=3", "federation.eval_every=1")

    def tamper(node_id, msg, reply):
        return FakeGrid.DIE if node_id == 102 and msg.metadata.group_id == "train-1" else reply

    grid, cell = run_fake(tmp_path, config, tamper, timeout=0.5)
    rounds = participation(cell)
    assert [r["clients_used"] for r in rounds] == [3, 2, 2]
    assert "no reply within" in rounds[1]["dropped"]["rendered/synth"]
    assert rounds[2]["dropped"] == {"rendered/synth": "no live node holds it"}
    assert "node 102 did not answer in time" in caplog.text
    tests = [r for r in store.read_metrics(cell / "metrics.jsonl") if r["split"] == "test"]
    assert {r["client"] for r in tests if r["round"] == 3} == {"rendered/print", "rendered/neon"}
    assert json.loads((cell / "summary.json").read_text())["rounds"] == 3
    # flower.json: where each client ran, which node was lost, and the server's waits
    info = json.loads((cell.parent.parent / "flower.json").read_text())
    assert info["engine"] == "flower" and info["nodes"] == [100, 101, 102] and info["lost_nodes"] == [102]
    assert info["clients"] == {"rendered/print": 100, "rendered/neon": 101, "rendered/synth": 102}
    assert info["options"] == {"round_timeout": 0.5, "node_wait": 5}


def test_a_slow_node_is_left_out_of_its_round_and_takes_part_again(tmp_path, caplog):
    config = tiny_config(THREE, "federation.rounds=3", "federation.eval_every=3")

    def tamper(node_id, msg, reply):
        return Late(reply) if node_id == 102 and msg.metadata.group_id == "train-0" else reply

    grid, cell = run_fake(tmp_path, config, tamper, timeout=0.3)
    assert [r["clients_used"] for r in participation(cell)] == [2, 3, 3]
    assert "node 102 answered late; it takes part again" in caplog.text


def test_with_no_reply_left_the_global_model_stays(tmp_path, caplog):
    config = tiny_config("federation.rounds=2", "federation.eval_every=2")
    nan = edit_state(lambda s: s[first_conv(s)].view(-1).__setitem__(0, float("nan")))

    def tamper(node_id, msg, reply):
        return nan(reply) if msg.metadata.group_id == "train-1" else reply

    grid, cell = run_fake(tmp_path, config, tamper)
    rounds = participation(cell)
    assert rounds[1]["clients_used"] == 0 and rounds[1]["global_model"] == "unchanged (no reply)"
    assert "no client reply remains" in caplog.text
    sent = next(msg for msg in grid.sent if msg.metadata.group_id == "train-1")
    before = m.from_arrays(sent.content, m.GLOBAL)
    final = torch.load(cell / "checkpoint.pt", weights_only=False)["global_state"]
    assert all(torch.equal(final[k], v) for k, v in before.items())
    train = [r for r in store.read_metrics(cell / "metrics.jsonl") if r["split"] == "train"]
    assert {r["round"] for r in train} == {1}  # no training record for the round nobody completed


def test_an_experiment_with_a_setting_of_a_later_fednorm_names_it_and_the_version_mismatch():
    """A server of a later fednorm sends settings an older node does not know: the node's error names the setting
    and the likely cause on its last line (the line the server logs of a node's error)."""
    import yaml

    from fednorm.engines.flower.node import load_experiment
    from fednorm.engines.flower.server import _error_text
    from fednorm.runs.config import ConfigError

    document = yaml.safe_load(experiment_text(tiny_config("methods=[fedbn]")))
    document["methods"][0]["a_later_setting"] = None
    with pytest.raises(ConfigError) as err:
        load_experiment(yaml.safe_dump(document))
    # as a ClientApp's exception comes back (fakegrid.FakeGrid, like Flower's ClientApp error replies)
    reply = SimpleNamespace(error=Error(code=2, reason=f"{type(err.value).__name__}: {err.value}"))
    shown = _error_text(reply)
    assert "methods.0.a_later_setting" in shown and "same fednorm version" in shown
    # any other invalid setting keeps its own message
    document["methods"][0].pop("a_later_setting")
    document["training"]["lr"] = -1
    with pytest.raises(ConfigError) as err:
        load_experiment(yaml.safe_dump(document))
    assert "training.lr" in str(err.value) and "fednorm version" not in str(err.value)


def test_validate_checks_without_changing_anything():
    shared = {"w": torch.zeros(2, 2), "bn.running_mean": torch.zeros(2), "bn.num_batches_tracked": torch.tensor(0)}
    server = ServerUpdate(ServerSpec(), shared, param_keys={"w"})
    with pytest.raises(RuntimeError, match="begin"):
        server.validate(ClientReply("a", shared, 1.0))
    server.begin(shared)
    good = {"w": torch.ones(2, 2), "bn.running_mean": torch.ones(2), "bn.num_batches_tracked": torch.tensor(3)}
    server.validate(ClientReply("a", good, 1.0))
    for bad, match in [({**good, "w": torch.full((2, 2), float("nan"))}, "non-finite"),
                       ({**good, "w": torch.ones(3)}, "shape"),
                       ({**good, "w": torch.ones(2, 2, dtype=torch.float64)}, "float64"),
                       ({k: v for k, v in good.items() if k != "w"}, "missing"),
                       ({**good, "extra": torch.ones(1)}, "unexpected")]:
        with pytest.raises(UpdateError, match=match):
            server.validate(ClientReply("a", bad, 1.0))
    with pytest.raises(UpdateError, match="weight"):
        server.validate(ClientReply("a", good, float("nan")))
    server.add(ClientReply("a", good, 1.0))  # nothing was summed by the failed checks
    assert torch.equal(server.finish()["w"], torch.ones(2, 2))


@pytest.mark.parametrize("method, edit, reason", [
    # HarmoFL's round-1 image amplitude: wrong shape, or missing
    ("harmofl", lambda msg: msg.__setitem__("amp.client", msg["amp.client"][:, :5]), "shape"),
    ("harmofl", lambda msg: msg.pop("amp.client"), "expected ['amp.client']"),
    # SCAFFOLD's control-variate update in another dtype than the server's state
    ("scaffold", lambda msg: msg.update({k: v.double() for k, v in msg.items()}), "float64"),
])
def test_a_bad_algorithm_message_drops_only_that_client(tmp_path, method, edit, reason):
    config = tiny_config(THREE, f"methods=[{method}]", "federation.rounds=2", "federation.eval_every=2")

    def tamper(node_id, msg, reply):
        return edit_arrays(m.ALGORITHM_MESSAGE, edit)(reply) if node_id == 101 and msg.metadata.group_id == "train-0" else reply

    grid, cell = run_fake(tmp_path, config, tamper)
    rounds = participation(cell)
    assert [r["clients_used"] for r in rounds] == [2, 3]
    assert list(rounds[0]["dropped"]) == ["rendered/neon"] and reason in rounds[0]["dropped"]["rendered/neon"]


def test_harmofl_amplitudes_of_center_cropped_images_are_accepted(tmp_path):
    """With data.center_crop the clients' round-1 amplitudes have the cropped C x H x W (the model's input), and the
    server checks them against that, not the stored images' size."""
    config = tiny_config(THREE, "methods=[harmofl]", "model.name=resnet20", "model.width=1", "data.center_crop=24",
                         "federation.rounds=2", "federation.eval_every=2")
    sent = []

    def record(node_id, msg, reply):
        if msg.metadata.group_id == "train-0":
            sent.append(tuple(m.from_arrays(reply.content, m.ALGORITHM_MESSAGE)["amp.client"].shape))
        return reply

    grid, cell = run_fake(tmp_path, config, record)
    assert sent == [(3, 24, 24)] * 3
    rounds = participation(cell)
    assert [r["clients_used"] for r in rounds] == [3, 3] and not any(r["dropped"] for r in rounds)


def run_with_restart(tmp_path, config, events, unavailable_errors=False):
    """A run over three nodes where ``events[round]`` acts on the grid after that round (kill, take offline,
    restart)."""
    grid = FakeGrid(make_client_app(), [{"client-index": i} for i in range(3)])
    grid.unavailable_errors = unavailable_errors
    out = tmp_path / "run"
    run_experiment(grid, ServerSettings(experiment_text(config), str(out), FlowerOptions(round_timeout=0.5,
                                                                                         node_wait=5)),
                   lambda label, seed, rnd, rounds, last: events.get(rnd, lambda g: None)(grid))
    return participation(out / config.methods[0].display / "seed0")


def test_a_supernode_restarted_under_a_new_id_takes_its_clients_back(tmp_path):
    config = tiny_config(THREE, "federation.rounds=3", "federation.eval_every=3")
    rounds = run_with_restart(tmp_path, config, {
        1: lambda g: (g.dead.add(102), g.offline.add(102)),  # dies after round 1; Flower stops listing it
        2: lambda g: g.restart(102, new_id=103)})  # a new SuperNode (new id) for the same client
    assert [r["clients_used"] for r in rounds] == [3, 2, 3]
    assert rounds[1]["dropped"] == {"rendered/synth": "no live node holds it"}


def test_a_supernode_restarted_with_other_data_for_its_client_stops_the_run(tmp_path):
    # its roster reports the client's partition record (sizes, counts per class, sha256 of each split), computed on
    # the node: another data folder or protocol gives another record, and the client would go on training on other
    # data
    import json as _json

    def other_data(node, message, reply):
        if node == 103 and m.ROSTER in reply.content.config_records:
            roster = reply.content.config_records[m.ROSTER]
            records = [_json.loads(r) for r in roster["partition"]]
            records[0]["train"]["sha256"] = "0" * 64
            roster["partition"] = [_json.dumps(r) for r in records]
        return reply

    def restart_with_other_data(grid):
        grid.restart(102, new_id=103)
        grid.tamper = other_data
    config = tiny_config(THREE, "federation.rounds=3", "federation.eval_every=3")
    with pytest.raises(RunError, match="node 103 holds client 'rendered/synth' with other data than its node had"):
        run_with_restart(tmp_path, config, {1: lambda g: (g.dead.add(102), g.offline.add(102)),
                                            2: restart_with_other_data})


def test_a_supernode_restarted_keeping_its_label_counts_to_itself_takes_its_client_back(tmp_path):
    # the same data (sizes and sha256), its record now without the counts per class (node config share-labels=false)
    def restart_with_share_labels_off(grid):
        grid.restart(102, new_id=103)
        grid.contexts[103].node_config = {**grid.contexts[103].node_config, "share-labels": False}
    config = tiny_config(THREE, "federation.rounds=3", "federation.eval_every=3")
    rounds = run_with_restart(tmp_path, config, {1: lambda g: (g.dead.add(102), g.offline.add(102)),
                                                 2: restart_with_share_labels_off})
    assert [r["clients_used"] for r in rounds] == [3, 2, 3]


def test_a_node_whose_partition_record_is_malformed_takes_no_part(tmp_path):
    def malformed(node, message, reply):
        if node == 101 and m.ROSTER in reply.content.config_records:
            roster = reply.content.config_records[m.ROSTER]
            roster["partition"] = ["{not json" for _ in roster["partition"]]
        return reply
    config = tiny_config("federation.rounds=1")
    with pytest.raises(RunError, match=r"no SuperNode holds client indexes \[1\]"):
        grid = FakeGrid(make_client_app(), [{"client-index": 0}, {"client-index": 1}], malformed)
        run_experiment(grid, ServerSettings(experiment_text(config), str(tmp_path / "run"),
                                            FlowerOptions(round_timeout=2.0, node_wait=1)))


@pytest.mark.parametrize("unavailable_errors", [False, True])
def test_a_supernode_restarted_under_its_id_is_asked_again(tmp_path, unavailable_errors):
    # it dies after round 1: its round-2 message goes unanswered (or Flower answers NODE_UNAVAILABLE); Flower then
    # lists it offline, and after round 3 it is back under the same id (node authentication) with an empty Context
    config = tiny_config(THREE, "federation.rounds=4", "federation.eval_every=4")
    rounds = run_with_restart(tmp_path, config, {
        1: lambda g: g.dead.add(102), 2: lambda g: g.offline.add(102), 3: lambda g: g.restart(102)},
        unavailable_errors)
    assert [r["clients_used"] for r in rounds] == [3, 2, 2, 3]
    assert ("node unavailable" if unavailable_errors else "no reply within") in rounds[1]["dropped"]["rendered/synth"]



def test_a_misconfigured_deployment_is_named_at_the_roster_before_anything_trains(tmp_path):
    """Two SuperNodes given the same client, or nodes that count a different federation (another fednorm
    version, other data), stop the run at the start with what to fix; nothing is trained or written."""
    config = tiny_config("federation.rounds=1")

    def start(nodes, tamper=None, out="run"):
        grid = FakeGrid(make_client_app(), nodes, tamper)
        run_experiment(grid, ServerSettings(experiment_text(config), str(tmp_path / out),
                                            FlowerOptions(round_timeout=2.0, node_wait=1)))
        return grid

    with pytest.raises(RunError, match=r"client 'rendered/print' is held by two nodes \(10[01] and 10[01]\); give "
                                       r"each SuperNode its own clients in --node-config"):
        start([{"client-index": 0}, {"client-index": "0,1"}])

    def other_total(node, message, reply):
        if node == 101 and m.ROSTER in reply.content.config_records:
            roster = reply.content.config_records[m.ROSTER]
            roster["total"] = [3 for _ in roster["total"]]
        return reply

    with pytest.raises(RunError, match=r"node 10[01] counts [23] clients in the federation, another node [23]: do the "
                                       r"nodes run the same fednorm version on the same data\?"):
        start([{"client-index": 0}, {"client-index": 1}], other_total, out="run2")
    assert not any((tmp_path / out / "fedbn" / "seed0" / store.METRICS_FILE).exists() for out in ("run", "run2"))


def test_a_node_refuses_global_entries_that_would_overwrite_its_local_state(tmp_path):
    """FedBN's BN entries stay on the client: a server that sends one (another experiment or fednorm version) is
    refused by the node, which keeps its own, and the client is left out of that round with the node's reason."""
    config = tiny_config(THREE, "federation.rounds=2", "federation.eval_every=2")
    local_key = sorted(k for k in batchnorm_keys(build_model(config.model.name, num_classes=10))
                       if k.endswith("running_mean"))[0]

    class WrongServer(FakeGrid):
        def push_messages(self, messages):
            for msg in messages:
                if msg.metadata.dst_node_id == 102 and msg.metadata.group_id == "train-0":
                    shared = m.from_arrays(msg.content, m.GLOBAL)
                    shared[local_key] = torch.zeros(4)
                    msg.content[m.GLOBAL] = m.to_arrays(shared)
            return super().push_messages(messages)

    grid = WrongServer(make_client_app(), [{"client-index": i} for i in range(3)])
    out = tmp_path / "run"
    run_experiment(grid, ServerSettings(experiment_text(config), str(out), FlowerOptions(round_timeout=2.0,
                                                                                         node_wait=5)))
    rounds = participation(out / "fedbn" / "seed0")
    assert [r["clients_used"] for r in rounds] == [2, 3]
    assert (f"the server sent the wrong global entries: unexpected ['{local_key}'], missing []"
            in rounds[0]["dropped"]["rendered/synth"])


def test_a_node_gets_one_message_per_wave_and_none_after_it_went_silent():
    """exchange: a node holding two clients runs them one after the other (one Context.state), and a node that
    left a wave unanswered is not sent its next client's message (it would cost another round timeout)."""
    from flwr.app import RecordDict

    from fednorm.engines.flower.server import exchange

    class Grid:
        def __init__(self):
            self.waves, self.replies = [], {}

        def push_messages(self, messages):
            self.waves.append(sorted(msg.metadata.dst_node_id for msg in messages))
            for msg in messages:
                msg.metadata.__dict__["_message_id"] = msg.object_id
                if msg.metadata.dst_node_id != 2:  # node 2 never answers
                    self.replies[msg.metadata.message_id] = Message(RecordDict(), reply_to=msg)
            return [msg.metadata.message_id for msg in messages]

        def pull_messages(self, ids):
            return [self.replies.pop(i) for i in ids if i in self.replies]

    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1  # as a ServerApp's run sets them
    grid = Grid()
    items = [("a", 1, RecordDict()), ("c", 2, RecordDict()), ("b", 1, RecordDict()), ("d", 2, RecordDict())]
    out, unanswered = exchange(grid, items, "train", FlowerOptions(round_timeout=0.05, poll_interval=0.01))
    assert grid.waves == [[1, 2], [1]]
    assert set(out) == {"a", "b"}
    assert set(unanswered) == {"c", "d"} and unanswered["c"] and unanswered["d"] == ""  # d was never sent


def test_fbn_statistics_of_a_round_with_a_reply_left_out_count_every_participant(tmp_path):
    """FBN clients unbias their batch with the n of the round (3 here). With one reply left out, the server
    aggregates the other 2 as replies of a 3-client round (the exact path of
    tests/methods/test_server.py::test_fbn_with_a_reply_left_out_is_centralized_bn_on_the_batches_that_arrived),
    not as a 2-client round, whose (RV) would keep the clients' 3-client factor."""
    config = tiny_config("data.domains=[rendered/print]", "data.partition=gamma", "data.num_clients=3",
                         "methods=[fbn]", "training.steps=1", "federation.weighting=uniform",
                         "federation.rounds=1", "federation.eval_every=1")
    kept: dict = {}

    def tamper(node_id, msg, reply):
        if msg.metadata.group_id == "train-0":
            if node_id == 101:
                return edit_state(lambda s: s[first_conv(s)].view(-1).__setitem__(0, float("nan")))(reply)
            kept[node_id] = m.decode_reply(reply.content, reply.content[m.CELL]["client"], 0.5)[0]
        return reply

    grid, cell = run_fake(tmp_path, config, tamper, nodes=[{"client-index": i} for i in range(3)])
    assert [r["clients_used"] for r in participation(cell)] == [2]
    final = torch.load(cell / "checkpoint.pt", weights_only=False)["global_state"]
    replies = list(kept.values())
    shared = {k: v for k, v in replies[0].state.items()}  # keys and dtypes of the shared state
    start = {k: (torch.zeros_like(v) if k.endswith("running_mean") else torch.ones_like(v)
                 if k.endswith("running_var") else v) for k, v in shared.items()}  # FBN's (0, 1) start
    fbn = {prefix: 0.1 for prefix in replies[0].bn_counts}  # FederatedBatchNorm's default momentum

    def aggregated(participants):
        server = ServerUpdate(ServerSpec(), start, param_keys=set(), fbn_layers=fbn)
        server.begin(start, participants=participants)
        for reply in replies:
            server.add(reply)
        return server.finish()

    as_round_of_three, as_round_of_two = aggregated(3), aggregated(None)
    for prefix in fbn:
        key = f"{prefix}.running_var"
        assert torch.equal(final[key], as_round_of_three[key]), prefix
    assert any(not torch.equal(final[f"{p}.running_var"], as_round_of_two[f"{p}.running_var"]) for p in fbn)
