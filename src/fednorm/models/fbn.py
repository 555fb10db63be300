"""Federated BatchNorm layers (Guerraoui et al. 2024, Algorithm 2), drop-in for ``nn.BatchNorm1d/2d``.

Training mode normalizes with the SHARED running statistics of the previous step (not with the batch's
own statistics), so a sample's output does not depend on the rest of its batch and no gradient flows
through any statistic. Each training step also folds the batch's channel mean and biased variance into
the running statistics, unbiased with the federation-wide factor Kn/(Kn-1) (K values per channel in this
batch, n clients in the round: :func:`set_federation_size`), exactly as
:func:`fednorm.methods.fbn_stats.client_running_stats`. The server then combines the clients' running
statistics with (RM) / (RV) (:mod:`fednorm.methods.server`), which equals a centralized BatchNorm's
running statistics on the union of the clients' batches. Evaluation mode is standard BN evaluation with
the shared statistics. Initial statistics are 0 and 1 (the paper's convention, also PyTorch's).

With several local steps per round (local epochs; the paper's exactness holds for one step per round, DSGD):
step t normalizes with the layer's running statistics as they stand before it, i.e. the round's shared
statistics at the first step and, at later steps, those statistics with the client's own earlier batches of the
round folded in. The paper does not say which statistics later local steps use; the alternative, normalizing
every step of the round with the round's shared statistics, would need a frozen copy per layer. The client
reports the K of its last batch; the server's (RV) for unequal K (:meth:`ServerUpdate._fbn`) assumes one step per
round, so after local epochs the server's statistics are an approximation of centralized BN, not equal to it.

The state_dict keys are those of ``nn.BatchNorm*d`` (weight, bias, running_mean, running_var,
num_batches_tracked), so checkpoints and policies treat the layers like BatchNorm; the layers subclass
``_BatchNorm``, so the FedBN / SiloBN policies select them too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm


class _FederatedBatchNorm(_BatchNorm):
    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1, affine: bool = True,
                 **kw) -> None:
        if momentum is None or not 0 < momentum <= 1:
            raise ValueError(f"FederatedBatchNorm needs a momentum beta in (0, 1] (the EMA weight of the new batch), "
                             f"got {momentum}; the cumulative average (momentum=None) has no federated form here")
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine, track_running_stats=True, **kw)
        self.num_clients = 1  # n in Kn/(Kn-1); set by the engine each round (set_federation_size)
        self.last_count = 0  # K of the last training batch (values per channel), reported to the server

    def _reduce_dims(self, x: Tensor) -> tuple[int, ...]:
        return (0,) + tuple(range(2, x.dim()))

    def forward(self, x: Tensor) -> Tensor:
        self._check_input_dim(x)
        if self.training:
            # normalize with the shared statistics as they were BEFORE this batch (Algorithm 2 line 3)
            shared_mean, shared_var = self.running_mean.clone(), self.running_var.clone()
            with torch.no_grad():
                dims = self._reduce_dims(x)
                # statistics in at least float32 (bf16 activations under autocast), float64 kept
                xf = x.detach().to(torch.promote_types(x.dtype, torch.float32))
                mean = xf.mean(dim=dims)
                var = xf.var(dim=dims, correction=0)
                k = xf.numel() // mean.numel()
                kn = k * self.num_clients
                if kn < 2:
                    raise ValueError("FederatedBatchNorm needs at least 2 values per channel in the round's union "
                                     f"batch (K = {k} per client, n = {self.num_clients} clients)")
                beta = self.momentum
                self.running_mean.mul_(1 - beta).add_(mean.to(self.running_mean.dtype), alpha=beta)
                self.running_var.mul_(1 - beta).add_(var.to(self.running_var.dtype), alpha=beta * kn / (kn - 1))
                self.num_batches_tracked.add_(1)
                self.last_count = k
            return F.batch_norm(x, shared_mean, shared_var, self.weight, self.bias, False, 0.0, self.eps)
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)


class FederatedBatchNorm1d(_FederatedBatchNorm):
    """FBN over (N, C) or (N, C, L) inputs; K = N (or N * L) values per channel."""

    def _check_input_dim(self, x: Tensor) -> None:
        if x.dim() not in (2, 3):
            raise ValueError(f"expected 2D or 3D input (got {x.dim()}D input)")


class FederatedBatchNorm2d(_FederatedBatchNorm):
    """FBN over (N, C, H, W) inputs; K = N * H * W values per channel."""

    def _check_input_dim(self, x: Tensor) -> None:
        if x.dim() != 4:
            raise ValueError(f"expected 4D input (got {x.dim()}D input)")


FEDERATED_BN_TYPES = (FederatedBatchNorm1d, FederatedBatchNorm2d)


def federated_bn_layers(model: nn.Module) -> dict[str, _FederatedBatchNorm]:
    """The model's FBN layers by module name (the prefix of their state_dict keys)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, _FederatedBatchNorm)}


def set_federation_size(model: nn.Module, num_clients: int) -> None:
    """Tell every FBN layer how many clients take part in this round (n of the Kn/(Kn-1) unbiasing)."""
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    for layer in federated_bn_layers(model).values():
        layer.num_clients = num_clients


def convert_to_federated_bn(model: nn.Module, prefix: str = "") -> nn.Module:
    """Swap every ``nn.BatchNorm1d/2d`` of ``model`` (in place) for its FBN twin, keeping its state, dtype,
    device and training mode. A BatchNorm without running statistics or with the cumulative average
    (``momentum=None``) has no FBN twin: refused, naming the layer."""
    for name, child in list(model.named_children()):
        path = f"{prefix}{name}"
        if isinstance(child, (nn.BatchNorm1d, nn.BatchNorm2d)) and not isinstance(child, _FederatedBatchNorm):
            if not child.track_running_stats:
                raise ValueError(f"BatchNorm layer {path!r} keeps no running statistics (track_running_stats=False): "
                                 "FBN shares running statistics, so build it with track_running_stats=True")
            if child.momentum is None:
                raise ValueError(f"BatchNorm layer {path!r} has momentum=None (cumulative average), which has no "
                                 "federated form: give it a momentum in (0, 1], e.g. 0.1")
            cls = FederatedBatchNorm2d if isinstance(child, nn.BatchNorm2d) else FederatedBatchNorm1d
            new = cls(child.num_features, eps=child.eps, momentum=child.momentum, affine=child.affine)
            reference = child.running_mean
            new.to(device=reference.device, dtype=reference.dtype)
            new.load_state_dict(child.state_dict())
            new.train(child.training)
            setattr(model, name, new)
        else:
            convert_to_federated_bn(child, f"{path}.")
    return model
