import numpy as np
import pytest
import torch

from fednorm.data.partition import (dirichlet_client_mix_partition, dirichlet_partition, gamma_similarity_partition,
                                    iid_partition, label_skew_clients)

LABELS = torch.arange(1000) % 10  # 100 samples per class


def assert_disjoint_cover(parts, n):
    flat = torch.cat(parts)
    assert len(flat) == n and len(set(flat.tolist())) == n


def test_iid_partition_is_a_seeded_equal_split():
    parts = iid_partition(LABELS, 7, seed=1)
    assert_disjoint_cover(parts, 1000)
    assert max(len(p) for p in parts) - min(len(p) for p in parts) <= 1
    assert all(torch.equal(a, b) for a, b in zip(parts, iid_partition(LABELS, 7, seed=1)))
    assert not all(torch.equal(a, b) for a, b in zip(parts, iid_partition(LABELS, 7, seed=2)))


def test_gamma_zero_gives_each_client_one_class_and_gamma_one_is_iid():
    parts = gamma_similarity_partition(LABELS, 10, gamma=0.0)
    assert_disjoint_cover(parts, 1000)
    assert [sorted(set(LABELS[p].tolist())) for p in parts] == [[c] for c in range(10)]
    iid = gamma_similarity_partition(LABELS, 10, gamma=1.0, seed=3)
    assert_disjoint_cover(iid, 1000)
    assert all(len(set(LABELS[p].tolist())) == 10 for p in iid)


def test_gamma_fraction_is_dealt_iid_and_sizes_are_equal():
    parts = gamma_similarity_partition(LABELS, 10, gamma=0.3, seed=0)
    assert_disjoint_cover(parts, 1000)
    assert {len(p) for p in parts} == {100}
    # each client: a 70-sample block of the label-sorted rest (at most two adjacent classes, as block
    # edges need not fall on class edges) plus 30 iid samples
    for p in parts:
        counts = torch.bincount(LABELS[p], minlength=10).sort(descending=True).values
        assert counts[:2].sum() >= 70 and counts[0] < 100


@pytest.mark.parametrize("n,gamma", [(1000, 0.013), (1003, 0.3), (25, 0.96), (14400, 0.01), (997, 0.0), (997, 1.0)])
def test_gamma_sizes_are_equal_when_nothing_divides_evenly(n, gamma):
    """Client sizes are np.array_split's (differing by at most one), whatever the iid share rounds to; each
    client holds exactly its iid share of one common uniform draw plus a block of the label-sorted rest."""
    labels = torch.arange(n) % 10
    parts = gamma_similarity_partition(labels, 10, gamma=gamma, seed=1)
    assert_disjoint_cover(parts, n)
    assert [len(p) for p in parts] == [len(a) for a in np.array_split(np.arange(n), 10)]
    n_iid = int(round(gamma * n))
    order = np.random.default_rng(1).permutation(n)
    iid = [set(a.tolist()) for a in np.array_split(order[:n_iid], 10)]
    # the rest, sorted by label (ties in draw order), cut into consecutive blocks that fill each client up
    rest = order[n_iid:]
    rest = rest[np.argsort(labels.numpy()[rest], kind="stable")]
    fill = np.cumsum([0] + [len(a) - len(share) for a, share in zip(np.array_split(np.arange(n), 10), iid)])
    for k, (p, share) in enumerate(zip(parts, iid)):
        assert share <= set(p.tolist())
        assert set(p.tolist()) - share == set(rest[fill[k]:fill[k + 1]].tolist())
        block = sorted(set(p.tolist()) - share, key=lambda i: (int(labels[i]), i))
        if block:  # the rest of client k is one run of consecutive labels (sorted order is by label)
            classes = sorted({int(labels[i]) for i in block})
            assert classes == list(range(classes[0], classes[-1] + 1))


def test_dirichlet_skew_grows_as_alpha_shrinks_and_respects_min_size():
    def mean_classes(alpha):
        parts = dirichlet_partition(LABELS, 10, alpha, seed=0, min_size=5)
        assert_disjoint_cover(parts, 1000)
        assert min(len(p) for p in parts) >= 5
        return sum((torch.bincount(LABELS[p], minlength=10) >= 5).sum().item() for p in parts) / 10

    assert mean_classes(0.1) < mean_classes(1.0) < mean_classes(100.0)
    a = dirichlet_partition(LABELS, 10, 0.5, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a, dirichlet_partition(LABELS, 10, 0.5, seed=4)))
    assert not all(torch.equal(x, y) for x, y in zip(a, dirichlet_partition(LABELS, 10, 0.5, seed=5)))
    with pytest.raises(ValueError, match="exceed"):
        dirichlet_partition(LABELS, 200, 0.5, min_size=10)
    with pytest.raises(ValueError, match="alpha must be > 0"):
        dirichlet_partition(LABELS, 10, 0.0)
    with pytest.raises(ValueError, match="no Dirichlet.*3 tries"):  # 99 of 100 samples on one client: never
        dirichlet_partition(LABELS, 10, 1e-3, min_size=99, max_tries=3)


def test_dirichlet_splits_each_class_by_its_own_draw_of_proportions():
    """The per-class rule, written out for two classes over three clients: per class, a seeded shuffle of its
    samples, then q ~ Dir(alpha 1), cut at int(cumsum(q) * n_c)."""
    labels = torch.tensor([0] * 10 + [1] * 10)
    parts = dirichlet_partition(labels, 3, 0.7, seed=11, min_size=0)
    rng = np.random.default_rng(11)
    expected = [[], [], []]
    for c in (0, 1):
        idx = rng.permutation(np.arange(10) + 10 * c)
        q = rng.dirichlet([0.7, 0.7, 0.7])
        cuts = [0, int(q[0] * 10), int((q[0] + q[1]) * 10), 10]
        for k in range(3):
            expected[k] += idx[cuts[k]:cuts[k + 1]].tolist()
    assert [p.tolist() for p in parts] == [sorted(e) for e in expected]


def test_label_skew_clients_split_the_training_pool_and_share_the_test_split():
    from fednorm.data.partition import label_skew_clients

    g = torch.Generator().manual_seed(0)
    y = torch.arange(500) % 10
    x = torch.randint(0, 255, (500, 3, 8, 8), generator=g, dtype=torch.uint8)
    clients = label_skew_clients("d", x, y, scheme="gamma", num_clients=10, gamma=0.0, seed=0)
    assert [c.name for c in clients] == [f"d-{k}" for k in range(1, 11)]
    assert sum(c.num_train for c in clients) == 400 and all(len(c.test) == 100 for c in clients)
    assert all(c.test is clients[0].test for c in clients)
    # gamma = 0 and ten equal classes: one class per client
    assert all(len(set(c.train.y.tolist())) == 1 for c in clients)
    assert sorted(int(c.train.y[0]) for c in clients) == list(range(10))
    test = clients[0].test
    external = label_skew_clients("d", x, y, scheme="iid", num_clients=4, test=test)
    assert sum(c.num_train for c in external) == 500 and external[0].test is test
    with pytest.raises(ValueError, match="label-skew scheme"):
        label_skew_clients("d", x, y, scheme="shards", num_clients=2)
    # pool_size: the first pool_size images of the stratified training split are partitioned, no other
    from fednorm.data.protocol import pool_split

    train_idx, _ = pool_split(y, 0, None)
    small = label_skew_clients("d", x, y, scheme="iid", num_clients=4, pool_size=200, seed=0)
    given = {bytes(img.numpy()) for c in small for img in c.train.x}
    assert len(given) == sum(c.num_train for c in small) == 200
    assert given == {bytes(img.numpy()) for img in x[train_idx[:200]]}


def test_a_domains_evaluation_client_validates_on_every_clients_validation_split():
    """Under label skew one client's validation slice may hold one class: the domain's evaluation client (cross-device
    and label-skew runs) validates on the union of its clients' ones, and tests on the shared test split."""
    from fednorm.data.domain import ClientData, Split
    from fednorm.data.federation import domain_eval_clients

    def split(label, n):
        return Split(torch.zeros(n, 3, 4, 4, dtype=torch.uint8), torch.full((n,), label))

    test = split(9, 5)
    clients = [ClientData(f"d-{k}", "d", split(k, 6), test, val=split(k, 2)) for k in range(3)]
    clients.append(ClientData("e-0", "e", split(0, 6), test))
    evals = domain_eval_clients(clients)
    assert [c.name for c in evals] == ["d", "e"]
    assert evals[0].val.y.tolist() == [0, 0, 1, 1, 2, 2] and evals[0].test is test
    assert evals[1].val is None


def test_hsu_dirichlet_gives_equal_clients_whose_class_mix_is_drawn_around_the_class_prior():
    """Hsu et al. 2019 (the FBN paper's [14]): client k's class mix q_k ~ Dir(alpha p), equal client sizes. Over
    seeds, the first client's class shares average to p (E q = p, unequal classes here); small alpha puts nearly
    all of a client on one class, large alpha gives it about p."""
    labels = torch.tensor([0] * 400 + [1] * 300 + [2] * 200 + [3] * 100)
    prior = np.array([0.4, 0.3, 0.2, 0.1])

    def first_shares(alpha, seeds=range(300)):
        out = []
        for seed in seeds:
            parts = dirichlet_client_mix_partition(labels, 10, alpha, seed=seed)
            out.append(np.bincount(labels[parts[0]].numpy(), minlength=4) / len(parts[0]))
        return np.array(out)

    parts = dirichlet_client_mix_partition(labels, 7, 0.5, seed=1)
    assert_disjoint_cover(parts, 1000)
    assert [len(p) for p in parts] == [143, 143, 143, 143, 143, 143, 142]
    assert all(torch.equal(a, b) for a, b in zip(parts, dirichlet_client_mix_partition(labels, 7, 0.5, seed=1)))
    assert not all(torch.equal(a, b) for a, b in zip(parts, dirichlet_client_mix_partition(labels, 7, 0.5, seed=2)))
    np.testing.assert_allclose(first_shares(1.0).mean(0), prior, atol=0.05)
    assert first_shares(0.01, range(50)).max(1).mean() > 0.95
    large = first_shares(1e4, range(50))  # q ~ p: only the multinomial's noise (about 0.05 on 100 samples) is left
    np.testing.assert_allclose(large.mean(0), prior, atol=0.02)
    assert large.max(1).mean() < 0.5 and (large > 0).all()
    with pytest.raises(ValueError, match="alpha must be > 0"):
        dirichlet_client_mix_partition(labels, 10, 0.0)


def test_label_skew_clients_take_the_dirichlet_form_asked_for():
    x = torch.zeros(1250, 1, 2, 2, dtype=torch.uint8)
    y = torch.arange(1250) % 10
    sizes = {form: [c.num_train for c in label_skew_clients("d", x, y, scheme="dirichlet", num_clients=5, alpha=0.3,
                                                            dirichlet_form=form)]
             for form in ("per_class", "per_client")}
    assert sizes["per_client"] == [200] * 5  # Hsu's equal sizes (the 80 % training part of 1,250)
    assert len(set(sizes["per_class"])) > 1 and sum(sizes["per_class"]) == 1000
    with pytest.raises(ValueError, match="Dirichlet form"):
        label_skew_clients("d", x, y, scheme="dirichlet", num_clients=5, dirichlet_form="per_pixel")
