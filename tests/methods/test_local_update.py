import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fednorm.data.domain import normalize_batch
from fednorm.methods.local_update import LocalTraining, batch_schedule, train_locally

from ..conftest import make_split


def test_fedprox_step_adds_mu_times_distance_to_global_weights():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 28 * 28, 10))
    data = make_split(8, seed=1)
    reference = {k: v.detach() + 0.3 * torch.randn_like(v) for k, v in model.named_parameters()}
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    mu, lr = 0.5, 0.1
    cfg = LocalTraining(batch_size=8, lr=lr)
    train_locally(model, data, cfg, generator=torch.Generator().manual_seed(0), prepare=normalize_batch,
                  prox_reference=reference, prox_mu=mu)
    # expected: w - lr * (dCE/dw + mu (w - w_global)), the gradient of CE + mu/2 ||w - w_global||^2
    check = nn.Sequential(nn.Flatten(), nn.Linear(3 * 28 * 28, 10))
    check.load_state_dict(start)
    loss = F.cross_entropy(check(normalize_batch(data.x)), data.y)
    loss = loss + mu / 2 * sum(((p - reference[k]) ** 2).sum() for k, p in check.named_parameters())
    grads = torch.autograd.grad(loss, list(check.parameters()))
    for (name, p), g in zip(check.named_parameters(), grads):
        torch.testing.assert_close(dict(model.named_parameters())[name].detach(), p.detach() - lr * g,
                                   rtol=1e-5, atol=1e-6)


def test_without_prox_the_step_is_plain_sgd():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 28 * 28, 10))
    data = make_split(8, seed=1)
    start = [p.detach().clone() for p in model.parameters()]
    train_locally(model, data, LocalTraining(batch_size=8, lr=0.1), generator=torch.Generator(), prepare=normalize_batch,
                  prox_reference={k: v.detach() + 1 for k, v in model.named_parameters()}, prox_mu=0.0)
    check = nn.Sequential(nn.Flatten(), nn.Linear(3 * 28 * 28, 10))
    for p, s in zip(check.parameters(), start):
        p.data.copy_(s)
    grads = torch.autograd.grad(F.cross_entropy(check(normalize_batch(data.x)), data.y), list(check.parameters()))
    for p, s, g in zip(model.parameters(), start, grads):
        torch.testing.assert_close(p.detach(), s - 0.1 * g, rtol=1e-5, atol=1e-6)


def test_epoch_schedule_covers_every_sample_once_per_epoch():
    cfg = LocalTraining(epochs=2, batch_size=32)
    batches = batch_schedule(743, cfg, torch.Generator().manual_seed(0), guard_single=False)
    assert len(batches) == 2 * 24
    first, second = torch.cat(batches[:24]), torch.cat(batches[24:])
    assert sorted(first.tolist()) == list(range(743))
    assert sorted(second.tolist()) == list(range(743))
    assert not torch.equal(first, second)  # reshuffled every epoch (a DataLoader with shuffle=True)


def test_fixed_steps_repeat_sampling_for_small_clients():
    cfg = LocalTraining(steps=10, batch_size=32)
    batches = batch_schedule(40, cfg, torch.Generator().manual_seed(0), guard_single=False)
    assert len(batches) == 10
    assert all(len(b) == 32 for b in batches)
    stream = torch.cat(batches)
    for start in range(0, 320 - 40, 40):  # each pass over the 40 samples sees every sample once
        assert sorted(stream[start:start + 40].tolist()) == list(range(40))


def test_single_sample_tail_batch_is_dropped_for_batchnorm_only():
    cfg = LocalTraining(batch_size=32)
    with_bn = batch_schedule(33, cfg, torch.Generator().manual_seed(0), guard_single=True)
    without = batch_schedule(33, cfg, torch.Generator().manual_seed(0), guard_single=False)
    assert [len(b) for b in with_bn] == [32]
    assert [len(b) for b in without] == [32, 1]
    with pytest.raises(ValueError, match="BatchNorm"):
        batch_schedule(1, cfg, torch.Generator(), guard_single=True)


def test_drop_last_drops_a_short_tail_batch_unless_it_is_the_only_one():
    cfg = LocalTraining(epochs=2, batch_size=8, drop_last=True)
    batches = batch_schedule(35, cfg, torch.Generator().manual_seed(0), guard_single=False)
    assert [len(b) for b in batches] == [8] * 8  # 4 full batches per epoch, the 3-sample tail dropped each time
    assert len(set(torch.cat(batches[:4]).tolist())) == 32
    assert [len(b) for b in batch_schedule(5, cfg, torch.Generator(), guard_single=False)] == [5, 5]


def test_diverging_training_raises_a_clear_error():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 28 * 28, 10))
    with torch.no_grad():
        model[1].weight[0, 0] = float("inf")  # as after an overflowing step
    with pytest.raises(FloatingPointError, match="learning rate"):
        train_locally(model, make_split(64, seed=0), LocalTraining(lr=0.01, batch_size=8),
                      generator=torch.Generator(), prepare=normalize_batch)


def test_fedbn_code_prox_schedule_skips_the_term_on_each_epoch_first_step():
    data = make_split(16, seed=2)

    def trained(skip, epochs, batch):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 28 * 28, 10))
        far = {k: v.detach() + 1.0 for k, v in model.named_parameters()}
        train_locally(model, data, LocalTraining(batch_size=batch, lr=0.1, epochs=epochs),
                      generator=torch.Generator().manual_seed(0), prepare=normalize_batch,
                      prox_reference=far, prox_mu=0.5, prox_skip_epoch_start=skip)
        return model[1].weight.detach()

    def plain(epochs, batch):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 28 * 28, 10))
        train_locally(model, data, LocalTraining(batch_size=batch, lr=0.1, epochs=epochs),
                      generator=torch.Generator().manual_seed(0), prepare=normalize_batch)
        return model[1].weight.detach()

    # one full batch per epoch: every step starts an epoch, so the skipped schedule is plain SGD
    assert torch.equal(trained(True, 2, 16), plain(2, 16))
    assert not torch.allclose(trained(False, 2, 16), plain(2, 16))
    # two batches per epoch: the second step of each epoch (steps 1 and 3) carries the term, written out by hand
    # on the batches train_locally draws (read through `prepare`)
    seen = []
    torch.manual_seed(0)
    probe = nn.Sequential(nn.Flatten(), nn.Linear(3 * 28 * 28, 10))
    train_locally(probe, data, LocalTraining(batch_size=8, lr=0.0, epochs=2),
                  generator=torch.Generator().manual_seed(0), prepare=lambda x: seen.append(x) or normalize_batch(x))
    assert len(seen) == 4
    rows = {tuple(x.flatten().tolist()): i for i, x in enumerate(data.x)}
    batches = [torch.tensor([rows[tuple(x.flatten().tolist())] for x in b]) for b in seen]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 28 * 28, 10))
    far = {k: v.detach() + 1.0 for k, v in model.named_parameters()}
    for step, idx in enumerate(batches):
        model.zero_grad()
        nn.functional.cross_entropy(model(normalize_batch(data.x[idx])), data.y[idx]).backward()
        with torch.no_grad():
            for k, w in model.named_parameters():
                prox = 0.5 * (w - far[k]) if step in (1, 3) else 0.0
                w -= 0.1 * (w.grad + prox)
    torch.testing.assert_close(trained(True, 2, 8), model[1].weight.detach(), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(trained(True, 2, 8), plain(2, 8))


def test_adam_client_steps_as_torch_adam_and_keeps_its_moments_across_rounds():
    """HarmoFL's segmentation optimizer: Adam (lr 1e-4, betas (0.9, 0.99), weight decay 1e-4), persistent."""
    data = make_split(8, seed=1)
    cfg = LocalTraining(batch_size=8, steps=2, lr=1e-3, optimizer="adam", betas=(0.9, 0.99), weight_decay=1e-4)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 28 * 28, 10))
    check = nn.Sequential(nn.Flatten(), nn.Linear(3 * 28 * 28, 10))
    check.load_state_dict(model.state_dict())
    _, state = train_locally(model, data, cfg, generator=torch.Generator(), prepare=normalize_batch)
    train_locally(model, data, cfg, generator=torch.Generator(), prepare=normalize_batch, optimizer_state=state)
    reference = torch.optim.Adam(check.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=1e-4)
    for _ in range(4):  # two rounds of two full-batch steps, one optimizer: the moments carry over
        reference.zero_grad()
        F.cross_entropy(check(normalize_batch(data.x)), data.y).backward()
        reference.step()
    for a, b in zip(model.parameters(), check.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert state["param_groups"][0]["betas"] == (0.9, 0.99)


def test_adam_refuses_sgd_momentum():
    with pytest.raises(ValueError, match="betas"):
        LocalTraining(optimizer="adam", momentum=0.9)
    from fednorm.runs.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="momentum: 0"):
        load_config("default", ["training.optimizer=adam", "training.momentum=0.9"])
    prostate = load_config("harmofl_prostate").training.build()
    assert (prostate.optimizer, prostate.lr, prostate.betas, prostate.momentum) == ("adam", 1e-4, (0.9, 0.99), 0.0)


def test_ema_client_momentum_starts_from_zero_and_carries_over_rounds():
    """FBN's client momentum (Robust-DSGD): m_t = mu m_(t-1) + (1 - mu) g_t from m_0 = 0, one step per round,
    the optimizer state kept between rounds; torch's SGD alone would take m_1 = g_1."""
    mu, lr = 0.9, 0.1
    data = make_split(8, seed=1)
    cfg = LocalTraining(batch_size=8, steps=1, lr=lr, momentum=mu, momentum_style="ema")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 28 * 28, 10))
    check = nn.Sequential(nn.Flatten(), nn.Linear(3 * 28 * 28, 10))
    check.load_state_dict(model.state_dict())
    state = None
    buffers = [torch.zeros_like(p) for p in check.parameters()]
    for _ in range(3):
        _, state = train_locally(model, data, cfg, generator=torch.Generator(), prepare=normalize_batch,
                                 optimizer_state=state)
        grads = torch.autograd.grad(F.cross_entropy(check(normalize_batch(data.x)), data.y), list(check.parameters()))
        with torch.no_grad():
            for p, m, g in zip(check.parameters(), buffers, grads):
                m.mul_(mu).add_((1 - mu) * g)
                p.sub_(lr * m)
        for a, b in zip(model.parameters(), check.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_auto_precision_follows_the_device_that_trains_not_another_in_the_machine(monkeypatch):
    from fednorm.methods import local_update

    # training runs under torch.autocast("cpu"): a bf16-capable GPU must not make `auto` pick emulated bf16
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    for amx, avx512_bf16, expected in ((False, False, "fp32"), (True, False, "bf16"), (False, True, "bf16")):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v, raising=False)
        assert local_update.resolve_precision("auto") == expected
    assert local_update.resolve_precision("fp32") == "fp32"
    # on a GPU, the GPU's bf16 decides (tests/engines/test_device.py)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert local_update.resolve_precision("auto", "cuda") == "fp32"


def test_weight_perturbation_counts_each_batch_once_in_the_batchnorm_statistics():
    """HarmoFL's second (perturbed) pass leaves BN running statistics as the first pass set them: after one
    step they are BatchNorm's momentum update with the batch at theta, counted once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 26 * 26, 10))
    data = make_split(8, seed=1)
    x = normalize_batch(data.x)
    with torch.no_grad():
        h = model[0](x)
    mean, var = h.mean(dim=(0, 2, 3)), h.var(dim=(0, 2, 3), unbiased=True)
    cfg = LocalTraining(batch_size=8, lr=0.1)
    train_locally(model, data, cfg, generator=torch.Generator().manual_seed(0), prepare=normalize_batch,
                  weight_perturbation=0.05)
    bn = model[1]
    assert int(bn.num_batches_tracked) == 1
    torch.testing.assert_close(bn.running_mean, 0.1 * mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bn.running_var, 0.9 + 0.1 * var, rtol=1e-5, atol=1e-6)
