"""Tasks: what a model is trained to predict, its loss and its evaluation score.

A :class:`Task` is the one place the training loop and the evaluator ask "which loss?" and "which
score?", so the rest of fednorm does not care whether a batch holds class labels or masks:

* ``classification`` (images or feature vectors): cross-entropy, accuracy. The loss is exactly the
  ``F.cross_entropy(logits.float(), y)`` the loop always used, so classification numbers do not
  change by going through a task. The score is accuracy, or ``balanced_accuracy`` (the mean over the
  classes present in a split of each class's recall, sklearn's ``balanced_accuracy_score``: FLamby's
  Fed-ISIC2019 metric, where one class holds half the images). ``focal`` is the weighted focal loss of
  FLamby's Fed-ISIC2019 baseline (FedWon Table 11): ``mean(-alpha_y (1 - p_y)^2 log p_y)``, with FLamby's
  class weights ``alpha`` on Fed-ISIC2019 and no weights elsewhere; its evaluation loss is the same focal loss.
* ``segmentation`` (HarmoFL's nuclei and prostate tasks): logits ``N x K x H x W`` against integer
  masks ``N x H x W``. Masks are stored as uint8 (:class:`~fednorm.data.medical.SegmentationSplit`)
  and converted to int64 one batch at a time (:meth:`Task.target`). Losses (HarmoFL names them but
  does not define them; :mod:`fednorm.methods.segmentation` follows the official code):

  - ``ce``: pixel-wise cross-entropy;
  - ``dice``: soft Dice loss, batch Dice over all classes including background (the code's
    ``DiceLoss``; the paper's nuclei loss);
  - ``ce_dice``: ``(CE + Dice) / 2`` (the code's ``JointLoss``; the paper's prostate loss).

  The score is the hard Dice of every image (argmax prediction), averaged over the images of a split.
  ``dice_background`` chooses the classes it averages: ``exclude`` (default) scores the foreground
  only, the usual reading of the paper's "Dice coefficient" (the paper does not say); ``include``
  averages background and foreground; ``code`` is the official ``dice_coef`` on each batch (background
  included, ``2I / (|P| + |G| + 1e-5)``, a class absent from both prediction and mask scores 0). A split's
  score is the mean over its images; the official test loop averages the batch means instead
  (``test_acc / len(loader)``), which differs only when a last, smaller batch is left (set
  ``federation.eval_batch_size`` to a divisor of the split sizes, or 1, to match it exactly).

Which task a run uses: the domains say it (``DomainSpec.task``: the prostate and nuclei sites are
segmentation, everything else classification) and ``training.loss`` picks the loss (``auto``: ``ce``
for classification, the paper's loss of the dataset for segmentation), see :func:`build_task`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .segmentation import DICE_SMOOTH, ce_dice_loss, dice_loss, dice_score

TASK_KINDS = ("classification", "segmentation")
LOSSES = ("ce", "dice", "ce_dice", "focal")
CLASSIFICATION_LOSSES = ("ce", "focal")
CLASSIFICATION_METRICS = ("accuracy", "balanced_accuracy")
METRICS = ("auto", *CLASSIFICATION_METRICS, "dice")  # training.metric


def metric_label(metric: str) -> str:
    """A score's name as tables and plots print it."""
    return {"dice": "Dice", "balanced_accuracy": "balanced accuracy"}.get(metric, metric)

# FLamby fed_isic2019 BaselineLoss (the weighted focal loss FedWon Table 11 trains with): class weights of the 8
# classes in FLamby's label order (MEL, NV, BCC, AK, BKL, DF, VASC, SCC) and gamma 2
FLAMBY_ISIC_FOCAL_ALPHA = (5.5813, 2.0472, 7.0204, 26.1194, 9.5369, 101.0707, 92.5224, 38.3443)
FOCAL_GAMMA = 2.0
DICE_BACKGROUND = ("exclude", "include", "code")
# HarmoFL Sec. 4: nuclei "segmentation Dice loss"; prostate "cross-entropy and dice loss together"
PAPER_SEGMENTATION_LOSS = {"nuclei": "dice", "prostate": "ce_dice"}
DEFAULT_SEGMENTATION_LOSS = "ce_dice"


@dataclass(frozen=True)
class Task:
    """A task's loss and evaluation score; immutable, so it can sit in :class:`LocalTraining`."""

    kind: str = "classification"
    loss_name: str = "ce"
    dice_background: str = "exclude"
    focal_alpha: tuple[float, ...] | None = None  # focal loss: per-class weights (None: unweighted)
    classification_metric: str = "accuracy"  # accuracy or balanced_accuracy (segmentation always scores Dice)

    def __post_init__(self) -> None:
        if self.kind not in TASK_KINDS:
            raise ValueError(f"unknown task {self.kind!r}; choose one of {', '.join(TASK_KINDS)}")
        if self.loss_name not in LOSSES:
            raise ValueError(f"unknown loss {self.loss_name!r}; choose one of {', '.join(LOSSES)}")
        if self.kind == "classification" and self.loss_name not in CLASSIFICATION_LOSSES:
            raise ValueError(f"loss {self.loss_name!r} is a segmentation loss; classification trains with 'ce' or "
                             "'focal'")
        if self.kind == "segmentation" and self.loss_name in ("focal",):
            raise ValueError("loss 'focal' is a classification loss; segmentation trains with ce, dice or ce_dice")
        if self.focal_alpha is not None and self.loss_name != "focal":
            raise ValueError(f"focal_alpha weighs the focal loss, not {self.loss_name!r}")
        if self.classification_metric not in CLASSIFICATION_METRICS:
            raise ValueError(f"unknown classification metric {self.classification_metric!r}; choose one of "
                             f"{', '.join(CLASSIFICATION_METRICS)}")
        if self.kind == "segmentation" and self.classification_metric != "accuracy":
            raise ValueError(f"{self.classification_metric} scores class labels; segmentation is scored by Dice")
        if self.dice_background not in DICE_BACKGROUND:
            raise ValueError(f"dice_background must be one of {', '.join(DICE_BACKGROUND)}, got {self.dice_background!r}")

    @property
    def metric(self) -> str:
        """Name of the main score (what the ``acc`` field of an evaluation holds)."""
        return self.classification_metric if self.kind == "classification" else "dice"

    def scorer(self) -> "Scorer":
        """A fresh accumulator of this task's score and loss over the batches of one split."""
        return Scorer(self)

    def target(self, y: torch.Tensor) -> torch.Tensor:
        """A batch's labels as the loss wants them: class labels unchanged, uint8 masks as int64."""
        return y if self.kind == "classification" else y.long()

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The batch's mean loss (computed in float32, as the loop always did under bf16 autocast)."""
        if self.loss_name == "focal":
            return focal_loss(logits, y, self.focal_alpha)
        if self.kind == "classification":
            return F.cross_entropy(logits.float(), y)
        if self.loss_name == "ce":
            return F.cross_entropy(logits.float(), y.long())
        if self.loss_name == "dice":
            return dice_loss(logits, y)
        return ce_dice_loss(logits, y)

    def evaluation_sums(self, logits: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        """(score summed over the batch's samples, loss summed over them); divide both by the split size.

        Classification: correct predictions and the summed cross-entropy. Segmentation: the sum of the
        per-image Dice and the batch's mean loss times its size (Dice losses are batch quantities, so
        the evaluation loss depends on the evaluation batch size, as the official code's does).
        """
        if self.loss_name == "focal":
            return int((logits.argmax(1) == y).sum()), float(focal_loss(logits, y, self.focal_alpha, reduction="sum"))
        if self.kind == "classification":
            return int((logits.argmax(1) == y).sum()), float(F.cross_entropy(logits, y, reduction="sum"))
        return float(self.per_image_dice(logits, y).sum()), float(self.loss(logits, y)) * len(y)

    def per_image_dice(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Hard Dice of each image (``N``), averaged over the classes ``dice_background`` selects. A split's score
        is the mean over its images; the official HarmoFL ``test()`` averages per-batch means
        (``test_acc / len(loader)``), which weighs a partial last batch's images more: the two agree when the
        split size is a multiple of the evaluation batch size."""
        if self.dice_background == "code":
            table = dice_score(logits, y, background="include", empty=0.0, eps=DICE_SMOOTH, reduction="none")
        else:
            table = dice_score(logits, y, background=self.dice_background, reduction="none")
        return table.mean(dim=1)


CLASSIFICATION = Task()


class Scorer:
    """A split's main score and mean loss, accumulated batch by batch (:meth:`Task.scorer`).

    Accuracy and Dice are means over samples (sums divided by the split size at the end, so the batch size
    does not matter); balanced accuracy is not, so it keeps each class's hits and support and averages the
    recalls of the classes present in the split (absent classes are left out, as sklearn does) at the end.
    """

    def __init__(self, task: Task) -> None:
        self.task = task
        self.score_sum, self.loss_sum, self.count = 0.0, 0.0, 0
        self.hits: torch.Tensor | None = None  # per class (balanced accuracy only)
        self.support: torch.Tensor | None = None

    def add(self, logits: torch.Tensor, y: torch.Tensor) -> None:
        """One batch: ``logits`` of the model and the task's targets ``y`` (:meth:`Task.target`)."""
        logits = logits.float()
        score, loss = self.task.evaluation_sums(logits, y)
        self.score_sum, self.loss_sum, self.count = self.score_sum + score, self.loss_sum + loss, self.count + len(y)
        if self.task.metric == "balanced_accuracy":
            k = logits.shape[1]
            y_cpu = y.detach().to("cpu", torch.int64)
            hit = (logits.argmax(1).to("cpu") == y_cpu)
            support = torch.bincount(y_cpu, minlength=k)
            hits = torch.bincount(y_cpu[hit], minlength=k)
            if self.support is None:
                self.hits, self.support = hits, support
            elif len(support) != len(self.support):
                raise ValueError(f"a batch has {len(support)} classes after batches with {len(self.support)}: the "
                                 "model's output width changed within a split")
            else:
                self.hits, self.support = self.hits + hits, self.support + support

    def class_counts(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """(hits, support) per class under balanced accuracy (what a piece of a split must report for the pieces
        to be combined exactly), else None."""
        if self.task.metric != "balanced_accuracy" or self.support is None:
            return None
        return tuple(int(v) for v in self.hits), tuple(int(v) for v in self.support)

    def result(self) -> tuple[float, float]:
        """(score, mean loss) over the samples added; (0, 0) for an empty split."""
        n = max(self.count, 1)
        if self.task.metric == "balanced_accuracy":
            counts = self.class_counts()
            return (0.0, 0.0) if counts is None else (balanced_accuracy(*counts), self.loss_sum / n)
        return self.score_sum / n, self.loss_sum / n


def balanced_accuracy(hits: tuple[int, ...], support: tuple[int, ...]) -> float:
    """The mean recall ``hits / support`` over the classes with support (sklearn's ``balanced_accuracy_score``)."""
    recalls = [h / s for h, s in zip(hits, support) if s > 0]
    return sum(recalls) / len(recalls) if recalls else 0.0


def focal_loss(logits: torch.Tensor, y: torch.Tensor, alpha: tuple[float, ...] | None = None,
               gamma: float = FOCAL_GAMMA, reduction: str = "mean") -> torch.Tensor:
    """Focal loss (Lin et al. 2017) of class logits ``N x K``: ``-alpha_y (1 - p_y)^gamma log p_y`` per sample, as
    FLamby's BaselineLoss (``alpha`` None: 1 for every class; gamma 0 and no alpha: cross-entropy), in float32."""
    logp = F.log_softmax(logits.float(), dim=1).gather(1, y.view(-1, 1)).view(-1)
    weight = (1.0 - logp.exp()).pow(gamma)
    if alpha is not None:
        if len(alpha) != logits.shape[1]:
            raise ValueError(f"the focal loss has {len(alpha)} class weights for {logits.shape[1]} classes")
        weight = weight * torch.tensor(alpha, dtype=weight.dtype, device=weight.device)[y]
    loss = -weight * logp
    return loss.mean() if reduction == "mean" else loss.sum()


def build_task(kind: str = "classification", loss: str = "auto", dice_background: str = "exclude",
               benchmark: str | None = None, metric: str = "auto") -> Task:
    """The task of a run: ``kind`` from its domains, ``loss`` from ``training.loss``, the score from
    ``training.metric`` (``auto``: accuracy for classification, Dice for segmentation).

    ``loss="auto"``: ``ce`` for classification; for segmentation the paper's loss of ``benchmark``
    (:data:`PAPER_SEGMENTATION_LOSS`), else CE + Dice.
    """
    if loss == "auto":
        loss = "ce" if kind == "classification" else PAPER_SEGMENTATION_LOSS.get(benchmark or "",
                                                                                DEFAULT_SEGMENTATION_LOSS)
    if kind == "classification" and loss not in CLASSIFICATION_LOSSES:
        raise ValueError(f"training.loss {loss!r} is a segmentation loss, but the domains are a classification "
                         "task (loss: ce, focal or auto)")
    if kind == "segmentation" and loss == "focal":
        raise ValueError("training.loss 'focal' is a classification loss, but the domains are a segmentation task "
                         "(loss: ce, dice, ce_dice or auto)")
    if kind == "segmentation" and metric not in ("auto", "dice"):
        raise ValueError(f"training.metric {metric!r} scores class labels, but the domains are a segmentation task "
                         "(metric: auto or dice)")
    if kind == "classification" and metric == "dice":
        raise ValueError("training.metric 'dice' scores masks, but the domains are a classification task (metric: "
                         f"auto, {' or '.join(CLASSIFICATION_METRICS)})")
    # FLamby's class weights on Fed-ISIC2019 (their order is its label order); an unweighted focal loss elsewhere
    alpha = FLAMBY_ISIC_FOCAL_ALPHA if loss == "focal" and benchmark == "fed_isic2019" else None
    return Task(kind, loss, dice_background, alpha, "accuracy" if metric in ("auto", "dice") else metric)


def prepare_features(x: torch.Tensor) -> torch.Tensor:
    """The ``prepare`` step of feature-vector domains (ABIDE): float32 as stored, no /255 and no
    per-channel standardization (features are standardized per site when the clients are built)."""
    if x.ndim != 2:
        raise ValueError(f"feature batches must be N x D, got shape {tuple(x.shape)}")
    return x.float()
