import pytest
import torch
from torch import nn

from fednorm.models import NORM_KINDS, DigitCNN, WSConv2d, build_model, make_norm


def layers(module, kind):
    return [m for m in module.modules() if isinstance(m, kind)]


def test_fedbn_table3_architecture():
    model = DigitCNN()
    convs = layers(model.features, nn.Conv2d)
    assert [(c.in_channels, c.out_channels, c.kernel_size, c.stride, c.padding) for c in convs] == [
        (3, 64, (5, 5), (1, 1), (2, 2)), (64, 64, (5, 5), (1, 1), (2, 2)), (64, 128, (5, 5), (1, 1), (2, 2))]
    fcs = layers(model.classifier, nn.Linear)
    assert [(f.in_features, f.out_features) for f in fcs] == [(6272, 2048), (2048, 512), (512, 10)]
    assert [b.num_features for b in layers(model, nn.BatchNorm2d)] == [64, 64, 128]
    assert [b.num_features for b in layers(model, nn.BatchNorm1d)] == [2048, 512]
    assert not layers(model, nn.Dropout)
    # Table 3's order: Conv -> BN -> ReLU (-> MaxPool after the first two), FC -> BN -> ReLU
    block, pool = [nn.Conv2d, nn.BatchNorm2d, nn.ReLU], [nn.MaxPool2d]
    assert [type(m) for m in model.features] == block + pool + block + pool + block
    assert [type(m) for m in model.classifier] == [nn.Linear, nn.BatchNorm1d, nn.ReLU] * 2 + [nn.Linear]
    assert model(torch.zeros(2, 3, 28, 28)).shape == (2, 10)
    # every conv and FC keeps PyTorch's default bias (FedBN's code): 3*64*25+64 + 64*64*25+64 + 64*128*25+128 conv
    # + 6272*2048+2048 + 2048*512+512 + 512*10+10 FC + 2 x (64+64+128+2048+512) BN affine = 14,219,210
    assert all(m.bias is not None for m in layers(model, (nn.Conv2d, nn.Linear)))
    assert sum(p.numel() for p in model.parameters()) == 14_219_210


def test_fedwon_digit_cnn_keeps_the_conv_bias_and_adds_a_gain_per_channel():
    """FedWon Listing 1: WSConv keeps bias=True and a learnable gain per output channel; no normalization layer:
    the BN model's 14,219,210 less its 5,632 BN affine values, plus 64+64+128 gains = 14,213,834."""
    model = build_model("digit_cnn", norm="ws", classifier="fedwon")
    assert all(m.bias is not None for m in layers(model, (nn.Conv2d, nn.Linear)))
    assert sum(p.numel() for p in model.parameters()) == 14_219_210 - 5_632 + 256 == 14_213_834


def test_fedbn_abide_mlp_has_hidden_layers_of_16_with_bn_after_the_first_two():
    """FedBN Sec. 5.2: three FC layers, hidden 16, two BN layers after the first two (ReLU after each BN)."""
    from fednorm.models.mlp import MLP

    model = MLP(num_classes=2, in_features=5995)
    assert [type(m) for m in model.layers] == [nn.Linear, nn.BatchNorm1d, nn.ReLU] * 2 + [nn.Linear]
    assert [(f.in_features, f.out_features) for f in layers(model, nn.Linear)] == [(5995, 16), (16, 16), (16, 2)]
    assert sum(p.numel() for p in model.parameters()) == 5995 * 16 + 16 + 16 * 16 + 16 + 16 * 2 + 2 + 2 * (16 + 16)


def test_batchnorm_is_pytorchs_default_as_in_the_papers_code():
    """eps 1e-5, momentum 0.1, affine, running statistics tracked (FedBN's and FBN's code use nn.BatchNorm as is)."""
    for spatial, kind in ((True, nn.BatchNorm2d), (False, nn.BatchNorm1d)):
        bn = make_norm("bn", 8, spatial=spatial)
        assert type(bn) is kind and (bn.eps, bn.momentum, bn.affine, bn.track_running_stats) == (1e-5, 0.1, True, True)


def test_fedwon_classifier_has_dropout_and_no_norm():
    model = DigitCNN(classifier="fedwon")
    # FedWon Table 5: Dropout before FC1 and FC2 (p not stated: PyTorch's default 0.5), no normalization
    assert [type(m) for m in model.classifier] == [nn.Dropout, nn.Linear, nn.ReLU, nn.Dropout, nn.Linear, nn.ReLU,
                                                   nn.Linear]
    assert [d.p for d in layers(model.classifier, nn.Dropout)] == [0.5, 0.5]
    assert [(f.in_features, f.out_features) for f in layers(model.classifier, nn.Linear)] == [
        (6272, 2048), (2048, 512), (512, 10)]
    assert not layers(model.classifier, nn.BatchNorm1d)
    assert len(layers(model.features, nn.BatchNorm2d)) == 3


def test_instance_norm_normalizes_each_image_and_channel_with_a_learnable_affine():
    """``in``: InstanceNorm2d with per-channel weight and bias (as GN and LN have; PyTorch's own default has none)
    and no running statistics: training and evaluation normalize each image's channel by its own mean and
    variance, then scale and shift."""
    layer = make_norm("in", 3)
    assert type(layer) is nn.InstanceNorm2d and layer.affine and not layer.track_running_stats
    assert sum(p.numel() for p in layer.parameters()) == 6
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([2.0, 0.5, 1.0]))
        layer.bias.copy_(torch.tensor([1.0, -1.0, 0.0]))
    x = torch.randn(4, 3, 5, 5) * 3 + 7
    for mode in (True, False):
        y = layer.train(mode)(x)
        mean, var = x.mean((2, 3), keepdim=True), x.var((2, 3), keepdim=True, unbiased=False)
        expected = (x - mean) / torch.sqrt(var + layer.eps) * layer.weight.view(1, 3, 1, 1) + layer.bias.view(1, 3, 1, 1)
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm, groups", [("gn", [32, 32, 64]), ("ln", [1, 1, 1])])
def test_group_and_layer_norm_follow_fedwon_table5(norm, groups):
    model = DigitCNN(norm=norm, classifier="fedwon")
    assert [g.num_groups for g in layers(model, nn.GroupNorm)] == groups
    assert not layers(model, nn.BatchNorm2d)


def test_no_norm_and_bad_arguments():
    model = DigitCNN(norm="none")
    assert not layers(model, (nn.BatchNorm2d, nn.BatchNorm1d, nn.GroupNorm))
    with pytest.raises(ValueError, match="unknown normalization"):
        make_norm("instance", 8)
    with pytest.raises(ValueError, match="28 x 28"):
        model(torch.zeros(1, 3, 32, 32))
    with pytest.raises(ValueError, match="unknown model"):
        build_model("resnet1000")


def test_width_scales_channels_for_small_test_models():
    model = build_model("digit_cnn", width=0.125)
    assert [c.out_channels for c in layers(model, nn.Conv2d)] == [8, 8, 16]
    assert model(torch.zeros(3, 3, 28, 28)).shape == (3, 10)


@pytest.mark.parametrize("norm", NORM_KINDS)
def test_the_digit_cnn_and_the_mlp_build_and_train_with_every_norm_from_the_registry(norm):
    """Every normalization through ``build_model`` (the path a config takes): the requested layer type and no other,
    a forward and backward pass reaching every parameter. Instance norm after a linear layer is refused with what
    to do: FedBN's classifier has BN after its linear layers (the FedWon classifier has none, and builds), the MLP
    only has linear layers."""
    from fednorm.models.fbn import FederatedBatchNorm1d, FederatedBatchNorm2d

    expected = {"bn": {nn.BatchNorm2d, nn.BatchNorm1d}, "fbn": {FederatedBatchNorm2d, FederatedBatchNorm1d},
                "gn": {nn.GroupNorm}, "ln": {nn.GroupNorm}, "in": {nn.InstanceNorm2d}, "none": set(), "ws": set()}[norm]
    norm_types = (nn.BatchNorm1d, nn.BatchNorm2d, FederatedBatchNorm1d, FederatedBatchNorm2d, nn.GroupNorm,
                  nn.InstanceNorm2d, nn.LayerNorm)
    cases = [("digit_cnn", {"width": 0.25, "classifier": "fedwon" if norm == "in" else "fedbn"}, (2, 3, 28, 28)),
             ("mlp", {"in_features": 8}, (2, 8))]
    if norm == "in":
        with pytest.raises(ValueError, match=r"instance norm after a linear layer .* \(classifier: fedwon\)"):
            build_model("digit_cnn", norm=norm, width=0.25)
        with pytest.raises(ValueError, match="the MLP has linear layers only: .* choose bn, fbn, gn, ln or none"):
            build_model("mlp", norm=norm, in_features=8)
        cases = cases[:1]
    for name, options, shape in cases:
        torch.manual_seed(0)
        model = build_model(name, norm=norm, **options).train()
        found = {type(m) for m in model.modules() if isinstance(m, norm_types)}
        if name == "mlp" and norm != "none":
            expected_here = {t for t in expected if t not in (nn.BatchNorm2d, FederatedBatchNorm2d)}
        else:
            expected_here = expected
        assert found == expected_here, (name, found)
        assert not [m for m in model.modules() if isinstance(m, WSConv2d)] or norm == "ws"
        out = model(torch.randn(*shape))
        out.sum().backward()
        assert all(p.grad is not None for p in model.parameters()), name
