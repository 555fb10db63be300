"""External-client evaluation: test-time BN statistics (UniFed), averaged BN affine (FedBN App. G) and averaged BN
layers with their statistics (FedWon Table 12's other reading)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fednorm.data.domain import Split
from fednorm.methods.external import (
    ABLATION_MOMENTA, ABLATION_TEST_BATCH_SIZES, DEFAULT_MOMENTUM, DEFAULT_TEST_BATCH_SIZE, FEDBN_APPENDIX_G,
    ExternalBN, average_bn_layers, batch_order, evaluate_bn_average, evaluate_external, evaluate_fedbn_average,
    evaluate_test_time_bn, reestimate_bn_statistics,
)


def prepare(x):
    return x.float() / 25.0


def data(n=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, 2, 2, 2), generator=g, dtype=torch.uint8)
    return Split(x, torch.randint(0, 3, (n,), generator=g))


def bn_model(seed=0):
    """BN2d first (its input is the prepared data), then a linear head."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(8, 3))
    with torch.no_grad():
        model[0].weight.uniform_(0.5, 1.5)
        model[0].bias.uniform_(-0.5, 0.5)
        model[0].running_mean.uniform_(0, 5)
        model[0].running_var.uniform_(1, 3)
    return model


def stats(x):
    """Channel mean and biased variance of an (N, C, H, W) batch."""
    return x.mean((0, 2, 3)), x.var((0, 2, 3), correction=0)


def hand_ema(model, split, batches, tau, reset=True):
    """UniFed's reconstructed Eq. 4 (history convention), batch by batch; returns the stats after each batch."""
    m, v = model[0].running_mean.clone(), model[0].running_var.clone()
    out = []
    for b, index in enumerate(batches):
        bm, bv = stats(prepare(split.x[index]))
        if b == 0 and reset:
            m, v = bm, bv
        else:
            m, v = tau * m + (1 - tau) * bm, tau * v + (1 - tau) * bv
        out.append((m, v))
    return out


def head(model, x, m, v):
    bn = model[0]
    h = (x - m.view(1, -1, 1, 1)) / torch.sqrt(v.view(1, -1, 1, 1) + bn.eps) * bn.weight.view(1, -1, 1, 1) \
        + bn.bias.view(1, -1, 1, 1)
    return model[2](h.flatten(1))


def metrics(pairs):
    correct = sum(int((lg.argmax(1) == y).sum()) for lg, y in pairs)
    loss = sum(float(F.cross_entropy(lg, y, reduction="sum")) for lg, y in pairs)
    n = sum(len(y) for _, y in pairs)
    return correct / n, loss / n


def test_statistics_are_the_momentum_average_over_batches_in_data_order():
    model, split = bn_model(), data(10)
    net = reestimate_bn_statistics(model, split, prepare, ExternalBN(batch_size=4, momentum=0.9))
    batches = [torch.arange(0, 4), torch.arange(4, 8), torch.arange(8, 10)]  # the tail batch of 2 is kept
    m, v = hand_ema(model, split, batches, tau=0.9)[-1]
    torch.testing.assert_close(net[0].running_mean, m)
    torch.testing.assert_close(net[0].running_var, v)
    assert not torch.equal(model[0].running_mean, net[0].running_mean)  # the given model is not changed


def test_pytorch_convention_weights_the_new_batch():
    model, split = bn_model(), data(10)
    a = reestimate_bn_statistics(model, split, prepare, ExternalBN(batch_size=3, momentum=0.9))
    b = reestimate_bn_statistics(model, split, prepare, ExternalBN(batch_size=3, momentum=0.1, convention="pytorch"))
    torch.testing.assert_close(a[0].running_mean, b[0].running_mean)
    torch.testing.assert_close(a[0].running_var, b[0].running_var)


def test_keeping_the_statistics_starts_from_the_models_running_ones():
    model, split = bn_model(), data(8)
    net = reestimate_bn_statistics(model, split, prepare, ExternalBN(batch_size=4, momentum=0.7, reset=False))
    m, v = hand_ema(model, split, [torch.arange(4), torch.arange(4, 8)], tau=0.7, reset=False)[-1]
    torch.testing.assert_close(net[0].running_mean, m)
    torch.testing.assert_close(net[0].running_var, v)


def test_seeded_shuffle_sets_the_batch_order():
    model, split = bn_model(), data(9)
    order = torch.randperm(9, generator=torch.Generator().manual_seed(3))
    assert torch.equal(torch.cat(batch_order(9, 4, shuffle_seed=3)), order)
    net = reestimate_bn_statistics(model, split, prepare, ExternalBN(batch_size=4, momentum=0.5, shuffle_seed=3))
    m, _ = hand_ema(model, split, list(torch.split(order, 4)), tau=0.5)[-1]
    torch.testing.assert_close(net[0].running_mean, m)


def test_online_prediction_uses_the_statistics_updated_with_each_batch():
    model, split = bn_model(), data(10)
    bn = ExternalBN(batch_size=4, momentum=0.8)
    batches = batch_order(10, 4)
    tracked = hand_ema(model, split, batches, tau=0.8)
    with torch.no_grad():
        pairs = [(head(model, prepare(split.x[i]), m, v), split.y[i]) for i, (m, v) in zip(batches, tracked)]
    acc, loss = metrics(pairs)
    result = evaluate_test_time_bn(model, split, prepare, bn)
    assert result.num_examples == 10
    assert result.accuracy == pytest.approx(acc)
    assert result.loss == pytest.approx(loss, rel=1e-5)


def test_after_pass_prediction_uses_the_final_statistics():
    model, split = bn_model(), data(10)
    batches = batch_order(10, 4)
    m, v = hand_ema(model, split, batches, tau=0.8)[-1]
    with torch.no_grad():
        pairs = [(head(model, prepare(split.x[i]), m, v), split.y[i]) for i in batches]
    result = evaluate_test_time_bn(model, split, prepare, ExternalBN(batch_size=4, momentum=0.8, predict="after_pass"))
    assert result.loss == pytest.approx(metrics(pairs)[1], rel=1e-5)


def test_momentum_zero_is_the_one_batch_study_batch_statistics_only():
    model, split = bn_model(), data(12)
    result = evaluate_test_time_bn(model, split, prepare, ExternalBN(batch_size=4, momentum=0.0))
    train_mode = copy.deepcopy(model).train()  # BN in training mode normalizes with the batch's own statistics
    with torch.no_grad():
        pairs = [(train_mode(prepare(split.x[i])), split.y[i]) for i in batch_order(12, 4)]
    assert result.loss == pytest.approx(metrics(pairs)[1], rel=1e-5)


def test_a_one_value_last_batch_keeps_the_tracked_statistics():
    """Before a BatchNorm1d a last batch of one sample has no variance: it is predicted with the statistics
    of the batches before it (at momentum 0: the previous batch's), not with (x, 0)."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Flatten(), nn.BatchNorm1d(8), nn.Linear(8, 3))
    split = data(5)
    bn = ExternalBN(batch_size=4, momentum=0.0)
    result = evaluate_test_time_bn(model, split, prepare, bn)
    x = prepare(split.x).flatten(1)
    m, v = x[:4].mean(0), x[:4].var(0, correction=0)
    with torch.no_grad():
        logits = model[2]((x - m) / torch.sqrt(v + model[1].eps) * model[1].weight + model[1].bias)
    assert result.loss == pytest.approx(metrics([(logits, split.y)])[1], rel=1e-5)
    after = reestimate_bn_statistics(model, split, prepare, bn)
    torch.testing.assert_close(after[1].running_var, v)


def test_at_test_batch_size_one_a_batchnorm1d_keeps_the_models_statistics_while_bn2d_adapts():
    """Test batch size 1: the BN2d layer (4 values per channel) follows Eq. 4 from the first sample on; the
    BatchNorm1d after it sees one value per channel in every batch, so it never gets a variance and normalizes with
    the model's statistics (not with (x, 0) set by the first sample, which would divide by sqrt(eps))."""
    model = bn_model()
    model.insert(2, nn.BatchNorm1d(8))
    with torch.no_grad():
        model[2].running_mean.uniform_(-1, 1)
        model[2].running_var.uniform_(0.5, 2)
    split = data(5)
    batches = batch_order(5, 1)
    tracked = hand_ema(model, split, batches, tau=0.9)
    net = reestimate_bn_statistics(model, split, prepare, ExternalBN(batch_size=1, momentum=0.9))
    torch.testing.assert_close(net[2].running_mean, model[2].running_mean)
    torch.testing.assert_close(net[2].running_var, model[2].running_var)
    torch.testing.assert_close(net[0].running_mean, tracked[-1][0])
    torch.testing.assert_close(net[0].running_var, tracked[-1][1])
    bn1d = model[2]
    with torch.no_grad():
        pairs = []
        for index, (m, v) in zip(batches, tracked):
            x = prepare(split.x[index])
            h = (x - m.view(1, -1, 1, 1)) / torch.sqrt(v.view(1, -1, 1, 1) + model[0].eps) \
                * model[0].weight.view(1, -1, 1, 1) + model[0].bias.view(1, -1, 1, 1)
            h = F.batch_norm(h.flatten(1), bn1d.running_mean, bn1d.running_var, bn1d.weight, bn1d.bias,
                             training=False, eps=bn1d.eps)
            pairs.append((model[3](h), split.y[index]))
    result = evaluate_test_time_bn(model, split, prepare, ExternalBN(batch_size=1, momentum=0.9))
    assert result.loss == pytest.approx(metrics(pairs)[1], rel=1e-5)
    # population statistics pool the values of all batches: one sample so far gives no variance either
    net = reestimate_bn_statistics(model, data(1), prepare, ExternalBN(batch_size=1, momentum=None))
    torch.testing.assert_close(net[2].running_var, model[2].running_var)
    assert not torch.equal(net[0].running_var, model[0].running_var)


def test_population_statistics_are_the_mean_and_variance_of_all_the_data():
    model, split = bn_model(), data(10)
    net = reestimate_bn_statistics(model, split, prepare, ExternalBN(batch_size=3, momentum=None))
    m, v = stats(prepare(split.x))
    torch.testing.assert_close(net[0].running_mean, m)
    torch.testing.assert_close(net[0].running_var, v)


def test_unbiased_option_rescales_each_variance_by_its_own_count():
    model, split = bn_model(), data(10)
    # population statistics: N = 10 samples x 2 x 2 positions = 40 values per channel, variance x 40/39
    net = reestimate_bn_statistics(model, split, prepare, ExternalBN(batch_size=3, momentum=None, unbiased=True))
    m, v = stats(prepare(split.x))
    torch.testing.assert_close(net[0].running_mean, m)
    torch.testing.assert_close(net[0].running_var, v * 40 / 39)
    # momentum: each batch's variance unbiased with its own K (4 samples: 16 values, the tail of 2: 8 values)
    net = reestimate_bn_statistics(model, split, prepare, ExternalBN(batch_size=4, momentum=0.9, unbiased=True))
    var = None
    for index, k in ((torch.arange(0, 4), 16), (torch.arange(4, 8), 16), (torch.arange(8, 10), 8)):
        bv = stats(prepare(split.x[index]))[1] * k / (k - 1)
        var = bv if var is None else 0.9 * var + 0.1 * bv
    torch.testing.assert_close(net[0].running_var, var)


def test_later_layers_see_inputs_normalized_with_the_updated_statistics():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Flatten(), nn.BatchNorm1d(8), nn.Linear(8, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    split = data(8, seed=2)
    net = reestimate_bn_statistics(model, split, prepare, ExternalBN(batch_size=4, momentum=0.6))
    s1 = s2 = None
    for index in batch_order(8, 4):
        x = prepare(split.x[index]).flatten(1)
        b1 = (x.mean(0), x.var(0, correction=0))
        s1 = b1 if s1 is None else tuple(0.6 * a + 0.4 * b for a, b in zip(s1, b1))
        h = model[2]((x - s1[0]) / torch.sqrt(s1[1] + 1e-5) * model[1].weight + model[1].bias).detach()
        b2 = (h.mean(0), h.var(0, correction=0))
        s2 = b2 if s2 is None else tuple(0.6 * a + 0.4 * b for a, b in zip(s2, b2))
    torch.testing.assert_close(net[3].running_mean, s2[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(net[3].running_var, s2[1], rtol=1e-5, atol=1e-6)


def test_fedbn_average_puts_the_mean_of_the_clients_affine_parameters():
    model, split = bn_model(), data(10)
    states = [{"0.weight": torch.rand(2), "0.bias": torch.randn(2), "0.running_mean": torch.randn(2)} for _ in range(3)]
    avg = average_bn_layers(model, states)
    assert set(avg) == {"0.weight", "0.bias"}
    torch.testing.assert_close(avg["0.weight"], sum(s["0.weight"] for s in states) / 3)
    torch.testing.assert_close(avg["0.bias"], torch.stack([s["0.bias"] for s in states]).mean(0))
    weighted = average_bn_layers(model, states, weights=[1, 0, 3])
    torch.testing.assert_close(weighted["0.bias"], (states[0]["0.bias"] + 3 * states[2]["0.bias"]) / 4)
    # statistics from the external data (population, then prediction): as test_time_bn on the averaged model
    manual = copy.deepcopy(model)
    manual.load_state_dict(avg, strict=False)
    expected = evaluate_test_time_bn(manual, split, prepare, FEDBN_APPENDIX_G)
    assert evaluate_fedbn_average(model, split, prepare, states) == expected
    assert evaluate_external(model, split, prepare, "fedbn_average", client_states=states) == expected
    m, v = stats(prepare(split.x))
    with torch.no_grad():
        pairs = [(head(manual, prepare(split.x[i]), m, v), split.y[i]) for i in batch_order(10, 32)]
    assert expected.loss == pytest.approx(metrics(pairs)[1], rel=1e-5)


def test_bn_average_puts_the_mean_of_the_clients_affine_and_running_statistics_and_estimates_nothing():
    """FedWon Table 12's other reading of FedBN's unseen-domain model: weight, bias, running mean and running
    variance each the plain mean over the clients (variances as they are, no between-client term), then the model
    predicts with those statistics whatever the external data: a hand-written BN with the averages."""
    model, split = bn_model(), data(10)
    g = torch.Generator().manual_seed(4)
    states = [{"0.weight": torch.rand(2, generator=g) + 0.5, "0.bias": torch.randn(2, generator=g),
               "0.running_mean": torch.randn(2, generator=g), "0.running_var": torch.rand(2, generator=g) + 0.5}
              for _ in range(3)]
    avg = average_bn_layers(model, states, statistics=True)
    assert set(avg) == {"0.weight", "0.bias", "0.running_mean", "0.running_var"}
    for key in avg:
        torch.testing.assert_close(avg[key], torch.stack([s[key] for s in states]).mean(0))
    # the variance average is not the pooled variance of the union (which adds the spread of the client means)
    pooled = avg["0.running_var"] + torch.stack([(s["0.running_mean"] - avg["0.running_mean"]) ** 2
                                                 for s in states]).mean(0)
    assert not torch.allclose(avg["0.running_var"], pooled)
    manual = copy.deepcopy(model)
    manual.load_state_dict(avg, strict=False)
    with torch.no_grad():
        logits = head(manual, prepare(split.x), avg["0.running_mean"], avg["0.running_var"])
    acc, loss = metrics([(logits, split.y)])
    result = evaluate_external(model, split, prepare, "bn_average", client_states=states)
    assert result == evaluate_bn_average(model, split, prepare, states)
    assert (result.accuracy, result.num_examples) == (acc, 10)
    assert result.loss == pytest.approx(loss, rel=1e-5)
    assert torch.equal(model[0].running_mean, bn_model()[0].running_mean)  # the model itself is untouched


def test_global_mode_is_the_model_as_it_is():
    model, split = bn_model(), data(10)
    with torch.no_grad():
        logits = copy.deepcopy(model).eval()(prepare(split.x))
    acc, loss = metrics([(logits, split.y)])
    result = evaluate_external(model, split, prepare, "global")
    assert (result.accuracy, result.num_examples) == (acc, 10)
    assert result.loss == pytest.approx(loss, rel=1e-6)
    assert model.training  # not put in eval mode: the function works on a copy


def test_defaults_and_ablation_ranges():
    assert (DEFAULT_TEST_BATCH_SIZE, DEFAULT_MOMENTUM) == (32, 0.9)
    assert ExternalBN().batch_size == 32 and ExternalBN().history_weight == 0.9
    sizes = ABLATION_TEST_BATCH_SIZES
    assert sizes[0] == 2 and sizes[-1] == 512 and 32 in sizes
    assert ABLATION_MOMENTA[0] == 0.0 and 0.9 in ABLATION_MOMENTA


def test_errors_are_clear():
    split = data(4)
    with pytest.raises(ValueError, match="no BatchNorm"):
        evaluate_test_time_bn(nn.Sequential(nn.Flatten(), nn.Linear(8, 3)), split, prepare)
    with pytest.raises(ValueError, match="unknown external evaluation mode"):
        evaluate_external(bn_model(), split, prepare, "tent")
    with pytest.raises(ValueError, match="client_states"):
        evaluate_external(bn_model(), split, prepare, "fedbn_average")
    with pytest.raises(ValueError, match="lack the BN entry '0.bias'"):
        average_bn_layers(bn_model(), [{"0.weight": torch.ones(2)}])
    with pytest.raises(ValueError, match="lack the BN entry '0.running_mean': bn_average needs"):
        evaluate_external(bn_model(), split, prepare, "bn_average",
                          client_states=[{"0.weight": torch.ones(2), "0.bias": torch.ones(2)}])
    with pytest.raises(ValueError, match="bn_average.*no BatchNorm"):
        evaluate_external(nn.Sequential(nn.Flatten(), nn.Linear(8, 3)), split, prepare, "bn_average", client_states=[{}])
    with pytest.raises(ValueError, match="'bn_average' needs client_states"):
        evaluate_external(bn_model(), split, prepare, "bn_average")
    with pytest.raises(ValueError, match="reset"):
        ExternalBN(momentum=None, reset=False)
    with pytest.raises(ValueError, match="convention"):
        ExternalBN(convention="keras")


@pytest.mark.parametrize("mode,bn", [
    ("global", None), ("test_time_bn", ExternalBN(batch_size=3)), ("test_time_bn", ExternalBN(momentum=None)),
    ("test_time_bn", ExternalBN(batch_size=4, predict="after_pass", reset=False)),
    ("fedbn_average", None), ("bn_average", None)])
def test_evaluating_an_external_client_never_changes_the_shared_model(mode, bn):
    """Test-time statistics (and the averaged BN layers) live in a copy: the model the federation shares keeps
    every weight and running statistic, and its training flag, whatever the mode; also under a momentum that
    keeps the model's statistics (reset False), and a second evaluation gives the same score."""
    model = bn_model().train()
    before = copy.deepcopy(model.state_dict())
    clients = [copy.deepcopy(bn_model(seed=s).state_dict()) for s in (1, 2)]
    first = evaluate_external(model, data(12), prepare, mode, bn, client_states=clients)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert model.training
    assert evaluate_external(model, data(12), prepare, mode, bn, client_states=clients) == first
