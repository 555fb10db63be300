"""FedWon, FixBN and cross-device federations in the in-process engine."""

import math

import pytest
import torch
from torch.nn.modules.batchnorm import _BatchNorm

from fednorm.data.domain import ClientData, normalize_batch
from fednorm.engines.simulation import Federation, InProcessEngine
from fednorm.methods import LocalTraining, resolve_method, train_locally
from fednorm.models import DigitCNN, WSConv2d, build_model

from ..conftest import make_split

TRAIN = LocalTraining(batch_size=8, lr=0.05)


def make_engine(clients, method, model, training=TRAIN, **fed):
    fed.setdefault("channels_last", False)
    return InProcessEngine(model, clients, resolve_method(method) if isinstance(method, str) else method,
                           training, Federation(**fed), normalize_batch)


def device_clients(n, size=6):
    return [ClientData(f"d{i % 2}-{i}", f"d{i % 2}", make_split(size, seed=i, shift=30.0 * (i % 2)),
                       make_split(8, seed=1000 + i % 2, shift=30.0 * (i % 2))) for i in range(n)]


def test_fedwon_model_is_normalization_free_and_keeps_nothing_local(tiny_clients):
    torch.manual_seed(0)
    model = build_model("digit_cnn", norm="ws", classifier="fedwon", width=0.125)
    eng = make_engine(tiny_clients, "fedwon", model)
    assert eng.local_keys == frozenset()
    assert any(k.endswith(".gain") for k in eng.shared_keys)  # WSConv gains are averaged like any parameter
    assert not any(k.endswith((".eps", ".fan_in")) for k in eng.global_state)  # non-persistent buffers
    eng.run_round()
    assert eng.local_states == {}


@pytest.mark.parametrize("exclude_head", [True, False])
def test_agc_clips_the_local_step_unit_wise_after_the_prox_term(tiny_clients, exclude_head):
    """One full-batch SGD step of a WSConv model with AGC (lambda 0.01) and a FedProx term: every parameter
    moves by -lr * clip(g + mu (w - w_ref)), unit by unit, the final classifier unclipped by default."""
    client, lr, clip, mu = tiny_clients[0], 0.05, 0.01, 0.1
    torch.manual_seed(0)
    model = build_model("digit_cnn", norm="ws", classifier="fedwon", width=0.125, dropout=0.0)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    reference = {n: p.detach() + 0.5 for n, p in model.named_parameters()}
    # the expected step, by hand: gradient of the mean cross-entropy plus mu (w - w_ref), then Eq. 4 per unit
    loss = torch.nn.functional.cross_entropy(model(normalize_batch(client.train.x)), client.train.y)
    grads = dict(zip([n for n, _ in model.named_parameters()], torch.autograd.grad(loss, list(model.parameters()))))
    head = {"classifier.6.weight", "classifier.6.bias"}
    expected, clipped_units = {}, 0
    for name, p in model.named_parameters():
        g = grads[name] + mu * (p.detach() - reference[name])
        if not (exclude_head and name in head):
            w_norm = p.detach().flatten(1).norm(dim=1) if p.dim() > 1 else p.detach().norm().reshape(1)
            g_norm = g.flatten(1).norm(dim=1) if g.dim() > 1 else g.norm().reshape(1)
            limit = clip * w_norm.clamp(min=1e-3)
            scale = torch.where(g_norm > limit, limit / g_norm, torch.ones_like(g_norm))
            clipped_units += int((g_norm > limit).sum())
            g = g * scale.reshape(-1, *([1] * (g.dim() - 1)))
        expected[name] = p.detach() - lr * g
    assert clipped_units > 0
    model.load_state_dict(start)
    train_locally(model, client.train, LocalTraining(batch_size=len(client.train), lr=lr),
                  generator=torch.Generator().manual_seed(1), prepare=normalize_batch, prox_reference=reference,
                  prox_mu=mu, agc_clip=clip, agc_exclude_head=exclude_head)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=1e-5, atol=1e-6)
    unclipped = start["classifier.6.weight"] - lr * (grads["classifier.6.weight"] + mu * (
        start["classifier.6.weight"] - reference["classifier.6.weight"]))
    assert torch.allclose(model.classifier[6].weight.detach(), unclipped, rtol=1e-5, atol=1e-6) == exclude_head


def test_fixbn_freezes_statistics_from_its_switch_round(tiny_clients, monkeypatch):
    import fednorm.engines.client_step as client_step

    freeze_flags = []

    def recording_train_locally(*args, **kwargs):
        freeze_flags.append(kwargs["freeze_bn_stats"])
        return train_locally(*args, **kwargs)

    monkeypatch.setattr(client_step, "train_locally", recording_train_locally)
    torch.manual_seed(0)
    model = DigitCNN(width=0.125, classifier="fedwon")
    eng = make_engine(tiny_clients, resolve_method("fixbn", freeze_bn_stats_at=2), model, rounds=4)
    assert eng.freeze_round == 2
    replies = []
    add = eng.server.add
    monkeypatch.setattr(eng.server, "add", lambda reply: (replies.append(reply), add(reply))[-1])
    stats = lambda: eng.global_state["features.1.running_mean"].clone()  # noqa: E731
    before = stats()
    eng.run_round()
    eng.run_round()
    phase1 = stats()
    counter = eng.global_state["features.1.num_batches_tracked"].clone()
    assert not torch.equal(phase1, before)  # phase 1: ordinary BN, statistics learned and averaged
    weight = eng.global_state["features.1.weight"].clone()
    replies.clear()
    eng.run_round()
    n = len(tiny_clients)
    assert freeze_flags == [False] * 2 * n + [True] * n  # the switch reaches local training in round 2, not before
    # phase 2: each client trains with the frozen statistics and sends them back untouched (not only the server
    # keeping its copy), so the shared statistics stay those of phase 1
    assert len(replies) == n
    for reply in replies:
        torch.testing.assert_close(reply.state["features.1.running_mean"], phase1, rtol=0, atol=0)
        assert torch.equal(reply.state["features.1.num_batches_tracked"], counter)
    torch.testing.assert_close(stats(), phase1, rtol=0, atol=0)
    assert not torch.equal(eng.global_state["features.1.weight"], weight)  # affine still trains


def test_fixbn_default_switch_is_half_the_rounds():
    assert resolve_method("fixbn").freeze_round(100) == 50
    # half an odd number of rounds rounds up, whatever the parity of the neighbours (Python's round() would give 12 of
    # 25 but 8 of 15)
    assert [resolve_method("fixbn").freeze_round(r) for r in (25, 15, 3)] == [13, 8, 2]
    assert resolve_method("fixbn", freeze_bn_stats_at=30).freeze_round(100) == 30


def test_frozen_bn_normalizes_with_running_statistics_in_training():
    """FixBN's second phase: every training step normalizes with the running statistics (so at lr 0 the training
    loss is the evaluation-mode loss, sample by sample) and leaves them, and the counter, untouched."""
    torch.manual_seed(0)
    model = DigitCNN(width=0.125)  # BatchNorm in features and classifier, no dropout
    with torch.no_grad():  # running statistics that are not the initial 0 / 1
        model.train()
        for seed in (7, 8):
            model(normalize_batch(make_split(16, seed=seed).x))
    before = {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}
    data = make_split(8, seed=3)
    model.eval()
    with torch.no_grad():
        eval_loss = torch.nn.functional.cross_entropy(model(normalize_batch(data.x)), data.y).item()
    result, _ = train_locally(model, data, LocalTraining(batch_size=1, lr=0.0),
                              generator=torch.Generator().manual_seed(0), prepare=normalize_batch,
                              freeze_bn_stats=True)  # batches of one are fine once frozen
    assert result.num_steps == 8
    assert result.mean_loss == pytest.approx(eval_loss, rel=1e-5)
    assert all(not m.training for m in model.modules() if isinstance(m, _BatchNorm))
    for k, v in before.items():
        assert torch.equal(model.state_dict()[k], v), k


def test_cross_device_refuses_methods_with_client_state():
    clients = device_clients(6)
    for method in ("fedbn", "silobn", "singleset"):
        with pytest.raises(ValueError, match="cross-device clients"):
            make_engine(clients, method, DigitCNN(width=0.125), stateless_clients=True, fraction=0.5)
    with pytest.raises(ValueError, match="stateless"):
        Federation(stateless_clients=True, persistent_optimizer=True)


def test_cross_device_sampling_is_seeded_and_keeps_no_client_state():
    clients = device_clients(20)
    model = build_model("digit_cnn", norm="ws", classifier="fedwon", width=0.125)
    eng = make_engine(clients, "fedwon", model, stateless_clients=True, fraction=0.2, seed=5,
                      training=LocalTraining(batch_size=2, lr=0.05))
    picks = [[c.name for c in eng.sample_clients(r)] for r in range(5)]
    assert all(len(p) == 4 for p in picks)
    assert len({tuple(p) for p in picks}) > 1  # a new draw every round
    again = make_engine(clients, "fedwon", build_model("digit_cnn", norm="ws", classifier="fedwon", width=0.125),
                        stateless_clients=True, fraction=0.2, seed=5)
    assert picks == [[c.name for c in again.sample_clients(r)] for r in range(5)]
    other = make_engine(clients, "fedwon", build_model("digit_cnn", norm="ws", classifier="fedwon", width=0.125),
                        stateless_clients=True, fraction=0.2, seed=6)
    assert picks != [[c.name for c in other.sample_clients(r)] for r in range(5)]
    results = eng.run_round()
    assert sorted(results) == sorted(picks[0])
    assert eng.local_states == {} and eng.optimizer_states == {}


def test_batch_size_one_trains_fedwon_and_refuses_batchnorm(tiny_clients):
    one = LocalTraining(batch_size=1, lr=0.01)
    model = build_model("digit_cnn", norm="ws", classifier="fedwon", width=0.125)
    eng = make_engine(tiny_clients, "fedwon", model, training=one)
    before = {k: v.clone() for k, v in eng.global_state.items()}
    results = eng.run_round()
    for c in tiny_clients:  # one step per sample, every loss finite
        assert results[c.name].num_steps == results[c.name].num_examples == c.num_train
        assert math.isfinite(results[c.name].mean_loss)
    assert all(not torch.equal(eng.global_state[k], before[k]) for k in ("features.0.weight", "features.0.gain"))
    with pytest.raises(ValueError, match="batch_size 1"):
        make_engine(tiny_clients, "fedavg", DigitCNN(width=0.125), training=one).run_round()


def test_fedbn_needs_a_model_with_batchnorm(tiny_clients):
    with pytest.raises(ValueError, match="no BatchNorm"):
        make_engine(tiny_clients, "fedbn", DigitCNN(width=0.125, norm="gn"))


def test_ws_layers_are_wsconv_in_every_registered_model():
    """norm ws: every Conv2d of every registered model is a WSConv2d and no normalization layer is left (the MLP has
    no convolution: ws is no normalization there; the U-Net's 1 x 1 output conv is its classifier, plain as the
    Linear heads of the others)."""
    import inspect

    from fednorm.models.registry import MODEL_NAMES, model_builder
    from fednorm.models.wsconv import NORM_LAYER_TYPES

    for name in MODEL_NAMES:
        accepted = inspect.signature(model_builder(name)).parameters
        small = {"width": 0.25, "width_mult": 0.25, "in_features": 8}  # build fast; the layer types are the same
        model = build_model(name, norm="ws", **{k: v for k, v in small.items() if k in accepted})
        head = [model.head] if name == "unet" else []
        convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d) and not any(m is h for h in head)]
        assert all(isinstance(c, WSConv2d) for c in convs), name
        assert all(type(h) is torch.nn.Conv2d for h in head)
        assert bool(convs) == (name != "mlp"), name
        assert not [m for m in model.modules() if isinstance(m, NORM_LAYER_TYPES)], name
