"""Server updates: each rule against its formula on hand-sized vectors; robust rules and simulated attacks."""

import math

import pytest
import torch

from fednorm.methods.aggregation import UpdateError
from fednorm.methods.robust import coordinate_median
from fednorm.methods.server import (ClientReply, LocalSchedule, ServerSpec, ServerUpdate, Threat, fednova_norm)

D = torch.float64


def _run(spec, x, client_values, weights=None, steps=None, threat=Threat(), schedule=LocalSchedule(),
         server=None, extra=None):
    """One round over a single parameter 'w' (plus optional extra entries)."""
    state = {"w": x.clone(), **(extra or {})}
    server = server or ServerUpdate(spec, state, param_keys={"w"}, schedule=schedule, threat=threat)
    n = len(client_values)
    weights = weights or [1 / n] * n
    steps = steps or [1] * n
    server.begin(state)
    for i, (v, p, s) in enumerate(zip(client_values, weights, steps)):
        server.add(ClientReply(f"c{i}", {"w": v.clone(), **{k: e.clone() for k, e in (extra or {}).items()}}, p, s))
    return server.finish(), server


def test_mean_is_the_weighted_mean():
    x = torch.zeros(3, dtype=D)
    values = [torch.tensor([1.0, 2, 3], dtype=D), torch.tensor([3.0, 0, -1], dtype=D)]
    new, _ = _run(ServerSpec(), x, values, weights=[0.25, 0.75])
    torch.testing.assert_close(new["w"], 0.25 * values[0] + 0.75 * values[1])


def test_fedavgm_momentum_over_two_rounds_and_fedavg_at_beta_zero():
    spec = ServerSpec("fedavgm", lr=0.5, momentum=0.9)
    x = torch.tensor([1.0, -1.0], dtype=D)
    new, server = _run(spec, x, [x + 2, x + 4])  # Delta = 3
    torch.testing.assert_close(new["w"], x + 0.5 * 3)
    x1 = new["w"]
    new2, _ = _run(spec, x1, [x1 - 1, x1 - 1], server=server)  # Delta = -1, v = 0.9 * 3 - 1 = 1.7
    torch.testing.assert_close(new2["w"], x1 + 0.5 * 1.7)
    plain, _ = _run(ServerSpec("fedavgm", lr=1.0, momentum=0.0), x, [x + 2, x + 4])
    torch.testing.assert_close(plain["w"], x + 3)


@pytest.mark.parametrize("rule", ["fedadam", "fedyogi", "fedadagrad"])
def test_adaptive_server_optimizers_follow_reddi_et_al(rule):
    spec = ServerSpec(rule, lr=0.1, momentum=0.9, beta2=0.99, tau=1e-3)
    x = torch.tensor([0.5, -0.5], dtype=D)
    # the third, small Delta after large ones: v > Delta^2, where Yogi's sign(v - Delta^2) lowers v (Adam would not)
    deltas = [torch.tensor([0.2, -0.4], dtype=D), torch.tensor([-0.1, 0.3], dtype=D), torch.tensor([0.01, -0.02], dtype=D)]
    m = torch.zeros(2, dtype=D)
    v = torch.full((2,), 1e-6, dtype=D)  # tau^2
    server = None
    for delta in deltas:
        new, server = _run(spec, x, [x + delta], weights=[1.0], server=server)
        m = 0.9 * m + 0.1 * delta
        if rule == "fedadam":
            v = 0.99 * v + 0.01 * delta**2
        elif rule == "fedyogi":
            lowered = (v > delta**2).any()
            v = v - 0.01 * delta**2 * torch.sign(v - delta**2)
        else:
            v = v + delta**2
        x = x + 0.1 * m / (v.sqrt() + 1e-3)
        torch.testing.assert_close(new["w"], x)
        x = new["w"]
    assert rule != "fedyogi" or lowered  # the last round took Yogi's own branch


def test_fednova_equals_fedavg_with_equal_steps_and_normalizes_unequal_ones():
    x = torch.zeros(2, dtype=D)
    values = [torch.tensor([-4.0, 2.0], dtype=D), torch.tensor([-1.0, 1.0], dtype=D)]
    equal, _ = _run(ServerSpec("fednova"), x, values, weights=[0.5, 0.5], steps=[3, 3])
    torch.testing.assert_close(equal["w"], 0.5 * values[0] + 0.5 * values[1])
    p, tau = [0.4, 0.6], [4, 1]
    new, _ = _run(ServerSpec("fednova"), x, values, weights=p, steps=tau)
    tau_eff = sum(pi * ti for pi, ti in zip(p, tau))
    d = sum(pi * (x - v) / ti for pi, v, ti in zip(p, values, tau))
    torch.testing.assert_close(new["w"], x - tau_eff * d)


def test_an_attack_on_the_statistics_leaves_the_server_optimizer_in_place():
    """A threat aimed at BN statistics only must not turn FedAdam / FedNova into the plain mean: the
    parameters move exactly as without the threat."""
    state = {"w": torch.tensor([0.5, -0.5], dtype=D), "bn.running_mean": torch.zeros(2, dtype=D),
             "bn.running_var": torch.ones(2, dtype=D)}
    threat = Threat("sign_flip", ("c2",))

    def one_round(spec, threat):
        server = ServerUpdate(spec, state, param_keys={"w"}, threat=threat)
        server.begin(state)
        for i, (delta, steps) in enumerate([(0.2, 4), (-0.1, 1), (0.3, 2)]):
            reply = {k: v + delta for k, v in state.items()}
            server.add(ClientReply(f"c{i}", reply, 1 / 3, steps))
        return server.finish()

    for spec in (ServerSpec("fedadam", lr=0.1), ServerSpec("fedavgm", lr=0.5, momentum=0.9), ServerSpec("fednova")):
        clean, attacked = one_round(spec, Threat()), one_round(spec, threat)
        torch.testing.assert_close(attacked["w"], clean["w"])
        assert not torch.equal(attacked["bn.running_mean"], clean["bn.running_mean"])
    # FedAdam's first step by hand: Delta = mean delta = 0.4 / 3, m = 0.1 Delta, v = 0.99 tau^2 + 0.01 Delta^2
    delta = 0.4 / 3
    m, v = 0.1 * delta, 0.99 * 1e-6 + 0.01 * delta**2
    expected = state["w"] + 0.1 * m / (math.sqrt(v) + 1e-3)
    torch.testing.assert_close(one_round(ServerSpec("fedadam", lr=0.1), threat)["w"], expected)


def test_fednova_under_a_parameter_attack_normalizes_every_reply_by_its_own_steps():
    """With SF on the parameters, FedNova divides each (attacked) pseudo-gradient by its a_k."""
    x = torch.zeros(1, dtype=D)
    values = [torch.tensor([-4.0], dtype=D), torch.tensor([-1.0], dtype=D), torch.tensor([9.0], dtype=D)]
    threat = Threat("sign_flip", ("c2",), targets=("parameters",))
    new, _ = _run(ServerSpec("fednova"), x, values, weights=[0.25, 0.25, 0.5], steps=[4, 1, 2], threat=threat)
    # pseudo-gradients x - x_k: 4, 1, and the attacker's -(mean of honest) = -2.5; each divided by a_k = tau_k
    d = 0.25 * 4 / 4 + 0.25 * 1 / 1 + 0.5 * -2.5 / 2
    tau_eff = 0.25 * 4 + 0.25 * 1 + 0.5 * 2
    torch.testing.assert_close(new["w"], x - tau_eff * d)


def test_fednova_under_fedprox_takes_the_rounds_learning_rate():
    """a_k under FedProx depends on lr: with a decaying schedule the round's lr (given to begin) is the one used."""
    x = torch.zeros(1, dtype=D)
    values = [torch.tensor([-4.0], dtype=D), torch.tensor([-1.0], dtype=D)]
    server = ServerUpdate(ServerSpec("fednova"), {"w": x.clone()}, param_keys={"w"},
                          schedule=LocalSchedule(lr=0.1, prox_mu=0.5))
    server.begin({"w": x.clone()}, lr=0.05)
    for i, (v, steps) in enumerate(zip(values, [4, 1])):
        server.add(ClientReply(f"c{i}", {"w": v.clone()}, 0.5, steps))
    a = [fednova_norm(t, LocalSchedule(0.05, 0.0, 0.5)) for t in (4, 1)]
    d = sum(0.5 * (x - v) / ak for v, ak in zip(values, a))
    torch.testing.assert_close(server.finish()["w"], x - sum(0.5 * ak for ak in a) * d)
    assert a[0] != fednova_norm(4, LocalSchedule(0.1, 0.0, 0.5))  # the base lr would give another a_k


def test_fednova_momentum_norm_is_the_displacement_of_sgd_under_a_constant_gradient():
    rho, lr, tau = 0.9, 0.1, 7
    w = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([w], lr=lr, momentum=rho)
    for _ in range(tau):
        opt.zero_grad()
        w.grad = torch.ones(1)
        opt.step()
    assert math.isclose(-float(w.detach()) / lr, fednova_norm(tau, LocalSchedule(lr, rho)), rel_tol=1e-5)
    q = 1 - lr * 0.5
    assert math.isclose(fednova_norm(tau, LocalSchedule(lr, 0.0, 0.5)), sum(q**k for k in range(tau)), rel_tol=1e-12)


def test_robust_rules_of_identical_updates_return_that_update():
    x = torch.tensor([1.0, 2.0, 3.0], dtype=D)
    same = [x + torch.tensor([0.5, -1, 2], dtype=D)] * 7
    for rule in ("median", "trimmed_mean", "krum"):
        for nnm in (False, True):
            new, _ = _run(ServerSpec(rule, robust_f=2, nnm=nnm), x, same)
            torch.testing.assert_close(new["w"], same[0])


def test_robust_rules_aggregate_pseudo_gradients():
    """The server steps by the robust aggregate of the pseudo-gradients x - x_k, by hand on scalars."""
    x = torch.tensor([2.0], dtype=D)
    values = [x - g for g in torch.tensor([[3.0], [1.0], [4.0], [1.0], [5.0]], dtype=D)]
    med, _ = _run(ServerSpec("median"), x, values)
    torch.testing.assert_close(med["w"], x - 3)  # median of (3, 1, 4, 1, 5)
    tm, _ = _run(ServerSpec("trimmed_mean", robust_f=1), x, values)
    torch.testing.assert_close(tm["w"], x - 8 / 3)  # drop one low (1) and one high (5): mean of (1, 3, 4)
    # Krum (f = 1): the pseudo-gradient with the smallest sum of squared distances to its n - f - 2 = 2
    # nearest others; with (0, 1, 2, 10, 11) that is 1 (scores 0: 1 + 4, 1: 1 + 1, 2: 1 + 4, 10: 1 + 64, 11: 1 + 81)
    values = [x - g for g in torch.tensor([[0.0], [1.0], [2.0], [10.0], [11.0]], dtype=D)]
    kr, _ = _run(ServerSpec("krum", robust_f=1), x, values)
    torch.testing.assert_close(kr["w"], x - 1)


def test_sign_flip_on_parameters_moves_the_mean_and_not_the_median():
    x = torch.zeros(3, dtype=D)
    honest = [torch.tensor([1.0, 1.0, 1.0], dtype=D) * (1 + 0.01 * i) for i in range(7)]
    values = honest + [torch.full((3,), 99.0, dtype=D)] * 3  # what the attackers trained is discarded
    threat = Threat("sign_flip", ("c7", "c8", "c9"), targets=("parameters",))
    mean, _ = _run(ServerSpec(), x, values, threat=threat)
    h = torch.stack(honest).mean(0)
    # pseudo-gradients x - x_k: honest -h, attackers +h (sign flip): mean = (7 (-h) + 3 h) / 10
    torch.testing.assert_close(mean["w"], x - (7 * (x - h) + 3 * (h - x)) / 10)
    med, _ = _run(ServerSpec("median", robust_f=3), x, values, threat=threat)
    # sorted pseudo-gradients: -1.06 ... -1.00 (honest), +1.03 x 3: the median of ten is the mean of the 5th and
    # 6th, (-1.02 - 1.01) / 2, so the model moves to x + 1.015, inside the honest range
    torch.testing.assert_close(med["w"], torch.full((3,), 1.015, dtype=D))


def _bn_round(spec, threat, means, vars_, fbn_beta=None, count=50, weights=None, counts=None):
    state = {"bn.running_mean": torch.zeros(2, dtype=D), "bn.running_var": torch.ones(2, dtype=D),
             "bn.weight": torch.ones(2, dtype=D)}
    server = ServerUpdate(spec, state, param_keys={"bn.weight"},
                          fbn_layers={"bn": fbn_beta} if fbn_beta else None, threat=threat)
    server.begin(state)
    weights = weights or [1 / len(means)] * len(means)
    counts = counts or [count] * len(means)
    for i, (m, v) in enumerate(zip(means, vars_)):
        server.add(ClientReply(f"c{i}", {"bn.running_mean": m, "bn.running_var": v, "bn.weight": torch.ones(2, dtype=D)},
                               weights[i], 1, {"bn": counts[i]} if fbn_beta else {}))
    return server.finish()


def test_attacked_naive_statistics_keep_the_clients_weights():
    """Naive BN under sign flipping, no defense: the server's mean is the weighted mean of what it received (the
    attacker's row being minus the honest clients' mean), with the clients' own weights, not 1/n."""
    means = [torch.tensor([1.0, 2.0], dtype=D), torch.tensor([3.0, -1.0], dtype=D), torch.tensor([0.5, 0.0], dtype=D),
             torch.tensor([9.0, 9.0], dtype=D)]
    vars_ = [torch.tensor([1.0, 2.0], dtype=D) * (i + 1) for i in range(4)]
    weights = [0.4, 0.1, 0.2, 0.3]
    new = _bn_round(ServerSpec(), Threat("sign_flip", ("c3",)), means, vars_, weights=weights)
    # SF sends minus the honest mean and the honest variances' mean (its own 4.0, 8.0 are not sent)
    sent = means[:3] + [-torch.stack(means[:3]).mean(0)]
    sent_vars = vars_[:3] + [torch.stack(vars_[:3]).mean(0)]
    torch.testing.assert_close(new["bn.running_mean"], sum(w * m for w, m in zip(weights, sent)))
    torch.testing.assert_close(new["bn.running_var"], sum(w * v for w, v in zip(weights, sent_vars)))


@pytest.mark.parametrize("spec, threat", [(ServerSpec(), Threat("sign_flip", ("c2",))),
                                          (ServerSpec("median", robust_f=1), Threat())])
def test_batch_counters_take_the_largest_under_an_attack_or_a_robust_rule(spec, threat):
    """num_batches_tracked is an integer counter, never averaged, attacked or robustly reduced: the largest
    client's count, as on the plain path."""
    state = {"bn.running_mean": torch.zeros(2, dtype=D), "bn.running_var": torch.ones(2, dtype=D),
             "bn.num_batches_tracked": torch.tensor(0), "w": torch.zeros(2, dtype=D)}
    server = ServerUpdate(spec, state, param_keys={"w"}, threat=threat)
    server.begin(state)
    for i, count in enumerate([3, 7, 5]):
        server.add(ClientReply(f"c{i}", {**{k: v + i for k, v in state.items() if v.is_floating_point()},
                                         "bn.num_batches_tracked": torch.tensor(count)}, 1 / 3, 1))
    new = server.finish()
    assert new["bn.num_batches_tracked"].dtype == torch.long and int(new["bn.num_batches_tracked"]) == 7


def test_robust_fbn_with_unequal_batch_counts_uses_the_mean_count_in_its_unbiasing():
    """Robust (RV) has no exact form for unequal K_i (a ragged last batch of local epochs): the server takes the
    robust formula with the mean K rounded, here (10 + 20 + 30 + 40 + 52) / 5 = 30.4 -> 30, Kn = 150."""
    means = [torch.tensor([0.1 * i, -0.3 * i], dtype=D) for i in range(5)]
    vars_ = [torch.tensor([1.0 + 0.2 * i, 2.0 - 0.1 * i], dtype=D) for i in range(5)]
    new = _bn_round(ServerSpec("median", robust_f=1), Threat(), means, vars_, fbn_beta=0.1,
                    counts=[10, 20, 30, 40, 52])
    median = lambda rows: rows.median(dim=0).values  # noqa: E731 - five rows: the third
    m = median(torch.stack(means))
    torch.testing.assert_close(new["bn.running_mean"], m)
    torch.testing.assert_close(new["bn.running_var"], median(torch.stack(vars_))
                               + 150 / (149 * 0.1) * median((torch.stack(means) - m) ** 2))


@pytest.mark.parametrize("counts", [[6, 6], [4, 9]])
def test_fbn_with_a_reply_left_out_is_centralized_bn_on_the_batches_that_arrived(counts):
    """Three clients trained (each unbiased its batch with n = 3 in Kn/(Kn-1)); the server, told the round had 3
    participants, aggregates the 2 replies that arrived: its running statistics equal a centralized BatchNorm's
    on the union of those 2 batches (float64, to 1e-10), for equal and unequal batch sizes."""
    from fednorm.methods.fbn_stats import client_running_stats

    beta, g = 0.3, torch.Generator().manual_seed(5)
    shared = {"bn.running_mean": torch.randn(2, generator=g, dtype=D), "bn.running_var": 1 + torch.rand(2, generator=g, dtype=D),
              "bn.weight": torch.ones(2, dtype=D)}
    batches = [torch.randn(k, 2, generator=g, dtype=D) * (1 + i) + 3 * i for i, k in enumerate([*counts, 5])]
    server = ServerUpdate(ServerSpec(), shared, param_keys={"bn.weight"}, fbn_layers={"bn": beta})
    server.begin(shared, participants=3)
    for i, x in enumerate(batches[:2]):  # the third client's reply never arrives
        m, v = client_running_stats(x, shared["bn.running_mean"], shared["bn.running_var"], beta, 3)
        server.add(ClientReply(f"c{i}", {"bn.running_mean": m, "bn.running_var": v, "bn.weight": shared["bn.weight"]},
                               0.5, 1, {"bn": x.shape[0]}))
    new = server.finish()
    central = torch.nn.BatchNorm1d(2, momentum=beta, dtype=D).train()
    central.running_mean.copy_(shared["bn.running_mean"])
    central.running_var.copy_(shared["bn.running_var"])
    central(torch.cat(batches[:2]))
    torch.testing.assert_close(new["bn.running_mean"], central.running_mean, rtol=0, atol=1e-10)
    torch.testing.assert_close(new["bn.running_var"], central.running_var, rtol=0, atol=1e-10)


def test_sign_flip_on_statistics_flips_the_mean_only_and_median_resists():
    means = [torch.tensor([1.0, 2.0], dtype=D) + 0.1 * i for i in range(10)]
    vars_ = [torch.tensor([1.0, 3.0], dtype=D)] * 10
    threat = Threat("sign_flip", ("c7", "c8", "c9"))
    naive = _bn_round(ServerSpec(), threat, means, vars_)
    h = torch.stack(means[:7]).mean(0)
    torch.testing.assert_close(naive["bn.running_mean"], (7 * h - 3 * h) / 10)
    torch.testing.assert_close(naive["bn.running_var"], torch.tensor([1.0, 3.0], dtype=D))
    robust = _bn_round(ServerSpec("median", robust_f=3), threat, means, vars_)
    # received: -h = (-1.3, -2.3) x 3 and the honest 1.0 ... 1.6 (2.0 ... 2.6): the 5th and 6th of ten are
    # 1.1 and 1.2 (2.1 and 2.2)
    torch.testing.assert_close(robust["bn.running_mean"], torch.tensor([1.15, 2.15], dtype=D))
    # FBN under attack without defense: the between-client term explodes; with the median it stays small
    fbn_attacked = _bn_round(ServerSpec(), threat, means, vars_, fbn_beta=0.1)
    fbn_median = _bn_round(ServerSpec("median", robust_f=3), threat, means, vars_, fbn_beta=0.1)
    fbn_clean = _bn_round(ServerSpec(), Threat(), means, vars_, fbn_beta=0.1)
    sent = torch.stack(means[:7] + [-h] * 3)  # what the server receives: SF means, honest variances
    m = sent.mean(0)
    kn = 50 * 10
    between = kn / ((kn - 1) * 0.1) * ((sent - m) ** 2).mean(0)
    torch.testing.assert_close(fbn_attacked["bn.running_mean"], m)
    torch.testing.assert_close(fbn_attacked["bn.running_var"], torch.stack(vars_).mean(0) + between)
    assert (fbn_attacked["bn.running_var"] > 4 * fbn_clean["bn.running_var"]).all()
    # robust (RM)/(RV): every average replaced by the median (of ten rows: the mean of the 5th and 6th), the
    # squared deviations taken from the robust mean, Kn counting all n = 10 clients
    middle = lambda rows: rows.sort(dim=0).values[4:6].mean(dim=0)  # noqa: E731
    m_med = middle(sent)
    torch.testing.assert_close(fbn_median["bn.running_mean"], m_med)
    torch.testing.assert_close(fbn_median["bn.running_var"],
                               middle(torch.stack(vars_)) + kn / ((kn - 1) * 0.1) * middle((sent - m_med) ** 2))
    # (1.93, 3.93): the honest clients' spread, not the attackers' (no attack: 1.83, 3.83)
    assert (fbn_median["bn.running_var"] < 1.5 * fbn_clean["bn.running_var"]).all()


def test_each_attack_on_statistics_reaches_the_server_as_defined():
    """What the server averages (no defense) when c7-c9 attack the BN statistics, against hand formulas."""
    from statistics import NormalDist

    means = [torch.tensor([1.0 + i, -2.0 * i], dtype=D) for i in range(10)]
    vars_ = [torch.tensor([1.0 + 0.5 * i, 3.0 - 0.25 * i], dtype=D) for i in range(10)]
    byz = ("c7", "c8", "c9")
    h_mean, h_var = torch.stack(means[:7]).mean(0), torch.stack(vars_[:7]).mean(0)
    # SF on each attacker's own statistics: its mean negated, its variance sent as it is
    own = _bn_round(ServerSpec(), Threat("sign_flip", byz, sign_flip_own=True), means, vars_)
    torch.testing.assert_close(own["bn.running_mean"], (sum(means[:7]) - sum(means[7:])) / 10)
    torch.testing.assert_close(own["bn.running_var"], torch.stack(vars_).mean(0))
    # FOE (eps 0.1): -0.1 x the honest mean, on the variance too, where it is clamped to a valid 0
    foe = _bn_round(ServerSpec(), Threat("fall_of_empires", byz, foe_eps=0.1), means, vars_)
    torch.testing.assert_close(foe["bn.running_mean"], (7 * h_mean - 3 * 0.1 * h_mean) / 10)
    torch.testing.assert_close(foe["bn.running_var"], 7 * h_var / 10)
    # ALIE with z_max(n = 10, f = 3) = Phi^-1(7/10): honest mean - z * honest std (unbiased), both statistics
    z = NormalDist().inv_cdf(0.7)
    alie = _bn_round(ServerSpec(), Threat("a_little_is_enough", byz), means, vars_)
    sent_mean = h_mean - z * torch.stack(means[:7]).std(0)
    sent_var = (h_var - z * torch.stack(vars_[:7]).std(0)).clamp(min=0)
    torch.testing.assert_close(alie["bn.running_mean"], (7 * h_mean + 3 * sent_mean) / 10)
    torch.testing.assert_close(alie["bn.running_var"], (7 * h_var + 3 * sent_var) / 10)


def test_alie_and_foe_on_parameters_reach_the_server_as_defined():
    """Attacks on the parameters replace the Byzantine pseudo-gradients g_k = x - x_k, by hand (no defense)."""
    from statistics import NormalDist

    x = torch.tensor([0.5, -1.0, 2.0], dtype=D)
    grads = [torch.tensor([1.0 + i, -0.5 * i, 0.25 * i * i], dtype=D) for i in range(10)]
    values = [x - g for g in grads]
    byz = ("c7", "c8", "c9")
    honest = torch.stack(grads[:7])
    z = NormalDist().inv_cdf(0.7)  # z_max(n = 10, f = 3)
    alie, _ = _run(ServerSpec(), x, values, threat=Threat("a_little_is_enough", byz, targets=("parameters",)))
    sent = honest.mean(0) - z * honest.std(0)
    torch.testing.assert_close(alie["w"], x - (7 * honest.mean(0) + 3 * sent) / 10)
    foe, _ = _run(ServerSpec(), x, values, threat=Threat("fall_of_empires", byz, targets=("parameters",), foe_eps=0.5))
    torch.testing.assert_close(foe["w"], x - (7 * honest.mean(0) + 3 * (-0.5 * honest.mean(0))) / 10)


def test_robust_f_defaults_to_the_threats_byzantine_count():
    """fbn_robust_mnistm sets no robust_f: NNM and the median must assume the 3 attackers, not f = 0 (with f = 0
    NNM mixes every row and the 'defense' is the attacked mean)."""
    means = [torch.tensor([1.0, 2.0], dtype=D) + 0.1 * i for i in range(10)]
    vars_ = [torch.tensor([1.0, 3.0], dtype=D)] * 10
    threat = Threat("sign_flip", ("c7", "c8", "c9"))
    state = {"bn.running_mean": torch.zeros(2, dtype=D), "bn.running_var": torch.ones(2, dtype=D)}
    spec = ServerSpec("median", nnm=True, robust_scope="statistics")
    assert ServerUpdate(spec, state, param_keys=set(), threat=threat).robust_f == 3
    default = _bn_round(spec, threat, means, vars_)
    three = _bn_round(ServerSpec("median", nnm=True, robust_scope="statistics", robust_f=3), threat, means, vars_)
    zero = _bn_round(ServerSpec("median", nnm=True, robust_scope="statistics", robust_f=0), threat, means, vars_)
    torch.testing.assert_close(default["bn.running_mean"], three["bn.running_mean"])
    honest = torch.stack(means[:7]).mean(0)
    assert (default["bn.running_mean"] - honest).abs().max() < (zero["bn.running_mean"] - honest).abs().max()


# the first server step, written out from each paper for this test's two clients: Delta = 0.25 * 1 + 0.75 * 3 = 2.5
# (they send x + 1 and x + 3), server lr 0.5, beta 0.9, beta2 0.99, tau 1e-3, v initialised at tau^2 (Reddi et al.
# Alg. 2, no bias correction); FedNova with a_k = tau_k = 1 and 2 local steps: d_k = (x - x_k) / a_k = -1, -1.5,
# tau_eff = 0.25 * 1 + 0.75 * 2 = 1.75, x+ = x - tau_eff (0.25 d_0 + 0.75 d_1) = x + 1.75 * 1.375
FIRST_STEP = {
    "fedavgm": 0.5 * 2.5,  # v = 0.9 * 0 + 2.5
    "fedadam": 0.5 * 0.25 / ((0.99e-6 + 0.01 * 6.25) ** 0.5 + 1e-3),  # m = 0.1 * 2.5, v = 0.99 tau^2 + 0.01 * 2.5^2
    "fedyogi": 0.5 * 0.25 / ((1e-6 + 0.01 * 6.25) ** 0.5 + 1e-3),  # v = tau^2 - 0.01 * 2.5^2 * sign(tau^2 - 2.5^2)
    "fedadagrad": 0.5 * 0.25 / ((1e-6 + 6.25) ** 0.5 + 1e-3),  # v = tau^2 + 2.5^2
    "fednova": 1.75 * 1.375,
}


@pytest.mark.parametrize("rule", list(FIRST_STEP))
def test_server_optimizers_step_on_parameters_and_average_the_bn_statistics(rule):
    """The server rule moves the parameters only, by its paper's first step; BN running statistics (buffers)
    take the weighted mean."""
    x = torch.tensor([1.0, -1.0], dtype=D)
    stats = {"bn.running_mean": torch.zeros(2, dtype=D), "bn.running_var": torch.ones(2, dtype=D)}
    state = {"w": x.clone(), **stats}
    server = ServerUpdate(ServerSpec(rule, lr=0.5), state, param_keys={"w"})
    server.begin(state)
    sent = [(torch.tensor([0.5, 1.5], dtype=D), torch.tensor([2.0, 4.0], dtype=D)),
            (torch.tensor([1.5, -0.5], dtype=D), torch.tensor([1.0, 0.5], dtype=D))]
    for i, ((m, v), p) in enumerate(zip(sent, (0.25, 0.75))):
        server.add(ClientReply(f"c{i}", {"w": x + 1 + 2 * i, "bn.running_mean": m, "bn.running_var": v}, p, 1 + i))
    new = server.finish()
    torch.testing.assert_close(new["bn.running_mean"], 0.25 * sent[0][0] + 0.75 * sent[1][0])
    torch.testing.assert_close(new["bn.running_var"], 0.25 * sent[0][1] + 0.75 * sent[1][1])
    torch.testing.assert_close(new["w"], x + FIRST_STEP[rule], rtol=1e-12, atol=1e-12)


def test_robust_scope_statistics_takes_the_median_of_the_statistics_and_the_mean_of_the_parameters():
    means = [torch.tensor([1.0, 2.0], dtype=D) + 0.1 * i for i in range(10)]
    vars_ = [torch.tensor([1.0, 3.0], dtype=D)] * 10
    threat = Threat("sign_flip", ("c7", "c8", "c9"))
    state = {"bn.running_mean": torch.zeros(2, dtype=D), "bn.running_var": torch.ones(2, dtype=D),
             "bn.weight": torch.ones(2, dtype=D)}
    weights = [torch.tensor([1.0 + i, -float(i)], dtype=D) for i in range(10)]
    out = {}
    for scope in ("all", "statistics"):
        server = ServerUpdate(ServerSpec("median", robust_f=3, robust_scope=scope), state, param_keys={"bn.weight"},
                              threat=threat)
        server.begin(state)
        for i in range(10):
            server.add(ClientReply(f"c{i}", {"bn.running_mean": means[i], "bn.running_var": vars_[i],
                                             "bn.weight": weights[i]}, 0.1, 1))
        out[scope] = server.finish()
    torch.testing.assert_close(out["statistics"]["bn.running_mean"], out["all"]["bn.running_mean"])
    torch.testing.assert_close(out["statistics"]["bn.weight"], torch.stack(weights).mean(0))  # the plain mean
    torch.testing.assert_close(out["all"]["bn.weight"], coordinate_median(torch.stack(weights)))
    with pytest.raises(ValueError, match="robust_scope"):
        ServerSpec("median", robust_scope="gradients")


def test_bad_replies_are_refused_with_the_client_named():
    x = torch.zeros(2, dtype=D)
    for spec in (ServerSpec(), ServerSpec("median")):
        with pytest.raises(UpdateError, match="c1"):
            _run(spec, x, [x, torch.tensor([float("nan"), 0.0], dtype=D)])
        with pytest.raises(UpdateError, match="c0.*shape"):
            _run(spec, x, [torch.zeros(3, dtype=D)])
    with pytest.raises(ValueError, match="server rule"):
        ServerSpec("fedsomething")
    with pytest.raises(ValueError, match="attack"):
        Threat("bit_flip", ("c0",))
