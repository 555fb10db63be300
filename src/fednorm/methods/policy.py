"""Norm state policies: which entries of a model's state a client keeps to itself.

Layers are selected by module type (every ``torch.nn.modules.batchnorm._BatchNorm`` subclass:
BatchNorm1d/2d/3d, SyncBatchNorm, lazy variants), never by a substring of the parameter name, so
the policies are correct on any torch model (torchvision names BN layers ``downsample.1``, ...).

| policy            | kept local by each client                                   | method    |
| ----------------- | ----------------------------------------------------------- | --------- |
| ``shared``        | nothing: every parameter and buffer is aggregated           | FedAvg    |
| ``local_bn``      | all BN state: weight, bias, running mean/var, counter       | FedBN     |
| ``local_bn_stats``| BN running mean/var and counter; BN weight/bias aggregated   | SiloBN    |
| ``local_all``     | everything (no communication)                               | SingleSet |
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

POLICIES: dict[str, str] = {
    "shared": "nothing stays local; every parameter and buffer (BN statistics included) is averaged",
    "local_bn": "all BatchNorm state (weight, bias, running mean/var, counter) stays on each client",
    "local_bn_stats": "BatchNorm running statistics stay on each client; BN weight and bias are averaged",
    "local_all": "every parameter and buffer stays on the client; nothing is communicated",
}

_BN_STAT_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"unknown norm state policy {policy!r}; choose one of {', '.join(POLICIES)}")
    return policy


def keeps_bn_state(policy: str) -> bool:
    """Whether ``policy`` is defined by keeping BatchNorm state on each client (FedBN, SiloBN): it needs a model
    with BatchNorm layers that hold state, or it would run as FedAvg."""
    return check_policy(policy) in ("local_bn", "local_bn_stats")


def keeps_bn_statistics(policy: str) -> bool:
    """Whether each client keeps its own BatchNorm running statistics under ``policy`` (FedBN, SiloBN, and
    SingleSet, which keeps everything), as opposed to statistics the server aggregates or shares."""
    return keeps_bn_state(policy) or policy == "local_all"


def local_state_keys(model: nn.Module, policy: str) -> frozenset[str]:
    """The ``state_dict`` keys that a client keeps to itself under ``policy``."""
    check_policy(policy)
    all_keys = model.state_dict().keys()
    if policy == "shared":
        return frozenset()
    if policy == "local_all":
        return frozenset(all_keys)
    local: set[str] = set()
    for prefix, module in model.named_modules():
        if not isinstance(module, _BatchNorm):
            continue
        dot = f"{prefix}." if prefix else ""
        names = [n for n, _ in module.named_parameters(recurse=False)] + [
            n for n, b in module.named_buffers(recurse=False) if b is not None
        ]
        for name in names:
            if policy == "local_bn" or name in _BN_STAT_BUFFERS:
                local.add(dot + name)
    missing = local - set(all_keys)
    assert not missing, f"policy selected keys not in state_dict: {sorted(missing)}"
    return frozenset(local)


def shared_state_keys(model: nn.Module, policy: str) -> list[str]:
    """The ``state_dict`` keys the server aggregates under ``policy``, in state_dict order."""
    local = local_state_keys(model, policy)
    return [k for k in model.state_dict() if k not in local]
