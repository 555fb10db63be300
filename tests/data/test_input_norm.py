"""data.input_norm: the per-channel standardization of uint8 images each paper's code uses."""

import pytest
import torch

from fednorm.data.domain import INPUT_NORMS, Standardize, input_normalization
from fednorm.runs.config import load_config


def _images() -> torch.Tensor:
    return torch.randint(0, 256, (4, 3, 5, 6), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


def test_each_normalization_is_its_formula():
    x = _images()
    unit = x.float() / 255
    torch.testing.assert_close(input_normalization("half")(x), (unit - 0.5) / 0.5)  # FedBN digits: [-1, 1]
    torch.testing.assert_close(input_normalization("unit")(x), unit)  # ToTensor only: [0, 1]
    torch.testing.assert_close(input_normalization("raw")(x), x.float())  # HarmoFL prostate: [0, 255]
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    torch.testing.assert_close(input_normalization("imagenet")(x), (unit - mean) / std)
    assert input_normalization() == Standardize() == Standardize(*INPUT_NORMS["half"])  # the default


def test_imagenet_needs_rgb_and_unknown_names_are_named():
    with pytest.raises(ValueError, match="3 channel means, the images have 1 channels"):
        input_normalization("imagenet")(torch.zeros(2, 1, 4, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="unknown input normalization 'z'"):
        input_normalization("z")


def test_presets_take_their_papers_code_normalization():
    assert load_config("fedbn_digits").data.input_norm == "half"
    assert load_config("fedbn_office").data.input_norm == "unit"
    assert load_config("fedbn_domainnet").data.input_norm == "unit"  # extends fedbn_office
    assert load_config("fedwon_office").data.input_norm == "unit"
    assert load_config("harmofl_camelyon17").data.input_norm == "unit"
    assert load_config("harmofl_prostate").data.input_norm == "raw"
    assert load_config("fedwon_isic2019").data.input_norm == "imagenet"
    assert load_config("unifed_cifar10c_external").data.input_norm == "imagenet"


def test_config_refuses_input_norm_on_feature_vectors():
    with pytest.raises(Exception, match="feature vectors are standardized per site"):
        load_config("fedbn_abide", ["data.input_norm=unit"])
