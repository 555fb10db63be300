"""Segmentation losses and the Dice metric of HarmoFL (nuclei: Dice loss; prostate: CE + Dice).

Models output logits ``N x K x H x W`` (K >= 2 classes, softmax over dim 1; HarmoFL's U-Net has
K = 2: background, foreground); targets are integer masks ``N x H x W`` (or ``N x 1 x H x W``) with
values in ``[0, K)``.

The paper names the losses and the metric but defines neither. Defaults follow the official code:

* soft Dice loss: softmax probabilities, per class ``(2 sum(p y) + s) / (sum p + sum y + s)`` summed
  over the *whole batch* (``batch_dice=True``), ``s = 1e-5``, loss = 1 - mean over classes
  *including background*. ``include_background=False`` / ``batch_dice=False`` give the other
  common forms (foreground classes only; one Dice per image, then the mean).
* CE + Dice: the paper says "cross-entropy and dice loss together"; the code takes their mean,
  ``(CE + Dice) / 2`` (default weights 0.5, 0.5); ``ce_weight=dice_weight=1`` is the plain sum.
* Dice metric (hard, on argmax predictions, per image and class): ``background="exclude"``
  (default) is the usual foreground-only Dice, which we take as the paper's "Dice coefficient";
  ``background="include"`` averages background and foreground Dice as the code's ``dice_coef``
  does, which inflates the score. :func:`harmofl_code_dice` reproduces that function exactly
  (``2 I / (|P| + |G| + 1e-5)``, so a class absent from both prediction and mask scores 0).

The standard forms come from MONAI (``monai.losses.DiceLoss`` with ``softmax=True``, ``smooth_nr =
smooth_dr = s``; ``monai.metrics.compute_dice`` with ``ignore_empty=False``), which computes exactly these
formulas; what is ours is the input checking and the official code's smoothed metric, which no library
reproduces (its ``+ 1e-5`` in the denominator). MONAI is imported on first use (it takes seconds to import),
so classification runs never load it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DICE_SMOOTH = 1e-5
BACKGROUND = ("exclude", "include")
REDUCTIONS = ("mean", "none")


def _check_target(target: torch.Tensor, n: int, spatial: tuple[int, ...], num_classes: int) -> torch.Tensor:
    if target.ndim == 4 and target.shape[1] == 1:
        target = target[:, 0]
    if target.ndim != 3:
        raise ValueError(f"segmentation targets must be N x H x W (or N x 1 x H x W) masks, got {tuple(target.shape)}")
    if target.is_floating_point() or target.is_complex():
        if not torch.equal(target, target.round()):
            raise TypeError("segmentation targets must hold integer class indices")
    target = target.long()
    if target.shape[0] != n or tuple(target.shape[1:]) != spatial:
        raise ValueError(f"target shape {tuple(target.shape)} does not match predictions N={n}, H x W={spatial}")
    if target.numel() and (target.min() < 0 or target.max() >= num_classes):
        raise ValueError(
            f"target values must be class indices in [0, {num_classes}), got [{int(target.min())}, {int(target.max())}]"
        )
    return target


def _check_logits(logits: torch.Tensor) -> None:
    if logits.ndim != 4 or not logits.is_floating_point():
        raise ValueError(f"expected float logits N x K x H x W, got {logits.dtype} {tuple(logits.shape)}")
    if logits.shape[1] < 2:
        raise ValueError(
            f"expected K >= 2 class channels (softmax over background/foreground), got {logits.shape[1]}; "
            "a single sigmoid channel is not supported"
        )


def one_hot_masks(target: torch.Tensor, num_classes: int, dtype=torch.float32) -> torch.Tensor:
    """N x H x W class indices -> N x K x H x W one-hot masks."""
    return F.one_hot(target.long(), num_classes).movedim(-1, 1).to(dtype)


def dice_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    include_background: bool = True,
    batch_dice: bool = True,
    smooth: float = DICE_SMOOTH,
) -> torch.Tensor:
    """Soft Dice loss on softmax probabilities; defaults are the official code's (see module docstring)."""
    from monai.losses import DiceLoss as MonaiDiceLoss

    _check_logits(logits)
    k = logits.shape[1]
    target = _check_target(target, logits.shape[0], tuple(logits.shape[2:]), k)
    # 1 - mean over (classes) or (images, classes) of (2 sum(p y) + s) / (sum p + sum y + s); softmax first,
    # then the background channel is dropped when excluded
    loss = MonaiDiceLoss(include_background=include_background, softmax=True, batch=batch_dice,
                         smooth_nr=smooth, smooth_dr=smooth)
    return loss(logits.float(), one_hot_masks(target, k))


def ce_dice_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ce_weight: float = 0.5,
    dice_weight: float = 0.5,
    **dice_options,
) -> torch.Tensor:
    """``ce_weight * CE + dice_weight * Dice``; the default ``(CE + Dice) / 2`` is the code's ``JointLoss``."""
    _check_logits(logits)
    target = _check_target(target, logits.shape[0], tuple(logits.shape[2:]), logits.shape[1])
    ce = F.cross_entropy(logits.float(), target)
    return ce_weight * ce + dice_weight * dice_loss(logits, target, **dice_options)


class DiceLoss(nn.Module):
    """Module form of :func:`dice_loss`."""

    def __init__(self, *, include_background: bool = True, batch_dice: bool = True, smooth: float = DICE_SMOOTH) -> None:
        super().__init__()
        self.options = dict(include_background=include_background, batch_dice=batch_dice, smooth=smooth)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return dice_loss(logits, target, **self.options)


class CEDiceLoss(nn.Module):
    """Module form of :func:`ce_dice_loss`."""

    def __init__(self, *, ce_weight: float = 0.5, dice_weight: float = 0.5, **dice_options) -> None:
        super().__init__()
        self.ce_weight, self.dice_weight, self.dice_options = ce_weight, dice_weight, dice_options

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ce_dice_loss(logits, target, ce_weight=self.ce_weight, dice_weight=self.dice_weight, **self.dice_options)


def dice_per_class(
    pred: torch.Tensor, target: torch.Tensor, num_classes: int, *, empty: float = 1.0, eps: float = 0.0
) -> torch.Tensor:
    """Hard Dice of every image and class, ``N x K``: ``2 |P & G| / (|P| + |G| + eps)``.

    ``pred`` and ``target`` are N x H x W class indices. A class absent from both the prediction and
    the mask scores ``empty`` (1.0: nothing to find, nothing found). ``eps = 0`` is the standard Dice
    (MONAI's ``compute_dice``); ``eps > 0`` is the official code's smoothed form, written out here.
    """
    p = one_hot_masks(pred, num_classes, torch.float64)
    g = one_hot_masks(target, num_classes, torch.float64)
    union = p.flatten(2).sum(-1) + g.flatten(2).sum(-1)
    if eps == 0:
        from monai.metrics import compute_dice

        dice = compute_dice(p, g, include_background=True, ignore_empty=False)  # empty in both -> 1
    else:
        inter = (p * g).flatten(2).sum(-1)
        dice = 2 * inter / (union + eps)
    return torch.where(union > 0, dice, torch.full_like(dice, empty)).float()


def dice_score(
    prediction: torch.Tensor,
    target: torch.Tensor,
    *,
    num_classes: int | None = None,
    background: str = "exclude",
    empty: float = 1.0,
    eps: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """Dice coefficient of hard predictions, per image.

    ``prediction``: logits N x K x H x W (argmax over K) or class indices N x H x W with
    ``num_classes``. ``background="exclude"`` scores the foreground classes 1..K-1 (for K = 2, the
    usual foreground Dice); ``"include"`` averages over all K classes (official code). ``reduction``
    ``"mean"``: one number, the mean over images of each image's class mean; ``"none"``: the N x K'
    table (sum it across batches to average over a whole test set exactly).
    """
    if background not in BACKGROUND:
        raise ValueError(f"background must be one of {', '.join(BACKGROUND)}, got {background!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    if prediction.ndim == 4 and prediction.is_floating_point():
        _check_logits(prediction)
        if num_classes is not None and num_classes != prediction.shape[1]:
            raise ValueError(f"num_classes={num_classes} but the logits have {prediction.shape[1]} channels")
        num_classes = prediction.shape[1]
        pred = prediction.argmax(dim=1)
    elif prediction.ndim == 3 and not prediction.is_floating_point():
        if num_classes is None or num_classes < 2:
            raise ValueError("class-index predictions need num_classes >= 2")
        pred = prediction.long()
        if pred.numel() and (pred.min() < 0 or pred.max() >= num_classes):
            raise ValueError(f"predicted classes must be in [0, {num_classes})")
    else:
        raise ValueError(
            f"prediction must be float logits N x K x H x W or integer classes N x H x W, got "
            f"{prediction.dtype} {tuple(prediction.shape)}"
        )
    target = _check_target(target, pred.shape[0], tuple(pred.shape[1:]), num_classes)
    dice = dice_per_class(pred, target, num_classes, empty=empty, eps=eps)
    if background == "exclude":
        dice = dice[:, 1:]
    return dice if reduction == "none" else dice.mean(dim=1).mean()


def harmofl_code_dice(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The official code's ``dice_coef``: background included, ``2 I / (|P| + |G| + 1e-5)`` (empty class -> 0)."""
    return dice_score(logits, target, background="include", empty=0.0, eps=DICE_SMOOTH)
