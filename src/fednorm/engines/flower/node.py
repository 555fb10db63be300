"""The client side on a Flower SuperNode: which clients a node holds, and the ClientApp's handlers.

A node learns the experiment from each message (the server sends the resolved config) and builds its
clients' data from it, on its own machine, by its node config:

| node config key           | meaning                                                                |
| ------------------------- | ---------------------------------------------------------------------- |
| ``clients``               | comma-separated client names (``fednorm flower clients CONFIG`` lists them) |
| ``client-index``          | the client's position in the federation (an int, or comma-separated ints) |
| ``partition-id``, ``num-partitions`` | set by Flower's simulation runtime: node k holds clients k, k+n, ... |
| ``data-dir``              | the node's data folder (else the config's ``data.data_dir``, FEDNORM_DATA, the user cache) |
| ``state-dir``             | where the node keeps its clients' state between rounds on disk, so that a stopped run of a method with client state (FedBN, SCAFFOLD, ...) can resume (:mod:`.node_state`) |

Where the federation's domains are independent (digits, rendered, PACS, CIFAR-10 and corrupted copies of
them: each domain's clients depend on that domain's pool alone), a node loads only its own domains.
FedBN's object benchmarks and the medical datasets cut each client to the smallest domain or site of the
federation, so there every node reads every domain's file (and keeps only its clients).

Training is :class:`fednorm.engines.client_step.ClientRunner` on the node's own engine (the in-process
engine of the cell, which gives the same model, input preparation and evaluation); what a client keeps
between rounds lives in its state-dir, else in ``Context.state`` (``node_state``), one snapshot per round.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from logging import WARNING

import torch
import yaml
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common.logger import log

from ...data.domain import ClientData
from ...data.federation import domain_eval_clients, parse_domain
from ...runs.config import ByzantineConfig, ConfigError, ExperimentConfig, MethodConfig, validate
from ...runs.runner import clients_per_domain, partition_record, with_validation, without_class_counts
from ..client_step import ClientMemory
from ..device import to_device
from . import messages as m
from .node_state import ContextStateStore, NodeStateStore, SnapshotStore

NODE_CLIENTS = "clients"
NODE_CLIENT_INDEX = "client-index"
NODE_DATA_DIR = "data-dir"
NODE_STATE_DIR = "state-dir"
NODE_SHARE_LABELS = "share-labels"
PARTITION_ID = "partition-id"
NUM_PARTITIONS = "num-partitions"


class NodeConfigError(ValueError):
    """The SuperNode's node config does not say which clients it holds, or names unknown ones."""


class ClientStateMissing(RuntimeError):
    """The server says a client saved state on disk (a method whose clients keep state, a node with a state-dir)
    after a round this node has no snapshot of: it is not the node or state-dir that ran it (another
    runtime, another state-dir, a restart without it, snapshots deleted or restored from an older backup). The
    server stops the run on this error (its name is the marker) rather than let the client start afresh."""


# ------------------------------------------------------------------------------------------ the experiment
@functools.lru_cache(maxsize=4)
def load_experiment(text: str) -> ExperimentConfig:
    try:
        return validate(yaml.safe_load(text) or {}, source="the experiment sent by the server")
    except ConfigError as exc:
        if not exc.unknown_keys:
            raise
        # the experiment holds every setting of the fednorm that wrote it, so a setting a later fednorm added reaches
        # an older node (or ServerApp) as an unknown key; said on the message's last line, the one the server's log
        # shows of a node's error (server._error_text)
        raise ConfigError(f"{exc}; {', '.join(exc.unknown_keys)}: not a setting of this fednorm. Was the experiment "
                          "written by a newer fednorm? Install the same fednorm version on the SuperLink's machine "
                          "and every SuperNode's", unknown_keys=exc.unknown_keys) from exc


def experiment_text(config: ExperimentConfig) -> str:
    """The resolved config as the YAML every message carries."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def check_flower_method(method_cfg: MethodConfig) -> None:
    """Refuse methods that are not federated: the centralized references train one model on pooled data."""
    method = method_cfg.build()
    if method.pooled or method.union_batches:
        raise ValueError(
            f"method {method_cfg.display!r} trains one centralized model on the clients' pooled data; it is a "
            "reference that needs every client's data in one place: run it in-process with `fednorm run`")


# ------------------------------------------------------------------------------------------ federation layout
def _root(name: str):
    spec = parse_domain(name)
    while spec.base is not None:
        spec = spec.base
    return spec


def independent_domains(config: ExperimentConfig) -> bool:
    """True when each domain's clients depend on that domain's data alone (no object or medical protocol)."""
    return all(not _root(d).official_split and not _root(d).medical
               for d in [*config.data.domains, *config.external.domains])


def federation_size(config: ExperimentConfig, data_dir: str | None = None) -> int:
    """The number of clients (internal and external) of the federation; counted without data where the
    domains are independent, else by building the federation from ``data_dir``."""
    if independent_domains(config):
        return len(config.data.domains) * clients_per_domain(config) + len(config.external.domains)
    return len(_federation(experiment_text(config), data_dir))


def _folder(config: ExperimentConfig, data_dir: str | None):
    from ...data.datafolder import resolve_data_dir

    return resolve_data_dir(data_dir or config.data.data_dir)


@functools.lru_cache(maxsize=2)
def _federation(experiment: str, data_dir: str | None) -> tuple[ClientData, ...]:
    """Every client of the federation, in order (joint protocols)."""
    from ...runs.runner import build_federation_data

    config = load_experiment(experiment)
    return tuple(build_federation_data(config, _folder(config, data_dir)))


@functools.lru_cache(maxsize=8)
def _one_domain(experiment: str, domain: str, external: bool, data_dir: str | None) -> tuple[ClientData, ...]:
    """The clients of one independent domain, built exactly as in the whole federation (validation splits
    are drawn afterwards with the clients' federation positions). Cached per process: Ray actors serve
    many rounds."""
    from ...runs.runner import build_external_clients, build_federation_data

    config = load_experiment(experiment)
    if external:  # from its own domain's file only
        return tuple(build_external_clients(config, _folder(config, data_dir), [domain]))
    data = {"domains": [domain], "val_fraction": 0.0}
    only = config.model_copy(update={"data": config.data.model_copy(update=data),
                                     "external": config.external.model_copy(update={"domains": []})})
    return tuple(build_federation_data(only, _folder(config, data_dir)))


def _client_at(config: ExperimentConfig, index: int, data_dir: str | None) -> ClientData:
    """The client at ``index`` of the federation, building as little data as the layout allows."""
    text = experiment_text(config)
    if not independent_domains(config):
        return _federation(text, data_dir)[index]
    per, internal = clients_per_domain(config), len(config.data.domains) * clients_per_domain(config)
    if index >= internal:
        return _one_domain(text, config.external.domains[index - internal], True, data_dir)[0]
    clients = _one_domain(text, config.data.domains[index // per], False, data_dir)
    if len(clients) != per:
        raise NodeConfigError(f"domain {config.data.domains[index // per]!r} gave {len(clients)} clients, "
                              f"expected {per}")
    client = clients[index % per]
    if config.data.val_fraction:
        client = with_validation(client, config.data.val_fraction, config.data.split_seed, index % per)
    return client


@dataclass(frozen=True)
class NodeSpec:
    """Which clients a node holds, from its node config."""

    names: tuple[str, ...] = ()
    indexes: tuple[int, ...] = ()
    partition: tuple[int, int] | None = None  # (partition-id, num-partitions)
    data_dir: str | None = None
    state_dir: str | None = None  # the clients' memories on disk (resumable runs), else Context.state only
    share_labels: bool = True  # the roster's partition records include counts per class (else sizes and sha256)

    @classmethod
    def from_node_config(cls, node_config, data_dir: str | None = None, state_dir: str | None = None) -> "NodeSpec":
        cfg = dict(node_config)
        names = tuple(s.strip() for s in str(cfg.get(NODE_CLIENTS, "")).split(",") if s.strip())
        raw = cfg.get(NODE_CLIENT_INDEX, "")
        try:
            indexes = tuple(int(s) for s in str(raw).split(",") if str(s).strip())
        except ValueError:
            raise NodeConfigError(f"node config {NODE_CLIENT_INDEX}={raw!r} must be an integer or comma-separated "
                                  "integers") from None
        partition = None
        if not names and not indexes and PARTITION_ID in cfg and NUM_PARTITIONS in cfg:
            partition = (int(cfg[PARTITION_ID]), int(cfg[NUM_PARTITIONS]))
        if not names and not indexes and partition is None:
            raise NodeConfigError(
                "this SuperNode does not say which clients it holds: start it with --node-config "
                "\"clients='NAME'\" or \"client-index=K\" (`fednorm flower clients CONFIG` lists them)")
        folder = cfg.get(NODE_DATA_DIR) or data_dir
        state = cfg.get(NODE_STATE_DIR) or state_dir
        share = cfg.get(NODE_SHARE_LABELS, True)
        if isinstance(share, str):
            if share.strip().lower() not in ("true", "false"):
                raise NodeConfigError(f"node config {NODE_SHARE_LABELS}={share!r} must be true or false")
            share = share.strip().lower() == "true"
        return cls(names, indexes, partition, str(folder) if folder else None, str(state) if state else None,
                   bool(share))

    def clients(self, config: ExperimentConfig) -> dict[int, ClientData]:
        """The node's clients with their data, by federation position."""
        total = federation_size(config, self.data_dir)
        if self.partition is not None:
            pid, n = self.partition
            return {i: _client_at(config, i, self.data_dir) for i in range(pid, total, n)}
        out = {}
        for index in self.indexes:
            if not 0 <= index < total:
                raise NodeConfigError(f"client-index {index} is outside the federation's {total} clients")
            out[index] = _client_at(config, index, self.data_dir)
        for name in self.names:
            out.update(self._by_name(config, name, total))
        return dict(sorted(out.items()))

    def _by_name(self, config: ExperimentConfig, name: str, total: int) -> dict[int, ClientData]:
        if not independent_domains(config):
            found = {i: c for i, c in enumerate(_federation(experiment_text(config), self.data_dir)) if c.name == name}
        else:
            domains = [*config.data.domains, *config.external.domains]
            owners = [d for d in domains if name == d or name.startswith(d + "-")]
            per, internal = clients_per_domain(config), len(config.data.domains) * clients_per_domain(config)
            starts = {d: (i * per if i < len(config.data.domains) else internal + i - len(config.data.domains),
                          per if i < len(config.data.domains) else 1) for i, d in enumerate(domains)}
            found = {}
            for d in owners:
                start, count = starts[d]
                found.update({i: c for i in range(start, start + count)
                              if (c := _client_at(config, i, self.data_dir)).name == name})
        if not found:
            raise NodeConfigError(f"the federation has no client {name!r} (`fednorm flower clients CONFIG` lists them)")
        return found


# ------------------------------------------------------------------------------------------ the node's engine
_ENGINES: dict[tuple, tuple] = {}


def node_engine(experiment: str, method: str, seed: int, client: ClientData):
    """The in-process engine of one cell on this node, and its initial state (where local entries start).

    It gives the same model initialization, input preparation, client runner and evaluation as the in-process
    run; any of the node's clients can be handed to it. Byzantine attacks are simulated by the server, so
    the node's copy has none. Kept per process for the last two cells (Ray actors serve many rounds; a
    deployment SuperNode starts a process per message)."""
    from ...runs.runner import build_engine

    key = (experiment, method, seed)
    if key not in _ENGINES:
        config = load_experiment(experiment)
        config = config.model_copy(update={"federation": config.federation.model_copy(
            update={"byzantine": ByzantineConfig()})})
        matches = [mc for mc in config.methods if mc.display == method]
        if not matches:
            raise ValueError(f"the experiment has no method labelled {method!r}")
        check_flower_method(matches[0])
        internal = ClientData(client.name, client.domain, client.train, client.test, client.val, client.origin)
        engine = build_engine(config, matches[0], seed, [internal])
        while len(_ENGINES) >= 2:
            _ENGINES.pop(next(iter(_ENGINES)))
        _ENGINES[key] = (engine, {k: v.detach().clone() for k, v in engine.global_state.items()})
    return _ENGINES[key]


def _shape(t: torch.Tensor) -> str:
    return ",".join(str(s) for s in t.shape[1:])


class NodeClients:
    """The handlers of the fednorm ClientApp on one node; ``data_dir`` is the default data folder and
    ``state_dir`` the default folder of the clients' state on disk (node config keys override both)."""

    def __init__(self, data_dir: str | None = None, state_dir: str | None = None) -> None:
        self.data_dir, self.state_dir = data_dir, state_dir

    def _spec(self, context: Context) -> NodeSpec:
        return NodeSpec.from_node_config(context.node_config, self.data_dir, self.state_dir)

    def _client(self, context: Context, cell: m.CellRequest):
        """(engine, initial state, client data, node spec) for the client ``cell`` names, which this node must
        hold."""
        config = load_experiment(cell.experiment)
        spec = self._spec(context)
        mine = {c.name: c for c in spec.clients(config).values()}
        if cell.client not in mine:
            raise NodeConfigError(f"this node holds {sorted(mine)}, not {cell.client!r}")
        client = mine[cell.client]
        if not spec.state_dir:
            contexts = ContextStateStore(context.state)
            for method, seed in cell.finished_cells:
                contexts.forget(m.cell_prefix(cell.run_id, method, seed))
        engine, initial = node_engine(cell.experiment, cell.method, cell.seed, client)
        return engine, initial, client, spec

    @staticmethod
    def _store(context: Context, spec: NodeSpec) -> SnapshotStore:
        """Where the node keeps its clients' state: its state-dir (it survives the run), else its run context."""
        return NodeStateStore(spec.state_dir) if spec.state_dir else ContextStateStore(context.state)

    @classmethod
    def _load_memory(cls, context: Context, spec: NodeSpec, cell: m.CellRequest, client: str, at_round: int
                     ) -> tuple[ClientMemory, int | None]:
        """The client's memory as of ``at_round`` completed rounds, and the round of the snapshot it is (-1: none;
        None: the newest, as an older server wants it): the snapshot the server names (``cell.state_round``).
        Raises :class:`ClientStateMissing` when the node lacks a snapshot saved on disk; a node without a state-dir
        that lacks one saved in its run context was restarted, and its client starts from the global model
        (docs/flower.md, "Bad replies and lost nodes")."""
        prefix = m.memory_prefix(cell, client)
        store, where = cls._store(context, spec), f"state-dir {spec.state_dir}" if spec.state_dir else "its run context"
        if not spec.state_dir and not cell.state_in_context:  # a snapshot on disk, or a server of an earlier fednorm
            if cell.state_round >= 0 or cell.state_at_least >= 0:
                # a snapshot saved in a state-dir, which this node cannot hold: whatever its run context keeps of
                # the client is older (it held the client before) or of no use
                raise ClientStateMissing(_missing(cell, client, "this node has no state-dir"))
            return store.load(prefix, max(at_round, 0)), None
        if cell.state_round == m.UNKNOWN_CLIENT_STATE:  # an older server or checkpoint: the newest snapshot
            if at_round < 0:
                return ClientMemory(), None
            newest = store.newest(prefix, at_round if cell.state_at_most < 0 else min(at_round, cell.state_at_most))
            if cell.state_at_least >= 0 and (newest is None or newest < cell.state_at_least):
                raise ClientStateMissing(_missing(cell, client, f"its newest in {where} is of round {newest}"
                                                  if newest is not None else f"it has none in {where}"))
            return (ClientMemory(), -1) if newest is None else (store.read(prefix, newest), newest)
        if cell.state_round == m.NO_CLIENT_STATE:  # any snapshot is of rounds a resumed run redoes, or unused
            return ClientMemory(), -1
        held = store.rounds(prefix)
        if cell.state_round in held:
            return store.read(prefix, cell.state_round), cell.state_round
        if not spec.state_dir:
            # named in a run context (state_in_context): a run context loses a snapshot only with the node
            # (restarted; what the client trained since was not used). The server names the lost snapshot until a
            # reply of the client is used: warn once for it
            warned = f"{prefix}/lost"
            if warned not in context.state or context.state.config_records[warned]["round"] != cell.state_round:
                log(WARNING, "fednorm: this node does not hold the state client %r saved in its run context after "
                    "round %s: restarted without a state-dir, it starts the client from the global model", client,
                    cell.state_round)
                context.state[warned] = ConfigRecord({"round": int(cell.state_round)})
            return ClientMemory(), -1
        raise ClientStateMissing(_missing(cell, client, f"{where} holds no snapshot of that round (its snapshots of "
                                          f"the client: rounds {held})" if held else f"it has none in {where}"))

    def query(self, message: Message, context: Context) -> Message:
        """A query message: the roster (no method named), or a client's BN layers."""
        cell = m.CellRequest.decode(message.content)
        return self.bn_layers(message, context) if cell.method else self.roster(message, context)

    def bn_layers(self, message: Message, context: Context) -> Message:
        """The BN entries the client keeps locally, as of the message's round (empty before it has trained): its
        BN weight and bias, and its running statistics too when the cell's external modes include bn_average.
        The server averages them for the external clients' fedbn_average (FedBN App. G) and bn_average modes.
        Everything else the client keeps stays on the node (its statistics too, unless bn_average is asked)."""
        cell = m.CellRequest.decode(message.content)
        engine, _, client, spec = self._client(context, cell)
        memory, _ = self._load_memory(context, spec, cell, client.name, cell.round)
        keys = engine.local_bn_keys(statistics="bn_average" in cell.external_modes)
        layers = {k: memory.local_state[k] for k in keys if k in memory.local_state}
        return Message(RecordDict({m.CELL: cell.record(), m.BN_LAYERS: m.to_arrays(layers)}), reply_to=message)

    def roster(self, message: Message, context: Context) -> Message:
        """Answer the server's roster query: the node's clients, split sizes, sample shapes and partition records
        (sizes, counts per class, sha256 of each split: what partitions.json keeps; never data)."""
        cell = m.CellRequest.decode(message.content)
        config = load_experiment(cell.experiment)
        spec = self._spec(context)
        total = federation_size(config, spec.data_dir)
        entries = [m.RosterEntry(i, total, c.name, c.domain, c.origin, bool(c.meta.get("external")), c.num_train,
                                 len(c.test), -1 if c.val is None else len(c.val), _shape(c.train.x),
                                 str(c.train.x.dtype).removeprefix("torch."), _shape(c.train.y),
                                 str(c.train.y.dtype).removeprefix("torch."), bool(spec.state_dir),
                                 json.dumps(_partition_record(c, spec.share_labels)), context_snapshots=True)
                   for i, c in spec.clients(config).items()]
        return Message(RecordDict({m.ROSTER: m.roster_record(entries)}), reply_to=message)

    def train(self, message: Message, context: Context) -> Message:
        """One round of the method's client update for the client the message names."""
        cell = m.CellRequest.decode(message.content)
        engine, initial, client, spec = self._client(context, cell)
        shared = m.from_arrays(message.content, m.GLOBAL)
        _check_global(shared, engine.shared_keys)
        instructions = m.decode_instructions(message.content)
        server_state = m.from_arrays(message.content, m.SERVER_STATE)
        input_state = m.from_arrays(message.content, m.INPUT_STATE)
        prefix = m.memory_prefix(cell, client.name)
        memory, started_from = self._load_memory(context, spec, cell, client.name, instructions.round)
        reply, algorithm_message, result = engine.runner.run(client, instructions, {**initial, **shared},
                                                             server_state, memory, input_state=input_state)
        kept = type(memory)(memory.local_state if engine.local_keys else {},
                            memory.optimizer_state if engine.federation.persistent_optimizer else None,
                            memory.algorithm_state if engine.algorithm.stateful else {})
        if kept.local_state or kept.optimizer_state is not None or kept.algorithm_state:
            # a run context does not outlive the run: no checkpoint can name its older snapshots
            every = load_experiment(cell.experiment).federation.checkpoint_every if spec.state_dir else 1
            self._store(context, spec).save(prefix, instructions.round + 1, kept, every, started_from)
        return Message(m.encode_reply(reply, algorithm_message, result), reply_to=message)

    def evaluate(self, message: Message, context: Context) -> Message:
        """Evaluate the client's model (global entries plus its own local state); for a domain evaluation
        (``record_as`` a domain) the global model on this client's splits as the domain's (the server asks the
        domain's first client for the test split and every client for its validation slice); for an external
        client the global model under each of the cell's external modes."""
        cell = m.CellRequest.decode(message.content)
        engine, initial, client, spec = self._client(context, cell)
        shared = m.from_arrays(message.content, m.GLOBAL)
        _check_global(shared, engine.shared_keys)
        engine.global_state = to_device({**initial, **shared}, engine.device)  # arrays arrive on the host
        engine.input_state = m.from_arrays(message.content, m.INPUT_STATE)
        engine.round = max(cell.round, 0)  # rounds completed, as the in-process engine's (augment_validation's draws)
        engine.local_states, engine.external_clients, engine.external_bn_average = {}, [], None
        if cell.external_modes:
            engine.external_clients, engine.external_modes = [client], cell.external_modes
            if m.BN_LAYERS in message.content.array_records:  # the server's average of the clients' BN layers
                engine.external_bn_average = {**engine.global_state, **m.from_arrays(message.content, m.BN_LAYERS)}
            evals = engine.evaluate_external()
        else:
            if cell.record_as == client.name:
                target = client
                memory, _ = self._load_memory(context, spec, cell, client.name, cell.round)
                if memory.local_state:
                    engine.local_states = {client.name: memory.local_state}
            else:
                target = domain_eval_clients([client])[0]
                if target.name != cell.record_as:
                    raise NodeConfigError(f"client {client.name!r} cannot stand for {cell.record_as!r}")
            engine.eval_clients = [target]
            evals = engine.evaluate(cell.splits or ("test", "val"))
        return Message(m.encode_evaluations(evals), reply_to=message)


def _partition_record(client: ClientData, share_labels: bool) -> dict:
    """The client's entry of partitions.json, without its counts per class (samples, or a mask's pixels) when the
    node keeps them to itself (node config share-labels=false: the server then learns sizes and sha256 only; a
    resume still checks them)."""
    record = partition_record([client])[0]
    return record if share_labels else without_class_counts(record)


def _missing(cell: m.CellRequest, client: str, found: str) -> str:
    return (f"client {client!r} of {cell.method} seed {cell.seed} saved its state (kept between rounds) on its node "
            f"after round {max(cell.state_round, cell.state_at_least)}, but {found}")


def _check_global(shared: dict[str, torch.Tensor], shared_keys: list[str]) -> None:
    """The server must send exactly the shared entries: a local entry from it would overwrite the client's own."""
    if set(shared) != set(shared_keys):
        extra, missing = sorted(set(shared) - set(shared_keys)), sorted(set(shared_keys) - set(shared))
        raise ValueError(f"the server sent the wrong global entries: unexpected {extra[:5]}, missing {missing[:5]}; "
                         "is it running the same experiment and fednorm version?")
