"""Procedurally rendered digits: an embedded multi-domain benchmark that needs no download.

In the spirit of SynthDigits (Ganin & Lempitsky, 2015), digits 0-9 are drawn from the fonts that
ship with matplotlib (DejaVu, STIX, Computer Modern) with random position, size, rotation, shear,
stroke width, colours, background texture, blur and noise. Each rendering style is one domain, and
the styles differ the way MNIST, MNIST-M, SVHN, SynthDigits and USPS differ (grey vs colour, light
vs dark backgrounds, clutter, stroke thickness, noise). This is a rendered stand-in, not a real
dataset: numbers obtained on it are not comparable with published results on the real benchmarks.

Styles (see :data:`RENDER_STYLES`):

* ``print``    - dark grey digits on light paper, clean, mild jitter (USPS / MNIST-like).
* ``neon``     - thin saturated glowing digits on dark backgrounds.
* ``synth``    - random-colour digits on random-colour backgrounds, any font (SynthDigits-like).
* ``street``   - house-number crops with cut neighbour digits, gradients, low contrast (SVHN-like).
* ``textured`` - thick digits that invert a colourful texture (MNIST-M-like).
* ``outline``  - hollow coloured outline digits on pale backgrounds.

Each (font, digit) glyph is rasterised once with PIL and cached; every sample is then produced with
batched torch ops from a ``torch.Generator`` seeded by (seed, style), so output is deterministic and
the global random state is left untouched.

The same bytes on every CPU: torch hands exp/sin/cos, matrix products, LAPACK's inverse and some
convolutions to MKL, and runs random normals, grid sampling, bicubic resizing and reductions in kernels
chosen by the instruction set (AVX2, AVX-512, or plain C on ARM and old x86), all of which differ in the
last bit; a last-bit difference moves a pixel across a rounding step to uint8 (about ten pixels of a
9,298-image pool did between AVX2 and AVX-512 machines, so a run started on one could not resume on the
other). Rendering therefore takes transcendentals in float64 rounded to float32 (:func:`_exactly`), and
writes every other computation as single elementwise operations in a fixed order (products, the 2x2
inverse, sums, the blur, bilinear sampling, bicubic resizing, the Box-Muller step of random normals),
which IEEE rounds the same everywhere. Each replaces a torch call with the same draws from the generator and
the same result up to the last bit, so the images are those torch's kernels drew.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fednorm.data.domain import Split

__all__ = ["RENDER_STYLES", "RenderStyle", "render_digits", "rendered_domain"]

_GLYPH = 64  # side of the cached glyph canvas in pixels
_GLYPH_HEIGHT = 0.70  # digit height as a fraction of the canvas
_CHUNK = 512  # samples rendered per batch (bounds memory; fixed so output never depends on it)
_LUMA = torch.tensor([0.299, 0.587, 0.114])

_SANS = ("DejaVuSans.ttf", "DejaVuSans-Oblique.ttf", "cmss10.ttf")
_SANS_BOLD = ("DejaVuSans-Bold.ttf", "DejaVuSans-BoldOblique.ttf")
_SERIF = ("DejaVuSerif.ttf", "DejaVuSerif-Italic.ttf", "STIXGeneral.ttf", "STIXGeneralItalic.ttf", "cmr10.ttf")
_SERIF_BOLD = ("DejaVuSerif-Bold.ttf", "DejaVuSerif-BoldItalic.ttf", "STIXGeneralBol.ttf", "STIXGeneralBolIta.ttf")
_MONO = ("DejaVuSansMono.ttf", "DejaVuSansMono-Oblique.ttf", "cmtt10.ttf")
_MONO_BOLD = ("DejaVuSansMono-Bold.ttf", "DejaVuSansMono-BoldOblique.ttf")


@dataclass(frozen=True)
class RenderStyle:
    """All parameters of one rendering style (one domain). Ranges are (low, high), sampled uniformly.

    Geometry is in units of the output image: ``scale`` 1 draws a digit about 70 % of the image
    tall, ``shift`` is the largest offset as a fraction of the half-width. Colours are HSV
    saturation/value ranges with uniformly random hue; ``blur`` is a gaussian sigma and ``noise``
    a gaussian std, both in output pixels / [0, 1] intensity units.
    """

    description: str
    fonts: tuple[str, ...]
    strokes: tuple[int, ...] = (0,)  # morphological stroke change at glyph resolution (<0 thins, >0 thickens)
    outline: bool = False  # draw only a ring around each stroke (hollow digits)
    rotation: float = 0.0  # max |degrees|
    scale: tuple[float, float] = (1.0, 1.0)
    aspect: tuple[float, float] = (1.0, 1.0)  # horizontal stretch
    shear: float = 0.0  # max |shear factor|
    shift: float = 0.0
    neighbours: float = 0.0  # probability of a cut neighbour digit on each side
    fg_sat: tuple[float, float] = (0.0, 0.0)
    fg_val: tuple[float, float] = (0.0, 0.0)
    bg_sat: tuple[float, float] = (0.0, 0.0)
    bg_val: tuple[float, float] = (1.0, 1.0)
    swap: float = 0.0  # probability of swapping digit and background colours
    min_contrast: float = 0.0  # minimum luminance difference between digit and background
    fg_inverts_bg: bool = False  # digit pixels are the colour-inverted background (MNIST-M)
    gradient: float = 0.0  # max strength of a linear blend towards a second background colour
    texture: float = 0.0  # amplitude of multi-scale background texture
    texture_colour: float = 0.0  # 0: grey texture, 1: independent texture per channel
    glow: float = 0.0  # strength of a blurred halo in the digit colour
    shading: float = 0.0  # max strength of a multiplicative lighting gradient over the whole image
    blur: tuple[float, float] = (0.0, 0.0)
    noise: tuple[float, float] = (0.0, 0.0)


RENDER_STYLES: dict[str, RenderStyle] = {
    "print": RenderStyle(
        description="dark grey digits on light paper, clean, mild jitter, several fonts (USPS/MNIST-like)",
        fonts=_SANS + _SERIF + _MONO,
        strokes=(0, 1, 2),
        rotation=10.0,
        scale=(0.8, 1.15),
        aspect=(0.8, 1.15),
        shear=0.15,
        shift=0.15,
        fg_sat=(0.0, 0.08),
        fg_val=(0.0, 0.3),
        bg_sat=(0.0, 0.06),
        bg_val=(0.82, 1.0),
        texture=0.03,
        blur=(0.3, 0.8),
        noise=(0.0, 0.05),
    ),
    "neon": RenderStyle(
        description="thin bright saturated digits with a glow on dark backgrounds",
        fonts=_SANS + _SANS_BOLD[:1] + _MONO[:1] + _MONO_BOLD[:1],
        strokes=(-1, 0),
        rotation=15.0,
        scale=(0.75, 1.15),
        aspect=(0.8, 1.2),
        shear=0.2,
        shift=0.2,
        fg_sat=(0.65, 1.0),
        fg_val=(0.75, 1.0),
        bg_sat=(0.2, 0.8),
        bg_val=(0.02, 0.2),
        min_contrast=0.2,
        gradient=0.6,
        glow=1.5,
        blur=(0.4, 1.0),
        noise=(0.02, 0.08),
    ),
    "synth": RenderStyle(
        description="random-colour digit on random-colour background, any font, rotation, blur, noise (SynthDigits-like)",
        fonts=_SANS + _SANS_BOLD + _SERIF + _SERIF_BOLD + _MONO + _MONO_BOLD,
        strokes=(0, 1, 2),
        rotation=20.0,
        scale=(0.7, 1.2),
        aspect=(0.75, 1.25),
        shear=0.25,
        shift=0.2,
        neighbours=0.3,
        fg_sat=(0.0, 1.0),
        fg_val=(0.0, 1.0),
        bg_sat=(0.0, 1.0),
        bg_val=(0.0, 1.0),
        min_contrast=0.3,
        gradient=0.4,
        blur=(0.0, 1.2),
        noise=(0.0, 0.08),
    ),
    "street": RenderStyle(
        description="centred house-number digit with cut neighbours, gradient/textured plate, low contrast, blur (SVHN-like)",
        fonts=_SANS_BOLD + _SERIF_BOLD[:3] + _MONO_BOLD[:1] + ("DejaVuSans.ttf", "cmr10.ttf"),
        strokes=(0, 1, 2),
        rotation=10.0,
        scale=(0.95, 1.25),
        aspect=(0.8, 1.15),
        shear=0.15,
        shift=0.1,
        neighbours=0.85,
        fg_sat=(0.0, 0.5),
        fg_val=(0.0, 0.35),
        bg_sat=(0.1, 0.6),
        bg_val=(0.35, 0.85),
        swap=0.5,
        min_contrast=0.2,
        gradient=0.8,
        texture=0.12,
        texture_colour=0.3,
        shading=0.5,
        blur=(0.6, 1.4),
        noise=(0.01, 0.05),
    ),
    "textured": RenderStyle(
        description="thick digits that colour-invert a colourful texture background (MNIST-M-like)",
        fonts=_SANS_BOLD[:1] + _SERIF_BOLD[:1] + ("STIXGeneralBol.ttf", "DejaVuSans.ttf"),
        strokes=(0, 1, 2),
        rotation=15.0,
        scale=(0.8, 1.15),
        aspect=(0.8, 1.15),
        shear=0.15,
        shift=0.15,
        bg_sat=(0.3, 0.9),
        bg_val=(0.2, 0.45),
        fg_inverts_bg=True,
        texture=0.35,
        texture_colour=1.0,
        blur=(0.2, 0.6),
        noise=(0.0, 0.03),
    ),
    "outline": RenderStyle(
        description="hollow coloured outline digits on pale pastel backgrounds",
        fonts=_SANS_BOLD + _SERIF_BOLD[:1] + ("STIXGeneralBol.ttf",) + _MONO_BOLD[:1],
        strokes=(1, 2, 3),
        outline=True,
        rotation=15.0,
        scale=(0.85, 1.15),
        aspect=(0.85, 1.15),
        shear=0.2,
        shift=0.15,
        fg_sat=(0.6, 1.0),
        fg_val=(0.35, 0.8),
        bg_sat=(0.05, 0.25),
        bg_val=(0.85, 1.0),
        min_contrast=0.3,
        gradient=0.5,
        blur=(0.2, 0.6),
        noise=(0.0, 0.04),
    ),
}


def _font_path(name: str) -> Path:
    import matplotlib

    return Path(matplotlib.get_data_path()) / "fonts" / "ttf" / name


@functools.lru_cache(maxsize=None)
def _font_glyphs(font: str) -> torch.Tensor:
    """The ten digits of one font, ink-centred on a blank canvas: float (10, G, G) in [0, 1]."""
    from PIL import Image, ImageDraw, ImageFont

    pt = 160
    ttf = ImageFont.truetype(str(_font_path(font)), pt)
    out = np.zeros((10, _GLYPH, _GLYPH), dtype=np.float32)
    for d in range(10):
        img = Image.new("L", (3 * pt, 3 * pt), 0)
        ImageDraw.Draw(img).text((pt, pt // 2), str(d), font=ttf, fill=255)
        box = img.getbbox()
        if box is None:
            raise ValueError(f"font {font} has no glyph for digit {d}")
        glyph = img.crop(box)
        k = min(_GLYPH_HEIGHT * _GLYPH / glyph.height, 0.9 * _GLYPH / glyph.width)
        w, h = max(1, round(glyph.width * k)), max(1, round(glyph.height * k))
        glyph = glyph.resize((w, h), Image.Resampling.LANCZOS)
        x0, y0 = (_GLYPH - w) // 2, (_GLYPH - h) // 2
        out[d, y0 : y0 + h, x0 : x0 + w] = np.asarray(glyph, dtype=np.float32) / 255.0
    return torch.from_numpy(out)


def _morph(x: torch.Tensor, k: int) -> torch.Tensor:
    """Dilate (k > 0) or erode (k < 0) soft masks (N, 1, H, W) with a (2|k|+1) square."""
    if k == 0:
        return x
    r = abs(k)
    if k > 0:
        return F.max_pool2d(x, 2 * r + 1, stride=1, padding=r)
    return -F.max_pool2d(-x, 2 * r + 1, stride=1, padding=r)


@functools.lru_cache(maxsize=None)
def _glyph_bank(fonts: tuple[str, ...], strokes: tuple[int, ...], outline: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """All (font, stroke, digit) masks as (F*S*10, 1, G, G) plus each glyph's half-width in [-1, 1] units."""
    masks = []
    for font in fonts:
        base = _font_glyphs(font).unsqueeze(1)
        for s in strokes:
            m = _morph(base, s)
            if outline:
                m = (_morph(m, 3) - m).clamp_(0.0, 1.0)
            masks.append(m)
    # pre-filter so that bilinear sampling straight down to the output size does not alias
    bank = F.avg_pool2d(torch.cat(masks), 3, stride=1, padding=1, count_include_pad=False)
    cols = (bank[:, 0] > 0.3).any(dim=1)  # (N, G) ink columns
    idx = torch.arange(_GLYPH).expand_as(cols)
    left = torch.where(cols, idx, _GLYPH).amin(dim=1)
    right = torch.where(cols, idx, -1).amax(dim=1)
    half_width = (right - left + 1).clamp(min=1).float() / _GLYPH
    return bank, half_width


def _exactly(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for a float32 tensor, the same on every CPU: evaluated in float64 (where instruction sets
    differ in the last bit) and rounded to float32, which takes that bit away."""
    return fn(x.double()).float()


def _luma(rgb: torch.Tensor) -> torch.Tensor:
    """Luminance of (N, 3) colours, summed in a fixed order (a matrix product's order depends on the CPU)."""
    return _LUMA[0] * rgb[:, 0] + _LUMA[1] * rgb[:, 1] + _LUMA[2] * rgb[:, 2]


def _normal(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """``torch.randn(*shape, generator=gen)`` with the same draws from ``gen`` and the same Box-Muller pairing
    as torch's CPU kernel (uniforms in blocks of 16: the first 8 give radii, the last 8 angles; a last partial
    block is redrawn whole), its transcendentals in float64 (the kernel's float32 ones depend on the CPU)."""
    size = math.prod(shape)
    if size < 16:  # torch draws each one in float64 on every CPU
        return torch.randn(*shape, generator=gen)

    def box_muller(u: torch.Tensor) -> torch.Tensor:  # (blocks, 16) uniforms -> normals, in place of them
        radius = _exactly(lambda v: torch.sqrt(-2.0 * torch.log(v)), 1.0 - u[:, :8])
        theta = 2.0 * math.pi * u[:, 8:]
        return torch.cat([radius * _exactly(torch.cos, theta), radius * _exactly(torch.sin, theta)], 1)

    whole = size // 16 * 16
    out = torch.empty(size)
    out[:whole] = box_muller(torch.rand(size, generator=gen)[:whole].view(-1, 16)).reshape(-1)
    if size % 16:
        out[size - 16 :] = box_muller(torch.rand(1, 16, generator=gen)).reshape(-1)
    return out.view(*shape)


def _bilinear_sample(images: torch.Tensor, gx: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
    """``F.grid_sample(images, stack([gx, gy], -1), align_corners=False)`` (bilinear, zeros outside), written
    out: images (N, 1, H, W), gx / gy (N, h, w) in [-1, 1] units -> (N, 1, h, w)."""
    n, _, height, width = images.shape
    ix = ((gx + 1.0) * width - 1.0) / 2.0
    iy = ((gy + 1.0) * height - 1.0) / 2.0
    x0, y0 = ix.floor(), iy.floor()
    wx1, wy1 = ix - x0, iy - y0
    wx0, wy0 = 1.0 - wx1, 1.0 - wy1
    # two zero pixels around every image: a corner outside the image reads a zero, so no masks are needed (a
    # top-left corner clamped to [-2, size] keeps both of its columns / rows outside when it was outside)
    padded_width = width + 4
    flat = F.pad(images, (2, 2, 2, 2)).reshape(n, (height + 4) * padded_width)
    top_left = ((y0.long().clamp(-2, height) + 2) * padded_width + x0.long().clamp(-2, width) + 2).reshape(n, -1)

    def at(offset: int) -> torch.Tensor:
        return flat.gather(1, top_left + offset).view_as(gx)

    top = at(0) * wx0 + at(1) * wx1
    bottom = at(padded_width) * wx0 + at(padded_width + 1) * wx1
    return (top * wy0 + bottom * wy1).unsqueeze(1)


def _cubic_taps(size_in: int, size_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Source indices (4, size_out) and weights (4, size_out) of PyTorch's bicubic resize (align_corners=False,
    A = -0.75, edge indices clamped)."""
    scale = size_in / size_out
    src = (torch.arange(size_out, dtype=torch.float32) + 0.5) * scale - 0.5
    base = src.floor()
    t = src - base
    a = -0.75

    def near(d: torch.Tensor) -> torch.Tensor:  # |d| <= 1
        return ((a + 2.0) * d - (a + 3.0)) * d * d + 1.0

    def far(d: torch.Tensor) -> torch.Tensor:  # 1 < |d| < 2
        return ((a * d - 5.0 * a) * d + 8.0 * a) * d - 4.0 * a

    weights = torch.stack([far(t + 1.0), near(t), near(1.0 - t), far(2.0 - t)])
    index = torch.stack([base.long() + k for k in (-1, 0, 1, 2)]).clamp(0, size_in - 1)
    return index, weights


def _bicubic_resize(x: torch.Tensor, size: int) -> torch.Tensor:
    """``F.interpolate(x, size=(size, size), mode="bicubic", align_corners=False)`` of square images
    (N, C, S, S), written out: columns, then rows, the four taps summed in order."""
    index, weights = _cubic_taps(x.shape[-1], size)
    cols = x.index_select(-1, index[0]) * weights[0]
    for k in range(1, 4):
        cols = cols + x.index_select(-1, index[k]) * weights[k]
    out = cols.index_select(-2, index[0]) * weights[0][:, None]
    for k in range(1, 4):
        out = out + cols.index_select(-2, index[k]) * weights[k][:, None]
    return out


def _uniform(gen: torch.Generator, n: int, lo_hi: tuple[float, float]) -> torch.Tensor:
    lo, hi = lo_hi
    return lo + (hi - lo) * torch.rand(n, generator=gen)


def _hsv_to_rgb(h: torch.Tensor, s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Vectors of hue/saturation/value in [0, 1] -> (N, 3) RGB."""
    k = (torch.tensor([5.0, 3.0, 1.0]) + 6.0 * h[:, None]) % 6.0
    return v[:, None] * (1.0 - s[:, None] * torch.minimum(k, 4.0 - k).clamp(0.0, 1.0))


def _random_colour(gen: torch.Generator, n: int, sat: tuple[float, float], val: tuple[float, float]) -> torch.Tensor:
    h = torch.rand(n, generator=gen)
    return _hsv_to_rgb(h, _uniform(gen, n, sat), _uniform(gen, n, val))


def _enforce_contrast(fg: torch.Tensor, bg: torch.Tensor, c: float) -> torch.Tensor:
    """Move fg towards black (light bg) or white (dark bg) until luminances differ by at least c."""
    yf, yb = _luma(fg), _luma(bg)
    to_black = yb > 0.5
    a_black = (yf - (yb - c)) / yf.clamp(min=1e-6)
    a_white = ((yb + c) - yf) / (1.0 - yf).clamp(min=1e-6)
    a = torch.where(to_black, a_black, a_white).clamp(0.0, 1.0)[:, None]
    target = torch.where(to_black[:, None], torch.zeros_like(fg), torch.ones_like(fg))
    return fg + a * (target - fg)


def _blur(img: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Separable gaussian blur with one sigma per sample; img (N, C, H, W), sigma (N,)."""
    n, c, h, w = img.shape
    r = min(max(1, math.ceil(3.0 * float(sigma.max()))), h - 1, w - 1)
    taps = torch.arange(-r, r + 1, dtype=img.dtype)
    k = _exactly(torch.exp, -(taps**2) / (2.0 * sigma.clamp(min=0.05)[:, None] ** 2))
    total = k[:, 0]
    for j in range(1, 2 * r + 1):  # summed in order (a reduction's order depends on the CPU)
        total = total + k[:, j]
    k = (k / total[:, None])[:, :, None, None, None]  # (N, K, 1, 1, 1)
    x = F.pad(img, (r, r, r, r), mode="reflect")
    # taps summed one by one in a fixed order (a convolution's order and kernel depend on the CPU); a product
    # then a sum, each rounded (a fused multiply-add would round once, on some CPUs only)
    # (the horizontal pass runs on the transposed image, so that every tap reads whole contiguous rows)
    xt = x.transpose(-1, -2).contiguous()
    rows = k[:, 0] * xt[..., 0:w, :]
    product = torch.empty_like(rows)
    for j in range(1, 2 * r + 1):
        rows += torch.mul(k[:, j], xt[..., j : j + w, :], out=product)
    rows = rows.transpose(-1, -2).contiguous()
    out = k[:, 0] * rows[..., 0:h, :]
    product = torch.empty_like(out)
    for j in range(1, 2 * r + 1):
        out += torch.mul(k[:, j], rows[..., j : j + h, :], out=product)
    return out


def _smooth_noise(gen: torch.Generator, n: int, c: int, size: int) -> torch.Tensor:
    """Multi-scale smooth noise (n, c, size, size) with roughly unit amplitude (octaves summed coarse to fine)."""
    out = 0.6 * _normal(gen, n, c, 3, 3)
    for cells, weight in ((6, 0.5), (12, 0.35)):
        out = _bicubic_resize(out, cells)
        out = out + weight * _normal(gen, n, c, cells, cells)
    return _bicubic_resize(out, size)


def _ramp(gen: torch.Generator, n: int, size: int) -> torch.Tensor:
    """Linear ramps in [-1, 1] along a random direction per sample: (n, 1, size, size)."""
    phi = 2.0 * math.pi * torch.rand(n, generator=gen)
    t = torch.arange(size, dtype=torch.float32) * (2.0 / (size - 1)) - 1.0  # linspace's kernel depends on the CPU
    yy, xx = torch.meshgrid(t, t, indexing="ij")
    r = _exactly(torch.cos, phi)[:, None, None] * xx + _exactly(torch.sin, phi)[:, None, None] * yy
    return (r / math.sqrt(2.0)).unsqueeze(1)


def _render_masks(st: RenderStyle, gen: torch.Generator, y: torch.Tensor, size: int) -> torch.Tensor:
    """Digit coverage masks (n, 1, size, size) for labels y, with the style's geometry."""
    bank, half_width = _glyph_bank(st.fonts, st.strokes, st.outline)
    n = y.shape[0]
    variant = torch.randint(0, len(st.fonts) * len(st.strokes), (n,), generator=gen) * 10

    ang = torch.deg2rad(_uniform(gen, n, (-st.rotation, st.rotation)))
    s = _uniform(gen, n, st.scale)
    asp = _uniform(gen, n, st.aspect)
    sh = _uniform(gen, n, (-st.shear, st.shear))
    t = _uniform(gen, 2 * n, (-st.shift, st.shift)).view(n, 2)
    cos, sin = _exactly(torch.cos, ang), _exactly(torch.sin, ang)
    # forward glyph -> image map M = s * R(ang) @ [[1, sh], [0, 1]] @ diag(asp, 1); grid_sample needs its inverse
    m = torch.stack(
        [torch.stack([cos * asp, cos * sh - sin], -1), torch.stack([sin * asp, sin * sh + cos], -1)], -2
    ) * s[:, None, None]
    # the 2x2 inverse and the offset written out (LAPACK's and a matrix product's last bit depend on the CPU)
    a, b, c, d = m[:, 0, 0], m[:, 0, 1], m[:, 1, 0], m[:, 1, 1]
    det = a * d - b * c
    inv = torch.stack([torch.stack([d / det, -b / det], -1), torch.stack([-c / det, a / det], -1)], -2)
    off = -torch.stack([inv[:, 0, 0] * t[:, 0] + inv[:, 0, 1] * t[:, 1],
                        inv[:, 1, 0] * t[:, 0] + inv[:, 1, 1] * t[:, 1]], -1)

    u = (torch.arange(size, dtype=torch.float32) + 0.5) * (2.0 / size) - 1.0  # pixel centres, align_corners=False
    ux, uy = u.view(1, 1, size), u.view(1, size, 1)
    gx = inv[:, 0, 0, None, None] * ux + inv[:, 0, 1, None, None] * uy + off[:, 0, None, None]
    gy = inv[:, 1, 0, None, None] * ux + inv[:, 1, 1, None, None] * uy + off[:, 1, None, None]
    mask = _bilinear_sample(bank[y + variant], gx, gy)

    if st.neighbours > 0:
        hw_c = half_width[y + variant]
        for side in (-1.0, 1.0):
            present = torch.rand(n, generator=gen) < st.neighbours
            d = torch.randint(0, 10, (n,), generator=gen) + variant
            gap = _uniform(gen, n, (0.05, 0.2))
            dx = side * (hw_c + half_width[d] + gap)
            other = _bilinear_sample(bank[d], gx - dx[:, None, None], gy)
            mask = torch.maximum(mask, other * present[:, None, None, None])
    return mask.clamp_(0.0, 1.0)


def _render_chunk(st: RenderStyle, gen: torch.Generator, y: torch.Tensor, size: int) -> torch.Tensor:
    n = y.shape[0]
    mask = _render_masks(st, gen, y, size)

    fg = _random_colour(gen, n, st.fg_sat, st.fg_val)
    bg = _random_colour(gen, n, st.bg_sat, st.bg_val)
    fg2 = _random_colour(gen, n, st.fg_sat, st.fg_val)
    bg2 = _random_colour(gen, n, st.bg_sat, st.bg_val)
    swap = (torch.rand(n, generator=gen) < st.swap)[:, None]
    fg, bg, bg2 = torch.where(swap, bg, fg), torch.where(swap, fg, bg), torch.where(swap, fg2, bg2)
    if st.min_contrast > 0:
        fg = _enforce_contrast(fg, bg, st.min_contrast)

    back = bg[:, :, None, None].expand(n, 3, size, size)
    if st.gradient > 0:
        g = _uniform(gen, n, (0.0, st.gradient)).view(n, 1, 1, 1)
        w = g * (_ramp(gen, n, size) + 1.0) / 2.0
        back = back + w * (bg2 - bg)[:, :, None, None]
    if st.texture > 0:
        c = st.texture_colour
        grey = _smooth_noise(gen, n, 1, size) if c < 1 else 0.0
        colour = _smooth_noise(gen, n, 3, size) if c > 0 else 0.0
        back = back + st.texture * ((1.0 - c) * grey + c * colour)
    back = back.clamp(0.0, 1.0)

    front = 1.0 - back if st.fg_inverts_bg else fg[:, :, None, None]
    img = back + mask * (front - back)
    if st.glow > 0:
        halo = _blur(mask, _uniform(gen, n, (1.5, 3.0)))
        img = img + st.glow * halo * (1.0 - mask) * fg[:, :, None, None]
    if st.shading > 0:
        a = _uniform(gen, n, (0.0, st.shading)).view(n, 1, 1, 1)
        img = img * (1.0 + a * _ramp(gen, n, size))
    img = _blur(img.clamp(0.0, 1.0), _uniform(gen, n, st.blur))
    std = _uniform(gen, n, st.noise).view(n, 1, 1, 1)
    img = img + std * _normal(gen, n, 1, size, size)
    return (img.clamp(0.0, 1.0) * 255.0).round().to(torch.uint8)


def _generator(style: str, seed: int) -> torch.Generator:
    digest = hashlib.sha256(f"fednorm.rendered/{style}/{seed}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def render_digits(style: str, n: int, seed: int, size: int = 28) -> Split:
    """Render ``n`` balanced, shuffled digits in ``style`` as uint8 (n, 3, size, size); deterministic in all arguments."""
    if style not in RENDER_STYLES:
        raise ValueError(f"unknown render style {style!r}; valid styles: {', '.join(sorted(RENDER_STYLES))}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if size < 8:
        raise ValueError(f"size must be >= 8, got {size}")
    st = RENDER_STYLES[style]
    gen = _generator(style, seed)
    y = (torch.arange(n) % 10)[torch.randperm(n, generator=gen)]
    with torch.no_grad():
        chunks = [_render_chunk(st, gen, y[i : i + _CHUNK], size) for i in range(0, n, _CHUNK)]
    x = torch.cat(chunks) if chunks else torch.zeros(0, 3, size, size, dtype=torch.uint8)
    return Split(x, y.to(torch.int64))


def rendered_domain(style: str, n: int = 9298, seed: int = 0, size: int = 28) -> tuple[torch.Tensor, torch.Tensor]:
    """The full pool of one style as (x uint8 (n, 3, size, size), y int64); the caller splits it."""
    split = render_digits(style, n, seed, size)
    return split.x, split.y
