"""DSGD with Federated BatchNorm: n clients, one step per round, averaging, equals one model stepping on the
union of their batches with FBN layers (FBN extraction T2), in float64; robust FBN through the engine."""

import pytest
import torch

from fednorm.data.domain import ClientData, normalize_batch
from fednorm.engines.simulation import Federation, InProcessEngine
from fednorm.methods import LocalTraining, resolve_method, train_locally
from fednorm.methods.fbn_stats import aggregate_fbn
from fednorm.methods.robust import coordinate_median
from fednorm.methods.server import Threat
from fednorm.models import DigitCNN
from fednorm.models.fbn import federated_bn_layers

from ..conftest import _record_client_runs, make_split

DSGD = LocalTraining(steps=1, batch_size=6, lr=0.1, momentum=0.9, momentum_style="ema")


def _prepare64(x):
    return normalize_batch(x).double()


def _clients(n=4, size=12, shift=30.0):
    return [ClientData(f"c{i}", f"d{i}", make_split(size, seed=i, shift=shift * i), make_split(8, seed=50 + i))
            for i in range(n)]


def _engine(method, clients, training=DSGD, norm="fbn", **fed):
    torch.manual_seed(7)
    model = DigitCNN(width=0.125, norm=norm).double()
    federation = Federation(seed=3, channels_last=False, weighting="uniform", persistent_optimizer=True, **fed)
    return InProcessEngine(model, clients, method, training, federation, _prepare64)


def test_dsgd_with_fbn_equals_centralized_fbn_on_the_union_batch():
    clients = _clients()
    fed = _engine(resolve_method("fbn"), clients)
    central = _engine(resolve_method("centralized_bn", norm="fbn"), clients)
    for _ in range(4):
        fed.run_round()
        central.run_round()
    assert any(k.endswith("running_var") for k in fed.global_state)
    for key, value in fed.global_state.items():
        if value.is_floating_point():
            torch.testing.assert_close(value, central.global_state[key], rtol=1e-9, atol=1e-10, msg=key)
    # and the statistics really moved away from the (0, 1) start
    assert float(fed.global_state["features.1.running_var"].sub(1).abs().max()) > 1e-3


def test_fbn_layers_count_the_rounds_participants_under_sampling(monkeypatch):
    """n in Kn/(Kn-1) is the number of clients in the round (2 of 4 at fraction 0.5), not the federation's size:
    every FBN layer a client trains with knows it."""
    import fednorm.engines.client_step as step

    seen, real = [], step.train_locally

    def spy(model, *args, **kwargs):
        seen.append({layer.num_clients for layer in federated_bn_layers(model).values()})
        return real(model, *args, **kwargs)

    monkeypatch.setattr(step, "train_locally", spy)
    fed = _engine(resolve_method("fbn"), _clients(), fraction=0.5)
    for _ in range(3):
        fed.run_round()
    assert seen == [{2}] * 6


def test_dsgd_naive_bn_misses_exactly_the_between_client_term(monkeypatch):
    """One DSGD round from the (0, 1) start, first BN layer (momentum beta): each naive client folds its own batch
    in, v_i = (1 - beta) + beta K/(K-1) s_i^2, and the server averages the v_i. Centralized BN folds in the union
    batch: (1 - beta) + beta Kn/(Kn-1) (mean_i s_i^2 + mean_i (m_i - m)^2). Both recomputed from the clients'
    own layers (m_i = running_mean_i / beta)."""
    import fednorm.engines.client_step as step

    trained, real = {}, step.train_locally

    def spy(model, data, *args, **kwargs):
        out = real(model, data, *args, **kwargs)
        trained[len(trained)] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return out

    monkeypatch.setattr(step, "train_locally", spy)
    clients = _clients()
    naive = _engine(resolve_method("naive_bn"), clients, norm="bn")
    central = _engine(resolve_method("centralized_bn"), clients, norm="bn")
    height, width = naive.model.features[0](_prepare64(clients[0].train.x[:1])).shape[-2:]
    naive.run_round()
    central.run_round()
    beta, n, k = naive.model.features[1].momentum, len(clients), DSGD.batch_size * height * width
    means = torch.stack([trained[i]["features.1.running_mean"] for i in range(n)]) / beta
    own = torch.stack([trained[i]["features.1.running_var"] for i in range(n)])
    torch.testing.assert_close(naive.global_state["features.1.running_var"], own.mean(0), rtol=1e-12, atol=1e-12)
    biased = (own - (1 - beta)) / beta * (k - 1) / k  # each client's batch variance s_i^2
    between = ((means - means.mean(0)) ** 2).mean(0)
    kn = k * n
    torch.testing.assert_close(central.global_state["features.1.running_var"],
                               (1 - beta) + beta * kn / (kn - 1) * (biased.mean(0) + between), rtol=1e-9, atol=1e-10)
    # the clients' brightness shifts make the missing term large next to the difference in unbiasing
    assert (central.global_state["features.1.running_var"] - naive.global_state["features.1.running_var"]
            > 0.5 * beta * between).all()


def test_union_batches_need_fixed_steps_and_byzantine_clients_must_exist():
    clients = _clients()
    with pytest.raises(ValueError, match="training.steps"):
        _engine(resolve_method("centralized_bn", norm="fbn"), clients, training=LocalTraining(batch_size=6))
    with pytest.raises(ValueError, match="Byzantine clients"):
        _engine(resolve_method("fbn"), clients, threat=Threat("sign_flip", ("c9",)))


def test_robust_fbn_under_sign_flip_is_the_median_of_the_attacked_rows_and_near_the_honest_ones():
    clients = _clients(n=7, shift=0.0)  # similar honest clients: their median is close to their mean
    threat = Threat("sign_flip", ("c5", "c6"))
    honest = _engine(resolve_method("fbn"), clients)
    attacked = _engine(resolve_method("fbn"), clients, threat=threat)
    defended = _engine(resolve_method("fbn", server={"rule": "median", "robust_f": 2}), clients, threat=threat)
    start = {k: v.clone() for k, v in defended.global_state.items()}
    sent = _record_client_runs(defended, lambda reply, message: ({k: v.clone() for k, v in reply.state.items()},
                                                                 dict(reply.bn_counts)))
    defended.run_round()
    # round 1 by hand: the two attackers' statistics rows become -(honest mean of m_i) and the honest mean of v_i
    # (SF changes only the mean); every row is then reduced by the coordinate median, (RV)'s between-client term
    # taken from the median m; the parameters (not attacked) are x - median_i(x - x_i)
    states = [s for s, _ in sent]
    byz, honest_rows = [5, 6], [0, 1, 2, 3, 4]
    beta = defended.model.features[1].momentum
    for prefix, k in sent[0][1].items():
        means = torch.stack([s[f"{prefix}.running_mean"] for s in states])
        vars_ = torch.stack([s[f"{prefix}.running_var"] for s in states])
        means[byz], vars_[byz] = -means[honest_rows].mean(0), vars_[honest_rows].mean(0)
        m, v = aggregate_fbn(means, vars_, beta, k, aggregator=coordinate_median)
        torch.testing.assert_close(defended.global_state[f"{prefix}.running_mean"], m, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(defended.global_state[f"{prefix}.running_var"], v, rtol=1e-12, atol=1e-12)
    assert set(sent[0][1]) == set(federated_bn_layers(defended.model))  # every FBN layer, conv and classifier
    for key, x in start.items():
        if x.is_floating_point() and ".running_" not in key:
            expected = x - coordinate_median(torch.stack([x - s[key] for s in states]))
            torch.testing.assert_close(defended.global_state[key], expected, rtol=1e-12, atol=1e-12, msg=key)
    defended.run_round()
    for eng in (honest, attacked):
        eng.run_round()
        eng.run_round()
    # SF sends -m_run: averaged, the means shrink and (RV)'s between-client term grows; the median resists
    stats = [k for k in honest.global_state if ".running_" in k]
    err = {name: sum(float((e.global_state[k] - honest.global_state[k]).abs().sum()) for k in stats)
           for name, e in (("attacked", attacked), ("defended", defended))}
    assert err["defended"] < 0.5 * err["attacked"]
    assert all(torch.isfinite(v).all() for v in defended.global_state.values() if v.is_floating_point())


def test_learning_rate_schedule_reaches_a_persistent_optimizer():
    cfg = LocalTraining(lr=0.1, lr_decay_every=1000)
    assert [cfg.lr_at(t) for t in (0, 999, 1000, 2500)] == pytest.approx([0.1, 0.1, 0.05, 0.1 / 3])
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 28 * 28, 10))
    data = make_split(8, seed=0)
    _, state = train_locally(model, data, LocalTraining(steps=1, batch_size=4, lr=0.1, momentum=0.9),
                             generator=torch.Generator(), prepare=normalize_batch)
    _, state = train_locally(model, data, LocalTraining(steps=1, batch_size=4, lr=0.05, momentum=0.9),
                             generator=torch.Generator(), prepare=normalize_batch, optimizer_state=state)
    assert state["param_groups"][0]["lr"] == 0.05


def test_centralized_bn_refuses_settings_it_would_silently_ignore():
    """One model on the merged batches has no client state, server rule, client algorithm or FixBN switch."""
    for override in ({"freeze_bn_stats_at": 0.5}, {"policy": "local_bn"}, {"prox_mu": 0.1},
                     {"client": {"name": "scaffold"}}, {"server": {"rule": "median"}}, {"weight_perturbation": 0.05}):
        with pytest.raises(ValueError, match="centralized BN"):
            resolve_method("centralized_bn", **override)
    resolve_method("centralized_bn", norm="fbn", agc_clip=0.64)  # what it does use is accepted
