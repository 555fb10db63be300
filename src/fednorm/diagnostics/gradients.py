"""Gradient dissimilarity across clients at the global model (HarmoFL Sec. 3.4, assumption B.2 and Eq. 8).

Every client's full-batch gradient g_i of its training loss is taken at the round's global model (with the
client's own local entries, e.g. its BN layers under FedBN, and the input pipeline of evaluation, e.g. the
global amplitude of HarmoFL), on the first ``samples`` of its training split, in training mode (batch
statistics, as local SGD sees them). Over the shared trainable parameters (the ones the server averages):

- ``dissimilarity`` = sum_i p_i ||g_i||^2 / ||sum_i p_i g_i||^2, the B^2 of HarmoFL's assumption B.2 with
  G = 0 (FedProx's "B-local dissimilarity"; 1 when every client has the same gradient). p_i are the run's
  aggregation weights: HarmoFL's B.2 writes the uniform 1/N, which this is under ``weighting: uniform`` (the
  HarmoFL presets); with sample weights it is FedProx's weighted form;
- ``pairwise`` = mean over client pairs of ||g_i - g_j||, the quantity HarmoFL's Eq. 8 bounds by eps;
- ``grad_sq_mean`` = sum_i p_i ||g_i||^2 and ``global_grad_sq`` = ||sum_i p_i g_i||^2.

The model's state is restored afterwards: the measurement changes nothing in the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..data.domain import Split
from ..methods.tasks import Task
from ..models.norm import buffers_kept


@dataclass(frozen=True)
class Dissimilarity:
    dissimilarity: float
    pairwise: float
    grad_sq_mean: float
    global_grad_sq: float

    def as_record(self) -> dict[str, float]:
        return {"dissimilarity": self.dissimilarity, "pairwise": self.pairwise, "grad_sq_mean": self.grad_sq_mean,
                "global_grad_sq": self.global_grad_sq}


def full_gradient(model: nn.Module, data: Split, task: Task, prepare: Callable[[torch.Tensor], torch.Tensor],
                  names: list[str], samples: int, batch_size: int) -> torch.Tensor:
    """The gradient of the mean training loss over the first ``samples`` of ``data`` with respect to the
    parameters ``names``, flattened into one vector (mini-batches weighted by their size)."""
    params = dict(model.named_parameters())
    missing = [n for n in names if n not in params]
    if missing:
        raise ValueError(f"parameters {missing[:3]} are not in the model")
    n = min(samples, len(data))
    if n == 0:
        raise ValueError("gradient dissimilarity needs training data on every client")
    model.train()
    model.zero_grad(set_to_none=True)
    starts = list(range(0, n, batch_size))
    if len(starts) > 1 and n - starts[-1] == 1:
        starts.pop()  # a trailing batch of one sample joins the previous one (BN batch statistics need two)
    for start, stop in zip(starts, starts[1:] + [n]):
        x = prepare(data.x[start:stop])
        y = task.target(data.y[start:stop]).to(x.device)
        # every mini-batch sees the model's statistics as they are: an FBN layer normalizes with its running
        # statistics, which a training forward would otherwise move for the next mini-batch of this measurement
        with buffers_kept(model):  # restored after backward, which may read the buffers (native BN)
            loss = task.loss(model(x), y) * ((stop - start) / n)
            loss.backward()
    grads = [params[k].grad if params[k].grad is not None else torch.zeros_like(params[k]) for k in names]
    flat = torch.cat([g.detach().reshape(-1).float() for g in grads])
    model.zero_grad(set_to_none=True)
    return flat


def dissimilarity(gradients: list[torch.Tensor], weights: list[float]) -> Dissimilarity:
    """The measures above from the clients' flattened gradients and aggregation weights p_i (summing to 1)."""
    if len(gradients) != len(weights) or not gradients:
        raise ValueError(f"need one weight per gradient, got {len(gradients)} gradients and {len(weights)} weights")
    g = torch.stack([t.double() for t in gradients])
    p = torch.tensor(weights, dtype=torch.float64, device=g.device)
    p = p / p.sum()
    grad_sq_mean = float((p * g.square().sum(dim=1)).sum())
    global_grad_sq = float((p[:, None] * g).sum(dim=0).square().sum())
    k = len(gradients)
    pairs = [float((g[i] - g[j]).norm()) for i in range(k) for j in range(i + 1, k)]
    pairwise = sum(pairs) / len(pairs) if pairs else 0.0
    ratio = grad_sq_mean / global_grad_sq if global_grad_sq > 0 else float("inf")
    return Dissimilarity(ratio, pairwise, grad_sq_mean, global_grad_sq)
