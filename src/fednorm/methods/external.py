"""Evaluation of EXTERNAL clients: clients that never trained, seen only at test time (UniFed, FedBN App. G).

Four modes, each a pure function of a trained model and the external client's test data (the model is
copied, never changed):

- ``global``: the model as it is (UniFed Table III's "original" rows). For a model trained with
  client-specific BN (FedBN), its BN layers are the never-updated initial ones (UniFed: "the BN layers in the
  global model are not updated"). Under SiloBN (policy ``local_bn_stats``) likewise the global running
  statistics are the initial (0, 1): the affine is trained and shared, the statistics never leave the clients,
  so only ``test_time_bn``, ``fedbn_average`` and ``bn_average`` give such a model statistics of its own.
- ``test_time_bn``: UniFed's test-time BN statistics (Sec. 3.4, Eqs. 3-4, formulas lost in our text and
  reconstructed): the external client's unlabelled test batches pass one by one in a stated order; at every BN
  layer each batch's channel mean and variance are folded into tracked statistics with a momentum, and the
  layer normalizes with the tracked statistics. The affine parameters stay the model's (gamma, beta of the
  global model).
- ``fedbn_average``: FedBN App. G: the average of the internal clients' BN affine parameters (weight, bias)
  put into the model, with statistics computed on the external client's own data.
- ``bn_average``: the other reading of FedWon Table 12's FedBN row ("a global model with averaged BN layer
  parameters from the seen domains"; whether the running statistics were averaged too is not stated): the
  internal clients' BN weight, bias, running mean and running variance all averaged into the model, nothing
  estimated on the external client (zero-shot, as the global model). The variances are averaged as they are,
  as FedAvg averages buffers, not pooled with FBN's between-client term (which would be the union's variance).
  Under a method whose BN state is shared (FedAvg, FixBN) this is the global model itself.

Conventions, named because the paper's symbols were lost:

- momentum: ``convention="history"`` (default, UniFed's reconstructed Eq. 4): mu_bar_b = tau mu_bar_{b-1} +
  (1 - tau) mu_b, tau = ``momentum`` weighting the HISTORY, so momentum 0 = "no historical values are tracked"
  (the one-batch study). ``convention="pytorch"``: ``momentum`` weights the NEW batch, as nn.BatchNorm's
  (tau = 1 - momentum). ``momentum=None``: population statistics, the mean and (biased) variance over all
  samples seen so far (for fedbn_average): exact for the first BN layer; a deeper layer's inputs were normalized
  by the earlier layers' statistics as they stood at each batch, not at their final values (a layer-by-layer pass
  would make every layer exact: measured 4 % off in the variance of a second layer on a toy model, batch 32).
- initialization: ``reset=True`` (default) starts from the first batch's statistics (mu_bar_1 = mu_1: the
  paper does not state mu_bar_0; this is the natural reading); ``reset=False`` starts from the model's running
  statistics (mu_bar_0 = the trained/global ones).
- variance: biased (mean of squared deviations over samples and positions), what BN normalizes with in
  training; ``unbiased=True`` for the n/(n-1) version.
- order: data order by default; ``shuffle_seed`` draws a seeded permutation (UniFed Fig. 6(c) studies orders).
  Batches of ``batch_size``, the last one possibly smaller (kept: every sample is predicted). A batch that gives a
  layer one value per channel (one sample before a BatchNorm1d) has no variance and is not folded into that layer's
  statistics: at test batch size 1 a BatchNorm1d layer keeps the model's statistics while convolutional BN layers,
  with H x W values per channel, adapt.
- prediction: ``predict="online"`` (default, UniFed Alg. 1 as reconstructed: "for each incoming test batch:
  update the statistics, normalize with them, output predictions for the batch"), or ``"after_pass"``: one pass
  over all batches to estimate, then a second pass predicting every batch with the final statistics.
- layers: every ``torch.nn.modules.batchnorm._BatchNorm`` (BN1d/2d/3d, SyncBN, FederatedBatchNorm), matched
  by type. Statistics at layer l are computed from its input as produced by the layers before it (already
  normalized with their updated statistics), in one forward pass per batch.
- precision: external clients are evaluated in float32 even when the run's ``precision`` is bf16 (internal
  clients are scored under bf16 autocast then): the statistics are re-estimated in full precision.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..data.domain import Split
from .tasks import CLASSIFICATION, Scorer, Task

EXTERNAL_MODES = ("global", "test_time_bn", "fedbn_average", "bn_average")
# the modes that average the internal clients' BN layers (so need them from the clients): fedbn_average the weight
# and bias, bn_average the running statistics too
CLIENT_AVERAGE_MODES = ("fedbn_average", "bn_average")
MOMENTUM_CONVENTIONS = ("history", "pytorch")
PREDICTIONS = ("online", "after_pass")

# UniFed's defaults: "a batch size of 32 and a momentum value of 0.9" (Sec. 4.1.1; read as the test-time BN
# settings, which Fig. 6(b) confirms for the batch size: "we set the test batch size as 32")
DEFAULT_TEST_BATCH_SIZE = 32
DEFAULT_MOMENTUM = 0.9
# UniFed Fig. 6(a), one-batch study (momentum 0): test batch sizes "from 2 to 512"; the axis values were lost,
# powers of two are assumed
ABLATION_TEST_BATCH_SIZES = (2, 4, 8, 16, 32, 64, 128, 256, 512)
# UniFed Fig. 6(b), at test batch size 32: the momentum range was lost (one end "means no historical values are
# tracked" = 0 in the history convention); this grid over [0, 0.9] plus 0.99 is a reconstruction
ABLATION_MOMENTA = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99)
# UniFed Fig. 6(c), sampling order: a box plot over "different test-sample orders" (how many was not given); each
# order is a seeded permutation of the external client's test samples, evaluated at UniFed's default point
ABLATION_ORDERS = tuple(range(10))


@dataclass(frozen=True)
class ExternalBN:
    """How BN statistics are re-estimated on an external client (see the module docstring for each choice)."""

    batch_size: int = DEFAULT_TEST_BATCH_SIZE
    momentum: float | None = DEFAULT_MOMENTUM
    convention: str = "history"
    reset: bool = True
    predict: str = "online"
    shuffle_seed: int | None = None
    unbiased: bool = False

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"test batch_size must be >= 1, got {self.batch_size}")
        if self.convention not in MOMENTUM_CONVENTIONS:
            raise ValueError(f"convention must be one of {', '.join(MOMENTUM_CONVENTIONS)}, got {self.convention!r}")
        if self.momentum is not None and not 0 <= self.momentum <= 1:
            raise ValueError(f"momentum must be in [0, 1] (or None for population statistics), got {self.momentum}")
        if self.momentum is None and not self.reset:
            raise ValueError("momentum=None estimates population statistics from the external data alone; "
                             "it cannot keep the model's statistics (reset must be True)")
        if self.predict not in PREDICTIONS:
            raise ValueError(f"predict must be one of {', '.join(PREDICTIONS)}, got {self.predict!r}")

    @property
    def history_weight(self) -> float | None:
        """tau: the weight of the tracked statistics in each update (None: population statistics)."""
        if self.momentum is None:
            return None
        return self.momentum if self.convention == "history" else 1.0 - self.momentum


# FedBN App. G does not say how the new client's "(mean, variance) on its own data" are computed; the default
# here is the exact population statistics over all its data, then prediction
FEDBN_APPENDIX_G = ExternalBN(momentum=None, predict="after_pass")


@dataclass(frozen=True)
class ExternalResult:
    accuracy: float  # the task's score: accuracy unless the task says balanced accuracy (or Dice)
    loss: float  # mean of the task's loss (cross-entropy by default)
    num_examples: int
    class_counts: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # balanced accuracy: (hits, support)


def batch_order(n: int, batch_size: int, shuffle_seed: int | None = None) -> list[Tensor]:
    """Index tensors of the test batches: data order, or a permutation seeded by ``shuffle_seed``."""
    if shuffle_seed is None:
        order = torch.arange(n)
    else:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(shuffle_seed))
    return list(torch.split(order, batch_size))


def bn_layers(model: nn.Module) -> dict[str, _BatchNorm]:
    return {name: m for name, m in model.named_modules() if isinstance(m, _BatchNorm)}


def _require_bn(model: nn.Module, mode: str) -> dict[str, _BatchNorm]:
    layers = bn_layers(model)
    if not layers:
        raise ValueError(f"external evaluation {mode!r} sets BatchNorm statistics, but the model has no "
                         "BatchNorm layer; use mode 'global'")
    missing = [name for name, m in layers.items() if m.running_mean is None or m.running_var is None]
    if missing:
        raise ValueError(f"BatchNorm layers {missing} keep no running statistics (track_running_stats=False); "
                         f"{mode!r} needs them to hold the statistics it sets")
    return layers


class _StatisticsTracker:
    """Forward pre-hook on a BN layer in eval mode: folds the batch's statistics into the layer's running
    statistics before the layer normalizes with them."""

    def __init__(self, bn: ExternalBN) -> None:
        self.tau = bn.history_weight
        self.unbiased = bn.unbiased
        self.first = bn.reset
        self.count = 0
        self.sum: Tensor | None = None
        self.sum_sq: Tensor | None = None

    def __call__(self, module: _BatchNorm, args: tuple) -> None:
        x = args[0].detach()
        dims = [0, *range(2, x.dim())]
        k = x.numel() // x.shape[1]  # values per channel in this batch
        if self.tau is None:  # population statistics: running sums in float64
            xd = x.double()
            s, sq = xd.sum(dims), (xd * xd).sum(dims)
            self.sum = s if self.sum is None else self.sum + s
            self.sum_sq = sq if self.sum_sq is None else self.sum_sq + sq
            self.count += k
            if self.count < 2:  # one value so far has no variance: the layer keeps its own statistics
                return
            mean = self.sum / self.count
            var = (self.sum_sq / self.count - mean * mean).clamp_min(0)
            if self.unbiased and self.count > 1:
                var = var * self.count / (self.count - 1)
        else:
            if k < 2:
                # a one-value batch (a last batch of 1 sample, or test batch size 1, before a BatchNorm1d) has no
                # variance: folded in it would set the statistics to (x, 0) at momentum 0 (normalizing by
                # sqrt(eps)), and, as the first batch, to (x, 0) for good; the layer keeps the statistics it has
                # (the tracked ones; before any batch of two values, the model's own) and the next batch of two
                # or more values is still the first (UniFed extraction pitfall 3: "the last partial batch can be
                # tiny - handle it")
                return
            xf = x.float()
            mean = xf.mean(dims)
            var = xf.var(dims, correction=1 if self.unbiased and k > 1 else 0)
            if not self.first:
                mean = self.tau * module.running_mean.float() + (1 - self.tau) * mean
                var = self.tau * module.running_var.float() + (1 - self.tau) * var
        self.first = False
        with torch.no_grad():
            module.running_mean.copy_(mean.to(module.running_mean.dtype))
            module.running_var.copy_(var.to(module.running_var.dtype))


def _attach_trackers(model: nn.Module, bn: ExternalBN, mode: str) -> list:
    return [layer.register_forward_pre_hook(_StatisticsTracker(bn)) for layer in _require_bn(model, mode).values()]


def _result(scorer: Scorer) -> ExternalResult:
    score, loss = scorer.result()
    return ExternalResult(score, loss, scorer.count, scorer.class_counts())


@torch.no_grad()
def evaluate_global(model: nn.Module, data: Split, prepare: Callable[[Tensor], Tensor],
                    batch_size: int = 500, task: Task = CLASSIFICATION) -> ExternalResult:
    """Mode ``global``: the model as it is, in eval mode (its own BN statistics)."""
    net = copy.deepcopy(model).eval()
    scorer = task.scorer()
    for index in batch_order(len(data), batch_size):
        x = prepare(data.x[index])
        scorer.add(net(x), task.target(data.y[index]).to(x.device))
    return _result(scorer)


@torch.no_grad()
def reestimate_bn_statistics(model: nn.Module, data: Split, prepare: Callable[[Tensor], Tensor],
                             bn: ExternalBN = ExternalBN()) -> nn.Module:
    """A copy of ``model`` whose BN running statistics were re-estimated over one pass of ``data`` (in the
    order of ``bn``), in eval mode: the statistics the ``after_pass`` protocol predicts with."""
    net = copy.deepcopy(model).eval()
    fold_bn_statistics_(net, data, prepare, bn)
    return net


@torch.no_grad()
def fold_bn_statistics_(model: nn.Module, data: Split, prepare: Callable[[Tensor], Tensor],
                        bn: ExternalBN = ExternalBN()) -> None:
    """In place: one pass of ``data`` (batches and order of ``bn``) through ``model``, already in eval mode, folding
    each BN layer's input statistics into its running statistics (see :class:`ExternalBN`)."""
    handles = _attach_trackers(model, bn, "test_time_bn")
    try:
        for index in batch_order(len(data), bn.batch_size, bn.shuffle_seed):
            model(prepare(data.x[index]))
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def evaluate_test_time_bn(model: nn.Module, data: Split, prepare: Callable[[Tensor], Tensor],
                          bn: ExternalBN = ExternalBN(), task: Task = CLASSIFICATION) -> ExternalResult:
    """Mode ``test_time_bn``: UniFed's test-time BN statistics, predictions ``online`` (each batch with the
    statistics just updated with it) or ``after_pass``; labels are used for the metrics only."""
    scorer = task.scorer()
    if len(data) == 0:
        return _result(scorer)
    batches = batch_order(len(data), bn.batch_size, bn.shuffle_seed)
    if bn.predict == "after_pass":
        net = reestimate_bn_statistics(model, data, prepare, bn)
    else:
        net = copy.deepcopy(model).eval()
        handles = _attach_trackers(net, bn, "test_time_bn")
    try:
        for index in batches:
            x = prepare(data.x[index])
            scorer.add(net(x), task.target(data.y[index]).to(x.device))
    finally:
        if bn.predict == "online":
            for h in handles:
                h.remove()
    return _result(scorer)


BN_STATISTICS = ("running_mean", "running_var")


def bn_state_keys(model: nn.Module, statistics: bool = False) -> list[str]:
    """The state_dict keys of every BN layer's ``weight`` and ``bias`` (what fedbn_average averages), and with
    ``statistics`` its ``running_mean`` and ``running_var`` too (what bn_average averages)."""
    names = ("weight", "bias", *(BN_STATISTICS if statistics else ()))
    keys = []
    for prefix, layer in bn_layers(model).items():
        dot = f"{prefix}." if prefix else ""
        keys += [dot + name for name in names if getattr(layer, name, None) is not None]
    return keys


def average_bn_layers(model: nn.Module, client_states: list[dict[str, Tensor]], weights: list[float] | None = None,
                      statistics: bool = False) -> dict[str, Tensor]:
    """The mean of the internal clients' BN ``weight`` and ``bias`` (FedBN App. G: "the averaged trainable BN
    parameters"), and with ``statistics`` of their running mean and variance too (bn_average), by ``model``'s
    state_dict keys. Uniform mean unless ``weights`` (normalized here) are given. ``client_states`` are state
    dicts holding each client's BN layers: its model's, or the global state overlaid with its local state."""
    mode = "bn_average" if statistics else "fedbn_average"
    if not client_states:
        raise ValueError(f"{mode} needs the BN layers of at least one internal client")
    if weights is None:
        w = [1.0 / len(client_states)] * len(client_states)
    else:
        if len(weights) != len(client_states) or any(x < 0 for x in weights) or sum(weights) <= 0:
            raise ValueError(f"weights must be {len(client_states)} non-negative numbers with a positive sum, "
                             f"got {weights}")
        w = [x / sum(weights) for x in weights]
    keys = bn_state_keys(model, statistics)
    if not statistics and not keys:
        raise ValueError("fedbn_average averages BN affine parameters, but the model's BN layers have none "
                         "(affine=False)")
    out = {}
    for key in keys:
        missing = [i for i, s in enumerate(client_states) if key not in s]
        if missing:
            raise ValueError(f"client state(s) {missing} lack the BN entry {key!r}: {mode} needs each internal "
                             "client's BN layers (the global state overlaid with its local state)")
        out[key] = sum(wi * s[key].detach().double() for wi, s in zip(w, client_states)).to(client_states[0][key].dtype)
    return out


@torch.no_grad()
def evaluate_fedbn_average(model: nn.Module, data: Split, prepare: Callable[[Tensor], Tensor],
                           client_states: list[dict[str, Tensor]], weights: list[float] | None = None,
                           bn: ExternalBN = FEDBN_APPENDIX_G, task: Task = CLASSIFICATION) -> ExternalResult:
    """Mode ``fedbn_average``: the internal clients' averaged BN affine parameters, statistics from the
    external client's data (population statistics over one pass, then prediction, by default)."""
    net = copy.deepcopy(model)
    net.load_state_dict(average_bn_layers(net, client_states, weights), strict=False)
    return evaluate_test_time_bn(net, data, prepare, bn, task)


@torch.no_grad()
def evaluate_bn_average(model: nn.Module, data: Split, prepare: Callable[[Tensor], Tensor],
                        client_states: list[dict[str, Tensor]], weights: list[float] | None = None,
                        batch_size: int = 500, task: Task = CLASSIFICATION) -> ExternalResult:
    """Mode ``bn_average``: the internal clients' averaged BN layers (affine and running statistics), then the
    model as it is: nothing is estimated on the external client."""
    net = copy.deepcopy(model)
    net.load_state_dict(average_bn_layers(net, client_states, weights, statistics=True), strict=False)
    return evaluate_global(net, data, prepare, batch_size, task)


def evaluate_external(model: nn.Module, data: Split, prepare: Callable[[Tensor], Tensor],
                      mode: str = "test_time_bn", bn: ExternalBN | None = None,
                      client_states: list[dict[str, Tensor]] | None = None, weights: list[float] | None = None,
                      eval_batch_size: int = 500, task: Task = CLASSIFICATION) -> ExternalResult:
    """One external client's score and loss under ``mode`` (one of EXTERNAL_MODES), by ``task`` (accuracy and
    cross-entropy by default). ``bn`` defaults to UniFed's settings for test_time_bn and to FEDBN_APPENDIX_G for
    fedbn_average; ``client_states`` (state dicts with the internal clients' BN layers) is needed by fedbn_average
    and bn_average only."""
    if mode == "global":
        return evaluate_global(model, data, prepare, eval_batch_size, task)
    if mode == "test_time_bn":
        return evaluate_test_time_bn(model, data, prepare, bn or ExternalBN(), task)
    if mode == "fedbn_average":
        if client_states is None:
            raise ValueError("mode 'fedbn_average' needs client_states: the internal clients' BN weight and bias")
        return evaluate_fedbn_average(model, data, prepare, client_states, weights, bn or FEDBN_APPENDIX_G, task)
    if mode == "bn_average":
        if client_states is None:
            raise ValueError("mode 'bn_average' needs client_states: the internal clients' BN layers")
        _require_bn(model, mode)
        return evaluate_bn_average(model, data, prepare, client_states, weights, eval_batch_size, task)
    raise ValueError(f"unknown external evaluation mode {mode!r}; choose one of {', '.join(EXTERNAL_MODES)}")
