"""What travels in Flower messages, and what a node keeps in ``Context.state``: conversions both ways.

Every message of a fednorm run carries a ``cell`` record (the resolved experiment as YAML, the method
label, the seed, the client it is for), so a node needs nothing but its own data to take part. Then:

| message          | server -> node                                   | node -> server                                  |
| ---------------- | ------------------------------------------------ | ----------------------------------------------- |
| query (roster)   | cell                                             | ``roster``: the node's clients, their sizes     |
| train            | cell, ``instructions``, ``global`` (shared       | ``state`` (shared entries), ``message`` (client |
|                  | entries only), ``server_state``, ``input_state`` | algorithm; HarmoFL's first amplitude),          |
|                  | (HarmoFL's global amplitude)                     | ``metrics``, ``bn_counts``                      |
| query (BN)       | cell (with the external modes)                   | ``bn_layers``: the client's local BN weight and |
|                  |                                                  | bias (and statistics, for ``bn_average``)       |
| evaluate         | cell, ``global``, ``input_state`` (an external   | one ConfigRecord per split (``eval.test``, ...) |
|                  | client: ``bn_layers``, the clients' average)     |                                                 |

Local entries (FedBN's BN state, SiloBN's statistics), optimizer state and client algorithm state are
never in a message, except the BN entries the query (BN) asks for when external clients are scored under
``fedbn_average`` or ``bn_average``: they stay on the node (``node_state``: its state-dir, else its
``Context.state``).

Decoding is strict: anything missing or of the wrong type raises :class:`UpdateError` naming the
record and the client, which the server logs before leaving the reply out of the round.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, fields

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from ...methods.aggregation import UpdateError
from ...methods.local_update import LocalResult
from ...methods.server import ClientReply
from ...methods.tasks import balanced_accuracy
from ..client_step import RoundInstructions

CELL = "cell"
INSTRUCTIONS = "instructions"
GLOBAL = "global"
SERVER_STATE = "server_state"
INPUT_STATE = "input_state"
STATE = "state"
ALGORITHM_MESSAGE = "message"
METRICS = "metrics"
BN_COUNTS = "bn_counts"
ROSTER = "roster"
BN_LAYERS = "bn_layers"  # a client's local BN entries, or their average (external clients' fedbn_average, bn_average)
EVAL_PREFIX = "eval."
NO_CLIENT_STATE = -1  # CellRequest.state_round: the client has saved no state in the run's history
UNKNOWN_CLIENT_STATE = -2  # CellRequest.state_round: the server does not say (the node's newest snapshot)


# ------------------------------------------------------------------------------------------ tensors
def to_arrays(tensors: dict[str, torch.Tensor]) -> ArrayRecord:
    """An ArrayRecord holding ``tensors`` exactly (dtype, shape and values)."""
    if not tensors:
        return ArrayRecord()
    return ArrayRecord({k: v.detach().cpu() for k, v in tensors.items()})


def from_arrays(content: RecordDict, name: str, who: str = "the server") -> dict[str, torch.Tensor]:
    """The tensors of record ``name``; UpdateError if it is absent or not arrays."""
    record = content.array_records.get(name)
    if record is None:
        raise UpdateError(f"{who} sent no {name!r} arrays")
    try:
        return dict(record.to_torch_state_dict())
    except Exception as exc:  # noqa: BLE001 - a malformed array of any kind gets the same message
        raise UpdateError(f"{who} sent unreadable {name!r} arrays: {exc}") from exc


# ------------------------------------------------------------------------------------------ cell
@dataclass(frozen=True)
class CellRequest:
    """Which run, cell and client a message is about; ``record_as`` names an evaluation (a domain when the
    global model is evaluated once per domain, else the client itself)."""

    experiment: str  # the resolved experiment config, YAML
    method: str = ""  # method label ("" for a roster query)
    seed: int = 0
    client: str = ""
    record_as: str = ""
    splits: tuple[str, ...] = ()
    external_modes: tuple[str, ...] = ()  # an external client's evaluation: under these modes
    round: int = -1  # rounds completed when the message is sent (where a node's saved client state applies)
    run_id: str = ""  # the run folder's id (run.json): a node keeps each run's client state apart
    # which snapshot of the client's state (kept between rounds, under a method whose clients keep state) the node
    # must use: the rounds completed when the client's reply last went into the global model (on a node that keeps
    # its state on disk, state-dir, or in its run context). NO_CLIENT_STATE: it has none (it starts from the global
    # model, whatever the node holds: snapshots of rounds a resumed run redoes are stale). UNKNOWN_CLIENT_STATE:
    # the server does not say (an older fednorm, or a checkpoint written before it recorded this): the newest
    # snapshot at or before ``round`` and ``state_at_most`` (if >= 0). A node that lacks a snapshot named on disk is
    # not the node or state-dir that ran it: it must not start the client afresh or from other state
    state_round: int = UNKNOWN_CLIENT_STATE
    state_at_most: int = -1
    # from a server of the fednorm before (which named no snapshot): the newest snapshot must be at least this
    # round (-1: no check)
    state_at_least: int = -1
    # True: the server names snapshots kept in run contexts too (RosterEntry.context_snapshots), and the named one,
    # if any, is in one; a node without a state-dir that lacks it was restarted, and starts the client from the
    # global model. False: the named snapshot is on disk (a node without a state-dir cannot hold it), or the
    # server is of an earlier fednorm, whose state_round for a node without a state-dir was -1 whatever the node
    # held (the node then reads its newest)
    state_in_context: bool = False
    # the run's cells (method label, seed) whose training and evaluation are over: a node drops the snapshots it
    # keeps of them in its run context (a run context lives as long as the Flower run, over all its cells).
    # Snapshots on disk stay (a state-dir's files are the user's, docs/flower.md 3.9); nodes of an earlier
    # fednorm ignore the field
    finished_cells: tuple[tuple[str, int], ...] = ()

    def record(self) -> ConfigRecord:
        # "state_snapshot" carries state_round. Servers of the fednorm before sent "state_round" with another rule
        # (< 0: nothing recorded, not "none"; else: the newest snapshot, at least of that round), still sent for
        # nodes of that version
        return ConfigRecord({"experiment": self.experiment, "method": self.method, "seed": int(self.seed),
                             "client": self.client, "record_as": self.record_as or self.client,
                             "splits": list(self.splits), "external_modes": list(self.external_modes),
                             "round": int(self.round), "run_id": self.run_id,
                             "state_snapshot": int(self.state_round), "state_at_most": int(self.state_at_most),
                             "state_round": int(self.state_round), "state_in_context": bool(self.state_in_context),
                             "finished_methods": [method for method, _ in self.finished_cells],
                             "finished_seeds": [int(seed) for _, seed in self.finished_cells]})

    @classmethod
    def decode(cls, content: RecordDict) -> "CellRequest":
        record = content.config_records.get(CELL)
        if record is None:
            raise ValueError("the message has no 'cell' record: it was not sent by a fednorm ServerApp")
        return cls(str(record["experiment"]), str(record["method"]), int(record["seed"]), str(record["client"]),
                   str(record["record_as"]), tuple(str(s) for s in record["splits"]),
                   tuple(str(s) for s in record.get("external_modes", [])), int(record.get("round", -1)),
                   str(record.get("run_id", "")), int(record.get("state_snapshot", UNKNOWN_CLIENT_STATE)),
                   int(record.get("state_at_most", -1)),
                   -1 if "state_snapshot" in record else max(int(record.get("state_round", -1)), -1),
                   bool(record.get("state_in_context", False)),
                   tuple(zip(map(str, record.get("finished_methods", [])), map(int, record.get("finished_seeds", [])),
                             strict=True)))


# ------------------------------------------------------------------------------------------ instructions
def instructions_record(instructions: RoundInstructions) -> ConfigRecord:
    return ConfigRecord(asdict(instructions))


def decode_instructions(content: RecordDict) -> RoundInstructions:
    record = content.config_records.get(INSTRUCTIONS)
    if record is None:
        raise ValueError("the train message has no 'instructions' record")
    values = {}
    for f in fields(RoundInstructions):
        if f.name not in record:
            raise ValueError(f"the train message's instructions lack {f.name!r}")
        values[f.name] = record[f.name]
    return RoundInstructions(**values)


# ------------------------------------------------------------------------------------------ replies
def encode_reply(reply: ClientReply, message: dict[str, torch.Tensor], result: LocalResult) -> RecordDict:
    """The node's answer to a train message."""
    metrics = {"weight": float(reply.weight), "num_steps": int(reply.num_steps),
               "loss_sum": float(result.loss_sum), "num_examples": int(result.num_examples)}
    if result.drift is not None:
        metrics["drift"] = float(result.drift)  # diagnostics.drift (HarmoFL's Gamma_i)
    return RecordDict({
        CELL: ConfigRecord({"client": reply.client}),
        STATE: to_arrays(reply.state),
        ALGORITHM_MESSAGE: to_arrays(message),
        METRICS: MetricRecord(metrics),
        BN_COUNTS: MetricRecord({k: int(v) for k, v in reply.bn_counts.items()}),
    })


def decode_reply(content: RecordDict, client: str, weight: float
                 ) -> tuple[ClientReply, dict[str, torch.Tensor], LocalResult]:
    """(reply, client algorithm message, loss statistics) of ``client``'s answer. ``weight`` is the
    server's own aggregation weight for it: a client's claim about its weight is never trusted."""
    who = f"client {client!r}"
    cell = content.config_records.get(CELL)
    if cell is None or cell.get("client") != client:
        named = None if cell is None else cell.get("client")
        raise UpdateError(f"{who}: the reply names client {named!r}; a node must answer for the client it was asked")
    state = from_arrays(content, STATE, who)
    message = from_arrays(content, ALGORITHM_MESSAGE, who)
    metrics = content.metric_records.get(METRICS)
    if metrics is None:
        raise UpdateError(f"{who} sent no 'metrics' record")
    try:
        num_steps, num_examples = metrics["num_steps"], metrics["num_examples"]
        loss_sum = float(metrics["loss_sum"])
    except KeyError as exc:
        raise UpdateError(f"{who} sent no {exc.args[0]!r} in its metrics") from None
    except (TypeError, ValueError) as exc:  # e.g. a list where a number belongs (MetricRecord allows lists)
        raise UpdateError(f"{who} sent a loss_sum that is not a number ({metrics['loss_sum']!r}: {exc})") from None
    if not _count(num_steps) or not _count(num_examples):
        raise UpdateError(f"{who} sent invalid step or example counts ({num_steps!r}, {num_examples!r})")
    if not math.isfinite(loss_sum):
        raise UpdateError(f"{who} reported a non-finite training loss ({loss_sum}): its local training diverged")
    counts_record = content.metric_records.get(BN_COUNTS)
    counts = {} if counts_record is None else dict(counts_record)
    if any(not _count(v) for v in counts.values()):
        raise UpdateError(f"{who} sent non-integer FBN batch sizes {counts}")
    drift = metrics.get("drift")
    if drift is not None and not (isinstance(drift, float) and math.isfinite(drift) and drift >= 0):
        raise UpdateError(f"{who} reported an invalid drift {drift!r} (a finite squared distance >= 0)")
    reply = ClientReply(client, state, weight, num_steps, counts)
    return reply, message, LocalResult(loss_sum, num_examples, num_steps, drift)


# ------------------------------------------------------------------------------------------ evaluation
def encode_evaluations(evals) -> RecordDict:
    """The node's answer to an evaluate message: one ConfigRecord per evaluation (``eval.<client>|<split>``)."""
    content = RecordDict()
    for e in evals:
        record = {"client": e.client, "split": e.split, "acc": float(e.accuracy), "loss": float(e.loss),
                  "n": int(e.num_examples), "metric": e.metric}
        if e.class_counts is not None:  # balanced accuracy: per-class hits and support, for exact combination
            record["hits"], record["support"] = list(e.class_counts[0]), list(e.class_counts[1])
        content[f"{EVAL_PREFIX}{e.client}|{e.split}"] = ConfigRecord(record)
    return content


def _count(value) -> bool:
    """A non-negative integer count (a bool is not one, though Python's bool is an int)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def decode_evaluations(content: RecordDict, client: str):
    """The :class:`fednorm.engines.simulation.Evaluation` list of ``client``'s evaluate reply (an external
    client's are named ``<client>:<mode>``)."""
    from ..simulation import Evaluation

    who = f"client {client!r}"
    out = []
    for name, record in content.config_records.items():
        if not name.startswith(EVAL_PREFIX):
            continue
        try:
            named, split, n, metric = str(record["client"]), str(record["split"]), record["n"], str(record["metric"])
            acc, loss = float(record["acc"]), float(record["loss"])
        except (KeyError, TypeError, ValueError) as exc:
            raise UpdateError(f"{who} sent a malformed evaluation {name!r}: {exc}") from None
        if named != client and not named.startswith(client + ":"):
            raise UpdateError(f"{who} sent an evaluation of {named!r}")
        if not _count(n) or not 0.0 <= acc <= 1.0:
            raise UpdateError(f"{who} sent an invalid evaluation of {split!r}: score {acc}, n {n!r}")
        counts = None
        if metric == "balanced_accuracy":
            hits, support = record.get("hits"), record.get("support")
            valid = (isinstance(hits, list) and isinstance(support, list) and support and len(hits) == len(support)
                     and all(_count(v) for v in hits + support) and all(h <= s for h, s in zip(hits, support))
                     and sum(support) == n and abs(acc - balanced_accuracy(hits, support)) < 1e-9)
            if not valid:
                raise UpdateError(f"{who} sent a balanced accuracy of {split!r} without valid per-class counts (hits "
                                  f"<= support per class, support summing to n = {n!r}, the score their mean "
                                  "recall): is it the same fednorm version?")
            counts = (tuple(hits), tuple(support))
        out.append(Evaluation(named, split, acc, loss, n, metric, counts))
    return out


# ------------------------------------------------------------------------------------------ roster
@dataclass(frozen=True)
class RosterEntry:
    """What the server may know of a client: never its data, only its place, split sizes and sample shape."""

    index: int  # position in the federation (the in-process engine's client order)
    total: int  # the federation's number of clients, as the node counts it
    name: str
    domain: str
    origin: str
    external: bool  # never trains, evaluated only
    num_train: int
    num_test: int
    num_val: int  # -1: no validation split
    x_shape: str  # one sample's shape, "3,28,28" ("" for a scalar)
    x_dtype: str
    y_shape: str
    y_dtype: str
    persistent: bool  # the node keeps the client's state on disk (node config state-dir): resumable
    # the client's entry of the run's partitions.json as JSON (split sizes, counts per class, a sha256 of each split:
    # what a resume checks the data against), computed on the node; "" from a node of an earlier fednorm
    partition: str = ""
    # without a state-dir, the node keeps the client's state per round in its run context and reads the snapshot
    # the server names, as a node with a state-dir does (False from an earlier node: it keeps only the newest)
    context_snapshots: bool = False


def roster_record(entries: list[RosterEntry]) -> ConfigRecord:
    return ConfigRecord({f.name: [getattr(e, f.name) for e in entries] for f in fields(RosterEntry)})


def decode_roster(content: RecordDict, node_id: int) -> list[RosterEntry]:
    record = content.config_records.get(ROSTER)
    if record is None:
        raise UpdateError(f"node {node_id} answered the roster query without a 'roster' record")
    try:
        rows = len(record["name"])
        columns = [list(record[f.name]) if f.default is MISSING or f.name in record else [f.default] * rows
                   for f in fields(RosterEntry)]  # a column added since: its default from an earlier node
    except KeyError as exc:
        raise UpdateError(f"node {node_id}'s roster lacks {exc.args[0]!r}") from None
    if len({len(c) for c in columns}) > 1:
        raise UpdateError(f"node {node_id}'s roster columns differ in length")
    for f, column in zip(fields(RosterEntry), columns):
        kind = {"int": int, "str": str, "bool": bool}[f.type]
        wrong = [v for v in column if not isinstance(v, kind) or (kind is int and isinstance(v, bool))]
        if wrong:
            raise UpdateError(f"node {node_id}'s roster column {f.name!r} holds {wrong[0]!r}, not {f.type}")
    entries = [RosterEntry(*row) for row in zip(*columns)]
    for e in entries:
        try:
            if e.partition and not isinstance(json.loads(e.partition), dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            raise UpdateError(f"node {node_id}'s partition record of client {e.name!r} is malformed ({exc})") from None
    return entries


# ------------------------------------------------------------------------------------------ client memory
def memory_prefix(cell: CellRequest, client: str) -> str:
    """Where a node keeps ``client``'s memory for the cell: per run (two runs of one config on the same
    ``state-dir`` never read each other's client state), method, seed and client. Runs started before run ids
    existed keep their old place."""
    return f"{cell_prefix(cell.run_id, cell.method, cell.seed)}/{client}"


def cell_prefix(run_id: str, method: str, seed: int) -> str:
    """Where a node keeps the memories of a cell's clients (:func:`memory_prefix`)."""
    run = f"{run_id}/" if run_id else ""
    return f"fednorm/{run}{method}/seed{seed}"
