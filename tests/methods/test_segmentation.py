import math

import pytest
import torch
import torch.nn.functional as F

from fednorm.methods.segmentation import (
    CEDiceLoss,
    DiceLoss,
    ce_dice_loss,
    dice_loss,
    dice_per_class,
    dice_score,
    harmofl_code_dice,
)

# one 2 x 3 image; foreground pixels: target (0,1) (0,2) (1,1); prediction (0,0) (0,1)
TARGET = torch.tensor([[[0, 1, 1], [0, 1, 0]]])
PRED = torch.tensor([[[1, 1, 0], [0, 0, 0]]])
FG = 2 * 1 / (2 + 3)  # intersection (0,1): 0.4
BG = 2 * 2 / (4 + 3)  # bg: prediction 4 px, target 3 px, common (1,0) (1,2): 4/7


def logits_of(labels, k=2):
    return F.one_hot(labels, k).movedim(-1, 1).float() * 10.0


def test_hard_dice_on_hand_masks():
    torch.testing.assert_close(dice_per_class(PRED, TARGET, 2), torch.tensor([[BG, FG]]))
    assert dice_score(logits_of(PRED), TARGET).item() == pytest.approx(FG)  # foreground only (default)
    assert dice_score(PRED, TARGET, num_classes=2).item() == pytest.approx(FG)
    assert dice_score(logits_of(PRED), TARGET, background="include").item() == pytest.approx((FG + BG) / 2)
    assert dice_score(logits_of(PRED), TARGET[:, None]).item() == pytest.approx(FG)  # N x 1 x H x W masks
    assert dice_score(logits_of(TARGET), TARGET).item() == 1.0


def test_official_code_dice_includes_background_and_scores_empty_as_zero():
    expected = (2 * 1 / (5 + 1e-5) + 2 * 2 / (7 + 1e-5)) / 2
    assert harmofl_code_dice(logits_of(PRED), TARGET).item() == pytest.approx(expected, rel=1e-7)
    empty = torch.zeros(1, 2, 3, dtype=torch.long)  # no foreground anywhere, none predicted
    # code: foreground 0 / (0 + 1e-5) = 0, background 2*6 / (12 + 1e-5); standard: foreground Dice 1
    assert harmofl_code_dice(logits_of(empty), empty).item() == pytest.approx(12 / (12 + 1e-5) / 2, rel=1e-7)
    assert dice_score(logits_of(empty), empty).item() == 1.0
    assert dice_score(logits_of(empty), empty, empty=0.0).item() == 0.0


def test_dice_is_averaged_per_image_and_reduction_none_gives_the_table():
    target = torch.cat([TARGET, TARGET])
    pred = torch.cat([PRED, TARGET])  # second image perfect
    assert dice_score(logits_of(pred), target).item() == pytest.approx((FG + 1.0) / 2)
    table = dice_score(logits_of(pred), target, reduction="none", background="include")
    torch.testing.assert_close(table, torch.tensor([[BG, FG], [1.0, 1.0]]))


def test_multiclass_dice_excludes_class_zero_only():
    target = torch.tensor([[[0, 1, 2, 2]]])
    pred = torch.tensor([[[0, 1, 2, 1]]])
    # class 1: 2*1/(2+1) ; class 2: 2*1/(1+2)
    assert dice_score(pred, target, num_classes=3).item() == pytest.approx(2 / 3)


def test_soft_dice_loss_on_hand_probabilities():
    # 1 x 1 x 2 image, p(class 1) = 0.75 everywhere (logits 0, ln 3); target [1, 0]
    logits = torch.tensor([0.0, math.log(3.0)]).view(1, 2, 1, 1).expand(1, 2, 1, 2).contiguous()
    target = torch.tensor([[[1, 0]]])
    s = 1e-5
    d1 = (2 * 0.75 + s) / (1.5 + 1 + s)
    d0 = (2 * 0.25 + s) / (0.5 + 1 + s)
    assert dice_loss(logits, target).item() == pytest.approx(1 - (d0 + d1) / 2, rel=1e-6)  # code: with background
    assert dice_loss(logits, target, include_background=False).item() == pytest.approx(1 - d1, rel=1e-6)
    ce = (-math.log(0.75) - math.log(0.25)) / 2
    assert ce_dice_loss(logits, target).item() == pytest.approx((ce + 1 - (d0 + d1) / 2) / 2, rel=1e-6)
    assert ce_dice_loss(logits, target, ce_weight=1, dice_weight=1).item() == pytest.approx(ce + 1 - (d0 + d1) / 2, rel=1e-6)
    assert DiceLoss()(logits, target).item() == pytest.approx(dice_loss(logits, target).item())
    assert CEDiceLoss(include_background=False)(logits, target).item() == pytest.approx(
        ce_dice_loss(logits, target, include_background=False).item()
    )


def test_batch_dice_sums_over_the_batch_and_per_image_averages():
    # image 1: one foreground pixel predicted with p = 1 (dice 1); image 2: no foreground, p(fg) = 0.5
    logits = torch.zeros(2, 2, 1, 2)
    logits[0, 1, 0, 0], logits[0, 0, 0, 1] = 50.0, 50.0  # image 1: p = onehot([1, 0]) exactly
    target = torch.tensor([[[1, 0]], [[0, 0]]])
    s = 1e-5
    fg_batch = (2 * 1 + s) / (1 + 1 + 1 + s)  # sums: inter 1, p 1 + 1, y 1
    fg_img = ((2 + s) / (2 + s) + (0 + s) / (1 + 0 + s)) / 2
    assert dice_loss(logits, target, include_background=False).item() == pytest.approx(1 - fg_batch, rel=1e-5)
    assert dice_loss(logits, target, include_background=False, batch_dice=False).item() == pytest.approx(1 - fg_img, rel=1e-5)


def test_losses_are_differentiable_and_both_halves_reach_the_gradient():
    """The gradient of CE + Dice is that of (CE + 1 - soft batch Dice with background) / 2, written by hand:
    a detached Dice half (an argmax, a .item()) would leave only the CE gradient."""
    torch.manual_seed(0)
    logits = torch.randn(2, 2, 4, 4, requires_grad=True)
    target = torch.randint(0, 2, (2, 4, 4))
    ce_dice_loss(logits, target).backward()
    ref = logits.detach().clone().requires_grad_()
    p, y, s = ref.softmax(1), F.one_hot(target, 2).movedim(-1, 1).float(), 1e-5
    dice = (2 * (p * y).sum((0, 2, 3)) + s) / (p.sum((0, 2, 3)) + y.sum((0, 2, 3)) + s)
    ((F.cross_entropy(ref, target) + 1 - dice.mean()) / 2).backward()
    torch.testing.assert_close(logits.grad, ref.grad, rtol=1e-5, atol=1e-7)
    ce_only = logits.detach().clone().requires_grad_()
    (F.cross_entropy(ce_only, target) / 2).backward()
    assert (ce_only.grad - ref.grad).abs().max() > 1e-3  # the Dice half is not negligible here


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="class indices in"):
        dice_loss(torch.randn(1, 2, 2, 2), torch.full((1, 2, 2), 2))
    with pytest.raises(ValueError, match="does not match"):
        dice_loss(torch.randn(1, 2, 2, 2), torch.zeros(1, 3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="K >= 2"):
        dice_loss(torch.randn(1, 1, 2, 2), torch.zeros(1, 2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="num_classes"):
        dice_score(PRED, TARGET)
    with pytest.raises(ValueError, match="background"):
        dice_score(PRED, TARGET, num_classes=2, background="both")
    with pytest.raises(TypeError, match="integer"):
        dice_loss(torch.randn(1, 2, 2, 2), torch.full((1, 2, 2), 0.5))


def test_soft_dice_is_the_written_formula_on_random_batches():
    # the loss goes through MONAI; this pins it to the formula of the module docstring, every option
    torch.manual_seed(0)
    logits, target = torch.randn(3, 3, 5, 4), torch.randint(0, 3, (3, 5, 4))
    p, y = logits.softmax(1), F.one_hot(target, 3).movedim(-1, 1).float()
    for batch_dice, dims in ((True, (0, 2, 3)), (False, (2, 3))):
        d = (2 * (p * y).sum(dims) + 1e-5) / (p.sum(dims) + y.sum(dims) + 1e-5)
        for background in (True, False):
            expected = 1 - (d if background else d[..., 1:]).mean()
            got = dice_loss(logits, target, include_background=background, batch_dice=batch_dice)
            assert got.item() == pytest.approx(expected.item(), rel=1e-6)


def test_hard_dice_of_a_class_predicted_but_absent_from_the_mask_is_zero():
    empty = torch.zeros(1, 2, 3, dtype=torch.long)
    torch.testing.assert_close(dice_per_class(PRED, empty, 2), torch.tensor([[2 * 4 / (4 + 6), 0.0]]))
    assert dice_score(PRED, empty, num_classes=2).item() == 0.0
