"""Tasks: losses and the Dice score against hand values; classification unchanged by going through a task."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from fednorm.data.domain import normalize_batch
from fednorm.methods import LocalTraining, train_locally
from fednorm.methods.tasks import CLASSIFICATION, Task, build_task, prepare_features

from ..conftest import make_split


def _logits_for(pred: torch.Tensor, k: int = 2) -> torch.Tensor:
    """Logits whose argmax is ``pred`` (N x H x W)."""
    return F.one_hot(pred, k).movedim(-1, 1).float() * 10


def _masks():
    """One 4 x 4 image: 4 foreground pixels in the mask, 4 predicted, 2 of them right."""
    target = torch.zeros(1, 4, 4, dtype=torch.uint8)
    target[0, 0, :] = 1  # first row
    pred = torch.zeros(1, 4, 4, dtype=torch.long)
    pred[0, 0, :2] = 1
    pred[0, 1, :2] = 1
    return pred, target


def test_dice_score_by_hand_with_each_background_rule():
    pred, target = _masks()
    logits = _logits_for(pred)
    # foreground: |P| = 4, |G| = 4, |P & G| = 2 -> 0.5; background: 12, 12, 10 -> 20 / 24
    fg, bg = 0.5, 20 / 24
    score = {b: Task("segmentation", "dice", b).per_image_dice(logits, target.long()) for b in ("exclude", "include", "code")}
    torch.testing.assert_close(score["exclude"], torch.tensor([fg]))
    torch.testing.assert_close(score["include"], torch.tensor([(fg + bg) / 2]))
    code = (2 * 2 / (8 + 1e-5) + 2 * 10 / (24 + 1e-5)) / 2
    torch.testing.assert_close(score["code"], torch.tensor([code]))


def test_empty_foreground_scores_one_foreground_only_and_zero_for_the_code():
    target = torch.zeros(2, 4, 4, dtype=torch.long)
    logits = _logits_for(torch.zeros(2, 4, 4, dtype=torch.long))
    assert Task("segmentation", "dice").per_image_dice(logits, target).tolist() == [1.0, 1.0]
    code = Task("segmentation", "dice", "code").per_image_dice(logits, target)
    torch.testing.assert_close(code, torch.full((2,), (2 * 16 / (32 + 1e-5) + 0.0) / 2))


def test_segmentation_losses_by_hand():
    _, target = _masks()
    logits = torch.zeros(1, 2, 4, 4)  # p = 0.5 everywhere
    # soft Dice over the batch, both classes, smooth 1e-5: fg (2*2 + s)/(8 + 4 + s), bg (2*6 + s)/(8 + 12 + s)
    s = 1e-5
    dice = 1 - ((4 + s) / (12 + s) + (12 + s) / (20 + s)) / 2
    ce = math.log(2)
    for name, value in (("ce", ce), ("dice", dice), ("ce_dice", (ce + dice) / 2)):
        loss = Task("segmentation", name).loss(logits, target.long())
        assert loss.item() == pytest.approx(value, rel=1e-6), name


def test_masks_become_int64_per_batch_and_evaluation_sums():
    pred, target = _masks()
    task = Task("segmentation", "ce_dice")
    y = task.target(target)
    assert y.dtype == torch.int64 and target.dtype == torch.uint8
    score, loss = task.evaluation_sums(_logits_for(pred).repeat(3, 1, 1, 1), y.repeat(3, 1, 1))
    assert score == pytest.approx(1.5) and loss == pytest.approx(3 * float(task.loss(_logits_for(pred), y)))
    assert task.metric == "dice" and CLASSIFICATION.metric == "accuracy"


def test_classification_sums_are_the_engines_old_formula():
    g = torch.Generator().manual_seed(0)
    logits, y = torch.randn(7, 10, generator=g), torch.randint(0, 10, (7,), generator=g)
    correct, loss = CLASSIFICATION.evaluation_sums(logits, y)
    assert correct == int((logits.argmax(1) == y).sum()) and isinstance(correct, int)
    assert loss == float(F.cross_entropy(logits, y, reduction="sum"))
    assert CLASSIFICATION.target(y) is y
    assert torch.equal(CLASSIFICATION.loss(logits, y), F.cross_entropy(logits.float(), y))


def test_classification_training_is_bit_identical_to_plain_cross_entropy():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 28 * 28, 10))
    ref = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 28 * 28, 10))
    ref.load_state_dict(model.state_dict())
    data = make_split(16, seed=1)
    cfg = LocalTraining(steps=2, batch_size=8, lr=0.1, momentum=0.9)
    assert cfg.task == CLASSIFICATION
    train_locally(model, data, cfg, generator=torch.Generator().manual_seed(0), prepare=normalize_batch)
    # by hand: the same batches, torch.optim.SGD on F.cross_entropy
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    stream = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    for index in torch.split(stream, 8):
        opt.zero_grad()
        F.cross_entropy(ref(normalize_batch(data.x[index])).float(), data.y[index]).backward()
        opt.step()
    for a, b in zip(model.state_dict().values(), ref.state_dict().values()):
        assert torch.equal(a, b)


def test_build_task_and_errors():
    assert build_task() == CLASSIFICATION
    assert build_task("segmentation", benchmark="nuclei").loss_name == "dice"
    assert build_task("segmentation", benchmark="prostate").loss_name == "ce_dice"
    assert build_task("segmentation", "ce").loss_name == "ce"
    with pytest.raises(ValueError, match="segmentation loss"):
        build_task("classification", "dice")
    with pytest.raises(ValueError, match="unknown loss"):
        Task("segmentation", "tversky")
    with pytest.raises(ValueError, match="'focal' is a classification loss"):
        Task("segmentation", "focal")
    with pytest.raises(ValueError, match="dice_background"):
        Task("segmentation", "dice", "both")
    with pytest.raises(ValueError, match="N x D"):
        prepare_features(torch.zeros(2, 3, 4, 4))
    x = torch.randn(3, 5)
    assert torch.equal(prepare_features(x), x)  # no /255, no standardization


def test_focal_loss_by_hand_and_flambys_isic_weights():
    """FedWon Table 11 trains Fed-ISIC2019 with FLamby's weighted focal loss: -alpha_y (1 - p_y)^2 log p_y, averaged."""
    from fednorm.methods.tasks import FLAMBY_ISIC_FOCAL_ALPHA, focal_loss

    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 3.0]])
    y = torch.tensor([0, 1])
    p = torch.softmax(logits, 1)
    p0, p1 = float(p[0, 0]), float(p[1, 1])
    by_hand = [-(1 - p0) ** 2 * math.log(p0), -(1 - p1) ** 2 * math.log(p1)]
    assert float(focal_loss(logits, y)) == pytest.approx(sum(by_hand) / 2, rel=1e-6)
    alpha = (2.0, 5.0, 1.0)
    weighted = focal_loss(logits, y, alpha, reduction="sum")
    assert float(weighted) == pytest.approx(2.0 * by_hand[0] + 5.0 * by_hand[1], rel=1e-6)
    assert torch.allclose(focal_loss(logits, y, gamma=0.0), F.cross_entropy(logits, y))  # gamma 0: cross-entropy
    with pytest.raises(ValueError, match="2 class weights for 3 classes"):
        focal_loss(logits, y, (1.0, 2.0))
    # FLamby's weights on Fed-ISIC2019, none elsewhere; the task's training and evaluation losses are the focal loss
    isic = build_task("classification", "focal", benchmark="fed_isic2019")
    assert isic.focal_alpha == FLAMBY_ISIC_FOCAL_ALPHA == (5.5813, 2.0472, 7.0204, 26.1194, 9.5369, 101.0707,
                                                           92.5224, 38.3443)
    plain = build_task("classification", "focal", benchmark="pacs")
    assert plain.focal_alpha is None and float(plain.loss(logits, y)) == pytest.approx(sum(by_hand) / 2, rel=1e-6)
    correct, total = plain.evaluation_sums(logits, y)
    assert correct == 1 and total == pytest.approx(sum(by_hand), rel=1e-6)
    with pytest.raises(ValueError, match="classification loss"):
        build_task("segmentation", "focal")


def test_the_isic_preset_trains_with_flambys_weighted_focal_loss():
    """fedwon_isic2019 (FedWon Table 11): the loss local training receives is FLamby's weighted focal loss."""
    from fednorm.methods.tasks import FLAMBY_ISIC_FOCAL_ALPHA
    from fednorm.runs.config import load_config

    cfg = load_config("fedwon_isic2019")
    training = cfg.training.build(cfg.task())
    assert training.task.loss_name == "focal" and training.task.focal_alpha == FLAMBY_ISIC_FOCAL_ALPHA
    with pytest.raises(Exception, match="segmentation"):
        load_config("harmofl_prostate", ["training.loss=focal"])


def _class_logits(predictions: list[int], classes: int) -> torch.Tensor:
    return F.one_hot(torch.tensor(predictions), classes).float() * 5.0


def test_balanced_accuracy_is_the_mean_recall_of_the_classes_present_whatever_the_batches():
    """FLamby's Fed-ISIC2019 score (sklearn's balanced_accuracy_score): class 0 has 3 of 4 right, class 1 1 of 2,
    class 2 0 of 1, so (3/4 + 1/2 + 0) / 3; class 3 is predicted but absent from the labels, so it is left out."""
    from fednorm.methods.tasks import Scorer

    y = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    predicted = [0, 0, 0, 3, 1, 0, 1]
    logits = _class_logits(predicted, 4)
    task = build_task("classification", metric="balanced_accuracy")
    assert task.metric == "balanced_accuracy"
    by_hand = (3 / 4 + 1 / 2 + 0) / 3
    from sklearn.metrics import balanced_accuracy_score  # FLamby's metric.py calls exactly this

    with pytest.warns(UserWarning, match="not in y_true"):  # class 3: predicted, absent, left out by sklearn too
        assert balanced_accuracy_score(y.numpy(), predicted) == pytest.approx(by_hand)
    for cuts in ([7], [3, 4], [1, 1, 5], [2, 2, 2, 1]):
        scorer = Scorer(task)
        start = 0
        for size in cuts:
            scorer.add(logits[start:start + size], y[start:start + size])
            start += size
        score, loss = scorer.result()
        assert score == pytest.approx(by_hand, abs=1e-12)
        assert loss == pytest.approx(float(F.cross_entropy(logits, y)), rel=1e-6)  # the task's loss, per sample
    plain = Scorer(build_task("classification"))  # accuracy: 4 of 7
    plain.add(logits, y)
    assert plain.result()[0] == pytest.approx(4 / 7)
    assert Scorer(task).result() == (0.0, 0.0)  # an empty split


def test_the_metric_option_and_its_errors():
    assert build_task("classification", metric="auto").metric == "accuracy"
    assert build_task("segmentation", benchmark="prostate", metric="auto").metric == "dice"
    assert build_task("segmentation", benchmark="prostate", metric="dice").metric == "dice"
    with pytest.raises(ValueError, match="scores class labels, but the domains are a segmentation"):
        build_task("segmentation", metric="balanced_accuracy")
    with pytest.raises(ValueError, match="'dice' scores masks"):
        build_task("classification", metric="dice")
    with pytest.raises(ValueError, match="unknown classification metric"):
        Task(classification_metric="f1")


def test_the_isic_preset_scores_balanced_accuracy_and_the_engine_reports_it(tiny_clients):
    """fedwon_isic2019 scores FLamby's balanced accuracy; an engine with that task reports it for internal clients
    (evaluate_split) and external ones (every mode), named so in the evaluations."""
    from fednorm.engines.simulation import Federation, InProcessEngine
    from fednorm.methods import resolve_method
    from fednorm.methods.external import evaluate_external
    from fednorm.models import DigitCNN
    from fednorm.runs.config import load_config

    assert load_config("fedwon_isic2019").task().metric == "balanced_accuracy"
    assert load_config("fedwon_isic2019", ["training.metric=accuracy"]).task().metric == "accuracy"
    task = build_task("classification", metric="balanced_accuracy")
    torch.manual_seed(0)
    eng = InProcessEngine(DigitCNN(width=0.125), tiny_clients[:2], resolve_method("fedavg"),
                          LocalTraining(batch_size=8, lr=0.05, task=task),
                          Federation(seed=0, channels_last=False, eval_batch_size=3), normalize_batch)
    eng.external_clients, eng.external_modes = [tiny_clients[2]], ("global", "test_time_bn")
    eng.run_round()
    evaluations = eng.evaluate(("test",))
    assert {e.metric for e in evaluations} == {"balanced_accuracy"}
    assert all(e.class_counts is not None for e in evaluations)  # internal and external: Flower combines by them
    from sklearn.metrics import balanced_accuracy_score

    eng.model.load_state_dict(eng.global_state)
    eng.model.eval()
    plain_differs = False
    for client in tiny_clients[:3]:  # two internal clients and the external one
        with torch.no_grad():
            predicted = eng.model(normalize_batch(client.test.x)).argmax(1).numpy()
        labels = client.test.y.numpy()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # sklearn: a predicted class absent from the labels
            by_sklearn = balanced_accuracy_score(labels, predicted)
        name = client.name if client is not tiny_clients[2] else f"{client.name}:global"
        score = next(e.accuracy for e in evaluations if e.client == name)
        assert score == pytest.approx(by_sklearn, abs=1e-9)  # batches of 3, scored as one split
        plain_differs |= abs(by_sklearn - (predicted == labels).mean()) > 1e-6
    assert plain_differs  # the data tell balanced from plain accuracy apart
    external = tiny_clients[2]
    scored = evaluate_external(eng.model, external.test, normalize_batch, "global", task=task)
    reported = next(e.accuracy for e in evaluations if e.client == f"{external.name}:global")
    assert scored.accuracy == pytest.approx(reported)  # the engine's external path is evaluate_external's
