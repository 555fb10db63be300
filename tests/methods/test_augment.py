"""training.augment fedbn_objects: the batched flip + rotation against torchvision's, its draws, its refusals."""

import pytest
import torch
import torchvision.transforms.functional as TF
from torch import nn
from torchvision.transforms import InterpolationMode

from fednorm.data.domain import normalize_batch
from fednorm.methods.augment import BatchAugment, draw_flip_rotate, flip_rotate
from fednorm.methods.local_update import LocalTraining, train_locally
from fednorm.methods.tasks import build_task

from ..conftest import make_split

# pixels allowed to differ from torchvision's per-image rotate: only a source coordinate on a rounding boundary (a
# half-integer) may pick the other neighbour. Measured: 0 of 2.4 million pixels (sizes 28, 64, 256; the module doc)
BOUNDARY_TOLERANCE = 0.001


@pytest.mark.parametrize("height, width", [(28, 28), (64, 64), (31, 40)])
def test_batched_flip_rotate_equals_torchvision_per_image(height, width):
    g = torch.Generator().manual_seed(height)
    x = torch.randint(0, 256, (12, 3, height, width), generator=g, dtype=torch.uint8)
    flip, angle = draw_flip_rotate(12, g)
    angle[:5] = torch.tensor([0.0, 30.0, -30.0, 90.0, -12.5])  # the range's ends, a quarter turn, a fraction
    flip[:2] = torch.tensor([True, False])
    out = flip_rotate(x, flip, angle)
    assert out.dtype == torch.uint8 and out.shape == x.shape
    differing = 0
    for i in range(len(x)):
        image = TF.hflip(x[i]) if flip[i] else x[i]
        expected = TF.rotate(image, float(angle[i]), InterpolationMode.NEAREST, expand=False, fill=[0.0, 0.0, 0.0])
        differing += int((expected != out[i]).any(0).sum())
    assert differing <= BOUNDARY_TOLERANCE * len(x) * height * width


def test_no_flip_and_angle_zero_leave_the_images_and_the_fill_is_black():
    x = torch.full((2, 3, 20, 20), 200, dtype=torch.uint8)
    x[:, :, :, :5] = 7
    same = flip_rotate(x, torch.tensor([False, False]), torch.tensor([0.0, 0.0]))
    assert torch.equal(same, x)
    flipped = flip_rotate(x, torch.tensor([True, False]), torch.tensor([0.0, 0.0]))
    assert torch.equal(flipped[0], x[0].flip(-1)) and torch.equal(flipped[1], x[1])
    turned = flip_rotate(x, torch.tensor([False, False]), torch.tensor([30.0, -30.0]))
    assert (turned[:, :, 0, 0] == 0).all() and (turned[:, :, -1, -1] == 0).all()  # corners: RandomRotation's fill 0
    assert (turned[:, :, 10, 10] == 200).all()  # the centre stays


def test_draws_are_uniform_in_range_and_independent_per_sample():
    """Seeded, and each bound 7 or more standard deviations wide at n = 20000 (flip rate 0.0035, angle mean 0.12
    degrees, a quartile 0.18 degrees, a lag-1 correlation 0.007), so a change of torch's generator cannot flake it."""
    flip, angle = draw_flip_rotate(20000, torch.Generator().manual_seed(0))
    assert 0.4 <= flip.double().mean() <= 0.6
    assert angle.min() >= -30 and angle.max() <= 30 and (angle < 0).any() and (angle > 0).any()
    assert angle.min() < -29.5 and angle.max() > 29.5  # the whole range is used
    assert abs(angle.mean()) < 1.0
    quartiles = torch.quantile(angle, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64))
    torch.testing.assert_close(quartiles, torch.tensor([-15.0, 0.0, 15.0], dtype=torch.float64), atol=1.5, rtol=0)
    # independent: of each other, and from one sample to the next
    assert 0.4 <= flip[angle > 0].double().mean() <= 0.6 and 0.4 <= flip[angle < 0].double().mean() <= 0.6
    assert abs(torch.corrcoef(torch.stack([angle[:-1], angle[1:]]))[0, 1]) < 0.05
    assert abs(torch.corrcoef(torch.stack([flip[:-1].double(), flip[1:].double()]))[0, 1]) < 0.05


def test_each_image_of_a_batch_gets_its_own_transform():
    image = make_split(1, seed=3).x
    out = BatchAugment("fedbn_objects", torch.Generator().manual_seed(0))(image.expand(16, -1, -1, -1).contiguous())
    assert len({tuple(o.flatten().tolist()) for o in out}) == 16
    again = BatchAugment("fedbn_objects", torch.Generator().manual_seed(0))(image.expand(16, -1, -1, -1).contiguous())
    assert torch.equal(out, again)  # the same stream gives the same draws


def test_augment_none_trains_exactly_as_without_the_option(monkeypatch):
    # under "none" nothing of the augmentation may run or draw: it would move the batch order or the global stream
    import fednorm.methods.local_update as local_update

    def refuse(*args, **kwargs):
        raise AssertionError("augment: none built an augmentation")

    monkeypatch.setattr(local_update, "BatchAugment", refuse)
    data = make_split(24, seed=1)
    weights = []
    for cfg in (LocalTraining(batch_size=8, lr=0.1), LocalTraining(batch_size=8, lr=0.1, augment="none")):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 28 * 28, 10))
        train_locally(model, data, cfg, generator=torch.Generator().manual_seed(0), prepare=normalize_batch)
        weights.append(model.state_dict())
    for k in weights[0]:
        assert torch.equal(weights[0][k], weights[1][k])


def test_refusals():
    with pytest.raises(ValueError, match="augment must be one of none, fedbn_objects"):
        LocalTraining(augment="flip")
    with pytest.raises(ValueError, match="masks"):
        LocalTraining(augment="fedbn_objects", task=build_task("segmentation", "dice"))
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 28 * 28, 10))
    with pytest.raises(ValueError, match="augment_generator"):
        train_locally(model, make_split(8, seed=1), LocalTraining(batch_size=8, augment="fedbn_objects"),
                      generator=torch.Generator(), prepare=normalize_batch)
    with pytest.raises(ValueError, match="uint8 N x C x H x W.*feature vectors"):
        BatchAugment("fedbn_objects", torch.Generator())(torch.rand(4, 12))
