import pytest
import torch

from fednorm.methods.fbn_stats import aggregate_fbn, aggregate_naive, client_running_stats
from fednorm.methods.robust import robust_aggregator

F64 = torch.float64
C = 3


def _setup(kind: str, n: int, seed: int):
    """Clients with DIFFERENT feature distributions: per-client, per-channel shift and scale."""
    g = torch.Generator().manual_seed(seed)
    shape, dims, bn_cls = ((4, C), (0,), torch.nn.BatchNorm1d) if kind == "1d" else (
        (2, C, 3, 2), (0, 2, 3), torch.nn.BatchNorm2d)
    view = (1, C) if kind == "1d" else (1, C, 1, 1)
    shift = torch.linspace(-3, 3, n, dtype=F64)[:, None] + 0.5 * torch.randn(n, C, generator=g, dtype=F64)
    scale = 0.2 + 2 * torch.rand(n, C, generator=g, dtype=F64)

    def batches():
        return [torch.randn(shape, generator=g, dtype=F64) * scale[i].view(view) + shift[i].view(view)
                for i in range(n)]

    k = shape[0] * (shape[2] * shape[3] if kind == "2d" else 1)
    return batches, dims, bn_cls, k


def _bn(bn_cls, beta, m, v):
    bn = bn_cls(C, momentum=beta, dtype=F64).train()
    bn.running_mean.copy_(m)
    bn.running_var.copy_(v)
    return bn


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("n", [2, 3, 10])
@pytest.mark.parametrize("kind", ["1d", "2d"])
def test_fbn_server_stats_equal_centralized_bn_on_the_union(kind, n, seed):
    beta = (0.1, 0.3, 0.9)[seed]
    batches, dims, bn_cls, k = _setup(kind, n, seed)
    m, v = torch.zeros(C, dtype=F64), torch.ones(C, dtype=F64)
    central = _bn(bn_cls, beta, m, v)
    for _ in range(4):
        xs = batches()
        ms, vs = zip(*(client_running_stats(x, m, v, beta, n, dims) for x in xs))
        ms, vs = torch.stack(ms), torch.stack(vs)
        m, v = aggregate_fbn(ms, vs, beta, k)
        central(torch.cat(xs))
        _close(m, central.running_mean)
        _close(v, central.running_var)
        m_agg, v_agg = aggregate_fbn(ms, vs, beta, k, aggregator=robust_aggregator("mean", 0))
        _close(m_agg, m)
        _close(v_agg, v)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("n", [2, 3, 10])
@pytest.mark.parametrize("kind", ["1d", "2d"])
def test_naive_bn_misses_the_between_client_variance_by_the_exact_gap(kind, n, seed):
    """From the same shared (m, v), one step: centralized minus naive running variance is
    beta Kn/(Kn-1) (1/n) sum_i (mean_i - mean)^2  -  beta K(n-1)/((Kn-1)(K-1)) (1/n) sum_i var_i
    (law of total variance, and Kn/(Kn-1) - K/(K-1) = -K(n-1)/((Kn-1)(K-1))); the means agree."""
    beta = (0.1, 0.5)[seed]
    batches, dims, bn_cls, k = _setup(kind, n, seed)
    kn = k * n
    m, v = torch.zeros(C, dtype=F64), torch.ones(C, dtype=F64)
    for _ in range(3):
        xs = batches()
        local = [_bn(bn_cls, beta, m, v) for _ in xs]
        for bn, x in zip(local, xs):
            bn(x)
        central = _bn(bn_cls, beta, m, v)
        central(torch.cat(xs))
        m, v = aggregate_naive(torch.stack([bn.running_mean for bn in local]),
                               torch.stack([bn.running_var for bn in local]))
        means = torch.stack([x.mean(dim=dims) for x in xs])
        vars_ = torch.stack([x.var(dim=dims, correction=0) for x in xs])
        between = ((means - means.mean(0)) ** 2).mean(0)
        gap = beta * kn / (kn - 1) * between - beta * k * (n - 1) / ((kn - 1) * (k - 1)) * vars_.mean(0)
        _close(m, central.running_mean)
        _close(central.running_var - v, gap)
        assert (between > 1e-3).all()  # heterogeneous clients: the missing term is real


def test_fbn_input_checks_and_clamp():
    with pytest.raises(ValueError, match="K\\*n"):
        client_running_stats(torch.ones(1, C), torch.zeros(C), torch.ones(C), 0.1, 1)
    with pytest.raises(ValueError, match="share a shape"):
        aggregate_fbn(torch.zeros(2, C), torch.zeros(3, C), 0.1, 4)
    _, v = aggregate_fbn(torch.zeros(2, C), -torch.ones(2, C), 0.1, 4)
    assert (v == 0).all()


def test_weighted_fbn_without_the_previous_variance_is_the_pitfall_4_approximation():
    """aggregate_fbn_weighted without previous_var: m = sum w_i m_i, v = sum w_i v_i + N/((N-1) beta) sum w_i
    (m_i - m)^2, w_i = K_i / N; for equal counts it is (RM)/(RV) itself."""
    from fednorm.methods.fbn_stats import aggregate_fbn_weighted

    g = torch.Generator().manual_seed(3)
    ms, vs = torch.randn(4, 5, generator=g, dtype=torch.float64), torch.rand(4, 5, generator=g, dtype=torch.float64)
    equal = aggregate_fbn_weighted(ms, vs, 0.1, [8] * 4)
    for got, want in zip(equal, aggregate_fbn(ms, vs, 0.1, 8)):
        torch.testing.assert_close(got, want)
    counts = torch.tensor([2.0, 8.0, 4.0, 6.0], dtype=torch.float64)
    w = (counts / 20).unsqueeze(1)
    m = (w * ms).sum(0)
    got_m, got_v = aggregate_fbn_weighted(ms, vs, 0.1, counts.int().tolist())
    torch.testing.assert_close(got_m, m)
    torch.testing.assert_close(got_v, (w * vs).sum(0) + 20 / (19 * 0.1) * (w * (ms - m) ** 2).sum(0))
