"""HarmoFL amplitude normalization (Jiang et al. 2022, Sec. 3.2, Eqs. 2-4), in pure PyTorch.

Every channel of every image is taken to the frequency domain with a 2-D DFT over (H, W)
(``torch.fft.fft2``), split into amplitude ``|F|`` and phase ``angle(F)`` (Eq. 2; ``atan2``, not the
printed ``arctan(I/R)``, which loses the quadrant), and rebuilt from a client's *average* amplitude
and the image's own phase, keeping the real part of the inverse DFT (Eq. 4):

    Psi(x_m) = real(IFFT2(Abar * exp(j * P(x_m))))

The average amplitude Abar (shape C x H x W) is a moving average over the client's batches (Eq. 3),
updated with the batch *before* the batch is normalized with it:

    Abar_k = (1 - v) * Abar_{k-1} + v * (1/M) sum_m A(x_m)        (v = 0.1)

i.e. the batch term is the mean over the M images of the batch of their per-image amplitudes (not
the amplitude of the mean image). The paper: "this term [Abar_{k-1}] is set to zero for the first
batch", so Abar_1 = v * batch mean, and after K batches Abar carries (1 - v)^K of that zero: the first
batch is normalized to a tenth of its amplitude (10x darker) and the amplitude a client sends after
round 1 is (1 - (1 - v)^K) of an unbiased average (0.88 for K = 20 batches, a harmofl_digits client
of 635 images in batches of 32; above 0.999 for K >= 70). That is the default here (``init="zero"``),
as the project implements the paper by default. The official code initialises Abar with the first batch's mean amplitude instead:
``init="first_batch"`` (Abar_1 = batch mean, then Eq. 3 as written; the method option
``amplitude_init: first_batch``). Until 2026-11-30 fednorm used ``first_batch`` for the full-spectrum
variant too; the HarmoFL results recorded before then (benchmarks/harmofl.md) were run with it.

Protocol (paper): in round 1 each client normalizes its batches with its own running amplitude and
sends Abar to the server, which averages them (Alg. 1 line 17: uniform mean,
:func:`average_amplitudes`), broadcasts the result, and every client then *freezes* it
(:meth:`AmplitudeNormalizer.set_amplitude`): later rounds and inference normalize with the fixed
global amplitude and never update it. Phases never leave the client. The messages and the server step are
at the end of this module (:data:`CLIENT_AMPLITUDE`, :data:`GLOBAL_AMPLITUDE`, :func:`update_input_state`), used
alike by the in-process and the Flower engine.

Where it acts: on float images scaled to [0, 1], *before* fednorm's per-channel mean/std
standardization (:class:`AmplitudePrepare` wraps :func:`fednorm.data.domain.normalize_batch`'s
steps). The paper says "images"; the official code puts the layer first in the network and feeds it
``ToTensor`` images in [0, 1] (Camelyon17; prostate: [0, 255]). Standardizing first would flip the
sign of the DC coefficient of images darker than the mean, and the average of |DC| would then be
reimposed with each image's own sign. Output values are not clamped (the code does not clamp).

Official-code variants (:meth:`AmplitudeNormalizer.official_code`):

* ``band_ratio``: the paper replaces the whole spectrum (``band_ratio=None``, default). The code
  calls an FDA-style swap (Yang & Soatto 2020) with ``L = 0``: only the centred window of
  half-width ``floor(min(H, W) * L)`` of the fftshifted spectrum is replaced, i.e. only the DC
  coefficient (each channel's mean intensity) for ``L = 0``. Any ``0 <= band_ratio <= 0.5`` gives
  that window.
* momentum: the code's Cython ``process`` types the momentum as ``int``, so 0.1 becomes 0 and the
  running amplitude stays the first training batch's mean amplitude: ``decay=0.0`` with
  ``init="first_batch"``.
* both are method options on top of ``amplitude_norm: code`` (``amplitude_band``: L, ``amplitude_decay``: v;
  :meth:`fednorm.methods.presets.Method.amplitude_settings`), e.g. the momentum the code meant, 0.1.
* the code updates the running amplitude at every forward pass until the amplitude is fixed (so
  twice per weight-perturbation step in round 1); here it is updated once per batch, where the
  batch is prepared, as Eq. 3 indexes it by batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

import torch
from torch import nn

if TYPE_CHECKING:
    from .presets import Method

INITS = ("first_batch", "zero")
DEFAULT_DECAY = 0.1
# the two variants' normalizer settings (AmplitudeNormalizer's keyword arguments): the paper's whole spectrum with
# v = 0.1 from zero, and the official code's DC coefficient (window L = 0) with its truncated momentum 0 from the
# first batch. One place: AmplitudeNormalizer.official_code, Method.amplitude_settings and the config's defaults
VARIANTS = {"full": {"band_ratio": None, "decay": DEFAULT_DECAY, "init": "zero"},
            "code": {"band_ratio": 0.0, "decay": 0.0, "init": "first_batch"}}


def _check_images(x: torch.Tensor, what: str = "images") -> None:
    if not isinstance(x, torch.Tensor) or x.ndim != 4:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"amplitude normalization expects {what} as an N x C x H x W tensor, got {shape}")
    if not x.is_floating_point():
        raise TypeError(
            f"amplitude normalization expects float {what} (scaled to [0, 1]), got {x.dtype}; "
            "convert uint8 images first (AmplitudePrepare does)"
        )


def _fft_dtype(x: torch.Tensor) -> torch.Tensor:
    # torch.fft has no bfloat16/half support on the CPU: compute in float32 at least
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def amplitude_phase(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Amplitude and phase (Eq. 2) of the per-channel 2-D DFT of real ``x`` over its last two dims."""
    spectrum = torch.fft.fft2(_fft_dtype(x))
    return spectrum.abs(), spectrum.angle()


def amplitude(x: torch.Tensor) -> torch.Tensor:
    """Per-channel 2-D DFT amplitude ``|F(x)|`` over the last two dims (same shape as ``x``)."""
    return torch.fft.fft2(_fft_dtype(x)).abs()


def reconstruct(amp: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
    """``real(IFFT2(amp * exp(j phase)))``; ``amp`` broadcasts against ``phase`` (e.g. C x H x W vs N x C x H x W)."""
    amp, phase = torch.broadcast_tensors(amp.to(phase.dtype), phase)
    return torch.fft.ifft2(torch.polar(amp, phase)).real


def low_frequency_mask(height: int, width: int, band_ratio: float, device=None) -> torch.Tensor:
    """Boolean H x W mask (unshifted DFT layout) of the FDA window the official code swaps.

    After ``fftshift`` the window is ``[c_h - b, c_h + b] x [c_w - b, c_w + b]`` with
    ``b = floor(min(H, W) * band_ratio)`` and ``c = floor(size / 2)`` (the DC term): frequencies
    ``-b..b`` along each axis, so ``band_ratio = 0`` selects the DC coefficient alone.
    """
    if not 0.0 <= band_ratio <= 0.5:
        raise ValueError(f"band_ratio must be in [0, 0.5] (0 = DC only), got {band_ratio}")
    b = int(min(height, width) * band_ratio)  # floor, as np.floor(...).astype(int) for non-negatives
    ch, cw = height // 2, width // 2
    shifted = torch.zeros(height, width, dtype=torch.bool, device=device)
    shifted[max(ch - b, 0) : ch + b + 1, max(cw - b, 0) : cw + b + 1] = True
    return torch.fft.ifftshift(shifted, dim=(-2, -1))


def swap_amplitude(x: torch.Tensor, target_amp: torch.Tensor, band_ratio: float | None = None) -> torch.Tensor:
    """Eq. 4: rebuild every image of ``x`` (N x C x H x W) from ``target_amp`` (C x H x W) and its own phase.

    ``band_ratio=None`` replaces the whole amplitude spectrum (paper); a number replaces only the
    centred low-frequency window of :func:`low_frequency_mask` and keeps the image's own amplitude
    elsewhere (official code, ``0`` = DC only). Returns the real part, in ``x``'s dtype.
    """
    _check_images(x)
    if target_amp.shape != x.shape[1:]:
        raise ValueError(
            f"the amplitude has shape {tuple(target_amp.shape)} but the images are {tuple(x.shape[1:])} "
            "(C x H x W): amplitude normalization needs every image of every client at one size"
        )
    amp, phase = amplitude_phase(x)
    target = target_amp.to(device=amp.device, dtype=amp.dtype)
    if band_ratio is None:
        new_amp = target.expand_as(amp)
    else:
        mask = low_frequency_mask(x.shape[-2], x.shape[-1], band_ratio, device=amp.device)
        new_amp = torch.where(mask, target, amp)
    return reconstruct(new_amp, phase).to(x.dtype)


def average_amplitudes(amplitudes: Sequence[torch.Tensor], weights: Sequence[float] | None = None) -> torch.Tensor:
    """The server's global amplitude: ``sum_i w_i A_i / sum_i w_i``.

    ``weights=None`` is Alg. 1 line 17's uniform mean ``(1/N) sum_i A_i`` (the code's uniform client
    weights too); pass data sizes or the aggregation weights p_i for a weighted mean.
    """
    amps = list(amplitudes)
    if not amps:
        raise ValueError("average_amplitudes needs at least one client amplitude")
    shape = amps[0].shape
    for i, a in enumerate(amps):
        if a.shape != shape:
            raise ValueError(
                f"client amplitudes must share one shape (C x H x W): #0 is {tuple(shape)}, #{i} is {tuple(a.shape)}"
            )
    if weights is None:
        w = torch.ones(len(amps), dtype=torch.float64)
    else:
        w = torch.as_tensor(list(weights), dtype=torch.float64)
        if w.shape != (len(amps),):
            raise ValueError(f"got {len(amps)} amplitudes but {w.numel()} weights")
        if (w < 0).any() or not torch.isfinite(w).all() or w.sum() <= 0:
            raise ValueError(f"amplitude weights must be finite, non-negative and not all zero, got {w.tolist()}")
    w = w / w.sum()
    stacked = torch.stack([a.detach().to(torch.float64) for a in amps])
    return torch.tensordot(w.to(stacked.device), stacked, dims=1).to(amps[0].dtype)


class AmplitudeNormalizer(nn.Module):
    """A client's amplitude normalizer: running average amplitude (Eq. 3) and normalization (Eq. 4).

    State lives in buffers, so ``state_dict()`` / ``load_state_dict()`` checkpoint it:
    ``running_amp`` (C x H x W; empty until the first update when ``shape`` is not given),
    ``num_updates`` (batches folded in) and ``frozen_flag`` (a global amplitude was set; no more updates).
    Keep it outside the model so that generic model aggregation never averages it by accident.

    ``normalizer(x)`` updates then normalizes when ``update`` is true; ``update=None`` means "when in
    training mode and not frozen" (``.train()`` / ``.eval()`` as for any module).
    """

    running_amp: torch.Tensor
    num_updates: torch.Tensor
    frozen_flag: torch.Tensor

    def __init__(
        self,
        shape: Sequence[int] | None = None,
        *,
        decay: float = DEFAULT_DECAY,
        init: str = "zero",
        band_ratio: float | None = None,
    ) -> None:
        super().__init__()
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"the amplitude decay v must be in [0, 1], got {decay}")
        if init not in INITS:
            raise ValueError(f"unknown amplitude init {init!r}; choose one of {', '.join(INITS)}")
        if init == "zero" and decay == 0.0:
            raise ValueError("init='zero' with decay=0 keeps the amplitude at zero forever; use init='first_batch'")
        if band_ratio is not None:
            low_frequency_mask(1, 1, band_ratio)  # validates the range
        if shape is not None:
            shape = tuple(int(s) for s in shape)
            if len(shape) != 3 or min(shape) < 1:
                raise ValueError(f"shape must be (C, H, W) with positive sizes, got {shape}")
        self.decay = float(decay)
        self.init = init
        self.band_ratio = band_ratio
        self.register_buffer("running_amp", torch.zeros(shape) if shape is not None else torch.zeros(0))
        self.register_buffer("num_updates", torch.zeros((), dtype=torch.long))
        self.register_buffer("frozen_flag", torch.zeros((), dtype=torch.bool))

    @classmethod
    def official_code(cls, shape: Sequence[int] | None = None, *, truncated_momentum: bool = True) -> "AmplitudeNormalizer":
        """The official repository's behaviour: DC-only swap (``L = 0``), first-batch initialisation,
        and momentum 0 (the Cython ``int`` truncation of 0.1); ``truncated_momentum=False`` keeps 0.1."""
        return cls(shape, **{**VARIANTS["code"], **({} if truncated_momentum else {"decay": DEFAULT_DECAY})})

    @classmethod
    def from_amplitude(cls, amp: torch.Tensor, *, band_ratio: float | None = None) -> "AmplitudeNormalizer":
        """A frozen normalizer holding a (global) amplitude: for later rounds and for inference."""
        norm = cls(tuple(amp.shape), band_ratio=band_ratio)
        norm.set_amplitude(amp)
        return norm

    # ------------------------------------------------------------------ state
    @property
    def frozen(self) -> bool:
        return bool(self.frozen_flag)

    @property
    def initialized(self) -> bool:
        return self.running_amp.numel() > 0 and (int(self.num_updates) > 0 or self.frozen)

    @property
    def amplitude(self) -> torch.Tensor:
        """The current average amplitude (C x H x W): what a client sends to the server after round 1."""
        if not self.initialized:
            raise RuntimeError("the amplitude normalizer has seen no batch yet and holds no amplitude")
        return self.running_amp

    @torch.no_grad()
    def set_amplitude(self, amp: torch.Tensor, *, freeze: bool = True) -> None:
        """Install the server's global amplitude (C x H x W) and, by default, freeze it (paper: fixed after round 1).

        ``freeze=False`` keeps updating from it (Alg. 1 as printed shares the amplitude every round).
        """
        if amp.ndim != 3:
            raise ValueError(f"an amplitude is C x H x W, got shape {tuple(amp.shape)}")
        if self.running_amp.numel() and self.running_amp.shape != amp.shape:
            raise ValueError(f"amplitude shape {tuple(amp.shape)} differs from this normalizer's {tuple(self.running_amp.shape)}")
        if (amp < 0).any() or not torch.isfinite(amp).all():
            raise ValueError("an amplitude must be finite and non-negative")
        self.running_amp = amp.detach().to(self.running_amp.device, torch.float32).clone()
        self.frozen_flag.fill_(freeze)
        if not freeze and int(self.num_updates) == 0:
            # unfrozen (Alg. 1's every-round sharing): Eq. 3 continues from this amplitude, which
            # therefore counts as the first value and is not overwritten by init="first_batch"
            self.num_updates.fill_(1)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # a lazily shaped normalizer (shape=None) accepts a checkpoint's C x H x W amplitude
        key = prefix + "running_amp"
        if key in state_dict and self.running_amp.shape != state_dict[key].shape and self.running_amp.numel() == 0:
            self.running_amp = torch.zeros_like(state_dict[key], device=self.running_amp.device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ------------------------------------------------------------- operation
    @torch.no_grad()
    def update(self, x: torch.Tensor) -> torch.Tensor:
        """Fold batch ``x`` (N x C x H x W) into the running amplitude (Eq. 3); returns the new average."""
        _check_images(x)
        if self.frozen:
            raise RuntimeError("this amplitude normalizer is frozen (it holds the global amplitude); it no longer updates")
        batch_mean = amplitude(x).mean(dim=0).to(torch.float32)  # (1/M) sum_m A(x_m)
        if self.running_amp.numel() == 0:
            self.running_amp = torch.zeros_like(batch_mean)
        elif self.running_amp.shape != batch_mean.shape:
            raise ValueError(
                f"batch images are {tuple(batch_mean.shape)} (C x H x W) but the running amplitude is "
                f"{tuple(self.running_amp.shape)}: amplitude normalization needs one image size"
            )
        batch_mean = batch_mean.to(self.running_amp.device)
        if int(self.num_updates) == 0 and self.init == "first_batch":
            self.running_amp.copy_(batch_mean)
        else:  # Eq. 3 as printed; with init="zero" Abar_0 = 0, so Abar_1 = v * batch mean
            self.running_amp.mul_(1.0 - self.decay).add_(batch_mean, alpha=self.decay)
        self.num_updates += 1
        return self.running_amp

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """Eq. 4 with the current average amplitude, without updating it."""
        return swap_amplitude(x, self.amplitude, self.band_ratio)

    def forward(self, x: torch.Tensor, update: bool | None = None) -> torch.Tensor:
        if update is None:
            update = self.training and not self.frozen
        if update:
            self.update(x)  # the batch is normalized with the *updated* average, Abar_k (Eq. 4)
        return self.normalize(x)

    def extra_repr(self) -> str:
        shape = tuple(self.running_amp.shape) if self.running_amp.numel() else "lazy"
        return f"shape={shape}, decay={self.decay}, init={self.init}, band_ratio={self.band_ratio}, frozen={self.frozen}"


class AmplitudePrepare:
    """A ``prepare`` step with amplitude normalization: uint8 -> [0, 1] -> Eq. 4 -> (x - mean) / std.

    The same steps as :func:`fednorm.data.domain.normalize_batch` with the normalizer in between
    (see the module docstring for why it acts before standardization). ``update`` as in
    :meth:`AmplitudeNormalizer.forward`: build one with ``update=None`` (or True) for round-1
    training and one with ``update=False`` for evaluation, or rely on ``.train()`` / ``.eval()``.
    """

    def __init__(
        self,
        normalizer: AmplitudeNormalizer,
        mean: Sequence[float] = (0.5,),
        std: Sequence[float] = (0.5,),
        *,
        update: bool | None = None,
    ) -> None:
        if len(mean) != len(std):
            raise ValueError(f"mean and std must have the same length, got {len(mean)} and {len(std)}")
        if any(s == 0 for s in std):
            raise ValueError(f"std must be non-zero, got {tuple(std)}")
        self.normalizer = normalizer
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        self.update = update

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.uint8:
            raise TypeError(f"AmplitudePrepare expects uint8 images (as fednorm's Split stores them), got {x.dtype}")
        if len(self.mean) > 1 and x.shape[1] != len(self.mean):
            raise ValueError(f"the standardization has {len(self.mean)} channel means, the images have {x.shape[1]} "
                             "channels")
        out = self.normalizer(x.float().div_(255.0), update=self.update)
        m = torch.tensor(self.mean, dtype=out.dtype, device=out.device).view(1, -1, 1, 1)
        s = torch.tensor(self.std, dtype=out.dtype, device=out.device).view(1, -1, 1, 1)
        return out.sub_(m).div_(s)


# --- The federation protocol (Alg. 1 lines 15-17), one place for every engine (in-process, Flower) ---
# Round 1: each client's message carries its running amplitude under CLIENT_AMPLITUDE; the server averages them once
# into the input state's GLOBAL_AMPLITUDE, which every later round broadcasts and every client freezes.
AMPLITUDE_PREFIX = "amp."
CLIENT_AMPLITUDE = AMPLITUDE_PREFIX + "client"
GLOBAL_AMPLITUDE = AMPLITUDE_PREFIX + "global"


def amplitude_normalizer(method: Method, global_amplitude: torch.Tensor | None) -> AmplitudeNormalizer:
    """A client's normalizer under ``method``'s amplitude normalization (:meth:`Method.amplitude_settings`: the
    variant's window, decay and start, or the method's own): its running amplitude (round 1), or the frozen global
    one afterwards (same window)."""
    settings = method.amplitude_settings()
    if global_amplitude is not None:
        return AmplitudeNormalizer.from_amplitude(global_amplitude, band_ratio=settings["band_ratio"])
    return AmplitudeNormalizer(**settings)


def client_amplitude_message(normalizer: AmplitudeNormalizer | None) -> dict[str, torch.Tensor]:
    """What a client adds to its message after training: its running amplitude while it is not frozen (round 1)."""
    if normalizer is None or normalizer.frozen:
        return {}
    return {CLIENT_AMPLITUDE: normalizer.amplitude.detach().clone()}


def amplitude_entries(message: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A client message's amplitude entries (``amp.*``), which go to the input state."""
    return {k: v for k, v in message.items() if k.startswith(AMPLITUDE_PREFIX)}


def without_amplitudes(message: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A client message without its amplitude entries: the client algorithm's part (SCAFFOLD's, MOON's, ...)."""
    return {k: v for k, v in message.items() if not k.startswith(AMPLITUDE_PREFIX)}


def update_input_state(input_state: dict[str, torch.Tensor], messages: Sequence[Mapping[str, torch.Tensor]]
                       ) -> dict[str, torch.Tensor]:
    """HarmoFL's server step for the inputs: the first round's client amplitudes averaged (uniformly, Alg. 1
    line 17) into the global amplitude, which is then broadcast and frozen (later messages carry none)."""
    amps = [m[CLIENT_AMPLITUDE] for m in messages if CLIENT_AMPLITUDE in m]
    if not amps or GLOBAL_AMPLITUDE in input_state:
        return input_state
    return {**input_state, GLOBAL_AMPLITUDE: average_amplitudes(amps)}
