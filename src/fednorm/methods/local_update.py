"""Client update: local SGD on the client's own data, with the optional FedProx proximal term.

One round of local training runs ``epochs`` passes over the client's data in shuffled mini-batches,
or, when ``steps`` is set, exactly that many full mini-batches, reshuffling and starting a new pass
whenever the data run out (FedBN App. E.6: clients with less data repeat sampling so that all
clients run the same number of local iterations).

FedProx (Li et al. 2020) adds (mu / 2) * ||w - w_global||^2 to the local loss, w_global being the
weights the client received at the start of the round. The term covers the trainable parameters
that the server aggregates under the method's norm state policy: all of them for FedProx, all but
the BatchNorm parameters for FedProx + FedBN (local BN parameters have no global counterpart).
Buffers (BN statistics) are not parameters and are never in the term. It is applied from the first
step of the first round, as the paper states. FedBN's official digits code skips the first step of
each epoch and the whole first round: ``prox_skip_epoch_start`` here, and the engine's
``prox_schedule="fedbn_code"``. (Its Office/DomainNet scripts also use the non-squared norm; that
variant is not offered.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..data.domain import Split
from ..models.norm import buffers_kept
from .agc import agc_parameters, clip_unitwise_
from .aggregation import DivergenceError
from .augment import MASK_AUGMENTS, BatchAugment, check_augment
from .client_algorithms import ClientAlgorithm, ClientContext
from .tasks import CLASSIFICATION, Task


PRECISIONS = ("fp32", "bf16")
MOMENTUM_STYLES = ("pytorch", "ema")
OPTIMIZERS = ("sgd", "adam")


def native_bf16() -> bool:
    """True when this CPU computes bf16 natively (AMX tiles or AVX512-BF16).

    Without it, PyTorch emulates bf16 autocast on the CPU, which is slower than fp32 (15-30x for
    the digit CNN on an AVX2-only AMD EPYC: 15-19x under load, 26-30x idle; benchmarks/performance.md),
    so ``precision: auto`` picks fp32 there.
    This is about the CPU only; a GPU's bf16 is :func:`resolve_precision`'s other case.
    """
    probes = [getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")]
    return any(p() for p in probes if p is not None)


def resolve_precision(precision: str, device: str = "cpu") -> str:
    """``auto`` -> ``bf16`` where the device training runs on (``cpu`` or ``cuda``, a
    :class:`torch.device` type) computes bf16 natively, else ``fp32``; other values unchanged."""
    if precision == "auto":
        if device == "cuda":
            return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
        return "bf16" if native_bf16() else "fp32"
    return precision


def resolve_channels_last(channels_last: bool | None, precision: str) -> bool:
    """The memory format a run uses: as set, or (None, ``auto``) channels_last only for bf16 training.

    oneDNN's fast bf16 convolutions (AMX) want NHWC, as do a GPU's bf16 tensor cores. In fp32, channels_last
    is no faster on the AVX2 CPU measured here and less precise: its BatchNorm kernels are 10-30x and its
    convolutions' input gradient 3x further from float64 than the NCHW ones (benchmarks/performance.md,
    "channels_last in fp32"), so fp32 stays NCHW.
    """
    return precision == "bf16" if channels_last is None else bool(channels_last)


@dataclass(frozen=True)
class LocalTraining:
    """Hyper-parameters of a client's local SGD."""

    epochs: int = 1
    steps: int | None = None
    batch_size: int = 32
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    drop_last: bool = False
    precision: str = "fp32"  # "bf16": autocast matmuls/convs to bfloat16 (AMX, GPU); weights stay fp32
    # "pytorch": buf = mu buf + g (torch.optim.SGD); "ema": buf = mu buf + (1 - mu) g from 0, the Polyak form of the
    # Byzantine-ML literature, which the FBN paper's client momentum 0.99 at lr 0.1 implies (extraction 1.5)
    momentum_style: str = "pytorch"
    # FBN Table 2's step schedule: lr / (1 + floor(round / lr_decay_every)) (0.1, 0.05, 0.033 every 1000 steps)
    lr_decay_every: int | None = None
    # the loss (and evaluation score) of the run's task: cross-entropy for classification, a Dice loss or CE +
    # Dice for segmentation (:mod:`fednorm.methods.tasks`)
    task: Task = CLASSIFICATION
    # HarmoFL's client drift (Eq. 9): record Gamma_i = 1/K sum_k ||theta_k - theta_0||^2 over the round's K steps,
    # theta_k the weights after step k. Alg. 1 indexes theta_{i,1} = theta^t, so a literal Eq. 9 averages the start
    # (a zero term) and the first K - 1 iterates; the choice here counts every step's result once
    track_drift: bool = False
    # the client's optimizer: SGD (momentum, weight decay), or Adam (betas, L2 weight decay added to the gradient
    # as torch.optim.Adam; HarmoFL's segmentation code: Adam lr 1e-4, betas (0.9, 0.99), weight decay 1e-4)
    optimizer: str = "sgd"
    betas: tuple[float, float] = (0.9, 0.999)
    # training-time augmentation of every training batch, on the uint8 images before ``prepare``
    # (:mod:`fednorm.methods.augment`): "none", "fedbn_objects" (FedBN's Office/DomainNet flip + rotation),
    # "rot90_flip" (HarmoFL's prostate code: quarter turns and flips, masks moved with their images) or
    # "flamby_isic" (FLamby's Fed-ISIC2019 pipeline, random 200 x 200 crops)
    augment: str = "none"
    # the same augmentation on the validation images at every evaluation (FedBN's Office / DomainNet code validates
    # on a Subset of its augmented training set); never on test images
    augment_validation: bool = False

    def __post_init__(self) -> None:
        check_augment(self.augment)
        if self.augment_validation and self.augment == "none":
            raise ValueError("augment_validation augments validation images with training.augment, which is none")
        if self.augment not in MASK_AUGMENTS and self.task.kind == "segmentation":
            raise ValueError(f"augment {self.augment!r} would move the images but not their masks: segmentation "
                             f"takes {' or '.join(MASK_AUGMENTS)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.optimizer == "adam" and (self.momentum or self.momentum_style != "pytorch"):
            raise ValueError("momentum and momentum_style are SGD's; Adam's momentum is betas[0] (set momentum: 0)")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.momentum_style not in MOMENTUM_STYLES:
            raise ValueError(f"momentum_style must be one of {', '.join(MOMENTUM_STYLES)}, got {self.momentum_style!r}")
        if self.lr_decay_every is not None and self.lr_decay_every < 1:
            raise ValueError(f"lr_decay_every must be >= 1, got {self.lr_decay_every}")

    def lr_at(self, round_index: int) -> float:
        """The learning rate of round ``round_index`` (0-based) under the decay schedule."""
        if self.lr_decay_every is None:
            return self.lr
        return self.lr / (1 + round_index // self.lr_decay_every)


@dataclass
class LocalResult:
    """What a round of local training reports besides the new weights."""

    loss_sum: float
    num_examples: int
    num_steps: int
    # HarmoFL's per-client drift Gamma_i of the round (Eq. 9 / App. C.3), when ``LocalTraining.track_drift``:
    # the mean over local steps k = 1..K of ||theta_k - theta_0||^2, over every trainable parameter
    drift: float | None = None

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / max(self.num_examples, 1)


def build_optimizer(params, cfg: LocalTraining, state: dict | None = None) -> torch.optim.Optimizer:
    """The client's optimizer as ``cfg`` names it, restored from ``state`` (a persistent optimizer's
    momentum buffers) with this round's lr and hyper-parameters (the saved ones give way).

    ``momentum_style: ema`` is the Polyak form m_t = mu m_(t-1) + (1 - mu) g_t from m_0 = 0, the client
    momentum of Robust-DSGD and the FBN paper (the EPFL byzfl clients start their momentum at zeros). It is
    torch's SGD with dampening mu, whose missing buffers are first set to zero: torch.optim.SGD would
    otherwise take buf = g on its first step, undamped, and at mu = 0.99 that first gradient alone would
    move the weights by about 100 lr g over the next few hundred steps (a loss blow-up of BatchNorm models
    in FBN's protocol before this was fixed).
    """
    params = list(params)
    if cfg.optimizer == "adam":
        hyper = dict(lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
        optimizer: torch.optim.Optimizer = torch.optim.Adam(params, **hyper)
    else:
        dampening = cfg.momentum if cfg.momentum_style == "ema" else 0.0
        hyper = dict(lr=cfg.lr, momentum=cfg.momentum, dampening=dampening, weight_decay=cfg.weight_decay)
        optimizer = torch.optim.SGD(params, **hyper)
    if state is not None:
        optimizer.load_state_dict(state)
        for group in optimizer.param_groups:
            group.update(**hyper)
    if cfg.optimizer == "sgd" and cfg.momentum_style == "ema" and cfg.momentum > 0:
        for p in params:
            if optimizer.state[p].get("momentum_buffer") is None:
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return optimizer


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, _BatchNorm) for m in model.modules())


def batch_schedule(
    n: int, cfg: LocalTraining, generator: torch.Generator, guard_single: bool
) -> list[torch.Tensor]:
    """Index tensors of the round's mini-batches, in order.

    With ``guard_single`` (the model has BatchNorm), a trailing batch of one sample is dropped:
    BatchNorm cannot compute batch statistics from one sample in training mode. With ``steps``,
    every batch is full (batch size 1 included, which the caller's model must support).
    """
    if n == 0:
        raise ValueError("client has no training data")
    if guard_single and cfg.batch_size == 1:
        raise ValueError(
            "batch_size 1 cannot train a BatchNorm model: batch statistics of one sample are undefined "
            "(FedWon runs no BN method at B = 1); use a model without BatchNorm (norm: gn, ln, ws, none)"
        )
    batches: list[torch.Tensor] = []

    def one_pass() -> list[torch.Tensor]:
        order = torch.randperm(n, generator=generator)
        parts = list(torch.split(order, cfg.batch_size))
        if parts and (cfg.drop_last and len(parts[-1]) < cfg.batch_size and len(parts) > 1):
            parts.pop()
        if parts and guard_single and len(parts[-1]) == 1:
            if len(parts) == 1:
                raise ValueError(
                    "a BatchNorm model cannot train on a client with a single sample per batch; "
                    "use batch_size >= 2 or a model without BatchNorm (norm: gn, ln, ws, none)"
                )
            parts.pop()
        return parts

    if cfg.steps is None:
        for _ in range(cfg.epochs):
            batches.extend(one_pass())
    else:
        # fixed iterations (FedBN App. E.6): shuffled passes are chained and cut into full batches,
        # so every client runs `steps` batches of the same size whatever its data size
        need = cfg.steps * cfg.batch_size
        stream = torch.cat([torch.randperm(n, generator=generator) for _ in range(-(-need // n))])
        batches = list(torch.split(stream[:need], cfg.batch_size))
    return batches


def train_locally(
    model: nn.Module,
    data: Split,
    cfg: LocalTraining,
    *,
    generator: torch.Generator,
    prepare: Callable[[torch.Tensor], torch.Tensor],
    prox_reference: dict[str, torch.Tensor] | None = None,
    prox_mu: float = 0.0,
    prox_skip_epoch_start: bool = False,
    optimizer_state: dict | None = None,
    agc_clip: float = 0.0,
    agc_exclude_head: bool = True,
    freeze_bn_stats: bool = False,
    schedule: list[torch.Tensor] | None = None,
    algorithm: "ClientAlgorithm | None" = None,
    context: "ClientContext | None" = None,
    weight_perturbation: float = 0.0,
    augment_generator: torch.Generator | None = None,
    augment_client_generator: torch.Generator | None = None,
) -> tuple[LocalResult, dict]:
    """Train ``model`` in place on ``data``; return the loss statistics and the optimizer state.

    ``prepare`` turns a uint8 batch into the model's float input. ``prox_reference`` maps parameter
    names to the round's global weights, pulled on with strength ``prox_mu`` (FedProx); ``optimizer_state`` restores a persistent
    optimizer (momentum buffers) and the returned state is the one to keep for the next round.
    ``agc_clip`` > 0 clips every step's gradient unit-wise (FedWon's AGC, :mod:`fednorm.methods.agc`),
    after the proximal gradient is added, just before the optimizer step. ``freeze_bn_stats`` puts
    every BatchNorm layer in eval mode (FixBN's second phase): it normalizes with its running
    statistics and does not update them, while its weight and bias still train. ``schedule`` replaces the
    drawn mini-batches by given index tensors (the union batches of centralized BN). ``algorithm`` with its
    ``context`` adds a client algorithm's hooks (:mod:`fednorm.methods.client_algorithms`); its message to
    the server is left in ``context.scratch["message"]``. ``weight_perturbation`` > 0 is HarmoFL's alpha:
    every step's gradient is taken at theta + alpha g/||g|| (:mod:`fednorm.methods.weight_perturbation`),
    two forward/backward passes per step. Only the first pass updates BatchNorm running statistics (the
    common SAM practice): the official code's BN keeps none (``track_running_stats=False``, our
    ``model.bn_mode: batch``), so it does not decide this; letting the perturbed pass update them too
    would count every batch twice, the second time with the activations of theta + delta.
    With ``cfg.augment`` set, every training batch is augmented before ``prepare``
    (:mod:`fednorm.methods.augment`), with draws from ``augment_generator`` alone (required then): the batch
    order ``generator`` and the global torch stream draw exactly as without augmentation;
    ``augment_client_generator`` makes the draws that stay fixed for a client's whole run (see
    :class:`~fednorm.methods.augment.BatchAugment`). The weight
    perturbation's second pass and a client algorithm's hooks see the step's augmented batch.
    """
    augment = None
    if cfg.augment != "none":
        if augment_generator is None:
            raise ValueError(f"augment {cfg.augment!r} needs an augment_generator of its own (the engines derive "
                             "one from the client's round seed: fednorm.engines.seeds.augment_generator)")
        augment = BatchAugment(cfg.augment, augment_generator, augment_client_generator)
    model.train()
    if freeze_bn_stats:
        for module in model.modules():
            if isinstance(module, _BatchNorm):
                module.eval()
    clipped = agc_parameters(model, agc_exclude_head) if agc_clip > 0 else []
    params = dict(model.named_parameters())
    optimizer = build_optimizer(params.values(), cfg, optimizer_state)
    prox = []
    if prox_mu > 0 and prox_reference:
        prox = [(params[name], ref) for name, ref in prox_reference.items() if name in params]
    use_bf16 = cfg.precision == "bf16"
    loss_sum, seen = 0.0, 0
    if schedule is None:
        schedule = batch_schedule(len(data), cfg, generator, guard_single=has_batchnorm(model) and not freeze_bn_stats)
    # every pass has the same number of batches, so epoch e starts at step e * per_epoch
    per_epoch = len(schedule) // cfg.epochs if cfg.steps is None else len(schedule)
    perturbation = None
    if weight_perturbation > 0:
        from .weight_perturbation import WeightPerturbation

        perturbation = WeightPerturbation(optimizer, alpha=weight_perturbation)
    if algorithm is not None:
        algorithm.on_start(context, model)
    drift_origin = [p.detach().clone() for p in params.values()] if cfg.track_drift else None
    drift_sum = 0.0

    def forward(inputs: torch.Tensor) -> torch.Tensor:
        with torch.autocast(inputs.device.type, dtype=torch.bfloat16, enabled=use_bf16):
            return model(inputs)

    def training_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The task's loss plus the client algorithm's extra term (MOON, ...), at the current weights."""
        logits = forward(x)
        loss = cfg.task.loss(logits, y)
        if algorithm is not None:
            extra = algorithm.loss_term(context, model, x, y, logits)
            if extra is not None:
                loss = loss + extra
        return loss

    for step, index in enumerate(schedule):
        images, targets = data.x[index], data.y[index]
        if augment is not None:
            images, targets = augment.pair(images, targets)
        x = prepare(images)  # on the model's device: ``prepare`` places the batch
        y = cfg.task.target(targets).to(x.device)  # segmentation masks: uint8 -> int64, one batch at a time
        optimizer.zero_grad(set_to_none=True)
        custom = algorithm.compute_gradients(context, model, x, y, forward) if algorithm is not None else None
        if custom is None:
            loss = training_loss(x, y)
            value = float(loss.detach())
        else:
            value = float(custom)
        if not math.isfinite(value):
            raise DivergenceError(
                f"local training loss became {value} after {seen} samples: lower the learning rate "
                f"(now {cfg.lr}) or check the client's data"
            )
        if custom is None:
            loss.backward()
        if perturbation is not None:
            perturbation.perturb()
            optimizer.zero_grad(set_to_none=True)
            try:
                with buffers_kept(model):
                    # the algorithm's own gradient (Per-FedAvg's meta-gradient) where it replaces the plain one
                    if custom is None or algorithm.compute_gradients(context, model, x, y, forward) is None:
                        training_loss(x, y).backward()
            finally:
                perturbation.restore()  # the step starts from theta, with the gradient of theta + delta
        if prox and not (prox_skip_epoch_start and step % per_epoch == 0):
            # gradient of (mu/2)||w - w_g||^2 is mu (w - w_g); added exactly, without building the term
            with torch.no_grad():
                for p, ref in prox:
                    if p.grad is not None:
                        p.grad.add_(p.detach() - ref, alpha=prox_mu)
        if algorithm is not None:
            algorithm.on_gradients(context, model)
        if clipped:
            clip_unitwise_(clipped, agc_clip)
        optimizer.step()
        if drift_origin is not None:
            drift_sum += squared_distance(list(params.values()), drift_origin)
        loss_sum += value * len(index)
        seen += len(index)
    if algorithm is not None:
        context.scratch["message"] = algorithm.on_end(context, model, len(schedule))
    drift = drift_sum / max(len(schedule), 1) if drift_origin is not None else None
    return LocalResult(loss_sum, seen, len(schedule), drift), optimizer.state_dict()


@torch.no_grad()
def squared_distance(current: list[torch.Tensor], origin: list[torch.Tensor]) -> float:
    """||current - origin||^2 summed over a list of tensors (one fused pass: torch._foreach ops)."""
    if not current:
        return 0.0
    norms = torch._foreach_norm(torch._foreach_sub([t.detach() for t in current], origin))
    return float(torch.stack(norms).square().sum())
