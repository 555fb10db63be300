import pytest
import torch
from torch import nn
from torchvision.models import resnet18 as tv_resnet18

from fednorm.models.alexnet import AlexNet
from fednorm.models.fbn import FederatedBatchNorm1d, FederatedBatchNorm2d
from fednorm.models.mobilenet import mobilenet_v2
from fednorm.models.norm import NORM_KINDS
from fednorm.models.resnet import PadShortcut, ResNet20, resnet18, resnet20
from fednorm.models.wsconv import NORM_LAYER_TYPES, WSConv2d


def layers(module, kind):
    return [m for m in module.modules() if isinstance(m, kind)]


def n_params(model):
    return sum(p.numel() for p in model.parameters())


# name -> (builder(norm), input side); small widths for speed. Instance norm needs more than one value
# per channel, so the stride-32 torchvision models use 64 x 64 for "in" (32 x 32 ends on a 1 x 1 map).
ZOO = {
    "alexnet_fedbn": (lambda norm: AlexNet(norm=norm, width=0.125), 64),
    "alexnet_fedwon": (lambda norm: AlexNet(norm=norm, width=0.125, classifier="fedwon"), 64),
    "resnet18": (lambda norm: resnet18(norm=norm), 32),
    "resnet20": (lambda norm: resnet20(norm=norm), 32),
    "mobilenet_v2": (lambda norm: mobilenet_v2(norm=norm, width_mult=0.25), 32),
}


@pytest.mark.parametrize("norm", NORM_KINDS)
@pytest.mark.parametrize("name", ZOO)
def test_every_model_builds_and_trains_with_every_norm(name, norm):
    build, side = ZOO[name]
    if name == "alexnet_fedbn" and norm == "in":
        with pytest.raises(ValueError, match="instance norm after a linear layer"):
            build(norm)
        return
    if norm == "in" and name in ("resnet18", "mobilenet_v2"):
        side = 64
    torch.manual_seed(0)
    model = build(norm).train()
    out = model(torch.randn(2, 3, side, side))
    assert out.shape == (2, 10)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)

    convs = layers(model, nn.Conv2d)
    assert convs
    if norm in ("ws", "none"):
        assert not layers(model, NORM_LAYER_TYPES)
    else:
        assert layers(model, NORM_LAYER_TYPES)
    if norm == "ws":
        assert all(isinstance(c, WSConv2d) for c in convs)
        assert all(c.bias is not None for c in convs)
    else:
        assert not layers(model, WSConv2d)
    # exactly the requested layer type (FedBN's AlexNet also normalizes its classifier: the 1d kind there);
    # "fbn" must build FBN layers, or the server finds none and the run silently becomes naive BN
    expected_norm = {"bn": {nn.BatchNorm2d}, "fbn": {FederatedBatchNorm2d}, "gn": {nn.GroupNorm},
                     "ln": {nn.GroupNorm}, "in": {nn.InstanceNorm2d}, "none": set(), "ws": set()}[norm]
    if name == "alexnet_fedbn" and norm in ("bn", "fbn"):
        expected_norm |= {nn.BatchNorm1d if norm == "bn" else FederatedBatchNorm1d}
    assert {type(m) for m in layers(model, NORM_LAYER_TYPES)} == expected_norm
    if norm == "ln":
        assert all(g.num_groups == 1 for g in layers(model, nn.GroupNorm))


def test_alexnet_fedbn_table9_geometry():
    model = AlexNet()
    convs = layers(model.features, nn.Conv2d)
    assert [(c.in_channels, c.out_channels, c.kernel_size, c.stride, c.padding) for c in convs] == [
        (3, 64, (11, 11), (4, 4), (2, 2)), (64, 192, (5, 5), (1, 1), (2, 2)), (192, 384, (3, 3), (1, 1), (1, 1)),
        (384, 256, (3, 3), (1, 1), (1, 1)), (256, 256, (3, 3), (1, 1), (1, 1))]
    pools = layers(model.features, nn.MaxPool2d)
    assert [(p.kernel_size, p.stride) for p in pools] == [(3, 2)] * 3
    # Table 9's order: Conv -> BN -> ReLU, max-pools after convs 1, 2 and 5; FC -> BN -> ReLU
    block, pool = [nn.Conv2d, nn.BatchNorm2d, nn.ReLU], [nn.MaxPool2d]
    assert [type(m) for m in model.features] == block + pool + block + pool + block * 3 + pool
    assert [type(m) for m in model.classifier] == [nn.Linear, nn.BatchNorm1d, nn.ReLU] * 2 + [nn.Linear]
    assert model.avgpool.output_size == (6, 6)
    fcs = layers(model.classifier, nn.Linear)
    assert [(f.in_features, f.out_features) for f in fcs] == [(9216, 4096), (4096, 4096), (4096, 10)]
    assert [b.num_features for b in layers(model.features, nn.BatchNorm2d)] == [64, 192, 384, 256, 256]
    assert [b.num_features for b in layers(model.classifier, nn.BatchNorm1d)] == [4096, 4096]
    assert not layers(model, nn.Dropout)
    assert model.eval()(torch.zeros(1, 3, 64, 64)).shape == (1, 10)
    # Table 9's shapes, every conv and FC layer with its bias, BN affine on 5 conv + 2 FC layers
    convs = 3 * 64 * 121 + 64 + 64 * 192 * 25 + 192 + 192 * 384 * 9 + 384 + 384 * 256 * 9 + 256 + 256 * 256 * 9 + 256
    fcs = 9216 * 4096 + 4096 + 4096 * 4096 + 4096 + 4096 * 10 + 10
    bn = 2 * (64 + 192 + 384 + 256 + 256) + 2 * (4096 + 4096)
    assert sum(p.numel() for p in model.parameters()) == convs + fcs + bn == 57_063_498


def test_alexnet_fedwon_classifier_has_dropout_and_no_norm():
    model = AlexNet(classifier="fedwon", width=0.125)
    assert [type(m) for m in model.classifier] == [
        nn.Dropout, nn.Linear, nn.ReLU, nn.Dropout, nn.Linear, nn.ReLU, nn.Linear]
    assert not layers(model.classifier, NORM_LAYER_TYPES)
    assert len(layers(model.features, nn.BatchNorm2d)) == 5
    fedbn = AlexNet(width=0.125)
    assert [type(m) for m in fedbn.classifier] == [
        nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Linear]


def test_alexnet_group_counts_follow_fedwon_table6():
    model = AlexNet(norm="gn", classifier="fedwon")
    assert [(g.num_groups, g.num_channels) for g in layers(model, nn.GroupNorm)] == [
        (32, 64), (32, 192), (64, 384), (64, 256), (64, 256)]


def test_group_counts_a_width_multiplier_breaks_are_lowered_with_a_warning():
    """At width 0.75 AlexNet's first conv has 48 channels, which Table 6's 32 groups do not divide: 24 are used and
    the warning names both counts; at width 1 every count divides and nothing is said."""
    import warnings

    with pytest.warns(UserWarning, match="GroupNorm over 48 channels uses 24 groups instead of 32"):
        model = AlexNet(norm="gn", classifier="fedwon", width=0.75)
    assert [(g.num_groups, g.num_channels) for g in layers(model, nn.GroupNorm)][0] == (24, 48)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AlexNet(norm="gn", classifier="fedwon")
        mobilenet_v2(norm="gn")  # FedWon's 32 / 8 / 24 rule divides every layer


def test_alexnet_plain_conv3_option_only_changes_conv3_under_ws():
    convs = layers(AlexNet(norm="ws", classifier="fedwon", plain_conv3=True, width=0.125), nn.Conv2d)
    assert [isinstance(c, WSConv2d) for c in convs] == [True, True, False, True, True]
    assert type(convs[2]) is nn.Conv2d
    default = layers(AlexNet(norm="ws", classifier="fedwon", width=0.125), nn.Conv2d)
    assert all(isinstance(c, WSConv2d) for c in default)
    # no effect for the other kinds
    bn = AlexNet(norm="bn", plain_conv3=True, width=0.125)
    assert [type(c) for c in layers(bn, nn.Conv2d)] == [nn.Conv2d] * 5
    assert len(layers(bn, nn.BatchNorm2d)) == 5


def test_alexnet_input_size_and_options():
    model = AlexNet(width=0.125, in_channels=1, num_classes=7).eval()
    assert model(torch.zeros(1, 1, 63, 63)).shape == (1, 7)
    assert model(torch.zeros(1, 1, 256, 256)).shape == (1, 7)
    with pytest.raises(ValueError, match="at least 63"):
        model(torch.zeros(1, 1, 32, 32))
    with pytest.raises(ValueError, match="unknown classifier"):
        AlexNet(classifier="torchvision")
    with pytest.raises(ValueError, match="unknown normalization"):
        AlexNet(norm="batch")


def test_resnet18_matches_torchvision_and_converts_downsample_convs():
    assert n_params(resnet18()) == n_params(tv_resnet18(num_classes=10)) == 11_181_642
    assert [type(m) for m in resnet18().modules()] == [type(m) for m in tv_resnet18(num_classes=10).modules()]
    ws = resnet18(norm="ws")
    downsample = [m.downsample[0] for m in ws.modules() if getattr(m, "downsample", None) is not None]
    assert len(downsample) == 3
    assert all(isinstance(c, WSConv2d) and c.kernel_size == (1, 1) for c in downsample)
    assert len(layers(ws, WSConv2d)) == 20


def test_resnet18_gn_groups_and_in_channels():
    model = resnet18(norm="gn")
    assert {(g.num_groups, g.num_channels) for g in layers(model, nn.GroupNorm)} == {
        (32, 64), (32, 128), (32, 256), (32, 512)}
    gray = resnet18(norm="ws", in_channels=1, num_classes=8)
    assert isinstance(gray.conv1, WSConv2d) and gray.conv1.in_channels == 1
    assert gray.eval()(torch.zeros(1, 1, 32, 32)).shape == (1, 8)


def test_resnet20_architecture_and_parameter_count():
    model = ResNet20()
    # option A (parameter-free shortcut): 269,722; option B (1x1 projection + BN): 272,474
    assert n_params(model) == 269_722
    assert n_params(resnet20(shortcut="B")) == 272_474
    assert len(layers(model, nn.Conv2d)) == 19 and len(layers(model, nn.Linear)) == 1  # 20 weighted layers
    assert [len(s) for s in (model.layer1, model.layer2, model.layer3)] == [3, 3, 3]
    assert [s[0].conv2.out_channels for s in (model.layer1, model.layer2, model.layer3)] == [16, 32, 64]
    assert len(layers(model, PadShortcut)) == 2
    assert all(c.bias is None for c in layers(model, nn.Conv2d))
    assert all(c.bias is not None for c in layers(resnet20(norm="none"), nn.Conv2d))
    assert model.fc.in_features == 64
    with pytest.raises(ValueError, match="unknown shortcut"):
        resnet20(shortcut="C")


def test_resnet20_option_a_shortcut_subsamples_and_zero_pads():
    x = torch.randn(2, 16, 8, 8)
    y = PadShortcut(2, 16)(x)
    assert y.shape == (2, 32, 4, 4)
    assert torch.equal(y[:, 8:24], x[:, :, ::2, ::2])
    assert not y[:, :8].any() and not y[:, 24:].any()


def test_resnet20_ws_option_b_converts_projection():
    model = resnet20(norm="ws", shortcut="B")
    assert all(isinstance(c, WSConv2d) for c in layers(model, nn.Conv2d))
    assert len(layers(model, nn.Conv2d)) == 21
    assert not layers(model, NORM_LAYER_TYPES)


def test_mobilenet_v2_ws_converts_depthwise_convs():
    model = mobilenet_v2(norm="ws")
    convs = layers(model, nn.Conv2d)
    assert all(isinstance(c, WSConv2d) for c in convs)
    depthwise = [c for c in convs if c.groups > 1]
    assert len(depthwise) == 17
    assert all(c.groups == c.in_channels == c.out_channels for c in depthwise)
    reference = __import__("torchvision").models.mobilenet_v2(num_classes=10)
    assert n_params(mobilenet_v2()) == n_params(reference)
    # each BN's weight and bias (2 C) become the WSConv's gain and bias (C each), so the count is unchanged: every
    # conv of torchvision's MobileNetV2 is followed by a BN (its last 1 x 1 projections too)
    bn_channels = sum(b.num_features for b in layers(reference, nn.BatchNorm2d))
    assert bn_channels == sum(c.out_channels for c in convs)
    assert n_params(model) == n_params(reference) == 2_236_682


def test_mobilenet_v2_gn_follows_fedwon_group_rule():
    gn = [(g.num_groups, g.num_channels) for g in layers(mobilenet_v2(norm="gn"), nn.GroupNorm)]
    assert (24, 144) in gn and (8, 16) in gn and (8, 24) in gn and (32, 32) in gn
    assert all(g == 24 for g, c in gn if c == 144)
    # every other layer: 32 groups, 8 below 32 channels (App. A.2), written out here rather than via default_groups
    assert all(g == 8 for g, c in gn if c < 32) and all(g == 32 for g, c in gn if c >= 32 and c != 144)
    assert len(gn) == len(layers(mobilenet_v2(norm="bn"), nn.BatchNorm2d))
    gray = mobilenet_v2(norm="bn", in_channels=1, num_classes=5, width_mult=0.25)
    assert gray.features[0][0].in_channels == 1
    assert gray.eval()(torch.zeros(1, 1, 32, 32)).shape == (1, 5)
