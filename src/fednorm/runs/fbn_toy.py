"""The 2-D Gaussian toy of the FBN paper (Guerraoui et al. 2024, Sections 3-4, Figs. 1-2).

n = 10 clients, one BN "layer" applied to the raw 2-D points (alpha = 1, zeta = 0). Class i is
N(mu_i, s^2 I) with mu_i = R (cos 2 pi i/n, sin 2 pi i/n), R = 10, s = 1. Every round each client gets a
fresh batch of m = 30 points and four normalizations are compared on the same points:

- ``centralized``: standard BN in train mode on the UNION of the n batches (Algorithm 1; the reference);
- ``naive``: every client normalizes with its own batch stats; the server averages the clients' running
  stats (:func:`~fednorm.methods.fbn_stats.aggregate_naive`), clients restart from that average;
- ``fbn``: every client normalizes with the SHARED previous running stats (init 0 / 1) and the server
  aggregates with (RM)/(RV) (:func:`~fednorm.methods.fbn_stats.client_running_stats`,
  :func:`~fednorm.methods.fbn_stats.aggregate_fbn`);
- ``fixbn``: ``naive`` for the first ``fixbn_switch`` rounds (default half), then every client normalizes
  with the server's averaged running stats frozen at the switch.

Metrics, per round then averaged over the rounds: the normalization error of Fig. 2c (mean Euclidean
distance between a scheme's normalized points and the centralized ones) and a separability score, the
(training) accuracy of a nearest-class-mean classifier fit on the scheme's normalized points of the
round (NCM is a linear classifier; ``classifier="logistic"`` uses sklearn's multinomial logistic
regression instead). Everything is float64 and deterministic given ``seed``.

Heterogeneity (the paper's sentence defining the toy's levels is garbled; choice made here): the
gamma-similarity partition of Section 4 applied to each round's points, with ``level = 1 - gamma``.
Each round draws m points from EACH Gaussian (the union batch, n*m points, m per class), puts a random
fraction gamma of them in a homogeneous pool dealt evenly to the clients (round(gamma*m) each), sorts the
rest by label and cuts it into n consecutive chunks, chunk i going to client i. level 0 = iid (every
client holds a random m-subset of the union), level 1 = the paper's extreme case (client i holds exactly
the m points of Gaussian i, labelled i). Consequence used by the tests: the union batch, hence the
centralized normalization and the FBN statistics (exact, Appendix A), are IDENTICAL at every level for a
given seed (the points and the partition use separate generators), so FBN's error cannot depend on the
level, while naive BN's grows with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from fednorm.figures import pyplot, save_figure
from fednorm.methods.fbn_stats import aggregate_fbn, aggregate_naive, client_running_stats

SCHEMES = ("centralized", "naive", "fbn", "fixbn")
DEFAULT_LEVELS = (0.0, 0.5, 0.9, 1.0)  # gamma = 1, 0.5, 0.1, 0; the paper shows four unnamed levels
CLASSIFIERS = ("ncm", "logistic")
F64 = torch.float64


def class_means(n: int = 10, radius: float = 10.0) -> np.ndarray:
    """mu_i = radius (cos 2 pi i/n, sin 2 pi i/n), i = 0..n-1 (the paper's i-1), shape (n, 2)."""
    angles = 2 * np.pi * np.arange(n) / n
    return radius * np.stack([np.cos(angles), np.sin(angles)], axis=1)


def sample_union(rng: np.random.Generator, means: np.ndarray, m: int, s: float) -> tuple[np.ndarray, np.ndarray]:
    """m points from each N(mu_j, s^2 I), in class order: points (n*m, 2) and labels (n*m,)."""
    n = len(means)
    labels = np.repeat(np.arange(n), m)
    return means[labels] + s * rng.standard_normal((n * m, 2)), labels


def partition(rng: np.random.Generator, n: int, m: int, level: float) -> list[np.ndarray]:
    """Client index sets of a class-ordered union batch of n*m points under gamma-similarity, gamma = 1-level.

    A random n*round(gamma*m) of the points form the homogeneous pool, dealt evenly; the others, kept in
    label order, are cut into n consecutive chunks of m - round(gamma*m) (Section 4.1 of the extraction).
    """
    if not 0.0 <= level <= 1.0:
        raise ValueError(f"heterogeneity level must be in [0, 1] (0 = iid, 1 = one Gaussian per client), got {level}")
    k_iid = int(round((1.0 - level) * m))
    perm = rng.permutation(n * m)
    pool = perm[: n * k_iid]
    rest = np.sort(perm[n * k_iid:])  # sorted indices = sorted by label (the union is in class order)
    chunks = rest.reshape(n, m - k_iid)
    deal = pool.reshape(n, k_iid)
    return [np.concatenate([chunks[i], deal[i]]) for i in range(n)]


def _normalize(x: Tensor, mean: Tensor, var: Tensor, eps: float) -> Tensor:
    return (x - mean) / torch.sqrt(var + eps)


def _batch_stats(x: Tensor) -> tuple[Tensor, Tensor]:
    """BN train-mode statistics: mean and BIASED variance per coordinate."""
    return x.mean(dim=0), x.var(dim=0, correction=0)


def ncm_accuracy(points: np.ndarray, labels: np.ndarray) -> float:
    """Training accuracy of the nearest-class-mean classifier fit on ``points`` (ties -> lowest class)."""
    classes = np.unique(labels)
    centroids = np.stack([points[labels == c].mean(axis=0) for c in classes])
    d2 = ((points[:, None, :] - centroids[None, :, :]) ** 2).sum(axis=2)
    return float((classes[d2.argmin(axis=1)] == labels).mean())


def logistic_accuracy(points: np.ndarray, labels: np.ndarray) -> float:
    """Training accuracy of sklearn's (multinomial, lightly regularized) logistic regression."""
    from sklearn.linear_model import LogisticRegression

    clf = LogisticRegression(C=100.0, max_iter=2000)
    return float(clf.fit(points, labels).score(points, labels))


def run_toy(
    level: float,
    rounds: int = 100,
    seed: int = 0,
    *,
    n: int = 10,
    m: int = 30,
    radius: float = 10.0,
    s: float = 1.0,
    beta: float = 0.1,
    eps: float = 1e-5,
    fixbn_switch: int | None = None,
    classifier: str = "ncm",
) -> dict:
    """One toy run at heterogeneity ``level`` (0 = iid ... 1 = extreme); see the module docstring.

    Returns a dict with, for each scheme of :data:`SCHEMES`: ``error`` (mean over rounds of the mean
    distance to the centralized points; 0 for centralized), ``error_late`` (same over the rounds after the
    first half: FBN's error is mostly its warm-up from the (0, 1) init), ``accuracy`` / ``accuracy_final``
    (separability, mean over rounds / last round), ``error_per_round`` and ``accuracy_per_round`` arrays;
    plus ``shift`` (mean over rounds and clients of the norm of the mean of a client's centrally
    normalized points: a lower bound on the error of any scheme that centres each client on its own mean,
    such as naive BN — Jensen), ``running`` (final running mean / var of centralized BN, FBN, naive BN and
    the frozen FixBN stats) and ``points`` (the last round's raw and normalized points and labels).
    """
    if rounds < 1 or n < 1 or m < 2:
        raise ValueError(f"need rounds >= 1, n >= 1 and m >= 2 points per client, got {rounds}, {n}, {m}")
    if not 0.0 < beta < 1.0:
        raise ValueError(f"beta (BN momentum, weight of the new batch) must be in (0, 1), got {beta}")
    if classifier not in CLASSIFIERS:
        raise ValueError(f"unknown classifier {classifier!r}; choose one of {', '.join(CLASSIFIERS)}")
    switch = rounds // 2 if fixbn_switch is None else fixbn_switch
    if not 0 <= switch <= rounds:
        raise ValueError(f"fixbn_switch must be in [0, rounds={rounds}], got {switch}")
    score = ncm_accuracy if classifier == "ncm" else logistic_accuracy

    # separate streams: the union batches do not depend on the level, only their partition does
    point_rng = np.random.default_rng([seed, 0])
    part_rng = np.random.default_rng([seed, 1])
    means = class_means(n, radius)

    zero, one = torch.zeros(2, dtype=F64), torch.ones(2, dtype=F64)
    central_run = (zero, one)   # Algorithm 1 running stats on the union (PyTorch BN init 0 / 1)
    fbn_run = (zero, one)       # shared FBN stats, "by convention" 0 / 1 (Appendix A)
    naive_run = (zero, one)     # server-averaged naive stats; also FixBN's phase 1
    frozen = naive_run if switch == 0 else None

    err = {k: np.zeros(rounds) for k in SCHEMES}
    acc = {k: np.zeros(rounds) for k in SCHEMES}
    shift = np.zeros(rounds)
    for t in range(rounds):
        raw, labels = sample_union(point_rng, means, m, s)
        clients = partition(part_rng, n, m, level)
        x = torch.from_numpy(raw)
        out = {k: torch.empty_like(x) for k in SCHEMES}

        mu, var = _batch_stats(x)
        out["centralized"] = _normalize(x, mu, var, eps)
        central_run = client_running_stats(x, *central_run, beta, num_clients=1)  # factor N/(N-1)

        out["fbn"] = _normalize(x, *fbn_run, eps)  # per-sample: same map for every client
        if frozen is not None:
            out["fixbn"] = _normalize(x, *frozen, eps)
        fbn_stats, naive_stats = [], []
        for idx in clients:
            xi = x[torch.from_numpy(idx)]
            out["naive"][idx] = _normalize(xi, *_batch_stats(xi), eps)
            fbn_stats.append(client_running_stats(xi, *fbn_run, beta, num_clients=n))
            naive_stats.append(client_running_stats(xi, *naive_run, beta, num_clients=1))  # local K/(K-1)
        fbn_run = aggregate_fbn(*(torch.stack(v) for v in zip(*fbn_stats)), beta, values_per_client=m)
        naive_run = aggregate_naive(*(torch.stack(v) for v in zip(*naive_stats)))
        if frozen is None:
            out["fixbn"] = out["naive"]
            if t + 1 == switch:
                frozen = naive_run  # FixBN phase 2: the server's averaged stats, frozen

        ref = out["centralized"]
        shift[t] = np.mean([ref[torch.from_numpy(idx)].mean(dim=0).norm().item() for idx in clients])
        for k in SCHEMES:
            err[k][t] = (out[k] - ref).norm(dim=1).mean().item()
            acc[k][t] = score(out[k].numpy(), labels)

    late = slice(rounds // 2, rounds)
    return {
        "level": level, "gamma": 1.0 - level, "rounds": rounds, "seed": seed, "n": n, "m": m,
        "beta": beta, "classifier": classifier, "fixbn_switch": switch,
        "error": {k: float(err[k].mean()) for k in SCHEMES},
        "error_late": {k: float(err[k][late].mean()) for k in SCHEMES},
        "accuracy": {k: float(acc[k].mean()) for k in SCHEMES},
        "accuracy_final": {k: float(acc[k][-1]) for k in SCHEMES},
        "error_per_round": err,
        "accuracy_per_round": acc,
        "shift": float(shift.mean()),
        "running": {"centralized": central_run, "fbn": fbn_run, "naive": naive_run, "fixbn": frozen},
        "points": {"raw": raw, "labels": labels, **{k: out[k].numpy() for k in SCHEMES}},
    }


def toy_table(levels: Iterable[float] = DEFAULT_LEVELS, seeds: Sequence[int] = (0,), rounds: int = 100,
              **options) -> list[dict]:
    """One row per level, metrics averaged over ``seeds``: errors (all rounds; FBN also after warm-up),
    the shift lower bound and NCM separability per scheme. ``options`` go to :func:`run_toy`."""
    rows = []
    for level in levels:
        runs = [run_toy(level, rounds=rounds, seed=seed, **options) for seed in seeds]

        def avg(key: str, scheme: str | None = None) -> float:
            return float(np.mean([r[key] if scheme is None else r[key][scheme] for r in runs]))

        row = {"level": float(level), "gamma": 1.0 - float(level), "shift": avg("shift")}
        for k in SCHEMES[1:]:
            row[f"err_{k}"] = avg("error", k)
        row["err_fbn_late"] = avg("error_late", "fbn")
        for k in SCHEMES:
            row[f"acc_{k}"] = avg("accuracy", k)
        row["acc_fixbn_final"] = avg("accuracy_final", "fixbn")
        rows.append(row)
    return rows


_COLUMNS = (
    ("level", "level"), ("gamma", "gamma"), ("shift", "shift bound"),
    ("err_naive", "err naive"), ("err_fbn", "err FBN"), ("err_fixbn", "err FixBN"),
    ("err_fbn_late", "err FBN (2nd half)"),
    ("acc_centralized", "acc central"), ("acc_naive", "acc naive"), ("acc_fbn", "acc FBN"),
    ("acc_fixbn", "acc FixBN"), ("acc_fixbn_final", "acc FixBN (last)"),
)


def format_table(rows: list[dict]) -> str:
    """The rows of :func:`toy_table` as a markdown table."""
    lines = ["| " + " | ".join(h for _, h in _COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[k]:.2f}" if k in ("level", "gamma") else f"{r[k]:.3f}"
                                       for k, _ in _COLUMNS) + " |")
    return "\n".join(lines)


def plot_toy(path: str | Path, level: float = 1.0, levels: Iterable[float] = DEFAULT_LEVELS,
             rounds: int = 100, seed: int = 0, rows: list[dict] | None = None, **options) -> Path:
    """A PNG in the style of Figs. 1-2: the last round's raw, centralized, naive, FBN and FixBN points at
    heterogeneity ``level`` (coloured by label) and the normalization error vs heterogeneity (Fig. 2c).
    ``rows`` (from :func:`toy_table`) avoids recomputing the error curve."""
    plt = pyplot()

    run = run_toy(level, rounds=rounds, seed=seed, **options)
    rows = rows if rows is not None else toy_table(levels, seeds=(seed,), rounds=rounds, **options)
    pts = run["points"]
    fig, axes = plt.subplots(2, 3, figsize=(13, 8.5))
    panels = [("raw", "raw points"), ("centralized", "centralized BN"), ("naive", "naive BN"),
              ("fbn", "FBN"), ("fixbn", "FixBN")]
    for ax, (key, title) in zip(axes.flat, panels):
        ax.scatter(pts[key][:, 0], pts[key][:, 1], c=pts["labels"], cmap="tab10", s=8, vmin=0, vmax=9)
        if key != "raw":
            title += (f"\nerror {run['error'][key]:.2f} (mean over rounds), "
                      f"NCM acc {run['accuracy_final'][key]:.2f}")
        ax.set_title(f"{title}, round {rounds}", fontsize=9)
        ax.set_aspect("equal", adjustable="datalim")
        ax.grid(alpha=0.3)
    ax = axes.flat[5]
    xs = [r["level"] for r in rows]
    for key, label in (("err_naive", "naive BN"), ("err_fixbn", "FixBN"), ("err_fbn", "FBN")):
        ax.plot(xs, [r[key] for r in rows], marker="o", label=label)
    ax.set_xlabel("heterogeneity level (1 - gamma)")
    ax.set_ylabel(f"normalization error (mean over {rounds} rounds)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.suptitle(f"FBN 2-D toy: n = {run['n']}, m = {run['m']}, beta = {run['beta']}, level = {level}, seed {seed}")
    return save_figure(fig, path)


__all__ = ["SCHEMES", "DEFAULT_LEVELS", "class_means", "sample_union", "partition", "ncm_accuracy",
           "logistic_accuracy", "run_toy", "toy_table", "format_table", "plot_toy"]
