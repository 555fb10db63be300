"""The server side on Flower: a ServerApp ``main`` that runs a fednorm experiment over SuperNodes.

The server knows its clients only through a roster (names, domains, split sizes) that each node reports
when asked; it holds an in-process engine over that roster (no images, see :func:`roster_clients`) for
everything a server does: sampling, aggregation weights, the learning-rate schedule, FixBN's switch,
the method's :class:`fednorm.methods.server.ServerUpdate` (Byzantine attacks included), the client
algorithm's server state and checkpoints. :class:`FlowerEngine` replaces only the loop over clients by
messages, so the run folder (``metrics.jsonl``, summaries, report) is written by the runner exactly as
in-process and the numbers are the same for the same seed.

Policy for bad replies (logged, and recorded per round in ``participation.jsonl`` in the cell folder):

- a reply that is missing (node died or timed out after ``round_timeout`` seconds), an error (the
  ClientApp raised, e.g. its training diverged), or malformed (missing arrays, wrong shapes or dtypes,
  NaN or Inf values, no FBN batch size) is left out of the round;
- the remaining replies' weights are renormalized to sum to one (unchanged when nothing was left out);
- if no reply remains, the global model and the client algorithm's server state stay as they were;
- a node that missed a reply is left out of later rounds until its late reply arrives (it was slow, not
  dead) or a node holding its clients connects (a restarted SuperNode is asked for its roster at the next
  round; without a state-dir its clients restart from the global model, their local state died with the old
  node; with one they go on from their saved state, and a node lacking it stops the run).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from logging import INFO, WARNING
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode
from flwr.common.logger import log

from ...data.domain import ClientData, Split
from ...methods.aggregation import DivergenceError, UpdateError
from ...methods.amplitude import CLIENT_AMPLITUDE, GLOBAL_AMPLITUDE, amplitude_entries, without_amplitudes
from ...methods.external import CLIENT_AVERAGE_MODES
from ...methods.local_update import LocalResult
from ...methods.server import ClientReply
from ...methods.tasks import balanced_accuracy
from ...runs import store
from ...runs.config import ExperimentConfig, MethodConfig
from ...runs.runner import (PARTITIONS_FILE, CellResult, RunError, build_engine, check_config_unchanged, check_engine,
                            execute, load_run_config, read_run_info, run_lock, start_run, without_class_counts)
from ..simulation import Evaluation
from . import messages as m
from .node import check_flower_method, experiment_text

PARTICIPATION_FILE = store.PARTICIPATION_FILE


@dataclass(frozen=True)
class FlowerOptions:
    """How long the server waits for nodes, and how often it looks for replies."""

    round_timeout: float | None = 600.0  # seconds for one wave of replies; None waits forever
    node_wait: float = 300.0  # seconds to wait at the start for nodes holding every client
    poll_interval: float = 0.2  # seconds between looks for replies

    def __post_init__(self) -> None:
        if self.round_timeout is not None and self.round_timeout <= 0:
            raise ValueError(f"round_timeout must be > 0 seconds (or None), got {self.round_timeout}")
        if self.node_wait < 0 or self.poll_interval <= 0:
            raise ValueError("node_wait must be >= 0 and poll_interval > 0")


def roster_clients(entries: list[m.RosterEntry]) -> list[ClientData]:
    """ClientData that carry only what the server may know of each client (name, domain, origin, split
    sizes, sample shape, the node's partition record for partitions.json): every sample is one zero broadcast
    to its shape, so the splits cost no memory; the data stay on the nodes."""
    def blank(n: int, shape: str, dtype: str) -> torch.Tensor:
        dims = tuple(int(s) for s in shape.split(",") if s)
        return torch.zeros((1,) * (1 + len(dims)), dtype=getattr(torch, dtype)).expand(n, *dims)

    def split(n: int, e: m.RosterEntry) -> Split:
        return Split(blank(n, e.x_shape, e.x_dtype), blank(n, e.y_shape, e.y_dtype))

    return [ClientData(e.name, e.domain, split(e.num_train, e), split(e.num_test, e),
                       None if e.num_val < 0 else split(e.num_val, e), e.origin,
                       meta={"index": e.index, **({"external": True} if e.external else {}),
                             **({"partition_record": json.loads(e.partition)} if e.partition else {})})
            for e in sorted(entries, key=lambda e: e.index)]


# ------------------------------------------------------------------------------------------ transport
def exchange(grid, items: list[tuple[str, int, RecordDict]], message_type: str, options: FlowerOptions,
             group: str = "") -> tuple[dict[str, Message], dict[str, str]]:
    """Send each ``(key, node, content)``; (replies by key, key -> id of the message left unanswered).

    A node gets one message at a time (waves), so its ClientApp never runs two clients at once on the same
    ``Context.state``; a node silent in one wave gets no more. Replies are polled every
    ``options.poll_interval`` seconds, for at most ``options.round_timeout`` seconds per wave."""
    waves: list[list[tuple[str, int, RecordDict]]] = []
    depth: dict[int, int] = {}
    for item in items:
        k = depth.get(item[1], 0)
        depth[item[1]] = k + 1
        if k == len(waves):
            waves.append([])
        waves[k].append(item)
    out: dict[str, Message] = {}
    unanswered: dict[str, str] = {}
    silent: set[int] = set()
    for wave in waves:
        unanswered.update({key: "" for key, node, _ in wave if node in silent})
        wave = [item for item in wave if item[1] not in silent]
        if not wave:
            continue
        messages = [Message(content, dst_node_id=node, message_type=message_type, group_id=group)
                    for _, node, content in wave]
        ids = list(grid.push_messages(messages))
        pending = {mid: key for mid, (key, _, _) in zip(ids, wave) if mid}
        unanswered.update({key: "" for mid, (key, _, _) in zip(ids, wave) if not mid})
        deadline = None if options.round_timeout is None else time.monotonic() + options.round_timeout
        while pending:
            for reply in grid.pull_messages(list(pending)):
                key = pending.pop(reply.metadata.reply_to_message_id, None)
                if key is not None:
                    out[key] = reply
            if not pending or (deadline is not None and time.monotonic() > deadline):
                break
            time.sleep(options.poll_interval)
        unanswered.update({key: mid for mid, key in pending.items()})
        silent |= {node for key, node, _ in wave if key in unanswered}
    return out, unanswered


def _error_text(reply: Message) -> str:
    error = reply.error
    return f"error {error.code}: {(error.reason or '').strip().splitlines()[-1] if error.reason else 'no reason given'}"


# ------------------------------------------------------------------------------------------ roster
def combine_pieces(client: str, split: str, pieces: list[Evaluation]) -> Evaluation:
    """One evaluation of a split scored in pieces on several nodes, as if scored whole: the loss and accuracy or
    Dice (means over samples) weighted by the pieces' sizes; balanced accuracy from the summed per-class counts."""
    total = sum(e.num_examples for e in pieces)
    loss = sum(e.loss * e.num_examples for e in pieces) / total
    if pieces[0].metric == "balanced_accuracy":
        widths = {len(e.class_counts[1]) for e in pieces}
        if len(widths) != 1:
            raise UpdateError(f"the pieces of {client!r}'s {split} split count {sorted(widths)} classes: one model "
                              "scores them all")
        width = widths.pop()
        hits, support = [0] * width, [0] * width
        for e in pieces:
            for k, (h, n) in enumerate(zip(*e.class_counts)):
                hits[k], support[k] = hits[k] + h, support[k] + n
        counts = (tuple(hits), tuple(support))
        return Evaluation(client, split, balanced_accuracy(*counts), loss, total, pieces[0].metric, counts)
    return Evaluation(client, split, sum(e.accuracy * e.num_examples for e in pieces) / total, loss, total,
                      pieces[0].metric)


class Roster:
    """Which SuperNode holds which client, learned by asking each node that connects (a query message)."""

    def __init__(self, grid, config: ExperimentConfig, options: FlowerOptions) -> None:
        self.grid, self.options = grid, options
        self.experiment = experiment_text(config)
        self.expected: int | None = None  # the federation's size, as the first node to answer counts it
        self.entries: dict[int, m.RosterEntry] = {}
        self.entry_of: dict[str, m.RosterEntry] = {}  # the same entries by client name
        self.node_of: dict[str, int] = {}
        self.known: set[int] = set()
        self.online: set[int] = set()  # nodes Flower reports online (their heartbeats arrive)
        self.lost: dict[int, list[str]] = {}  # node -> ids of its messages left unanswered
        self.gone: set[int] = set()  # lost nodes Flower has since reported offline (dead, not only slow)

    def discover(self) -> None:
        """Take back lost nodes that answered since, ask a lost node that went offline and came back (a
        restarted SuperNode keeping its id under node authentication) again, and ask every node not seen
        before which clients it holds."""
        self.online = set(self.grid.get_node_ids())
        self.revive()
        self.gone |= {n for n in self.lost if n not in self.online}
        for node in sorted(self.gone & self.online):
            # restarted: its clients' in-memory state died with it (state-dir keeps it on disk); asked afresh
            log(WARNING, "fednorm: node %s is back after going offline; it is asked which clients it holds", node)
            self.gone.discard(node)
            self.lost.pop(node, None)
            self.known.discard(node)
        new = [n for n in self.online if n not in self.known]
        if not new:
            return
        content = RecordDict({m.CELL: m.CellRequest(self.experiment).record()})
        items = [(str(n), n, content) for n in new]
        wait = min(self.options.round_timeout or float("inf"), max(self.options.node_wait, 1.0))
        replies, unanswered = exchange(self.grid, items, MessageType.QUERY, replace(self.options, round_timeout=wait),
                                       group="roster")
        for key in unanswered:
            log(WARNING, "fednorm: node %s did not answer the roster query; it is asked again later", key)
        for key, reply in replies.items():
            node = int(key)
            self.known.add(node)
            if reply.has_error():
                log(WARNING, "fednorm: node %s cannot take part (%s)", node, _error_text(reply))
                continue
            try:
                entries = m.decode_roster(reply.content, node)
            except UpdateError as exc:
                log(WARNING, "fednorm: %s", exc)
                continue
            for e in entries:
                if self.expected is None:
                    self.expected = e.total
                if e.total != self.expected:
                    raise RunError(f"node {node} counts {e.total} clients in the federation, another node "
                                   f"{self.expected}: do the nodes run the same fednorm version on the same data?")
                if not 0 <= e.index < self.expected:
                    log(WARNING, "fednorm: node %s claims client %r at index %s, outside the federation's %s "
                        "clients; ignored", node, e.name, e.index, self.expected)
                    continue
                held = self.entries.get(e.index)
                if (held is not None and held.partition and e.partition
                        and without_class_counts(json.loads(held.partition))
                        != without_class_counts(json.loads(e.partition))):
                    # a restarted or new node for a known client: it must hold the data the client trained on (the
                    # sizes and sha256 decide; the counts per class derive from the data, and a node may keep them)
                    raise RunError(f"node {node} holds client {e.name!r} with other data than its node had (their "
                                   f"sizes or sha256 in {PARTITIONS_FILE} differ): give it the data folder "
                                   "and node config the client's first node had")
                old = self.node_of.get(e.name)
                # a client "held by two nodes" only while its old node is live: a node Flower reports offline
                # (a SuperNode restarted under a new id) has handed its clients on
                if old is not None and old not in self.lost and old in self.online and old != node:
                    raise RunError(f"client {e.name!r} is held by two nodes ({old} and {node}); give each SuperNode "
                                   "its own clients in --node-config")
                if old is not None and old != node:
                    log(WARNING, "fednorm: client %r is now held by node %s (its node %s was lost; local state "
                        "kept only in the lost node's run context starts afresh)", e.name, node, old)
                if held is not None:
                    self.entry_of.pop(held.name, None)
                self.entries[e.index], self.entry_of[e.name], self.node_of[e.name] = e, e, node
            log(INFO, "fednorm: node %s holds %s", node, [e.name for e in entries])

    def wait_for_all(self) -> list[ClientData]:
        """Wait until nodes hold every client of the federation; the roster clients in federation order."""
        deadline = time.monotonic() + self.options.node_wait
        while True:
            self.discover()
            missing = sorted(set(range(self.expected)) - set(self.entries)) if self.expected is not None else ["all"]
            if not missing:
                return roster_clients(list(self.entries.values()))
            if time.monotonic() > deadline:
                raise RunError(
                    f"after {self.options.node_wait:.0f} s no SuperNode holds client indexes {missing[:10]} of the "
                    f"federation ({self.expected or 'no node answered'}); start one per client with --node-config "
                    "\"client-index=K\" (`fednorm flower clients CONFIG` lists them)")
            time.sleep(min(1.0, max(self.options.poll_interval, 0.05)))

    def entry(self, client: str) -> m.RosterEntry | None:
        """What the node holding ``client`` (last) reported of it."""
        return self.entry_of.get(client)

    def node(self, client: str) -> int | None:
        """The live node holding ``client``, or None (none holds it, it missed a reply, or Flower reports it
        offline)."""
        node = self.node_of.get(client)
        return None if node is None or node in self.lost or node not in self.online else node

    def lose(self, node: int, message_id: str = "") -> None:
        """``node`` left message ``message_id`` unanswered: leave its clients out until it answers."""
        if node not in self.lost:
            held = sorted(c for c, n in self.node_of.items() if n == node)
            log(WARNING, "fednorm: node %s did not answer in time; its clients %s are left out until it answers "
                "or a node holding them connects", node, held)
        self.lost.setdefault(node, [])
        if message_id:
            self.lost[node].append(message_id)

    def revive(self) -> None:
        """A lost node whose late reply has arrived is alive (only slow): it takes part again. Its late
        replies are dropped (their round is over), and the training the client did for them too (except on a
        node of an earlier fednorm without a state-dir: FlowerEngine._count_client_state)."""
        for node, ids in list(self.lost.items()):
            if not ids or node not in self.online:
                continue
            answered = [r for r in self.grid.pull_messages(ids) if r.metadata.src_node_id == node]
            if answered:
                del self.lost[node]
                log(WARNING, "fednorm: node %s answered late; it takes part again", node)


# ------------------------------------------------------------------------------------------ engine
class FlowerEngine:
    """One cell on Flower: the in-process engine's server side over a roster, clients reached by messages.

    Has the round interface the runner drives (``round``, ``run_round``, ``evaluate``, ``state_dict``,
    ``load_state_dict``)."""

    def __init__(self, grid, roster: Roster, config: ExperimentConfig, method_cfg: MethodConfig, seed: int,
                 clients: list[ClientData], options: FlowerOptions = FlowerOptions(),
                 cell_dir: Path | None = None, run_id: str = "",
                 finished_cells: tuple[tuple[str, int], ...] = ()) -> None:
        check_flower_method(method_cfg)
        self.grid, self.roster, self.options = grid, roster, options
        self.core = build_engine(config, method_cfg, seed, clients, device="cpu")  # aggregation only: the host
        self.label, self.seed = method_cfg.display, seed
        self.experiment = experiment_text(config)
        self.run_id = run_id
        self.finished_cells = finished_cells  # the run's cells before this one: nodes drop their run-context state
        self.participation_path = None if cell_dir is None else Path(cell_dir) / PARTICIPATION_FILE
        self._participation_checked = False  # rounds after the cell's checkpoint are dropped at the first write
        core = self.core
        # under a method whose clients keep state (their BN layers, optimizer, control variates), a node that
        # answers a train message has saved that state (node.py, train), in its state-dir or its run context. Every
        # later message names the round it was saved after (client -> rounds completed, CellRequest.state_round),
        # and a node without a snapshot saved on disk (another runtime or state-dir on resume, a restart without
        # it) stops the run instead of starting the client afresh. A node without a state-dir promises no more than
        # its run context: restarted, its clients start from the global model (docs/flower.md); but a resume
        # cannot bring their state back (load_state_dict). All three are checkpointed.
        self.keeps_client_state = bool(core.local_keys or core.federation.persistent_optimizer
                                       or core.algorithm.stateful)
        self.clients_with_state: dict[str, int] = {}
        self.clients_with_state_in_context: set[str] = set()  # of those, the ones whose snapshot is in a run context
        self.clients_with_volatile_state: set[str] = set()
        # resumed from a checkpoint of this round written before fednorm recorded clients_with_state (-1: none):
        # for a client not in it, the server cannot name its snapshot; the node takes its newest at or before this
        # round (later ones are of rounds the resumed run redoes)
        self.client_state_unrecorded_at = -1

    @property
    def round(self) -> int:
        return self.core.round

    # -------------------------------------------------------------- messages
    def _cell(self, client: str, record_as: str = "", splits: tuple[str, ...] = ()) -> m.CellRequest:
        """The message's cell; ``_send`` names the client's state snapshot in it once the roster is current."""
        return m.CellRequest(self.experiment, self.label, self.seed, client, record_as or client, splits,
                             round=self.core.round, run_id=self.run_id, finished_cells=self.finished_cells)

    def _named_state(self, client: str) -> dict:
        """Which snapshot of ``client``'s state its node must read (CellRequest.state_round and the fields beside
        it), for the node that holds it now."""
        if client not in self.clients_with_state:
            unknown = self.client_state_unrecorded_at >= 0
            return {"state_round": m.UNKNOWN_CLIENT_STATE if unknown else m.NO_CLIENT_STATE,
                    "state_at_most": self.client_state_unrecorded_at if unknown else -1, "state_in_context": True}
        if client not in self.clients_with_state_in_context:  # on disk: a node without that state-dir stops the run
            return {"state_round": self.clients_with_state[client], "state_in_context": False}
        entry = self.roster.entry(client)
        if entry is None or entry.persistent or not entry.context_snapshots:
            # it was in the run context of a node that is gone (its node restarted with a state-dir, or as an
            # earlier fednorm): the client starts from the global model, as on any restarted node without one
            return {"state_round": m.NO_CLIENT_STATE, "state_in_context": True}
        return {"state_round": self.clients_with_state[client], "state_in_context": True}

    def _global(self) -> ArrayRecord:
        return m.to_arrays({k: self.core.global_state[k] for k in self.core.shared_keys})

    def _send(self, message_type: str, plan: list[tuple[str, str, RecordDict]], group: str
              ) -> tuple[dict[str, Message], dict[str, str]]:
        """Send each ``(key, client, content)`` to the node holding ``client``; (replies without error by key,
        left-out key -> reason)."""
        self.roster.discover()  # a restarted node may hold lost clients again
        items, dropped, client_of = [], {}, {}
        for key, client, content in plan:
            if m.CELL in content.config_records:  # the snapshot for the node holding the client now
                content[m.CELL] = replace(m.CellRequest.decode(content), **self._named_state(client)).record()
            node = self.roster.node(client)
            client_of[key] = client
            if node is None:
                dropped[key] = "no live node holds it"
            else:
                items.append((key, node, content))
        replies: dict[str, Message] = {}
        received, unanswered = exchange(self.grid, items, message_type, self.options, group)
        for key, message_id in unanswered.items():
            dropped[key] = f"no reply within {self.options.round_timeout} s (node died or too slow)"
            self.roster.lose(self.roster.node_of[client_of[key]], message_id)
        for key, reply in received.items():
            if reply.has_error():
                dropped[key] = _error_text(reply)
                if reply.error.code == ErrorCode.NODE_UNAVAILABLE:  # Flower: the node missed its heartbeats
                    self.roster.lose(self.roster.node_of[client_of[key]])
            else:
                replies[key] = reply
        missing = {key: reason for key, reason in dropped.items() if "ClientStateMissing" in reason}
        if missing:
            # a node without the state its client saved would start that client afresh: results of no method.
            # Not a faulty node to leave out of one round but a setup error: stop, before anything is aggregated
            key, reason = next(iter(missing.items()))
            raise RunError(
                f"{self.label} seed {self.seed}: the node holding client {client_of[key]!r} lacks the state that client "
                f"saved on it ({reason}). Clients keep this state on the nodes that trained them: resume a run with "
                "the Flower runtime and nodes that started it (sim: RUN/node_state; local: its --workdir; a "
                "deployment: each SuperNode with the same state-dir), and restart a SuperNode with the state-dir it "
                "had (docs/flower.md, 3.9). Nothing was aggregated with the missing state: once the nodes are right, "
                "resume the run, which goes on from its last checkpoint")
        return replies, dropped

    # -------------------------------------------------------------- rounds
    def run_round(self) -> dict[str, LocalResult]:
        """One round: the sampled clients train on their nodes, the server aggregates the valid replies."""
        core, r = self.core, self.core.round
        plan = core.round_plan(r)  # the in-process engine's participants and instructions
        participants = [client for client, _ in plan]
        shared, server_state = self._global(), m.to_arrays(core.algorithm_server_state)
        input_state = m.to_arrays(core.input_state)
        sends = [(client.name, client.name, RecordDict({
            m.CELL: self._cell(client.name).record(), m.INSTRUCTIONS: m.instructions_record(instructions),
            m.GLOBAL: shared, m.SERVER_STATE: server_state, m.INPUT_STATE: input_state}))
            for client, instructions in plan]
        replies, dropped = self._send(MessageType.TRAIN, sends, group=f"train-{r}")
        # a node whose local training raised DivergenceError (NaN/inf loss) answers with an error naming it
        # (flwr: "<class '...DivergenceError'>:<'...'>"). As in-process, that is the run's divergence, which
        # federation.on_divergence settles (runner.run_cell: stop with an error, or record the cell), not a faulty
        # node to leave out; the global model and the round stay as they were. A reply whose entries are NaN/inf
        # is a malformed message instead (a faulty node or link: the server cannot tell), left out like any other
        diverged = next(((name, reason) for name, reason in dropped.items() if "DivergenceError" in reason), None)
        if diverged:
            raise DivergenceError(f"client {diverged[0]!r}, on its node: {diverged[1]}")
        if core.shared_keys:
            # validate() checks replies against this round's global state
            core.server.begin(core.global_state, lr=core.training.lr_at(core.round), participants=len(plan))
        accepted: list[tuple[ClientReply, dict, LocalResult]] = []
        received: set[str] = set()
        for client, instructions in plan:
            if client.name not in replies:
                continue
            try:
                reply, message, result = m.decode_reply(replies[client.name].content, client.name, instructions.weight)
                received |= set(reply.state) | {f"message:{k}" for k in message}
                if core.shared_keys:
                    core.server.validate(reply)
                self._check_message(client.name, message)
            except UpdateError as exc:
                dropped[client.name] = str(exc)
                continue
            accepted.append((reply, message, result))
        for client, reason in dropped.items():
            log(WARNING, "fednorm: round %s: client %r left out of the round: %s", r + 1, client, reason)
        if dropped and accepted:
            total = sum(reply.weight for reply, _, _ in accepted)
            accepted = [(replace(reply, weight=reply.weight / total), message, result)
                        for reply, message, result in accepted]
        kept = "updated"
        if not accepted:
            log(WARNING, "fednorm: round %s: no client reply remains; the global model stays as it was", r + 1)
            kept = "unchanged (no reply)"
        else:
            try:
                # (the FBN clients unbiased with the n of the round's plan, also those left out now)
                core.aggregate([reply for reply, _, _ in accepted], [msg for _, msg, _ in accepted],
                               participants=len(plan))
            except UpdateError as exc:
                log(WARNING, "fednorm: round %s: the server update failed (%s); the global model stays as it was",
                    r + 1, exc)
                kept = f"unchanged ({exc})"
        used = [reply.client for reply, _, _ in accepted] if kept == "updated" else []
        self._count_client_state(set(replies), used, r)
        core.round += 1
        log(INFO, "fednorm: %s seed %s round %s/%s: %s of %s sampled clients used", self.label, self.seed,
            core.round, core.federation.rounds, len(used), len(participants))
        self._record({"round": core.round, "kind": "train", "sampled": [c.name for c in participants],
                      "used": used, "clients_used": len(used), "dropped": dropped, "global_model": kept,
                      "sent_keys": sorted(core.shared_keys), "received_keys": sorted(received)})
        return {reply.client: result for reply, _, result in accepted}

    def _count_client_state(self, trained: set[str], used: list[str], r: int) -> None:
        """Of the clients that ``trained`` in round ``r`` (they answered), those whose replies were ``used`` (went
        into the global model) go on from the state they saved in it; the others (left out, late, or the round's
        update failed) go on from their state before it, the snapshot the server names (on a node of an earlier
        fednorm without a state-dir: from their newest), as if they had not trained (which keeps SCAFFOLD's server
        control variate the mean of the clients'; the in-process engine uses every reply). Called after the divergence check: a diverged round is not counted,
        and `record` evaluates the cell as of round r."""
        if not self.keeps_client_state:
            return
        entries = self.roster.entries.values()
        persistent = {e.name for e in entries if e.persistent}
        in_context = {e.name for e in entries if not e.persistent and e.context_snapshots}
        for name in used:
            if name in persistent or name in in_context:
                self.clients_with_state[name] = r + 1
                (self.clients_with_state_in_context.add if name in in_context
                 else self.clients_with_state_in_context.discard)(name)
            else:
                # a node of an earlier fednorm without a state-dir keeps the client's newest state in its run
                # context, whether its reply was used or not: the server names no snapshot for it
                self.clients_with_state.pop(name, None)
                self.clients_with_state_in_context.discard(name)
        # a client whose state is on disk since has its state on disk from then on; the others' is in a run context
        # (lost when their node restarts, and with the run)
        self.clients_with_volatile_state = ((self.clients_with_volatile_state - (set(used) & persistent))
                                            | (trained - persistent))

    def _check_message(self, client: str, message: dict[str, torch.Tensor]) -> None:
        """The client algorithm's message must match its server state (SCAFFOLD's control variates)."""
        state = self.core.algorithm_server_state
        amplitudes = amplitude_entries(message)
        if self.core.method.amplitude_norm and GLOBAL_AMPLITUDE not in self.core.input_state:
            # HarmoFL's first round: every client sends its image amplitude (C x H x W of its images as the model
            # sees them, so after data.center_crop: the client computes it on the cropped batches)
            images = next(c.train.x for c in self.core.clients if c.name == client)
            images = self.core.runner.standardize.center_crop(images[:1])
            amp = amplitudes.get(CLIENT_AMPLITUDE)
            if amp is None or set(amplitudes) != {CLIENT_AMPLITUDE}:
                raise UpdateError(f"client {client!r} sent amplitude entries {sorted(amplitudes)}, expected "
                                  f"[{CLIENT_AMPLITUDE!r}] in HarmoFL's first round")
            if tuple(amp.shape) != tuple(images.shape[1:]):
                raise UpdateError(f"client {client!r} sent an image amplitude of shape {tuple(amp.shape)}, expected "
                                  f"{tuple(images.shape[1:])} (its images' C x H x W, after data.center_crop)")
        elif amplitudes:
            raise UpdateError(f"client {client!r} sent amplitude entries {sorted(amplitudes)} outside HarmoFL's "
                              "first round (the global amplitude is frozen)")
        for k, v in amplitudes.items():
            if not v.is_floating_point() or not torch.isfinite(v).all():
                raise UpdateError(f"client {client!r} sent an invalid image amplitude {k!r}")
        message = without_amplitudes(message)
        if not message:
            if state and self.core.algorithm.stateful:
                raise UpdateError(f"client {client!r} sent no client-algorithm message")
            return
        if set(message) != set(state):
            raise UpdateError(f"client {client!r} sent client-algorithm entries {sorted(message)[:3]}..., expected "
                              f"{sorted(state)[:3]}...")
        for k, v in message.items():
            if v.shape != state[k].shape:
                raise UpdateError(f"client {client!r} sent {k!r} with shape {tuple(v.shape)}, expected "
                                  f"{tuple(state[k].shape)}")
            if v.dtype != state[k].dtype:
                raise UpdateError(f"client {client!r} sent {k!r} as {v.dtype}, expected {state[k].dtype}")
            if v.is_floating_point() and not torch.isfinite(v).all():
                raise UpdateError(f"client {client!r} sent non-finite values in its client-algorithm message {k!r}")

    def evaluate(self, splits: tuple[str, ...] = ("test", "val")) -> list[Evaluation]:
        """Every evaluation client's metrics, computed on its node with its own local state. A domain's
        evaluation (cross-device, label skew: the global model) takes the domain's test split on the node of its
        first client, and its validation split as in-process, the union of the domain's clients' ones: each
        client's node scores its own slice and the server combines them (:func:`combine_pieces`, exact for the
        global model)."""
        names = {c.name for c in self.core.clients}
        shared, input_state = self._global(), m.to_arrays(self.core.input_state)
        plan, record_of, val_parts = [], {}, {}
        for target in self.core.eval_clients:
            content = {m.GLOBAL: shared, m.INPUT_STATE: input_state}
            if target.name in names:
                plan.append((target.name, target.name, RecordDict({
                    m.CELL: self._cell(target.name, target.name, tuple(splits)).record(), **content})))
                record_of[target.name] = target.name
                continue
            members = [c.name for c in self.core.clients if c.domain == target.name]
            own = tuple(x for x in splits if x != "val")
            if own:
                plan.append((target.name, members[0], RecordDict({
                    m.CELL: self._cell(members[0], target.name, own).record(), **content})))
                record_of[target.name] = target.name
            if "val" in splits:
                val_parts[target.name] = []
                for member in members:
                    key = f"{member} (validation of {target.name})"
                    plan.append((key, member, RecordDict({
                        m.CELL: self._cell(member, target.name, ("val",)).record(), **content})))
                    record_of[key] = target.name
                    val_parts[target.name].append(key)
        modes = self.core.external_modes if "test" in splits and self.core.external_clients else ()
        averaged = [x for x in modes if x in CLIENT_AVERAGE_MODES]
        average = None
        # the clients' BN layers where they keep them locally (FedBN; SiloBN's statistics for bn_average); else the
        # nodes average the global model's, which the clients share
        if averaged and self.core.local_bn_keys(statistics="bn_average" in averaged):
            average = self._average_bn_layers(modes)
            if average is None:
                modes = tuple(x for x in modes if x not in averaged)
        for client in self.core.external_clients if modes else []:
            cell = replace(self._cell(client.name), external_modes=modes)
            content = RecordDict({m.CELL: cell.record(), m.GLOBAL: shared, m.INPUT_STATE: input_state})
            if average is not None:
                content[m.BN_LAYERS] = m.to_arrays(average)
            plan.append((client.name, client.name, content))
            record_of[client.name] = client.name
        replies, dropped = self._send(MessageType.EVALUATE, plan, group=f"evaluate-{self.core.round}")
        found: dict[str, list[Evaluation]] = {}
        for key, _, _ in plan:
            if key not in replies:
                continue
            try:
                found.setdefault(record_of[key], []).extend(m.decode_evaluations(replies[key].content, record_of[key]))
            except UpdateError as exc:
                dropped[key] = str(exc)
        for domain, keys in val_parts.items():  # the domain's validation pieces, combined by size
            pieces = [e for e in found.get(domain, []) if e.split == "val"]
            found[domain] = [e for e in found.get(domain, []) if e.split != "val"]
            if sum(e.num_examples for e in pieces):
                found[domain].append(combine_pieces(domain, "val", pieces))
        out: list[Evaluation] = []
        for name in dict.fromkeys(record_of.values()):  # plan order, each evaluated client once
            out += sorted(found.get(name, []), key=lambda e: self._order(e, splits))
        for client, reason in dropped.items():
            log(WARNING, "fednorm: evaluation after round %s: client %r left out: %s", self.core.round, client, reason)
        self._record({"round": self.core.round, "kind": "evaluate", "evaluated": sorted({e.client for e in out}),
                      "dropped": dropped})
        return out

    def _order(self, e: Evaluation, splits: tuple[str, ...]) -> tuple[int, int]:
        """The in-process engine's order within one client's evaluations: by split, external modes as listed."""
        mode = e.client.rsplit(":", 1)[-1] if ":" in e.client else ""
        modes = self.core.external_modes
        return (splits.index(e.split) if e.split in splits else len(splits),
                modes.index(mode) if mode in modes else -1)

    def _average_bn_layers(self, modes: tuple[str, ...]) -> dict[str, torch.Tensor] | None:
        """The average of the internal clients' BN layers for the external clients' fedbn_average (FedBN App. G:
        weight and bias) and bn_average (with the running statistics) modes, under a method that keeps some of them
        local: each node sends the BN entries its clients keep (the statistics only when bn_average is among
        ``modes``), each overlaid on the global state as the in-process engine does. Uniform over the clients
        that have trained; None (the modes are skipped, logged) when no client answered with them."""
        from ...methods.external import average_bn_layers

        core = self.core
        statistics = "bn_average" in modes
        plan = [(c.name, c.name, RecordDict({m.CELL: replace(self._cell(c.name), external_modes=modes).record()}))
                for c in core.clients]
        replies, dropped = self._send(MessageType.QUERY, plan, group=f"bn-layers-{core.round}")
        model_state = core.model.state_dict()
        keys = set(core.local_bn_keys(statistics))
        states = {}
        for client in core.clients:
            if client.name not in replies:
                continue
            try:
                state = m.from_arrays(replies[client.name].content, m.BN_LAYERS, f"client {client.name!r}")
                bad = [k for k, v in state.items() if k not in keys or v.shape != model_state[k].shape
                       or not torch.isfinite(v).all() or (k.endswith(".running_var") and (v < 0).any())]
                if bad or (state and set(state) != keys):
                    raise UpdateError(f"client {client.name!r} sent invalid BN entries {sorted(bad or state)[:3]}, "
                                      f"expected {sorted(keys)[:3]}...")
            except UpdateError as exc:
                dropped[client.name] = str(exc)
                continue
            if state:
                states[client.name] = state
        mode_names = " and ".join(x for x in modes if x in CLIENT_AVERAGE_MODES)
        for client, reason in dropped.items():
            log(WARNING, "fednorm: %s after round %s: client %r left out: %s", mode_names, core.round, client, reason)
        if not states:
            log(WARNING, "fednorm: no client sent its BN layers after round %s; external mode(s) %s skipped this "
                "evaluation", core.round, mode_names)
            return None
        return average_bn_layers(core.model, core.client_bn_states(states), statistics=statistics)

    def _record(self, record: dict) -> None:
        """One line of ``participation.jsonl`` (with the wall-clock time it was written). The first write of a
        cell drops what a stopped run recorded after the round the cell restarts from (0, or its checkpoint)."""
        if self.participation_path is not None and not self._participation_checked:
            self._participation_checked = True
            if self.participation_path.exists():
                store.truncate_metrics(self.participation_path, self.core.round - (record["kind"] == "train"))
        if self.participation_path is not None:
            store.append_metrics(self.participation_path, [{**record, "time": time.time()}])

    # -------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """The server's state (global model, server optimizer, client algorithm server state); the clients'
        local state is on their nodes and not in it."""
        return {**self.core.state_dict(), "engine": "flower", "clients_with_state": dict(self.clients_with_state),
                "clients_with_state_in_context": sorted(self.clients_with_state_in_context),
                "clients_with_volatile_state": sorted(self.clients_with_volatile_state),
                "client_state_unrecorded_at": self.client_state_unrecorded_at}

    def load_state_dict(self, state: dict) -> None:
        """Resume from the server's checkpoint. A method with client state needs it back from the nodes: every
        training client's node must keep it on disk (node config ``state-dir``, :mod:`.node_state`). A cell whose
        training is over (a stop while its plots or summary were written) needs nothing from the nodes."""
        still_trains = int(state["round"]) < self.core.federation.rounds
        if self.keeps_client_state and still_trains:
            volatile = sorted(e.name for e in self.roster.entries.values() if not e.external and not e.persistent)
            if volatile:
                raise RunError(
                    f"method {self.label!r} keeps state on each client, and the nodes holding {volatile[:5]} keep it "
                    "in Flower's run context only, which ended with the stopped run: start every SuperNode with "
                    "--node-config \"state-dir='DIR'\" (a folder on its machine) to make such runs resumable, "
                    "or delete the cell folder to rerun the cell")
        lost = sorted(state.get("clients_with_volatile_state", []))
        if lost and still_trains:  # their nodes may have a state-dir now, but what they trained before is gone
            raise RunError(
                f"method {self.label!r} keeps state on each client, and {lost[:5]} trained on nodes without a "
                "state-dir: that state ended with the stopped run, and a resume would start them afresh. Delete the "
                "cell folder to rerun the cell, with every SuperNode started with --node-config \"state-dir='DIR'\" "
                "so that the run can resume")
        self.core.load_state_dict(state)
        # checkpoints written before fednorm recorded which snapshot each client saved: nothing is checked, and a
        # node reads its newest snapshot of a client at or before the checkpoint's round until a reply of that
        # client is used
        recorded = state.get("clients_with_state")
        self.clients_with_state = {str(k): int(v) for k, v in (recorded or {}).items()}
        self.clients_with_volatile_state = set(state.get("clients_with_volatile_state", []))
        # before fednorm kept snapshots in run contexts, only snapshots on disk were recorded
        self.clients_with_state_in_context = set(state.get("clients_with_state_in_context", []))
        self.client_state_unrecorded_at = int(state.get("client_state_unrecorded_at",
                                                        -1 if recorded is not None else state["round"]))


# ------------------------------------------------------------------------------------------ the ServerApp's main
@dataclass(frozen=True)
class ServerSettings:
    """What the ServerApp needs: the experiment, where its run folder goes, and the options."""

    experiment: str  # resolved config, YAML
    out: str  # the run folder, on the machine that runs the ServerApp (the SuperLink's)
    options: FlowerOptions = field(default_factory=FlowerOptions)
    resume: bool = False  # continue the stopped run in ``out`` from its checkpoints (same experiment)

    @classmethod
    def from_run_config(cls, run_config) -> "ServerSettings":
        """From the Flower run config (``[tool.flwr.app.config]`` of the app folder, ``flwr run --run-config``)."""
        cfg = dict(run_config)
        missing = [k for k in ("experiment", "out") if not cfg.get(k)]
        if missing:
            raise RunError(f"the Flower run config lacks {missing}; write the app folder with `fednorm flower app`")
        timeout = float(cfg.get("round-timeout", 600.0))
        return cls(str(cfg["experiment"]), str(cfg["out"]), FlowerOptions(
            round_timeout=timeout if timeout > 0 else None, node_wait=float(cfg.get("node-wait", 300.0))),
            resume=bool(cfg.get("resume", False)))


def run_experiment(grid, settings: ServerSettings, progress=None) -> list[CellResult]:
    """Run every (method, seed) cell of the experiment over the grid's SuperNodes into ``settings.out``."""
    from .node import load_experiment

    config = load_experiment(settings.experiment)
    run_dir = Path(settings.out)
    if settings.resume and (run_dir / store.CONFIG_FILE).exists():
        check_engine(run_dir, "flower")  # first: an in-process run's own settings may be no Flower ones
    for method_cfg in config.methods:
        check_flower_method(method_cfg)
    d = config.diagnostics
    if d.gradient_dissimilarity or d.landscape:
        raise RunError("diagnostics.gradient_dissimilarity and diagnostics.landscape evaluate every client's data in "
                       "one process, which a Flower server does not hold: run them with the in-process engine "
                       "(`fednorm run`); diagnostics.drift works on Flower")
    if settings.resume:
        saved = load_run_config(run_dir)  # a clear error when there is no run to resume
        check_config_unchanged(run_dir, saved, engine="flower")
        if saved.model_dump(mode="json") != config.model_dump(mode="json"):
            raise RunError(f"{run_dir} holds a run of another experiment than the one to resume; resume it with the "
                           "config it was started with (`fednorm flower ... --resume` reads it from the run folder)")
    elif (run_dir / store.CONFIG_FILE).exists():
        raise RunError(f"{run_dir} already holds a run; resume it (--resume) or choose another output folder")
    log(INFO, "fednorm: %s: waiting for SuperNodes holding every client", config.name)
    roster = Roster(grid, config, settings.options)
    clients = roster.wait_for_all()

    built: list[tuple[str, int]] = []  # cells run before, one at a time (runner.execute): they are finished

    def build(cfg: ExperimentConfig, method_cfg: MethodConfig, seed: int, cell_clients: list[ClientData]):
        # run.json exists by now (written when the run folder is made) and keeps its id across resumes
        run_id = read_run_info(run_dir).get("run_id", "")
        engine = FlowerEngine(grid, roster, cfg, method_cfg, seed, cell_clients, settings.options,
                              store.cell_dir(run_dir, method_cfg.display, seed), run_id=run_id,
                              finished_cells=tuple(built))
        built.append((method_cfg.display, seed))
        return engine

    if settings.resume:
        log(INFO, "fednorm: resuming %s from its checkpoints", run_dir)
        with run_lock(run_dir):
            results = execute(run_dir, config, None, progress, clients=clients, build=build)
    else:
        results = start_run(config, run_dir, progress=progress, clients=clients, build=build, engine="flower")
    store.write_json(run_dir / store.FLOWER_INFO_FILE, {
        "engine": "flower", "flwr": _flwr_version(), "nodes": sorted(roster.known), "lost_nodes": sorted(roster.lost),
        "clients": {c.name: roster.node_of.get(c.name) for c in clients},
        "options": {"round_timeout": settings.options.round_timeout, "node_wait": settings.options.node_wait},
    })
    log(INFO, "fednorm: %s finished; results in %s", config.name, run_dir)
    return results


def _flwr_version() -> str:
    from importlib.metadata import version

    return version("flwr")
