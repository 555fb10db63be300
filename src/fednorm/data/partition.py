"""Label-skew partitioners: split one labelled pool into client index sets.

Each function returns a list of int64 index tensors, one per client, disjoint, in a deterministic
order for a given seed. They complement the feature-shift splits of :mod:`fednorm.data.protocol`
(one domain per client) for the papers' label-skew experiments (FedWon Sec. 5, FBN Sec. 4).
"""

from __future__ import annotations

import numpy as np
import torch


def _labels(labels: torch.Tensor) -> np.ndarray:
    y = torch.as_tensor(labels).cpu().numpy()
    if y.ndim != 1:
        raise ValueError(f"labels must be a vector, got shape {y.shape}")
    return y


def iid_partition(labels: torch.Tensor, num_clients: int, seed: int = 0) -> list[torch.Tensor]:
    """A seeded shuffle cut into ``num_clients`` near-equal parts."""
    n = len(_labels(labels))
    if not 1 <= num_clients <= n:
        raise ValueError(f"cannot split {n} samples over {num_clients} clients")
    order = np.random.default_rng(seed).permutation(n)
    return [torch.from_numpy(part.astype(np.int64)) for part in np.array_split(order, num_clients)]


def dirichlet_partition(
    labels: torch.Tensor, num_clients: int, alpha: float, seed: int = 0, min_size: int = 10, max_tries: int = 1000
) -> list[torch.Tensor]:
    """Dirichlet label skew, per class: for each class, proportions q ~ Dir(alpha * 1) over the clients and the
    class's samples split accordingly; client sizes differ. Redrawn until every client has ``min_size`` samples
    (the rule of FedMA / NIID-Bench). Small alpha is more skewed; alpha -> infinity approaches iid.

    The FBN paper (App. C.2) cites Hsu et al. 2019 for its Dirichlet split, whose form is per client
    (:func:`dirichlet_client_mix_partition`); this per-class form is the one of the authors' group's library
    (EPFL byzfl, ``dirichlet_niid_idx``, without the redraw) and the default (``data.dirichlet_form``).
    """
    y = _labels(labels)
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if num_clients * min_size > len(y):
        raise ValueError(f"{num_clients} clients x min_size {min_size} exceed the {len(y)} samples")
    rng = np.random.default_rng(seed)
    for _ in range(max_tries):
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for c in np.unique(y):
            idx = rng.permutation(np.flatnonzero(y == c))
            q = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(q)[:-1] * len(idx)).astype(int)
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [torch.tensor(sorted(p), dtype=torch.int64) for p in parts]
    raise ValueError(f"no Dirichlet({alpha}) draw in {max_tries} tries gave every client {min_size} samples; "
                     "lower min_size or raise alpha")


def dirichlet_client_mix_partition(labels: torch.Tensor, num_clients: int, alpha: float,
                                   seed: int = 0) -> list[torch.Tensor]:
    """Dirichlet label skew, per client (Hsu, Qi & Brown 2019, the FBN paper's reference [14]): client k's class
    mix q_k ~ Dir(alpha p), p the pool's class frequencies, and equal client sizes (``np.array_split``). Clients
    draw in order, each its size from q_k by a multinomial; a class that runs out leaves the draw, whose
    remaining proportions are renormalized (Hsu et al. do not say: their pools are never exhausted in
    expectation). With alpha -> 0 each client holds one class; alpha -> infinity approaches iid.
    """
    y = _labels(labels)
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    n = len(y)
    if not 1 <= num_clients <= n:
        raise ValueError(f"cannot split {n} samples over {num_clients} clients")
    rng = np.random.default_rng(seed)
    classes, counts = np.unique(y, return_counts=True)
    pools = [list(rng.permutation(np.flatnonzero(y == c))) for c in classes]
    remaining = counts.astype(np.int64)
    prior = counts / n
    sizes = [len(p) for p in np.array_split(np.arange(n), num_clients)]
    parts = []
    for size in sizes:
        q = rng.dirichlet(alpha * prior)
        take = np.zeros(len(classes), dtype=np.int64)
        need = size
        while need > 0:
            open_ = remaining - take > 0
            w = np.where(open_, q, 0.0)
            # q may put (numerically) all its mass on classes that ran out: then the rest by what is left
            w = w / w.sum() if w.sum() > 0 else (remaining - take) / (remaining - take).sum()
            draw = np.minimum(rng.multinomial(need, w), remaining - take)
            take += draw
            need -= int(draw.sum())
        part = []
        for c, t in enumerate(take):
            part += pools[c][:t]
            del pools[c][:t]
        remaining -= take
        parts.append(torch.tensor(sorted(part), dtype=torch.int64))
    return parts


def gamma_similarity_partition(labels: torch.Tensor, num_clients: int, gamma: float, seed: int = 0) -> list[torch.Tensor]:
    """FBN's gamma-similarity (after SCAFFOLD, Karimireddy et al. 2020): a fraction ``gamma`` of the pool
    is shuffled and dealt out iid; the rest is sorted by label and cut into ``num_clients`` consecutive
    chunks, one per client. gamma = 1 is iid; gamma = 0 gives each client a contiguous label block
    (one class each when classes and clients are equal in number and size).

    The paper does not say how the iid part is drawn; a seeded uniform draw without replacement is used.
    """
    y = _labels(labels)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    n = len(y)
    if not 1 <= num_clients <= n:
        raise ValueError(f"cannot split {n} samples over {num_clients} clients")
    rng = np.random.default_rng(seed)
    order = rng.permutation(n)
    n_iid = int(round(gamma * n))
    iid, rest = order[:n_iid], order[n_iid:]
    rest = rest[np.argsort(y[rest], kind="stable")]
    # client k holds as many samples as np.array_split(n) gives it ("disjoint and equal in size", FBN Sec. 4): its
    # iid share, then the sorted samples that fill it up (never negative: see the size arithmetic in the tests)
    sizes = np.array([len(p) for p in np.array_split(np.arange(n), num_clients)])
    iid_parts = np.array_split(iid, num_clients)
    rest_parts = np.split(rest, np.cumsum(sizes - np.array([len(p) for p in iid_parts]))[:-1])
    parts = [np.concatenate([a, b]) for a, b in zip(iid_parts, rest_parts)]
    return [torch.from_numpy(np.sort(p).astype(np.int64)) for p in parts]


LABEL_SKEW_SCHEMES = ("iid", "gamma", "dirichlet")
DIRICHLET_FORMS = ("per_class", "per_client")


def label_skew_clients(
    domain: str,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    scheme: str,
    num_clients: int,
    gamma: float = 1.0,
    alpha: float = 1.0,
    dirichlet_form: str = "per_class",
    pool_size: int | None = None,
    seed: int = 0,
    origin: str = "real",
    test=None,
    presplit: int | None = None,
):
    """``num_clients`` clients of one domain with label skew (FBN Sec. 4, FedWon Sec. 5).

    The domain's pool is split 80/20 (stratified, ``seed``, as the FedBN protocol; ``presplit``: the pool is FedBN's
    own files, whose stored split is kept, :func:`fednorm.data.protocol.pool_split`); the first
    ``pool_size`` training indices (all when None) are partitioned by ``scheme`` (``iid``, ``gamma``
    similarity or ``dirichlet`` with ``alpha`` in ``dirichlet_form``); every client is tested on the domain's whole test split
    (the FBN paper tests on CIFAR-10's test set). With ``test`` (a Split, e.g. CIFAR-10's official test
    set), the whole pool is training data and ``test`` is every client's test split. Clients are named
    ``<domain>-<k>``, k from 1.
    """
    from .domain import ClientData, Split
    from .protocol import pool_split

    if scheme not in LABEL_SKEW_SCHEMES:
        raise ValueError(f"unknown label-skew scheme {scheme!r}; choose one of {', '.join(LABEL_SKEW_SCHEMES)}")
    pool = Split(x, y)
    if test is None:
        train_idx, test_idx = pool_split(y, seed, presplit)
    else:
        train_idx, test_idx = torch.arange(len(y)), None
    if pool_size is not None:
        train_idx = train_idx[:pool_size]
    labels = y[train_idx]
    if scheme == "iid":
        parts = iid_partition(labels, num_clients, seed)
    elif scheme == "gamma":
        parts = gamma_similarity_partition(labels, num_clients, gamma, seed)
    elif dirichlet_form == "per_client":
        parts = dirichlet_client_mix_partition(labels, num_clients, alpha, seed)
    elif dirichlet_form == "per_class":
        parts = dirichlet_partition(labels, num_clients, alpha, seed, min_size=min(10, len(labels) // num_clients))
    else:
        raise ValueError(f"unknown Dirichlet form {dirichlet_form!r}; choose one of {', '.join(DIRICHLET_FORMS)}")
    test = pool.subset(test_idx) if test is None else test
    return [
        ClientData(name=f"{domain}-{k + 1}", domain=domain, train=pool.subset(train_idx[part]), test=test,
                   origin=origin, meta={"partition": scheme, "gamma": gamma, "alpha": alpha, "client_index": k,
                                        "classes": torch.bincount(labels[part], minlength=int(y.max()) + 1).tolist()})
        for k, part in enumerate(parts)
    ]
