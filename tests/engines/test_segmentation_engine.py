"""Segmentation through the in-process engine: a tiny U-Net federation on synthetic masks trains, reports Dice;
FedBN keeps every BatchNorm entry on its client; HarmoFL (amplitude normalization, weight perturbation) runs."""

import pytest
import torch

from fednorm.data.domain import ClientData, normalize_batch
from fednorm.data.medical import SegmentationSplit
from fednorm.engines.simulation import Federation, InProcessEngine
from fednorm.methods import LocalTraining, resolve_method
from fednorm.methods.tasks import Task
from fednorm.models.unet import UNet

from ..conftest import assert_control_variate_is_the_gradient_at, record_client_messages, record_client_replies

SIDE = 16


def synthetic_segmentation(n: int, seed: int, shift: float = 0.0) -> SegmentationSplit:
    """Noise images with one bright rectangle, its mask the foreground; ``shift`` brightens the whole client."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, SIDE, SIDE, generator=g) * 60 + shift
    y = torch.zeros(n, SIDE, SIDE, dtype=torch.uint8)
    for i in range(n):
        top, left = (int(v) for v in torch.randint(0, SIDE // 2, (2,), generator=g))
        h, w = (int(v) for v in torch.randint(3, SIDE // 2, (2,), generator=g))
        y[i, top:top + h, left:left + w] = 1
        x[i, :, top:top + h, left:left + w] += 120
    return SegmentationSplit(x.clamp(0, 255).to(torch.uint8), y)


def clients(k: int = 3) -> list[ClientData]:
    return [ClientData(f"site{i}", f"site{i}", synthetic_segmentation(8, i, 30.0 * i),
                       synthetic_segmentation(4, 100 + i, 30.0 * i), val=synthetic_segmentation(2, 200 + i, 30.0 * i))
            for i in range(k)]


def engine(method: str, task: Task, federation_clients=None) -> InProcessEngine:
    torch.manual_seed(0)
    training = LocalTraining(batch_size=4, lr=0.05, momentum=0.9, task=task)
    return InProcessEngine(UNet(width=0.125), federation_clients or clients(), resolve_method(method), training,
                           Federation(seed=0, channels_last=False, eval_batch_size=3), normalize_batch)


def test_unet_federation_trains_and_reports_dice():
    eng = engine("fedavg", Task("segmentation", "ce_dice"))
    results = [eng.run_round() for _ in range(3)]
    assert all(set(r) == {"site0", "site1", "site2"} for r in results)
    assert all(torch.isfinite(torch.tensor(res.mean_loss)) for r in results for res in r.values())
    evals = eng.evaluate()
    assert {(e.client, e.split) for e in evals} == {(f"site{i}", s) for i in range(3) for s in ("test", "val")}
    assert all(e.metric == "dice" and 0.0 <= e.accuracy <= 1.0 for e in evals)
    # the score is the mean per-image foreground Dice of the global model, whatever the evaluation batch size
    c = eng.clients[1]
    eng.load_client(c.name)
    eng.model.eval()
    with torch.no_grad():
        logits = eng.model(normalize_batch(c.test.x)).float()
    by_hand = eng.training.task.per_image_dice(logits, c.test.y.long()).mean().item()
    got = next(e.accuracy for e in evals if e.client == c.name and e.split == "test")
    assert abs(got - by_hand) < 1e-5


def test_dice_loss_training_steps_on_the_dice_gradient():
    """loss: dice trains on soft Dice (background included, batch Dice: the nuclei preset's loss), not on CE:
    one site, one full batch, plain SGD, so the round is exactly theta - lr * grad Dice(theta)."""
    import copy

    from fednorm.methods.segmentation import dice_loss

    site = clients(1)
    torch.manual_seed(0)
    eng = InProcessEngine(UNet(width=0.125), site, resolve_method("fedavg"),
                          LocalTraining(batch_size=8, lr=0.05, task=Task("segmentation", "dice")),
                          Federation(seed=0, channels_last=False), normalize_batch)
    start = {k: v.clone() for k, v in eng.global_state.items()}
    eng.run_round()
    ref = copy.deepcopy(eng.model)
    ref.load_state_dict(start)
    ref.train()
    data = site[0].train
    params = dict(ref.named_parameters())
    grads = torch.autograd.grad(dice_loss(ref(normalize_batch(data.x)), data.y.long()), list(params.values()))
    for (name, p), g in zip(params.items(), grads):
        torch.testing.assert_close(eng.global_state[name], p.detach() - 0.05 * g, rtol=1e-4, atol=1e-6, msg=name)
    assert all(e.metric == "dice" for e in eng.evaluate(("test",)))


def test_fedbn_keeps_batchnorm_local_on_the_unet():
    eng = engine("fedbn", Task("segmentation", "ce_dice"))
    bn_keys = {k for k in eng.global_state if ".norm" in k}
    assert bn_keys and eng.local_keys == frozenset(bn_keys)  # weight, bias, running stats, counter of every BN
    init = {k: eng.global_state[k].clone() for k in bn_keys}
    eng.run_round()
    replies = record_client_replies(eng)
    eng.run_round()
    # no BN entry leaves a client; every other entry is the plain mean of the three replies (8 images each)
    assert len(replies) == 3 and not any(k in bn_keys for r in replies for k in r)
    shared = set(eng.global_state) - bn_keys
    assert all(set(r) == shared for r in replies)
    for k in shared:
        torch.testing.assert_close(eng.global_state[k].float(), torch.stack([r[k].float() for r in replies]).mean(0),
                                   msg=k)
    # the server never touched the BN entries; each client has its own, and they differ across clients
    assert all(torch.equal(eng.global_state[k], init[k]) for k in bn_keys)
    stats = [eng.local_states[f"site{i}"]["encoders.0.norm1.running_mean"] for i in range(3)]
    assert not torch.allclose(stats[0], stats[2])
    weights = [eng.local_states[f"site{i}"]["encoders.0.norm1.weight"] for i in range(3)]
    assert not torch.equal(weights[0], weights[1])
    # shared convolutions are the global ones for every client
    for name in ("site0", "site2"):
        eng.load_client(name)
        assert torch.equal(eng.model.state_dict()["encoders.0.conv1.weight"], eng.global_state["encoders.0.conv1.weight"])
        assert torch.equal(eng.model.state_dict()["encoders.0.norm1.running_mean"],
                           eng.local_states[name]["encoders.0.norm1.running_mean"])
    assert all(e.metric == "dice" for e in eng.evaluate(("test",)))


def test_harmofl_runs_on_segmentation():
    eng = engine("harmofl", Task("segmentation", "ce_dice", "code"))
    messages = record_client_messages(eng)
    before = {k: v.clone() for k, v in eng.global_state.items()}
    eng.run_round()
    # the sites trained (weight-perturbed steps): every weight of the U-Net moved in the round
    weights = [k for k, _ in eng.model.named_parameters()]
    assert weights and all(not torch.equal(eng.global_state[k], before[k]) for k in weights)
    # the global amplitude is the uniform mean of the three sites' round-1 amplitudes (Alg. 1 line 17)
    client_amps = [m["amp.client"] for m in messages]
    assert len(client_amps) == 3
    torch.testing.assert_close(eng.input_state["amp.global"], torch.stack(client_amps).mean(0))
    assert eng.input_state["amp.global"].shape == (3, SIDE, SIDE)
    eng.run_round()
    evals = eng.evaluate(("test",))
    assert len(evals) == 3
    # each site's Dice (the code's: background included) and loss are those of its model on amplitude-normalized
    # images (evaluation batches of 3: the CE + Dice loss is a batch quantity), not on the raw images
    prepare = eng.runner.evaluation_prepare(eng.input_state)
    task = eng.training.task
    for c in eng.clients:
        eng.load_client(c.name)
        eng.model.eval()
        y = c.test.y.long()
        with torch.no_grad():
            logits = eng.model(prepare(c.test.x)).float()
            raw = eng.model(normalize_batch(c.test.x)).float()
        dice = task.per_image_dice(logits, y).mean().item()
        loss = (3 * float(task.loss(logits[:3], y[:3])) + float(task.loss(logits[3:], y[3:]))) / 4
        raw_loss = (3 * float(task.loss(raw[:3], y[:3])) + float(task.loss(raw[3:], y[3:]))) / 4
        got = next(e for e in evals if e.client == c.name)
        assert abs(got.accuracy - dice) < 1e-6 and abs(got.loss - loss) < 1e-6
        # amplitude-normalized inputs give other outputs than raw ones (the loss alone barely moves: after two
        # rounds the tiny U-Net's output depends little on x)
        assert (logits - raw).abs().max() > 1e-3 and got.loss != raw_loss


def test_local_bn_policies_refuse_batch_statistics_bn_that_holds_no_state():
    """HarmoFL's code BN (model.bn_mode: batch) has no affine and no running statistics: FedBN, SiloBN and FixBN
    would have nothing to keep local or freeze and would silently run as FedAvg, so the engine refuses them."""
    training = LocalTraining(batch_size=4, lr=0.05, task=Task("segmentation", "ce_dice"))
    for method in ("fedbn", "silobn", "fixbn"):
        with pytest.raises(ValueError, match="bn_mode"):
            InProcessEngine(UNet(width=0.125, bn_mode="batch"), clients(), resolve_method(method), training,
                            Federation(seed=0, channels_last=False), normalize_batch)
    InProcessEngine(UNet(width=0.125, bn_mode="batch"), clients(), resolve_method("fedavg"), training,
                    Federation(seed=0, channels_last=False), normalize_batch)  # nothing to keep: FedAvg is fine


def test_scaffold_option_one_on_segmentation_is_the_task_losss_gradient():
    """SCAFFOLD option I's c_i is the gradient of the run's loss (CE + Dice on masks here), not of a class CE."""
    task = Task("segmentation", "ce_dice")
    site = clients(1)
    torch.manual_seed(0)
    eng = InProcessEngine(UNet(width=0.125), site, resolve_method("scaffold", client={"scaffold_option": "I"}),
                          LocalTraining(batch_size=4, lr=0.05, task=task),
                          Federation(seed=0, channels_last=False), normalize_batch)
    start = {k: v.clone() for k, v in eng.global_state.items()}
    eng.run_round()
    data = site[0].train
    assert_control_variate_is_the_gradient_at(
        eng, "site0", start, lambda model: task.loss(model(normalize_batch(data.x)), data.y.long()))
    with pytest.raises(ValueError, match="classification only"):
        InProcessEngine(UNet(width=0.125), site, resolve_method("perfedavg"), LocalTraining(batch_size=4, task=task),
                        Federation(seed=0, channels_last=False), normalize_batch)


def test_rot90_flip_trains_on_masks_moved_with_their_images(monkeypatch):
    """training.augment rot90_flip on segmentation: the loss sees each augmented image with its own augmented mask
    (the synthetic masks are exactly the bright rectangle, so a mask that stayed behind would not match)."""
    import fednorm.methods.local_update as local_update

    pairs = []

    class Recording(local_update.BatchAugment):
        def pair(self, x, y):
            out = super().pair(x, y)
            pairs.append(out)
            return out

    monkeypatch.setattr(local_update, "BatchAugment", Recording)
    torch.manual_seed(0)
    training = LocalTraining(batch_size=4, lr=0.05, task=Task("segmentation", "ce_dice"), augment="rot90_flip")
    eng = InProcessEngine(UNet(width=0.125), clients(2), resolve_method("fedavg"), training,
                          Federation(seed=0, channels_last=False), normalize_batch)
    eng.run_round()
    assert len(pairs) == 4  # 2 clients x 8 images / batch 4
    originals = [m for c in eng.clients for m in c.train.y]
    moved = 0
    for images, masks in pairs:
        # the rectangle is 120 brighter than the noise (at most 60 + shift): its pixels are the mask
        for img, mask in zip(images, masks):
            bright = img[0].float() > img[0].float().min() + 90
            assert torch.equal(bright, mask.bool())
            moved += int(not any(torch.equal(mask, m) for m in originals))
    assert moved > 0  # the augmentation did turn or flip masks (with their images)
