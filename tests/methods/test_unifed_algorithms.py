"""MOON, FedDC and Per-FedAvg client algorithms against hand computations on tiny models."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fednorm.data.domain import ClientData, Split
from fednorm.methods.client_algorithms import (
    ClientContext, ClientSpec, FedDC, Moon, PerFedAvg, model_contrastive_loss, representation_module,
)
from fednorm.methods.local_update import LocalTraining, train_locally


def prepare(x):
    return x.float() / 255.0


def tiny_split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, 3, 2, 2), generator=g, dtype=torch.uint8)
    return Split(x, torch.randint(0, 3, (n,), generator=g))


def mlp(seed=0, bn=False):
    torch.manual_seed(seed)
    layers = [nn.Flatten(), nn.Linear(12, 5)] + ([nn.BatchNorm1d(5)] if bn else []) + [nn.ReLU(), nn.Linear(5, 3)]
    return nn.Sequential(*layers)


def context(model, spec_name="sgd", client_state=None, server_state=None, lr=0.1, shared=None):
    params = [k for k, _ in model.named_parameters()] if shared is None else shared
    return ClientContext("c", lr, params, {k: v.detach().clone() for k, v in model.state_dict().items()},
                         server_state or {}, client_state if client_state is not None else {})


def hidden(model, x):
    """The input of the last Linear of ``mlp`` (MOON's z), computed by hand."""
    return model[:-1](x)


def cos(a, b):
    """Cosine similarity with torch's guard for a zero vector (a ReLU output can be all zero)."""
    return (a * b).sum(1) / (a.norm(dim=1).clamp_min(1e-8) * b.norm(dim=1).clamp_min(1e-8))


# ---------------------------------------------------------------------------------------------- MOON
def test_model_contrastive_loss_matches_the_formula():
    z = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    z_glob = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    z_prev = torch.tensor([[0.0, 1.0], [0.0, -1.0]])
    tau = 0.5
    first = -math.log(math.exp(1 / tau) / (math.exp(1 / tau) + math.exp(0 / tau)))
    s = 1 / math.sqrt(2)
    second = -math.log(math.exp(s / tau) / (math.exp(s / tau) + math.exp(-1 / tau)))
    assert model_contrastive_loss(z, z_glob, z_prev, tau).item() == pytest.approx((first + second) / 2, rel=1e-6)


def test_representation_is_the_input_of_the_last_linear_or_the_named_module():
    model = mlp()
    assert representation_module(model)[0] == "3"
    assert representation_module(model, "1")[0] == "1"
    with pytest.raises(ValueError, match="moon_layer 'head'"):
        representation_module(model, "head")
    with pytest.raises(ValueError, match="no|none"):
        representation_module(nn.Sequential(nn.Conv2d(3, 2, 1)))


def test_moon_term_contrasts_with_the_frozen_global_and_the_previous_model():
    model = mlp(0)
    previous = mlp(1)
    spec = ClientSpec("moon", moon_mu=2.0, moon_tau=0.7)
    algo = spec.build()
    ctx = context(model, client_state={f"prev.{k}": v.clone() for k, v in previous.state_dict().items()})
    global_copy = copy.deepcopy(model)
    algo.on_start(ctx, model)
    with torch.no_grad():  # training has moved the model; the global copy must not follow
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = prepare(tiny_split(6, 3).x)
    model(x)
    term = algo.loss_term(ctx, model, x, None, None)
    z, zg, zp = hidden(model, x), hidden(global_copy, x).detach(), hidden(previous, x).detach()
    logits = torch.stack([cos(z, zg), cos(z, zp)], 1) / 0.7
    expected = 2.0 * (-(logits[:, 0] - torch.logsumexp(logits, 1))).mean()
    torch.testing.assert_close(term, expected, rtol=1e-5, atol=1e-6)
    term.backward()
    assert all(p.grad is not None for p in model[1].parameters())
    algo.on_end(ctx, model, 1)


def test_moon_first_round_uses_the_global_model_as_previous_and_keeps_the_trained_model():
    model = mlp(0)
    algo = ClientSpec("moon", moon_mu=3.0).build()
    ctx = context(model)
    algo.on_start(ctx, model)
    x = prepare(tiny_split(5, 4).x)
    model(x)
    term = algo.loss_term(ctx, model, x, None, None)
    assert term.item() == pytest.approx(3.0 * math.log(2), rel=1e-6)  # z_prev = z_glob: constant mu log 2
    grads = torch.autograd.grad(term, list(model.parameters()), allow_unused=True)
    assert all(g is None or g.abs().max() < 1e-6 for g in grads)
    algo.on_end(ctx, model, 1)
    assert set(ctx.client_state) == {f"prev.{k}" for k in model.state_dict()}
    for k, v in model.state_dict().items():
        torch.testing.assert_close(ctx.client_state[f"prev.{k}"], v)
    assert not model[-1]._forward_pre_hooks  # hooks are removed at the end of the round


def test_moon_local_training_equals_a_hand_written_loop():
    data = tiny_split(8, 5)
    previous = mlp(2)
    model = mlp(0)
    start = copy.deepcopy(model)
    cfg = LocalTraining(batch_size=4, lr=0.2)
    schedule = [torch.tensor([0, 1, 2, 3]), torch.tensor([4, 5, 6, 7])]
    algo = ClientSpec("moon", moon_mu=1.5, moon_tau=0.5).build()
    ctx = context(model, client_state={f"prev.{k}": v.clone() for k, v in previous.state_dict().items()}, lr=0.2)
    train_locally(model, data, cfg, generator=torch.Generator(), prepare=prepare, schedule=schedule,
                  algorithm=algo, context=ctx)
    hand = copy.deepcopy(start)
    for index in schedule:
        x, y = prepare(data.x[index]), data.y[index]
        z = hidden(hand, x)
        zg, zp = hidden(start, x).detach(), hidden(previous, x).detach()
        logits = torch.stack([cos(z, zg), cos(z, zp)], 1) / 0.5
        loss = F.cross_entropy(hand(x), y) + 1.5 * F.cross_entropy(logits, torch.zeros(4, dtype=torch.long))
        grads = torch.autograd.grad(loss, list(hand.parameters()))
        with torch.no_grad():
            for p, g in zip(hand.parameters(), grads):
                p.sub_(0.2 * g)
    for (k, p), q in zip(model.named_parameters(), hand.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    for k, v in model.state_dict().items():  # the next round's previous model
        torch.testing.assert_close(ctx.client_state[f"prev.{k}"], v)


# ---------------------------------------------------------------------------------------------- FedDC
def test_feddc_step_drift_update_and_reply_match_hand_computation():
    torch.manual_seed(0)
    model = mlp(0)
    theta0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    names = list(theta0)
    h = {k: 0.1 * torch.randn_like(v) for k, v in theta0.items()}
    c_i = {k: 0.05 * torch.randn_like(v) for k, v in theta0.items()}
    c = {k: 0.05 * torch.randn_like(v) for k, v in theta0.items()}
    alpha, lr = 0.3, 0.1
    algo = ClientSpec("feddc", feddc_alpha=alpha).build()
    state = {**{f"h_i.{k}": v.clone() for k, v in h.items()}, **{f"c_i.{k}": v.clone() for k, v in c_i.items()}}
    ctx = context(model, client_state=state, server_state={f"c.{k}": v.clone() for k, v in c.items()}, lr=lr)
    data = tiny_split(8, 6)
    schedule = [torch.arange(4), torch.arange(4, 8)]
    train_locally(model, data, LocalTraining(batch_size=4, lr=lr), generator=torch.Generator(), prepare=prepare,
                  schedule=schedule, algorithm=algo, context=ctx)
    # by hand: grad = grad CE + (c - c_i) + alpha (theta + h_i - theta0)
    hand = mlp(0)
    for index in schedule:
        loss = F.cross_entropy(hand(prepare(data.x[index])), data.y[index])
        grads = torch.autograd.grad(loss, list(hand.parameters()))
        with torch.no_grad():
            for (k, p), g in zip(hand.named_parameters(), grads):
                p.sub_(lr * (g + c[k] - c_i[k] + alpha * (p + h[k] - theta0[k])))
    theta = {k: p.detach() for k, p in hand.named_parameters()}
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), theta[k], rtol=1e-5, atol=1e-6)
    message = ctx.scratch["message"]
    for k in names:
        new_h = h[k] + theta[k] - theta0[k]
        new_ci = c_i[k] - c[k] + (theta0[k] - theta[k]) / (2 * lr)  # option II, K = 2 steps
        torch.testing.assert_close(ctx.client_state[f"h_i.{k}"], new_h, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ctx.client_state[f"c_i.{k}"], new_ci, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(message[f"c.{k}"], new_ci - c_i[k], rtol=1e-4, atol=1e-5)
    reply = algo.reply_state(ctx, dict(model.state_dict()))
    for k in names:
        torch.testing.assert_close(reply[k], theta[k] + ctx.client_state[f"h_i.{k}"], rtol=1e-5, atol=1e-6)
    # server: g += (1/N) sum_i Delta g_i, N = 3 clients of which 2 replied
    other = {k: torch.ones_like(v) for k, v in message.items()}
    server = algo.update_server_state({f"c.{k}": v.clone() for k, v in c.items()}, [message, other], 3)
    for k in names:
        torch.testing.assert_close(server[f"c.{k}"], c[k] + (message[f"c.{k}"] + 1) / 3)


def test_feddc_acts_on_shared_parameters_only_and_sends_unchanged_buffers():
    model = mlp(0, bn=True)
    shared = [k for k, _ in model.named_parameters() if not k.startswith("2.")]  # BN "2." stays local
    algo = FedDC(ClientSpec("feddc"))
    ctx = ClientContext("c", 0.1, shared, {k: v.detach().clone() for k, v in model.state_dict().items()
                                           if not k.startswith("2.")},
                        algo.init_server_state(model, shared), {})
    train_locally(model, tiny_split(8, 1), LocalTraining(batch_size=4, lr=0.1), generator=torch.Generator(),
                  prepare=prepare, algorithm=algo, context=ctx)
    assert {k[4:] for k in ctx.client_state if k.startswith("h_i.")} == set(shared)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("2.")}
    reply = algo.reply_state(ctx, state)
    assert set(reply) == set(state)
    for k in state:
        if k not in shared:
            assert reply[k] is state[k]


# ---------------------------------------------------------------------------------------------- Per-FedAvg
def linear(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 3))


def grad_at(model, params, x, y, loss_fn=F.cross_entropy):
    probe = copy.deepcopy(model)
    with torch.no_grad():
        for p, v in zip(probe.parameters(), params):
            p.copy_(v)
    loss = loss_fn(probe(x), y)
    return [g.detach() for g in torch.autograd.grad(loss, list(probe.parameters()))], float(loss.detach())


def test_perfedavg_first_order_step_is_the_two_step_maml_update():
    data = tiny_split(8, 7)
    model = linear()
    start = [p.detach().clone() for p in model.parameters()]
    alpha, beta = 0.05, 0.2
    algo = ClientSpec("perfedavg", perfedavg_alpha=alpha).build()
    schedule = [torch.arange(4), torch.arange(4, 8)]
    result, _ = train_locally(model, data, LocalTraining(batch_size=4, lr=beta), generator=torch.Generator(),
                              prepare=prepare, schedule=schedule, algorithm=algo, context=context(model, lr=beta))
    theta, losses = start, []
    for index in schedule:
        x, y = prepare(data.x[index]), data.y[index]
        g_d, _ = grad_at(model, theta, x[:2], y[:2])
        temp = [t - alpha * g for t, g in zip(theta, g_d)]  # theta' = theta - alpha grad f(theta; D)
        g_o, loss = grad_at(model, temp, x[2:], y[2:])  # grad f(theta'; D')
        theta = [t - beta * g for t, g in zip(theta, g_o)]
        losses.append(loss)
    for p, t in zip(model.parameters(), theta):
        torch.testing.assert_close(p.detach(), t, rtol=1e-5, atol=1e-6)
    assert result.loss_sum == pytest.approx(4 * sum(losses), rel=1e-5)  # the reported loss is f(theta'; D')


def test_perfedavg_hessian_free_step_matches_the_finite_difference_formula():
    data = tiny_split(6, 8)
    model = linear(1)
    start = [p.detach().clone() for p in model.parameters()]
    alpha, beta, delta = 0.05, 0.2, 1e-3
    algo = ClientSpec("perfedavg", perfedavg_alpha=alpha, perfedavg_variant="hf", perfedavg_delta=delta).build()
    train_locally(model, data, LocalTraining(batch_size=6, lr=beta), generator=torch.Generator(), prepare=prepare,
                  schedule=[torch.arange(6)], algorithm=algo, context=context(model, lr=beta))
    x, y = prepare(data.x), data.y
    g_d, _ = grad_at(model, start, x[:2], y[:2])
    temp = [t - alpha * g for t, g in zip(start, g_d)]
    u, _ = grad_at(model, temp, x[2:4], y[2:4])
    plus, _ = grad_at(model, [t + delta * v for t, v in zip(start, u)], x[4:], y[4:])
    minus, _ = grad_at(model, [t - delta * v for t, v in zip(start, u)], x[4:], y[4:])
    d = [(a - b) / (2 * delta) for a, b in zip(plus, minus)]
    expected = [t - beta * (ui - alpha * di) for t, ui, di in zip(start, u, d)]
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-4, atol=1e-5)
    # d approximates the Hessian-vector product H(theta; D'') u
    probe = copy.deepcopy(linear(1))
    loss = F.cross_entropy(probe(x[4:]), y[4:])
    g = torch.autograd.grad(loss, list(probe.parameters()), create_graph=True)
    hvp = torch.autograd.grad(sum((gi * ui).sum() for gi, ui in zip(g, u)), list(probe.parameters()))
    for di, hi in zip(d, hvp):
        torch.testing.assert_close(di, hi, rtol=0.05, atol=2e-3)


def meta_gradient(model, theta, x, y, alpha, loss_fn=F.cross_entropy):
    """Per-FedAvg (FO)'s gradient at theta on a batch split in halves: grad f(theta - alpha grad f(theta; D); D')."""
    half = len(y) // 2
    g_d, _ = grad_at(model, theta, x[:half], y[:half], loss_fn)
    temp = [t - alpha * g for t, g in zip(theta, g_d)]
    return grad_at(model, temp, x[half:], y[half:], loss_fn)


def test_perfedavg_with_weight_perturbation_steps_on_the_meta_gradient_at_the_perturbed_point():
    """HarmoFL's perturbation composed with Per-FedAvg: delta = rho m(theta) / ||m(theta)|| from the meta-gradient
    m, then theta <- theta - beta m(theta + delta) (not the plain gradient at theta + delta)."""
    data = tiny_split(8, 7)
    model = linear(3)
    theta = [p.detach().clone() for p in model.parameters()]
    alpha, beta, rho = 0.05, 0.2, 0.5
    algo = ClientSpec("perfedavg", perfedavg_alpha=alpha).build()
    train_locally(model, data, LocalTraining(batch_size=8, lr=beta), generator=torch.Generator(), prepare=prepare,
                  schedule=[torch.arange(8)], algorithm=algo, context=context(model, lr=beta),
                  weight_perturbation=rho)
    x, y = prepare(data.x), data.y
    m, _ = meta_gradient(model, theta, x, y, alpha)
    norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in m]))
    perturbed = [t + rho * g / norm for t, g in zip(theta, m)]
    m_delta, _ = meta_gradient(model, perturbed, x, y, alpha)
    for p, t, g in zip(model.parameters(), theta, m_delta):
        torch.testing.assert_close(p.detach(), t - beta * g, rtol=1e-5, atol=1e-6)
    plain, _ = grad_at(model, perturbed, x, y)  # what the step took before: the plain loss at theta + delta
    assert max(float((a - b).abs().max()) for a, b in zip(m_delta, plain)) > 1e-3


def test_perfedavg_trains_and_adapts_with_the_runs_loss():
    """A run with the focal loss (ISIC 2019's) gives Per-FedAvg's inner, outer and evaluation steps that loss."""
    from fednorm.methods.tasks import Task

    task = Task(loss_name="focal", focal_alpha=(0.2, 0.5, 0.3))
    data = tiny_split(8, 4)
    model = linear(4)
    theta = [p.detach().clone() for p in model.parameters()]
    alpha, beta = 0.3, 0.5
    algo = ClientSpec("perfedavg", perfedavg_alpha=alpha, perfedavg_eval_steps=1, perfedavg_eval_batch=8,
                      perfedavg_eval_data="train").build()
    ctx = context(model, lr=beta)
    ctx.task = task
    train_locally(model, data, LocalTraining(batch_size=8, lr=beta, task=task), generator=torch.Generator(),
                  prepare=prepare, schedule=[torch.arange(8)], algorithm=algo, context=ctx)
    x, y = prepare(data.x), data.y
    m, _ = meta_gradient(model, theta, x, y, alpha, task.loss)
    trained = [t - beta * g for t, g in zip(theta, m)]
    for p, t in zip(model.parameters(), trained):
        torch.testing.assert_close(p.detach(), t, rtol=1e-5, atol=1e-6)
    algo.adapt_for_evaluation(model, ClientData("c", "d", data, data), prepare, lr=0.0, task=task)
    g, _ = grad_at(model, trained, x, y, task.loss)
    for p, t, gi in zip(model.parameters(), trained, g):
        torch.testing.assert_close(p.detach(), t - alpha * gi, rtol=1e-5, atol=1e-6)
    g_ce, _ = grad_at(model, trained, x, y)
    assert max(float((a - b).abs().max()) for a, b in zip(g, g_ce)) > 1e-3  # the focal loss is not CE here


@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_perfedavg_bn_statistics_move_only_with_the_real_forwards(variant):
    """BN folds in D at theta, then D' at theta' = theta - alpha grad f(theta; D) (momentum 0.1, unbiased
    variance); HF's perturbed forwards on D'' leave the statistics as they were."""
    import copy

    alpha = 0.3  # large enough that theta' is clearly not theta
    model = mlp(0, bn=True)
    start = copy.deepcopy(model)
    data = tiny_split(6, 2)
    algo = ClientSpec("perfedavg", perfedavg_variant=variant, perfedavg_alpha=alpha).build()
    train_locally(model, data, LocalTraining(batch_size=6, lr=0.1), generator=torch.Generator(),
                  prepare=prepare, schedule=[torch.arange(6)], algorithm=algo, context=context(model))
    assert int(model[2].num_batches_tracked) == 2  # D and D'
    x, y = prepare(data.x), data.y
    d, o = (slice(0, 3), slice(3, 6)) if variant == "fo" else (slice(0, 2), slice(2, 4))
    ref = copy.deepcopy(start).train()  # a copy: its forward's statistics must not touch start's
    g = torch.autograd.grad(F.cross_entropy(ref(x[d]), y[d]), list(ref.parameters()))
    with torch.no_grad():
        h_d = start[1](x[d].flatten(1))
        h_o = F.linear(x[o].flatten(1), start[1].weight - alpha * g[0], start[1].bias - alpha * g[1])
    torch.testing.assert_close(model[2].running_mean, 0.9 * 0.1 * h_d.mean(0) + 0.1 * h_o.mean(0))
    torch.testing.assert_close(model[2].running_var, 0.9 * (0.9 + 0.1 * h_d.var(0)) + 0.1 * h_o.var(0))
    # at theta instead of theta' the second forward would give other statistics
    assert (start[1](x[o].flatten(1)).mean(0) - h_o.mean(0)).abs().max() > 1e-3


def test_perfedavg_uses_a_batch_too_small_to_split_whole():
    model = mlp(0, bn=True).train()
    x, y = torch.randn(3, 3, 2, 2), torch.tensor([0, 1, 2])
    parts = PerFedAvg.split_batch(model, x, y, 2)
    assert all(p[0] is x for p in parts)
    assert [len(p[1]) for p in PerFedAvg.split_batch(linear(), x, y, 2)] == [2, 1]


def test_perfedavg_evaluation_steps_on_labelled_samples_of_the_scored_split_and_their_holdout():
    """Two SGD steps with lr alpha on 4 seeded samples of the split being scored: test samples for the test
    metric (the default), validation samples for the validation metric (no test label in model selection)."""
    client = ClientData("c", "d", tiny_split(12, 9), tiny_split(10, 10), tiny_split(6, 11))
    alpha = 0.3
    algo = ClientSpec("perfedavg", perfedavg_alpha=alpha, perfedavg_eval_steps=2, perfedavg_eval_batch=4,
                      perfedavg_eval_seed=5).build()
    for split in ("test", "val"):
        model = linear(2)
        start = [p.detach().clone() for p in model.parameters()]
        extra = {} if split == "test" else {"split": split}  # the test split is the default
        algo.adapt_for_evaluation(model, client, prepare, lr=99.0, **extra)  # the engine's lr (beta) is not used
        data = getattr(client, split)
        index = torch.randperm(len(data), generator=torch.Generator().manual_seed(5))[:4].sort().values
        theta = start
        for _ in range(2):
            g, _ = grad_at(model, theta, prepare(data.x[index]), data.y[index])
            theta = [t - alpha * gi for t, gi in zip(theta, g)]
        for p, t in zip(model.parameters(), theta):
            torch.testing.assert_close(p.detach(), t, rtol=1e-5, atol=1e-6)
        assert torch.equal(algo.evaluation_holdout(client, split), index)


def test_perfedavg_evaluation_on_training_data_holds_out_nothing():
    model = linear(2)
    start = [p.detach().clone() for p in model.parameters()]
    client = ClientData("c", "d", tiny_split(12, 9), tiny_split(10, 10))
    algo = ClientSpec("perfedavg", perfedavg_alpha=0.3, perfedavg_eval_batch=12, perfedavg_eval_data="train").build()
    algo.adapt_for_evaluation(model, client, prepare, lr=0.0)
    g, _ = grad_at(model, start, prepare(client.train.x), client.train.y)
    for p, t, gi in zip(model.parameters(), start, g):
        torch.testing.assert_close(p.detach(), t - 0.3 * gi, rtol=1e-5, atol=1e-6)
    assert algo.evaluation_holdout(client, "test") is None


def test_stateful_flags():
    assert Moon.stateful and FedDC.stateful and not PerFedAvg.stateful


@pytest.mark.parametrize("fields, match", [
    ({"moon_tau": 0.0}, "moon_tau"), ({"moon_mu": -1.0}, "moon_mu"), ({"feddc_alpha": -0.1}, "feddc_alpha"),
    ({"perfedavg_alpha": 0.0}, "perfedavg_alpha"), ({"perfedavg_variant": "so"}, "perfedavg_variant"),
    ({"perfedavg_eval_data": "val"}, "perfedavg_eval_data"), ({"perfedavg_eval_batch": 0}, "perfedavg_eval_batch"),
    ({"name": "fedfoo"}, "unknown client algorithm"),
])
def test_client_spec_rejects_bad_values(fields, match):
    with pytest.raises(ValueError, match=match):
        ClientSpec(**{"name": "sgd", **fields})


# ---------------------------------------------------------------------------------------------- SCAFFOLD
def test_effective_steps_of_sgd_with_momentum():
    from fednorm.methods.client_algorithms import effective_steps

    assert effective_steps(5) == 5
    beta, K = 0.9, 7
    assert effective_steps(K, beta) == pytest.approx((K - beta * (1 - beta**K) / (1 - beta)) / (1 - beta))  # FedNova
    # EMA momentum from a zero buffer: buf_k = 1 - b^k, so K steps move K - b (1 - b^K) / (1 - b) gradients
    assert effective_steps(K, beta, "ema") == pytest.approx(K - beta * (1 - beta**K) / (1 - beta))


@pytest.mark.parametrize("style", ["pytorch", "ema"])
def test_effective_steps_equal_the_local_optimizers_movement_under_a_constant_gradient(style):
    from fednorm.methods.client_algorithms import effective_steps
    from fednorm.methods.local_update import LocalTraining, build_optimizer

    w = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    g = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    cfg = LocalTraining(lr=0.1, momentum=0.9, momentum_style=style)
    optimizer = build_optimizer([w], cfg)
    for _ in range(6):
        w.grad = g.clone()
        optimizer.step()
    assert torch.allclose(w.detach(), -0.1 * effective_steps(6, 0.9, style) * g)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_scaffold_option_two_recovers_a_constant_gradient_with_or_without_momentum(momentum):
    """A linear loss has the same gradient g everywhere: the local steps follow g + c - c_i, so option II's
    c_i+ = c_i - c + (x - y_i) / (K lr) is g, momentum or not, whatever c and c_i were; the client sends
    Delta c_i = c_i+ - c_i (a flipped correction, or c_i+ sent instead of its change, would not give these)."""
    from fednorm.methods.client_algorithms import Scaffold

    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False)
    weight = torch.randn(1, 4)
    x = torch.randn(16, 4)
    c, c_i = torch.tensor([[0.3, -0.2, 0.5, 0.1]]), torch.tensor([[-0.4, 0.6, 0.2, -0.3]])
    ctx = context(model, lr=0.05, client_state={"c_i.weight": c_i.clone()})
    ctx.momentum = momentum
    ctx.server_state = {"c.weight": c}
    algo = Scaffold(ClientSpec("scaffold"))
    algo.on_start(ctx, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    for _ in range(6):
        opt.zero_grad()
        (model(x) * weight.sum()).mean().backward()
        algo.on_gradients(ctx, model)
        opt.step()
    grad = (x.mean(0) * weight.sum()).reshape(1, 4)
    message = algo.on_end(ctx, model, 6)
    torch.testing.assert_close(ctx.client_state["c_i.weight"], grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(message["c.weight"], grad - c_i, rtol=1e-5, atol=1e-6)


def test_scaffold_literal_step_count_divides_the_drift_by_k_lr_under_momentum():
    """scaffold_effective_steps=False is the papers' formula c_i+ = c_i - c + (x - y_i) / (K lr) as written."""
    from fednorm.methods.client_algorithms import Scaffold

    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False)
    start = model.weight.detach().clone()
    x = torch.randn(16, 4)
    c, c_i = torch.tensor([[0.3, -0.2, 0.5, 0.1]]), torch.tensor([[-0.4, 0.6, 0.2, -0.3]])
    ctx = context(model, lr=0.05, client_state={"c_i.weight": c_i.clone()})
    ctx.momentum = 0.9
    ctx.server_state = {"c.weight": c}
    algo = Scaffold(ClientSpec("scaffold", scaffold_effective_steps=False))
    algo.on_start(ctx, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(6):
        opt.zero_grad()
        model(x).mean().backward()
        algo.on_gradients(ctx, model)
        opt.step()
    algo.on_end(ctx, model, 6)
    torch.testing.assert_close(ctx.client_state["c_i.weight"], c_i - c + (start - model.weight.detach()) / (6 * 0.05))
