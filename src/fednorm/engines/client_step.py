"""The client side of one round, shared by every engine (in-process simulation, Flower).

A client receives the global shared entries, the client algorithm's server state and a few round
instructions; it loads them with what it keeps to itself (:class:`ClientMemory`: its local entries
under the method's norm state policy, its optimizer state, its client algorithm's state), trains, and
answers with a :class:`fednorm.methods.server.ClientReply` plus the client algorithm's message.
Engines only move these objects around; nothing here knows how they travel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..data.domain import ClientData, Standardize, normalize_batch
from ..methods.amplitude import GLOBAL_AMPLITUDE, AmplitudePrepare, amplitude_normalizer, client_amplitude_message
from ..methods.client_algorithms import ClientAlgorithm, ClientContext
from ..methods.local_update import LocalResult, LocalTraining, train_locally
from ..methods.presets import Method
from ..methods.server import ClientReply
from ..models.fbn import federated_bn_layers, set_federation_size
from .device import to_device
from .seeds import augment_generator, client_augment_generator


@dataclass(frozen=True)
class RoundInstructions:
    """What the server tells each participant of a round, besides the global entries."""

    round: int
    num_participants: int
    lr: float  # this round's learning rate (schedules live on the server)
    weight: float  # the client's aggregation weight p_k, echoed in its reply
    freeze_bn_stats: bool = False  # FixBN's second phase
    prox: bool = True  # whether FedProx's term applies this round (FedBN's code skips round 0)
    seed: int = 0  # the client's random stream of this round (batches, dropout)


@dataclass
class ClientMemory:
    """What one client keeps between rounds; never sent to the server."""

    local_state: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer_state: dict | None = None
    algorithm_state: dict[str, torch.Tensor] = field(default_factory=dict)


class ClientRunner:
    """Runs a method's client update on one working model, for any client handed to it."""

    def __init__(self, model: nn.Module, method: Method, training: LocalTraining, local_keys, shared_keys: list[str],
                 prepare: Callable[[torch.Tensor], torch.Tensor], persistent_optimizer: bool = False,
                 algorithm: ClientAlgorithm | None = None,
                 place: Callable[[torch.Tensor], torch.Tensor] | None = None, seed: int = 0) -> None:
        """``prepare`` turns a uint8 batch into the model input; ``place`` (the model's device and memory
        format) is applied after it, and after the amplitude normalization that replaces ``prepare`` for
        HarmoFL's methods (which runs on the host). ``seed`` is the run's: it seeds the augmentation draws a
        client keeps for the whole run (``client_augment_generator``)."""
        if method.amplitude_norm and prepare is not normalize_batch and not isinstance(prepare, Standardize):
            # AmplitudePrepare replaces the input pipeline with /255 -> amplitude -> the same per-channel
            # standardization; another pipeline would be silently dropped
            raise ValueError(f"method {method.name!r} normalizes image amplitudes between /255 and the per-channel "
                             "standardization (normalize_batch, Standardize); it cannot follow another input pipeline "
                             f"({getattr(prepare, '__name__', type(prepare).__name__)}): pass a Standardize")
        # the crop and standardization around amplitude normalization (normalize_batch: mean 0.5, std 0.5, no crop)
        self.standardize = prepare if isinstance(prepare, Standardize) else Standardize()
        self.model, self.method, self.training = model, method, training
        self.seed = seed
        self.device = next(model.parameters()).device
        self.place = place or (lambda x: x.to(self.device))
        self.prepare = lambda x: self.place(prepare(x))
        self.local_keys, self.shared_keys = frozenset(local_keys), list(shared_keys)
        params = {n for n, _ in model.named_parameters()}
        self.shared_params = [k for k in self.shared_keys if k in params]
        self.persistent_optimizer = persistent_optimizer
        self.algorithm = algorithm or method.client.build()
        self.fbn_layers = federated_bn_layers(model)

    @property
    def task(self):
        """The run's task (its loss and evaluation score); it travels inside ``training`` to ``train_locally``."""
        return self.training.task

    def load(self, global_state: dict[str, torch.Tensor], memory: ClientMemory | None) -> None:
        """The client's model: the global entries with its own local entries on top."""
        local = memory.local_state if memory is not None else {}
        self.model.load_state_dict({**global_state, **local})

    def run(self, client: ClientData, instructions: RoundInstructions, global_state: dict[str, torch.Tensor],
            server_state: dict[str, torch.Tensor], memory: ClientMemory, copy_reply: bool = False,
            input_state: dict[str, torch.Tensor] | None = None,
            ) -> tuple[ClientReply, dict[str, torch.Tensor], LocalResult]:
        """Train ``client`` for one round from ``global_state`` (shared entries, or the full state); update
        ``memory`` in place; return the reply to the server, the client algorithm's message and the loss
        statistics. ``copy_reply`` detaches the reply from the working model (needed when the caller keeps
        it while training the next client). ``input_state`` is the server's input harmonization state
        (HarmoFL's global amplitude, once averaged); the client's own amplitude goes into the message
        under ``amp.client`` until then. Tensors that arrive on another device (a Flower node's messages and
        stored state are host arrays) are moved to the model's.

        ``training.augment`` acts inside ``train_locally`` on each uint8 training batch, before ``prepare``:
        under HarmoFL the amplitude normalization that replaces ``prepare`` therefore sees the augmented
        batch, and round 1's running amplitude averages augmented training images (the official code's
        amplitude layer is the network's first, after the data loader's transforms). The client algorithm's
        own passes over the training data (``ClientContext.prepare``: SCAFFOLD option I's full gradient at the
        global model, in eval mode) are not augmented: they are a reference gradient, not training steps."""
        global_state, server_state = to_device(global_state, self.device), to_device(server_state, self.device)
        memory.local_state = to_device(memory.local_state, self.device)
        for key, value in memory.algorithm_state.items():  # in place: the caller keeps this dict (SCAFFOLD's c_i)
            memory.algorithm_state[key] = value.to(self.device)
        self.load(global_state, memory)
        training = self.training if instructions.lr == self.training.lr else _with_lr(self.training, instructions.lr)
        shared_global = {k: global_state[k] for k in self.shared_keys}
        prox_reference = None
        if self.method.prox_mu > 0 and instructions.prox:
            prox_reference = {k: shared_global[k] for k in self.shared_params}
        prepare, normalizer = self.prepare, None
        if self.method.amplitude_norm:
            if client.train.x.dtype != torch.uint8 or client.train.x.ndim != 4:
                raise ValueError(f"method {self.method.name!r} normalizes image amplitudes, but client {client.name!r} "
                                 f"holds {tuple(client.train.x.shape[1:])} {client.train.x.dtype} inputs, not images; "
                                 "use a method without amplitude_norm for feature vectors")
            normalizer = amplitude_normalizer(self.method, (input_state or {}).get(GLOBAL_AMPLITUDE))
            normalizer.train()
            amplitude_prepare = AmplitudePrepare(normalizer, self.standardize.mean, self.standardize.std)
            prepare = lambda x: self.place(amplitude_prepare(self.standardize.center_crop(x)))  # noqa: E731
        sgd_momentum = training.momentum if training.optimizer == "sgd" else 0.0
        context = ClientContext(
            client.name, training.lr, self.shared_params, shared_global, server_state,
            memory.algorithm_state if self.algorithm.stateful else {}, data=client.train, prepare=prepare,
            momentum=sgd_momentum, momentum_style=training.momentum_style, task=training.task,
            batch_size=training.batch_size,
        )
        set_federation_size(self.model, instructions.num_participants)
        for layer in self.fbn_layers.values():
            layer.last_count = 0
        torch.manual_seed(instructions.seed)  # dropout and any other sampling inside the model
        result, optimizer_state = train_locally(
            self.model, client.train, training,
            generator=torch.Generator().manual_seed(instructions.seed),
            prepare=prepare,
            prox_reference=prox_reference,
            prox_mu=self.method.prox_mu,
            prox_skip_epoch_start=self.method.prox_schedule == "fedbn_code",
            optimizer_state=memory.optimizer_state if self.persistent_optimizer else None,
            agc_clip=self.method.agc_clip,
            agc_exclude_head=self.method.agc_exclude_head,
            freeze_bn_stats=instructions.freeze_bn_stats,
            algorithm=self.algorithm,
            context=context,
            weight_perturbation=self.method.weight_perturbation,
            # training.augment: its own stream from the round's client seed, so augment none draws nothing
            augment_generator=augment_generator(instructions.seed) if training.augment != "none" else None,
            augment_client_generator=(client_augment_generator(self.seed, client.name)
                                      if training.augment != "none" else None),
        )
        message = {**context.scratch.get("message", {}), **client_amplitude_message(normalizer)}
        if self.persistent_optimizer:
            memory.optimizer_state = optimizer_state
        state = self.model.state_dict()
        if self.local_keys:
            memory.local_state = {k: state[k].detach().clone() for k in self.local_keys}
        sent = self.algorithm.reply_state(context, {k: state[k] for k in self.shared_keys})
        reply = ClientReply(
            client.name, {k: v.detach().clone() if copy_reply else v for k, v in sent.items()},
            instructions.weight, result.num_steps,
            {prefix: layer.last_count for prefix, layer in self.fbn_layers.items() if layer.last_count},
        )
        return reply, message, result

    def evaluation_prepare(self, input_state: dict[str, torch.Tensor] | None) -> Callable[[torch.Tensor], torch.Tensor]:
        """The input pipeline at evaluation: with amplitude normalization, the global (frozen) amplitude."""
        amp = (input_state or {}).get(GLOBAL_AMPLITUDE)
        if not self.method.amplitude_norm or amp is None:
            return self.prepare
        normalizer = amplitude_normalizer(self.method, amp).eval()
        amplitude_prepare = AmplitudePrepare(normalizer, self.standardize.mean, self.standardize.std, update=False)
        return lambda x: self.place(amplitude_prepare(self.standardize.center_crop(x)))


def _with_lr(training: LocalTraining, lr: float) -> LocalTraining:
    from dataclasses import replace

    return replace(training, lr=lr)
