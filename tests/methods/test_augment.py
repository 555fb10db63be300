"""training.augment fedbn_objects: the batched flip + rotation against torchvision's, its draws, its refusals."""

import pytest
import torch
import torch.nn.functional as F
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


def test_rot90_flip_is_the_harmofl_codes_numpy_rotation_and_cv2_flip_per_image():
    """HarmoFL's prostate augmentation: np.rot90(img, k) on the H, W axes, then cv2.flip(img, d): d = 0 reverses the
    rows, 1 the columns, -1 both; code 2 here means no flip. The image and its mask get the same transform."""
    import numpy as np

    from fednorm.methods.augment import rot90_flip

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (10, 3, 6, 6), dtype=torch.uint8, generator=g)
    turns = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 1, 0])
    codes = torch.tensor([2, 0, 1, -1, 0, 1, -1, 2, 2, -1])
    out = rot90_flip(x, turns, codes)
    for i in range(10):
        img = np.rot90(x[i].permute(1, 2, 0).numpy(), int(turns[i]))  # HWC, as the code's numpy arrays
        img = {2: img, 0: img[::-1], 1: img[:, ::-1], -1: img[::-1, ::-1]}[int(codes[i])]
        assert torch.equal(out[i], torch.from_numpy(img.copy()).permute(2, 0, 1))
    masks = (x[:, 0] > 128).to(torch.uint8)
    augment = BatchAugment("rot90_flip", torch.Generator().manual_seed(1))
    images, moved = augment.pair(x, masks)
    assert torch.equal(moved, (images[:, 0] > 128).to(torch.uint8))  # each mask went where its image went
    labels = torch.arange(10)
    assert torch.equal(BatchAugment("rot90_flip", torch.Generator()).pair(x, labels)[1], labels)  # class labels stay
    with pytest.raises(ValueError, match="must be square"):
        rot90_flip(torch.zeros(2, 3, 4, 6, dtype=torch.uint8), torch.zeros(2, dtype=torch.long),
                   torch.zeros(2, dtype=torch.long))


def test_rot90_flip_draws_follow_the_codes_randint_and_flip_probability():
    """k = random.randint(0, 4) (inclusive: 4 is a full turn, so no turn has probability 2/5), a flip with
    probability 0.75, its code uniform in {-1, 0, 1}."""
    from fednorm.methods.augment import draw_rot90_flip

    n = 200_000
    turns, codes = draw_rot90_flip(n, torch.Generator().manual_seed(0))
    share = torch.bincount(turns, minlength=4).double() / n
    torch.testing.assert_close(share, torch.tensor([0.4, 0.2, 0.2, 0.2], dtype=torch.float64), atol=0.005, rtol=0)
    flipped = codes != 2
    assert abs(flipped.double().mean() - 0.75) < 0.005
    by_code = torch.stack([(codes == c).double().mean() for c in (-1, 0, 1)])
    torch.testing.assert_close(by_code, torch.full((3,), 0.25, dtype=torch.float64), atol=0.005, rtol=0)


def test_fedbn_objects_refuses_masks_and_rot90_flip_is_allowed_for_segmentation():
    segmentation = build_task("segmentation", "dice")
    assert LocalTraining(augment="rot90_flip", task=segmentation).augment == "rot90_flip"
    x = torch.zeros(2, 3, 8, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="not their masks"):
        BatchAugment("fedbn_objects", torch.Generator()).pair(x, torch.zeros(2, 8, 8, dtype=torch.uint8))


def _flamby_identity(n: int, side: int, top: int = 12, left: int = 12) -> dict:
    """flamby_isic draws with every optional step off and the crop at (top, left)."""
    f = torch.float64
    return {"size": torch.full((n,), side), "angle": torch.zeros(n, dtype=f), "alpha": torch.ones(n, dtype=f),
            "beta": torch.zeros(n, dtype=f), "code": torch.full((n,), 2), "shear_x": torch.zeros(n, dtype=f),
            "shear_y": torch.zeros(n, dtype=f), "top": torch.full((n,), top), "left": torch.full((n,), left),
            "dropped": torch.zeros(n, dtype=torch.bool), "corners": torch.zeros(n, 0, 2, dtype=torch.long)}


def _images224(n: int = 2) -> torch.Tensor:
    return torch.randint(0, 256, (n, 3, 224, 224), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))


def test_flamby_isic_steps_one_at_a_time_against_their_definitions():
    """FLamby's Fed-ISIC2019 training transform, step by step on 224 x 224 images: the crop alone is the
    200 x 200 window; a 90-degree rotation is np.rot90 (counter-clockwise as displayed, cv2's sign); flip code 1
    reverses the columns; a resize is bilinear resampling of pixel centres (torch's interpolate, no antialias);
    contrast and brightness give floor(clip(x alpha + 255 beta)) (albumentations' uint8 lookup table); a hole is a
    black 16 x 16 square."""
    from fednorm.methods.augment import flamby_isic

    x = _images224()
    base = _flamby_identity(2, 224, top=3, left=17)
    out = flamby_isic(x, base)
    assert out.shape == (2, 3, 200, 200) and torch.equal(out, x[..., 3:203, 17:217])
    turned = flamby_isic(x, {**base, "angle": torch.full((2,), 90.0, dtype=torch.float64)})
    assert torch.equal(turned, torch.rot90(x, 1, dims=(-2, -1))[..., 3:203, 17:217])
    # the pipeline's order: the flip acts on the rotated image (flip after turn is not turn after flip)
    both = flamby_isic(x, {**base, "angle": torch.full((2,), 90.0, dtype=torch.float64), "code": torch.tensor([1, 1])})
    assert torch.equal(both, torch.rot90(x, 1, dims=(-2, -1)).flip(-1)[..., 3:203, 17:217])
    assert not torch.equal(both, torch.rot90(x.flip(-1), 1, dims=(-2, -1))[..., 3:203, 17:217])
    flipped = flamby_isic(x, {**base, "code": torch.tensor([1, 0])})
    assert torch.equal(flipped[0], x[0].flip(-1)[..., 3:203, 17:217])
    assert torch.equal(flipped[1], x[1].flip(-2)[..., 3:203, 17:217])
    scaled = flamby_isic(x, {**base, "size": torch.full((2,), 212), "left": torch.full((2,), 10)})
    resized = F.interpolate(x.float(), size=(212, 212), mode="bilinear", align_corners=False)
    expected = resized.round().clamp(0, 255)[..., 3:203, 10:210]
    assert (scaled.float() - expected).abs().max() <= 1  # one resampling against torch's, up to rounding
    adjusted = flamby_isic(x, {**base, "alpha": torch.full((2,), 1.1, dtype=torch.float64),
                                "beta": torch.full((2,), -0.15, dtype=torch.float64)})
    alpha, beta = torch.tensor(1.1, dtype=torch.float32), torch.tensor(-0.15, dtype=torch.float32)
    by_hand = (x[..., 3:203, 17:217].float() * alpha + 255.0 * beta).clamp(0, 255).floor()
    assert torch.equal(adjusted.float(), by_hand)  # floored, as astype(uint8): rounding would differ on ~half
    holes = {**base, "dropped": torch.tensor([True, False]), "corners": torch.tensor([[[0, 0], [100, 150]]] * 2)}
    cut = flamby_isic(x, holes)
    assert (cut[0, :, :16, :16] == 0).all() and (cut[0, :, 100:116, 150:166] == 0).all()
    assert torch.equal(cut[1], out[1])  # no cut-out where the step did not apply
    untouched = torch.ones(200, 200, dtype=torch.bool)
    untouched[:16, :16] = untouched[100:116, 150:166] = False
    assert torch.equal(cut[0][:, untouched], out[0][:, untouched])


def test_flamby_isic_draws_follow_flambys_ranges_and_probabilities():
    from fednorm.methods.augment import draw_flamby_isic

    n = 40_000
    d = draw_flamby_isic(n, 224, holes=3, generator=torch.Generator().manual_seed(0))
    scaled = d["scale"] != 1
    assert abs(scaled.double().mean() - 0.5) < 0.02  # each optional step with probability 0.5
    assert float((d["scale"] - 1).abs().max()) <= 0.07
    assert torch.equal(d["size"], torch.floor(224 * d["scale"] + 1e-9).long())  # albumentations' int(224 s)
    rotated = d["angle"] != 0
    assert abs(rotated.double().mean() - 0.5) < 0.02 and float(d["angle"].abs().max()) <= 50
    assert float((d["alpha"] - 1).abs().max()) <= 0.1 and float(d["beta"].abs().max()) <= 0.15
    assert abs((d["code"] != 2).double().mean() - 0.5) < 0.02
    sheared = d["shear_x"] != 0
    assert abs(sheared.double().mean() - 0.5) < 0.02  # Affine(shear=0.1): exactly 0.1 degrees on x and y
    assert set(d["shear_x"].tolist()) == {0.0, 0.1} and torch.equal(d["shear_x"], d["shear_y"])
    assert abs(d["dropped"].double().mean() - 0.5) < 0.02 and d["corners"].shape == (n, 3, 2)
    assert int(d["corners"].max()) == 200 - 16 and int(d["corners"].min()) == 0
    room = d["size"] - 200
    assert bool((d["top"] <= room).all()) and bool((d["left"] <= room).all()) and int(d["top"].min()) == 0
    with pytest.raises(ValueError, match="too small"):
        draw_flamby_isic(8, 200, 1, torch.Generator().manual_seed(0))


def test_flamby_isic_trains_on_200_crops_with_a_hole_count_fixed_per_client():
    from fednorm.methods.augment import FLAMBY_MAX_HOLES, draw_flamby_holes

    counts = {BatchAugment("flamby_isic", torch.Generator().manual_seed(s)).holes for s in range(200)}
    assert counts == set(range(1, FLAMBY_MAX_HOLES + 1))  # FLamby's random.randint(1, 8)
    # with a per-client generator (FLamby draws H once per client dataset) H comes from it, whatever the batch stream
    per_client = {BatchAugment("flamby_isic", torch.Generator().manual_seed(s), torch.Generator().manual_seed(7)).holes
                  for s in range(50)}
    assert per_client == {draw_flamby_holes(torch.Generator().manual_seed(7))}
    # and the batch stream is not drawn from for it: the first batch's draws are those of a fresh generator
    augment = BatchAugment("flamby_isic", torch.Generator().manual_seed(3), torch.Generator().manual_seed(7))
    fresh = torch.Generator().manual_seed(3)
    assert torch.equal(torch.rand(4, generator=augment.generator), torch.rand(4, generator=fresh))
    shapes = []
    model = nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(12, 10))
    model.register_forward_pre_hook(lambda m, args: shapes.append(tuple(args[0].shape)))
    data = type(make_split(1, seed=0))(_images224(6), torch.arange(6))
    train_locally(model, data, LocalTraining(batch_size=3, lr=0.1, augment="flamby_isic"),
                  generator=torch.Generator().manual_seed(0), prepare=normalize_batch,
                  augment_generator=torch.Generator().manual_seed(1))
    assert shapes == [(3, 3, 200, 200)] * 2
