import pytest
import torch
from torch import nn

from fednorm.methods.agc import agc_parameters, clip_unitwise_, head_parameter_names, unitwise_norm


def test_clips_exactly_the_units_above_the_ratio():
    w = nn.Parameter(torch.tensor([[3.0, 4.0], [0.0, 0.0], [1.0, 0.0]]))  # unit norms 5, 0 (-> eps), 1
    w.grad = torch.tensor([[6.0, 8.0], [0.1, 0.0], [0.0, 0.5]])  # grad norms 10, 0.1, 0.5
    clip_unitwise_([w], clip=0.64, eps=1e-3)
    # unit 0: 10 / 5 = 2 > 0.64 -> rescaled to norm 0.64 * 5 = 3.2
    torch.testing.assert_close(w.grad[0], torch.tensor([6.0, 8.0]) * (3.2 / 10))
    # unit 1: weight norm clamped to eps: 0.1 / 1e-3 > 0.64 -> norm 0.64e-3
    torch.testing.assert_close(w.grad[1], torch.tensor([0.64e-3, 0.0]))
    # unit 2: 0.5 / 1 = 0.5 <= 0.64 -> unchanged
    torch.testing.assert_close(w.grad[2], torch.tensor([0.0, 0.5]))


def test_default_eps_is_the_papers_1e_3():
    """A zero-weight unit's norm is clamped to eps = 1e-3 (FedWon / NFNets) unless told otherwise."""
    w = nn.Parameter(torch.zeros(1, 2))
    w.grad = torch.tensor([[1.0, 0.0]])
    clip_unitwise_([w], clip=0.5)
    torch.testing.assert_close(w.grad, torch.tensor([[0.5e-3, 0.0]]))


def test_conv_units_are_output_channels_and_vectors_are_one_unit():
    torch.manual_seed(0)
    w = torch.randn(4, 3, 2, 2)
    assert unitwise_norm(w).shape == (4, 1, 1, 1)
    torch.testing.assert_close(unitwise_norm(w).flatten(), w.flatten(1).norm(dim=1))
    b = torch.tensor([3.0, 4.0])
    assert float(unitwise_norm(b)) == 5.0


def test_random_ratios_never_exceed_lambda_after_clipping():
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(8, 5, 3, 3))
    p.grad = torch.randn(8, 5, 3, 3) * torch.logspace(-2, 1, 8).view(8, 1, 1, 1)
    before = p.grad.clone()
    clip_unitwise_([p], clip=0.3)
    # Eq. 4 unit by unit: a unit above lambda is rescaled to ratio exactly lambda, its direction kept
    weight_norm = p.detach().flatten(1).norm(dim=1).clamp(min=1e-3).view(8, 1, 1, 1)
    grad_norm = before.flatten(1).norm(dim=1).view(8, 1, 1, 1)
    clipped = grad_norm / weight_norm > 0.3
    assert clipped.any() and (~clipped).any()
    torch.testing.assert_close(p.grad, before * torch.where(clipped, 0.3 * weight_norm / grad_norm, 1.0))
    torch.testing.assert_close((unitwise_norm(p.grad) / unitwise_norm(p.detach()))[clipped],
                               torch.full((int(clipped.sum()),), 0.3))


def test_the_final_classifier_is_excluded_by_default():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    assert head_parameter_names(model) == {"4.weight", "4.bias"}
    names = {id(p) for p in agc_parameters(model)}
    assert id(model[4].weight) not in names and id(model[2].weight) in names
    assert len(agc_parameters(model, exclude_head=False)) == 6


def test_a_convolutional_head_is_the_classifier_excluded():
    """The U-Net has no Linear layer: its 1 x 1 output conv (``head``) is the classifier AGC leaves alone."""
    from fednorm.models.unet import UNet

    model = UNet(num_classes=2, norm="none", width=0.125)
    assert head_parameter_names(model) == {"head.weight", "head.bias"}
    kept = {id(p) for p in agc_parameters(model)}
    assert id(model.head.weight) not in kept
    assert len(kept) == len(list(model.parameters())) - 2


def test_lambda_must_be_positive():
    with pytest.raises(ValueError, match="lambda"):
        clip_unitwise_([nn.Parameter(torch.ones(2))], clip=0.0)
