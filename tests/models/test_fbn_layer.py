"""Federated BatchNorm layer: the server's (RM)/(RV) of the clients' layers equal centralized BatchNorm's
running statistics on the union batch (float64, to 1e-10), step after step; training-mode output uses the
shared statistics of the previous step, per sample."""

import pytest
import torch
from torch import nn

from fednorm.methods.server import ClientReply, ServerSpec, ServerUpdate
from fednorm.models.fbn import (FederatedBatchNorm1d, FederatedBatchNorm2d, convert_to_federated_bn,
                                set_federation_size)
from fednorm.models.norm import make_norm


def _round(shared: dict, inputs: list[torch.Tensor], cls, beta: float) -> dict:
    """One DSGD round of a lone FBN layer: every client starts from ``shared``, forwards its batch, replies."""
    n = len(inputs)
    wrapper = nn.Sequential(cls(inputs[0].shape[1], momentum=beta)).double()
    server = ServerUpdate(ServerSpec(), dict(shared), param_keys={"0.weight", "0.bias"}, fbn_layers={"0": beta})
    server.begin(shared)
    for x in inputs:
        wrapper.load_state_dict(shared)
        set_federation_size(wrapper, n)
        wrapper.train()(x)
        state = {k: v.clone() for k, v in wrapper.state_dict().items()}
        server.add(ClientReply("c", state, 1 / n, 1, {"0": wrapper[0].last_count}))
    return server.finish()


@pytest.mark.parametrize("cls,shape", [(FederatedBatchNorm2d, (7, 5, 3, 4)), (FederatedBatchNorm1d, (9, 5))])
def test_server_statistics_equal_centralized_batchnorm_on_the_union_batch(cls, shape):
    torch.manual_seed(0)
    beta, n = 0.1, 6
    central = (nn.BatchNorm2d if cls is FederatedBatchNorm2d else nn.BatchNorm1d)(5, momentum=beta).double().train()
    shared = {f"0.{k}": v.clone() for k, v in cls(5, momentum=beta).double().state_dict().items()}
    for step in range(20):
        # heterogeneous clients: each its own mean and scale
        inputs = [torch.randn(*shape, dtype=torch.float64) * (1 + i) + 10 * i - step for i in range(n)]
        shared = _round(shared, inputs, cls, beta)
        central(torch.cat(inputs))
        torch.testing.assert_close(shared["0.running_mean"], central.running_mean, rtol=0, atol=1e-10)
        torch.testing.assert_close(shared["0.running_var"], central.running_var, rtol=1e-12, atol=1e-10)


def test_unequal_batch_sizes_still_equal_centralized_batchnorm():
    """Clients with K = 4 and 12 values per channel (ragged last batches in epoch mode), over several rounds:
    the server weights by K_i / N and swaps each client's own unbiasing K_i n/(K_i n - 1) for the union's
    N/(N - 1), so mean and variance equal centralized BN on the union batch."""
    torch.manual_seed(3)
    beta, sizes = 0.1, (4, 12)
    shared = {f"0.{k}": v.clone() for k, v in FederatedBatchNorm1d(3, momentum=beta).double().state_dict().items()}
    central = nn.BatchNorm1d(3, momentum=beta).double().train()
    for step in range(5):
        inputs = [torch.randn(k, 3, dtype=torch.float64) * (1 + i) + 5 * i - step for i, k in enumerate(sizes)]
        shared = _round(shared, inputs, FederatedBatchNorm1d, beta)
        central(torch.cat(inputs))
        torch.testing.assert_close(shared["0.running_mean"], central.running_mean, rtol=0, atol=1e-12)
        torch.testing.assert_close(shared["0.running_var"], central.running_var, rtol=1e-12, atol=1e-12)


def _naive_round(shared: dict, inputs: list[torch.Tensor], beta: float) -> dict:
    """One round of naive BN: each client's standard BatchNorm (its own K/(K-1)) from ``shared``, and the server's
    plain mean of the replies, running statistics included."""
    n = len(inputs)
    wrapper = nn.Sequential(nn.BatchNorm1d(inputs[0].shape[1], momentum=beta)).double()
    server = ServerUpdate(ServerSpec(), dict(shared), param_keys={"0.weight", "0.bias"})
    server.begin(shared)
    for x in inputs:
        wrapper.load_state_dict(shared)
        wrapper.train()(x)
        server.add(ClientReply("c", {k: v.clone() for k, v in wrapper.state_dict().items()}, 1 / n, 1))
    return server.finish()


def test_naive_averaging_misses_exactly_the_between_client_term():
    """The server's naive average of standard BN statistics against its FBN combination, one step from (0, 1):
    the FBN variance is centralized BN's; the naive one lacks the between-client term beta Kn/(Kn-1) mean_i
    (mu_i - mu)^2 and unbiases with K/(K-1) instead of Kn/(Kn-1), and nothing else."""
    torch.manual_seed(1)
    beta, n, k = 0.1, 10, 30
    inputs = [torch.randn(k, 2, dtype=torch.float64) + 10 * i for i in range(n)]
    start = {f"0.{key}": v.clone() for key, v in FederatedBatchNorm1d(2, momentum=beta).double().state_dict().items()}
    naive_var = _naive_round(start, inputs, beta)["0.running_var"]
    fbn_var = _round(start, inputs, FederatedBatchNorm1d, beta)["0.running_var"]
    central = nn.BatchNorm1d(2, momentum=beta).double().train()
    central(torch.cat(inputs))
    torch.testing.assert_close(fbn_var, central.running_var, rtol=1e-12, atol=1e-10)
    means = torch.stack([x.mean(0) for x in inputs])
    biased_within = torch.stack([x.var(0, correction=0) for x in inputs]).mean(0)
    kn = k * n
    between = beta * kn / (kn - 1) * ((means - means.mean(0)) ** 2).mean(0)
    unbiasing_gap = beta * (kn / (kn - 1) - k / (k - 1)) * biased_within
    torch.testing.assert_close(naive_var, (1 - beta) + beta * k / (k - 1) * biased_within, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fbn_var - naive_var, between + unbiasing_gap, rtol=1e-12, atol=1e-10)
    assert (between > 50).all()  # means 0..90 apart: the term dominates


def test_training_output_uses_previous_shared_statistics_per_sample_and_equals_eval():
    torch.manual_seed(2)
    layer = FederatedBatchNorm2d(3).double()
    layer.running_mean.copy_(torch.tensor([1.0, -2.0, 0.5]))
    layer.running_var.copy_(torch.tensor([4.0, 0.25, 1.0]))
    layer.weight.data.copy_(torch.tensor([2.0, 1.0, -1.0]))
    layer.bias.data.copy_(torch.tensor([0.5, -1.0, 3.0]))
    x = torch.randn(6, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    expected = (x.detach() - layer.running_mean.view(1, 3, 1, 1)) / torch.sqrt(layer.running_var.view(1, 3, 1, 1)
                                                                               + layer.eps) * layer.weight.view(1, 3, 1, 1)
    expected = expected + layer.bias.detach().view(1, 3, 1, 1)
    in_eval = FederatedBatchNorm2d(3).double()
    in_eval.load_state_dict(layer.state_dict())
    before = layer.running_mean.clone()
    out = layer.train()(x)
    torch.testing.assert_close(out.detach(), expected)
    # the same output as the layer in evaluation mode with the statistics from before the batch
    torch.testing.assert_close(out.detach(), in_eval.eval()(x.detach()), rtol=1e-12, atol=1e-12)
    # the batch folded into the running statistics with momentum 0.1, unbiased by K/(K-1) (one client: n = 1)
    xd = x.detach()
    torch.testing.assert_close(layer.running_mean, 0.9 * before + 0.1 * xd.mean((0, 2, 3)), rtol=0, atol=1e-12)
    torch.testing.assert_close(layer.running_var, 0.9 * torch.tensor([4.0, 0.25, 1.0], dtype=torch.float64)
                               + 0.1 * xd.var((0, 2, 3), correction=1), rtol=0, atol=1e-12)
    alone = FederatedBatchNorm2d(3).double()
    alone.load_state_dict({**layer.state_dict(), "running_mean": before,
                           "running_var": torch.tensor([4.0, 0.25, 1.0], dtype=torch.float64)})
    torch.testing.assert_close(alone.train()(x[:1]).detach(), expected[:1])  # independent of the other samples
    out.sum().backward()  # no gradient through statistics: d out / d x = weight / sqrt(v + eps)
    grad = (layer.weight / torch.sqrt(torch.tensor([4.0, 0.25, 1.0], dtype=torch.float64) + layer.eps)).detach()
    torch.testing.assert_close(x.grad, grad.view(1, 3, 1, 1).expand_as(x))


def test_unbiasing_uses_the_federation_size():
    x = torch.arange(8, dtype=torch.float64).reshape(4, 2)
    layer = FederatedBatchNorm1d(2, momentum=1.0).double()
    set_federation_size(layer, 3)
    layer.train()(x)
    kn = 4 * 3
    torch.testing.assert_close(layer.running_var, x.var(0, correction=0) * kn / (kn - 1))
    torch.testing.assert_close(layer.running_mean, x.mean(0))


def test_converter_and_factory_and_bad_momentum():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2), nn.BatchNorm1d(2))
    model[1].running_mean.fill_(3.0)
    convert_to_federated_bn(model)
    assert isinstance(model[1], FederatedBatchNorm2d) and isinstance(model[4], FederatedBatchNorm1d)
    assert float(model[1].running_mean[0]) == 3.0
    assert isinstance(make_norm("fbn", 8), FederatedBatchNorm2d)
    assert isinstance(make_norm("fbn", 8, spatial=False), FederatedBatchNorm1d)
    with pytest.raises(ValueError, match="momentum"):
        FederatedBatchNorm2d(4, momentum=None)


def test_converter_keeps_dtype_and_mode_and_refuses_layers_without_a_federated_form():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, momentum=0.3)).double().eval()
    convert_to_federated_bn(model)
    bn = model[1]
    assert isinstance(bn, FederatedBatchNorm1d) and bn.running_mean.dtype == torch.float64
    assert bn.weight.dtype == torch.float64 and bn.momentum == 0.3 and not bn.training
    x = torch.randn(5, 3, dtype=torch.float64)
    model.train()
    out = model(x)  # FBN normalizes with the shared statistics before this batch: 0 and 1
    h = model[0](x)
    torch.testing.assert_close(out, h / torch.sqrt(torch.tensor(1 + bn.eps, dtype=torch.float64)))
    no_stats = nn.Sequential(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, track_running_stats=False)))
    with pytest.raises(ValueError, match=r"'0\.1'.*track_running_stats"):
        convert_to_federated_bn(no_stats)
    with pytest.raises(ValueError, match=r"'1'.*momentum=None"):
        convert_to_federated_bn(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, momentum=None)))


def test_a_second_local_step_normalizes_with_the_statistics_its_first_step_updated():
    """With local epochs (several steps per round) step t normalizes with the running statistics as they stand
    before it: the shared ones at the first step, then those with the client's earlier batches folded in (the
    documented choice; the paper is silent)."""
    torch.manual_seed(4)
    layer = FederatedBatchNorm1d(3, momentum=0.1).double().train()
    set_federation_size(nn.Sequential(layer), 2)
    x1, x2 = torch.randn(6, 3, dtype=torch.float64) * 2 + 1, torch.randn(6, 3, dtype=torch.float64) - 3
    shared_mean, shared_var = layer.running_mean.clone(), layer.running_var.clone()
    y1 = layer(x1)
    after_first = layer.running_mean.clone(), layer.running_var.clone()
    kn = 6 * 2
    torch.testing.assert_close(after_first[0], 0.9 * shared_mean + 0.1 * x1.mean(0))
    torch.testing.assert_close(after_first[1], 0.9 * shared_var + 0.1 * kn / (kn - 1) * x1.var(0, correction=0))
    y2 = layer(x2)
    for y, x, (m, v) in ((y1, x1, (shared_mean, shared_var)), (y2, x2, after_first)):
        expected = (x - m) / torch.sqrt(v + layer.eps) * layer.weight + layer.bias
        torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
