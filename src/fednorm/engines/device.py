"""Where training runs: the CPU, or a CUDA GPU when the machine has one (``federation.device``).

On a GPU the model, the global state, the clients' local states and the server's aggregation live on the
device; the datasets stay in host memory as uint8 and each batch is moved after its conversion to float
(:meth:`fednorm.engines.simulation.InProcessEngine` places it, with the memory format). Checkpoints are read
back to the host and moved, so a run can resume on another device; Flower messages travel as host arrays
and are moved on arrival (:class:`fednorm.engines.client_step.ClientRunner`). Random streams are the same
(batch order and client sampling come from CPU generators), but GPU kernels round differently from the CPU's:
numbers agree to float tolerance, not bit for bit.
"""

from __future__ import annotations

import re
from typing import Any

import torch

DEVICE_PATTERN = r"^(auto|cpu|cuda(:\d+)?)$"  # what federation.device accepts


class DeviceError(ValueError):
    """The configured device does not exist on this machine (checked when a run starts, not when a config is
    read: a GPU run's folder can be reported on a machine without one)."""


def resolve_device(device: str) -> torch.device:
    """``auto`` -> the first CUDA GPU when PyTorch sees one, else the CPU; ``cpu``, ``cuda``, ``cuda:N`` as set
    (a clear error when CUDA is asked for and not there)."""
    if not re.match(DEVICE_PATTERN, device):
        raise DeviceError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if device == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {device!r} asked for, but PyTorch sees no CUDA GPU on this machine "
                             f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); use device: cpu or auto")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise DeviceError(f"device {device!r} asked for, but this machine has {torch.cuda.device_count()} CUDA "
                             "GPU(s), numbered from 0")
    return resolved


def to_device(tree: Any, device: torch.device | str) -> Any:
    """``tree`` (tensors inside dicts, lists and tuples) with every tensor on ``device``; a tensor already there
    is returned as it is (no copy), so this is free on the CPU."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: to_device(v, device) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_device(v, device) for v in tree)
    return tree
