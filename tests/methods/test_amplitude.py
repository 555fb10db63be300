import numpy as np
import pytest
import torch

from fednorm.data.domain import normalize_batch
from fednorm.methods.amplitude import (
    CLIENT_AMPLITUDE,
    GLOBAL_AMPLITUDE,
    AmplitudeNormalizer,
    AmplitudePrepare,
    amplitude,
    amplitude_entries,
    amplitude_normalizer,
    amplitude_phase,
    average_amplitudes,
    client_amplitude_message,
    low_frequency_mask,
    reconstruct,
    swap_amplitude,
    update_input_state,
    without_amplitudes,
)
from fednorm.methods.presets import resolve_method


def images(n=4, c=3, h=6, w=10, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, c, h, w, generator=g, dtype=dtype)


def unit_phasor_close(a, b, where, atol=1e-9):
    """exp(j a) == exp(j b) wherever ``where``: phases equal modulo 2 pi."""
    diff = (torch.polar(torch.ones_like(a), a) - torch.polar(torch.ones_like(b), b)).abs()
    return bool((diff[where] < atol).all())


@pytest.mark.parametrize("shape", [(1, 3, 6, 10), (2, 1, 5, 7), (3, 4, 8, 8)])
def test_own_amplitude_is_the_identity(shape):
    x = torch.rand(*shape, dtype=torch.float64)
    for m in range(shape[0]):
        out = swap_amplitude(x[m : m + 1], amplitude(x[m]))
        torch.testing.assert_close(out, x[m : m + 1], atol=1e-12, rtol=0)
    # float32 too, within float error
    x32 = x.float()
    torch.testing.assert_close(swap_amplitude(x32[:1], amplitude(x32[0])), x32[:1], atol=1e-5, rtol=0)


def test_amplitude_and_phase_are_eq_2():
    x = images(2, 2, 4, 6)
    amp, pha = amplitude_phase(x)
    f = torch.fft.fft2(x)
    torch.testing.assert_close(amp, torch.sqrt(f.real**2 + f.imag**2))
    torch.testing.assert_close(pha, torch.atan2(f.imag, f.real))  # atan2, not arctan(I/R)
    # the DFT of Eq. 2 written out for one coefficient
    h, w, u, v = 4, 6, 1, 2
    hh, ww = torch.meshgrid(torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64), indexing="ij")
    manual = (x[0, 0] * torch.exp(-2j * torch.pi * (hh * u / h + ww * v / w))).sum()
    torch.testing.assert_close(f[0, 0, u, v], manual)
    torch.testing.assert_close(reconstruct(amp, pha), x)


def test_average_amplitude_is_imposed_and_phase_kept():
    x = images(5, 3, 6, 10)
    avg = amplitude(x).mean(0)
    out = swap_amplitude(x, avg)
    assert out.shape == x.shape and out.dtype == x.dtype
    amp_out, pha_out = amplitude_phase(out)
    for m in range(5):
        torch.testing.assert_close(amp_out[m], avg, atol=1e-12, rtol=1e-10)
    _, pha_x = amplitude_phase(x)
    assert unit_phasor_close(pha_out, pha_x, avg.expand_as(pha_x) > 1e-9)
    # the spectrum avg * exp(j P) is Hermitian: its inverse DFT is real, so taking .real loses nothing
    imag = torch.fft.ifft2(torch.polar(avg.expand_as(pha_x), pha_x)).imag
    assert imag.abs().max() < 1e-12


def test_images_of_two_clients_get_the_same_amplitude():
    a, b = images(3, seed=1), 0.3 * images(3, seed=2) + 0.5  # a dim and a bright client
    glob = average_amplitudes([amplitude(a).mean(0), amplitude(b).mean(0)])
    amp_a, amp_b = amplitude(swap_amplitude(a, glob)), amplitude(swap_amplitude(b, glob))
    torch.testing.assert_close(amp_a, amp_b, atol=1e-10, rtol=1e-10)
    # channel means follow the DC term of the global amplitude
    torch.testing.assert_close(swap_amplitude(a, glob).mean((2, 3)), (glob[:, 0, 0] / 60).expand(3, 3))


def test_decay_formula_on_hand_values():
    # 1 x 2 x 2 constant images c: DFT = 4c at DC, 0 elsewhere, so |DFT| = 4|c| at DC
    def const(*cs):
        return torch.tensor(cs, dtype=torch.float64).view(-1, 1, 1, 1).expand(-1, 1, 2, 2).contiguous()

    batch1, batch2, batch3 = const(-1.0, 3.0), const(5.0), const(0.0, 2.0)
    # batch term = mean over the batch of per-image amplitudes: (4 + 12) / 2 = 8 (amplitude of the mean image: 4)
    for init, expected in {"first_batch": [8.0, 9.2, 8.68], "zero": [0.8, 2.72, 2.848]}.items():
        norm = AmplitudeNormalizer((1, 2, 2), decay=0.1, init=init)
        got = []
        for batch in (batch1, batch2, batch3):
            norm.update(batch)
            got.append(norm.amplitude[0, 0, 0].item())
            assert float(norm.amplitude.abs().sum() - norm.amplitude[0, 0, 0]) == 0.0  # no AC energy
        # first_batch: 8; 0.9*8 + 0.1*20 = 9.2; 0.9*9.2 + 0.1*4 = 8.68
        # zero (paper, Abar_0 = 0): 0.1*8 = 0.8; 0.9*0.8 + 2 = 2.72; 0.9*2.72 + 0.4 = 2.848
        np.testing.assert_allclose(got, expected, rtol=1e-6)
        assert int(norm.num_updates) == 3


def test_decay_matches_eq_3_on_random_batches():
    batches = [images(4, seed=s) for s in range(4)]
    v = 0.3
    norm = AmplitudeNormalizer(decay=v, init="zero")
    ref = torch.zeros(3, 6, 10, dtype=torch.float64)
    for x in batches:
        ref = (1 - v) * ref + v * torch.fft.fft2(x).abs().mean(0)
        norm.update(x)
    torch.testing.assert_close(norm.amplitude.double(), ref, rtol=1e-5, atol=1e-5)


def test_the_running_amplitude_starts_from_zero_as_the_paper_says():
    """HarmoFL Eq. 3: "this term is set to zero for the first batch" is the default; the official code's start
    from the first batch's mean amplitude is the named option."""
    assert AmplitudeNormalizer().init == "zero"
    x = images(3, seed=5)
    norm = AmplitudeNormalizer()
    norm.update(x)
    torch.testing.assert_close(norm.amplitude.double(), 0.1 * amplitude(x).mean(0), rtol=1e-5, atol=1e-6)
    assert AmplitudeNormalizer.official_code().init == "first_batch"


@pytest.mark.parametrize("init, first_weight", [("zero", 0.1), ("first_batch", 1.0)])
def test_training_forward_normalizes_with_the_updated_average(init, first_weight):
    x1, x2 = images(3, seed=1), images(3, seed=2)
    norm = AmplitudeNormalizer(decay=0.1, init=init).train()
    out1 = norm(x1)
    avg1 = first_weight * amplitude(x1).mean(0)
    torch.testing.assert_close(out1, swap_amplitude(x1, avg1.float()), atol=1e-6, rtol=0)
    out2 = norm(x2)
    avg2 = 0.9 * avg1 + 0.1 * amplitude(x2).mean(0)  # Abar_k, not Abar_{k-1}
    torch.testing.assert_close(out2, swap_amplitude(x2, avg2.float()), atol=1e-5, rtol=0)
    # evaluation mode does not update
    before = norm.amplitude.clone()
    norm.eval()(images(2, seed=3))
    assert torch.equal(norm.amplitude, before) and int(norm.num_updates) == 2


def test_single_image_batch_is_returned_unchanged_on_the_first_batch_of_the_code():
    x = images(1, seed=4)
    torch.testing.assert_close(AmplitudeNormalizer(init="first_batch").train()(x), x, atol=1e-6, rtol=0)


def test_the_papers_first_batch_of_one_image_is_that_image_scaled_by_v():
    # Abar_1 = v * A(x) from Abar_0 = 0, with x's own phase: real(IFFT(v A e^{jP})) = v x (a 10x darker image)
    x = images(1, seed=4)
    torch.testing.assert_close(AmplitudeNormalizer(decay=0.1).train()(x), 0.1 * x, atol=1e-6, rtol=0)


def test_global_amplitude_is_frozen_and_used_at_inference():
    clients = [images(4, seed=s) * (s + 1) for s in range(3)]
    normalizers = [AmplitudeNormalizer().train() for _ in clients]
    for norm, x in zip(normalizers, clients):
        norm(x)
    glob = average_amplitudes([n.amplitude for n in normalizers])
    torch.testing.assert_close(glob, sum(n.amplitude for n in normalizers) / 3)
    for norm in normalizers:
        norm.set_amplitude(glob)
        assert norm.frozen
        norm.train()(images(4, seed=9))  # training forward after freezing: no update
        torch.testing.assert_close(norm.amplitude, glob)
        with pytest.raises(RuntimeError, match="frozen"):
            norm.update(images(2))
    server = AmplitudeNormalizer.from_amplitude(glob)
    test = images(2, seed=11)
    torch.testing.assert_close(server.eval()(test), swap_amplitude(test, glob))


def test_weighted_average_on_hand_values():
    a, b = torch.full((1, 2, 2), 1.0), torch.full((1, 2, 2), 4.0)
    torch.testing.assert_close(average_amplitudes([a, b]), torch.full((1, 2, 2), 2.5))
    torch.testing.assert_close(average_amplitudes([a, b], weights=[3, 1]), torch.full((1, 2, 2), 1.75))
    with pytest.raises(ValueError, match="share one shape"):
        average_amplitudes([a, torch.ones(1, 2, 3)])
    with pytest.raises(ValueError, match="2 amplitudes but 3 weights"):
        average_amplitudes([a, b], weights=[1, 1, 1])
    with pytest.raises(ValueError, match="non-negative"):
        average_amplitudes([a, b], weights=[1, -1])
    with pytest.raises(ValueError, match="at least one"):
        average_amplitudes([])


def fda_mutate_reference(amp_src, amp_trg, L):
    """The official code's ``mutate`` (FDA low-frequency swap), in NumPy."""
    a_src = np.fft.fftshift(amp_src, axes=(-2, -1)).copy()
    a_trg = np.fft.fftshift(amp_trg, axes=(-2, -1))
    _, h, w = a_src.shape
    b = int(np.floor(np.amin((h, w)) * L))
    c_h, c_w = int(np.floor(h / 2.0)), int(np.floor(w / 2.0))
    a_src[:, c_h - b : c_h + b + 1, c_w - b : c_w + b + 1] = a_trg[:, c_h - b : c_h + b + 1, c_w - b : c_w + b + 1]
    return np.fft.ifftshift(a_src, axes=(-2, -1))


@pytest.mark.parametrize("h,w,ratio", [(8, 8, 0.0), (8, 8, 0.125), (7, 9, 0.2), (6, 10, 0.25), (6, 6, 0.5)])
def test_low_frequency_window_matches_the_official_fda_swap(h, w, ratio):
    x = images(2, 3, h, w, seed=5)
    target = amplitude(images(3, 3, h, w, seed=6)).mean(0)
    out = swap_amplitude(x, target, band_ratio=ratio)
    for m in range(2):
        amp, pha = np.abs(np.fft.fft2(x[m].numpy())), np.angle(np.fft.fft2(x[m].numpy()))
        ref = np.real(np.fft.ifft2(fda_mutate_reference(amp, target.numpy(), ratio) * np.exp(1j * pha)))
        np.testing.assert_allclose(out[m].numpy(), ref, atol=1e-10)


def test_low_frequency_mask_positions():
    assert low_frequency_mask(8, 8, 0.0).nonzero().tolist() == [[0, 0]]  # DC only
    rows, cols = low_frequency_mask(8, 8, 0.125).nonzero().T  # b = 1: frequencies -1, 0, 1
    assert set(rows.tolist()) == {0, 1, 7} and set(cols.tolist()) == {0, 1, 7} and len(rows) == 9
    assert low_frequency_mask(6, 6, 0.5).all()
    with pytest.raises(ValueError, match="band_ratio"):
        low_frequency_mask(8, 8, 0.6)


def test_dc_only_swap_sets_the_channel_means():
    x = images(3, seed=7)  # non-negative images: DC phase is 0
    target = amplitude(images(4, seed=8)).mean(0)
    out = swap_amplitude(x, target, band_ratio=0.0)
    hw = x.shape[-2] * x.shape[-1]
    expected = x - x.mean((2, 3), keepdim=True) + (target[:, 0, 0] / hw).view(1, -1, 1, 1)
    torch.testing.assert_close(out, expected)


def test_official_code_preset_keeps_the_first_batch_amplitude():
    norm = AmplitudeNormalizer.official_code()
    assert norm.decay == 0.0 and norm.band_ratio == 0.0 and norm.init == "first_batch"
    x1 = images(3, seed=1)
    norm.train()(x1)
    first = norm.amplitude.clone()
    norm(images(3, seed=2) * 5)
    torch.testing.assert_close(norm.amplitude, first)
    assert AmplitudeNormalizer.official_code(truncated_momentum=False).decay == 0.1


def test_state_dict_round_trip_and_lazy_shape():
    norm = AmplitudeNormalizer(decay=0.2).train()
    norm(images(3, seed=1))
    norm(images(3, seed=2))
    state = norm.state_dict()
    assert set(state) == {"running_amp", "num_updates", "frozen_flag"}
    restored = AmplitudeNormalizer(decay=0.2)
    restored.load_state_dict(state)
    torch.testing.assert_close(restored.amplitude, norm.amplitude)
    assert int(restored.num_updates) == 2 and not restored.frozen
    x = images(2, seed=3)
    torch.testing.assert_close(restored.train()(x), norm(x))
    # frozen state survives a checkpoint too
    norm.set_amplitude(norm.amplitude)
    restored.load_state_dict(norm.state_dict())
    assert restored.frozen


def test_amplitude_prepare_wraps_normalize_batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (1, 3, 8, 8), dtype=torch.uint8, generator=g)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    # a single image's own amplitude: identity, so the result is normalize_batch's
    prep = AmplitudePrepare(AmplitudeNormalizer(init="first_batch").train(), mean, std)
    torch.testing.assert_close(prep(x), normalize_batch(x, mean, std), atol=1e-5, rtol=0)
    # the normalizer acts on [0, 1] images, before standardization
    frozen = AmplitudeNormalizer.from_amplitude(amplitude(torch.rand(3, 8, 8)))
    out = AmplitudePrepare(frozen, mean, std, update=False)(x)
    ref = (frozen(x.float() / 255) - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    torch.testing.assert_close(out, ref)
    with pytest.raises(TypeError, match="uint8"):
        prep(x.float())


def test_bad_shapes_and_arguments_are_refused():
    norm = AmplitudeNormalizer((3, 6, 10))
    with pytest.raises(ValueError, match="N x C x H x W"):
        norm.update(torch.rand(3, 6, 10))
    with pytest.raises(ValueError, match="one image size"):
        norm.update(torch.rand(2, 3, 6, 8))
    with pytest.raises(TypeError, match="float"):
        norm.update(torch.zeros(2, 3, 6, 10, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="no amplitude"):
        AmplitudeNormalizer().eval()(torch.rand(2, 3, 6, 10))
    with pytest.raises(ValueError, match="one size"):
        swap_amplitude(torch.rand(2, 3, 6, 10), torch.rand(3, 6, 8))
    with pytest.raises(ValueError, match="decay"):
        AmplitudeNormalizer(decay=1.5)
    with pytest.raises(ValueError, match="init"):
        AmplitudeNormalizer(init="ones")
    with pytest.raises(ValueError, match="zero forever"):
        AmplitudeNormalizer(decay=0.0, init="zero")
    with pytest.raises(ValueError, match="band_ratio"):
        AmplitudeNormalizer(band_ratio=-0.1)


def test_half_precision_inputs_are_computed_in_float32():
    x = images(2, dtype=torch.float32).bfloat16()
    out = AmplitudeNormalizer().train()(x)
    # computed in float32 (the first batch's amplitude is v times its own mean amplitude), cast back to the input's
    # dtype
    ref = swap_amplitude(x.float(), 0.1 * amplitude(x.float()).mean(0)).bfloat16()
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)


def test_unfrozen_global_amplitude_is_the_start_of_eq_3():
    glob = torch.full((1, 2, 2), 10.0)
    norm = AmplitudeNormalizer(decay=0.1)
    norm.set_amplitude(glob, freeze=False)
    assert not norm.frozen
    x = torch.full((1, 1, 2, 2), 5.0)  # DC amplitude 20, no AC
    norm.train()(x)
    expected = torch.tensor([[[0.9 * 10 + 0.1 * 20, 9.0], [9.0, 9.0]]])
    torch.testing.assert_close(norm.amplitude, expected)


def test_protocol_averages_round_one_amplitudes_once_and_separates_them_from_the_algorithm_message():
    """Alg. 1 lines 15-17: round 1's client amplitudes are averaged uniformly into the global one; later messages
    (and a second average) leave it frozen; the client algorithm sees its own entries only."""
    a, b = torch.rand(3, 8, 8), torch.rand(3, 8, 8)
    messages = [{CLIENT_AMPLITUDE: a, "c_delta": torch.ones(2)}, {CLIENT_AMPLITUDE: b}, {}]
    state = update_input_state({}, messages)
    torch.testing.assert_close(state[GLOBAL_AMPLITUDE], (a + b) / 2)
    assert update_input_state(state, [{CLIENT_AMPLITUDE: torch.zeros(3, 8, 8)}]) is state  # frozen after round 1
    assert update_input_state({}, [{"c_delta": torch.ones(2)}]) == {}  # no amplitude sent: nothing to average
    assert set(without_amplitudes(messages[0])) == {"c_delta"}
    assert set(amplitude_entries(messages[0])) == {CLIENT_AMPLITUDE}


def test_a_client_sends_its_amplitude_only_while_it_is_not_frozen():
    method = resolve_method("harmofl")
    running = amplitude_normalizer(method, None).train()
    running(torch.rand(4, 3, 8, 8))
    message = client_amplitude_message(running)
    torch.testing.assert_close(message[CLIENT_AMPLITUDE], running.amplitude)
    frozen = amplitude_normalizer(method, message[CLIENT_AMPLITUDE])
    assert frozen.frozen and client_amplitude_message(frozen) == {}
    assert client_amplitude_message(None) == {}
