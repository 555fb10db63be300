import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fednorm.methods.agc import clip_unitwise_, unitwise_norm
from fednorm.methods.weight_perturbation import WeightPerturbation

D = torch.float64
# f(theta) = 1/2 theta^T A theta + b^T theta over theta = (u, w): u in R^2, w in R^3 (two parameters)
A = torch.diag(torch.tensor([1.0, 4.0, 2.0, 0.5, 3.0], dtype=D)) + 0.1 * torch.ones(5, 5, dtype=D)
B = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0], dtype=D)
THETA0 = torch.tensor([0.3, -0.7, 1.2, 0.4, -0.2], dtype=D)


def quadratic_params():
    u = nn.Parameter(THETA0[:2].clone())
    w = nn.Parameter(THETA0[2:].clone())
    return u, w


def make_closure(u, w, calls=None):
    def closure():
        theta = torch.cat([u, w])
        if calls is not None:
            calls.append(theta.detach().clone())
        loss = 0.5 * theta @ A @ theta + B @ theta
        loss.backward()
        return loss

    return closure


def grad(theta):
    return A @ theta + B


def test_sgd_update_equals_the_gradient_at_theta_plus_delta():
    alpha, lr = 0.05, 0.1
    u, w = quadratic_params()
    calls = []
    opt = WeightPerturbation(torch.optim.SGD([u, w], lr=lr), alpha=alpha)
    loss = opt.step(make_closure(u, w, calls))

    g = grad(THETA0)
    delta = alpha * g / g.norm()  # ONE global L2 norm over both parameters
    g_delta = grad(THETA0 + delta)
    expected = THETA0 - lr * g_delta
    torch.testing.assert_close(torch.cat([u, w]).detach(), expected, rtol=0, atol=1e-14)
    # the closure ran at theta, then at theta + delta; the returned loss is the one at theta
    assert len(calls) == 2
    torch.testing.assert_close(calls[0], THETA0, rtol=0, atol=0)
    torch.testing.assert_close(calls[1], THETA0 + delta, rtol=0, atol=1e-14)
    torch.testing.assert_close(loss.detach(), 0.5 * THETA0 @ A @ THETA0 + B @ THETA0)
    # a per-parameter (layer-wise) norm would give a different step
    per_layer = torch.cat([alpha * g[:2] / g[:2].norm(), alpha * g[2:] / g[2:].norm()])
    assert not torch.allclose(expected, THETA0 - lr * grad(THETA0 + per_layer))


def test_weights_are_restored_before_the_base_step_and_hook_sees_g_delta():
    u, w = quadratic_params()
    seen = {}

    def hook():
        seen["theta"] = torch.cat([u, w]).detach().clone()
        seen["grad"] = torch.cat([u.grad, w.grad]).clone()

    opt = WeightPerturbation(torch.optim.SGD([u, w], lr=0.0), alpha=0.5)
    opt.step(make_closure(u, w), grad_hook=hook)
    assert torch.equal(seen["theta"], THETA0)  # exactly restored, bit for bit
    assert torch.equal(torch.cat([u, w]).detach(), THETA0)  # lr 0: unchanged
    g = grad(THETA0)
    torch.testing.assert_close(seen["grad"], grad(THETA0 + 0.5 * g / g.norm()))
    assert not opt.perturbed


def test_momentum_and_weight_decay_act_on_g_delta_at_the_restored_weights():
    kw = dict(lr=0.05, momentum=0.9, weight_decay=1e-2)
    u, w = quadratic_params()
    opt = WeightPerturbation(torch.optim.SGD([u, w], **kw), alpha=0.05)
    ru, rw = quadratic_params()
    ref = torch.optim.SGD([ru, rw], **kw)
    for _ in range(3):
        theta = torch.cat([ru, rw]).detach()
        g = grad(theta)
        g_delta = grad(theta + 0.05 * g / g.norm())
        ru.grad, rw.grad = g_delta[:2].clone(), g_delta[2:].clone()
        ref.step()
        opt.step(make_closure(u, w))
        torch.testing.assert_close(torch.cat([u, w]).detach(), torch.cat([ru, rw]).detach(), rtol=0, atol=1e-14)


def test_grad_hook_modifies_the_gradient_of_the_base_step():
    u, w = quadratic_params()
    opt = WeightPerturbation(torch.optim.SGD([u, w], lr=0.1), alpha=0.05)
    opt.step(make_closure(u, w), grad_hook=lambda: [p.grad.mul_(0.5) for p in (u, w)])
    g = grad(THETA0)
    torch.testing.assert_close(torch.cat([u, w]).detach(), THETA0 - 0.1 * 0.5 * grad(THETA0 + 0.05 * g / g.norm()))


def test_agc_as_a_hook_in_a_model_training_loop():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(32, 4)
    y = (x @ torch.randn(4, 3)).argmax(1)  # learnable labels
    params = list(model.parameters())
    opt = WeightPerturbation(torch.optim.SGD(params, lr=0.1, momentum=0.9), alpha=0.05)

    def closure():
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    def ratios():  # per unit: ||g_delta|| / max(||W||, 1e-3), W the restored weights theta the step starts from
        return torch.cat([(unitwise_norm(p.grad) / unitwise_norm(p.detach()).clamp(min=1e-3)).flatten()
                          for p in params])

    before, after = [], []

    def hook():
        before.append(ratios())
        clip_unitwise_(params, 0.64)
        after.append(ratios())

    losses = [float(opt.step(closure, grad_hook=hook)) for _ in range(40)]
    assert losses[-1] < 0.7 * losses[0]
    assert any((r > 0.64).any() for r in before)  # the clip acted, on the perturbed gradient
    for b, a in zip(before, after):  # clipped units land on the threshold, the others keep their ratio
        torch.testing.assert_close(a, torch.clamp(b, max=0.64), rtol=1e-5, atol=1e-7)


def test_alpha_zero_is_the_plain_base_optimizer_and_adam_works():
    torch.manual_seed(0)
    m1 = nn.Linear(3, 2)
    m2 = nn.Linear(3, 2)
    m2.load_state_dict(m1.state_dict())
    x, y = torch.randn(8, 3), torch.randn(8, 2)
    opt1 = WeightPerturbation(torch.optim.Adam(m1.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=1e-4), alpha=0.0)
    opt2 = torch.optim.Adam(m2.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=1e-4)
    for _ in range(3):
        opt1.step(lambda: F.mse_loss(m1(x), y).backward())
        opt2.zero_grad()
        F.mse_loss(m2(x), y).backward()
        opt2.step()
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p1, p2)


def test_default_alpha_is_the_papers_and_adam_steps_with_the_perturbed_gradient():
    """Without alpha the wrapper uses HarmoFL's 0.05; around Adam (the prostate setting) the base step is Adam's
    first step taken with g at theta + delta: from zero moments, theta - lr * g_delta / (|g_delta| + eps)."""
    u, w = quadratic_params()
    lr, eps = 1e-2, 1e-8
    opt = WeightPerturbation(torch.optim.Adam([u, w], lr=lr, betas=(0.9, 0.99), eps=eps))
    assert opt.param_groups[0]["alpha"] == 0.05
    opt.step(make_closure(u, w))
    g = grad(THETA0)
    g_delta = grad(THETA0 + 0.05 * g / g.norm())
    # Adam's first step, bias-corrected: m_hat = g_delta, v_hat = g_delta^2
    expected = THETA0 - lr * g_delta / (g_delta.abs() + eps)
    torch.testing.assert_close(torch.cat([u, w]).detach(), expected, rtol=0, atol=1e-12)
    # the unperturbed gradient gives another step (Adam's first step is lr * sign(g) where no sign changes, so
    # compare the second step, where the moments carry the perturbed gradients)
    g2 = grad(expected)
    opt.step(make_closure(u, w))
    g2_delta = grad(expected + 0.05 * g2 / g2.norm())
    m = (0.1 * 0.9 * g_delta + 0.1 * g2_delta) / (1 - 0.9 ** 2)
    v = (0.01 * 0.99 * g_delta ** 2 + 0.01 * g2_delta ** 2) / (1 - 0.99 ** 2)
    torch.testing.assert_close(torch.cat([u, w]).detach(), expected - lr * m / (v.sqrt() + eps), rtol=0, atol=1e-12)
    m_plain = (0.1 * 0.9 * g_delta + 0.1 * g2) / (1 - 0.9 ** 2)
    v_plain = (0.01 * 0.99 * g_delta ** 2 + 0.01 * g2 ** 2) / (1 - 0.99 ** 2)
    assert not torch.allclose(expected - lr * m / (v.sqrt() + eps), expected - lr * m_plain / (v_plain.sqrt() + eps))


def test_per_group_alpha_with_one_global_norm():
    u, w = quadratic_params()
    opt = WeightPerturbation(torch.optim.SGD([{"params": [u], "alpha": 0.2}, {"params": [w]}], lr=0.1), alpha=0.05)
    opt.step(make_closure(u, w))
    g = grad(THETA0)
    delta = torch.cat([0.2 * g[:2], 0.05 * g[2:]]) / g.norm()
    torch.testing.assert_close(torch.cat([u, w]).detach(), THETA0 - 0.1 * grad(THETA0 + delta))


def test_manual_phases_match_step():
    u, w = quadratic_params()
    opt = WeightPerturbation(torch.optim.SGD([u, w], lr=0.1), alpha=0.05)
    closure = make_closure(u, w)
    opt.zero_grad()
    closure()
    norm = opt.perturb()
    torch.testing.assert_close(norm, grad(THETA0).norm())
    assert opt.perturbed
    with pytest.raises(RuntimeError, match="already perturbed"):
        opt.perturb()
    opt.zero_grad()
    closure()
    opt.restore()
    opt.base_optimizer.step()
    g = grad(THETA0)
    torch.testing.assert_close(torch.cat([u, w]).detach(), THETA0 - 0.1 * grad(THETA0 + 0.05 * g / g.norm()))


def test_weights_restored_if_the_second_pass_fails():
    u, w = quadratic_params()
    opt = WeightPerturbation(torch.optim.SGD([u, w], lr=0.1))
    calls = []

    def closure():
        calls.append(1)
        if len(calls) == 2:
            raise FloatingPointError("boom")
        return make_closure(u, w)()

    with pytest.raises(FloatingPointError):
        opt.step(closure)
    assert torch.equal(torch.cat([u, w]).detach(), THETA0) and not opt.perturbed


def test_state_dict_is_the_base_optimizers_and_schedulers_work():
    u, w = quadratic_params()
    opt = WeightPerturbation(torch.optim.SGD([u, w], lr=0.1, momentum=0.9), alpha=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step(make_closure(u, w))
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert opt.base_optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    state = opt.state_dict()
    plain = torch.optim.SGD([u, w], lr=0.1, momentum=0.9)
    plain.load_state_dict(state)  # interchangeable with the plain optimizer's checkpoint
    assert torch.equal(plain.state[u]["momentum_buffer"], opt.base_optimizer.state[u]["momentum_buffer"])
    again = WeightPerturbation(torch.optim.SGD([u, w], lr=0.1, momentum=0.9), alpha=0.05)
    again.load_state_dict(plain.state_dict())
    assert again.param_groups is again.base_optimizer.param_groups
    assert again.param_groups[0]["alpha"] == 0.05


def test_bad_arguments():
    u, w = quadratic_params()
    with pytest.raises(TypeError, match="optimizer instance"):
        WeightPerturbation(torch.optim.SGD, alpha=0.05)
    with pytest.raises(ValueError, match="alpha"):
        WeightPerturbation(torch.optim.SGD([u], lr=0.1), alpha=-1.0)
    opt = WeightPerturbation(torch.optim.SGD([u, w], lr=0.1))
    with pytest.raises(RuntimeError, match="closure"):
        opt.step()
    with pytest.raises(RuntimeError, match="no parameter has a gradient"):
        opt.perturb()


def test_harmofl_local_training_updates_the_amplitude_once_per_batch():
    """train_locally with weight perturbation (two forward/backward passes per step) and AmplitudePrepare: Eq. 3's
    running amplitude is updated once per mini-batch, in the batch order, not once per pass."""
    from fednorm.methods import LocalTraining, train_locally
    from fednorm.methods.amplitude import AmplitudeNormalizer, AmplitudePrepare

    from ..conftest import make_split

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(4, 10))
    data = make_split(10, seed=2, size=16)
    normalizer = AmplitudeNormalizer().train()
    cfg = LocalTraining(batch_size=4, lr=0.05)  # one epoch: batches of 4, 4 and 2
    train_locally(model, data, cfg, generator=torch.Generator().manual_seed(0), prepare=AmplitudePrepare(normalizer),
                  weight_perturbation=0.05)
    assert int(normalizer.num_updates) == 3
    reference = AmplitudeNormalizer().train()
    order = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    for batch in (order[:4], order[4:8], order[8:]):
        AmplitudePrepare(reference)(data.x[batch])
    torch.testing.assert_close(normalizer.running_amp, reference.running_amp, rtol=0, atol=0)
