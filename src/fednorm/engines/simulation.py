"""In-process federation: every client trains in turn on one shared working model.

Memory grows with the model plus the per-client local state, not with clients x model: the server
holds one global state; a client holds only the entries its method's policy keeps local (a few
kilobytes of BN state for FedBN), plus its optimizer state when the optimizer is persistent.

Random streams (mini-batch order, dropout, client sampling) are derived from (seed, round, client),
never drawn in execution order, so results do not depend on the order clients run in, nor on a
resume from a checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Iterable

import numpy as np
import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch import nn

from ..data.domain import ClientData, Split
from ..diagnostics.gradients import Dissimilarity, dissimilarity, full_gradient
from ..methods.aggregation import client_weights
from ..methods.amplitude import update_input_state, without_amplitudes
from ..methods.local_update import (LocalResult, LocalTraining, batch_schedule, has_batchnorm, resolve_channels_last,
                                   train_locally)
from ..methods.policy import keeps_bn_state, local_state_keys
from ..methods.presets import Method
from ..methods.external import EXTERNAL_MODES, ExternalBN, bn_state_keys, evaluate_external, fold_bn_statistics_
from .allocator import reuse_freed_memory
from .device import to_device
from .client_step import ClientMemory, ClientRunner, RoundInstructions
from .seeds import augment_generator, client_augment_generator, derive_seed, validation_augment_generator
from ..methods.augment import BatchAugment
from ..methods.server import ClientReply, LocalSchedule, ServerUpdate, Threat
from ..methods.tasks import Scorer
from ..models.fbn import federated_bn_layers

_SAMPLING_STREAM = 1
_CLIENT_STREAM = 2
_DIAGNOSTIC_STREAM = 5
# 6: training-time augmentation (seeds.AUGMENT_STREAM, derived from the client's round seed)


@dataclass(frozen=True)
class Federation:
    """How the engine runs rounds, independent of the method."""

    seed: int = 0
    fraction: float = 1.0  # share of clients sampled each round (seeded per round)
    weighting: str = "samples"  # aggregation weights: "samples" (n_k / n) or "uniform" (1 / K)
    persistent_optimizer: bool = False  # keep each client's optimizer state (momentum) across rounds
    eval_batch_size: int = 500
    # where the model trains: "cpu", "cuda", "cuda:N" (:mod:`.device`; the runner resolves ``auto``)
    device: str = "cpu"
    # NHWC activations and weights; None: on only where training runs in bf16 (resolve_channels_last)
    channels_last: bool | None = None
    # keep freed blocks in the process (glibc mallopt, process-wide): no fresh pages per step, :mod:`.allocator`
    reuse_freed_memory: bool = True
    # cross-device FL: clients are anonymous devices that keep nothing between rounds
    stateless_clients: bool = False
    rounds: int | None = None  # total rounds of the run, for methods with a phase switch (FixBN)
    threat: Threat = Threat()  # simulated Byzantine clients (robust FBN experiments); honest by default
    # before each evaluation, recompute each client's own BN running statistics over its training split at its
    # current weights (InProcessEngine.recompute_bn_statistics); off: the statistics as training left them
    recompute_bn_statistics: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")
        if self.stateless_clients and self.persistent_optimizer:
            raise ValueError("persistent_optimizer keeps optimizer state on each client; cross-device clients are stateless")


@dataclass(frozen=True)
class Evaluation:
    client: str
    split: str
    accuracy: float
    loss: float
    num_examples: int
    metric: str = "accuracy"  # what ``accuracy`` holds: the task's main score ("accuracy" or "dice")
    # balanced accuracy only: (hits, support) per class, so that pieces of one split combine exactly (Flower)
    class_counts: tuple[tuple[int, ...], tuple[int, ...]] | None = None


def _without(data: Split, index: torch.Tensor) -> Split:
    """``data`` minus the samples at ``index`` (those a client adapted on before being tested)."""
    keep = torch.ones(len(data), dtype=torch.bool)
    keep[index] = False
    return data.subset(keep.nonzero().flatten())


class InProcessEngine:
    """Runs a :class:`Method` over clients, one round at a time, in this process."""

    def __init__(
        self,
        model: nn.Module,
        clients: list[ClientData],
        method: Method,
        training: LocalTraining,
        federation: Federation,
        prepare: Callable[[torch.Tensor], torch.Tensor],
        eval_clients: list[ClientData] | None = None,
        external_clients: list[ClientData] | None = None,
        external_modes: tuple[str, ...] = ("global", "test_time_bn", "fedbn_average"),
        external_bn: ExternalBN | None = None,
    ) -> None:
        """``external_clients`` never train; each is evaluated after every round under each of
        ``external_modes`` (:mod:`fednorm.methods.external`), reported as client ``<name>:<mode>``."""
        if not clients:
            raise ValueError("a federation needs at least one client")
        names = [c.name for c in clients]
        if len(set(names)) != len(names):
            raise ValueError(f"client names must be unique, got {names}")
        reuse_freed_memory(federation.reuse_freed_memory)
        federation = replace(federation, channels_last=resolve_channels_last(federation.channels_last,
                                                                             training.precision))
        self.device = torch.device(federation.device)
        model = model.to(self.device)
        self.model = model.to(memory_format=torch.channels_last) if federation.channels_last else model
        self.clients = clients
        self.eval_clients = eval_clients if eval_clients is not None else clients
        self.external_clients = external_clients or []
        self.external_modes = tuple(external_modes)
        self.external_bn = external_bn or ExternalBN()
        for mode in self.external_modes:
            if mode not in EXTERNAL_MODES:
                raise ValueError(f"unknown external evaluation mode {mode!r}; choose from {', '.join(EXTERNAL_MODES)}")
        self.method = method
        self.training = training
        self.federation = federation
        self.prepare = lambda x: self._place(prepare(x))
        self.local_keys = local_state_keys(self.model, method.policy)
        self._check_method(method, federation)
        self.freeze_round = method.freeze_round(federation.rounds) if federation.rounds else None
        if method.freeze_bn_stats_at is not None and self.freeze_round is None:
            raise ValueError("a method that freezes BN statistics (FixBN) needs Federation.rounds to place its switch")
        state = self.model.state_dict()
        self.shared_keys = [k for k in state if k not in self.local_keys]
        self._bn_statistic_keys = local_state_keys(self.model, "local_bn_stats")
        # FixBN's statistics, which the server keeps exactly as they are from the switch on (see aggregate)
        self.frozen_stat_keys = (sorted(local_state_keys(self.model, "local_bn_stats") & set(self.shared_keys))
                                 if self.freeze_round is not None else [])
        self.global_state: dict[str, torch.Tensor] = {k: v.detach().clone() for k, v in state.items()}
        self.fbn_layers = federated_bn_layers(self.model)
        self.server = ServerUpdate(
            method.server,
            {k: self.global_state[k] for k in self.shared_keys},
            param_keys={n for n, _ in self.model.named_parameters()},
            fbn_layers={prefix: layer.momentum for prefix, layer in self.fbn_layers.items()},
            schedule=LocalSchedule(training.lr, training.momentum, method.prox_mu),
            threat=federation.threat,
        )
        params = {n for n, _ in self.model.named_parameters()}
        self.shared_params = [k for k in self.shared_keys if k in params]
        self.algorithm = method.client.build()
        self.runner = ClientRunner(self.model, method, training, self.local_keys, self.shared_keys, prepare,
                                   federation.persistent_optimizer, self.algorithm, place=self._place,
                                   seed=federation.seed)
        self.input_state: dict[str, torch.Tensor] = {}  # HarmoFL's global amplitude once averaged
        # the internal clients' averaged BN layers for fedbn_average and bn_average given from outside (a Flower node
        # gets the server's average); None: averaged here from the internal clients' local states
        self.external_bn_average: dict[str, torch.Tensor] | None = None
        self.algorithm_server_state = self.algorithm.init_server_state(self.model, self.shared_params)
        self.algorithm_states: dict[str, dict[str, torch.Tensor]] = {}
        self.local_states: dict[str, dict[str, torch.Tensor]] = {}
        self.optimizer_states: dict[str, dict] = {}
        self.round = 0  # rounds completed
        self._index = {c.name: i for i, c in enumerate(clients)}

    def _check_method(self, method: Method, federation: Federation) -> None:
        has_bn = has_batchnorm(self.model)
        if keeps_bn_state(method.policy) and not has_bn:
            raise ValueError(
                f"method {method.name!r} keeps BatchNorm state local, but the model has no BatchNorm layer "
                "(its norm is not bn); use model.norm: bn or a method with policy 'shared'"
            )
        if method.freeze_bn_stats_at is not None and not has_bn:
            raise ValueError(f"method {method.name!r} freezes BatchNorm statistics, but the model has no BatchNorm")
        if method.client.name == "perfedavg" and self.training.task.kind != "classification":
            raise ValueError(f"method {method.name!r} uses Per-FedAvg, whose meta-steps and evaluation steps are "
                             "cross-entropy on class labels: it supports classification only")
        # batch-statistics BN (model.bn_mode: batch, HarmoFL's code) holds no state: nothing to keep local or freeze,
        # and the method would silently run as FedAvg
        no_state = keeps_bn_state(method.policy) and not self.local_keys
        no_stats = method.freeze_bn_stats_at is not None and not any(
            m.track_running_stats for m in self.model.modules() if isinstance(m, _BatchNorm))
        if has_bn and (no_state or no_stats):
            raise ValueError(
                f"method {method.name!r} keeps BatchNorm state local or frozen, but the model's BatchNorm layers keep "
                "none (model.bn_mode: batch): it would silently run as FedAvg; use model.bn_mode: running")
        if method.union_batches and self.training.steps is None:
            raise ValueError(
                f"method {method.name!r} steps on the merge of the clients' batches of each step, which needs a "
                "fixed number of local steps: set training.steps (1 for DSGD)")
        unknown = set(federation.threat.byzantine) - {c.name for c in self.clients}
        if unknown:
            raise ValueError(f"Byzantine clients {sorted(unknown)} are not clients of the federation")
        if federation.stateless_clients and method.stateful_clients:
            raise ValueError(
                f"method {method.name!r} keeps state on each client between rounds (policy {method.policy!r}, "
                f"client algorithm {method.client.name!r}), "
                "which cross-device clients cannot do: they are sampled anonymously and keep nothing. Use a "
                "stateless method (fedavg, fedprox, fedwon, fedavg_gn, fedavg_ln, fixbn) or a cross-silo federation"
            )

    def _place(self, x: torch.Tensor) -> torch.Tensor:
        """A prepared (float) batch on the model's device, in its memory format."""
        x = x.to(self.device, non_blocking=True)
        return x.contiguous(memory_format=torch.channels_last) if self.federation.channels_last else x

    # ---------------------------------------------------------------- rounds
    def sample_clients(self, round_index: int) -> list[ClientData]:
        """The clients taking part in ``round_index``: all, or a seeded fraction (sorted by position)."""
        n = len(self.clients)
        if self.federation.fraction >= 1:
            return list(self.clients)
        # m = max(C K, 1) (McMahan et al. 2017), C K rounded half up: Python's round() halves to even (0.5 of 5
        # clients would be 2, of 7 would be 4), and a floor would turn 0.29 x 100 = 28.999... into 28
        m = max(1, math.floor(self.federation.fraction * n + 0.5))
        rng = np.random.default_rng(derive_seed(self.federation.seed, round_index, _SAMPLING_STREAM))
        chosen = np.sort(rng.choice(n, size=m, replace=False))
        return [self.clients[i] for i in chosen]

    def load_client(self, name: str) -> None:
        """Put client ``name``'s model (global state plus its own local state) into the working model."""
        self.model.load_state_dict({**self.global_state, **self.local_states.get(name, {})})

    def _round_training(self, r: int) -> LocalTraining:
        lr = self.training.lr_at(r)
        return self.training if lr == self.training.lr else replace(self.training, lr=lr)

    def round_plan(self, r: int) -> list[tuple[ClientData, RoundInstructions]]:
        """The participants of round ``r`` and what the server tells each (the same for every engine)."""
        participants = self.sample_clients(r)
        weights = client_weights([c.num_train for c in participants], self.federation.weighting)
        lr = self.training.lr_at(r)
        prox = not (self.method.prox_schedule == "fedbn_code" and r == 0)
        freeze = self.freeze_round is not None and r >= self.freeze_round
        return [(client, RoundInstructions(
            round=r, num_participants=len(participants), lr=lr, weight=weight, freeze_bn_stats=freeze, prox=prox,
            seed=derive_seed(self.federation.seed, r, self._index[client.name], _CLIENT_STREAM)))
            for client, weight in zip(participants, weights)]

    def aggregate(self, replies: Iterable[ClientReply], messages: list[dict[str, torch.Tensor]],
                  participants: int | None = None) -> None:
        """The server side of a round, for every engine: fold the clients' replies into the global state with
        the method's server update, then update the client algorithm's server state and HarmoFL's input state
        from the clients' ``messages``. ``replies`` may be a generator (in-process: each client trains when the
        server is ready to fold its reply in, so one reply is held at a time); ``messages`` is read after it.
        ``participants``: how many clients the round sent out, when some of their replies were left out (Flower)."""
        if self.shared_keys:
            # FixBN's phase 2: every client sends back the frozen statistics unchanged, and averaging identical
            # copies can still move them by float rounding (one ulp, seen with AVX-512 kernels): keep them as frozen
            frozen = ({k: self.global_state[k].clone() for k in self.frozen_stat_keys}
                      if self.freeze_round is not None and self.round >= self.freeze_round else {})
            self.server.begin(self.global_state, lr=self.training.lr_at(self.round), participants=participants)
            for reply in replies:
                self.server.add(reply)
            self.global_state.update(self.server.finish())
            self.global_state.update(frozen)
        else:
            for _ in replies:
                pass
        algorithm_messages = [without_amplitudes(m) for m in messages]
        self.algorithm_server_state = self.algorithm.update_server_state(
            self.algorithm_server_state, algorithm_messages, len(self.clients))
        self.input_state = update_input_state(self.input_state, messages)

    def run_round(self) -> dict[str, LocalResult]:
        """One communication round: local training of the sampled clients, then the server update."""
        r = self.round
        plan = self.round_plan(r)
        if self.method.union_batches:
            return self._run_union_round(r, [client for client, _ in plan])
        results: dict[str, LocalResult] = {}
        messages: list[dict[str, torch.Tensor]] = []

        def train_each() -> Iterable[ClientReply]:
            for client, instructions in plan:
                memory = ClientMemory(self.local_states.get(client.name, {}), self.optimizer_states.get(client.name),
                                      self.algorithm_states.setdefault(client.name, {}) if self.algorithm.stateful else {})
                reply, message, result = self.runner.run(client, instructions, self.global_state,
                                                         self.algorithm_server_state, memory,
                                                         copy_reply=self.server.collecting, input_state=self.input_state)
                if self.local_keys:
                    self.local_states[client.name] = memory.local_state
                if self.federation.persistent_optimizer:
                    self.optimizer_states[client.name] = memory.optimizer_state
                messages.append(message)
                results[client.name] = result
                yield reply

        self.aggregate(train_each(), messages)
        self.round += 1
        return results

    def _client_generator(self, r: int, client: ClientData) -> torch.Generator:
        """The client's random stream of round ``r``; also seeds dropout and any sampling inside the model."""
        seed = derive_seed(self.federation.seed, r, self._index[client.name], _CLIENT_STREAM)
        torch.manual_seed(seed)
        return torch.Generator().manual_seed(seed)

    def _run_union_round(self, r: int, participants: list[ClientData]) -> dict[str, LocalResult]:
        """Centralized BN (FBN Remark 4.1): each client draws its batches as in a federated round; one model
        steps on the concatenation of the participants' s-th batches, for every local step s."""
        training = self._round_training(r)
        guard = has_batchnorm(self.model)
        schedules, offset, offsets = [], 0, []
        for client in participants:
            schedules.append(batch_schedule(client.num_train, training, self._client_generator(r, client), guard))
            offsets.append(offset)
            offset += client.num_train
        union = [torch.cat([sched[s] + off for sched, off in zip(schedules, offsets)])
                 for s in range(len(schedules[0]))]
        data = Split.concat([c.train for c in participants])
        self.load_client("__union__")
        round_seed = derive_seed(self.federation.seed, r, _CLIENT_STREAM)
        torch.manual_seed(round_seed)
        result, optimizer_state = train_locally(
            self.model, data, training, generator=torch.Generator(), prepare=self.prepare,
            optimizer_state=self.optimizer_states.get("__union__"), agc_clip=self.method.agc_clip,
            agc_exclude_head=self.method.agc_exclude_head, schedule=union,
            augment_generator=augment_generator(round_seed) if training.augment != "none" else None,
            # the union of the clients is one dataset to FLamby's per-dataset draws (its pooled Fed-ISIC2019)
            augment_client_generator=(client_augment_generator(self.federation.seed, "__union__")
                                      if training.augment != "none" else None),
        )
        if self.federation.persistent_optimizer:
            self.optimizer_states["__union__"] = optimizer_state
        self.global_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.round += 1
        return {"centralized": result}

    # ---------------------------------------------------------------- evaluation
    def evaluate_split(self, data: Split, prepare=None) -> tuple[float, float]:
        """(main score, mean loss) of the working model on ``data``, in eval mode: accuracy (or balanced accuracy)
        and the task's loss for classification, mean per-image Dice and the task's loss for segmentation
        (``training.task``)."""
        return self.score_split(data, prepare).result()

    @torch.inference_mode()
    def score_split(self, data: Split, prepare=None) -> Scorer:
        """The :class:`~fednorm.methods.tasks.Scorer` of the working model over ``data`` (see evaluate_split)."""
        prepare = prepare or self.prepare
        task = self.training.task
        self.model.eval()
        scorer = task.scorer()
        use_bf16 = self.training.precision == "bf16"
        for start in range(0, len(data), self.federation.eval_batch_size):
            x = prepare(data.x[start : start + self.federation.eval_batch_size])
            y = task.target(data.y[start : start + self.federation.eval_batch_size]).to(x.device)
            with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=use_bf16):
                logits = self.model(x).float()
            scorer.add(logits, y)
        return scorer

    def evaluate(self, splits: Iterable[str] = ("test", "val")) -> list[Evaluation]:
        """Every evaluation client's metrics with its own model (global state plus its local state)."""
        out: list[Evaluation] = []
        prepare = self.runner.evaluation_prepare(self.input_state)
        for client in self.eval_clients:
            loaded = False
            for split in splits:
                data = getattr(client, split)
                if data is None:
                    continue
                # an algorithm that adapts the model before scoring (Per-FedAvg) adapts afresh on each split's
                # own samples (the validation metric picks the reported round: it must not see test labels)
                if not loaded or self.algorithm.adapts_at_evaluation:
                    self.load_client(client.name)
                    self.algorithm.adapt_for_evaluation(self.model, client, prepare, self.training.lr, split,
                                                        task=self.training.task)
                    if self.recomputes_bn_statistics:
                        self.recompute_bn_statistics(client, prepare)
                    loaded = True
                # the samples it adapted on are left out of that split's metric
                held = self.algorithm.evaluation_holdout(client, split)
                if held is not None:
                    data = _without(data, held)
                if len(data) == 0:
                    continue
                if split == "val" and self.training.augment_validation:
                    data = self.augmented_validation(client.name, data)
                scorer = self.score_split(data, prepare)
                acc, loss = scorer.result()
                out.append(Evaluation(client.name, split, acc, loss, len(data), self.training.task.metric,
                                      scorer.class_counts()))
        if "test" in splits:
            out += self.evaluate_external(prepare)
        return out

    @property
    def recomputes_bn_statistics(self) -> bool:
        """Whether evaluations recompute the clients' BN statistics: ``Federation.recompute_bn_statistics`` and a
        policy that keeps the statistics on each client (FedBN, SiloBN, SingleSet, the UniFed add-on). A method
        sharing them (FedAvg, FixBN, FBN) has no per-client statistics to recompute and is evaluated as is."""
        return self.federation.recompute_bn_statistics and bool(self.local_keys & self._bn_statistic_keys)

    @torch.no_grad()
    def recompute_bn_statistics(self, client: ClientData, prepare) -> None:
        """BN recalibration of the working model, which holds ``client``'s model: its running statistics become
        the population statistics (mean, biased variance: what BN normalizes with in training) of the client's
        training split through the evaluation input pipeline, one pass in data order, in float32. The stored
        local state is untouched, so training goes on from the statistics training left.

        Not in FedBN's or SiloBN's definition, which evaluate with the running statistics of training (the
        default, ``recompute_bn_statistics`` off): at small batches those lag and are noisy, which cost FedBN
        and SiloBN 7-13 points on PACS at B = 2-4 (benchmarks/fedwon.md, "BN staleness")."""
        if len(client.train) == 0:
            return
        self.model.eval()
        fold_bn_statistics_(self.model, client.train, prepare,
                            ExternalBN(batch_size=self.federation.eval_batch_size, momentum=None))

    def augmented_validation(self, client: str, data: Split) -> Split:
        """``client``'s validation images through the training augmentation, with this evaluation's own draws
        (:func:`~fednorm.engines.seeds.validation_augment_generator`): FedBN's official code validates on a
        ``Subset`` of its augmented training set, so each evaluation sees freshly augmented images."""
        augment = BatchAugment(self.training.augment,
                               validation_augment_generator(self.federation.seed, self.round, client),
                               client_augment_generator(self.federation.seed, client))
        # in evaluation-sized chunks, one after the other from the one generator: the float sampling buffers stay
        # those of one batch, whatever the split's size
        step = self.federation.eval_batch_size
        chunks = [augment.pair(data.x[i:i + step], data.y[i:i + step]) for i in range(0, len(data), step)]
        return type(data)(torch.cat([x for x, _ in chunks]), torch.cat([y for _, y in chunks]))

    def evaluate_external(self, prepare=None) -> list[Evaluation]:
        """Every external client (never trained) under every external mode, from the global model. None under
        SingleSet (policy local_all): no global model is ever trained, so there is nothing to evaluate."""
        if self.method.policy == "local_all":
            return []
        prepare = prepare or self.runner.evaluation_prepare(self.input_state)
        has_bn = has_batchnorm(self.model)
        out: list[Evaluation] = []
        for client in self.external_clients:
            for mode in self.external_modes:
                if mode != "global" and not has_bn:
                    continue  # the modes other than global set BN statistics: they need BatchNorm layers
                # the configured test-time BN (UniFed) for test_time_bn; FedBN App. G's own protocol (population
                # statistics over one pass, then prediction) for fedbn_average; none for bn_average and global
                bn = self.external_bn if mode == "test_time_bn" else None
                result = self.evaluate_external_client(client, mode, bn, prepare)
                if result is not None:
                    out.append(Evaluation(f"{client.name}:{mode}", "test", result.accuracy, result.loss,
                                          result.num_examples, self.training.task.metric, result.class_counts))
        return out

    @property
    def bn_affine_is_local(self) -> bool:
        """Whether the clients keep their own BN weight and bias (FedBN), so fedbn_average must average them."""
        return bool(self.local_bn_keys(statistics=False))

    def local_bn_keys(self, statistics: bool) -> list[str]:
        """The BN entries fedbn_average (``statistics`` False: weight and bias) or bn_average (True: and the running
        statistics) averages that the clients keep locally: none under FedAvg, the statistics under SiloBN, all
        under FedBN. Only these need the clients' own states; the rest is the global model's."""
        return [k for k in bn_state_keys(self.model, statistics) if k in self.local_keys]

    def client_bn_states(self, local_states: dict[str, dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """Each internal client's BN layers as its model holds them, for fedbn_average and bn_average: the global
        state overlaid with the client's local state, for every client in ``local_states`` (in client order); the
        global state alone when no client has one (FedAvg and FixBN, or before any client trained), the average
        of the clients' layers then."""
        local = [local_states[c.name] for c in self.clients if c.name in local_states]
        return [{**self.global_state, **state} for state in local] or [self.global_state]

    def evaluate_external_client(self, client: ClientData, mode: str, bn: ExternalBN | None = None, prepare=None):
        """One external client's test split under one mode (:func:`fednorm.methods.external.evaluate_external`),
        from the global model after the client algorithm's evaluation-time adaptation (Per-FedAvg's steps on
        labelled test samples, which are then left out); ``None`` if no test sample is left. Leaves the model
        holding the evaluated state; the global state is untouched. Under fedbn_average and bn_average the
        internal clients' averaged BN layers replace the adapted model's, so Per-FedAvg's steps there keep only
        their effect on the other layers (no paper combines the two; adapting after the averaging would be the
        alternative)."""
        prepare = prepare or self.runner.evaluation_prepare(self.input_state)
        # the internal clients' BN layers for fedbn_average and bn_average: the average the server sent (Flower), or
        # each client's own (the global state overlaid with its local state)
        states = ([self.external_bn_average] if self.external_bn_average is not None
                  else self.client_bn_states(self.local_states))
        self.model.load_state_dict(self.global_state)
        self.algorithm.adapt_for_evaluation(self.model, client, prepare, self.training.lr, "test",
                                             task=self.training.task)
        data = client.test
        held = self.algorithm.evaluation_holdout(client, "test")
        if held is not None:
            data = _without(data, held)
        if len(data) == 0:
            return None
        return evaluate_external(self.model, data, prepare, mode, bn, states,
                                 eval_batch_size=self.federation.eval_batch_size, task=self.training.task)

    # ---------------------------------------------------------------- diagnostics
    def gradient_dissimilarity(self, samples: int = 256) -> Dissimilarity:
        """Gradient dissimilarity of the training clients at the current global model
        (:mod:`fednorm.diagnostics.gradients`); leaves the run's state untouched. With client sampling
        (cross-device), among the participants of the round just completed."""
        prepare = self.runner.evaluation_prepare(self.input_state)
        clients = self.clients if self.federation.fraction >= 1 else self.sample_clients(max(self.round - 1, 0))
        weights = client_weights([c.num_train for c in clients], self.federation.weighting)
        batch = max(self.training.batch_size, 2)  # BN batch statistics need two samples; the mean loss is the same
        gradients = []
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # the run's random streams are left as they were
            torch.manual_seed(derive_seed(self.federation.seed, self.round, _DIAGNOSTIC_STREAM))  # dropout
            for client in clients:
                self.load_client(client.name)
                gradients.append(full_gradient(self.model, client.train, self.training.task, prepare,
                                               self.shared_params, samples, batch))
        self.model.load_state_dict(self.global_state)
        return dissimilarity(gradients, weights)

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        return {
            "round": self.round,
            "global_state": self.global_state,
            "local_states": self.local_states,
            "optimizer_states": self.optimizer_states,
            "local_keys": sorted(self.local_keys),
            "server": self.server.state_dict(),
            "algorithm_server_state": self.algorithm_server_state,
            "algorithm_states": self.algorithm_states,
            "input_state": self.input_state,
        }

    def load_state_dict(self, state: dict) -> None:
        if sorted(self.local_keys) != state["local_keys"]:
            raise ValueError(
                "checkpoint was written by a method with a different norm state policy; "
                "resume it with the config it was started with"
            )
        missing = set(self.global_state) ^ set(state["global_state"])
        if missing:
            raise ValueError(f"checkpoint does not match the model: differing entries {sorted(missing)[:5]}")
        reshaped = [f"{k} {tuple(v.shape)} (model {tuple(self.global_state[k].shape)})"
                    for k, v in state["global_state"].items() if v.shape != self.global_state[k].shape]
        if reshaped:
            raise ValueError(f"checkpoint does not match the model: entries of other shapes, {', '.join(reshaped[:3])}")
        # checkpoints are read to the host (store.load_checkpoint): the model's state goes back to its device;
        # optimizer states follow their parameters when loaded, the input state (amplitudes) is used on the host
        on_device = ("global_state", "local_states", "server", "algorithm_server_state", "algorithm_states")
        state = {**state, **to_device({k: state[k] for k in on_device if k in state}, self.device)}
        self.round = int(state["round"])
        self.global_state = state["global_state"]
        self.local_states = state["local_states"]
        self.optimizer_states = state["optimizer_states"]
        self.server.load_state_dict(state.get("server", {}))
        self.algorithm_server_state = state.get("algorithm_server_state", self.algorithm_server_state)
        self.algorithm_states = state.get("algorithm_states", {})
        self.input_state = state.get("input_state", {})
