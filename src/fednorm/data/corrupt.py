"""Corrupted domains: the 15 corruptions of Hendrycks & Dietterich (ICLR 2019) on any base domain.

UniFed (Sec. 4.1) builds its benchmark from CIFAR-10-C, one client per corruption. Here any domain
the federation builder knows can be corrupted, so the benchmark also runs offline on MNIST-M or
PACS photos. The domain name is

    ``corrupt/<corruption>/<severity>/<base domain>``, e.g. ``corrupt/fog/3/mnistm``,
    ``corrupt/glass_blur/5/pacs/photo``, ``corrupt/snow/2/cifar10/test``,

with ``<corruption>`` one of :data:`CORRUPTIONS` and ``<severity>`` 1..5. The base domain comes
last because it may itself contain slashes. A corrupted domain keeps the base's labels, size,
splits and origin (corruptions of real images are how CIFAR-10-C itself is made).

Images are corrupted with the ``imagecorruptions`` package (Michaelis et al. 2019, the reference
ImageNet-C code made importable), which must be installed. Choices:

* Parameters are imagecorruptions' (ImageNet-C's, tuned for 224 x 224). The official CIFAR-10-C
  files were made with milder CIFAR-specific constants, so ``corrupt/*/*/cifar10/test`` is a
  CIFAR-10-C *style* benchmark, not the released files (those are the domains
  ``cifar10c/<corruption>/<severity>``, :mod:`fednorm.data.cifar10c`).
* imagecorruptions refuses images under 32 x 32. A smaller image (28 x 28 digits) is upsampled so
  its shorter side is 32 (PIL bilinear), corrupted, and downsampled back to its size (PIL
  bilinear, antialiased). Noise is therefore slightly low-passed on such images.
* Determinism: image ``i`` is corrupted with NumPy's global generator seeded from
  ``(seed, corruption, severity, base domain, i)`` (imagecorruptions draws from the global
  generator); the caller's global random state is saved and restored. A result does not depend on
  which other images are corrupted in the same call, so a preview of a few images equals the same
  images of the whole pool.
* Compatibility: imagecorruptions 1.1.2 (its latest release) predates NumPy 2, scikit-image 0.19
  and setuptools 81. :func:`_imagecorruptions` patches, inside that package's module only, the
  four things that broke (``np.float_``, ``gaussian(multichannel=)``, ``pkg_resources``, and the
  unseeded generator of ``skimage.util.random_noise`` used by impulse noise); the corruption maths
  is untouched.
* Cache: a corrupted pool is written once to ``<cache>/corrupted/`` (``$FEDNORM_CACHE``, else the
  per-user cache folder that is also the default data folder; never the data folder itself,
  which may be a shared read-only copy), keyed by the base images' sha256, the corruption,
  severity, seed and package version, and re-generated whenever any of them changes.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import torch

from .domain import DataError

CORRUPTIONS = (
    "gaussian_noise", "shot_noise", "impulse_noise",
    "defocus_blur", "glass_blur", "motion_blur", "zoom_blur",
    "snow", "frost", "fog", "brightness",
    "contrast", "elastic_transform", "pixelate", "jpeg_compression",
)
SEVERITIES = (1, 2, 3, 4, 5)
# Hendrycks & Dietterich's four types (Fig. 1 of their paper: brightness is a weather effect).
CORRUPTION_TYPES = {
    "noise": CORRUPTIONS[0:3],
    "blur": CORRUPTIONS[3:7],
    "weather": CORRUPTIONS[7:11],
    "digital": CORRUPTIONS[11:15],
}
# UniFed's leave-one-type-out table has noise N1-N3, blur B1-B4, weather W1-W3 and digital D1-D5:
# it counts one weather corruption as digital. Brightness is the only one that is not a weather
# phenomenon, so it is put there [inferred; the paper does not map indices to corruptions].
UNIFED_TYPES = {
    "noise": CORRUPTIONS[0:3],
    "blur": CORRUPTIONS[3:7],
    "weather": ("snow", "frost", "fog"),
    "digital": ("brightness", "contrast", "elastic_transform", "pixelate", "jpeg_compression"),
}
PREFIX = "corrupt/"
MIN_SIDE = 32  # imagecorruptions.corrupt refuses smaller images
CACHE_ENV = "FEDNORM_CACHE"
_FORMAT = 1  # bump when the way images are corrupted changes: invalidates every cache file


def corruption_domains(base: str, severity: int, corruptions: tuple[str, ...] = CORRUPTIONS) -> list[str]:
    """The domain names of ``corruptions`` (default: all 15, UniFed's clients) of ``base`` at ``severity``."""
    return [f"{PREFIX}{c}/{severity}/{base}" for c in corruptions]


def corruption_type_fold(held: str, domains: list[str]) -> tuple[list[str], list[str]]:
    """UniFed's leave-one-corruption-type-out fold (Table III): of UniFed's 15 corruptions of one set at one
    severity, those of the three types other than ``held`` are the internal clients and those of ``held`` the
    external ones (noise 3, blur 4, weather 3, digital 5: 12, 11, 12 or 10 internal clients). ``domains`` are
    corrupted domains naming the set and severity, generated (``corrupt/<c>/<s>/<base>``) or released CIFAR-10-C
    (``cifar10c/<c>/<s>``); returns (internal domains, external domains) in UniFed's column order."""
    if held not in UNIFED_TYPES:
        raise ValueError(f"unknown corruption type {held!r}; choose one of {', '.join(UNIFED_TYPES)}")
    sets = set()
    for name in domains:
        if name.startswith(PREFIX):
            _, severity, base = parse_corrupt_name(name)
            sets.add((severity, base))
        elif name.startswith("cifar10c/"):
            from .cifar10c import parse_cifar10c_name

            sets.add((parse_cifar10c_name(name)[1], None))
        else:
            raise ValueError(f"a corruption-type fold needs corrupted domains (corrupt/<corruption>/<severity>/<base> "
                             f"or cifar10c/<corruption>/<severity>); {name!r} is not one")
    if len(sets) != 1:
        found = ", ".join(f"cifar10c severity {s}" if b is None else f"{b} severity {s}" for s, b in sorted(
            sets, key=str)) or "none"
        raise ValueError(f"a corruption-type fold needs the corruptions of one set at one severity; the domains "
                         f"give {found}")
    severity, base = sets.pop()

    def domain(corruption: str) -> str:
        return f"cifar10c/{corruption}/{severity}" if base is None else f"{PREFIX}{corruption}/{severity}/{base}"

    internal = [domain(c) for kind, members in UNIFED_TYPES.items() if kind != held for c in members]
    return internal, [domain(c) for c in UNIFED_TYPES[held]]


def parse_corrupt_name(name: str) -> tuple[str, int, str]:
    """``corrupt/<corruption>/<severity>/<base>`` -> ``(corruption, severity, base)``; ValueError if malformed."""
    parts = name[len(PREFIX):].split("/", 2) if name.startswith(PREFIX) else []
    if len(parts) != 3 or not all(parts):
        raise ValueError(f"corrupted domain names are corrupt/<corruption>/<severity>/<base domain>, got {name!r}")
    corruption, severity, base = parts
    if corruption not in CORRUPTIONS:
        raise ValueError(f"unknown corruption {corruption!r} in {name!r}; choose one of {', '.join(CORRUPTIONS)}")
    if severity not in {str(s) for s in SEVERITIES}:
        raise ValueError(f"severity must be 1..5 in {name!r}, got {severity!r}")
    return corruption, int(severity), base


# --- imagecorruptions, made to work with current NumPy / scikit-image / setuptools ---------------


class _NumpyCompat(types.ModuleType):
    """NumPy as seen by imagecorruptions: adds ``np.float_`` (removed in NumPy 2.0)."""

    def __init__(self) -> None:
        super().__init__("numpy")

    def __getattr__(self, name):
        if name == "float_":
            return np.float64
        return getattr(np, name)


def _patch(module) -> None:
    from skimage import color, filters, util

    def gaussian(image, sigma=1, multichannel=None, **kwargs):
        if multichannel is not None:  # removed in scikit-image 0.19: channel_axis replaces it
            kwargs["channel_axis"] = -1 if multichannel else None
        return filters.gaussian(image, sigma=sigma, **kwargs)

    def random_noise(image, mode="gaussian", rng=None, **kwargs):
        # scikit-image >= 0.19 ignores np.random.seed: draw its seed from the seeded global generator.
        if rng is None:
            rng = int(np.random.randint(0, 2**31 - 1))
        return util.random_noise(image, mode=mode, rng=rng, **kwargs)

    def resource_filename(package: str, path: str) -> str:
        return str(Path(sys.modules[package].__file__).parent / path)

    module.np = _NumpyCompat()
    module.gaussian = gaussian
    module.sk = types.SimpleNamespace(util=types.SimpleNamespace(random_noise=random_noise), color=color)
    module.resource_filename = resource_filename


_PACKAGE = None


def _imagecorruptions():
    """The ``imagecorruptions`` package, patched once (see the module docstring)."""
    global _PACKAGE
    if _PACKAGE is not None:
        return _PACKAGE
    shim = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pkg_resources warns that it is deprecated
            importlib.import_module("pkg_resources")
    except ImportError:  # setuptools >= 81 has no pkg_resources: give the import what it needs
        shim = types.ModuleType("pkg_resources")
        shim.resource_filename = lambda package, path: str(Path(sys.modules[package].__file__).parent / path)
        sys.modules["pkg_resources"] = shim
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            package = importlib.import_module("imagecorruptions")
            module = importlib.import_module("imagecorruptions.corruptions")
    except ImportError as exc:
        raise DataError("Corrupted domains need the imagecorruptions package: pip install imagecorruptions "
                        f"({exc})") from exc
    finally:
        if shim is not None and sys.modules.get("pkg_resources") is shim:
            del sys.modules["pkg_resources"]
    _patch(module)
    _PACKAGE = package
    return package


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("imagecorruptions")
    except Exception:  # noqa: BLE001 - metadata may be missing for a source checkout
        return "unknown"


# --- corrupting images ---------------------------------------------------------------------------


def _image_seed(seed: int, corruption: str, severity: int, base: str, index: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{corruption}/{severity}/{base}/{index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def _resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.fromarray(image).resize((width, height), Image.BILINEAR), dtype=np.uint8)


def corrupt_image(image: np.ndarray, corruption: str, severity: int, *, seed: int) -> np.ndarray:
    """One (H, W, 3) uint8 image corrupted deterministically (NumPy's global state is restored).

    Images smaller than 32 x 32 are upsampled, corrupted and downsampled back (module docstring).
    """
    package = _imagecorruptions()
    h, w = image.shape[:2]
    small = min(h, w) < MIN_SIDE
    work = image
    if small:
        scale = MIN_SIDE / min(h, w)
        work = _resize(image, max(MIN_SIDE, round(h * scale)), max(MIN_SIDE, round(w * scale)))
    state = np.random.get_state()
    try:
        np.random.seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = package.corrupt(np.ascontiguousarray(work), corruption_name=corruption, severity=severity)
    finally:
        np.random.set_state(state)
    out = np.asarray(out, dtype=np.uint8)
    if out.shape != work.shape:  # some blurs may return a cropped image: put it back on the canvas
        fixed = work.copy()
        fixed[: out.shape[0], : out.shape[1]] = out[: work.shape[0], : work.shape[1]]
        out = fixed
    if small:
        out = _resize(out, h, w)
    return out


def corrupt_images(
    x: torch.Tensor,
    corruption: str,
    severity: int,
    *,
    seed: int,
    base: str,
    positions: list[int] | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """Corrupt uint8 (N, 3, H, W) images; image ``i`` uses its own seed (see the module docstring).

    ``positions``: the index of each image of ``x`` in its whole pool (default ``0..N-1``), which
    seeds it; corrupting a few images with their positions gives the same result as corrupting
    the whole pool. ``base`` is the base domain's name, also part of every seed.
    """
    if corruption not in CORRUPTIONS:
        raise ValueError(f"unknown corruption {corruption!r}; choose one of {', '.join(CORRUPTIONS)}")
    if severity not in SEVERITIES:
        raise ValueError(f"severity must be 1..5, got {severity!r}")
    if x.dtype != torch.uint8 or x.ndim != 4 or x.shape[1] != 3:
        raise ValueError(f"images must be uint8 (N, 3, H, W), got {x.dtype} {tuple(x.shape)}")
    pos = list(range(x.shape[0])) if positions is None else [int(i) for i in positions]
    if len(pos) != x.shape[0]:
        raise ValueError(f"positions has {len(pos)} entries for {x.shape[0]} images")
    nhwc = x.permute(0, 2, 3, 1).numpy()
    out = np.empty_like(nhwc)
    bar = None
    if progress and pos:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        bar = Progress(TextColumn(f"{corruption} {severity} of {base}"), BarColumn(), MofNCompleteColumn(),
                       TimeRemainingColumn())
        bar.start()
        task = bar.add_task("corrupt", total=len(pos))
    try:
        for k, i in enumerate(pos):
            out[k] = corrupt_image(nhwc[k], corruption, severity, seed=_image_seed(seed, corruption, severity, base, i))
            if bar is not None and (k % 64 == 63 or k == len(pos) - 1):
                bar.update(task, completed=k + 1)
    finally:
        if bar is not None:
            bar.stop()
    return torch.from_numpy(out).permute(0, 3, 1, 2).contiguous()


# --- the cache -------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Where corrupted pools are cached: ``$FEDNORM_CACHE/corrupted``, else the user cache folder's."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser() / "corrupted"
    import platformdirs

    return Path(platformdirs.user_cache_dir("fednorm")) / "corrupted"


def _cache_key(x: torch.Tensor, corruption: str, severity: int, seed: int, base: str) -> str:
    h = hashlib.sha256()
    h.update(str(tuple(x.shape)).encode())
    h.update(x.contiguous().numpy().tobytes())
    return json.dumps({"format": _FORMAT, "package": _version(), "base": base, "base_sha256": h.hexdigest(),
                       "corruption": corruption, "severity": severity, "seed": seed}, sort_keys=True)


def _cache_path(key: str, corruption: str, severity: int) -> Path:
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return cache_dir() / f"{corruption}_s{severity}_{digest}.npz"


def _read_cache(path: Path, key: str, shape: tuple[int, ...]) -> torch.Tensor | None:
    try:
        with np.load(path, allow_pickle=False) as f:
            if str(f["key"]) != key or f["x"].shape != shape or f["x"].dtype != np.uint8:
                return None
            return torch.from_numpy(f["x"].copy())
    except Exception:  # noqa: BLE001 - an unreadable cache file is simply regenerated
        return None


def _write_cache(path: Path, key: str, x: torch.Tensor) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with tmp.open("wb") as fh:
            np.savez(fh, x=x.numpy(), key=np.array(key))
        os.replace(tmp, path)
    except OSError:  # a read-only cache folder only costs the regeneration next time
        pass


def corrupt_pool(
    x: torch.Tensor,
    corruption: str,
    severity: int,
    *,
    seed: int,
    base: str,
    cache: bool = True,
    progress: bool = False,
) -> torch.Tensor:
    """All images of a pool corrupted (see :func:`corrupt_images`), read from / written to the cache."""
    if not cache:
        return corrupt_images(x, corruption, severity, seed=seed, base=base, progress=progress)
    key = _cache_key(x, corruption, severity, seed, base)
    path = _cache_path(key, corruption, severity)
    if path.is_file():
        cached = _read_cache(path, key, tuple(x.shape))
        if cached is not None:
            return cached
    out = corrupt_images(x, corruption, severity, seed=seed, base=base, progress=progress)
    _write_cache(path, key, out)
    return out
