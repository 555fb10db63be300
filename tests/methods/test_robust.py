import pytest
import torch

from fednorm.methods.fbn_stats import aggregate_fbn, client_running_stats
from fednorm.methods.robust import (
    a_little_is_enough,
    alie_z,
    attack_statistics,
    coordinate_median,
    fall_of_empires,
    krum,
    nearest_neighbor_mixing,
    nearest_neighbors,
    robust_aggregator,
    sign_flip,
    trimmed_mean,
)

F64 = torch.float64


def t(*rows):
    return torch.tensor(rows, dtype=F64)


def _close(a, b, atol=1e-12):
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=F64), rtol=0, atol=atol)


def test_coordinate_median_by_hand():
    _close(coordinate_median(t(3, 1, 4, 1, 5)), 3.0)
    _close(coordinate_median(t(1, 2, 3, 10)), 2.5)  # even n: mean of the two middle values
    _close(coordinate_median(t([0, 9], [4, 1], [2, 5], [8, 3], [6, 7])), [4.0, 5.0])


def test_trimmed_mean_by_hand():
    _close(trimmed_mean(t(3, 1, 4, 1, 5), 1), 8 / 3)
    _close(trimmed_mean(t(3, 1, 4, 1, 5), 2), 3.0)
    _close(trimmed_mean(t([0, 9], [4, 1], [2, 5], [8, 3], [6, 7]), 1), [4.0, 5.0])
    x = torch.randn(6, 3, dtype=F64)
    _close(trimmed_mean(x, 0), x.mean(0))
    with pytest.raises(ValueError, match="2f < n"):
        trimmed_mean(x, 3)


def test_nnm_by_hand():
    # n - f = 3 nearest (self included): 0, 1, 3 mix to 4/3; 10 mixes with 3 and 1.
    _close(nearest_neighbor_mixing(t(0, 1, 3, 10), 1), [4 / 3, 4 / 3, 4 / 3, 14 / 3])
    x = t([0, 0], [1, 0], [0, 2], [5, 5])
    _close(nearest_neighbor_mixing(x, 1), [[1 / 3, 2 / 3]] * 3 + [[2.0, 7 / 3]])
    _close(nearest_neighbor_mixing(x, 0), x.mean(0).expand(4, 2))
    # neighbours by Euclidean distance: from (0, 0), (2, 2) at 2.83 is nearer than (3, 0) at 3 (by the L1 distance
    # it would be the other way round)
    _close(nearest_neighbor_mixing(t([0, 0], [3, 0], [2, 2]), 1), [[1.0, 1.0], [2.5, 1.0], [2.5, 1.0]])


def test_krum_by_hand():
    # f=1: scores over the n-f-2 = 2 nearest others: 0->5, 1->2, 2->5, 10->65, 11->82.
    _close(krum(t(0, 1, 2, 10, 11), 1), 1.0)
    x = t([0, 0], [1, 0], [0, 1], [9, 9], [1, 1])  # the four unit-square corners all score 2: first wins
    _close(krum(x, 1), [0.0, 0.0])
    # the scores sum SQUARED distances over the n-f-2 = 4 nearest: 3 -> 1+4+9+16 = 30 beats 2 -> 1+1+4+25 = 31
    # (by plain distances 2 would win, 9 against 10)
    _close(krum(t(0, 1, 2, 3, 7, 8, 9), 1), 3.0)
    with pytest.raises(ValueError, match="n > 2f"):
        krum(t(0, 1, 2, 3), 1)


@pytest.mark.parametrize("name,nnm", [("median", False), ("median", True), ("trimmed_mean", False),
                                      ("trimmed_mean", True), ("krum", False), ("mean", True)])
def test_identical_updates_are_returned(name, nnm):
    u = torch.randn(2, 3, dtype=F64)
    _close(robust_aggregator(name, 1, nnm)(u.expand(6, 2, 3).clone()), u)
    with pytest.raises(ValueError, match="unknown aggregator"):
        robust_aggregator("geomed", 1)


@pytest.mark.parametrize("rule", ["median", "trimmed_mean"])
def test_nnm_returns_the_honest_mean_when_attackers_sit_apart(rule):
    # n = 10, f = 3 as the FBN robust preset. FOE's copies of -0.1 x the honest mean are far from honest
    # statistics that sit close together: every honest row's 7 nearest rows are the 7 honest ones, NNM maps
    # all of them to the honest mean, and those 7 equal rows fill the middle of every coordinate's sorted 10
    # values, so the median and the trimmed mean both return the honest mean exactly (benchmarks/fbn.md).
    honest = 5.0 + 0.01 * torch.randn(7, 16, dtype=F64, generator=torch.Generator().manual_seed(0))
    rows = torch.cat([honest, fall_of_empires(honest, 3)])
    assert (nearest_neighbors(rows, 3)[:7].sort(dim=1).values == torch.arange(7)).all()
    _close(robust_aggregator(rule, 3, nnm=True)(rows), honest.mean(0), atol=1e-12)
    # without NNM the two rules differ, and neither returns the honest mean
    assert not torch.allclose(coordinate_median(rows), trimmed_mean(rows, 3))
    assert not torch.allclose(coordinate_median(rows), honest.mean(0))


def test_attacks_against_their_definitions():
    h = t([1, -2], [3, 0], [5, 4], [7, 2])
    mean, std = t(4, 1), h.std(0, correction=1)
    _close(sign_flip(h, 3), (-mean).expand(3, 2))
    _close(sign_flip(h, 2, own=True), -h[:2])
    _close(fall_of_empires(h, 3, eps=0.5), (-0.5 * mean).expand(3, 2))
    _close(a_little_is_enough(h, 7, 3, z=2.0), (mean - 2 * std).expand(3, 2))
    assert abs(alie_z(10, 3) - 0.5244) < 1e-4
    # s = floor(n/2 + 1) - f supporters needed: n = 20, f = 3 gives s = 8, z = Phi^-1(12/20); n = 11, f = 2 gives
    # s = 4, z = Phi^-1(7/11) (at n = 10, f = 3, s happens to equal f)
    assert abs(alie_z(20, 3) - 0.2533471031357998) < 1e-12
    assert abs(alie_z(11, 2) - 0.3487556955170447) < 1e-12
    _close(a_little_is_enough(h, 10, 3), (mean - alie_z(10, 3) * std).expand(3, 2))


def _honest_stats(seed, h=7, n=10, c=4, beta=0.1, b=8):
    """h honest clients with mildly different feature distributions, shared stats after a few rounds."""
    g = torch.Generator().manual_seed(seed)
    shift, scale = 2 + 0.3 * torch.randn(h, c, generator=g, dtype=F64), 1 + 0.2 * torch.rand(h, c, generator=g, dtype=F64)
    m, v = torch.full((c,), 2.0, dtype=F64), torch.ones(c, dtype=F64)
    xs = [torch.randn(b, c, generator=g, dtype=F64) * scale[i] + shift[i] for i in range(h)]
    ms, vs = zip(*(client_running_stats(x, m, v, beta, n, (0,)) for x in xs))
    return torch.stack(ms), torch.stack(vs), beta, b


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name,nnm", [("median", True), ("trimmed_mean", True), ("median", False),
                                      ("trimmed_mean", False)])
def test_robust_fbn_resists_sign_flip_while_averaging_is_pulled_away(seed, name, nnm):
    f = 3
    ms, vs, beta, k = _honest_stats(seed)
    ref_m, ref_v = aggregate_fbn(ms, vs, beta, k)
    bm, bv = attack_statistics("sign_flip", ms, vs, f)
    all_m, all_v = torch.cat([ms, bm]), torch.cat([vs, bv])
    plain_m, plain_v = aggregate_fbn(all_m, all_v, beta, k)
    rob_m, rob_v = aggregate_fbn(all_m, all_v, beta, k, aggregator=robust_aggregator(name, f, nnm))
    plain_err = max((plain_m - ref_m).abs().max(), (plain_v - ref_v).abs().max())
    rob_err = max((rob_m - ref_m).abs().max(), (rob_v - ref_v).abs().max())
    assert plain_err > 1.0
    assert rob_err < 0.01 * plain_err


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", ["median", "trimmed_mean"])
def test_robust_fbn_statistics_are_rm_and_rv_with_every_average_replaced_by_hand(seed, name):
    """Under sign flipping (f = 3 of 10): m = Agg(m_i), v = Agg(v_i) + Kn/((Kn-1) beta) Agg((m_i - m)^2), the
    deviations from the robust m, Kn counting all ten clients; Agg by sorting each coordinate by hand (median of
    ten: mean of the 5th and 6th; trimmed mean: mean of the 4th to 7th). Dropping the between-client term misses
    by that term, which the honest clients' spread makes non-negligible."""
    f = 3
    ms, vs, beta, k = _honest_stats(seed)
    bm, bv = attack_statistics("sign_flip", ms, vs, f)
    all_m, all_v = torch.cat([ms, bm]), torch.cat([vs, bv])
    keep = slice(4, 6) if name == "median" else slice(f, 10 - f)
    agg = lambda rows: rows.sort(dim=0).values[keep].mean(dim=0)  # noqa: E731
    m = agg(all_m)
    between = k * 10 / ((k * 10 - 1) * beta) * agg((all_m - m) ** 2)
    rob_m, rob_v = aggregate_fbn(all_m, all_v, beta, k, aggregator=robust_aggregator(name, f))
    _close(rob_m, m)
    _close(rob_v, agg(all_v) + between)
    assert (between > 1e-3).all()


@pytest.mark.parametrize("attack,kw", [("sign_flip", {}), ("sign_flip", {"own": True}),
                                       ("fall_of_empires", {}), ("fall_of_empires", {"eps": 5.0}),
                                       ("a_little_is_enough", {}), ("a_little_is_enough", {"z": 50.0})])
def test_attacked_statistics_follow_each_attack_and_variances_are_never_negative(attack, kw):
    ms, vs, beta, k = _honest_stats(0)  # 7 honest rows, f = 3, n = 10
    bm, bv = attack_statistics(attack, ms, vs, 3, **kw)
    assert bm.shape == bv.shape == (3, ms.shape[1])
    assert (bv >= 0).all()
    if attack == "sign_flip":  # SF flips the mean only and sends the variance honestly
        _close(bm, -ms[:3] if kw else -ms.mean(0).expand(3, -1))
        _close(bv, vs[:3] if kw else vs.mean(0).expand(3, -1))
    elif attack == "fall_of_empires":  # -eps * honest mean, on the mean and on the variance (clamped at 0)
        eps = kw.get("eps", 0.1)
        _close(bm, (-eps * ms.mean(0)).expand(3, -1))
        _close(bv, torch.zeros(3, ms.shape[1]))
    else:  # mean - z * unbiased std; z_max(n=10, f=3) = Phi^-1(7/10)
        z = kw.get("z", 0.5244005127080407)
        _close(bm, (ms.mean(0) - z * ms.std(0)).expand(3, -1), atol=1e-10)
        _close(bv, (vs.mean(0) - z * vs.std(0)).clamp(min=0).expand(3, -1), atol=1e-10)
        if "z" in kw:
            _close(bv, torch.zeros(3, ms.shape[1]))  # z = 50 would make every variance negative
    all_m, all_v = torch.cat([ms, bm]), torch.cat([vs, bv])
    for agg in (None, robust_aggregator("median", 3, True), robust_aggregator("krum", 3)):
        assert (aggregate_fbn(all_m, all_v, beta, k, aggregator=agg)[1] >= 0).all()
    with pytest.raises(ValueError, match="unknown attack"):
        attack_statistics("gaussian", ms, vs, 3)
