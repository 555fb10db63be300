"""Run an experiment (methods x seeds) into a run folder, and resume one from its checkpoints.

Each (method, seed) cell writes its metrics line by line and a checkpoint after every
``checkpoint_every`` rounds. A stopped run (Ctrl-C, kill -9, a crash) resumes from the last
checkpoint and ends with exactly the numbers of an uninterrupted run, because every random stream
is derived from (seed, round, client) rather than from the order of execution. A run folder is locked while a
process runs or resumes it (:func:`run_lock`), and a new run builds every method's engine before it writes the
folder (:func:`preflight`).
"""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import math
import os
import socket
import uuid
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Collection

import torch
import yaml

from ..data.datafolder import resolve_data_dir
from ..data.domain import ClientData, input_normalization
from ..data.prepare import check_data_files
from ..data.federation import (build_clients, domain_eval_clients, is_rendered, load_domain, load_pool,
                               num_classes, parse_domain, pooled_client)
from ..data.partition import LABEL_SKEW_SCHEMES, label_skew_clients
from ..methods.aggregation import DivergenceError
from ..methods.server import Threat
from ..methods.local_update import resolve_precision
from ..methods.tasks import prepare_features
from ..engines.device import resolve_device
from ..engines.simulation import Federation, InProcessEngine, derive_seed
from . import store
from .config import LEGACY_AMPLITUDE_INIT, ExperimentConfig, MethodConfig, effective_amplitude_norm, validate

_INIT_STREAM = 3
_VAL_STREAM = 4
RUN_INFO_FILE = "run.json"
# metrics.jsonl records of the whole federation (not of a client): the gradient dissimilarity diagnostics
FEDERATION_RECORD = "federation"
DIAGNOSTICS_SPLIT = "diagnostics"
PARTITIONS_FILE = "partitions.json"

ProgressFn = Callable[[str, int, int, int, dict], None]  # (method label, seed, round, rounds, last metrics)
# how a cell gets its engine: build_engine (in this process) or another engine with the same round interface
# (round, run_round, evaluate, state_dict, load_state_dict), e.g. fednorm.engines.flower's
EngineBuilder = Callable[[ExperimentConfig, MethodConfig, int, list[ClientData]], object]


class RunError(RuntimeError):
    """A run folder cannot be created or resumed; the message says why and what to do."""


class RunBusy(RunError):
    """Another process is running the folder now (:func:`run_lock`): wait for it, nothing is to be fixed."""


class RunWarning(UserWarning):
    """Something about a run folder a user should know while it goes on (the CLI prints it as one line)."""


@dataclass
class CellResult:
    label: str
    seed: int
    summary: dict


def needs_data_folder(config: ExperimentConfig) -> bool:
    """Whether a run reads files (any domain, internal or external, that is not rendered in memory)."""
    return any(not is_rendered(d) for d in list(config.data.domains) + list(config.external.domains))


def build_federation_data(config: ExperimentConfig, data_dir: Path | None) -> list[ClientData]:
    """The federation's clients, followed by its external clients (``meta["external"]``, never trained)."""
    if data_dir is not None:
        check_data_files(list(config.data.domains) + list(config.external.domains)
                         + ([config.data.test_domain] if config.data.test_domain else []), data_dir)
    internal = _build_internal(config, data_dir)
    if not config.external.domains:
        return internal
    return internal + build_external_clients(config, data_dir)


def build_external_clients(config: ExperimentConfig, data_dir: Path | None,
                           domains: list[str] | None = None) -> list[ClientData]:
    """The external clients (``meta["external"]``) of ``domains`` (default: all of the config's); each is built
    from its own domain's file alone, so a Flower node holding one needs no other domain's data."""
    d = config.data
    domains = list(domains or config.external.domains)
    if config.external.data == "all":
        # never trained: every sample of the domain is test data, loaded once (no protocol split beside it: an
        # external Camelyon17 hospital is gigabytes); the train split is empty, as nothing trains on it
        external = []
        for domain in domains:
            whole = load_domain(domain, data_dir=data_dir, rendered_size=d.rendered_size, seed=d.split_seed).all()
            external.append(ClientData(name=domain, domain=domain, train=whole.subset(torch.zeros(0, dtype=torch.int64)),
                                       test=whole, origin=parse_domain(domain).origin,
                                       meta={"protocol": "external, every sample tested", "external": True}))
        return external
    external = build_clients(domains, data_dir=data_dir, percent=d.percent, pool_size=d.pool_size,
                             split_seed=d.split_seed, rendered_size=d.rendered_size)
    for c in external:
        c.meta["external"] = True
    return external


def split_external(clients: list[ClientData]) -> tuple[list[ClientData], list[ClientData]]:
    """(internal clients, external clients) of a federation built by :func:`build_federation_data`."""
    return ([c for c in clients if not c.meta.get("external")], [c for c in clients if c.meta.get("external")])


def clients_per_domain(config: ExperimentConfig) -> int:
    """How many clients each internal domain contributes (they come in domain order)."""
    d = config.data
    return d.num_clients if d.partition in LABEL_SKEW_SCHEMES else d.clients_per_domain


def _build_internal(config: ExperimentConfig, data_dir: Path | None) -> list[ClientData]:
    clients = _build_partition(config, data_dir)
    fraction = config.data.val_fraction
    if not fraction:
        return clients
    per = clients_per_domain(config)
    return [with_validation(c, fraction, config.data.split_seed, i % per) for i, c in enumerate(clients)]


def with_validation(client: ClientData, fraction: float, seed: int, partition: int = 0) -> ClientData:
    """``client`` with a seeded ``fraction`` of its training split held out as validation data (UniFed's
    0.7/0.1/0.2 protocol, model selection by validation accuracy). A client that has a validation split
    (FedBN's object lists, the medical sets) keeps it.

    The held-out positions depend on ``partition`` (the client's index among its domain's clients), not
    on the client's place in the federation: clients built from the same images (corrupted copies of one
    base domain: ``corrupt/fog/3/mnistm`` and ``corrupt/snow/3/mnistm`` train on the same MNIST-M digits)
    hold out the same images, so no client validates on images that another trains on. Seeding by the
    client's place (before 2026-11-23) leaked them: FedAvg on 15 corrupted MNIST-M domains validated at
    84 % where its test accuracy was 58 %."""
    if client.val is not None and len(client.val):
        return client
    n = client.num_train
    n_val = int(round(fraction * n))
    if n_val < 1 or n_val >= n:
        raise ValueError(f"data.val_fraction {fraction} leaves client {client.name!r} ({n} training samples) "
                         "without training or validation data")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(derive_seed(seed, _VAL_STREAM, partition)))
    return ClientData(client.name, client.domain, client.train.subset(order[n_val:].sort().values), client.test,
                      client.train.subset(order[:n_val].sort().values), client.origin, dict(client.meta))


def _build_partition(config: ExperimentConfig, data_dir: Path | None) -> list[ClientData]:
    d = config.data
    if d.partition in LABEL_SKEW_SCHEMES:
        clients: list[ClientData] = []
        test = None
        if d.test_domain:
            from ..data.domain import Split

            test = Split(*load_pool(d.test_domain, data_dir=data_dir, rendered_size=d.rendered_size, seed=d.split_seed))
        for domain in d.domains:
            loaded = load_domain(domain, data_dir=data_dir, rendered_size=d.rendered_size, seed=d.split_seed)
            whole = loaded.all()
            clients += label_skew_clients(domain, whole.x, whole.y, scheme=d.partition, num_clients=d.num_clients,
                                          gamma=d.gamma, alpha=d.alpha, dirichlet_form=d.dirichlet_form,
                                          pool_size=d.pool_size, seed=d.split_seed,
                                          origin="rendered" if is_rendered(domain) else "real", test=test,
                                          presplit=loaded.presplit)
        return clients
    return build_clients(
        d.domains,
        data_dir=data_dir,
        percent=d.percent,
        clients_per_domain=d.clients_per_domain,
        pool_size=d.pool_size,
        split_seed=d.split_seed,
        rendered_size=d.rendered_size,
        partition=d.partition,
        truncate_train=d.truncate_train,
        medical_options=d.medical_options or None,
        standardize_features=d.standardize_features,
    )


def build_engine(
    config: ExperimentConfig, method_cfg: MethodConfig, seed: int, clients: list[ClientData],
    device: str | None = None,
) -> InProcessEngine:
    """The engine of one cell; the model's initial weights depend on the seed only (drawn on the host, then
    moved). ``device`` overrides ``federation.device`` (the Flower server aggregates on the host)."""
    method = method_cfg.build()
    where = resolve_device(device or config.federation.device)
    # feature vectors (ABIDE): the MLP's input length comes from the data, no image layout or /255 scaling
    features = clients[0].train.x.ndim == 2
    torch.manual_seed(derive_seed(seed, _INIT_STREAM))
    model = config.model.build(norm=method.norm, num_classes=num_classes(config.data.domains),
                               image_size=config.input_size(),
                               in_features=int(clients[0].train.x.shape[1]) if features else None)
    f = config.federation
    cross_device = f.setting == "cross_device"
    federation = Federation(
        seed=seed,
        fraction=f.fraction,
        weighting=f.weighting,
        persistent_optimizer=f.persistent_optimizer,
        device=str(where),
        channels_last=False if features else f.channels_last_for(config.training.precision, where.type),
        reuse_freed_memory=f.reuse_freed_memory,
        eval_batch_size=f.eval_batch_size,
        recompute_bn_statistics=f.evaluation_bn == "recomputed",
        stateless_clients=cross_device,
        rounds=f.rounds,
        threat=threat(config, clients),
    )
    clients, external = split_external(clients)
    train_clients = [pooled_client(clients)] if method.pooled else clients
    training = config.training.build(task=config.task(), device=where.type)
    if method_cfg.lr is not None:
        training = replace(training, lr=method_cfg.lr)
    if config.diagnostics.drift:
        training = replace(training, track_drift=True)
    return InProcessEngine(
        model, train_clients, method, training, federation,
        prepare_features if features else input_normalization(config.data.input_norm, config.data.center_crop),
        eval_clients=evaluation_clients(config, clients, method_cfg),
        external_clients=external,
        external_modes=tuple(config.external.modes),
        external_bn=config.external.bn(),
    )


def threat(config: ExperimentConfig, clients: list[ClientData]) -> Threat:
    """The simulated Byzantine clients: the last ``count`` clients of the federation."""
    b = config.federation.byzantine
    if not b.count:
        return Threat()
    if b.count >= len(clients):
        raise RunError(f"federation.byzantine.count {b.count} leaves no honest client among {len(clients)}")
    return Threat(b.attack, tuple(c.name for c in clients[-b.count:]), tuple(b.targets), b.foe_eps, b.alie_z,
                  b.sign_flip_own)


def evaluation_clients(config: ExperimentConfig, clients: list[ClientData],
                       method_cfg: MethodConfig | None = None) -> list[ClientData]:
    """Who is evaluated: every client (cross-silo), or each domain once with the global model: cross-device,
    and label-skew federations of a method that keeps nothing on the clients (all hold the same model and
    share the domain's test split, so per-client numbers would repeat)."""
    if config.federation.setting == "cross_device":
        return domain_eval_clients(clients)
    if config.data.partition in LABEL_SKEW_SCHEMES and method_cfg is not None and not method_cfg.build().stateful_clients:
        return domain_eval_clients(clients)
    return clients


def set_aside_metrics_without_checkpoint(metrics_path: Path) -> Path | None:
    """A cell with metrics but no checkpoint (the checkpoint was deleted, or the folder was copied or cloned without
    its ``*.pt`` files) trains again from round 0. Its earlier metrics cannot be continued, but they are results: move
    them to ``metrics.no-checkpoint-<k>.jsonl`` beside it (never overwritten) and say so, instead of truncating them
    away. Returns the new path, or None when there was nothing to keep."""
    records = store.read_metrics(metrics_path)
    if not records:
        return None
    k = 1
    while (kept := metrics_path.with_name(f"metrics.no-checkpoint-{k}.jsonl")).exists():
        k += 1
    metrics_path.rename(kept)
    warnings.warn(f"{metrics_path.parent} has metrics up to round {max(r['round'] for r in records)} but no "
                  f"{store.CHECKPOINT_FILE}, so it trains again from round 0; its earlier metrics are kept in "
                  f"{kept.name}", RunWarning, stacklevel=3)
    return kept


def run_cell(
    config: ExperimentConfig,
    method_cfg: MethodConfig,
    seed: int,
    clients: list[ClientData],
    cell: Path,
    progress: ProgressFn | None = None,
    build: EngineBuilder | None = None,
) -> dict:
    """Train one (method, seed) cell to the end, resuming from its checkpoint if there is one.
    ``build`` makes the cell's engine (default :func:`build_engine`, in this process)."""
    cell.mkdir(parents=True, exist_ok=True)
    for leftover in cell.glob("*.tmp"):  # a write killed before its rename (the run folder is locked: none live)
        leftover.unlink(missing_ok=True)
    metrics_path, checkpoint_path = cell / store.METRICS_FILE, cell / store.CHECKPOINT_FILE
    engine = (build or build_engine)(config, method_cfg, seed, clients)
    if checkpoint_path.exists():
        state = store.load_checkpoint(checkpoint_path)
        try:
            engine.load_state_dict(state)
        except (RuntimeError, KeyError, ValueError) as exc:  # size mismatch, missing or unexpected entries
            raise RunError(f"{checkpoint_path} does not fit the model and method this run's config builds ({exc}). "
                           "The config.yaml or the code changed since the checkpoint was written: restore them, or "
                           "delete the checkpoint to restart this cell from round 0") from exc
    else:
        set_aside_metrics_without_checkpoint(metrics_path)
    backup = store.truncate_metrics(metrics_path, engine.round)
    if backup is not None:  # rare: only then is the kept copy parsed again, for the line numbers
        damaged = store.damaged_metric_lines(backup)
        warnings.warn(f"{metrics_path} had {len(damaged)} damaged line(s) (line {', '.join(map(str, damaged[:5]))}"
                      f"{', ...' if len(damaged) > 5 else ''}): their records are left out of the resumed file, the "
                      f"other records are kept; the file as it was is kept in {backup.name}", RunWarning, stacklevel=2)
    selection = ModelSelection(cell / store.SELECTED_FILE, store.read_metrics(metrics_path),
                               keep=config.federation.keep_selected_model)
    rounds, f = config.federation.rounds, config.federation
    external_names = {c.name for c in external_entries(split_external(clients)[1], config.external.modes)}
    label = method_cfg.display
    if engine.round < rounds:
        _record_cell_start(cell.parent.parent, label, seed, engine.round)
    if progress:
        progress(label, seed, engine.round, rounds, {})
    diverged: dict | None = None
    while engine.round < rounds:
        evals = None
        this_round = engine.round + 1
        try:
            train_results = engine.run_round()
            if this_round % f.eval_every == 0 or this_round == rounds:
                evals = engine.evaluate()
                check_evaluations(evals, external_names)
        except DivergenceError as err:
            if f.on_divergence != "record":
                run_dir = cell.parent.parent
                if trained_by(run_dir) == "flower":  # a Flower resume reads the config from the run folder
                    how = (f"set `federation.on_divergence: record` in {run_dir / store.CONFIG_FILE} (an edit a resume "
                           f"accepts) and resume {resume_command(run_dir)}")
                else:
                    how = f"`fednorm resume {run_dir} --on-divergence record`"
                raise DivergenceError(
                    f"{label} seed {seed} diverged in round {this_round}: {err}. The cells finished before it "
                    f"are kept. To record the divergence as this cell's outcome and go on with the next cells: "
                    f"{how}") from err
            diverged = {"round": this_round, "reason": str(err)}
            if evals is None:
                # in training: the server's model is still the last finite aggregate; clients that trained before
                # the failing one keep their (finite) new local state. Evaluated, recorded at the round that
                # diverged, marked diverged: even when its outputs are not finite (then its scores are chance-level
                # argmaxes of NaN), so that the cell has numbers and the table's footnote says what they are
                evals = engine.evaluate()
                store.append_metrics(metrics_path, [
                    {"round": this_round, "client": e.client, "split": e.split, "acc": e.accuracy, "loss": e.loss,
                     "n": e.num_examples, "metric": e.metric, "diverged": True} for e in evals])
            # in evaluation (finite weights, non-finite outputs): nothing of the round is recorded, the cell's
            # numbers are its last finite evaluation; a cell that has none keeps this round's, marked diverged
            elif not any(r["split"] == "test" for r in store.read_metrics(metrics_path)):
                store.append_metrics(metrics_path, [
                    {"round": this_round, "client": e.client, "split": e.split, "acc": e.accuracy, "loss": e.loss,
                     "n": e.num_examples, "metric": e.metric, "diverged": True} for e in evals])
            if progress:
                progress(label, seed, rounds, rounds, {"diverged": this_round})
            selection.flush()  # the cell ends here, its metrics past the checkpoint kept: so is its selection
            selection.commit()
            break
        r = engine.round
        records = [
            {"round": r, "client": name, "split": "train", "loss": res.mean_loss, "steps": res.num_steps,
             "n": res.num_examples, **({"drift": res.drift} if res.drift is not None else {})}
            for name, res in train_results.items()
        ]
        last: dict = {}
        if train_results:  # an engine that lost every client of a round (Flower) reports none
            last["train_loss"] = sum(x.mean_loss for x in train_results.values()) / len(train_results)
        if evals is not None:
            records += [  # "acc" holds the task's main score, named by "metric" (accuracy, or dice)
                {"round": r, "client": e.client, "split": e.split, "acc": e.accuracy, "loss": e.loss,
                 "n": e.num_examples, "metric": e.metric}
                for e in evals
            ]
            selection.observe(r, evals, engine)
            tests = [e.accuracy for e in evals if e.split == "test" and e.client not in external_names]
            if tests:
                last["test_acc"] = sum(tests) / len(tests)
            if config.diagnostics.gradient_dissimilarity:
                measured = engine.gradient_dissimilarity(config.diagnostics.samples)
                records.append({"round": r, "client": FEDERATION_RECORD, "split": DIAGNOSTICS_SPLIT,
                                **measured.as_record()})
        store.append_metrics(metrics_path, records)
        if r % f.checkpoint_every == 0 or r == rounds:
            selection.flush()  # first, beside selected.pt: it never holds a round past the checkpoint's
            store.save_checkpoint(checkpoint_path, engine.state_dict())
            selection.commit()
        if progress:
            progress(label, seed, r, rounds, last)
    internal, external = split_external(clients)
    reported = evaluation_clients(config, internal, method_cfg) + external_entries(external, config.external.modes)
    if config.diagnostics.landscape and diverged is None:  # before the summary: a stop here redoes only the landscape
        from ..diagnostics import landscape

        d = config.diagnostics
        result = landscape.landscape(engine, span=d.landscape_span, points=d.landscape_points, samples=d.samples,
                                     seed=seed)
        landscape.save(result, cell, title=f"{label}, seed {seed}: training loss around the global model "
                       f"(round {engine.round})")
    summary = summarize_cell(store.read_metrics(metrics_path), reported, label,
                             seed, rounds)
    if diverged is not None:
        summary["diverged"] = diverged
    if selection.has_model:
        summary["selected_model"] = {"file": store.SELECTED_FILE, "round": selection.saved_round}
    # the plots before the summary, which marks the cell finished: a failure in between leaves the cell to be
    # finished by a resume (from its last checkpoint: the plots and summary only when that is the last round; a
    # diverged cell, which stops without a checkpoint, trains again from its last one), not finished without plots
    from .plots import plot_cell

    plot_cell(store.read_metrics(metrics_path), cell)
    store.write_json(cell / store.SUMMARY_FILE, summary)
    return summary


def check_evaluations(evals, external_names) -> None:
    """Raise :class:`DivergenceError` when the global model scores a federation client with a non-finite loss:
    finite weights whose outputs overflow (a huge learning rate) give NaN logits, whose "accuracy" (argmax of
    NaN) would otherwise be recorded as a result. External clients are scored, not trained: left out."""
    bad = [e for e in evals if e.client not in external_names and not math.isfinite(e.loss)]
    if bad:
        e = bad[0]
        raise DivergenceError(f"the global model's {e.split} loss on {e.client} is {e.loss} (its outputs are not "
                              f"finite{f'; {len(bad) - 1} more client evaluations too' if len(bad) > 1 else ''})")


def external_entries(external: list[ClientData], modes) -> list[ClientData]:
    """One reported column per (external client, mode), named ``<client>:<mode>`` as the engine records it."""
    return [ClientData(name=f"{c.name}:{mode}", domain=c.domain, train=c.test.subset(torch.arange(0)), test=c.test,
                       origin=c.origin, meta={"external": True, "mode": mode})
            for c in external for mode in modes]


def mean_scores_by_round(records: list[dict], split: str, among: set[str] | None = None) -> dict[int, float]:
    """Round -> the mean ``split`` score over the clients (``among``, else all that have one) of that round."""
    by_round: dict[int, list[float]] = {}
    for r in records:
        if r["split"] == split and (among is None or r["client"] in among):
            by_round.setdefault(r["round"], []).append(r["acc"])
    return {rnd: sum(accs) / len(accs) for rnd, accs in by_round.items()}


def best_mean_round(records: list[dict], split: str, among: set[str] | None = None) -> int | None:
    """The round whose mean ``split`` score is best, the earliest on ties; None when no record has the split.
    The one rule of model selection: the summary's ``selected`` scores and ``selected.pt`` both use it."""
    means = {rnd: m for rnd, m in mean_scores_by_round(records, split, among).items() if math.isfinite(m)}
    return max(means, key=lambda rnd: (means[rnd], -rnd)) if means else None  # (a diverged round's NaN: never)


class ModelSelection:
    """UniFed's model selection kept as a model, not only as a round: the engine state of the round with the best
    mean validation score (:func:`best_mean_round`), so that what is evaluated afterwards (the external-client
    ablation) can use the selected model rather than the last one.

    The state is serialized in memory when a round beats the best so far, written to ``selected.pending.pt`` just
    before the checkpoint (:meth:`flush`) and renamed to ``selected.pt`` once the checkpoint is written
    (:meth:`commit`), so ``selected.pt`` never holds a round the checkpoint's history has not reached and a stop
    between the writes loses neither model. On resume the best round is recomputed from the metrics the
    checkpoint kept: a pending file of that round is promoted (the stop came after the checkpoint), one of a
    later round is deleted (before it); a ``selected.pt`` of another round (a run begun before selected.pt
    existed) is deleted too: the cell then has a selected model again only once a later round beats the kept
    best. With ``keep=False`` (``federation.keep_selected_model: false``) nothing is written. On Flower the
    engine state is the server's (global model, server optimizer): clients' local state stays on their nodes."""

    def __init__(self, path: Path, records: list[dict], keep: bool = True):
        self.path, self.keep = path, keep
        self.pending_path = path.with_name(path.stem + ".pending" + path.suffix)
        means = mean_scores_by_round(records, "val")
        self.best_round = best_mean_round(records, "val")
        self.best_score = means[self.best_round] if self.best_round is not None else -math.inf
        self.pending: bytes | None = None
        if self.pending_path.exists():
            if self.best_round is not None and self.read_round(self.pending_path) == self.best_round:
                os.replace(self.pending_path, path)
            else:
                self.pending_path.unlink()
        self.saved_round = self.read_round(path) if path.exists() else None
        if path.exists() and self.saved_round != self.best_round:
            path.unlink()
            self.saved_round = None

    @staticmethod
    def read_round(path: Path) -> int | None:
        """The round a ``selected.pt`` holds (None if it cannot be read: it is then replaced or deleted)."""
        try:
            return int(torch.load(path, map_location="cpu", weights_only=False, mmap=True)["round"])
        except Exception:  # noqa: BLE001 - an unreadable file is as good as none
            return None

    def observe(self, round_: int, evals, engine) -> None:
        """Keep the engine's state when this round's mean validation score beats the best so far."""
        vals = [e.accuracy for e in evals if e.split == "val"]
        if not self.keep or not vals or not sum(vals) / len(vals) > self.best_score:
            return
        self.best_round, self.best_score = round_, sum(vals) / len(vals)
        buffer = io.BytesIO()  # a copy now: the engine's tensors change in the next round
        torch.save({"round": round_, "val_mean": self.best_score, "state": engine.state_dict()}, buffer)
        self.pending = buffer.getvalue()

    def flush(self) -> None:
        """Write the selected state kept since the last checkpoint beside ``selected.pt`` (just before the
        checkpoint is written); :meth:`commit` makes it ``selected.pt`` once the checkpoint is."""
        if self.pending is not None:
            pending = self.pending
            store.atomic_write_bytes(self.pending_path, lambda fh: fh.write(pending))
            self.pending = None

    def commit(self) -> None:
        """The checkpoint now reaches the flushed round: it becomes ``selected.pt``."""
        if self.pending_path.exists():
            os.replace(self.pending_path, self.path)
            self.saved_round = self.best_round

    @property
    def has_model(self) -> bool:
        """Whether ``selected.pt`` holds the model of the selected round (after the last :meth:`commit`)."""
        return self.saved_round is not None and self.saved_round == self.best_round


def load_selected(path: Path) -> dict:
    """The engine state a ``selected.pt`` holds, for an engine's ``load_state_dict``."""
    return store.load_checkpoint(path)["state"]


def cell_engine(run_dir: Path, label: str | None, seed: int | None, data_dir: str | None, command: str):
    """An in-process engine holding one finished cell's last checkpoint, with each client's local state, for an
    offline ``command`` (``fednorm landscape``, ``fednorm bn-stats``): ``(engine, label, seed, cell folder)``,
    ``label`` and ``seed`` defaulting to the run's first. RunError for an unknown label or a cell without a
    checkpoint."""
    run_dir = Path(run_dir)
    config = load_run_config(run_dir)
    labels = [m.display for m in config.methods]
    label = label or labels[0]
    if label not in labels:
        raise RunError(f"{run_dir} has no method labelled {label!r}; it has {', '.join(labels)}")
    seed = config.seeds[0] if seed is None else seed
    cell = store.cell_dir(run_dir, label, seed)
    checkpoint = cell / store.CHECKPOINT_FILE
    if not checkpoint.exists():
        raise RunError(f"{cell} has no checkpoint: run or resume the cell first ({resume_command(run_dir)})")
    engine = build_engine(config, config.methods[labels.index(label)], seed,
                          build_federation_data(config, run_data_dir(run_dir, config, data_dir)))
    load_cell_state(engine, checkpoint, command, client_state=True)
    return engine, label, seed, cell


def load_cell_state(engine, path: Path, command: str, client_state: bool) -> None:
    """Load a cell's ``checkpoint.pt`` or ``selected.pt`` (by its name) into an in-process ``engine`` for an offline
    ``command`` (``fednorm rescore``, ``fednorm landscape``, ``fednorm external-ablation``). ``client_state``:
    whether the command evaluates with the clients' local state (each client's BN layers under FedBN / SiloBN / a
    local_bn add-on). A Flower run's files hold the server's state only, the clients' local state stays on their
    nodes: such a command refuses them rather than evaluate the clients with the global model's BN entries
    (numbers of no model)."""
    path = Path(path)
    state = load_selected(path) if path.name == store.SELECTED_FILE else store.load_checkpoint(path)
    if client_state and state.get("engine") == "flower" and state.get("local_keys"):
        run_dir, keys = path.parent.parent.parent, state["local_keys"]
        raise RunError(
            f"{path} is from a Flower run: it holds the server's state only, and the clients of "
            f"{path.parent.parent.name!r} keep their own BN state ({len(keys)} entries: {', '.join(keys[:3])}"
            f"{', ...' if len(keys) > 3 else ''}) on their nodes, which `{command}` needs to evaluate them. For "
            f"this command, run the experiment on the in-process engine: `fednorm run {run_dir / store.CONFIG_FILE} "
            "--out NEW_DIR`; the nodes' own evaluations are in the run's metrics.jsonl")
    engine.load_state_dict(state)


def scores_at_best_mean_round(per_client: list[dict], records: list[dict], split: str, prefix: str,
                             among: set[str] | None = None) -> None:
    """Record in each client's test entry ``<prefix>_acc`` and ``<prefix>_round``: its test score at the round
    whose mean ``split`` score over the clients (``among``, else all that have one) is best (earliest on ties)."""
    chosen = best_mean_round(records, split, among)
    if chosen is None:
        return
    for e in per_client:
        at = [r for r in records if r["client"] == e["name"] and r["split"] == "test" and r["round"] == chosen]
        if at and "test" in e:
            e["test"][f"{prefix}_acc"], e["test"][f"{prefix}_round"] = at[0]["acc"], chosen


def summarize_cell(records: list[dict], clients: list[ClientData], label: str, seed: int, rounds: int) -> dict:
    """Final and best test (and validation) accuracy of every client of one cell."""
    per_client = []
    for c in clients:
        mine = [r for r in records if r["client"] == c.name]
        entry: dict = {"name": c.name, "domain": c.domain, "origin": c.origin, "num_train": c.num_train}
        if c.meta.get("external"):
            entry["external"] = True
        for split in ("test", "val"):
            evals = [r for r in mine if r["split"] == split]
            if not evals:
                continue
            final = max(evals, key=lambda r: r["round"])
            best = max(evals, key=lambda r: (r["acc"], -r["round"]))
            entry[split] = {"final_acc": final["acc"], "final_loss": final["loss"], "best_acc": best["acc"],
                            "best_round": best["round"], "n": final["n"]}
        per_client.append(entry)
    # model selection (UniFed: "the model is selected based on the highest validation accuracy"): the round
    # with the best mean validation accuracy over the clients that have one; every client's test score there
    scores_at_best_mean_round(per_client, records, "val", "selected")
    # report --best: the round with the best mean test score over the internal clients, one model for every
    # client (the per-client best_acc above may come from different rounds: no model scores them all)
    scores_at_best_mean_round(per_client, records, "test", "best_mean",
                             among={e["name"] for e in per_client if not e.get("external")})
    finals = [e["test"]["final_acc"] for e in per_client if "test" in e and not e.get("external")]
    metric = next((r["metric"] for r in records if "metric" in r), "accuracy")
    return {
        "method": label,
        "seed": seed,
        "rounds": rounds,
        "metric": metric,  # what every *_acc value holds: accuracy, or Dice for segmentation
        "clients": per_client,
        "mean_final_test_acc": sum(finals) / len(finals) if finals else None,
    }


# ------------------------------------------------------------------------------------------ runs
def resolved_hardware(config: ExperimentConfig) -> dict:
    """What the config's ``auto`` settings become on this machine: device, precision and memory format (the
    latter of image models; feature-vector MLPs have none)."""
    device = resolve_device(config.federation.device)
    return {
        "device": str(device),
        "precision": resolve_precision(config.training.precision, device.type),
        "channels_last": config.federation.channels_last_for(config.training.precision, device.type),
        **({"gpu": torch.cuda.get_device_name(device)} if device.type == "cuda" else {}),
    }


# what a resume may change in config.yaml without touching training: where it runs and what a divergence does
# (`fednorm resume --device / --data-dir / --on-divergence`), where its memory comes from (reuse_freed_memory: same
# results, tests/runs/test_runner.py), and the texts that describe the preset. channels_last stays a training
# setting: it changes the float rounding of convolutions, so a curve resumed with the other layout is of neither.
_CONFIG_EDITS_ALLOWED = {"name", "description", "paper", "paper_source", "paper_variants",
                         "federation.device", "federation.on_divergence", "federation.reuse_freed_memory",
                         "data.data_dir"}


# method fields added after run.json recorded fingerprints: left out of the methods' fingerprint while unset, so
# runs begun before they existed (whose methods were fingerprinted without them) keep resuming
METHOD_FIELDS_ADDED_LATER = ("amplitude_init", "amplitude_band", "amplitude_decay")


def config_fingerprint(config: ExperimentConfig, written_without: Collection[int] = ()) -> dict[str, str]:
    """A short sha256 of every setting of ``config`` that training depends on, keyed by its dotted name
    (``training.lr``, ``methods``): recorded in run.json, so a resume tells which settings of config.yaml were
    edited since the run wrote it. ``written_without``: the indices of methods whose config.yaml entry predates
    ``amplitude_init`` (:func:`load_run_config` filled it in), fingerprinted as they were written."""
    return {name: hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()[:16]
            for name, v in _training_settings(config, written_without).items()}


def config_values(config: ExperimentConfig, width: int = 80) -> dict[str, str]:
    """The fingerprinted settings' values as short JSON text (cut at ``width``): recorded beside the fingerprint, so
    an edit refusal names what a setting was when the run started, not only that it changed."""
    out = {}
    for name, v in _training_settings(config).items():
        text = json.dumps(v, sort_keys=True)
        out[name] = text if len(text) <= width else text[:width - 3] + "..."
    return out


def _training_settings(config: ExperimentConfig, written_without: Collection[int] = ()) -> dict[str, object]:
    """Every setting training depends on, by dotted name (sections split one level, methods whole)."""
    out = {}
    dump = config.model_dump(mode="json")
    dump["methods"] = [{k: v for k, v in m.items()
                        if not (k in METHOD_FIELDS_ADDED_LATER and (v is None or i in written_without))}
                       for i, m in enumerate(dump["methods"])]
    for key, value in dump.items():
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for sub, v in items:
            name = f"{key}.{sub}" if sub is not None else key
            if name not in _CONFIG_EDITS_ALLOWED and key not in _CONFIG_EDITS_ALLOWED:
                out[name] = v
    return out


def _config_record(config: ExperimentConfig) -> dict:
    """What run.json keeps of the config its checkpoints are trained with: the fingerprint and the values."""
    return {"config_fingerprint": config_fingerprint(config), "config_values": config_values(config)}


RUN_INFO_REMEDY = ("it records the run's data folder, its sessions and the fingerprint of the config its checkpoints "
                   "were trained with: restore it (e.g. from a copy of the run folder), or delete it to resume without "
                   "checking config.yaml against the run's start")
PARTITIONS_REMEDY = ("it records what data every client holds, checked on resume: restore it (e.g. from a copy of the "
                     "run folder), or delete it to resume without that check (it is then written from the data now)")


def read_run_info(run_dir: Path) -> dict:
    """run.json of ``run_dir`` ({} when there is none); a damaged one is a CorruptFileError saying what to do."""
    path = Path(run_dir) / RUN_INFO_FILE
    if not path.exists():
        return {}
    info = store.read_json(path, RUN_INFO_REMEDY)
    if not isinstance(info, dict):
        raise store.CorruptFileError(f"{path} is damaged (not a JSON object); {RUN_INFO_REMEDY}")
    return info


def trained_by(run_dir: Path) -> str:
    """The engine (in-process or flower) that trains the run in ``run_dir``, as run.json records it. Runs begun
    before run.json named the engine: a Flower run is known by its flower.json (written when it finished), its
    participation logs (written every round) or its checkpoints (marked "engine": "flower")."""
    run_dir = Path(run_dir)
    info_path = run_dir / RUN_INFO_FILE
    try:
        engine = json.loads(info_path.read_text()).get("engine") if info_path.exists() else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):  # the files below still tell
        engine = None
    if engine is not None:
        return engine
    flower = (run_dir / store.FLOWER_INFO_FILE).exists() or any(run_dir.glob(f"*/seed*/{store.PARTICIPATION_FILE}"))
    for checkpoint in [] if flower else sorted(run_dir.glob(f"*/seed*/{store.CHECKPOINT_FILE}"))[:1]:
        try:  # memory-mapped: only the mark is read
            state = torch.load(checkpoint, map_location="cpu", weights_only=False, mmap=True)
            flower = state.get("engine") == "flower"
        except Exception:  # noqa: BLE001 - an unreadable checkpoint tells nothing; its own resume says so
            pass
    return "flower" if flower else "in-process"


def resume_command(run_dir: Path) -> str:
    """How to resume the run in ``run_dir``, for the engine that trains it."""
    if trained_by(run_dir) != "flower":
        return f"`fednorm resume {run_dir}`"
    # the runtimes keep the clients' state in different places (sim: RUN/node_state, local: its --workdir,
    # a deployment: each node's state-dir), so the one that started the run must resume it
    return (f"with the Flower runtime that started it: `fednorm flower sim --out {run_dir} --resume`, "
            f"`fednorm flower local --out {run_dir} --resume` (with the --workdir it ran with, default "
            f"{run_dir}-flower), or `fednorm flower app APP_DIR --out {run_dir} --resume` and `flwr run` "
            "(docs/flower.md, 3.9); a Flower resume cannot add rounds")


def check_engine(run_dir: Path, engine: str) -> None:
    """Refuse to resume with ``engine`` (in-process or flower) a run another engine trained: a Flower run's clients
    keep their state (FedBN's BN layers, SCAFFOLD's control variates) and data on their nodes, and its checkpoints
    hold the server's state only, so the in-process engine would go on with clients it never had; an in-process
    run's nodes would have none of its clients' state."""
    run_dir = Path(run_dir)
    engine_of_run = trained_by(run_dir)
    if engine_of_run == engine:
        return
    raise RunError(f"{run_dir} is a run of the {engine_of_run} engine, not of the {engine} one: its clients' state "
                   f"stays with the engine that trained them, so resume it there: {resume_command(run_dir)}")


def check_config_unchanged(run_dir: Path, config: ExperimentConfig, engine: str = "in-process") -> None:
    """Refuse to resume a run whose config.yaml was edited (by hand) in a setting training depends on: its
    checkpoints were trained with the config it started with, and going on with another would give results of
    neither. Only the settings both recorded and fingerprinted now are compared: a setting a later fednorm added (its
    default filled in on loading), or no longer counts as a training setting, is no edit. Runs written before the
    fingerprint existed are not checked. ``engine`` (in-process or flower) picks the commands the message gives."""
    info = read_run_info(run_dir)
    recorded = info.get("config_fingerprint")
    if not recorded:
        return
    now = config_fingerprint(config)
    # methods written before amplitude_init existed: load_run_config filled in the start they ran with
    legacy = methods_written_without_amplitude_init(run_dir)
    nows = [now, config_fingerprint(config, legacy)] if legacy else [now]
    # a write of config.yaml cut off by a kill leaves the fingerprint it replaces beside the new one (_write_config)
    accepted = [recorded, *([info["config_fingerprint_before"]] if info.get("config_fingerprint_before") else [])]
    # a recorded setting no longer fingerprinted (one a later fednorm allows to edit, federation.reuse_freed_memory,
    # or one it dropped) is no edit either: runs begun before keep resuming
    changes = [sorted(k for k in fp if k in n and fp[k] != n[k]) for fp in accepted for n in nows]
    if any(not c for c in changes):
        return
    path = Path(run_dir) / store.CONFIG_FILE
    if engine == "flower":
        restart = f"`fednorm flower sim {path} --out NEW_DIR` (or `fednorm flower app APP_DIR {path} --out NEW_DIR`)"
        flags = "a Flower resume goes on with the config the run started with"
    else:
        data_dir = info.get("data_dir") if not config.data.data_dir else None
        restart = f"`fednorm run {path} --out NEW_DIR" + (f" --data-dir {data_dir}`" if data_dir else "`")
        flags = ("a resume itself changes the rounds (--rounds), the device (--device), the data folder (--data-dir) "
                 "and on_divergence (--on-divergence)")
    was, now_values = info.get("config_values") or {}, config_values(config)
    edits = [f"{k} (was {was[k]}, now {now_values.get(k, '?')})" if k in was else k for k in changes[0]]
    raise RunError(f"{path} was edited since the run wrote it: {', '.join(edits)} differ(s) from the settings "
                   "its checkpoints were trained with, so going on would give results of neither config. Undo the "
                   f"edit to resume, or start a new run from the edited config: {restart}; {flags}")


def _write_config(run_dir: Path, config: ExperimentConfig) -> None:
    """The run's resolved config.yaml, written atomically (start, ``--rounds``, ``--on-divergence``), and its
    fingerprint in run.json (see :func:`check_config_unchanged`). In three steps, so that a kill between any two
    leaves a run.json that accepts the config.yaml on disk: the new fingerprint beside the old one, config.yaml,
    the new fingerprint alone."""
    new = config_fingerprint(config)
    old = read_run_info(run_dir).get("config_fingerprint")
    if old and old != new:
        _update_run_info(run_dir, {"config_fingerprint": new, "config_fingerprint_before": old})
    store.write_text(run_dir / store.CONFIG_FILE, yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    _update_run_info(run_dir, _config_record(config), drop=("config_fingerprint_before",))


def _update_run_info(run_dir: Path, entries: dict, drop: tuple[str, ...] = ()) -> None:
    info = read_run_info(run_dir)
    store.write_json(run_dir / RUN_INFO_FILE, {k: v for k, v in info.items() if k not in drop} | entries)


def _write_run_info(run_dir: Path, data_dir: Path | None, config: ExperimentConfig, engine: str) -> None:
    """run.json of a new run, written whole (a folder whose earlier run lost its config.yaml keeps nothing of it)."""
    store.write_json(run_dir / RUN_INFO_FILE, {
        "run_id": uuid.uuid4().hex,  # tells this run's state apart from another run's of the same config (Flower nodes)
        "engine": engine,  # which engine trains it, and so which command resumes it (check_engine)
        "data_dir": str(Path(data_dir).absolute()) if data_dir else None,  # a resume from another directory finds it
        "fednorm_version": __import__("fednorm").__version__,
        **resolved_hardware(config),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        **_config_record(config),
    })


# what sets a run's float rounding besides its config: two stretches of one cell trained under different values agree to
# float rounding, not bit for bit (MKL's and oneDNN's kernels change with the CPU's instruction set; PyTorch's CPU
# convolution gradients change in their last bits with the thread count: benchmarks/fbn.md, Dirichlet 0.1 FixBN)
ROUNDING_KEYS = ("device", "gpu", "torch", "cpu_capability", "torch_threads")


def training_environment(config: ExperimentConfig) -> dict:
    """Where this process trains: the resolved device (and GPU), the torch build, the CPU's kernel set and the
    number of threads torch computes with (``OMP_NUM_THREADS`` or ``torch.set_num_threads``)."""
    device = resolved_hardware(config)
    return {"device": device["device"], **({"gpu": device["gpu"]} if "gpu" in device else {}),
            "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch_threads": torch.get_num_threads()}


def record_session(run_dir: Path, config: ExperimentConfig, todo: list[tuple[str, int]]) -> None:
    """Append this run's or resume's entry to run.json's ``sessions``: when, on which host, and (in-process, where
    this process trains) the training environment; each cell it trains adds its starting round (:func:`run_cell`).
    Warns when cells of ``todo`` (:func:`unfinished_cells`) resume from a checkpoint in another environment than
    the one that trained before: their numbers then equal an uninterrupted run's to float rounding only."""
    info = read_run_info(run_dir)
    engine = trained_by(run_dir)
    session = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "host": socket.gethostname(), "engine": engine, "fednorm_version": __import__("fednorm").__version__}
    if engine == "in-process":  # a Flower run trains on its nodes: the server's threads and CPU say nothing
        session |= training_environment(config)
        # the environment that trained last: the last session that trained a cell; runs begun before sessions were
        # recorded have the start's torch and CPU kernels (not its threads) at run.json's top level
        earlier = next((s for s in reversed(info.get("sessions", [])) if s.get("cells")), info)
        changed = [f"{k} {earlier[k]} -> {session[k]}" for k in ROUNDING_KEYS
                   if k in earlier and earlier.get(k) != session.get(k)]
        resumed = [f"{label}/seed{seed}" for label, seed in todo
                   if (store.cell_dir(run_dir, label, seed) / store.CHECKPOINT_FILE).exists()]
        if changed and resumed:
            warnings.warn(
                f"{run_dir}: {', '.join(resumed)} go(es) on from checkpoints trained with other settings of the "
                f"machine ({'; '.join(changed)}), so from here their numbers equal an uninterrupted run's to float "
                "rounding, not bit for bit; to match, resume where and as the run trained before (threads: "
                "OMP_NUM_THREADS); run.json's sessions record each", RunWarning, stacklevel=3)
    _update_run_info(run_dir, {"sessions": [*info.get("sessions", []), session | {"cells": {}}]})


def _record_cell_start(run_dir: Path, label: str, seed: int, start_round: int) -> None:
    """The round a cell starts training from in this session (0, or its checkpoint's), in run.json's last session."""
    info = read_run_info(run_dir)
    if not info.get("sessions"):
        return
    info["sessions"][-1]["cells"][f"{label}/seed{seed}"] = start_round
    _update_run_info(run_dir, {"sessions": info["sessions"]})


def preflight(config: ExperimentConfig, clients: list[ClientData]) -> None:
    """Build every method's engine and score two samples with its model before the run folder is written, so a
    method, model or data that do not fit fail as a config error (which a resume could not get past once the
    config is frozen in the folder), not after the cells before it have trained. ``clients`` may be a Flower
    server's roster (zero samples of the clients' shapes): the in-process engine it builds is the server's."""
    from .config import ConfigError

    for method_cfg in config.methods:
        try:
            engine = build_engine(config, method_cfg, config.seeds[0], clients)
            sample = clients[0].test if len(clients[0].test) else clients[0].train
            engine.model.eval()
            with torch.no_grad():
                engine.model(engine.prepare(sample.x[:2]))
        except (ValueError, RuntimeError, TypeError) as exc:
            raise ConfigError(f"method {method_cfg.display!r} cannot run on this config: {exc}") from exc


LOCK_FILE = ".lock"


@contextmanager
def run_lock(run_dir: Path):
    """Hold ``run_dir``'s lock while a process writes its cells: a second ``run``/``resume`` of the same folder
    (another terminal, a retried job) is refused instead of interleaving checkpoints and metrics. An OS lock
    (``flock``): it ends with the process, so a killed run leaves no stale lock."""
    import fcntl

    path = Path(run_dir) / LOCK_FILE
    fh = open(path, "a+")
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "another process"
        fh.close()
        raise busy_error(run_dir, holder) from None
    except OSError as exc:  # a filesystem without locks (NFS without lockd, some FUSE mounts): run unlocked
        warnings.warn(f"{run_dir}: cannot lock the run folder ({exc}); nothing stops a second process from "
                      "resuming it at the same time", RunWarning, stacklevel=3)
    try:
        fh.seek(0)
        fh.truncate()
        fh.write(f"process {os.getpid()} on {socket.gethostname()}")
        fh.flush()
        yield
    finally:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
        except OSError:
            pass
        fh.close()


def busy_error(run_dir: Path, holder: str) -> RunBusy:
    """The refusal of a folder that ``holder`` (:func:`run_holder`) runs now."""
    return RunBusy(f"{run_dir} is being run by {holder}; wait for it to end (or stop it) before resuming this folder")


def run_holder(run_dir: Path) -> str | None:
    """Who holds ``run_dir``'s lock now (``"process <pid> on <host>"``), or None when no process runs it: what a
    report says instead of advising a resume that :func:`run_lock` would refuse. Takes and drops the lock at once;
    writes nothing."""
    import fcntl

    path = Path(run_dir) / LOCK_FILE
    if not path.is_file():
        return None
    try:
        with open(path) as fh:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return fh.read().strip() or "another process"
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
    except OSError:  # unreadable, or a filesystem without locks: nothing known
        return None
    return None


def start_run(
    config: ExperimentConfig, run_dir: Path, data_dir: str | None = None, progress: ProgressFn | None = None,
    clients: list[ClientData] | None = None, build: EngineBuilder | None = None, engine: str = "in-process",
) -> list[CellResult]:
    """Create ``run_dir`` for ``config`` and run every cell. ``clients`` and ``build`` replace the
    federation's data and the in-process engine (Flower's server passes its roster, its engine and ``engine``
    "flower", recorded in run.json so that each engine resumes only its own runs)."""
    run_dir = Path(run_dir)
    again = f"`fednorm resume {run_dir}`" if engine == "in-process" else "a Flower resume (--resume)"
    if (run_dir / store.CONFIG_FILE).exists():
        raise RunError(f"{run_dir} already holds a run; continue it with {again} or choose another --out")
    blocking = next((p for p in [run_dir, *run_dir.parents] if p.exists() and not p.is_dir()), None)
    if blocking is not None:  # before the data are built: mkdir would fail only after that
        raise RunError(f"cannot make the run folder {run_dir}: {blocking} is a file; choose another --out")
    resolved = None
    if clients is None:
        if needs_data_folder(config):
            resolved = resolve_data_dir(data_dir or config.data.data_dir)
        clients = build_federation_data(config, resolved)  # before writing anything: bad data leaves no folder
    # also over a Flower server's roster, whose samples are zeros of the clients' shapes: enough to build and run
    # every method's model
    preflight(config, clients)
    run_dir.mkdir(parents=True, exist_ok=True)
    with run_lock(run_dir):
        if (run_dir / store.CONFIG_FILE).exists():  # started by another process since the check above
            raise RunError(f"{run_dir} already holds a run; continue it with {again}")
        _write_config(run_dir, config)
        _write_run_info(run_dir, resolved, config, engine)
        return execute(run_dir, config, resolved, progress, clients=clients, build=build)


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


# the counts a partition record derives from each split's targets: samples per class (classification) or pixels per
# class (segmentation masks); the split's sha256 already covers them
COUNT_KEYS = ("labels", "pixels")


def partition_record(clients: list[ClientData]) -> list[dict]:
    """What every client holds: sizes, counts per class and a sha256 of each split (images and targets). The counts
    are samples per class ("labels") for classification, pixels per class ("pixels") for segmentation masks. A
    client whose data are elsewhere (a Flower server's roster client) carries its record in
    ``meta["partition_record"]``, computed where the data are."""
    out = []
    for c in clients:
        if "partition_record" in c.meta:
            out.append(c.meta["partition_record"])
            continue
        entry: dict = {"name": c.name, "domain": c.domain, "origin": c.origin, "external": bool(c.meta.get("external"))}
        for split in ("train", "val", "test"):
            data = getattr(c, split)
            if data is None:
                continue
            counts = "pixels" if data.y.dim() > 1 else "labels"
            entry[split] = {"n": len(data), "sha256": _digest(data.x, data.y),
                            counts: torch.bincount(data.y.reshape(-1).long().clamp(min=0)).tolist() if len(data) else []}
        out.append(entry)
    return out


def check_partitions(run_dir: Path, clients: list[ClientData]) -> None:
    """Write the run's partitions (first time), or check that the rebuilt clients hold exactly the same data
    (resume): a run continues only on the data it started with."""
    path = Path(run_dir) / PARTITIONS_FILE
    record = partition_record(clients)
    if not path.exists():
        store.write_json(path, record)
        return
    saved = store.read_json(path, PARTITIONS_REMEDY)
    if saved == record:
        return
    if len(saved) == len(record) and any("partition_record" in c.meta for c in clients):
        # a Flower run started before its nodes reported their records: the file describes the server's placeholder
        # clients (zeros), not data; the nodes' records replace those entries (a node of that fednorm reports none)
        placeholders = partition_record([replace(c, meta={k: v for k, v in c.meta.items() if k != "partition_record"})
                                         for c in clients])
        # (compared without the counts: a placeholder of a segmentation client was recorded with its first pixel's
        # class as label before fednorm recorded masks' pixels per class)
        updated = [new if without_class_counts(old) == without_class_counts(placeholder) and "partition_record" in c.meta
                   else old for old, new, placeholder, c in zip(saved, record, placeholders, clients)]
        if updated != saved and list(map(without_class_counts, updated)) == list(map(without_class_counts, record)):
            store.write_json(path, record)
            return
    if list(map(without_class_counts, saved)) == list(map(without_class_counts, record)):
        # the same data (sizes and sha256) with counts of an earlier fednorm (it recorded a segmentation mask's first
        # pixel as its label) or of a node that keeps its labels to itself: the digests decide, the file is renewed
        store.write_json(path, record)
        return
    names_saved, names_now = [c["name"] for c in saved], [c["name"] for c in record]
    if names_saved != names_now:
        raise RunError(f"{run_dir}: the federation's clients changed since the run started ({names_saved} then, "
                       f"{names_now} now); resume with the data and config the run started with")
    for a, b in zip(map(without_class_counts, saved), map(without_class_counts, record)):
        if a != b:
            split = next((s for s in ("train", "val", "test") if a.get(s) != b.get(s)), "?")
            why = ("the data folder or fednorm's data protocol changed" if a.get("origin") != "rendered" else
                   "rendered digits are drawn again on resume: with the same fednorm they are the same bytes on "
                   "every CPU, but fednorm before December 2026 drew a few pixels differently (and by CPU), and "
                   "other Pillow or matplotlib versions may draw the glyphs differently: resume with the "
                   "fednorm and packages that started the run")
            raise RunError(f"{run_dir}: client {a['name']!r} no longer holds the same {split} data as when the run "
                           f"started (its sha256 or size differs): {why}. Resume with the original data (see "
                           f"{PARTITIONS_FILE}) or start a new run")


def without_class_counts(entry: dict) -> dict:
    """A partitions.json entry without the per-class counts derived from its splits' targets."""
    return {key: {k: v for k, v in value.items() if k not in COUNT_KEYS} if key in ("train", "val", "test") else value
            for key, value in entry.items()}


def with_device(config: ExperimentConfig, device: str | None) -> ExperimentConfig:
    """``config`` training on ``device`` instead (None: unchanged); the device must exist here."""
    if device is None:
        return config
    resolve_device(device)
    return config.model_copy(update={"federation": config.federation.model_copy(update={"device": device})})


def load_run_config(run_dir: Path) -> ExperimentConfig:
    path = Path(run_dir) / store.CONFIG_FILE
    if Path(run_dir).is_file() and find_run_folder(Path(run_dir).parent) is not None:
        raise RunError(f"{run_dir} is a file of a run: give its run folder, {find_run_folder(Path(run_dir).parent)}")
    if not path.exists():
        left = [name for name in (RUN_INFO_FILE, PARTITIONS_FILE) if (Path(run_dir) / name).exists()] + \
            [str(p.relative_to(run_dir)) for p in sorted(Path(run_dir).glob(f"*/seed*/{store.METRICS_FILE}"))[:2]]
        if left:  # a run folder that lost its config: nothing can resume it, but its files are results
            raise store.CorruptFileError(
                f"{path} is missing, but {run_dir} is a run folder (it has {', '.join(left)}): the resolved config "
                f"the run trained with is needed to resume or score it; restore {store.CONFIG_FILE} (e.g. from a copy "
                "of the run folder), or start a new run in another folder")
        raise RunError(f"{run_dir} is not a run folder (no {store.CONFIG_FILE}); start one with `fednorm run`")
    try:
        saved = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise store.CorruptFileError(f"{path} is not valid YAML ({exc}); restore it from the run's start (it "
                                     "holds the resolved config) or start a new run") from exc
    # a run folder's config is a full dump: an empty one is damage, not "the default experiment"
    if not isinstance(saved, dict) or not saved:
        raise store.CorruptFileError(f"{path} is empty or not a mapping; restore it from the run's start or start "
                                     "a new run (resuming would silently train the default experiment)")
    methods = saved.get("methods")
    for i in _written_without_amplitude_init(saved):
        # no amplitude_init key: written before 2026-11-30, when AmpNorm started from the first batch whatever the
        # variant (the default is now the paper's zero start for full), so resuming or reporting it keeps that start.
        # (A key left null was written on 2026-11-30 before config.yaml recorded the resolved start: it means the
        # default, filled in by MethodConfig.)
        if "amplitude_init" not in methods[i] and effective_amplitude_norm(methods[i]) is not None:
            methods[i] = {**methods[i], "amplitude_init": LEGACY_AMPLITUDE_INIT}
    return validate(saved, source=str(path))


def _written_without_amplitude_init(saved: dict) -> list[int]:
    methods = saved.get("methods")
    if not isinstance(methods, list):
        return []
    return [i for i, m in enumerate(methods) if isinstance(m, dict) and m.get("amplitude_init") is None]


def methods_written_without_amplitude_init(run_dir: Path) -> list[int]:
    """The indices of the methods whose entry in the run folder's config.yaml has no ``amplitude_init`` or a null
    one (the run's fingerprint was computed without it; :func:`load_run_config` filled in the start it used)."""
    try:
        saved = yaml.safe_load((Path(run_dir) / store.CONFIG_FILE).read_text())
    except (OSError, yaml.YAMLError):
        return []
    return _written_without_amplitude_init(saved) if isinstance(saved, dict) else []


def find_run_folder(path: Path) -> Path | None:
    """The run folder (the one holding config.yaml) that ``path``, a run folder or a cell folder inside one,
    belongs to, or None."""
    for folder in [Path(path), *Path(path).parents][:4]:  # run / method / seed: a cell is two levels down
        if (folder / store.CONFIG_FILE).exists():
            return folder
    return None


def run_data_dir(run_dir: Path, config: ExperimentConfig, data_dir: str | None = None) -> Path | None:
    """The data folder of an existing run: ``data_dir``, else the config's, else the one the run recorded
    (None when the run needs no data folder)."""
    if not needs_data_folder(config):
        return None
    recorded = read_run_info(run_dir).get("data_dir")
    return resolve_data_dir(data_dir or config.data.data_dir or recorded)


def resume_run(run_dir: Path, data_dir: str | None = None, progress: ProgressFn | None = None,
               device: str | None = None, rounds: int | None = None,
               on_divergence: str | None = None) -> list[CellResult]:
    """Continue a stopped run from its checkpoints with the config it was started with; ``device`` moves it to
    another device (a run started on a GPU finishing on a CPU machine: numbers then agree with an uninterrupted
    run to float rounding, not bit for bit). ``rounds`` extends the run (see :func:`extend_rounds`).
    ``on_divergence`` changes what a divergence does from here on (``record``: a run stopped by a diverged cell
    records it and goes on); it changes no finished cell, and is written to config.yaml."""
    run_dir = Path(run_dir)
    load_run_config(run_dir)  # a folder without a run says so before anything is written into it
    with run_lock(run_dir):
        return _resume_locked(run_dir, data_dir, progress, device, rounds, on_divergence)


def _resume_locked(run_dir: Path, data_dir: str | None, progress: ProgressFn | None, device: str | None,
                   rounds: int | None, on_divergence: str | None) -> list[CellResult]:
    config = load_run_config(run_dir)
    check_engine(run_dir, "in-process")
    check_config_unchanged(run_dir, config)
    missing = {RUN_INFO_FILE: "config.yaml cannot be checked against the config its checkpoints were trained with",
               PARTITIONS_FILE: "the data cannot be checked against the data the run started with"}
    missing = {name: what for name, what in missing.items() if not (run_dir / name).exists()}
    if missing and any(run_dir.glob(f"*/seed*/{store.CHECKPOINT_FILE}")):
        warnings.warn(f"{run_dir} has checkpoints but no {' and no '.join(missing)}: {'; '.join(missing.values())}. "
                      "The resume goes on and records them from now on (restore the originals first to have the "
                      "checks)", RunWarning, stacklevel=3)
        if RUN_INFO_FILE in missing:
            _update_run_info(run_dir, _config_record(config))
    if rounds is not None and rounds != config.federation.rounds:
        config = extend_rounds(run_dir, config, rounds)
    if on_divergence is not None and on_divergence != config.federation.on_divergence:
        config = validate(config.model_dump(mode="json") | {
            "federation": config.federation.model_dump(mode="json") | {"on_divergence": on_divergence}})
        _write_config(run_dir, config)
    config = with_device(config, device)
    return execute(run_dir, config, run_data_dir(run_dir, config, data_dir), progress)


def extend_rounds(run_dir: Path, config: ExperimentConfig, rounds: int) -> ExperimentConfig:
    """Raise a run's number of rounds, so finished cells go on from their last checkpoint: a shortened run
    grows towards the paper's protocol across sessions. Training equals a run started with ``rounds``,
    as nothing in a round depends on the total, except a switch placed at a fraction of the rounds
    (FixBN's ``freeze_bn_stats_at`` < 1): such a run is refused when the switch would move (pass the round
    index instead). The old last round keeps its evaluation (an extra point on the curve when it is not a
    multiple of eval_every). A diverged cell keeps its recorded outcome. Writes the new rounds to config.yaml and the
    extension to run.json."""
    old = config.federation.rounds
    if rounds < old:
        raise RunError(f"{run_dir} has {old} rounds; a run can be extended, not shortened (asked for {rounds}): "
                       f"start a new run with --set federation.rounds={rounds}")
    for m in config.methods:
        method = m.build()
        before, after = method.freeze_round(old), method.freeze_round(rounds)
        if before != after:
            raise RunError(
                f"method {m.display} switches at a fraction of the rounds (freeze_bn_stats_at={m.freeze_bn_stats_at}): "
                f"round {before} of {old}, round {after} of {rounds}, so an extended run would not equal a run of "
                f"{rounds} rounds; start a new run, or extend a run whose switch is a round index")
    for method_cfg in config.methods:
        for seed in config.seeds:
            cell = store.cell_dir(run_dir, method_cfg.display, seed)
            summary = cell / store.SUMMARY_FILE
            if summary.exists() and not (cell / store.CHECKPOINT_FILE).exists() \
                    and "diverged" not in store.read_json(summary, "delete it (the cell then trains again) or "
                                                          "restore it"):  # a diverged cell keeps its outcome
                raise RunError(f"{cell} finished at round {old} but its {store.CHECKPOINT_FILE} is gone, so it cannot "
                               f"go on to round {rounds}; start a new run")
    extended = config.model_copy(update={"federation": config.federation.model_copy(update={"rounds": rounds})})
    _write_config(run_dir, extended)
    info = read_run_info(run_dir)
    _update_run_info(run_dir, {"extended": [*info.get("extended", []), {"from": old, "to": rounds}]})
    return extended


def finished_summary(cell: Path, config: ExperimentConfig) -> dict | None:
    """The cell's summary if it has finished the config's rounds (a diverged cell has: its outcome is recorded),
    else None: no summary, or one of fewer rounds than the run now has (an extended run goes on)."""
    path = cell / store.SUMMARY_FILE
    try:
        summary = store.read_json(path, "") if path.exists() else None
        if summary is not None and (not isinstance(summary, dict) or "rounds" not in summary):
            raise store.CorruptFileError(f"{path} is not a cell summary")
    except store.CorruptFileError:
        # a damaged summary: the cell is not counted as finished, so the run's resume writes it again (from the
        # checkpoint at its last round, or, without one, by training the cell again, its metrics set aside)
        k = 1
        while (kept := path.with_name(f"summary.damaged-{k}.json")).exists():
            k += 1
        path.rename(kept)
        gone = "" if (cell / store.CHECKPOINT_FILE).exists() else (
            f"; its {store.CHECKPOINT_FILE} is gone too, so the cell trains again from round 0")
        warnings.warn(f"{path} was damaged (kept as {kept.name}): the resume writes the cell's summary again{gone}",
                      RunWarning, stacklevel=2)
        return None
    if summary is not None and "diverged" not in summary and summary["rounds"] < config.federation.rounds:
        return None
    return summary


def unfinished_cells(run_dir: Path, config: ExperimentConfig) -> list[tuple[str, int]]:
    """(label, seed) of the cells of ``run_dir`` that still have rounds to train (:func:`finished_summary`)."""
    return [(m.display, seed) for m in config.methods for seed in config.seeds
            if finished_summary(store.cell_dir(run_dir, m.display, seed), config) is None]


def execute(
    run_dir: Path,
    config: ExperimentConfig,
    data_dir: Path | None,
    progress: ProgressFn | None = None,
    clients: list[ClientData] | None = None,
    build: EngineBuilder | None = None,
) -> list[CellResult]:
    """Run every unfinished cell of ``run_dir``, then write the run's table and comparison plot. A run whose
    every cell finished builds no data (nothing trains): its table is written again from the summaries."""
    todo = unfinished_cells(run_dir, config)
    if clients is None and todo:
        clients = build_federation_data(config, data_dir)
    if clients is not None:
        check_partitions(run_dir, clients)
    if todo:
        record_session(run_dir, config, todo)
    results: list[CellResult] = []
    for method_cfg in config.methods:
        for seed in config.seeds:
            cell = store.cell_dir(run_dir, method_cfg.display, seed)
            summary = finished_summary(cell, config)
            if summary is not None:
                if progress:
                    progress(method_cfg.display, seed, config.federation.rounds, config.federation.rounds, {})
            else:
                summary = run_cell(config, method_cfg, seed, clients, cell, progress, build)
            results.append(CellResult(method_cfg.display, seed, summary))
    from .report import write_run_report

    write_run_report(run_dir, config, results)
    return results
