"""AlexNet's UniFed options: ImageNet weights (``pretrained``) and the in-forward resize (``input_size``).

No test downloads anything: torch.hub's download is blocked in every test, and the "ImageNet" checkpoint is a
fake with torchvision's keys and shapes, written into a temporary TORCH_HOME.
"""

from urllib.error import URLError

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torchvision.models import alexnet as tv_alexnet

from fednorm.data.domain import DataError
from fednorm.models.alexnet import AlexNet, load_imagenet_weights
from fednorm.models.registry import build_model
from fednorm.runs.config import ConfigError, ModelConfig, load_config

CHECKPOINT = "alexnet-owt-7be5be79.pth"  # torchvision's AlexNet_Weights.IMAGENET1K_V1 file name
# torchvision's layer -> ours (read from torchvision/models/alexnet.py: ReLUs and max-pools between the convs,
# Dropouts before the FCs); written out here rather than imported, to check the model's own mapping
CONVS = ("features.0", "features.3", "features.6", "features.8", "features.10")
FCS = ("classifier.1", "classifier.4")


def layers(module, kind):
    return [m for m in module.modules() if isinstance(m, kind)]


@pytest.fixture(autouse=True)
def offline_empty_hub(tmp_path, monkeypatch):
    """An empty torch.hub cache and no network: a download attempt raises (and is counted)."""
    attempts = []

    def blocked(url, *args, **kwargs):
        attempts.append(url)
        raise URLError("network blocked in tests")

    monkeypatch.setattr(torch.hub, "download_url_to_file", blocked)
    monkeypatch.setattr(torch.hub, "_hub_dir", None)  # an earlier torch.hub.set_dir would override TORCH_HOME
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty_torch_home"))
    return attempts


@pytest.fixture(scope="module")
def fake_imagenet(tmp_path_factory):
    """A TORCH_HOME whose hub cache holds a random checkpoint with torchvision AlexNet's keys and shapes."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in tv_alexnet(weights=None).state_dict().items()}
    generator = torch.Generator().manual_seed(1234)
    state = {k: torch.randn(shape, generator=generator) for k, shape in shapes.items()}
    home = tmp_path_factory.mktemp("torch_home")
    path = home / "hub" / "checkpoints" / CHECKPOINT
    path.parent.mkdir(parents=True)
    torch.save(state, path)
    return home, state


@pytest.fixture
def imagenet_hub(fake_imagenet, monkeypatch):
    home, state = fake_imagenet
    monkeypatch.setenv("TORCH_HOME", str(home))
    return state


def assert_fresh_norms(model):
    bns = layers(model, _BatchNorm)
    assert len(bns) == 7  # after the five convs and FC1, FC2
    for bn in bns:
        assert torch.equal(bn.weight, torch.ones_like(bn.weight)) and torch.equal(bn.bias, torch.zeros_like(bn.bias))
        assert torch.equal(bn.running_mean, torch.zeros_like(bn.running_mean))
        assert torch.equal(bn.running_var, torch.ones_like(bn.running_var))
        assert bn.num_batches_tracked == 0


def test_imagenet_weights_fill_every_conv_and_fc1_fc2_and_nothing_else(imagenet_hub, offline_empty_hub):
    state = imagenet_hub
    torch.manual_seed(0)
    model = ModelConfig(name="alexnet", pretrained="imagenet", input_size=224).build(num_classes=10).eval()
    torch.manual_seed(1)
    other = build_model("alexnet", classifier="fedwon", pretrained="imagenet")  # torchvision's own FC indices
    torch.manual_seed(0)
    plain = AlexNet()
    assert not offline_empty_hub  # read from the cache, no download tried

    for net in (model, other):
        convs, fcs = layers(net.features, nn.Conv2d), layers(net.classifier, nn.Linear)
        assert len(convs) == 5 and len(fcs) == 3
        for key, layer in zip(CONVS + FCS, convs + fcs[:2]):
            assert torch.equal(layer.weight, state[f"{key}.weight"]), key
            assert torch.equal(layer.bias, state[f"{key}.bias"]), key
    # the class layer is fresh and seeded as without weights (the loading draws no random numbers)
    head, plain_head = layers(model.classifier, nn.Linear)[2], layers(plain.classifier, nn.Linear)[2]
    assert torch.equal(head.weight, plain_head.weight) and torch.equal(head.bias, plain_head.bias)
    assert not torch.equal(head.weight, layers(other.classifier, nn.Linear)[2].weight)  # another seed
    assert not torch.equal(layers(plain.features, nn.Conv2d)[0].weight, state["features.0.weight"])
    assert_fresh_norms(model)
    assert layers(other, _BatchNorm) and all(isinstance(m, nn.BatchNorm2d) for m in layers(other, _BatchNorm))
    # 32 x 32 CIFAR images reach the pretrained network at 224 x 224
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_missing_weights_offline_name_the_url_and_the_cache_path(offline_empty_hub, tmp_path):
    expected = tmp_path / "empty_torch_home" / "hub" / "checkpoints" / CHECKPOINT
    with pytest.raises(DataError, match="cannot download the ImageNet AlexNet weights") as caught:
        ModelConfig(name="alexnet", pretrained="imagenet").build()
    message = str(caught.value)
    assert str(expected) in message and f"https://download.pytorch.org/models/{CHECKPOINT}" in message
    assert "network blocked" in message
    assert offline_empty_hub == [f"https://download.pytorch.org/models/{CHECKPOINT}"]  # stopped by the stub
    assert not expected.exists()


def test_a_broken_or_foreign_checkpoint_is_a_data_error(tmp_path, monkeypatch):
    path = tmp_path / "home" / "hub" / "checkpoints" / CHECKPOINT
    path.parent.mkdir(parents=True)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "home"))
    small = AlexNet(width=0.125)  # the loader itself, on a small model: the file fails before any copy
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(DataError, match="cannot load the ImageNet AlexNet weights at .*delete the file"):
        load_imagenet_weights(small)
    torch.save({"features.0.weight": torch.zeros(64, 3, 11, 11)}, path)
    with pytest.raises(DataError, match=r"not torchvision's ImageNet AlexNet: features\.0\.weight is of shape"):
        load_imagenet_weights(small)


@pytest.mark.parametrize("options, message", [
    ({"width": 0.5}, "width must be 1"),
    ({"norm": "ws", "classifier": "fedwon"}, "norm 'ws' standardizes"),
    ({"in_channels": 1}, "in_channels must be 3"),
    ({"pretrained": "ImageNet"}, "unknown pretrained"),
    ({"pretrained": "none", "input_size": 32}, "input_size must be at least 63"),
])
def test_alexnet_refuses_what_cannot_take_the_weights_before_loading(options, message, offline_empty_hub):
    with pytest.raises(ValueError, match=message):
        AlexNet(**{"pretrained": "imagenet", **options})
    assert not offline_empty_hub


@pytest.mark.parametrize("overrides, message", [
    (["model.name=resnet18", "model.pretrained=imagenet"], "model.pretrained: only alexnet"),
    (["model.pretrained=yes"], "model.pretrained"),
    (["model.name=alexnet", "model.input_size=224", "model.pretrained=imagenet", "model.width=0.5"],
     "model.width must be 1"),
    (["model.name=alexnet", "model.input_size=224", "model.pretrained=imagenet", "model.norm=ws"],
     "model.pretrained: norm ws"),
    (["model.name=alexnet", "model.input_size=224", "model.pretrained=imagenet", "methods=[fedbn, fedwon]"],
     "method 'fedwon' standardizes"),
    (["model.name=resnet18", "model.input_size=224"], "model.input_size: only alexnet"),
    (["model.name=alexnet", "model.input_size=32"], "model.input_size: alexnet needs at least 63"),
    (["model.name=alexnet"], "at least 63 x 63 .*set model.input_size"),  # 28 x 28 digits without the resize
])
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("default", overrides)


def test_a_pretrained_resized_alexnet_validates_on_small_images():
    cfg = load_config("default", ["model.name=alexnet", "model.pretrained=imagenet", "model.input_size=224"])
    assert (cfg.model.pretrained, cfg.model.input_size) == ("imagenet", 224)
    with pytest.raises(ValueError, match="has no option 'pretrained'"):
        build_model("resnet18", pretrained="imagenet")
    with pytest.raises(ValueError, match="has no option 'input_size'"):
        build_model("digit_cnn", input_size=64)


def test_input_size_resizes_inside_forward_as_interpolate():
    torch.manual_seed(0)
    model = ModelConfig(name="alexnet", width=0.125, input_size=64).build().eval()
    assert model.input_size == 64
    x = torch.randn(3, 3, 32, 32)
    up = F.interpolate(x, size=(64, 64), mode="bilinear", align_corners=False)
    with torch.no_grad():
        assert torch.equal(model(x), model(up))
        assert model(torch.randn(2, 3, 40, 50)).shape == (2, 10)  # any side, also non-square
    torch.manual_seed(0)
    plain = AlexNet(width=0.125).eval()
    with torch.no_grad():
        assert torch.equal(plain(up), model(x))  # same seed, same weights: the resize is all that differs
        with pytest.raises(ValueError, match="at least 63 x 63.*input_size"):
            plain(x)
