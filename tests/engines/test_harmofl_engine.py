"""HarmoFL through the engine: weight perturbation in the local step, amplitude normalization's protocol
(client amplitudes in round 1, averaged, broadcast, frozen, used at evaluation)."""

import torch
import torch.nn.functional as F

from fednorm.data.domain import normalize_batch
from fednorm.engines.simulation import Federation, InProcessEngine
from fednorm.methods import LocalTraining, resolve_method, train_locally
from fednorm.methods.amplitude import amplitude
from fednorm.models import DigitCNN

from ..conftest import make_split, record_client_messages

TRAIN = LocalTraining(batch_size=8, lr=0.05)


def test_weight_perturbation_steps_with_the_gradient_at_theta_plus_delta():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 28 * 28, 10))
    data = make_split(8, seed=1)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = LocalTraining(steps=1, batch_size=8, lr=0.1)
    train_locally(model, data, cfg, generator=torch.Generator().manual_seed(0), prepare=normalize_batch,
                  weight_perturbation=0.05)
    # by hand: g at theta, delta = alpha g / ||g||, gradient at theta + delta, step from theta
    ref = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 28 * 28, 10))
    ref.load_state_dict(start)
    order = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    x, y = normalize_batch(data.x[order]), data.y[order]
    grads = torch.autograd.grad(F.cross_entropy(ref(x), y), list(ref.parameters()))
    norm = torch.sqrt(sum((g**2).sum() for g in grads))
    with torch.no_grad():
        for p, g in zip(ref.parameters(), grads):
            p.add_(0.05 * g / norm)
    grads_delta = torch.autograd.grad(F.cross_entropy(ref(x), y), list(ref.parameters()))
    for (name, value), g in zip(start.items(), grads_delta):
        torch.testing.assert_close(model.state_dict()[name], value - 0.1 * g, rtol=1e-5, atol=1e-6)


def test_amplitude_normalization_protocol(tiny_clients):
    torch.manual_seed(3)
    eng = InProcessEngine(DigitCNN(width=0.125), tiny_clients, resolve_method("harmofl"), TRAIN,
                          Federation(seed=0, channels_last=False), normalize_batch)
    assert eng.input_state == {}
    seen = record_client_messages(eng)
    eng.run_round()
    client_amps = [m["amp.client"] for m in seen]
    assert len(client_amps) == 3 and not torch.allclose(client_amps[0], client_amps[2])  # brightness-shifted
    torch.testing.assert_close(eng.input_state["amp.global"], torch.stack(client_amps).mean(0))
    seen.clear()
    inputs = []
    hook = eng.model.register_forward_pre_hook(lambda module, args: inputs.append(args[0].detach().clone()))
    eng.run_round()
    hook.remove()
    assert all("amp.client" not in m for m in seen)  # frozen: nothing more is sent
    # round 2 trains every client on its images carrying the broadcast global amplitude (not its own): batches of
    # 8 over 24 / 16 / 20 images, each forwarded twice (at theta and at theta + delta, weight perturbation)
    # (The self-conjugate Nyquist frequencies (0, 14), (14, 0), (14, 14) of 28 x 28 are left out: where an image's
    # own coefficient there is float32 noise its phase is arbitrary, and taking the real part, as the paper does,
    # shrinks the swapped amplitude A to |A cos(phase)|. The DC, where the brightness shift sits, is a positive sum.)
    assert len(inputs) == 2 * (3 + 2 + 3)
    checked = torch.ones(28, 28, dtype=torch.bool)
    checked[::14, ::14] = False
    checked[0, 0] = True
    glob = eng.input_state["amp.global"]
    for first, second in zip(inputs[::2], inputs[1::2]):
        assert torch.equal(first, second)
        got = amplitude(first * 0.5 + 0.5)
        torch.testing.assert_close(got[..., checked], glob[..., checked].expand(len(first), -1, -1),
                                   rtol=1e-3, atol=1e-3)
    # evaluation normalizes every client's images to the global amplitude (before standardization)
    prepare = eng.runner.evaluation_prepare(eng.input_state)
    images = tiny_clients[2].test.x[:4]
    restored = prepare(images) * 0.5 + 0.5  # undo normalize_batch's (x - 0.5) / 0.5
    torch.testing.assert_close(amplitude(restored), eng.input_state["amp.global"].expand(4, -1, -1, -1),
                               rtol=1e-3, atol=1e-3)
    assert len(eng.evaluate(("test",))) == 3
    state = eng.state_dict()
    assert torch.equal(state["input_state"]["amp.global"], eng.input_state["amp.global"])


def test_code_variant_swaps_only_the_dc_amplitude_at_evaluation(tiny_clients):
    """``amplitude_norm="code"`` (the authors' code: FDA window L = 0): after the protocol, evaluation replaces
    only each channel's DC amplitude by the global one; every other frequency keeps the image's own amplitude."""
    torch.manual_seed(3)
    eng = InProcessEngine(DigitCNN(width=0.125), tiny_clients, resolve_method("harmofl", amplitude_norm="code"),
                          TRAIN, Federation(seed=0, channels_last=False), normalize_batch)
    eng.run_round()
    eng.run_round()
    glob = eng.input_state["amp.global"]
    images = tiny_clients[2].test.x[:4]
    restored = eng.runner.evaluation_prepare(eng.input_state)(images) * 0.5 + 0.5
    got, own = amplitude(restored), amplitude(images.float() / 255)
    torch.testing.assert_close(got[..., 0, 0], glob[..., 0, 0].expand(4, -1), rtol=1e-4, atol=1e-3)
    assert not torch.allclose(own[..., 0, 0], got[..., 0, 0], rtol=1e-2)  # the DC did move (shifted client)
    not_dc = torch.ones(got.shape[-2:], dtype=torch.bool)
    not_dc[0, 0] = False
    torch.testing.assert_close(got[..., not_dc], own[..., not_dc], rtol=1e-4, atol=1e-3)


def test_code_variant_window_and_decay_are_method_options(tiny_clients):
    """amplitude_band (the code's FDA window L) and amplitude_decay (v) replace the code variant's L = 0 and v = 0:
    with L = 0.1 on 28 x 28 images evaluation swaps the frequencies -2..2 along each axis (b = floor(2.8)) and
    keeps the image's own amplitude elsewhere; round 1's running amplitude decays with the given v."""
    from fednorm.methods.amplitude import amplitude_normalizer
    from fednorm.methods.amplitude import low_frequency_mask

    method = resolve_method("harmofl", amplitude_norm="code", amplitude_band=0.1, amplitude_decay=0.1)
    running = amplitude_normalizer(method, None)
    assert (running.band_ratio, running.decay, running.init) == (0.1, 0.1, "first_batch")
    default = amplitude_normalizer(resolve_method("harmofl", amplitude_norm="code"), None)
    assert (default.band_ratio, default.decay) == (0.0, 0.0)  # the code's own
    torch.manual_seed(3)
    eng = InProcessEngine(DigitCNN(width=0.125), tiny_clients, method, TRAIN,
                          Federation(seed=0, channels_last=False), normalize_batch)
    eng.run_round()
    glob = eng.input_state["amp.global"]
    images = tiny_clients[2].test.x[:4]
    restored = eng.runner.evaluation_prepare(eng.input_state)(images) * 0.5 + 0.5
    got, own = amplitude(restored), amplitude(images.float() / 255)
    window = low_frequency_mask(28, 28, 0.1)
    assert int(window.sum()) == 25
    torch.testing.assert_close(got[..., window], glob[..., window].expand(4, -1, -1), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got[..., ~window], own[..., ~window], rtol=1e-4, atol=1e-3)
    assert not torch.allclose(got[..., window], own[..., window], rtol=1e-2)


def test_amplitude_methods_refuse_an_input_pipeline_they_would_replace(tiny_clients):
    """AmpNorm sits between /255 and normalize_batch's standardization: a custom pipeline (ImageNet statistics,
    say) would be dropped without a word, so the engine refuses it."""
    imagenet = lambda x: normalize_batch(x, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))  # noqa: E731
    try:
        InProcessEngine(DigitCNN(width=0.125), tiny_clients, resolve_method("harmofl"), TRAIN,
                        Federation(seed=0, channels_last=False), imagenet)
    except ValueError as exc:
        assert "normalize_batch" in str(exc) and "harmofl" in str(exc)
    else:
        raise AssertionError("a HarmoFL engine accepted a pipeline its amplitude step would replace")
    InProcessEngine(DigitCNN(width=0.125), tiny_clients, resolve_method("fedavg"), TRAIN,
                    Federation(seed=0, channels_last=False), imagenet)  # without AmpNorm the pipeline is kept


def test_amplitude_normalization_follows_the_runs_input_normalization(tiny_clients):
    """With data.input_norm unit (HarmoFL's Camelyon17 code: ToTensor only) the amplitude-normalized images are
    not standardized afterwards: the evaluation input is the amplitude-normalized [0, 1] image itself."""
    from fednorm.data.domain import input_normalization

    torch.manual_seed(3)
    eng = InProcessEngine(DigitCNN(width=0.125), tiny_clients, resolve_method("harmofl"), TRAIN,
                          Federation(seed=0, channels_last=False), input_normalization("unit"))
    eng.run_round()
    images = tiny_clients[2].test.x[:4]
    got = eng.runner.evaluation_prepare(eng.input_state)(images)
    torch.testing.assert_close(amplitude(got), eng.input_state["amp.global"].expand(4, -1, -1, -1),
                               rtol=1e-3, atol=1e-3)
    half = InProcessEngine(DigitCNN(width=0.125), tiny_clients, resolve_method("harmofl"), TRAIN,
                           Federation(seed=0, channels_last=False), normalize_batch)
    half.input_state = eng.input_state
    torch.testing.assert_close(half.runner.evaluation_prepare(half.input_state)(images), (got - 0.5) / 0.5)
