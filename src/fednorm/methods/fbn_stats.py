"""Federated BatchNorm (FBN) running statistics: the client step and the server aggregation.

Guerraoui et al. 2024, "Overcoming the Challenges of Batch Normalization in Federated Learning",
Algorithm 2 and Appendix A. Each client starts from the SHARED previous running stats (m, v), folds its
batch into them with the federation-wide unbiasing factor Kn/(Kn-1), and the server recovers the
between-client variance from the spread of the clients' running means (RV).

Exactness: with equal K per client, one local step per round and all n clients starting from the same
shared (m, v), the server's (m, v) equal the running stats of centralized BatchNorm (Algorithm 1,
momentum beta) run on the union of the n batches (law of total variance, Appendix A). With E > 1 local
steps per round (RM) still holds but (RV) does not: the final running means only reveal the weighted SUM
of the per-step deviations, not the sum of their squares (extraction 1.6), so exactness is lost; the paper
covers only one step per round (DSGD).

Pure tensor math over per-channel statistics: ``means``/``vars`` are stacked along dim 0, one row per client.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

Aggregator = Callable[[Tensor], Tensor]


def _unbias(values_per_client: int, num_clients: int) -> float:
    """Kn/(Kn-1): the unbiasing factor of the union batch of Kn values (Algorithm 2 line 6)."""
    kn = values_per_client * num_clients
    if kn < 2:
        raise ValueError(f"need at least 2 values per channel in the union batch, got K*n = {kn}")
    return kn / (kn - 1)


def client_running_stats(
    batch: Tensor,
    shared_mean: Tensor,
    shared_var: Tensor,
    beta: float,
    num_clients: int,
    reduce_dims: Sequence[int] = (0,),
) -> tuple[Tensor, Tensor]:
    """One client's FBN running stats (Algorithm 2 lines 4-6).

    Channel-wise batch mean and BIASED variance over ``reduce_dims`` ((0,) for (N, C), (0, 2, 3) for
    (N, C, H, W)), folded into the shared stats: m_i = (1-beta) m + beta mean_i,
    v_i = (1-beta) v + beta Kn/(Kn-1) var_i, with K = values per channel in this batch and n = num_clients.
    """
    dims = tuple(reduce_dims)
    mean = batch.mean(dim=dims)
    var = batch.var(dim=dims, correction=0)
    k = batch.numel() // mean.numel()
    m = (1 - beta) * shared_mean + beta * mean
    v = (1 - beta) * shared_var + beta * _unbias(k, num_clients) * var
    return m, v


def aggregate_fbn(
    means: Tensor,
    vars: Tensor,
    beta: float,
    values_per_client: int,
    aggregator: Aggregator | None = None,
) -> tuple[Tensor, Tensor]:
    """Server FBN aggregation of the clients' running stats ``means``/``vars`` of shape (n, C).

    (RM) m = mean_i m_i;  (RV) v = mean_i v_i + Kn/((Kn-1) beta) * mean_i (m_i - m)^2  (Algorithm 2 l. 9-10).

    With ``aggregator`` (e.g. ``robust.robust_aggregator(...)``, applied along dim 0) every average is
    replaced by it, the natural robust reading of Section 5 (the paper does not spell it out):
    m = Agg(m_i), v = Agg(v_i) + Kn/((Kn-1) beta) * Agg((m_i - m)^2), deviations taken from the robust m
    (alternative: plain average of those squared deviations). A median or Krum of the squared deviations
    estimates a typical client's, which for this non-negative, right-skewed quantity is usually below their mean
    (Krum may even pick a client whose deviation is near 0), so even without an attack the robust v tends to be
    smaller than (RV)'s when the clients' means differ (label skew): robust FBN trades some of FBN's exactness for
    robustness. n is the number of rows, i.e. it counts
    Byzantine clients too, matching the n the clients used in Kn (alternative: n - f). An aggregator with NNM
    (nearest-neighbour mixing) mixes each of the three quantities (m_i, v_i, (m_i - m)^2) by its own nearest
    neighbours, so the neighbour sets may differ between them (the paper does not say; the alternative is to
    pick neighbours once on the concatenated (m_i, v_i)).
    v is clamped to >= 0: a no-op for honest inputs (every term is non-negative), a guard against
    attacked inputs (implementation choice, not in the paper; sqrt(v + eps) would otherwise be NaN).
    """
    if means.shape != vars.shape or means.dim() < 1:
        raise ValueError(f"means {tuple(means.shape)} and vars {tuple(vars.shape)} must share a shape (n, ...)")
    agg: Aggregator = aggregator if aggregator is not None else (lambda x: x.mean(dim=0))
    scale = _unbias(values_per_client, means.shape[0]) / beta
    m = agg(means)
    v = agg(vars) + scale * agg((means - m) ** 2)
    return m, v.clamp(min=0)


def aggregate_naive(means: Tensor, vars: Tensor) -> tuple[Tensor, Tensor]:
    """Naive BN (the paper's baseline, Section 1.2 of the extraction): plain averages of the clients' own
    running stats. Misses the between-client variance and unbiases with K/(K-1) instead of Kn/(Kn-1)."""
    return means.mean(dim=0), vars.mean(dim=0)


def aggregate_fbn_weighted(means: Tensor, vars: Tensor, beta: float, counts: Sequence[int],
                           previous_var: Tensor | None = None,
                           num_clients: int | None = None) -> tuple[Tensor, Tensor]:
    """(RM)/(RV) for clients whose batches hold different numbers of values per channel ``counts`` (K_i).

    Weights w_i = K_i / N (N = sum K_i): m = sum w_i m_i (exact). The paper assumes equal K "for
    simplicity"; for the variance each client unbiased its batch with its own f_i = K_i n/(K_i n - 1)
    (n = the rows, the round's clients), so with the shared variance v the clients started from
    (``previous_var``) the server takes each f_i back out and applies the union's N/(N - 1):

        v+ = (1-beta) v + N/(N-1) [ sum w_i (v_i - (1-beta) v) / f_i + sum w_i (m_i - m)^2 / beta ]

    which equals centralized BN's running variance on the union batch exactly (one local step per round,
    as (RV) itself), and reduces to :func:`aggregate_fbn` for equal counts. ``num_clients`` is the n the clients
    unbiased with when it is not the number of rows: a client that trained but whose reply the server left out (a
    Flower node's dropped or invalid reply) makes the rows fewer; with it, v+ is still centralized BN's on the
    union of the batches that arrived (N = the sum of their counts). Without ``previous_var``:
    v = sum w_i v_i + N/((N-1) beta) sum w_i (m_i - m)^2 (extraction pitfall 4), close to but not
    exactly centralized BN when the counts differ.
    """
    k = torch.as_tensor(list(counts), dtype=means.dtype, device=means.device)
    if k.numel() != means.shape[0] or (k <= 0).any():
        raise ValueError(f"need one positive count per client row, got {list(counts)} for {means.shape[0]} rows")
    total = float(k.sum())
    if total < 2:
        raise ValueError(f"need at least 2 values per channel in the union batch, got {total:g}")
    shape = (-1, *([1] * (means.dim() - 1)))
    w = (k / total).reshape(shape)
    m = (w * means).sum(dim=0)
    between = (w * (means - m) ** 2).sum(dim=0)
    if previous_var is None:
        v = (w * vars).sum(dim=0) + total / ((total - 1) * beta) * between
        return m, v.clamp(min=0)
    n = means.shape[0] if num_clients is None else num_clients
    if (k * n < 2).any():
        raise ValueError(f"every client needs K_i n >= 2 values per channel, got counts {list(counts)} with n = {n}")
    f = (k * n / (k * n - 1)).reshape(shape)
    prev = previous_var.to(means.dtype)
    within = (w * (vars - (1 - beta) * prev) / f).sum(dim=0)
    v = (1 - beta) * prev + total / (total - 1) * (within + between / beta)
    return m, v.clamp(min=0)
