"""MOON's projection head: base encoder -> Linear(d, d) -> ReLU -> Linear(d, out_dim) -> Linear(out_dim, classes),
and MOON's representation z is the projection's output."""

import pytest
import torch
from torch import nn

from fednorm.methods.client_algorithms import representation_module
from fednorm.models import DigitCNN, build_model
from fednorm.models.projection import MOON_OUT_DIM, add_projection_head


def test_the_head_replaces_the_output_layer_and_z_is_the_projection_output():
    torch.manual_seed(0)
    plain = DigitCNN(width=0.25)
    d, classes = plain.classifier[-1].in_features, plain.classifier[-1].out_features
    before = sum(p.numel() for p in plain.parameters())
    model = add_projection_head(plain, out_dim=16).eval()
    head = model.classifier[-1]
    assert [type(m) for m in head] == [nn.Linear, nn.ReLU, nn.Linear, nn.Linear]
    assert [(m.in_features, m.out_features) for m in head if isinstance(m, nn.Linear)] == [(d, d), (d, 16),
                                                                                            (16, classes)]
    # the output layer Linear(d, classes) gave way to Linear(d, d), Linear(d, 16) and Linear(16, classes)
    assert sum(p.numel() for p in model.parameters()) == before - (d * classes + classes) + (d * d + d) \
        + (d * 16 + 16) + (16 * classes + classes)
    seen = {}
    head.project1.register_forward_pre_hook(lambda m, args: seen.update(h=args[0]))
    x = torch.randn(3, 3, 28, 28)
    logits = model(x)
    z = head.project2(torch.relu(head.project1(seen["h"])))
    torch.testing.assert_close(logits, head.output(z))
    # MOON's z (the input of the last nn.Linear) is the projection's output
    name, module = representation_module(model)
    assert module is head.output and name == "classifier.6.output"
    module.register_forward_pre_hook(lambda m, args: seen.update(z=args[0]))
    model(x)
    torch.testing.assert_close(seen["z"], z)
    assert MOON_OUT_DIM == 256


def test_models_without_a_linear_output_layer_are_refused():
    with pytest.raises(ValueError, match="no nn.Linear output layer .* leave model.projection_dim unset"):
        add_projection_head(build_model("unet", width=0.25))
    with pytest.raises(ValueError, match="single nn.Linear; wrap it in nn.Sequential"):
        add_projection_head(nn.Linear(4, 2))
    with pytest.raises(ValueError, match="out_dim must be >= 1"):
        add_projection_head(DigitCNN(width=0.25), out_dim=0)
