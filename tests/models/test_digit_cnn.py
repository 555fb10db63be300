import pytest
import torch
from torch import nn

from fednorm.models import DigitCNN, build_model, make_norm


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
