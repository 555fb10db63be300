"""Adaptive gradient clipping (Brock et al. 2021b; FedWon App. A.3, Eq. 4), usable with any method.

For every unit i of a parameter W with gradient G (a row: an output channel of a conv or an output
unit of a linear layer),

    if ||G_i|| / max(||W_i||, eps) > lambda:   G_i <- lambda * max(||W_i||, eps) / ||G_i|| * G_i

with Frobenius norms, ``eps = 1e-3`` and threshold ``lambda`` (FedWon: 0.64 on digits, 1.28 on
Office-Caltech-10 and DomainNet). FedWon does not say how units are defined nor which parameters
are clipped; this follows timm's ``adaptive_clip_grad`` with ``exclude_head``: a tensor of two or more
dimensions has one unit per slice along dim 0 (norms over all other dims, so a WSConv gain of shape
(C, 1, 1, 1) is clipped per channel), a vector or scalar (a bias) is one unit, and the final classifier
layer, weight and bias, is excluded (NFNets: "we do not clip the final linear layer"), which
``exclude_head=False`` turns off. DeepMind's NFNets code differs in two details: its gains are vectors of
shape (C,), clipped as one unit, and only the final layer's weight escapes clipping (its bias is clipped
with the other gains and biases). Both touch few, small tensors.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

AGC_EPS = 1e-3


def unitwise_norm(t: torch.Tensor) -> torch.Tensor:
    """Frobenius norm of each unit of ``t``, broadcastable to ``t``."""
    if t.ndim <= 1:
        return t.norm(2)
    return t.norm(2, dim=tuple(range(1, t.ndim)), keepdim=True)


@torch.no_grad()
def clip_unitwise_(params: Iterable[torch.Tensor], clip: float, eps: float = AGC_EPS) -> None:
    """Clip the ``.grad`` of every parameter in place, unit by unit (Eq. 4)."""
    if clip <= 0:
        raise ValueError(f"the AGC threshold lambda must be > 0, got {clip}")
    for p in params:
        if p.grad is None:
            continue
        max_norm = unitwise_norm(p.detach()).clamp_(min=eps).mul_(clip)
        grad_norm = unitwise_norm(p.grad)
        # the ratio test of Eq. 4: units within the threshold keep their gradient unchanged
        scale = torch.where(grad_norm > max_norm, max_norm / grad_norm.clamp(min=1e-12), torch.ones_like(grad_norm))
        p.grad.mul_(scale)


def head_parameter_names(model: nn.Module) -> set[str]:
    """Names of the parameters of the model's final classifier: the submodule the model names ``head``
    when it has one (the U-Net's 1 x 1 output conv, a per-pixel classifier), else the last ``nn.Linear``
    registered (the digit CNN, AlexNet, ResNet, DenseNet)."""
    head = getattr(model, "head", None)
    if isinstance(head, nn.Module):
        return {f"head.{n}" for n, _ in head.named_parameters()}
    last = None
    for prefix, module in model.named_modules():
        if isinstance(module, nn.Linear):
            last = prefix
    if last is None:
        return set()
    return {f"{last}.{n}" if last else n for n, _ in model.get_submodule(last).named_parameters(recurse=False)}


def agc_parameters(model: nn.Module, exclude_head: bool = True) -> list[torch.Tensor]:
    """The parameters AGC clips: all trainable ones but (by default) the final classifier's."""
    skip = head_parameter_names(model) if exclude_head else set()
    return [p for n, p in model.named_parameters() if p.requires_grad and n not in skip]
