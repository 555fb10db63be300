"""The FedBN digits protocol: how one domain's image pool becomes its federated clients.

FedBN (Li et al., ICLR 2021, Sec. 5) truncates every digit dataset to 7438 training samples
("the smallest number", USPS) and gives each client 10 % of that (743 samples) by default, testing on
held-out data. The paper does not say how; the official code (github.com/med-air/FedBN) does this:

1. ``utils/data_preprocess.py``, ``process_*`` + ``stratified_split``: concatenate the dataset's
   original train and test sets and re-split the union with
   ``StratifiedShuffleSplit(n_splits=1, test_size=0.2, random_state=0)``; the training split is
   stored in sklearn's (shuffled) index order. USPS: 9298 -> 7438 / 1860, hence "7438".
2. ``utils/data_preprocess.py``, ``split``: ``part_len = 743.8``; partition ``n`` is
   ``train[int(part_len * n) : int(part_len * (n + 1))]`` for n = 0..9. The "random truncation to
   7438" of the paper is therefore just "the first 7438 samples of the shuffled training split".
3. ``utils/data_utils.py``, ``DigitsDataset``: ``percent >= 0.1`` -> concatenate partitions
   ``0 .. int(percent * 10) - 1``; ``percent < 0.1`` -> the first
   ``int(len(partition 0) * percent * 10)`` samples of partition 0 (1 % -> 74, 5 % -> 371).
   The test set is the dataset's whole 20 % test split, for every ``percent``.

The official code has one client per domain. For several clients per domain (paper Sec. 5.1 /
Table 7: "parcel each dataset into 10 subsets, one for each client") client ``j`` takes the same
amount as the official single client, starting at its own offset: partitions
``j*k .. j*k + k - 1`` for ``k = 10 * percent`` partitions, or the leading fraction of partition
``j`` for ``percent < 0.1``. Client 0 therefore reproduces the official data exactly. Every client
of a domain is tested on the domain's whole test split, as in the official code.

The functions work on any (x, y) pool (real files or rendered stand-ins); ``origin`` is passed
through to :class:`ClientData` so results tables can mark non-real domains.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from fednorm.data.domain import ClientData, Split

FEDBN_POOL_SIZE = 7438
FEDBN_NUM_PARTITIONS = 10
FEDBN_TEST_FRACTION = 0.2


def pool_split(y: torch.Tensor, seed: int, presplit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(train indices, test indices) of a domain pool: FedBN's stratified 80/20 split (``seed``), or, for a
    pool whose first ``presplit`` images are already FedBN's training pool in partition order and the rest its
    test split (``fednorm data prepare --fedbn-dir``: the official preprocessed files), that split as stored."""
    if presplit is None:
        return stratified_split(y, FEDBN_TEST_FRACTION, seed)
    if not 0 < presplit < len(y):
        raise ValueError(f"a pre-split pool needs 0 < train length < {len(y)}, got {presplit}")
    return torch.arange(presplit), torch.arange(presplit, len(y))


def stratified_split(
    y: torch.Tensor, test_fraction: float = FEDBN_TEST_FRACTION, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and test indices (int64) of a stratified shuffle split of labels ``y``.

    Exactly the official ``stratified_split`` (``utils/data_preprocess.py``):
    ``StratifiedShuffleSplit(n_splits=1, test_size=test_fraction, random_state=seed)``, indices kept
    in sklearn's order. sklearn rounds the test size up: 9298 -> 1860 test, 7438 train.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    labels = torch.as_tensor(y)
    if labels.ndim != 1:
        raise ValueError(f"labels must be a vector, got shape {tuple(labels.shape)}")
    from sklearn.model_selection import StratifiedShuffleSplit  # here: importing sklearn costs seconds

    labels_np = labels.cpu().numpy()
    sss = StratifiedShuffleSplit(n_splits=1, test_size=test_fraction, random_state=seed)
    # The features do not influence the split; sklearn only needs their count.
    train_idx, test_idx = next(sss.split(np.zeros(len(labels_np)), labels_np))
    return torch.from_numpy(train_idx.astype(np.int64)), torch.from_numpy(test_idx.astype(np.int64))


def partition_bounds(
    pool_len: int, num_partitions: int = FEDBN_NUM_PARTITIONS
) -> list[tuple[int, int]]:
    """``[start, stop)`` of each of ``num_partitions`` consecutive, near-equal partitions.

    The official ``split`` uses ``int(743.8 * n)``; ``(pool_len * n) // num_partitions`` is the
    same number computed without floating point (identical for every pool of 10 .. 99999 samples
    in 10 partitions, checked), and its last bound is always ``pool_len``. For 7438:
    0, 743, 1487, 2231, 2975, 3719, 4462, 5206, 5950, 6694, 7438 (partitions of 743 or 744).
    """
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    if pool_len < num_partitions:
        raise ValueError(
            f"cannot cut {pool_len} samples into {num_partitions} non-empty partitions"
        )
    edges = [(pool_len * n) // num_partitions for n in range(num_partitions + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _partitions_per_client(percent: float) -> int:
    """Whole partitions per client for ``percent >= 0.1`` (one partition = 10 %)."""
    k = int(round(percent * FEDBN_NUM_PARTITIONS))
    # The official code takes int(percent * 10) partitions, so 0.15 silently means 10 %. Neither
    # the paper nor the code defines a percent between two multiples of 10 %, so reject it
    # rather than truncate or round it.
    if not math.isclose(percent * FEDBN_NUM_PARTITIONS, k, abs_tol=1e-6):
        raise ValueError(
            f"percent >= 0.1 must be a multiple of 0.1 (whole partitions of 10 % of the pool), "
            f"got {percent}; below 0.1 any value is allowed (a fraction of one partition)"
        )
    return k


def _check_percent_and_clients(domain: str, percent: float, clients_per_domain: int, pool: str) -> int:
    """Validate ``percent`` / ``clients_per_domain`` of the FedBN protocol; whole partitions per
    client (0 = a fraction of one partition, for ``percent < 0.1``)."""
    if isinstance(percent, bool) or not isinstance(percent, numbers.Real):
        raise TypeError(f"percent must be a number, got {percent!r}")
    if not 0.0 < percent <= 1.0:
        raise ValueError(
            f"percent is the fraction of the {pool} training pool each client gets; "
            f"it must be in (0, 1], got {percent}"
        )
    if isinstance(clients_per_domain, bool) or not isinstance(clients_per_domain, int):
        raise TypeError(f"clients_per_domain must be an int, got {clients_per_domain!r}")
    if clients_per_domain < 1:
        raise ValueError(f"clients_per_domain must be >= 1, got {clients_per_domain}")

    if percent >= 0.1:
        per_client = _partitions_per_client(percent)
        if clients_per_domain * per_client > FEDBN_NUM_PARTITIONS:
            raise ValueError(
                f"{clients_per_domain} clients x {per_client} partitions ({percent:g} of the pool "
                f"each) need {clients_per_domain * per_client} of the {FEDBN_NUM_PARTITIONS} "
                f"disjoint partitions of domain {domain!r}; use clients_per_domain <= "
                f"{FEDBN_NUM_PARTITIONS // per_client} at percent={percent:g}"
            )
    else:
        per_client = 0  # a fraction of one partition
        if clients_per_domain > FEDBN_NUM_PARTITIONS:
            raise ValueError(
                f"at percent={percent:g} each client takes part of its own partition, so domain "
                f"{domain!r} can have at most {FEDBN_NUM_PARTITIONS} clients, "
                f"got clients_per_domain={clients_per_domain}"
            )
    return per_client


def _client_range(domain: str, j: int, per_client: int, bounds: list[tuple[int, int]],
                  percent: float) -> tuple[list[int], int, int]:
    """Partitions and ``[start, stop)`` in the training pool of client ``j`` (see the module docstring)."""
    if per_client:
        parts = list(range(j * per_client, (j + 1) * per_client))
        start, stop = bounds[parts[0]][0], bounds[parts[-1]][1]
    else:
        parts = [j]
        start, part_stop = bounds[j]
        # Same expression and evaluation order as the official DigitsDataset:
        # int(len(part) * percent * 10); e.g. 743 * 0.05 * 10 -> 371.
        stop = start + int((part_stop - start) * percent * 10)
    if stop <= start:
        raise ValueError(
            f"domain {domain!r}: client {j + 1} would get no training sample (partition of "
            f"{bounds[j][1] - bounds[j][0]} samples x {percent:g} x 10 < 1); use a larger "
            f"percent or a larger pool"
        )
    return parts, start, stop


def fedbn_domain_clients(
    domain: str,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    percent: float = 0.1,
    clients_per_domain: int = 1,
    pool_size: int | None = FEDBN_POOL_SIZE,
    seed: int = 0,
    origin: str = "real",
    presplit: int | None = None,
) -> list[ClientData]:
    """The clients of one domain under the FedBN digits protocol (see the module docstring).

    ``x``/``y`` is the domain's whole image pool (uint8 N x C x H x W, labels N). It is split
    80/20 (stratified, ``seed``); the first ``pool_size`` training indices form the training pool
    (all of them, noted in ``meta``, if the split is smaller), cut into 10 partitions. Each client
    gets ``percent`` of the training pool at its own offset and the whole test split. ``presplit``:
    the pool is FedBN's own files, its first ``presplit`` images the training pool (``pool_split``).
    ``pool_size=None``: the whole training split is the pool, so the domains' clients differ in size as their
    datasets do (FedBN App. E.6, Tables 15-16: 10 % is 5,600 MNIST images, 743 USPS ones).
    """
    per_client = _check_percent_and_clients(domain, percent, clients_per_domain,
                                            "whole-split" if pool_size is None else f"{pool_size}-sample")
    if pool_size is not None and (isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 1):
        raise ValueError(f"pool_size must be a positive int or None (the whole training split), got {pool_size!r}")

    if pool_size is None and presplit is not None:
        raise ValueError(
            f"domain {domain!r} was prepared from FedBN's partitions (--fedbn-dir): its file holds FedBN's "
            f"{presplit}-image training pool only, not the dataset's whole training split that pool_size null asks "
            f"for (FedBN App. E.6); prepare it from the official files (fednorm data prepare {domain}) or set a "
            "pool_size")
    pool = Split(x, y)  # validates dtype and shapes
    train_idx, test_idx = pool_split(pool.y, seed, presplit)
    train_pool_idx = train_idx[:pool_size]
    train_pool_len = len(train_pool_idx)
    if train_pool_len < FEDBN_NUM_PARTITIONS:
        raise ValueError(
            f"domain {domain!r}: the training pool has {train_pool_len} samples (training split "
            f"{len(train_idx)} of a pool of {len(pool)}, pool_size {pool_size}); at least "
            f"{FEDBN_NUM_PARTITIONS} are needed for {FEDBN_NUM_PARTITIONS} partitions"
        )
    bounds = partition_bounds(train_pool_len, FEDBN_NUM_PARTITIONS)
    test = pool.subset(test_idx)

    base_meta = {
        "protocol": "fedbn-digits",
        "percent": percent,
        "split_seed": seed if presplit is None else "the files' own split",
        "pool_len": len(pool),
        "train_split_len": len(train_idx),
        "test_len": len(test_idx),
        "requested_pool_size": pool_size,
        "train_pool_len": train_pool_len,
        "clients_per_domain": clients_per_domain,
    }
    if pool_size is not None and train_pool_len < pool_size:
        base_meta["note"] = (
            f"training split has only {train_pool_len} samples (< pool_size {pool_size}); "
            f"the whole split is the training pool, so partitions are "
            f"~{train_pool_len / FEDBN_NUM_PARTITIONS:g} samples instead of "
            f"~{pool_size / FEDBN_NUM_PARTITIONS:g}"
        )

    clients = []
    for j in range(clients_per_domain):
        parts, start, stop = _client_range(domain, j, per_client, bounds, percent)
        name = domain if clients_per_domain == 1 else f"{domain}-{j + 1}"
        meta = dict(
            base_meta,
            client_index=j,
            partitions=parts,
            train_pool_range=(start, stop),
            num_train=stop - start,
        )
        clients.append(
            ClientData(
                name=name,
                domain=domain,
                train=pool.subset(train_pool_idx[start:stop]),
                test=test,
                origin=origin,
                meta=meta,
            )
        )
    return clients


def even_domain_clients(
    domain: str,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    clients_per_domain: int,
    percent: float = 1.0,
    pool_size: int | None = FEDBN_POOL_SIZE,
    seed: int = 0,
    origin: str = "real",
    presplit: int | None = None,
) -> list[ClientData]:
    """Many clients per domain: ``percent`` of the domain's training pool split evenly and disjointly.

    FedWon's cross-device setting (Sec. 4.1): "we evenly split samples of each dataset into 20
    clients ... with a total of 100 clients" (1,000 clients: 200 per domain, Table 16). The pool is the
    FedBN one (stratified 80/20 split with ``seed``, first ``pool_size`` training samples); FedWon
    does not say how much of it is used, and its cross-device accuracies suggest the whole pool, so
    ``percent`` defaults to 1. Client ``j`` takes the j-th of ``clients_per_domain`` contiguous
    near-equal slices (the pool is already in shuffled order); every client shares the domain's test
    split (the same tensor, not a copy), which a cross-device run evaluates once per domain.
    """
    if not 0.0 < percent <= 1.0:
        raise ValueError(f"percent must be in (0, 1], got {percent}")
    if isinstance(clients_per_domain, bool) or not isinstance(clients_per_domain, int) or clients_per_domain < 1:
        raise ValueError(f"clients_per_domain must be a positive int, got {clients_per_domain!r}")
    pool = Split(x, y)
    train_idx, test_idx = pool_split(pool.y, seed, presplit)
    used = train_idx[:pool_size]
    used = used[: int(len(used) * percent)]
    if len(used) < clients_per_domain:
        raise ValueError(
            f"domain {domain!r}: {len(used)} training samples cannot give {clients_per_domain} clients at "
            "least one sample each; use fewer clients per domain or a larger percent"
        )
    test = pool.subset(test_idx)
    clients = []
    for j, (start, stop) in enumerate(partition_bounds(len(used), clients_per_domain)):
        clients.append(ClientData(
            name=f"{domain}-{j + 1}",
            domain=domain,
            train=pool.subset(used[start:stop]),
            test=test,
            origin=origin,
            meta={"protocol": "even", "percent": percent, "split_seed": seed, "client_index": j,
                  "train_pool_range": (start, stop), "num_train": stop - start},
        ))
    return clients


def fedbn_object_clients(
    domain: str,
    train: Split,
    test: Split,
    *,
    min_train_len: int,
    train_fraction: float,
    val_fraction: float,
    percent: float = 1.0,
    clients_per_domain: int = 1,
    partition: str = "fedbn",
    origin: str = "real",
) -> list[ClientData]:
    """The clients of one Office-Caltech10 / DomainNet domain under FedBN's object protocol.

    The official ``prepare_data`` (med-air/FedBN ``federated/fed_office.py``, ``fed_domainnet.py``)
    keeps each domain's fixed train and test lists and, with ``m`` the smallest train list of the
    federation, trains on the first ``int(train_fraction * m)`` samples of the train list (the
    "training pool": 62 on Office-Caltech10, 105 on DomainNet), validates on its last
    ``int(val_fraction * m)`` samples and tests on the whole test list. ``train`` is expected in
    the list's order (it is shuffled already), so no seed is involved.

    On top of that pool ``percent`` and ``clients_per_domain`` work as in the digits protocol:
    ``partition="fedbn"`` cuts the pool into ten partitions and gives each client ``percent`` of it
    (``percent=1`` with one client per domain is the official setting; the default 0.1 of the
    digits is a tenth of it), ``partition="even"`` splits ``percent`` of the pool evenly over the
    clients. Every client of a domain shares the validation and test splits.
    """
    if partition not in ("fedbn", "even"):
        raise ValueError(f"unknown partition {partition!r}; choose fedbn or even")
    if not isinstance(min_train_len, int) or min_train_len < 1:
        raise ValueError(f"min_train_len must be a positive int, got {min_train_len!r}")
    if min_train_len > len(train):
        raise ValueError(f"domain {domain!r}: min_train_len {min_train_len} exceeds its {len(train)} training samples")
    n_train = int(min_train_len * train_fraction)
    n_val = int(min_train_len * val_fraction)
    label = "FedBN's object protocol"
    if n_train < 1:
        raise ValueError(f"domain {domain!r}: {label} trains on int({train_fraction:g} x {min_train_len}) = 0 "
                         "samples; the smallest training list of the federation is too short")
    pool = train.subset(torch.arange(n_train))
    val = train.subset(torch.arange(len(train) - n_val, len(train))) if n_val else None
    base_meta = {
        "protocol": "fedbn-objects",
        "partition": partition,
        "percent": percent,
        "train_list_len": len(train),
        "min_train_len": min_train_len,
        "train_pool_len": n_train,
        "val_len": n_val,
        "test_len": len(test),
        "clients_per_domain": clients_per_domain,
    }
    if n_train + n_val > len(train):
        base_meta["note"] = (f"training pool ({n_train}) and validation ({n_val}) overlap in the {len(train)}-sample "
                             "train list, as in the official code")
    if partition == "fedbn":
        per_client = _check_percent_and_clients(domain, percent, clients_per_domain, f"{n_train}-sample")
        if n_train < FEDBN_NUM_PARTITIONS:
            raise ValueError(f"domain {domain!r}: the training pool has {n_train} samples; at least "
                             f"{FEDBN_NUM_PARTITIONS} are needed for {FEDBN_NUM_PARTITIONS} partitions")
        bounds = partition_bounds(n_train, FEDBN_NUM_PARTITIONS)
        ranges = [_client_range(domain, j, per_client, bounds, percent) for j in range(clients_per_domain)]
    else:
        if not 0.0 < percent <= 1.0:
            raise ValueError(f"percent must be in (0, 1], got {percent}")
        if isinstance(clients_per_domain, bool) or not isinstance(clients_per_domain, int) or clients_per_domain < 1:
            raise ValueError(f"clients_per_domain must be a positive int, got {clients_per_domain!r}")
        used = int(n_train * percent)
        if used < clients_per_domain:
            raise ValueError(f"domain {domain!r}: {used} training samples cannot give {clients_per_domain} clients at "
                             "least one sample each; use fewer clients per domain or a larger percent")
        ranges = [([j], start, stop) for j, (start, stop) in enumerate(partition_bounds(used, clients_per_domain))]
    clients = []
    for j, (parts, start, stop) in enumerate(ranges):
        name = domain if clients_per_domain == 1 and partition == "fedbn" else f"{domain}-{j + 1}"
        clients.append(ClientData(
            name=name, domain=domain, train=pool.subset(torch.arange(start, stop)), test=test, val=val,
            origin=origin,
            meta=dict(base_meta, client_index=j, partitions=parts, train_pool_range=(start, stop), num_train=stop - start),
        ))
    return clients
