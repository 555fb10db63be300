import pytest
import torch
from torch import nn
from torchvision.models import densenet121 as tv_densenet121

from fednorm.models.densenet import densenet121, replace_batchnorm
from fednorm.models.fbn import FederatedBatchNorm2d
from fednorm.models.norm import NORM_KINDS
from fednorm.models.unet import UNet
from fednorm.models.wsconv import NORM_LAYER_TYPES, WSConv2d


def layers(module, kind):
    return [m for m in module.modules() if isinstance(m, kind)]


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def code_unet_params(in_ch=3, out_ch=2, f=32, bn_affine=True):
    """Parameter count of the official U-Net, written out block by block."""
    def block(i, o):
        return 9 * i * o + 9 * o * o + (4 * o if bn_affine else 0)

    total, prev = 0, in_ch
    for c in (f, 2 * f, 4 * f, 8 * f):
        total += block(prev, c)
        prev = c
    total += block(8 * f, 16 * f)  # bottleneck
    for c in (8 * f, 4 * f, 2 * f, f):
        total += 4 * (2 * c) * c + c  # ConvTranspose2d(2c, c, 2, 2) with bias
        total += block(2 * c, c)
    return total + f * out_ch + out_ch  # 1x1 head


@pytest.mark.parametrize("norm", NORM_KINDS)
def test_unet_builds_and_trains_with_every_norm(norm):
    torch.manual_seed(0)
    model = UNet(num_classes=2, norm=norm, width=0.125).train()
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 2, 32, 32)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    if norm in ("none", "ws"):
        assert not layers(model, NORM_LAYER_TYPES)
    else:
        norms = layers(model, NORM_LAYER_TYPES)
        assert len(norms) == 18  # 9 blocks x 2
        assert {type(m) for m in norms} == {{"bn": nn.BatchNorm2d, "fbn": FederatedBatchNorm2d, "gn": nn.GroupNorm,
                                             "ln": nn.GroupNorm, "in": nn.InstanceNorm2d}[norm]}
    if norm == "ws":
        convs = [m for m in model.modules() if type(m) in (nn.Conv2d, WSConv2d)]
        assert sum(isinstance(c, WSConv2d) for c in convs) == 18 and type(model.head) is nn.Conv2d


def test_unet_matches_the_official_architecture():
    model = UNet()
    assert [b.conv2.out_channels for b in model.encoders] == [32, 64, 128, 256]
    assert model.bottleneck.conv2.out_channels == 512
    assert [b.conv2.out_channels for b in model.decoders] == [256, 128, 64, 32]
    assert n_params(model) == code_unet_params()  # affine BN (fednorm's default)
    code = UNet(bn_mode="batch")
    assert n_params(code) == code_unet_params(bn_affine=False)
    bns = layers(code, nn.BatchNorm2d)
    assert bns and all(not bn.affine and not bn.track_running_stats for bn in bns)
    assert all(c.bias is None for b in model.encoders for c in (b.conv1, b.conv2))


def test_unet_batch_statistics_mode_depends_on_the_batch_in_eval():
    torch.manual_seed(0)
    x = torch.randn(4, 1, 16, 16)
    code = UNet(in_channels=1, width=0.125, bn_mode="batch").eval()
    standard = UNet(in_channels=1, width=0.125).eval()
    assert not torch.allclose(code(x)[:2], code(x[:2]))  # batch statistics even in eval
    torch.testing.assert_close(standard(x)[:2], standard(x[:2]))


def test_unet_refuses_bad_arguments():
    with pytest.raises(ValueError, match="divisible by 16"):
        UNet(width=0.125)(torch.randn(1, 3, 24, 24))
    with pytest.raises(ValueError, match="norm='bn'"):
        UNet(norm="gn", bn_mode="batch")
    with pytest.raises(ValueError, match="bn_mode"):
        UNet(bn_mode="frozen")
    with pytest.raises(ValueError, match=">= 2 classes"):
        UNet(num_classes=1)
    with pytest.raises(ValueError, match="unknown normalization"):
        UNet(norm="batch")


def test_densenet121_is_torchvisions_at_width_one():
    ours, ref = densenet121(num_classes=2), tv_densenet121(weights=None, num_classes=2)
    shapes = {k: v.shape for k, v in ours.state_dict().items()}
    assert shapes == {k: v.shape for k, v in ref.state_dict().items()}
    assert n_params(ours) == n_params(ref)


@pytest.mark.parametrize("norm", NORM_KINDS)
def test_densenet_builds_and_trains_with_every_norm(norm):
    torch.manual_seed(0)
    model = densenet121(num_classes=2, norm=norm, width=0.125).train()
    side = 64 if norm == "in" else 32  # instance norm needs > 1 value per channel in the last block
    out = model(torch.randn(2, 3, side, side))
    assert out.shape == (2, 2)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert not any(type(m) is nn.BatchNorm2d for m in model.modules()) or norm == "bn"
    expected = {"bn": nn.BatchNorm2d, "fbn": FederatedBatchNorm2d, "gn": nn.GroupNorm, "ln": nn.GroupNorm,
                "in": nn.InstanceNorm2d}
    norms = layers(model, NORM_LAYER_TYPES)
    if norm in ("none", "ws"):
        assert not norms
    else:
        assert len(norms) == 2 * 58 + 3 + 2  # two per dense layer, one per transition, norm0, norm5
        assert {type(m) for m in norms} == {expected[norm]}
        if norm == "ln":
            assert all(m.num_groups == 1 for m in norms)
    if norm == "ws":
        assert all(isinstance(m, WSConv2d) for m in model.modules() if isinstance(m, nn.Conv2d))


def test_densenet_code_options():
    model = densenet121(width=0.125, bn_mode="batch", code_zero_pad=True)
    bns = layers(model, nn.BatchNorm2d)
    assert len(bns) == 121 and all(not bn.affine and not bn.track_running_stats for bn in bns)
    names = [n for n, _ in model.features.named_children()]
    assert names[names.index("denseblock1") + 1] == "zero_padding"
    sizes = {}
    model.features.transition1.register_forward_hook(lambda m, i, o: sizes.update(t1=o.shape[-1]))
    assert model(torch.randn(2, 3, 96, 96)).shape == (2, 2)
    assert sizes["t1"] == 14  # 96 -> 24 after the stem, padded to 28, pooled to 14 (12 without the pad)
    gray = densenet121(width=0.125, in_channels=1)
    assert gray(torch.randn(2, 1, 32, 32)).shape == (2, 2)
    with pytest.raises(ValueError, match="norm='bn'"):
        densenet121(norm="gn", bn_mode="batch")


def test_replace_batchnorm_selects_by_type():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Sequential(nn.BatchNorm2d(4)))
    replace_batchnorm(model, lambda c: nn.GroupNorm(2, c))
    assert [type(m) for m in model.modules()].count(nn.GroupNorm) == 2


@pytest.mark.parametrize("name,module,attr", [("unet", "unet", "UNet"), ("densenet121", "densenet", "densenet121")])
def test_registry_lines_build_the_models(monkeypatch, name, module, attr):
    from fednorm.models import registry

    monkeypatch.setitem(registry._BUILDERS, name, (module, attr))  # the lines proposed for _BUILDERS
    model = registry.build_model(name, num_classes=2, norm="gn", width=0.125)
    assert model(torch.randn(2, 3, 32, 32)).shape[:2] == (2, 2)


def test_the_code_zero_pad_of_the_official_densenet_is_reachable_from_the_config():
    from fednorm.models.densenet import densenet121
    from fednorm.runs.config import ModelConfig

    model = ModelConfig(name="densenet121", width=0.125, code_zero_pad=True).build(num_classes=2)
    pads = [m for m in model.modules() if isinstance(m, torch.nn.ZeroPad2d)]
    assert len(pads) == 1 and pads[0].padding == (2, 2, 2, 2)
    assert not [m for m in densenet121(width=0.125).modules() if isinstance(m, torch.nn.ZeroPad2d)]
    with pytest.raises(ValueError, match="code_zero_pad"):
        ModelConfig(name="digit_cnn", code_zero_pad=True).build()
