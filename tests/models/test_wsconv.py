import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fednorm.models import DigitCNN, WSConv2d, build_model, convert_to_ws
from fednorm.models.wsconv import NORM_LAYER_TYPES


def formula(w: torch.Tensor, gain: torch.Tensor, unbiased: bool, eps: float = 1e-4) -> torch.Tensor:
    """FedWon Listing 1 written out per output channel with plain loops."""
    out = torch.empty_like(w)
    fan_in = w[0].numel()
    for i in range(w.shape[0]):
        row = w[i].flatten().double()
        mean = row.sum() / fan_in
        var = ((row - mean) ** 2).sum() / (fan_in - 1 if unbiased else fan_in)
        out[i] = (gain[i].double() * (w[i].double() - mean) / torch.sqrt(torch.clamp(fan_in * var, min=eps))).float()
    return out


@pytest.mark.parametrize("variance", ["unbiased", "biased"])
def test_standardized_weight_equals_the_formula(variance):
    torch.manual_seed(0)
    conv = WSConv2d(6, 5, 3, padding=1, variance=variance)
    with torch.no_grad():
        conv.weight.normal_(0.3, 2.0)
        conv.gain.uniform_(0.5, 2.0)
    expected = formula(conv.weight, conv.gain.flatten(), unbiased=variance == "unbiased")
    torch.testing.assert_close(conv.standardized_weight(), expected, rtol=1e-5, atol=1e-6)
    x = torch.randn(2, 6, 8, 8)
    torch.testing.assert_close(conv(x), F.conv2d(x, expected, conv.bias, padding=1), rtol=1e-4, atol=1e-5)


def test_listing1_defaults_gain_eps_and_non_persistent_buffers():
    conv = WSConv2d(4, 8, 3, groups=2)
    assert conv.gain.shape == (8, 1, 1, 1) and torch.equal(conv.gain, torch.ones(8, 1, 1, 1))
    assert conv.gain.requires_grad
    assert float(conv.fan_in) == 2 * 3 * 3  # (in / groups) * kh * kw
    assert float(conv.eps) == pytest.approx(1e-4)
    assert conv.bias is not None
    # Listing 1's torch.var: the unbiased variance by default (Eq. 3's 1/N is variance="biased")
    assert conv.variance == "unbiased"
    with torch.no_grad():
        conv.weight.normal_(0.0, 1.0)
    torch.testing.assert_close(conv.standardized_weight(), formula(conv.weight, conv.gain.flatten(), unbiased=True),
                               rtol=1e-5, atol=1e-6)
    converted = convert_to_ws(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
    assert converted[0].variance == "unbiased"
    # eps and fan_in are never aggregated or saved
    assert set(conv.state_dict()) == {"weight", "bias", "gain"}


def test_weights_start_xavier_normal_as_listing1_and_the_converter():
    """FedWon's WSConv initialises its weight with nn.init.xavier_normal_ (gain 1): std sqrt(2 / (fan_in + fan_out)),
    not Conv2d's Kaiming-uniform (std 1 / sqrt(3 fan_in)); so do the converter's fresh convolutions."""
    torch.manual_seed(0)
    conv = WSConv2d(4, 8, 3, groups=2)
    torch.manual_seed(0)
    reference = nn.Conv2d(4, 8, 3, groups=2)  # draws its Kaiming weight and bias first, as WSConv2d's parent does
    nn.init.xavier_normal_(reference.weight)
    assert torch.equal(conv.weight, reference.weight)
    assert torch.equal(conv.bias, reference.bias)
    torch.manual_seed(1)
    converted = convert_to_ws(nn.Sequential(nn.Conv2d(64, 64, 3), nn.BatchNorm2d(64)))[0]
    xavier_std = (2 / (64 * 9 + 64 * 9)) ** 0.5  # 0.0417; Kaiming-uniform's would be 0.0241
    assert float(converted.weight.detach().std()) == pytest.approx(xavier_std, rel=0.05)  # 36,864 draws: std's SE 0.4 %
    assert abs(float(converted.weight.detach().mean())) < 0.002


def test_eps_clamps_fan_in_times_variance():
    conv = WSConv2d(3, 1, 1, bias=False)
    with torch.no_grad():
        conv.weight.fill_(0.7)  # zero variance: the scale is 1 / sqrt(eps) times (w - mean) = 0
        assert torch.equal(conv.standardized_weight(), torch.zeros(1, 3, 1, 1))
        conv2 = WSConv2d(2, 1, 1, bias=False)
        conv2.weight.copy_(torch.tensor([0.0, 0.004]).view(1, 2, 1, 1))  # fan_in * var = 2 * 8e-6 < 1e-4
        torch.testing.assert_close(conv2.standardized_weight().flatten(), torch.tensor([-0.002, 0.002]) / 1e-2)


def test_fan_in_of_one_is_refused():
    with pytest.raises(ValueError, match="fan-in of 1"):
        WSConv2d(4, 4, 1, groups=4)


def test_output_is_invariant_to_weight_scale_and_shift():
    torch.manual_seed(1)
    conv = WSConv2d(3, 4, 3)
    x = torch.randn(2, 3, 6, 6)
    before = conv(x)
    with torch.no_grad():
        conv.weight.mul_(5.0).add_(1.5)
    torch.testing.assert_close(conv(x), before, rtol=1e-4, atol=1e-4)


def _geometry(conv):
    return (conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding, conv.dilation,
            conv.groups, conv.padding_mode)


@pytest.mark.parametrize("build", ["resnet18", "mobilenet_v2", "frozen_bn_resnet18", "rmsnorm"])
def test_convert_leaves_no_norm_of_any_kind_and_keeps_every_convs_geometry(build):
    """Checked by class name, not by the converter's own list: nothing called *Norm* is left, and every conv keeps
    kernel, stride, padding, dilation, groups and padding mode."""
    import torchvision

    if build == "frozen_bn_resnet18":
        model = torchvision.models.resnet18(norm_layer=torchvision.ops.FrozenBatchNorm2d)
    elif build == "rmsnorm":
        if not hasattr(nn, "RMSNorm"):
            pytest.skip("nn.RMSNorm needs torch >= 2.4")
        model = nn.Sequential(nn.Conv2d(3, 4, 3, dilation=2, padding=2), nn.RMSNorm([4, 5, 5]))
    else:
        model = getattr(torchvision.models, build)()
    before = [_geometry(m) for m in model.modules() if isinstance(m, nn.Conv2d)]
    convert_to_ws(model)
    # leaf modules only: torchvision's Conv2dNormActivation is a container named after what it held
    assert not [type(m).__name__ for m in model.modules() if "Norm" in type(m).__name__ and not list(m.children())]
    after = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert all(isinstance(m, WSConv2d) for m in after)
    assert [_geometry(m) for m in after] == before


def test_convert_keeps_dtype_and_refuses_conv_subclasses_with_their_own_forward():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).double()
    convert_to_ws(model)
    assert model[0].weight.dtype == torch.float64 and model(torch.randn(1, 3, 5, 5, dtype=torch.float64)).dtype == torch.float64

    class SamePadConv(nn.Conv2d):
        def forward(self, x):
            return super().forward(F.pad(x, (1, 1, 1, 1)))

    with pytest.raises(ValueError, match=r"'1\.0'.*SamePadConv"):
        convert_to_ws(nn.Sequential(nn.Identity(), nn.Sequential(SamePadConv(3, 4, 3))))


def test_convert_refuses_norm_subclasses_with_their_own_forward_and_keeps_plain_ones():
    """timm's BatchNormAct2d is a BatchNorm2d that applies an activation too: replacing it by Identity would drop the
    activation without a word. A subclass that only changes the constructor normalizes as its base: removed."""

    class BatchNormAct(nn.BatchNorm2d):
        def forward(self, x):
            return F.relu(super().forward(x))

    class QuietBatchNorm(nn.BatchNorm2d):
        def __init__(self, channels):
            super().__init__(channels, momentum=0.01)

    with pytest.raises(ValueError, match=r"'1\.1'.*BatchNormAct.*own forward"):
        convert_to_ws(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Sequential(nn.Identity(), BatchNormAct(4))))
    model = convert_to_ws(nn.Sequential(nn.Conv2d(3, 4, 3), QuietBatchNorm(4)))
    assert isinstance(model[1], nn.Identity)


def test_converted_torchvision_resnet18_trains():
    """FedWon's conversion of a torchvision model (its ResNet-18) gives one that learns: a few optimizer steps fit a
    fixed batch. (MobileNetV2 converted learns too, but needs more steps than a unit test should take.)"""
    import torchvision

    torch.manual_seed(0)
    model = convert_to_ws(torchvision.models.resnet18(num_classes=4))
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 3])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    first = F.cross_entropy(model(x), y).item()
    for _ in range(5):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    last = F.cross_entropy(model(x), y).item()
    assert last < 0.5 * first, (first, last)


def test_convert_removes_every_norm_and_swaps_every_conv():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.GroupNorm(4, 8),  # depthwise
        nn.Conv2d(8, 16, 1, stride=2), nn.InstanceNorm2d(16), nn.LayerNorm([16, 4, 4]),
        nn.Flatten(), nn.Linear(256, 10), nn.BatchNorm1d(10),
    )
    convert_to_ws(model)
    assert not [m for m in model.modules() if isinstance(m, NORM_LAYER_TYPES)]
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 3 and all(isinstance(c, WSConv2d) for c in convs)
    assert [(c.in_channels, c.out_channels, c.groups, c.stride) for c in convs] == [
        (3, 8, 1, (1, 1)), (8, 8, 8, (1, 1)), (8, 16, 1, (2, 2))]
    assert all(c.bias is not None for c in convs)  # Listing 1 default: the removed norm carried the shift
    assert isinstance(model[9], nn.Linear)  # linear layers stay plain
    # the converted model trains
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    first = F.cross_entropy(model(x), y)
    for _ in range(20):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert F.cross_entropy(model(x), y) < first


def test_convert_says_which_convolutions_it_leaves_unstandardized():
    """FedWon standardizes 2-D convolutions (Listing 1): a 1-D, 3-D or transposed conv of an arbitrary model is left
    as it is, and the converter names each one rather than leave it plain without a word."""
    import warnings

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ConvTranspose2d(4, 4, 2, stride=2),
                          nn.Sequential(nn.Conv1d(4, 4, 1), nn.Conv3d(4, 4, 1)))
    with pytest.warns(UserWarning, match=r"3 other convolution\(s\) stay unstandardized: 2 \(ConvTranspose2d\), "
                      r"3\.0 \(Conv1d\), 3\.1 \(Conv3d\)"):
        convert_to_ws(model)
    assert isinstance(model[0], WSConv2d) and type(model[2]) is nn.ConvTranspose2d
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_to_ws(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3, groups=4)))


def test_convert_can_keep_each_convs_bias_choice():
    model = convert_to_ws(nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4)), bias=None)
    assert model[0].bias is None and isinstance(model[1], nn.Identity)


def test_ws_digit_cnn_matches_fedwon_table5_and_works_at_batch_one():
    model = build_model("digit_cnn", norm="ws", classifier="fedwon")
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 3 and all(isinstance(c, WSConv2d) for c in convs)
    assert not [m for m in model.modules() if isinstance(m, NORM_LAYER_TYPES)]
    model.train()
    assert model(torch.zeros(1, 3, 28, 28)).shape == (1, 10)  # B = 1 works
    # no batch dependency in training mode: each sample's output is the same alone as in its batch
    small = build_model("digit_cnn", norm="ws", classifier="fedwon", width=0.25, dropout=0.0).train()
    x = torch.randn(4, 3, 28, 28)
    torch.testing.assert_close(torch.cat([small(x[i:i + 1]) for i in range(4)]), small(x), rtol=1e-5, atol=1e-6)


def test_none_norm_gives_no_norm_layers_and_plain_convs():
    plain = DigitCNN(norm="none", classifier="fedwon", width=0.25)
    assert not [m for m in plain.modules() if isinstance(m, (NORM_LAYER_TYPES + (WSConv2d,)))]
    assert len([m for m in plain.modules() if type(m) is nn.Conv2d]) == 3


def test_convert_passes_its_eps_and_variance_to_every_wsconv():
    """The official-code / paper options reach the swapped convs (grouped and depthwise ones too), so the
    standardized weight of a converted conv is the formula under those settings."""
    model = convert_to_ws(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3, groups=4),
                                        nn.Conv2d(4, 8, 1, groups=2)), eps=1e-3, variance="biased")
    convs = [m for m in model.modules() if isinstance(m, WSConv2d)]
    assert len(convs) == 3
    for conv in convs:
        assert conv.variance == "biased" and float(conv.eps) == pytest.approx(1e-3)
        w = conv.weight.detach().double()
        fan_in = w[0].numel()
        var = w.var(dim=(1, 2, 3), keepdim=True, unbiased=False)
        expected = conv.gain.detach().double().view(-1, 1, 1, 1) * (w - w.mean(dim=(1, 2, 3), keepdim=True)) \
            / torch.sqrt(torch.clamp(fan_in * var, min=1e-3))
        torch.testing.assert_close(conv.standardized_weight().double(), expected, rtol=1e-5, atol=1e-6)
