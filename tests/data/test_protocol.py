"""The FedBN digits protocol (fednorm.data.protocol) on synthetic and real pools."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from sklearn.model_selection import StratifiedShuffleSplit

from fednorm.data.digits import load_digit_pool
from fednorm.data.protocol import (
    FEDBN_NUM_PARTITIONS,
    FEDBN_POOL_SIZE,
    fedbn_domain_clients,
    partition_bounds,
    stratified_split,
)

from ..conftest import real_data_dir

# USPS class counts of train + test (9298 images): unbalanced, 708 .. 1553 per class.
USPS_COUNTS = [1553, 1269, 929, 824, 852, 716, 834, 792, 708, 821]
# Boundaries of the official utils/data_preprocess.py split(): int(743.8 * n), n = 0..10.
OFFICIAL_EDGES = [int(743.8 * n) for n in range(11)]




def _pool(counts=USPS_COUNTS, seed=0):
    """Labels shuffled with the given class counts; each image encodes its own pool index in
    pixels (0, 0) and (0, 1), so a client's samples can be traced back to the pool."""
    rng = np.random.default_rng(seed)
    y = torch.from_numpy(rng.permutation(np.repeat(np.arange(len(counts)), counts)).astype(np.int64))
    idx = torch.arange(len(y))
    x = torch.zeros((len(y), 1, 2, 2), dtype=torch.uint8)
    x[:, 0, 0, 0] = (idx % 256).to(torch.uint8)
    x[:, 0, 0, 1] = (idx // 256).to(torch.uint8)
    return x, y


def _ids(split) -> torch.Tensor:
    """Pool indices of the samples of a Split built from _pool()."""
    return split.x[:, 0, 0, 0].long() + 256 * split.x[:, 0, 0, 1].long()


@pytest.fixture(scope="module")
def usps_like():
    return _pool()


# --- stratified_split ------------------------------------------------------------------------


def test_split_sizes_and_stratification(usps_like):
    _, y = usps_like
    train, test = stratified_split(y)
    assert (len(train), len(test)) == (7438, 1860)
    assert train.dtype == torch.int64 and test.dtype == torch.int64
    assert torch.equal(torch.sort(torch.cat([train, test])).values, torch.arange(len(y)))
    pool_counts = torch.bincount(y, minlength=10).double()
    for idx, frac in ((train, 0.8), (test, 0.2)):
        counts = torch.bincount(y[idx], minlength=10).double()
        assert (counts - frac * pool_counts).abs().max() <= 1.0


def test_split_is_sklearn_with_its_index_order(usps_like):
    _, y = usps_like
    train, test = stratified_split(y, 0.2, seed=0)
    # The official call: StratifiedShuffleSplit(n_splits=1, test_size=0.2, random_state=0) on
    # the images; the image content does not influence the indices.
    images = np.random.default_rng(5).random((len(y), 3))
    sss = StratifiedShuffleSplit(n_splits=1, test_size=0.2, random_state=0)
    ref_train, ref_test = next(sss.split(images, y.numpy()))
    assert train.tolist() == ref_train.tolist()
    assert test.tolist() == ref_test.tolist()


def test_split_seed(usps_like):
    _, y = usps_like
    a_train, a_test = stratified_split(y, seed=0)
    b_train, b_test = stratified_split(y, seed=0)
    c_train, _ = stratified_split(y, seed=1)
    assert torch.equal(a_train, b_train) and torch.equal(a_test, b_test)
    assert not torch.equal(a_train, c_train)
    assert not torch.equal(torch.sort(a_train).values, torch.sort(c_train).values)


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.2, 1.5])
def test_split_rejects_bad_fraction(usps_like, bad):
    with pytest.raises(ValueError, match="test_fraction"):
        stratified_split(usps_like[1], bad)


# --- partition_bounds ------------------------------------------------------------------------


def test_partition_bounds_match_official():
    bounds = partition_bounds(FEDBN_POOL_SIZE)
    assert [s for s, _ in bounds] + [bounds[-1][1]] == OFFICIAL_EDGES
    assert OFFICIAL_EDGES == [0, 743, 1487, 2231, 2975, 3719, 4462, 5206, 5950, 6694, 7438]
    sizes = [stop - start for start, stop in bounds]
    assert set(sizes) == {743, 744} and sum(sizes) == 7438
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(9))


@pytest.mark.parametrize("pool_len", [10, 127, 1274, 5555, 7438, 56000])
def test_partition_bounds_general(pool_len):
    bounds = partition_bounds(pool_len)
    assert len(bounds) == FEDBN_NUM_PARTITIONS
    assert bounds[0][0] == 0 and bounds[-1][1] == pool_len
    # The official float formula int(pool_len / 10 * n) for any pool, not only 7438.
    assert [s for s, _ in bounds] == [int(pool_len / 10 * n) for n in range(10)]
    sizes = [stop - start for start, stop in bounds]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_partition_bounds_errors():
    with pytest.raises(ValueError, match="non-empty"):
        partition_bounds(9)
    with pytest.raises(ValueError, match="num_partitions"):
        partition_bounds(100, 0)


# --- fedbn_domain_clients --------------------------------------------------------------------


@pytest.mark.parametrize(
    "percent, size",
    [(0.01, 74), (0.05, 371), (0.1, 743), (0.2, 1487), (0.3, 2231), (0.4, 2975), (0.6, 4462),
     (1.0, 7438)],
)
def test_percent_sizes_are_official(usps_like, percent, size):
    # Paper Table 6/14: 74, 371, 743, 1487, 2975, 4462, 7438 samples for 1 .. 100 %.
    x, y = usps_like
    (client,) = fedbn_domain_clients("usps", x, y, percent=percent)
    assert client.num_train == size
    assert len(client.test) == 1860
    # Client 0 is the official data: the leading samples of the shuffled training split.
    train_idx, test_idx = stratified_split(y)
    assert torch.equal(_ids(client.train), train_idx[:size])
    assert torch.equal(_ids(client.test), test_idx)
    assert torch.equal(client.train.y, y[train_idx[:size]])


def test_pool_truncated_to_7438():
    x, y = _pool([c * 3 for c in USPS_COUNTS])  # 27894 samples -> 22315 training samples
    (client,) = fedbn_domain_clients("big", x, y, percent=1.0)
    train_idx, _ = stratified_split(y)
    assert len(train_idx) == 22315
    assert torch.equal(_ids(client.train), train_idx[:7438])
    assert client.meta["train_pool_len"] == 7438 and "note" not in client.meta


def test_no_pool_size_cuts_each_domain_from_its_whole_training_split():
    """FedBN App. E.6 (Tables 15-16): pool_size None, so 10 % of a domain is 10 % of its own training split and the
    domains' clients differ in size as their datasets do (the paper's MNIST 5,600 against USPS 743)."""
    x, y = _pool([c * 3 for c in USPS_COUNTS])  # 27894 samples -> 22315 training samples
    (big,) = fedbn_domain_clients("big", x, y, percent=0.1, pool_size=None)
    train_idx, _ = stratified_split(y)
    # partition 0 of ten over the whole 22315-sample split: int(2231.5 * 1) samples, in the split's order
    assert big.num_train == int(22315 / 10) == 2231 and torch.equal(_ids(big.train), train_idx[:2231])
    assert big.meta["train_pool_len"] == 22315 and big.meta["requested_pool_size"] is None and "note" not in big.meta
    (whole,) = fedbn_domain_clients("big", x, y, percent=1.0, pool_size=None)
    assert torch.equal(_ids(whole.train), train_idx)
    (usps,) = fedbn_domain_clients("usps", *_pool(), percent=0.1, pool_size=None)
    assert usps.num_train == 743  # 7438 training images: the same as under the 7438 pool
    with pytest.raises(ValueError, match="positive int or None"):
        fedbn_domain_clients("usps", *_pool(), pool_size=0)
    # a file prepared from FedBN's partitions holds their 7,438-image pool only: no whole split to cut from
    with pytest.raises(ValueError, match=r"FedBN's partitions .*7438-image training pool only.*prepare svhn"):
        fedbn_domain_clients("svhn", *_pool(), pool_size=None, presplit=7438)


def test_many_clients_disjoint_cover_pool_share_test(usps_like):
    x, y = usps_like
    clients = fedbn_domain_clients("usps", x, y, percent=0.1, clients_per_domain=10)
    assert [c.name for c in clients] == [f"usps-{j}" for j in range(1, 11)]
    assert [c.num_train for c in clients] == [b - a for a, b in partition_bounds(7438)]
    ids = torch.cat([_ids(c.train) for c in clients])
    train_idx, _ = stratified_split(y)
    assert torch.equal(ids, train_idx[:7438])  # disjoint, in partition order, whole pool
    assert all(c.test is clients[0].test for c in clients)
    assert all(c.domain == "usps" for c in clients)
    assert [c.meta["partitions"] for c in clients] == [[j] for j in range(10)]


def test_clients_at_twenty_percent(usps_like):
    x, y = usps_like
    clients = fedbn_domain_clients("usps", x, y, percent=0.2, clients_per_domain=3)
    assert [c.meta["partitions"] for c in clients] == [[0, 1], [2, 3], [4, 5]]
    assert [c.meta["train_pool_range"] for c in clients] == [(0, 1487), (1487, 2975), (2975, 4462)]
    assert [c.num_train for c in clients] == [1487, 1488, 1487]
    sets = [set(_ids(c.train).tolist()) for c in clients]
    assert not (sets[0] & sets[1]) and not (sets[1] & sets[2]) and not (sets[0] & sets[2])


def test_clients_below_ten_percent_use_own_partition(usps_like):
    x, y = usps_like
    clients = fedbn_domain_clients("usps", x, y, percent=0.05, clients_per_domain=2)
    # Partition 0 has 743 samples, partition 1 has 744: int(744 * 0.05 * 10) = 372.
    assert [c.num_train for c in clients] == [371, 372]
    assert [c.meta["train_pool_range"] for c in clients] == [(0, 371), (743, 1115)]
    train_idx, _ = stratified_split(y)
    assert torch.equal(_ids(clients[1].train), train_idx[743:1115])


def test_meta_and_origin(usps_like):
    x, y = usps_like
    (client,) = fedbn_domain_clients("digits-r", x, y, percent=0.1, seed=3, origin="rendered")
    assert client.name == "digits-r" and client.origin == "rendered"
    meta = client.meta
    assert meta["percent"] == 0.1 and meta["split_seed"] == 3
    assert meta["partitions"] == [0] and meta["train_pool_range"] == (0, 743)
    assert (meta["pool_len"], meta["train_split_len"], meta["test_len"]) == (9298, 7438, 1860)
    assert (meta["requested_pool_size"], meta["train_pool_len"]) == (7438, 7438)
    train_idx, _ = stratified_split(y, seed=3)
    assert torch.equal(_ids(client.train), train_idx[:743])


def test_small_domain_uses_whole_split_and_says_so():
    x, y = _pool([160] * 9 + [153])  # 1593 samples, like Semeion
    (client,) = fedbn_domain_clients("semeion", x, y, percent=0.1)
    assert len(client.test) == 319
    assert client.meta["train_pool_len"] == 1274
    assert "1274" in client.meta["note"] and "7438" in client.meta["note"]
    assert client.num_train == 127  # partition 0 of int(127.4 * n) boundaries


def test_custom_pool_size(usps_like):
    x, y = usps_like
    (client,) = fedbn_domain_clients("usps", x, y, percent=1.0, pool_size=500)
    train_idx, _ = stratified_split(y)
    assert torch.equal(_ids(client.train), train_idx[:500])


@pytest.mark.parametrize("percent", [0.0, -0.1, 1.5])
def test_bad_percent(usps_like, percent):
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        fedbn_domain_clients("usps", *usps_like, percent=percent)


def test_percent_between_partitions_rejected(usps_like):
    with pytest.raises(ValueError, match="multiple of 0.1"):
        fedbn_domain_clients("usps", *usps_like, percent=0.15)


def test_bad_types(usps_like):
    with pytest.raises(TypeError, match="percent"):
        fedbn_domain_clients("usps", *usps_like, percent=True)
    with pytest.raises(TypeError, match="clients_per_domain"):
        fedbn_domain_clients("usps", *usps_like, clients_per_domain=2.0)
    with pytest.raises(ValueError, match="pool_size"):
        fedbn_domain_clients("usps", *usps_like, pool_size=0)


def test_bad_client_count(usps_like):
    with pytest.raises(ValueError, match="clients_per_domain must be >= 1"):
        fedbn_domain_clients("usps", *usps_like, clients_per_domain=0)
    with pytest.raises(ValueError, match="clients_per_domain <= 5") as info:
        fedbn_domain_clients("usps", *usps_like, percent=0.2, clients_per_domain=6)
    assert "12" in str(info.value) and "'usps'" in str(info.value)
    with pytest.raises(ValueError, match="at most 10 clients"):
        fedbn_domain_clients("usps", *usps_like, percent=0.05, clients_per_domain=11)


def test_too_small_domain():
    x, y = _pool([5, 5])  # 10 samples -> 8 for training
    with pytest.raises(ValueError, match="at least 10"):
        fedbn_domain_clients("tiny", x, y)
    x, y = _pool([12] * 10)  # 120 -> 96 training, partition 0 has 9: int(9 * 0.01 * 10) = 0
    with pytest.raises(ValueError, match="no training sample"):
        fedbn_domain_clients("tiny", x, y, percent=0.01)


def test_images_and_labels_must_match(usps_like):
    x, y = usps_like
    with pytest.raises(ValueError, match="length"):
        fedbn_domain_clients("usps", x, y[:-1])


# --- real data -------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize(
    "name, n_train, n_test, pool",
    [("mnist", 56000, 14000, 7438), ("usps", 7438, 1860, 7438), ("mnistm", 14400, 3600, 7438),
     ("semeion", 1274, 319, 1274)],
)
def test_real_protocol_sizes(name, n_train, n_test, pool):
    x, y = load_digit_pool(name, real_data_dir())
    train_idx, test_idx = stratified_split(y)
    assert (len(train_idx), len(test_idx)) == (n_train, n_test)
    (client,) = fedbn_domain_clients(name, x, y, percent=0.1)
    assert client.num_train == (743 if pool == 7438 else 127)
    assert len(client.test) == n_test
    assert client.meta["train_pool_len"] == pool
    assert client.train.x.shape[1:] == (3, 28, 28)


def test_even_partition_splits_the_pool_disjointly_over_many_clients():
    from fednorm.data.protocol import even_domain_clients

    y = torch.arange(1000) % 10
    ids = torch.arange(1000)  # each image encodes its own index in two pixels
    x = torch.stack([ids // 256, ids % 256], 1).view(1000, 2, 1, 1).to(torch.uint8)
    clients = even_domain_clients("dom", x, y, clients_per_domain=20, percent=1.0, pool_size=700, seed=0)
    assert len(clients) == 20 and [c.name for c in clients[:2]] == ["dom-1", "dom-2"]
    assert [c.num_train for c in clients] == [35] * 20  # 700 / 20
    got = torch.cat([c.train.x[:, 0, 0, 0].long() * 256 + c.train.x[:, 1, 0, 0].long() for c in clients])
    train_idx, test_idx = stratified_split(y, 0.2, 0)
    # client j holds the j-th contiguous slice of the FedBN pool, in the pool's order: disjoint, all of it
    assert got.tolist() == train_idx[:700].tolist()
    assert all(c.test is clients[0].test for c in clients)  # one shared test split, not copies
    assert len(clients[0].test) == len(test_idx)
    half = even_domain_clients("dom", x, y, clients_per_domain=7, percent=0.5, pool_size=700, seed=0)
    assert sum(c.num_train for c in half) == 350
    with pytest.raises(ValueError, match="at least one sample"):
        even_domain_clients("dom", x, y, clients_per_domain=800, pool_size=700)
