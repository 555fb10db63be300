"""A stopped Flower run resumes from its last checkpoint with the in-process engine's numbers, also for a
method whose clients keep state (FedBN's BN layers, SCAFFOLD's control variates), when the nodes keep that
state on disk (node config ``state-dir``); without it, the resume of such a method is refused clearly."""

import shutil

import pytest
import torch
from flwr.app import RecordDict

from fednorm.engines.client_step import ClientMemory
from fednorm.engines.flower import messages as m
from fednorm.engines.flower.app import make_client_app
from fednorm.engines.flower.node import experiment_text
from fednorm.engines.flower.node_state import ContextStateStore, NodeStateStore
from fednorm.engines.flower.server import PARTICIPATION_FILE, FlowerOptions, ServerSettings, run_experiment
from fednorm.runs import store
from fednorm.runs.runner import RunError, start_run

from .conftest import tiny_config
from .fakegrid import FakeGrid


class Stop(Exception):
    pass


def stop_at(round_to_stop):
    def progress(label, seed, rnd, rounds, last):
        if rnd == round_to_stop:
            raise Stop()
    return progress


def memory(value: float) -> ClientMemory:
    return ClientMemory({"bn.weight": torch.full((2,), value)}, None, {})


@pytest.fixture(params=["state-dir", "run context"])
def snapshot_store(request, tmp_path):
    """A node's client-state store: on disk (state-dir) or in its Context.state; both keep snapshots alike."""
    return NodeStateStore(tmp_path) if request.param == "state-dir" else ContextStateStore(RecordDict())


def test_node_state_store_reads_the_newest_snapshot_at_or_before_a_round(snapshot_store):
    nodes = snapshot_store
    assert nodes.load("m/seed0/c", 5).local_state == {}  # never trained: empty memory
    for r in (1, 2, 3):
        nodes.save("m/seed0/c", r, memory(r), checkpoint_every=2)
    assert nodes.load("m/seed0/c", 2).local_state["bn.weight"].tolist() == [2.0, 2.0]
    assert nodes.load("m/seed0/c", 10).local_state["bn.weight"].tolist() == [3.0, 3.0]
    # after round 3 the server's last checkpoint is at least round 2: older snapshots are not needed
    assert nodes.rounds("m/seed0/c") == [2, 3]
    nodes.save("m/seed0/c", 3, memory(33), checkpoint_every=2)  # the run resumed from round 2 redoes round 3
    assert nodes.rounds("m/seed0/c") == [2, 3]
    assert nodes.load("m/seed0/c", 4).local_state["bn.weight"].tolist() == [33.0, 33.0]
    nodes.save("m/seed0/c", 4, memory(4), checkpoint_every=2)
    nodes.save("m/seed0/c", 6, memory(6), checkpoint_every=2)  # not sampled in round 5
    assert nodes.rounds("m/seed0/c") == [4, 6]
    nodes.save("m/seed0/c", 5, memory(5), checkpoint_every=2)  # resumed from round 4, sampled in round 5 this time:
    assert nodes.rounds("m/seed0/c") == [4, 5]                 # its old round 6 belongs to a future that is redone


def test_node_state_store_writing_a_snapshot_drops_the_ones_after_the_snapshot_it_started_from(snapshot_store):
    nodes = snapshot_store
    for r in (2, 3, 4):  # round 3 and 4: of a run stopped after round 4, resumed from its round-2 checkpoint
        nodes.save("m/seed0/c", r, memory(r), checkpoint_every=2)
    # the resumed run left the client out of round 3; it trains in round 5 from the round-2 snapshot the server names
    assert nodes.read("m/seed0/c", 2).local_state["bn.weight"].tolist() == [2.0, 2.0]
    nodes.save("m/seed0/c", 5, memory(5), checkpoint_every=2, started_from=2)
    assert nodes.rounds("m/seed0/c") == [2, 5]  # round 3 and 4 were of the abandoned run: gone
    nodes.save("m/seed0/c", 6, memory(6), checkpoint_every=2, started_from=-1)  # the server: no state saved
    assert nodes.rounds("m/seed0/c") == [6]
    nodes.save("m/seed0/c", 7, memory(7), checkpoint_every=2)  # an older server names none: only newer ones go
    assert nodes.rounds("m/seed0/c") == [6, 7]


def test_a_node_asked_by_a_server_of_the_fednorm_before_reads_its_newest_snapshot_and_keeps_that_servers_check(
        tmp_path):
    # that server named no snapshot: "state_round" S meant "the newest snapshot, at least of round S"
    from flwr.app import Context, RecordDict

    from fednorm.engines.flower.node import ClientStateMissing, NodeClients, NodeSpec

    nodes = NodeStateStore(tmp_path)
    cell = m.CellRequest("name: x", "fedbn", 0, "c", run_id="r", state_round=m.UNKNOWN_CLIENT_STATE, state_at_least=2)
    prefix = m.memory_prefix(cell, "c")
    for r in (1, 2, 3):
        nodes.save(prefix, r, memory(r), checkpoint_every=10)
    spec, context = NodeSpec(state_dir=str(tmp_path)), Context(1, 1, {}, RecordDict(), {})
    memory_read, read = NodeClients._load_memory(context, spec, cell, "c", at_round=2)
    assert read == 2 and memory_read.local_state["bn.weight"].tolist() == [2.0, 2.0]
    with pytest.raises(ClientStateMissing, match="after round 2, but its newest in state-dir .* is of round 1"):
        NodeClients._load_memory(context, spec, cell, "c", at_round=1)
    with pytest.raises(ClientStateMissing, match="this node has no state-dir"):
        NodeClients._load_memory(context, NodeSpec(), cell, "c", at_round=2)


def run_flower(config, out, state_dir, progress=None, resume=False, grid=None):
    grid = grid or FakeGrid(make_client_app(state_dir=state_dir), [{"client-index": 0}, {"client-index": 1}])
    run_experiment(grid, ServerSettings(experiment_text(config), str(out), FlowerOptions(node_wait=5), resume=resume),
                   progress)


@pytest.mark.parametrize("method", ["fedbn", "scaffold"])
def test_a_stopped_flower_run_with_client_state_resumes_to_the_in_process_numbers(tmp_path, method):
    config = tiny_config(f"methods=[{method}]", "federation.rounds=4", "federation.eval_every=1",
                         "federation.checkpoint_every=2")
    start_run(config, tmp_path / "in_process")
    state = str(tmp_path / "node_state")
    with pytest.raises(Stop):  # stopped after round 3: the checkpoint holds round 2, the nodes have round 3
        run_flower(config, tmp_path / "flower", state, stop_at(3))
    checkpoint = store.load_checkpoint(tmp_path / "flower" / method / "seed0" / store.CHECKPOINT_FILE)
    assert checkpoint["round"] == 2
    snapshots = sorted(tmp_path.joinpath("node_state").rglob("round*.pt"))
    assert snapshots and {p.name for p in snapshots} <= {"round2.pt", "round3.pt"}
    assert "round3.pt" in {p.name for p in snapshots}
    reported = []
    run_flower(config, tmp_path / "flower", state, resume=True,  # new contexts: a new `flwr run`
               progress=lambda label, seed, rnd, rounds, last: reported.append(rnd))
    assert reported == [2, 3, 4]  # from the round-2 checkpoint: round 3 redone (its snapshot replaced), then 4
    cell = f"{method}/seed0/{store.METRICS_FILE}"
    assert store.read_metrics(tmp_path / "flower" / cell) == store.read_metrics(tmp_path / "in_process" / cell)
    rounds = [r["round"] for r in store.read_metrics(tmp_path / "flower" / method / "seed0" / PARTICIPATION_FILE)
              if r["kind"] == "train"]
    assert rounds == [1, 2, 3, 4]


def as_of_an_earlier_fednorm(checkpoint_path):
    """Rewrite a Flower checkpoint as fednorm wrote it before it recorded which snapshot each client saved."""
    older = store.load_checkpoint(checkpoint_path)
    for key in ("clients_with_state", "clients_with_volatile_state", "client_state_unrecorded_at"):
        del older[key]
    store.save_checkpoint(checkpoint_path, older)


def test_a_checkpoint_of_an_earlier_fednorm_resumes_with_the_nodes_newest_snapshots(tmp_path):
    # written before the server recorded which snapshot each client saved: it cannot name them, and the nodes take
    # their newest at or before the checkpoint's round, not "no state"
    config = tiny_config("methods=[fedbn]", "federation.rounds=4", "federation.eval_every=1",
                         "federation.checkpoint_every=2")
    start_run(config, tmp_path / "in_process")
    with pytest.raises(Stop):
        run_flower(config, tmp_path / "flower", str(tmp_path / "node_state"), stop_at(3))
    path = tmp_path / "flower" / "fedbn" / "seed0" / store.CHECKPOINT_FILE
    as_of_an_earlier_fednorm(path)
    run_flower(config, tmp_path / "flower", str(tmp_path / "node_state"), resume=True)
    cell = f"fedbn/seed0/{store.METRICS_FILE}"
    assert store.read_metrics(tmp_path / "flower" / cell) == store.read_metrics(tmp_path / "in_process" / cell)
    assert store.load_checkpoint(path)["client_state_unrecorded_at"] == 2  # kept for the next resume


def test_two_runs_on_one_state_dir_keep_their_client_state_apart(tmp_path):
    # the same method label and seed: a first run trains every client every round; in the second, half the
    # clients a round, a client first sampled in a later round must start from the global model, not from the
    # first run's snapshot of that round
    state = str(tmp_path / "node_state")
    first = tiny_config("methods=[fedbn]", "federation.rounds=4", "federation.checkpoint_every=10")
    run_flower(first, tmp_path / "first", state)  # checkpoints far apart: the nodes keep every round's snapshot
    config = tiny_config("methods=[fedbn]", "federation.rounds=4", "federation.eval_every=1",
                         "federation.fraction=0.5")
    start_run(config, tmp_path / "in_process")
    run_flower(config, tmp_path / "second", state)
    cell = f"fedbn/seed0/{store.METRICS_FILE}"
    assert store.read_metrics(tmp_path / "second" / cell) == store.read_metrics(tmp_path / "in_process" / cell)


@pytest.mark.parametrize("method", ["fedbn", "scaffold"])
def test_a_resume_on_nodes_that_lack_the_clients_state_stops_and_loses_nothing(tmp_path, method):
    # resumed with another runtime or state-dir, the nodes find none of the state their clients saved (FedBN's BN
    # layers, SCAFFOLD's c_i); from an older backup of the state-dir, only stale state: they must not go on with it
    config = tiny_config(f"methods=[{method}]", "federation.rounds=4", "federation.eval_every=1",
                         "federation.checkpoint_every=2")
    start_run(config, tmp_path / "in_process")
    state, backup = tmp_path / "node_state", tmp_path / "backup_after_round_1"

    def back_up_then_stop(label, seed, rnd, rounds, last):
        if rnd == 1:
            shutil.copytree(state, backup)
        if rnd == 3:
            raise Stop()
    with pytest.raises(Stop):
        run_flower(config, tmp_path / "flower", str(state), back_up_then_stop)
    checkpoint = store.load_checkpoint(tmp_path / "flower" / method / "seed0" / store.CHECKPOINT_FILE)
    assert checkpoint["round"] == 2 and checkpoint["clients_with_state"] == {"rendered/print": 2, "rendered/neon": 2}
    with pytest.raises(RunError, match="lacks the state that client saved on it.*ClientStateMissing.*after round 2, "
                                       "but it has none in state-dir"):
        run_flower(config, tmp_path / "flower", str(tmp_path / "other_runtime_state"), resume=True)
    with pytest.raises(RunError, match=r"ClientStateMissing.*after round 2, but state-dir .* holds no snapshot of that "
                                       r"round \(its snapshots of the client: rounds \[1\]\)"):
        run_flower(config, tmp_path / "flower", str(backup), resume=True)
    assert store.load_checkpoint(tmp_path / "flower" / method / "seed0" / store.CHECKPOINT_FILE)["round"] == 2
    run_flower(config, tmp_path / "flower", str(state), resume=True)  # the nodes that ran it go on, as if never stopped
    cell = f"{method}/seed0/{store.METRICS_FILE}"
    assert store.read_metrics(tmp_path / "flower" / cell) == store.read_metrics(tmp_path / "in_process" / cell)


@pytest.mark.parametrize("earlier_fednorms_checkpoint", [False, True])
def test_a_client_left_out_of_a_redone_round_does_not_go_on_from_the_abandoned_runs_snapshot(
        tmp_path, earlier_fednorms_checkpoint):
    # stopped after round 3 (checkpoint of round 2): the nodes hold each client's snapshot of round 3. The resumed
    # run loses the node of rendered/neon for round 3 and gets it back for round 4: the client must go on from its
    # round-2 state, not from the round-3 snapshot of the run that was stopped
    config = tiny_config("methods=[fedbn]", "federation.rounds=5", "federation.eval_every=1",
                         "federation.checkpoint_every=2")
    state = tmp_path / "node_state"
    with pytest.raises(Stop):
        run_flower(config, tmp_path / "flower", str(state), stop_at(3))
    if earlier_fednorms_checkpoint:  # the server cannot name the snapshots: the newest at or before round 2
        as_of_an_earlier_fednorm(tmp_path / "flower" / "fedbn" / "seed0" / store.CHECKPOINT_FILE)
    shutil.copytree(tmp_path / "flower", tmp_path / "flower_fresh_nodes")
    fresh_nodes = tmp_path / "node_state_without_the_abandoned_rounds"
    shutil.copytree(state, fresh_nodes, ignore=shutil.ignore_patterns("round3.pt"))
    assert len(list(state.rglob("round3.pt"))) == 2 and not list(fresh_nodes.rglob("round3.pt"))

    def resume(out, state_dir):
        grid = FakeGrid(make_client_app(state_dir=str(state_dir)), [{"client-index": 0}, {"client-index": 1}])

        def lose_neon_in_round_3(label, seed, rnd, rounds, last):
            if rnd == 2:
                grid.offline.add(101)
            if rnd == 3:
                grid.offline.discard(101)
        run_flower(config, out, None, lose_neon_in_round_3, resume=True, grid=grid)
        cell = out / "fedbn" / "seed0"
        used = [r["used"] for r in store.read_metrics(cell / PARTICIPATION_FILE) if r["kind"] == "train"]
        return store.read_metrics(cell / store.METRICS_FILE), used
    metrics, used = resume(tmp_path / "flower", state)
    assert used[2:] == [["rendered/print"], ["rendered/print", "rendered/neon"], ["rendered/print", "rendered/neon"]]
    assert (metrics, used) == resume(tmp_path / "flower_fresh_nodes", fresh_nodes)


@pytest.mark.parametrize("on_disk", [True, False], ids=["state-dir", "run context"])
def test_a_scaffold_client_whose_reply_was_left_out_goes_on_from_its_state_before_it(tmp_path, on_disk):
    # SCAFFOLD's server control variate c moves by the used replies only (c += |S|/N mean dc_i): it stays the mean
    # of the clients' c_i only if a client whose reply was left out also keeps its c_i of before, whether its node
    # keeps its snapshots on disk or in its run context
    from flwr.app import MessageType

    def corrupt_neon_in_round_2(node, message, reply):
        if node == 101 and message.metadata.message_type == MessageType.TRAIN and message.metadata.group_id == "train-1":
            state = m.from_arrays(reply.content, m.STATE)
            next(v for v in state.values() if v.is_floating_point()).view(-1)[0] = float("nan")
            reply.content[m.STATE] = m.to_arrays(state)
        return reply
    config = tiny_config("methods=[scaffold]", "federation.rounds=3", "federation.checkpoint_every=1")
    state = tmp_path / "node_state"
    grid = FakeGrid(make_client_app(state_dir=str(state) if on_disk else None),
                    [{"client-index": 0}, {"client-index": 1}], tamper=corrupt_neon_in_round_2)
    run_flower(config, tmp_path / "flower", None, grid=grid)
    cell = tmp_path / "flower" / "scaffold" / "seed0"
    used = [r["used"] for r in store.read_metrics(cell / PARTICIPATION_FILE) if r["kind"] == "train"]
    assert used == [["rendered/print", "rendered/neon"], ["rendered/print"], ["rendered/print", "rendered/neon"]]
    checkpoint = store.load_checkpoint(cell / store.CHECKPOINT_FILE)
    assert checkpoint["clients_with_state"] == {"rendered/print": 3, "rendered/neon": 3}
    c_global = checkpoint["algorithm_server_state"]
    if on_disk:
        c_clients = [NodeStateStore(state).read(str(p.parent.relative_to(state)), 3).algorithm_state
                     for p in sorted(state.rglob("round3.pt"))]
    else:
        assert not state.exists()
        c_clients = [ContextStateStore(context.state).read(key.removesuffix("/round3/local"), 3).algorithm_state
                     for context in grid.contexts.values() for key in context.state.keys()
                     if key.endswith("/round3/local")]
    assert len(c_clients) == 2 and c_global
    for k, c in c_global.items():
        mean_c_i = torch.stack([ci["c_i." + k.removeprefix("c.")] for ci in c_clients]).mean(dim=0)
        torch.testing.assert_close(c, mean_c_i, rtol=0, atol=1e-6)


def test_a_node_without_a_state_dir_reads_the_snapshot_the_server_names_from_its_run_context(caplog):
    from flwr.app import Context

    from fednorm.engines.flower.node import ClientStateMissing, NodeClients, NodeSpec

    spec, context = NodeSpec(), Context(1, 1, {}, RecordDict(), {})

    def cell(state_round, in_context=True):
        return m.CellRequest("name: x", "fedbn", 0, "c", run_id="r", state_round=state_round,
                             state_in_context=in_context)
    prefix = m.memory_prefix(cell(0), "c")
    contexts = ContextStateStore(context.state)
    contexts.save(prefix, 1, memory(1))
    contexts.save(prefix, 2, memory(2), started_from=1)  # round 2's reply: not yet known to be used
    got, read = NodeClients._load_memory(context, spec, cell(1), "c", at_round=2)
    assert read == 1 and got.local_state["bn.weight"].tolist() == [1.0, 1.0]  # the server used round 1's, not 2's
    got, read = NodeClients._load_memory(context, spec, cell(m.NO_CLIENT_STATE), "c", at_round=2)
    assert read == -1 and got == ClientMemory()
    # a server of the fednorm before names nothing for a node without a state-dir: the newest, as that node read it
    got, read = NodeClients._load_memory(context, spec, cell(m.NO_CLIENT_STATE, in_context=False), "c", at_round=2)
    assert read is None and got.local_state["bn.weight"].tolist() == [2.0, 2.0]
    with pytest.raises(ClientStateMissing, match="this node has no state-dir"):  # a snapshot on disk, named so
        NodeClients._load_memory(context, spec, cell(2, in_context=False), "c", at_round=2)
    # restarted (its run context lost the snapshot; it may hold one of training since that was not used): the
    # client starts from the global model, as docs/flower.md promises
    restarted = Context(1, 1, {}, RecordDict(), {})
    for held in ([], [3]):
        for r in held:
            ContextStateStore(restarted.state).save(prefix, r, memory(r), started_from=-1)
        got, read = NodeClients._load_memory(restarted, spec, cell(2), "c", at_round=3)
        assert read == -1 and got == ClientMemory()
    # the server names the lost snapshot until a reply of the client is used: the node warns once for it
    lost = [r for r in caplog.records if "does not hold the state client 'c'" in r.getMessage()]
    assert len(lost) == 1 and "after round 2" in lost[0].getMessage()
    assert ContextStateStore(restarted.state).rounds(prefix) == [3]  # the warning's mark is no snapshot
    NodeClients._load_memory(restarted, spec, cell(4), "c", at_round=5)  # lost again (another restart)
    assert sum("does not hold the state client 'c'" in r.getMessage() for r in caplog.records) == 2


@pytest.mark.parametrize("earlier_node", [False, True])
def test_the_server_names_run_context_snapshots_only_to_nodes_that_keep_them(tmp_path, earlier_node):
    # a node of the fednorm before, without a state-dir, keeps only its newest state, and its roster has no
    # context_snapshots column: the server sends it -1 (read your newest), as that fednorm's server did
    from flwr.app import MessageType

    def as_earlier_node(node, message, reply):
        if earlier_node and m.ROSTER in reply.content.config_records:
            del reply.content.config_records[m.ROSTER]["context_snapshots"]
        return reply
    config = tiny_config("federation.rounds=3", "federation.eval_every=1")
    grid = FakeGrid(make_client_app(), [{"client-index": 0}, {"client-index": 1}], tamper=as_earlier_node)
    run_flower(config, tmp_path / "flower", None, grid=grid)
    named = [m.CellRequest.decode(msg.content).state_round for msg in grid.sent
             if msg.metadata.message_type == MessageType.TRAIN]
    assert named == ([m.NO_CLIENT_STATE] * 6 if earlier_node else [m.NO_CLIENT_STATE] * 2 + [1, 1, 2, 2])


@pytest.mark.parametrize("state_dir", [False, True])
def test_a_node_drops_the_run_context_state_of_finished_cells(tmp_path, state_dir, caplog):
    # a run context lives as long as the Flower run: without the drop, every cell's snapshots would stay in each
    # node's memory until the last cell ends. A state-dir's files stay (the user's, docs/flower.md 3.9)
    from flwr.app import MessageType

    config = tiny_config("methods=[fedbn, scaffold]", "seeds=[0, 1]", "federation.rounds=2")
    folder = str(tmp_path / "node_state") if state_dir else None
    grid = FakeGrid(make_client_app(state_dir=folder), [{"client-index": 0}, {"client-index": 1}])
    seen: list[set[str]] = []  # each node's run-context cells after each train message
    app = grid.client_app

    def recording(message, context):
        reply = app(message, context)
        if message.metadata.message_type == MessageType.TRAIN:
            seen.append({"/".join(k.split("/")[2:4]) for k in context.state.keys() if k.startswith("fednorm/")})
        return reply
    grid.client_app = recording
    run_flower(config, tmp_path / "flower", folder, grid=grid)
    cells = ["fedbn/seed0", "fedbn/seed1", "scaffold/seed0", "scaffold/seed1"]
    finished = [m.CellRequest.decode(msg.content).finished_cells for msg in grid.sent
                if msg.metadata.message_type == MessageType.TRAIN]
    assert finished[0] == () and finished[-1] == (("fedbn", 0), ("fedbn", 1), ("scaffold", 0))
    kept = [{"/".join(k.split("/")[2:4]) for k in c.state.keys() if k.startswith("fednorm/")}
            for c in grid.contexts.values()]
    if state_dir:  # nothing in the run contexts; every cell's files on disk
        assert all(not s for s in seen + kept)
        on_disk = {"/".join(p.relative_to(tmp_path / "node_state").parts[2:4])
                   for p in (tmp_path / "node_state").rglob("round*.pt")}
        assert on_disk == set(cells)
    else:  # while a cell trains, its nodes hold its snapshots and those of no cell before it
        assert seen == [{cell} for cell in cells for _ in range(4)]  # 2 rounds x 2 nodes
        assert kept == [{"scaffold/seed1"}] * 2
    # and the cell being trained kept its own: every round after the first read the snapshot the server named
    assert not [r for r in caplog.records if "does not hold the state client" in r.getMessage()]


def run_moving_neon(tmp_path, first_config: dict, then_config: dict, tamper=None):
    """A FedBN run of 3 rounds over two nodes whose node of rendered/neon (101) dies after round 1 and, after
    round 2, comes back as node 103 with ``then_config`` (a restart with another node config); (the grid, the
    cell folder). ``tamper`` acts on node 103's replies."""
    from flwr.app import Context

    def restart(g):
        g.restart(101, new_id=103)
        g.contexts[103] = Context(run_id=1, node_id=103, node_config={"client-index": 1, **then_config},
                                  state=RecordDict(), run_config={})
        g.tamper = tamper
    events = {1: lambda g: (g.dead.add(101), g.offline.add(101)), 2: restart}
    grid = FakeGrid(make_client_app(), [{"client-index": 0, **first_config}, {"client-index": 1, **first_config}])
    config = tiny_config("federation.rounds=3", "federation.eval_every=3")
    run_experiment(grid, ServerSettings(experiment_text(config), str(tmp_path / "flower"),
                                        FlowerOptions(round_timeout=0.5, node_wait=5)),
                   lambda label, seed, rnd, rounds, last: events.get(rnd, lambda g: None)(grid))
    return grid, tmp_path / "flower" / "fedbn" / "seed0"


def named_in_train(grid, node: int, rnd: int) -> int:
    from flwr.app import MessageType

    return next(m.CellRequest.decode(msg.content).state_round for msg in grid.sent
                if msg.metadata.message_type == MessageType.TRAIN and msg.metadata.dst_node_id == node
                and msg.metadata.group_id == f"train-{rnd - 1}")


def test_a_client_whose_state_is_on_disk_stops_the_run_on_a_node_restarted_without_its_state_dir(tmp_path):
    state = str(tmp_path / "node_state")
    with pytest.raises(RunError, match="client 'rendered/neon' lacks the state .* this node has no state-dir"):
        run_moving_neon(tmp_path, {"state-dir": state}, {})


@pytest.mark.parametrize("then", ["a state-dir", "an earlier fednorm"])
def test_a_client_whose_state_was_in_a_lost_run_context_starts_afresh_on_its_new_node(tmp_path, then):
    # its state died with its node's run context; on the new node (with a state-dir, or of an earlier fednorm
    # without one, which keeps only its newest state) it starts from the global model, as on any restarted node
    def as_earlier_node(node, message, reply):
        if m.ROSTER in reply.content.config_records:
            del reply.content.config_records[m.ROSTER]["context_snapshots"]
        return reply
    state = tmp_path / "node_state"
    with_state_dir = then == "a state-dir"
    grid, cell = run_moving_neon(tmp_path, {}, {"state-dir": str(state)} if with_state_dir else {},
                                 None if with_state_dir else as_earlier_node)
    used = [r["used"] for r in store.read_metrics(cell / PARTICIPATION_FILE) if r["kind"] == "train"]
    assert used == [["rendered/print", "rendered/neon"], ["rendered/print"], ["rendered/print", "rendered/neon"]]
    assert named_in_train(grid, 101, 1) == m.NO_CLIENT_STATE and named_in_train(grid, 100, 3) == 2
    assert named_in_train(grid, 103, 3) == m.NO_CLIENT_STATE  # not round 1: that snapshot died with node 101
    checkpoint = store.load_checkpoint(cell / store.CHECKPOINT_FILE)
    if with_state_dir:  # from then on its state is on disk: named so, and no longer lost with a run context
        assert checkpoint["clients_with_state"] == {"rendered/print": 3, "rendered/neon": 3}
        assert checkpoint["clients_with_state_in_context"] == ["rendered/print"]
        assert checkpoint["clients_with_volatile_state"] == ["rendered/print"]
        assert len(list(state.rglob("round3.pt"))) == 1
    else:  # the earlier node keeps its newest whatever the server names: none named
        assert checkpoint["clients_with_state"] == {"rendered/print": 3}
        assert checkpoint["clients_with_volatile_state"] == ["rendered/neon", "rendered/print"]


def test_a_run_whose_nodes_had_no_state_dir_is_not_resumed_on_nodes_with_one(tmp_path):
    # the refusal below says to start the nodes with a state-dir; that makes later runs resumable, not this one:
    # what its clients trained before died with the stopped run
    config = tiny_config("federation.rounds=4", "federation.checkpoint_every=2")
    with pytest.raises(Stop):
        run_flower(config, tmp_path / "flower", None, stop_at(3))
    with pytest.raises(RunError, match=r"\['rendered/neon', 'rendered/print'\] trained on nodes without a state-dir"):
        run_flower(config, tmp_path / "flower", str(tmp_path / "node_state"), resume=True)
    assert not (tmp_path / "node_state").exists()


def test_a_cell_stopped_after_its_last_round_finishes_on_a_resume_whatever_its_nodes_kept(tmp_path):
    # a stop while the plots or the summary were written: its checkpoint is of the last round, and the resume
    # only writes them; nothing is asked of the nodes, so their lost state does not matter
    config = tiny_config("federation.rounds=2", "federation.eval_every=1")
    run_flower(config, tmp_path / "flower", None)
    cell = tmp_path / "flower" / "fedbn" / "seed0"
    summary = (cell / store.SUMMARY_FILE).read_text()
    (cell / store.SUMMARY_FILE).unlink()
    run_flower(config, tmp_path / "flower", None, resume=True)
    assert (cell / store.SUMMARY_FILE).read_text() == summary


def test_a_recorded_divergence_does_not_count_the_diverged_round_as_saved_client_state(tmp_path):
    # round 1: one client's reply is a divergence (both nodes trained and saved their state of round 1); the round
    # is not counted, so `record` evaluates the cell with the state as of round 0, of which that node rightly has no snapshot
    from flwr.app import Error, Message, MessageType

    def diverge_neon_in_round_1(node, message, reply):
        if node == 101 and message.metadata.message_type == MessageType.TRAIN and message.metadata.group_id == "train-0":
            return Message(Error(code=2, reason="DivergenceError: non-finite loss nan"), reply_to=message)
        return reply
    config = tiny_config("federation.rounds=3", "federation.on_divergence=record")
    grid = FakeGrid(make_client_app(state_dir=str(tmp_path / "node_state")),
                    [{"client-index": 0}, {"client-index": 1}], tamper=diverge_neon_in_round_1)
    run_experiment(grid, ServerSettings(experiment_text(config), str(tmp_path / "flower"), FlowerOptions(node_wait=5)))
    assert len(list((tmp_path / "node_state").rglob("round1.pt"))) == 2  # both nodes saved a snapshot of round 1
    records = store.read_metrics(tmp_path / "flower" / "fedbn" / "seed0" / store.METRICS_FILE)
    assert {r["round"] for r in records if r.get("diverged")} == {1}  # the cell ends marked diverged in round 1


def test_resume_without_node_state_is_refused_for_a_method_with_client_state(tmp_path):
    config = tiny_config("federation.rounds=4", "federation.checkpoint_every=2")
    with pytest.raises(Stop):
        run_flower(config, tmp_path / "flower", None, stop_at(3))
    with pytest.raises(RunError, match="state-dir"):
        run_flower(config, tmp_path / "flower", None, resume=True)
    with pytest.raises(RunError, match="--resume"):
        run_flower(config, tmp_path / "flower", None)
    other = tiny_config("federation.rounds=5", "federation.checkpoint_every=2")
    with pytest.raises(RunError, match="another experiment"):
        run_flower(other, tmp_path / "flower", None, resume=True)


def test_a_flower_resume_on_nodes_holding_other_data_is_refused(tmp_path):
    # the nodes report each client's partition record (sizes, counts per class, sha256 of each split); the run's
    # partitions.json keeps the first ones, and a resume goes on only on the data the run started with (the sizes
    # and digests decide; the counts derive from the data)
    import json

    config = tiny_config("methods=[fedavg]", "federation.rounds=4", "federation.checkpoint_every=2")
    with pytest.raises(Stop):
        run_flower(config, tmp_path / "flower", None, stop_at(3))

    def other_data(node, message, reply):
        if node == 101 and m.ROSTER in reply.content.config_records:
            roster = reply.content.config_records[m.ROSTER]
            records = [json.loads(r) for r in roster["partition"]]
            records[0]["train"]["sha256"] = "0" * 64
            roster["partition"] = [json.dumps(r) for r in records]
        return reply
    grid = FakeGrid(make_client_app(), [{"client-index": 0}, {"client-index": 1}], tamper=other_data)
    with pytest.raises(RunError, match="client 'rendered/neon' no longer holds the same train data"):
        run_flower(config, tmp_path / "flower", None, resume=True, grid=grid)
    run_flower(config, tmp_path / "flower", None, resume=True)  # the nodes with the run's data go on
    assert store.load_checkpoint(tmp_path / "flower" / "fedavg" / "seed0" / store.CHECKPOINT_FILE)["round"] == 4


@pytest.mark.parametrize("placeholder_entries", [slice(None), slice(0, 1)])  # all, or one node's (a mixed roster)
def test_a_flower_run_whose_partitions_json_describes_the_servers_placeholders_resumes_and_gets_the_records(
        tmp_path, placeholder_entries):
    # before the nodes reported their partition records, a Flower run's partitions.json described the server's
    # placeholder clients (zeros); its resume must not be refused as "other data", and the file gets the records
    import json

    from fednorm.engines.flower.node import _shape
    from fednorm.engines.flower.server import roster_clients
    from fednorm.runs.runner import PARTITIONS_FILE, build_federation_data, partition_record

    config = tiny_config("methods=[fedavg]", "federation.rounds=4", "federation.checkpoint_every=2")
    with pytest.raises(Stop):
        run_flower(config, tmp_path / "flower", None, stop_at(3))
    records = json.loads((tmp_path / "flower" / PARTITIONS_FILE).read_text())
    clients = build_federation_data(config, None)
    entries = [m.RosterEntry(i, len(clients), c.name, c.domain, c.origin, False, c.num_train, len(c.test), -1,
                             _shape(c.train.x), str(c.train.x.dtype).removeprefix("torch."), _shape(c.train.y),
                             str(c.train.y.dtype).removeprefix("torch."), False) for i, c in enumerate(clients)]
    placeholders = partition_record(roster_clients(entries))
    assert placeholders != records and [p["name"] for p in placeholders] == [r["name"] for r in records]
    written = list(records)
    written[placeholder_entries] = placeholders[placeholder_entries]
    (tmp_path / "flower" / PARTITIONS_FILE).write_text(json.dumps(written))
    run_flower(config, tmp_path / "flower", None, resume=True)
    assert json.loads((tmp_path / "flower" / PARTITIONS_FILE).read_text()) == records


def test_a_flower_resume_of_a_run_whose_config_was_edited_by_hand_is_refused(tmp_path):
    """`fednorm flower ... --resume` reads config.yaml from the run folder, so an edit there reaches both sides of
    the "another experiment" check: the fingerprint run.json recorded at the start catches it."""
    import yaml

    config = tiny_config("methods=[fedavg]", "federation.rounds=4", "federation.checkpoint_every=2")
    with pytest.raises(Stop):
        run_flower(config, tmp_path / "flower", None, stop_at(3))
    edited = config.model_copy(update={"training": config.training.model_copy(update={"lr": 0.5})})
    (tmp_path / "flower" / "config.yaml").write_text(yaml.safe_dump(edited.model_dump(mode="json")))
    # the way on it names is Flower's, not the in-process `fednorm run` / `fednorm resume --rounds`
    with pytest.raises(RunError, match=rf"config.yaml was edited since the run wrote it: training.lr \(was {config.training.lr}, now 0.5\) differ.*"
                                       r"`fednorm flower sim .*flower/config.yaml --out NEW_DIR`") as err:
        run_flower(edited, tmp_path / "flower", None, resume=True)
    assert "--rounds" not in str(err.value) and "fednorm run " not in str(err.value)


def test_each_engine_resumes_only_its_own_runs(tmp_path):
    """A Flower run's checkpoint holds the server's state only (FedBN's client BN layers stay on the nodes):
    resumed in-process, its clients would go on from the global model's BN entries. Each engine refuses the
    other's run and names the command that resumes it; a run begun before run.json named its engine is known by
    its checkpoints."""
    import json

    from fednorm.runs.runner import resume_run

    config = tiny_config("federation.rounds=4", "federation.checkpoint_every=2")
    with pytest.raises(Stop):
        run_flower(config, tmp_path / "flower", str(tmp_path / "node_state"), stop_at(3))
    info_path = tmp_path / "flower" / "run.json"
    assert json.loads(info_path.read_text())["engine"] == "flower"
    cell = tmp_path / "flower" / "fedbn" / "seed0"
    before = (cell / store.METRICS_FILE).read_text()
    for info in ("as written", "without engine"):
        if info == "without engine":
            info_path.write_text(json.dumps({k: v for k, v in json.loads(info_path.read_text()).items()
                                             if k != "engine"}))
        with pytest.raises(RunError, match=r"is a run of the flower engine, not of the in-process one: .*"
                                           r"`fednorm flower sim --out .*flower --resume`"):
            resume_run(tmp_path / "flower")
    assert (cell / store.METRICS_FILE).read_text() == before
    assert store.load_checkpoint(cell / store.CHECKPOINT_FILE)["round"] == 2
    # what points to a resume elsewhere (here `fednorm report` of the unfinished run) names the Flower one too
    from typer.testing import CliRunner

    from fednorm.cli.main import app
    result = CliRunner().invoke(app, ["report", str(tmp_path / "flower")], terminal_width=400)
    assert result.exit_code == 2 and "fednorm flower sim --out" in result.output
    assert "fednorm resume" not in result.output
    run_flower(config, tmp_path / "flower", str(tmp_path / "node_state"), resume=True)  # its own engine goes on
    assert store.load_checkpoint(cell / store.CHECKPOINT_FILE)["round"] == 4

    with pytest.raises(Stop):
        start_run(config, tmp_path / "in_process", progress=stop_at(3))
    assert json.loads((tmp_path / "in_process" / "run.json").read_text())["engine"] == "in-process"
    with pytest.raises(RunError, match=r"is a run of the in-process engine, not of the flower one: .*"
                                       r"`fednorm resume .*in_process`"):
        run_flower(config, tmp_path / "in_process", str(tmp_path / "node_state"), resume=True)


def test_resume_commands_read_the_config_from_the_run_folder_and_refuse_a_missing_run(tmp_path):
    from typer.testing import CliRunner

    from fednorm.cli.main import app
    from fednorm.engines.flower.runtime import write_app
    from fednorm.runs.config import load_config

    missing = CliRunner().invoke(app, ["flower", "sim", "--out", str(tmp_path / "none"), "--resume"])
    # the run folder lives where the server runs: the message says so, and how to resume from elsewhere
    assert missing.exit_code == 2 and "no config.yaml" in missing.output
    assert "give the original config" in " ".join(missing.output.split())
    config = tiny_config("federation.rounds=4")
    run_flower(config, tmp_path / "run", None)  # a run folder (here a finished Flower run)
    out = CliRunner().invoke(app, ["flower", "app", str(tmp_path / "app"), "--out", str(tmp_path / "run"), "--resume"])
    assert out.exit_code == 0, out.output
    start_run(config, tmp_path / "in_process")  # another engine's run is refused before any app is written
    refused = CliRunner().invoke(app, ["flower", "app", str(tmp_path / "app3"), "--out", str(tmp_path / "in_process"),
                                       "--resume"])
    assert refused.exit_code != 0 and "a run of the in-process engine" in " ".join(refused.output.split())
    assert not (tmp_path / "app3").exists()
    text = (tmp_path / "app" / "pyproject.toml").read_text()
    assert "resume = true" in text and "rounds: 4" in text
    write_app(tmp_path / "app2", load_config("default"), tmp_path / "x")
    assert "resume = false" in (tmp_path / "app2" / "pyproject.toml").read_text()


def test_a_method_that_cannot_run_fails_on_flower_before_the_run_folder_is_written(tmp_path):
    """The preflight runs over the server's roster too (zero samples of the clients' shapes): a model that does not
    fit the images fails as a config error at the start, not after the cells before it have trained."""
    from fednorm.runs.config import ConfigError

    config = tiny_config("methods=[fedavg, fedbn]", "model.name=densenet121")  # 28 x 28 digits: pools too small
    with pytest.raises(ConfigError, match="method 'fedavg' cannot run on this config"):
        run_flower(config, tmp_path / "run", None)
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_the_flower_runtimes_refuse_an_in_process_run_before_they_start(tmp_path):
    """`flower sim / local --resume` of an in-process run folder: refused before Ray or a SuperLink starts, where
    the server's refusal would only reach a log (`flower local` would then report the old run's table)."""
    from fednorm.engines.flower import runtime

    config = tiny_config("federation.rounds=2")
    start_run(config, tmp_path / "run")
    for launch in (lambda: runtime.simulate(config, tmp_path / "run", resume=True),
                   lambda: runtime.run_local(config, tmp_path / "run", tmp_path / "work", resume=True)):
        with pytest.raises(RunError, match=r"is a run of the in-process engine, not of the flower one: .*"
                                           r"`fednorm resume .*run`"):
            launch()
    assert not (tmp_path / "work").exists() and not (tmp_path / "run" / "node_state").exists()


def test_a_failed_simulation_is_a_message_with_its_cause_and_the_way_on(tmp_path, monkeypatch):
    """Flower ends every failure with "An error was encountered. Ending simulation."; the user gets the chained
    cause (Ray's node start-up timing out on a busy machine, say), whether anything is kept, and what to try."""
    import flwr.simulation

    from fednorm.engines.flower import runtime

    def failing(*args, **kwargs):
        try:
            raise TimeoutError("node timed out during startup")
        except TimeoutError as exc:
            raise RuntimeError("An error was encountered. Ending simulation.") from exc

    monkeypatch.setattr(flwr.simulation, "run_simulation", failing)
    config = tiny_config("federation.rounds=1")
    with pytest.raises(RunError, match=r"Flower's simulation stopped \(TimeoutError: node timed out during "
                                       r"startup\); nothing was written\. .*fewer --nodes") as err:
        runtime.simulate(config, tmp_path / "run")
    assert "An error was encountered" not in str(err.value)
    (tmp_path / "run").mkdir(exist_ok=True)
    (tmp_path / "run" / "config.yaml").write_text("name: x\n")
    message = runtime.simulation_failure(err.value.__cause__, tmp_path / "run")
    assert f"what finished is kept in {tmp_path / 'run'}: `fednorm flower sim --out {tmp_path / 'run'} --resume`" in message


def test_flower_sim_keeps_the_clients_state_in_the_run_folder_and_its_resume_gives_the_in_process_numbers(
        tmp_path, monkeypatch):
    """`fednorm flower sim` wiring, with Flower's simulation replaced by the in-process grid: one virtual SuperNode
    per client, no GPU share, the clients' state under RUN/node_state; stopped after round 3 and resumed with
    --resume, FedBN's run equals the in-process one (its BN layers came back from the nodes' state)."""
    import flwr.simulation

    from fednorm.engines.flower import app as flower_app
    from fednorm.engines.flower import runtime

    seen = {}

    def server_app(settings, progress=None):
        seen.update(settings=settings, progress=progress)
        return "the ServerApp"

    def run_simulation(server, client_app, num_supernodes, backend_config):
        seen.update(nodes=num_supernodes, backend=backend_config)
        grid = FakeGrid(client_app, [{"partition-id": i, "num-partitions": num_supernodes}
                                     for i in range(num_supernodes)])
        run_experiment(grid, seen["settings"], seen["progress"])

    monkeypatch.setattr(flower_app, "make_server_app", server_app)
    monkeypatch.setattr(flwr.simulation, "run_simulation", run_simulation)
    config = tiny_config("federation.rounds=4", "federation.checkpoint_every=1", "federation.eval_every=2")
    out = tmp_path / "run"
    with pytest.raises(Stop):
        runtime.simulate(config, out, progress=stop_at(3))
    assert seen["nodes"] == 2 and seen["backend"]["client_resources"]["num_gpus"] == 0
    assert any((out / "node_state").rglob("*.pt"))
    runtime.simulate(config, out, resume=True)
    assert seen["settings"].resume
    start_run(config, tmp_path / "in_process")
    cell = "fedbn/seed0/metrics.jsonl"
    assert (out / cell).read_text() == (tmp_path / "in_process" / cell).read_text()


def test_flower_local_gives_each_supernode_its_client_and_absolute_folders_and_resumes_in_its_workdir(
        tmp_path, monkeypatch):
    """`fednorm flower local` wiring, its SuperLink and SuperNode processes replaced by the in-process grid run
    from the app folder it wrote: a node per client with absolute state and data folders (the nodes run in the
    work folder), and `--resume` with the default work folder (OUT-flower) finds the clients' state again."""
    import tomllib
    from types import SimpleNamespace

    from typer.testing import CliRunner

    from fednorm.cli.main import app
    from fednorm.engines.flower import runtime

    from ...conftest import TINY_RUN

    started = []

    class Deployment:
        def __init__(self, workdir, node_configs):
            self.node_configs = node_configs
            started.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def run_app(self, app_dir):
            run_config = tomllib.loads((app_dir / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
            grid = FakeGrid(make_client_app(), self.node_configs)
            run_experiment(grid, ServerSettings.from_run_config(run_config), stop_at(3) if len(started) == 1 else None)
            return SimpleNamespace(wait=lambda timeout=None: 0)

    monkeypatch.setattr(runtime, "LocalDeployment", Deployment)
    monkeypatch.chdir(tmp_path)
    sets = [arg for item in [*TINY_RUN, "methods=[fedbn]", "federation.checkpoint_every=1"] for arg in ("--set", item)]
    first = CliRunner().invoke(app, ["flower", "local", *sets, "--out", "run", "--data-dir", "data"])
    assert isinstance(first.exception, Stop), first.output
    state = str(tmp_path / "run-flower" / "node_state")
    assert started[0].node_configs == [{"client-index": i, "state-dir": state, "data-dir": str(tmp_path / "data")}
                                       for i in range(2)]
    resumed = CliRunner().invoke(app, ["flower", "local", "--out", "run", "--data-dir", "data", "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert started[1].node_configs == started[0].node_configs
    from fednorm.runs.config import load_config

    start_run(load_config("default", [*TINY_RUN, "methods=[fedbn]", "federation.checkpoint_every=1"]),
              tmp_path / "in_process")
    cell = "fedbn/seed0/metrics.jsonl"
    assert (tmp_path / "run" / cell).read_text() == (tmp_path / "in_process" / cell).read_text()
