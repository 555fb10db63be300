"""Server-side aggregation of client states.

The server update of FedAvg (McMahan et al. 2017): the weighted mean of the clients' values of every
shared entry. Aggregation streams: clients are added one at a time into one accumulator, so the
server never holds more than one extra copy of the shared state, however many clients report.
"""

from __future__ import annotations

import math

import torch

WEIGHTINGS = ("samples", "uniform")


def client_weights(num_samples: list[int], weighting: str) -> list[float]:
    """Aggregation weights p_k summing to one: by training-sample count (FedAvg) or uniform (FedBN code)."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"unknown weighting {weighting!r}; choose one of {', '.join(WEIGHTINGS)}")
    if not num_samples:
        raise ValueError("cannot aggregate zero clients")
    if weighting == "uniform":
        return [1.0 / len(num_samples)] * len(num_samples)
    total = sum(num_samples)
    if total <= 0:
        raise ValueError(f"clients report no training samples: {num_samples}")
    return [n / total for n in num_samples]


class UpdateError(RuntimeError):
    """A client's update cannot be aggregated (wrong keys, shapes or non-finite values)."""


class DivergenceError(UpdateError, FloatingPointError):
    """Training diverged: a client's loss or update is NaN or infinite.

    Also a ``FloatingPointError``, so callers that catch either keep working; ``federation.on_divergence:
    record`` ends only the diverged cell (the run goes on), ``stop`` (default) stops the run with it."""


def all_finite(value: torch.Tensor) -> bool:
    """True when no element is NaN or +-inf. Fast path: the sum (one read pass, no temporary) is finite
    whenever every element is, unless it overflows; only then is the element-wise check run."""
    if math.isfinite(float(value.sum())):
        return True
    return bool(torch.isfinite(value).all())


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the weighted mean of ``dtype`` values is summed in: the values' own for float32 and float64
    (float32 sums of K weighted clients round at about K * 6e-8 relative, far below SGD noise, and run 15x
    faster than mixed float32 -> float64 in-place adds on this CPU: benchmarks/performance.md); float32 for
    half and bfloat16."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


class WeightedMean:
    """Streaming weighted mean of state dicts.

    Floating tensors are averaged with the given weights. Integer tensors (BatchNorm's
    ``num_batches_tracked``) are counters, never averaged as floats: the aggregate takes their
    maximum, which does not depend on the order clients report in. (FedBN's official code copies
    client 0's counter instead; the counter only matters for BN with ``momentum=None``.)
    """

    def __init__(self, reference: dict[str, torch.Tensor]) -> None:
        self._reference = {k: (tuple(v.shape), v.dtype) for k, v in reference.items()}
        self._sum: dict[str, torch.Tensor] = {}
        self._weight = 0.0
        self.count = 0

    def add(self, state: dict[str, torch.Tensor], weight: float, client: str = "?") -> None:
        if set(state) != set(self._reference):
            extra = sorted(set(state) - set(self._reference))
            missing = sorted(set(self._reference) - set(state))
            raise UpdateError(f"client {client!r} sent the wrong entries: missing {missing}, unexpected {extra}")
        for key, value in state.items():
            shape, dtype = self._reference[key]
            if tuple(value.shape) != shape:
                raise UpdateError(
                    f"client {client!r} sent {key!r} with shape {tuple(value.shape)}, expected {shape}"
                )
            if value.is_floating_point():
                if not all_finite(value):
                    raise DivergenceError(
                        f"client {client!r} sent non-finite values in {key!r} (NaN or inf): its local training "
                        "diverged; lower the learning rate or check its data"
                    )
                acc = self._sum.get(key)
                if acc is None:
                    acc = self._sum[key] = torch.zeros(shape, dtype=accumulator_dtype(value.dtype), device=value.device)
                acc.add_(value.detach(), alpha=weight)  # in place, no temporary copy
            else:
                cur = self._sum.get(key)
                self._sum[key] = value.detach().clone() if cur is None else torch.maximum(cur, value)
        self._weight += weight
        self.count += 1

    def result(self) -> dict[str, torch.Tensor]:
        if self.count == 0:
            raise UpdateError("no client update to aggregate")
        if not math.isclose(self._weight, 1.0, rel_tol=1e-6):
            raise UpdateError(f"aggregation weights sum to {self._weight}, expected 1")
        return {k: v.to(self._reference[k][1]) for k, v in self._sum.items()}
