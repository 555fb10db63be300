"""FedBN's convergence argument, checked numerically (FedBN Sec. 4 and App. F, Fig. 9).

Two pieces:

* :func:`gram_check` -- Corollary 4.6. For a two-layer ReLU network trained by gradient descent, FedAvg's loss
  decays at a rate set by mu0 = lambda_min(G_inf), FedBN's by mu0* = lambda_min(G*_inf) (Theorem 4.4, Corollary
  4.5), with (Def. 4.2) ``G_inf_pq = E_{v ~ N(0, alpha^2 I)}[relu(v.x_p) relu(v.x_q)]`` over all clients' points and
  ``G*_inf = G_inf * 1{p, q on the same client}``, the block diagonal of the clients' own Gram matrices. The
  expectation has a closed form, the degree-1 arc-cosine kernel (Cho & Saul 2009; the paper does not give it):
  ``alpha^2 |x_p| |x_q| / (2 pi) (sin t + (pi - t) cos t)``, t the angle between the points. Corollary 4.6 says
  mu0* = min_i lambda_min(G_inf_i) >= mu0 (eigenvalue interlacing of principal submatrices); the check samples
  clients whose centred inputs have different covariances (Assumption 4.1) and reports both.

* :func:`synthetic_run` -- App. F / Fig. 9: two clients, binary classes N(-1, Sigma_i) and N(+1, Sigma_i) in
  R^10 (the means the all -1 and all +1 vectors [inferred]), Sigma_1 = I and Sigma_2 with non-zero off-diagonal
  entries; a two-layer network with 100 hidden neurons, weights ~ N(0, alpha^2 I) and biases ~ N(0, alpha^2),
  alpha = 10; cross-entropy, SGD lr 1e-5, 600 steps. FedAvg and FedBN run on the library's engine, the
  training loss recorded per step. The paper states neither the sample count, the batch size, the loss reduction,
  where the BN sits, how often the clients communicate nor Sigma_2: here 500 points per class and client,
  full-batch steps, BN right after the hidden layer (before the ReLU, as the digit CNN), one step per round (every
  step communicated), and Sigma_2 tridiagonal (unit variances, ``rho`` = 0.4 between neighbouring coordinates),
  under which both classes stay separable enough for the ~100 % accuracy the paper reports (an equicorrelated
  0.8 would cap client 2 near 86 %). The lr: 1e-5 is read as a step on the loss SUMMED over the batch, i.e.
  1e-5 x 1,000 = 1e-2 on the mean cross-entropy the engine minimizes; on the mean, 1e-5 barely moves the
  alpha = 10 network in 600 steps (seed 0: loss 30.9 -> 21.2, accuracy 52 -> 60 %), which ``lr=1e-5`` reproduces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

SYNTHETIC_DIM = 10
SYNTHETIC_HIDDEN = 100
SYNTHETIC_ALPHA = 10.0
SYNTHETIC_LR = 1e-5
SYNTHETIC_STEPS = 600


# --- Corollary 4.6: the Gram matrices -------------------------------------------------------------------------


def arccos_gram(x: np.ndarray, alpha: float = 1.0) -> np.ndarray:
    """``G_pq = E_{v ~ N(0, alpha^2 I)}[relu(v.x_p) relu(v.x_q)]`` for the rows of ``x`` (closed form, float64)."""
    x = np.asarray(x, dtype=np.float64)
    norms = np.linalg.norm(x, axis=1)
    if np.any(norms == 0):
        raise ValueError("a zero input has no angle: the Gram matrix needs non-zero points (Assumption 4.1)")
    cos = np.clip((x @ x.T) / np.outer(norms, norms), -1.0, 1.0)
    theta = np.arccos(cos)
    return alpha**2 * np.outer(norms, norms) / (2 * math.pi) * (np.sin(theta) + (math.pi - theta) * cos)


@dataclass(frozen=True)
class GramCheck:
    mu0: float  # lambda_min(G_inf): FedAvg's rate constant (Theorem 4.4)
    mu0_star: float  # lambda_min(G*_inf): FedBN's (Corollary 4.5)
    per_client: tuple[float, ...]  # lambda_min of each client's own block G_inf_i

    @property
    def ratio(self) -> float:
        return self.mu0_star / self.mu0


def gram_check(clients: list[np.ndarray], alpha: float = 1.0) -> GramCheck:
    """mu0 and mu0* of Corollary 4.6 for the clients' input points (one array of rows per client)."""
    points = np.concatenate(clients)
    gram = arccos_gram(points, alpha)
    owner = np.repeat(np.arange(len(clients)), [len(c) for c in clients])
    star = gram * (owner[:, None] == owner[None, :])
    per_client = tuple(float(np.linalg.eigvalsh(gram[np.ix_(owner == i, owner == i)])[0]) for i in range(len(clients)))
    return GramCheck(float(np.linalg.eigvalsh(gram)[0]), float(np.linalg.eigvalsh(star)[0]), per_client)


def client_covariances(num_clients: int, dim: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Different input covariances per client (Assumption 4.1: not all identity): client 0 the identity, the
    others S = A A^T / dim + 0.1 I with A Gaussian (positive definite, off-diagonal entries)."""
    out = [np.eye(dim)]
    for _ in range(num_clients - 1):
        a = rng.standard_normal((dim, dim))
        out.append(a @ a.T / dim + 0.1 * np.eye(dim))
    return out


def gram_table(num_clients: int = 2, points: int = 50, dim: int = SYNTHETIC_DIM, seeds=(0, 1, 2),
               alpha: float = 1.0) -> list[dict]:
    """One row per seed: mu0, mu0*, their ratio, for ``num_clients`` clients of ``points`` centred Gaussian
    points each (covariances from :func:`client_covariances`)."""
    rows = []
    for seed in seeds:
        rng = np.random.default_rng(seed)
        covs = client_covariances(num_clients, dim, rng)
        clients = [rng.multivariate_normal(np.zeros(dim), cov, size=points) for cov in covs]
        check = gram_check(clients, alpha)
        rows.append({"seed": seed, "mu0": check.mu0, "mu0_star": check.mu0_star, "ratio": check.ratio,
                     "per_client": check.per_client})
    return rows


# --- App. F / Fig. 9: the synthetic experiment -----------------------------------------------------------------


def second_client_covariance(rho: float = 0.4) -> np.ndarray:
    """Sigma_2 of the synthetic experiment: unit variances, ``rho`` between neighbouring coordinates (tridiagonal;
    positive definite for |rho| < 1 / (2 cos(pi / 11)) = 0.52 in R^10)."""
    cov = np.eye(SYNTHETIC_DIM) + rho * (np.eye(SYNTHETIC_DIM, k=1) + np.eye(SYNTHETIC_DIM, k=-1))
    if np.linalg.eigvalsh(cov)[0] <= 0:
        raise ValueError(f"rho {rho} does not give a positive definite covariance (|rho| must be below 0.52)")
    return cov


def synthetic_clients(points_per_class: int = 500, rho: float = 0.4, seed: int = 0):
    """The two clients of App. F: (train, test) FeatureSplits, classes N(-1, S_i) and N(+1, S_i) in R^10, S_1 = I,
    S_2 = :func:`second_client_covariance`; test sets of the same size, drawn apart."""
    from ..data.domain import ClientData
    from ..data.medical._common import FeatureSplit

    rng = np.random.default_rng(seed)
    covs = [np.eye(SYNTHETIC_DIM), second_client_covariance(rho)]

    def split(cov):
        x = np.concatenate([rng.multivariate_normal(-np.ones(SYNTHETIC_DIM), cov, points_per_class),
                            rng.multivariate_normal(np.ones(SYNTHETIC_DIM), cov, points_per_class)])
        y = np.repeat([0, 1], points_per_class)
        order = rng.permutation(len(y))
        return FeatureSplit(torch.from_numpy(x[order]).float(), torch.from_numpy(y[order]).long())

    return [ClientData(f"client{i + 1}", f"gaussian{i + 1}", split(cov), split(cov), origin="synthetic")
            for i, cov in enumerate(covs)]


def synthetic_model(alpha: float = SYNTHETIC_ALPHA, seed: int = 0) -> nn.Module:
    """Linear(10, 100) -> BN -> ReLU -> Linear(100, 2), every weight ~ N(0, alpha^2), every bias ~ N(0, alpha^2)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(SYNTHETIC_DIM, SYNTHETIC_HIDDEN), nn.BatchNorm1d(SYNTHETIC_HIDDEN), nn.ReLU(),
                          nn.Linear(SYNTHETIC_HIDDEN, 2))
    with torch.no_grad():
        for layer in (model[0], model[3]):
            layer.weight.normal_(0.0, alpha)
            layer.bias.normal_(0.0, alpha)
    return model


def synthetic_run(method: str, steps: int = SYNTHETIC_STEPS, lr: float | None = None, seed: int = 0,
                  points_per_class: int = 500, rho: float = 0.4) -> dict[str, list[float]]:
    """Fig. 9 for one method (``fedavg`` or ``fedbn``): per step, the clients' mean training loss (the engine's
    record of the local step) and the mean test accuracy after the step (each client with its own BN under
    FedBN). Same data, initial model and batch order for every method given the seed. ``lr`` on the mean loss;
    None: the paper's 1e-5 on the summed loss (module docstring)."""
    from ..engines.simulation import Federation, InProcessEngine
    from ..methods import LocalTraining, resolve_method

    clients = synthetic_clients(points_per_class, rho, seed)
    batch = 2 * points_per_class  # one full-batch step per round
    training = LocalTraining(batch_size=batch, lr=SYNTHETIC_LR * batch if lr is None else lr)
    engine = InProcessEngine(synthetic_model(seed=seed), clients, resolve_method(method), training,
                             Federation(seed=seed, weighting="uniform", channels_last=False), lambda x: x)
    loss, acc = [], []
    for _ in range(steps):
        results = engine.run_round()
        loss.append(float(np.mean([r.mean_loss for r in results.values()])))
        acc.append(float(np.mean([e.accuracy for e in engine.evaluate()])))
    return {"loss": loss, "acc": acc}


def plot_synthetic(curves: dict[str, dict[str, list[float]]], path: Path) -> Path:
    """Fig. 9's panels: training loss (log scale) and test accuracy by step, one line per method."""
    from ..figures import pyplot, save_figure

    plt = pyplot()
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for method, c in curves.items():
        steps = range(1, len(c["loss"]) + 1)
        loss_ax.plot(steps, c["loss"], label=method)
        acc_ax.plot(steps, [100 * a for a in c["acc"]], label=method)
    loss_ax.set_yscale("log")
    loss_ax.set_ylabel("training loss (mean over the 2 clients)")
    acc_ax.set_ylabel("test accuracy (%, mean over the 2 clients)")
    for ax in (loss_ax, acc_ax):
        ax.set_xlabel("step (= round)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("FedBN App. F synthetic experiment (Fig. 9)", fontsize=10)
    return save_figure(fig, path)
