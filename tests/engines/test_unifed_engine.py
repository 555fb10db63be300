"""MOON, FedDC and Per-FedAvg end to end through the in-process engine, with shared and client-specific BN."""

import math
from dataclasses import replace

import pytest
import torch

from fednorm.data.domain import normalize_batch
from fednorm.engines.simulation import Federation, InProcessEngine
from fednorm.methods import LocalTraining
from fednorm.methods.client_algorithms import ClientSpec
from fednorm.methods.presets import Method
from fednorm.models import DigitCNN

from ..conftest import make_split

TRAIN = LocalTraining(batch_size=8, lr=0.05)
SPECS = {
    "moon": ClientSpec("moon"),
    "feddc": ClientSpec("feddc"),
    "perfedavg": ClientSpec("perfedavg", perfedavg_eval_batch=8),
}


def method(name, policy, **client):
    spec = replace(SPECS[name], **client)
    return Method(f"{name}_{policy}", f"{name} with policy {policy}", policy, client=spec)


def engine(clients, m, **fed):
    torch.manual_seed(5)
    return InProcessEngine(DigitCNN(width=0.125), clients, m, TRAIN,
                           Federation(seed=1, channels_last=False, **fed), normalize_batch)


@pytest.mark.parametrize("policy", ["shared", "local_bn"])
@pytest.mark.parametrize("name", ["moon", "feddc", "perfedavg"])
def test_algorithm_runs_and_keeps_its_state_where_it_should(tiny_clients, name, policy):
    e = engine(tiny_clients, method(name, policy))
    for _ in range(2):
        results = e.run_round()
        assert all(math.isfinite(r.mean_loss) for r in results.values())
    evals = e.evaluate(("test",))
    assert len(evals) == 3 and all(math.isfinite(ev.loss) for ev in evals)
    state_keys = set(e.model.state_dict())
    for c in tiny_clients:
        state = e.algorithm_states.get(c.name, {})
        if name == "moon":  # the previous local model, every entry
            assert {k[5:] for k in state} == state_keys
            if policy == "local_bn":  # its BN entries are the client's own trained ones
                for k in e.local_keys:
                    torch.testing.assert_close(state[f"prev.{k}"], e.local_states[c.name][k])
        elif name == "feddc":  # drift and correction state on the aggregated parameters only
            assert {k[4:] for k in state if k.startswith("h_i.")} == set(e.shared_params)
            assert {k[4:] for k in state if k.startswith("c_i.")} == set(e.shared_params)
            assert not any(k[4:] in e.local_keys for k in state)
        else:
            assert state == {}
    if name == "feddc":
        assert {k[2:] for k in e.algorithm_server_state} == set(e.shared_params)
    if policy == "local_bn":
        assert "features.1.weight" in e.local_keys and "features.1.weight" not in e.shared_params


def test_moon_previous_model_is_the_clients_trained_model(tiny_clients):
    e = engine(tiny_clients[:1], method("moon", "shared"))
    e.run_round()
    # one client: the FedAvg mean is its trained model, which MOON keeps as the previous model
    for k, v in e.global_state.items():
        torch.testing.assert_close(e.algorithm_states["c0"][f"prev.{k}"].to(v.dtype), v)


def test_feddc_rounds_by_hand_penalty_drift_and_upload(tiny_clients):
    """Two FedDC rounds of one client, replayed by hand: SGD whose gradient gets alpha (theta_i + h_i - theta)
    (the correction g - g_i is zero for a lone client: g is its own g_i), then h_i += theta_i - theta and the
    client sends theta_i + h_i, which the server (one client) takes as the new global model."""
    import copy

    from fednorm.engines.simulation import derive_seed
    from fednorm.methods import train_locally

    alpha = 0.5  # large enough that a dropped penalty shows far beyond the tolerance
    e = engine(tiny_clients[:1], method("feddc", "shared", feddc_alpha=alpha))
    theta, h = {k: v.clone() for k, v in e.global_state.items()}, {k: 0.0 for k in e.shared_params}
    for r in range(2):
        model = copy.deepcopy(e.model)
        model.load_state_dict(theta)
        params = dict(model.named_parameters())
        hooks = [params[k].register_hook(lambda g, p=params[k], a=theta[k] - h[k]: g + alpha * (p.detach() - a))
                 for k in e.shared_params]
        seed = derive_seed(1, r, e._index["c0"], 2)
        torch.manual_seed(seed)
        train_locally(model, tiny_clients[0].train, TRAIN, generator=torch.Generator().manual_seed(seed),
                      prepare=normalize_batch)
        for hook in hooks:
            hook.remove()
        e.run_round()
        trained = model.state_dict()
        h = {k: h[k] + trained[k] - theta[k] for k in e.shared_params}
        for k, v in e.global_state.items():
            if k in e.shared_params:
                torch.testing.assert_close(e.algorithm_states["c0"][f"h_i.{k}"], h[k], rtol=1e-5, atol=1e-6, msg=k)
                torch.testing.assert_close(v, trained[k] + h[k], rtol=1e-5, atol=1e-6, msg=k)
            else:  # BN running statistics: the client's own
                torch.testing.assert_close(v.to(trained[k].dtype), trained[k], msg=k)
        theta = {k: v.clone() for k, v in e.global_state.items()}


def test_perfedavg_personalizes_before_evaluation(tiny_clients):
    adapted = engine(tiny_clients, method("perfedavg", "local_bn"))
    plain = engine(tiny_clients, method("perfedavg", "local_bn", perfedavg_eval_steps=0))
    adapted.run_round()
    plain.run_round()
    for k, v in adapted.global_state.items():  # same training
        torch.testing.assert_close(plain.global_state[k], v)
    a, p = adapted.evaluate(("test",)), plain.evaluate(("test",))
    assert all(x.loss != y.loss for x, y in zip(a, p))  # every client adapts
    held = adapted.algorithm.evaluation_holdout(tiny_clients[0], "test")
    assert len(held) == 8
    # the 8 labelled test samples the client adapted on are left out of its test metric (20 - 8 = 12)
    assert [x.num_examples for x in a if x.split == "test"] == [12] * len(tiny_clients)
    assert [x.num_examples for x in p if x.split == "test"] == [20] * len(tiny_clients)
    client = tiny_clients[0]
    keep = torch.ones(len(client.test), dtype=torch.bool)
    keep[held] = False
    prepare = adapted.runner.evaluation_prepare(adapted.input_state)
    adapted.load_client(client.name)
    adapted.algorithm.adapt_for_evaluation(adapted.model, client, prepare, adapted.training.lr, "test")
    rest = type(client.test)(client.test.x[keep], client.test.y[keep])
    acc, loss = adapted.evaluate_split(rest, prepare)
    c0 = next(x for x in a if x.client == client.name and x.split == "test")
    assert (c0.accuracy, c0.loss) == pytest.approx((acc, loss), rel=1e-6)


def test_perfedavg_validation_metric_adapts_on_validation_samples_not_test_ones(tiny_clients):
    """The validation metric picks the reported round, so it must not come from a model adapted on test
    labels: each split is scored after adapting on its own labelled samples, which it then leaves out."""
    clients = [replace(c, val=make_split(12, seed=200 + i, shift=40.0 * i)) for i, c in enumerate(tiny_clients)]
    e = engine(clients, method("perfedavg", "local_bn", perfedavg_eval_batch=4))
    e.run_round()
    client = clients[0]
    scores = {(x.client, x.split): x for x in e.evaluate(("test", "val"))}
    prepare = e.runner.evaluation_prepare(e.input_state)
    for split in ("test", "val"):
        data = getattr(client, split)
        keep = torch.ones(len(data), dtype=torch.bool)
        keep[e.algorithm.adaptation_index(len(data))] = False
        e.load_client(client.name)
        with torch.no_grad():
            before = {k: v.clone() for k, v in e.model.state_dict().items()}
        e.algorithm.adapt_for_evaluation(e.model, client, prepare, e.training.lr, split)
        assert any(not torch.equal(before[k], v) for k, v in e.model.state_dict().items())
        acc, loss = e.evaluate_split(type(data)(data.x[keep], data.y[keep]), prepare)
        got = scores[(client.name, split)]
        assert got.num_examples == int(keep.sum())
        assert (got.accuracy, got.loss) == pytest.approx((acc, loss), rel=1e-6)


def test_cross_device_refuses_stateful_moon_and_feddc_but_runs_perfedavg(tiny_clients):
    for name in ("moon", "feddc"):
        with pytest.raises(ValueError, match=name):
            engine(tiny_clients, method(name, "shared"), stateless_clients=True)
    e = engine(tiny_clients, method("perfedavg", "shared"), stateless_clients=True)
    e.run_round()
    assert e.algorithm_states == {}


@pytest.mark.parametrize("name", ["fedavg", "fedprox", "scaffold", "fedavgm", "fedadam", "fedyogi", "fedadagrad",
                                  "fednova", "moon", "feddc", "perfedavg"])
def test_the_local_bn_add_on_keeps_exactly_the_bn_state_local_under_every_algorithm(tiny_clients, name):
    """UniFed's add-on, one option on any base algorithm: every BN entry (affine and running statistics) and only
    those stay with the clients; the server's update (mean, server optimizer, FedNova's normalized average,
    SCAFFOLD/FedDC corrections) moves the shared weights and never touches a BN entry of the global model."""
    from torch.nn.modules.batchnorm import _BatchNorm

    from fednorm.methods.presets import resolve_method

    client = {"perfedavg_eval_batch": 8} if name == "perfedavg" else {}
    e = engine(tiny_clients, resolve_method(name, policy="local_bn", client=client or None))
    bn_keys = {f"{module_name}.{k}" for module_name, module in e.model.named_modules()
               if isinstance(module, _BatchNorm) for k in module.state_dict()}
    assert bn_keys and set(e.local_keys) == bn_keys
    assert not bn_keys & set(e.shared_keys)
    before = {k: v.clone() for k, v in e.global_state.items()}
    for _ in range(2):
        e.run_round()
    for k in bn_keys:  # the server never aggregates nor steps a BN entry
        torch.testing.assert_close(e.global_state[k], before[k], rtol=0, atol=0)
    assert all(not torch.equal(e.global_state[k], before[k]) for k in e.shared_params)  # the shared weights moved
    for c in tiny_clients:  # each client holds exactly its own trained BN state
        assert set(e.local_states[c.name]) == bn_keys
        assert not torch.equal(e.local_states[c.name]["features.1.running_mean"], before["features.1.running_mean"])
    first, second = (e.local_states[c.name]["features.1.weight"] for c in tiny_clients[:2])
    assert not torch.equal(first, second)
