"""What travels in messages and what a node keeps: conversions are exact both ways, decoding is strict."""

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fednorm.engines.client_step import ClientMemory, RoundInstructions
from fednorm.engines.flower import messages as m
from fednorm.engines.simulation import Evaluation
from fednorm.methods.aggregation import UpdateError
from fednorm.methods.local_update import LocalResult
from fednorm.methods.server import ClientReply


def test_tensors_round_trip_exactly():
    state = {"w": torch.randn(4, 3, 2, 2).contiguous(memory_format=torch.channels_last),
             "bn.num_batches_tracked": torch.tensor(7), "half": torch.randn(3).double()}
    back = m.from_arrays(RecordDict({"x": m.to_arrays(state)}), "x")
    assert list(back) == list(state)
    for k, v in state.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v)
    assert m.from_arrays(RecordDict({"x": m.to_arrays({})}), "x") == {}


def test_instructions_round_trip():
    ins = RoundInstructions(round=3, num_participants=5, lr=0.0123456789, weight=1 / 3, freeze_bn_stats=True,
                            prox=False, seed=2**62 + 12345)
    assert m.decode_instructions(RecordDict({m.INSTRUCTIONS: m.instructions_record(ins)})) == ins


@pytest.mark.parametrize("in_context", [False, True])
@pytest.mark.parametrize("state_round", [5, m.NO_CLIENT_STATE, m.UNKNOWN_CLIENT_STATE])
def test_cell_request_round_trips_and_an_older_servers_request_names_no_snapshot(state_round, in_context):
    cell = m.CellRequest("name: x", "FedBN", 2, "mnist", "mnist", ("test", "val"), ("fedbn_average",), round=7,
                         run_id="abc", state_round=state_round, state_at_most=3, state_in_context=in_context,
                         finished_cells=(("FedAvg", 0), ("FedAvg", 1)))
    assert m.CellRequest.decode(RecordDict({m.CELL: cell.record()})) == cell
    # a node of the fednorm before reads "state_round": its newest snapshot, at least of that round (< 0: no check)
    assert cell.record()["state_round"] == state_round
    older = cell.record()  # a server of the fednorm before: "state_round" only,
    del older["state_snapshot"], older["state_at_most"], older["state_in_context"]
    del older["finished_methods"], older["finished_seeds"]
    back = m.CellRequest.decode(RecordDict({m.CELL: older}))  # whose -1 meant "nothing recorded", not "none"
    assert back.state_round == m.UNKNOWN_CLIENT_STATE and back.state_at_most == -1  # the node's newest,
    assert not back.state_in_context  # (on a node without a state-dir too)
    assert back.state_at_least == max(state_round, -1)  # with that server's check
    del older["state_round"], older["run_id"], older["external_modes"]  # a server of an earlier fednorm still
    assert m.CellRequest.decode(RecordDict({m.CELL: older})) == m.CellRequest(
        "name: x", "FedBN", 2, "mnist", "mnist", ("test", "val"), round=7)


def test_reply_round_trip_and_the_server_weight_wins():
    reply = ClientReply("a", {"w": torch.ones(2, 2), "n": torch.tensor(3)}, 0.25, 7, {"bn1": 32})
    content = m.encode_reply(reply, {"c.w": torch.zeros(2, 2)}, LocalResult(12.5, 40, 7))
    back, message, result = m.decode_reply(content, "a", weight=0.5)
    assert back.weight == 0.5 and back.num_steps == 7 and back.bn_counts == {"bn1": 32}
    assert torch.equal(back.state["w"], reply.state["w"]) and back.state["n"].dtype == torch.int64
    assert torch.equal(message["c.w"], torch.zeros(2, 2))
    assert (result.loss_sum, result.num_examples, result.num_steps) == (12.5, 40, 7)


@pytest.mark.parametrize("drop, match", [(m.STATE, "no 'state' arrays"), (m.METRICS, "no 'metrics' record"),
                                         (m.CELL, "names client None")])
def test_decoding_a_reply_without_a_record_fails_clearly(drop, match):
    content = m.encode_reply(ClientReply("a", {"w": torch.ones(1)}, 1.0, 1), {}, LocalResult(1.0, 1, 1))
    del content[drop]
    with pytest.raises(UpdateError, match=match):
        m.decode_reply(content, "a", 1.0)


def test_a_reply_for_another_client_or_with_bad_counts_is_refused():
    content = m.encode_reply(ClientReply("b", {"w": torch.ones(1)}, 1.0, 1), {}, LocalResult(1.0, 1, 1))
    with pytest.raises(UpdateError, match="names client 'b'"):
        m.decode_reply(content, "a", 1.0)
    content = m.encode_reply(ClientReply("a", {"w": torch.ones(1)}, 1.0, 1), {}, LocalResult(float("nan"), 1, 1))
    with pytest.raises(UpdateError, match="non-finite training loss"):
        m.decode_reply(content, "a", 1.0)
    content[m.METRICS] = MetricRecord({"num_steps": -1, "num_examples": 1, "loss_sum": 1.0, "weight": 1.0})
    with pytest.raises(UpdateError, match="invalid step"):
        m.decode_reply(content, "a", 1.0)
    # types MetricRecord allows but a count or loss is not: a clear UpdateError, not a TypeError out of the round
    content[m.METRICS] = MetricRecord({"num_steps": 1, "num_examples": 1, "loss_sum": [1.0, 2.0], "weight": 1.0})
    with pytest.raises(UpdateError, match="loss_sum that is not a number"):
        m.decode_reply(content, "a", 1.0)


def test_client_memory_lives_in_context_state_one_snapshot_per_round():
    from fednorm.engines.flower.node_state import ContextStateStore

    state = RecordDict()
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    memory = ClientMemory({"bn.weight": torch.rand(3), "bn.num_batches_tracked": torch.tensor(2)}, opt.state_dict(),
                          {"c_i.w": torch.rand(2, 2)})
    store = ContextStateStore(state)
    store.save("p", 1, memory)
    back = store.read("p", 1)
    assert torch.equal(back.local_state["bn.weight"], memory.local_state["bn.weight"])
    assert back.local_state["bn.num_batches_tracked"].dtype == torch.int64
    assert torch.equal(back.algorithm_state["c_i.w"], memory.algorithm_state["c_i.w"])
    buf = memory.optimizer_state["state"][0]["momentum_buffer"]
    assert torch.equal(back.optimizer_state["state"][0]["momentum_buffer"], buf)
    assert store.load("other", 5) == ClientMemory() and store.rounds("other") == []
    store.save("p", 2, ClientMemory({"bn.weight": torch.zeros(3)}, None, {}))  # no optimizer state kept
    assert store.read("p", 2).optimizer_state is None and store.rounds("p") == [1, 2]
    assert all(key.startswith("p/round") for key in state.keys())


def test_roster_and_evaluations_round_trip():
    entries = [m.RosterEntry(1, 4, "d-2", "d", "rendered", False, 40, 60, -1, "3,28,28", "uint8", "", "int64", False),
               m.RosterEntry(3, 4, "x", "x", "real", True, 0, 20, 5, "3,28,28", "uint8", "", "int64", True)]
    assert m.decode_roster(RecordDict({m.ROSTER: m.roster_record(entries)}), 7) == entries
    evals = [Evaluation("c", "test", 0.5, 1.25, 60), Evaluation("c", "val", 0.75, 0.5, 8, "dice")]
    assert m.decode_evaluations(m.encode_evaluations(evals), "c") == evals
    with pytest.raises(UpdateError, match="evaluation of 'c'"):
        m.decode_evaluations(m.encode_evaluations(evals), "other")
    bad = RecordDict({"eval.c|test": ConfigRecord({"client": "c", "split": "test", "acc": 2.0, "loss": 0.0, "n": 3,
                                                   "metric": "accuracy"})})
    with pytest.raises(UpdateError, match="invalid evaluation"):
        m.decode_evaluations(bad, "c")
    with pytest.raises(UpdateError, match="without a 'roster'"):
        m.decode_roster(RecordDict({"x": ArrayRecord()}), 7)
    columns = m.roster_record(entries)
    columns["index"] = ["1", "3"]  # a string where the server compares integers
    with pytest.raises(UpdateError, match="roster column 'index' holds '1', not int"):
        m.decode_roster(RecordDict({m.ROSTER: columns}), 7)
    counted = RecordDict({"eval.c|test": ConfigRecord({"client": "c", "split": "test", "acc": 0.5, "loss": 0.0,
                                                       "n": True, "metric": "accuracy"})})
    with pytest.raises(UpdateError, match="invalid evaluation"):
        m.decode_evaluations(counted, "c")


def test_balanced_accuracy_travels_with_its_class_counts_and_pieces_combine_exactly():
    """A domain's validation split scored in pieces on several nodes (Flower, cross-device) combines into the
    balanced accuracy of the whole split: per-class hits and support travel with each piece and are summed.
    A balanced accuracy without valid counts is refused."""
    from fednorm.engines.flower.server import combine_pieces
    from fednorm.methods.tasks import Scorer, build_task

    task = build_task("classification", metric="balanced_accuracy")
    logits = torch.randn(40, 4, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 4, (40,), generator=torch.Generator().manual_seed(1))
    whole = Scorer(task)
    whole.add(logits, y)
    pieces = []
    for part in (slice(0, 7), slice(7, 25), slice(25, 40)):
        scorer = Scorer(task)
        scorer.add(logits[part], y[part])
        score, loss = scorer.result()
        piece = Evaluation("d", "val", score, loss, scorer.count, task.metric, scorer.class_counts())
        assert m.decode_evaluations(m.encode_evaluations([piece]), "d") == [piece]
        pieces.append(piece)
    combined = combine_pieces("d", "val", pieces)
    assert combined.accuracy == pytest.approx(whole.result()[0], abs=1e-12)
    assert combined.loss == pytest.approx(whole.result()[1], rel=1e-6) and combined.num_examples == 40  # float32 sums
    sized = sum(p.accuracy * p.num_examples for p in pieces) / 40
    assert abs(sized - combined.accuracy) > 1e-3  # the size-weighted mean of the pieces would not be it
    external = Evaluation("x:global", "test", pieces[0].accuracy, 0.5, pieces[0].num_examples, task.metric,
                          pieces[0].class_counts)  # an external client's score travels with its counts too
    assert m.decode_evaluations(m.encode_evaluations([external]), "x") == [external]
    plain = [Evaluation("d", "val", 0.5, 1.0, 10), Evaluation("d", "val", 1.0, 3.0, 30)]
    assert combine_pieces("d", "val", plain) == Evaluation("d", "val", 0.875, 2.5, 40)
    record = {"client": "d", "split": "val", "acc": 0.5, "loss": 0.0, "n": 3, "metric": "balanced_accuracy"}
    for counts in ({}, {"hits": [1, 0], "support": [1, 1]}, {"hits": [2, 0], "support": [1, 2]},
                   {"hits": 1, "support": [1, 2]}, {"hits": [0, 0], "support": [1, 2]}):  # the last: acc is not 0
        with pytest.raises(UpdateError, match="without valid per-class counts"):
            m.decode_evaluations(RecordDict({"eval.d|val": ConfigRecord({**record, **counts})}), "d")


def test_drift_travels_with_the_reply_and_a_bad_drift_is_refused():
    reply = ClientReply("a", {"w": torch.ones(1)}, 1.0, 3)
    back = m.decode_reply(m.encode_reply(reply, {}, LocalResult(1.0, 8, 3, drift=0.125)), "a", 1.0)[2]
    assert back.drift == 0.125
    assert m.decode_reply(m.encode_reply(reply, {}, LocalResult(1.0, 8, 3)), "a", 1.0)[2].drift is None
    content = m.encode_reply(reply, {}, LocalResult(1.0, 8, 3, drift=float("inf")))
    with pytest.raises(UpdateError, match="invalid drift"):
        m.decode_reply(content, "a", 1.0)
