"""Training-time data augmentation, batched on uint8 image tensors (``training.augment``).

``fedbn_objects`` is the training transform of FedBN's official code for Office-Caltech-10 and
DomainNet, which FedWon follows::

    transforms.Compose([Resize([256, 256]), RandomHorizontalFlip(), RandomRotation((-30, 30)), ToTensor()])

on training images only (test: ``Resize`` + ``ToTensor``). The stored images are already resized
(:mod:`fednorm.data.objects`), so what remains is, per image and independently: a horizontal flip
with probability 0.5, then a rotation by an angle uniform in [-30, 30] degrees about the image
centre, nearest-neighbour, without expansion, the uncovered corners filled with 0
(``RandomRotation``'s defaults). It acts on the uint8 batch before ``prepare`` scales and
standardizes it, so the fill is black, as PIL's is in the official pipeline.

The rotation is one ``grid_sample`` over the whole batch with each image's own angle, on the
sampling grid torchvision's tensor ``rotate`` builds (``_gen_affine_grid``: pixel centres, the
inverse rotation matrix, ``align_corners=False``). Against
``torchvision.transforms.functional.rotate(img, angle, InterpolationMode.NEAREST)`` per image (torch
2.14, torchvision 0.29, CPU) it is exact: 0 of 2.4 million pixels differ (random images of 28, 64 and
256 pixels, random angles and 0, +-30). Only a source coordinate exactly on a rounding boundary (a
half-integer) could pick the other neighbour if another kernel rounded the grid's last bit
differently; the tests allow 0.1 % of such pixels. PIL's ``Image.rotate`` (the official code rotates
PIL images) rounds its own grid: it differs from torchvision's tensor rotate on 0.01-0.1 % of the
pixels (random images of 28 to 256 pixels); the reference here is torchvision's tensor rotate, the
one a tensor pipeline has. Cost: 3 % of an AlexNet training step (batch 32, 64 or 256 pixels, on this
repository's busy 2-core CPU); a per-image torchvision loop is 15-65x slower than the batched call.

``rot90_flip`` is the training augmentation of HarmoFL's prostate code (``RandomRotate90`` then
``RandomFlip`` in ``utils/dataset.py``; the paper: "random rotation by {0, 90, 180, 270} degrees and
horizontal or vertical flips", after Liu et al. 2020), applied to each image *and its mask* alike:

- ``np.rot90(img, k)`` with ``k = random.randint(0, 4)``, Python's inclusive randint, so k in {0, ..., 4} and
  k = 4 is the identity again: no rotation with probability 2/5, 90, 180, 270 degrees (counter-clockwise) with
  1/5 each. This bias of the code is kept; square images only (a quarter turn of a non-square image changes its
  shape);
- then with probability 0.75 ``cv2.flip(img, d)``, ``d = random.randint(-1, 1)``: 0 flips the rows (vertical),
  1 the columns (horizontal), -1 both.

Classification labels pass through unchanged; segmentation masks (N x H x W) get the image's rotation and flip.

``flamby_isic`` is FLamby's Fed-ISIC2019 training pipeline (``flamby/datasets/fed_isic2019/dataset.py``), which
FedWon's Table 11 trains with, on the stored 224 x 224 images, giving 200 x 200 crops::

    RandomScale(0.07), Rotate(50), RandomBrightnessContrast(0.15, 0.1), Flip(p=0.5), Affine(shear=0.1),
    RandomCrop(200, 200), CoarseDropout(random.randint(1, 8), 16, 16), Normalize()

(albumentations; each with its default probability 0.5 except the crop). Per image: with probability 0.5 a
resize by s uniform in [0.93, 1.07] (to floor(224 s) pixels); with probability 0.5 a rotation by an angle uniform
in [-50, 50] degrees about the centre; with probability 0.5 contrast alpha in [0.9, 1.1] and brightness beta in
[-0.15, 0.15] (``x alpha + 255 beta``, clipped); with probability 0.5 a flip (rows, columns or both, 1/3 each);
with probability 0.5 a shear of x and of y by 0.1 degrees (``Affine(shear=0.1)`` turns the number into the
interval ``to_tuple(0.1, 0.1) = (0.1, 0.1)`` for each axis: a constant, not a range); a 200 x 200 crop at a uniform
offset; with probability 0.5, H black 16 x 16 holes at uniform positions. ``Normalize`` is ImageNet's mean and
std: ``data.input_norm: imagenet``. Test images are centre-cropped to 200 (``data.center_crop: 200``).
Differences, named: the geometric steps are composed into one affine map and sampled once (bilinear, as each
of albumentations' steps, which resample three times); outside the image the sampling reflects about the
border (``grid_sample``'s reflection, cv2's BORDER_REFLECT) where Rotate uses BORDER_REFLECT_101 and Affine a
black border (a 0.1-degree shear reaches at most 0.2 pixels out; its sign convention, skimage's, is not
reproduced: x' = x + tan(0.1 deg) y about the centre, and likewise y); brightness and contrast act on the
once-sampled values rounded to integers, then floored as albumentations' uint8 lookup table
(``astype(uint8)``) does. H is FLamby's: drawn once per client dataset (``random.randint(1, 8)``, uniform on 1..8)
and kept for the whole run; FLamby's draw is unseeded, here it comes from the run's seed and the client's name
(the engines' ``client_augment_generator``), so a client keeps its H every round and across a resume. Cost: 264 ms
for 64 images on one thread of a busy AVX2 CPU, 1.9 % of the ResNet-18 step it feeds (``benchmarks/augment_cost.py``,
benchmarks/performance.md).

The draws (the batch's flips, then its angles; for ``rot90_flip`` the quarter turns, then whether to flip, then
the flip codes; for ``flamby_isic`` see :func:`draw_flamby_isic`) come from a generator of their own (the engines seed
it from the client's round seed, :mod:`fednorm.engines.seeds`), never from the one that orders the
batches, so ``none`` leaves every run as it was. The official code draws from torch's global
generator inside its data loader: the distribution is the same, the stream is not reproduced.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

AUGMENTS = ("none", "fedbn_objects", "rot90_flip", "flamby_isic")
MASK_AUGMENTS = ("none", "rot90_flip")  # those that move a segmentation mask with its image
FLIP_PROBABILITY = 0.5
MAX_DEGREES = 30.0
ROT90_CHOICES = 5  # HarmoFL code: random.randint(0, 4), k = 4 a full turn
ROT90_FLIP_PROBABILITY = 0.75  # HarmoFL code: RandomFlip(prob=0.75)
# FLamby's Fed-ISIC2019 training transform (albumentations' default p = 0.5 for every step but the crop)
FLAMBY_CROP = 200
FLAMBY_MIN_SIDE = 216  # floor(216 x 0.93) = 200: the smallest side the 7 % downscale still crops 200 from
FLAMBY_P = 0.5
FLAMBY_SCALE_LIMIT = 0.07
FLAMBY_ROTATE_LIMIT = 50.0
FLAMBY_BRIGHTNESS_LIMIT = 0.15
FLAMBY_CONTRAST_LIMIT = 0.1
FLAMBY_SHEAR_DEGREES = 0.1  # both axes, exactly (albumentations' to_tuple(0.1, 0.1))
FLAMBY_HOLE = 16
FLAMBY_MAX_HOLES = 8


def check_augment(name: str) -> None:
    """A known augmentation name, or a ValueError listing them."""
    if name not in AUGMENTS:
        raise ValueError(f"augment must be one of {', '.join(AUGMENTS)}, got {name!r}")


def _check_batch(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.ndim != 4 or x.dtype != torch.uint8:
        what = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"training.augment flips and rotates images: it needs a uint8 N x C x H x W batch, got "
                         f"{what}; use augment: none for feature vectors")


def draw_flip_rotate(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` independent draws of (flip, angle): flip with probability 0.5, angle uniform in [-30, 30) degrees
    (float64), flips first then angles, from ``generator`` alone."""
    flip = torch.rand(n, generator=generator, dtype=torch.float64) < FLIP_PROBABILITY
    angle = (torch.rand(n, generator=generator, dtype=torch.float64) * 2 - 1) * MAX_DEGREES
    return flip, angle


def _rotation_grid(angle: torch.Tensor, height: int, width: int, device=None) -> torch.Tensor:
    """N x H x W x 2 ``grid_sample`` grids rotating each image by its ``angle`` (degrees, counter-clockwise as
    displayed) about its centre: torchvision's ``rotate`` grid (``_get_inverse_affine_matrix`` with -angle,
    ``_gen_affine_grid``), one matrix per image, in float32 as torchvision builds it."""
    rad = angle.to(torch.float64) * (math.pi / 180.0)
    cos, sin = torch.cos(rad), torch.sin(rad)
    zero = torch.zeros_like(cos)
    # the inverse map output -> input, in pixel units about the centre: x_in = cos x - sin y, y_in = sin x + cos y
    theta = torch.stack([torch.stack([cos, -sin, zero], 1), torch.stack([sin, cos, zero], 1)], 1)
    theta = theta.to(device=device, dtype=torch.float32)
    base = torch.empty(1, height, width, 3, dtype=torch.float32, device=device)
    base[..., 0].copy_(torch.linspace(-width * 0.5 + 0.5, width * 0.5 + 0.5 - 1, steps=width, device=device))
    base[..., 1].copy_(torch.linspace(-height * 0.5 + 0.5, height * 0.5 + 0.5 - 1, steps=height,
                                      device=device).unsqueeze_(-1))
    base[..., 2].fill_(1)
    scale = torch.tensor([0.5 * width, 0.5 * height], dtype=torch.float32, device=device)
    rescaled = theta.transpose(1, 2) / scale  # N x 3 x 2
    return torch.matmul(base.view(height * width, 3), rescaled).view(len(angle), height, width, 2)


def flip_rotate(x: torch.Tensor, flip: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """uint8 images ``x`` (N x C x H x W), each flipped horizontally where ``flip`` and then rotated by its
    ``angle`` (degrees, counter-clockwise) about its centre, nearest-neighbour, same size, corners 0."""
    _check_batch(x)
    if len(flip) != len(x) or len(angle) != len(x):
        raise ValueError(f"one flip and one angle per image: got {len(flip)} and {len(angle)} for {len(x)} images")
    if len(x) == 0:
        return x
    flip = flip.to(x.device).view(-1, 1, 1, 1)
    x = torch.where(flip, x.flip(-1), x)
    grid = _rotation_grid(angle, x.shape[-2], x.shape[-1], device=x.device)
    # nearest sampling picks stored values, so the round trip through float32 is exact; outside the image
    # grid_sample's zero padding is RandomRotation's fill 0
    out = F.grid_sample(x.float(), grid, mode="nearest", padding_mode="zeros", align_corners=False)
    return out.to(torch.uint8)


def draw_rot90_flip(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` independent draws of (quarter turns k, flip code): k uniform in {0, ..., 4} (4 = no turn), then flip
    with probability 0.75, then the code uniform in {-1, 0, 1}; no flip is coded 2. All of the batch's k
    first, then its flip decisions, then its codes, from ``generator`` alone."""
    turns = torch.randint(0, ROT90_CHOICES, (n,), generator=generator) % 4
    flips = torch.rand(n, generator=generator, dtype=torch.float64) < ROT90_FLIP_PROBABILITY
    codes = torch.randint(-1, 2, (n,), generator=generator)
    return turns, torch.where(flips, codes, torch.full_like(codes, 2))


def rot90_flip(x: torch.Tensor, turns: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Each image (or mask) of ``x`` (N x ... x H x W, square) turned ``turns`` quarter turns counter-clockwise
    (``np.rot90`` on its H, W axes) and then flipped by its cv2 ``codes``: 0 rows, 1 columns, -1 both, 2 none."""
    if x.shape[-1] != x.shape[-2]:
        raise ValueError(f"rot90_flip turns images by quarter turns: they must be square, got {x.shape[-2]} x "
                         f"{x.shape[-1]}")
    if len(turns) != len(x) or len(codes) != len(x):
        raise ValueError(f"one turn and one flip code per image: got {len(turns)} and {len(codes)} for {len(x)}")
    out = x.clone()
    for k in (1, 2, 3):
        chosen = (turns == k).nonzero().flatten().to(x.device)
        if len(chosen):
            out[chosen] = torch.rot90(out[chosen], k, dims=(-2, -1))
    for code, dims in ((0, (-2,)), (1, (-1,)), (-1, (-2, -1))):
        chosen = (codes == code).nonzero().flatten().to(x.device)
        if len(chosen):
            out[chosen] = out[chosen].flip(dims)
    return out


def draw_flamby_holes(generator: torch.Generator) -> int:
    """FLamby's cut-out hole count, ``random.randint(1, 8)``: uniform on 1..8."""
    return int(torch.randint(1, FLAMBY_MAX_HOLES + 1, (1,), generator=generator))


def draw_flamby_isic(n: int, side: int, holes: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """``n`` images' draws of :func:`flamby_isic` for ``side`` x ``side`` inputs and ``holes`` cut-out holes, in this
    order from ``generator`` alone: for each step in the pipeline's order, whether it applies (probability 0.5) and
    then its values for the whole batch (scale, angle, contrast and brightness, flip code, crop offsets, hole
    positions; the shear has no value to draw). A step that does not apply has its identity values (scale 1,
    angle 0, ...)."""
    def applies() -> torch.Tensor:
        return torch.rand(n, generator=generator, dtype=torch.float64) < FLAMBY_P

    def uniform(limit: float) -> torch.Tensor:
        return (torch.rand(n, generator=generator, dtype=torch.float64) * 2 - 1) * limit

    scaled = applies()
    scale = torch.where(scaled, 1 + uniform(FLAMBY_SCALE_LIMIT), torch.ones(n, dtype=torch.float64))
    size = torch.floor(side * scale + 1e-9).to(torch.int64)  # albumentations: int(height * scale)
    if int(size.min()) < FLAMBY_CROP:
        raise ValueError(f"flamby_isic crops {FLAMBY_CROP} x {FLAMBY_CROP} from images scaled down by up to 7 %: "
                         f"{side}-pixel images are too small (FLamby's are 224)")
    rotated = applies()
    angle = torch.where(rotated, uniform(FLAMBY_ROTATE_LIMIT), torch.zeros(n, dtype=torch.float64))
    adjusted = applies()
    alpha = torch.where(adjusted, 1 + uniform(FLAMBY_CONTRAST_LIMIT), torch.ones(n, dtype=torch.float64))
    beta = torch.where(adjusted, uniform(FLAMBY_BRIGHTNESS_LIMIT), torch.zeros(n, dtype=torch.float64))
    flipped = applies()
    code = torch.where(flipped, torch.randint(-1, 2, (n,), generator=generator), torch.full((n,), 2))
    sheared = applies()
    shear_x = sheared.to(torch.float64) * FLAMBY_SHEAR_DEGREES
    shear_y = shear_x.clone()
    room = (size - FLAMBY_CROP + 1).to(torch.float64)
    top = torch.floor(torch.rand(n, generator=generator, dtype=torch.float64) * room).to(torch.int64)
    left = torch.floor(torch.rand(n, generator=generator, dtype=torch.float64) * room).to(torch.int64)
    dropped = applies()
    corners = torch.randint(0, FLAMBY_CROP - FLAMBY_HOLE + 1, (n, holes, 2), generator=generator)
    return {"scale": scale, "size": size, "angle": angle, "alpha": alpha, "beta": beta, "code": code,
            "shear_x": shear_x, "shear_y": shear_y, "top": top, "left": left, "dropped": dropped, "corners": corners}


def _flamby_grid(draws: dict[str, torch.Tensor], side: int) -> torch.Tensor:
    """N x 200 x 200 x 2 ``grid_sample`` grids: each output pixel of the crop traced back through the shear, the
    flip, the rotation and the resize to the ``side`` x ``side`` source (pixel centres, align_corners=False)."""
    f = torch.float64
    size = draws["size"].to(f)
    centre = (size - 1) / 2
    u = torch.arange(FLAMBY_CROP, dtype=f)
    y1 = (u.view(1, -1, 1) + draws["top"].to(f).view(-1, 1, 1)).expand(-1, -1, FLAMBY_CROP)
    x1 = (u.view(1, 1, -1) + draws["left"].to(f).view(-1, 1, 1)).expand(-1, FLAMBY_CROP, -1)
    c = centre.view(-1, 1, 1)
    # undo the shear (about the centre): [x1, y1] - c = [[1, tan sx], [tan sy, 1]] ([x, y] - c)
    tx = torch.tan(torch.deg2rad(draws["shear_x"])).view(-1, 1, 1)
    ty = torch.tan(torch.deg2rad(draws["shear_y"])).view(-1, 1, 1)
    det = 1 - tx * ty
    dx, dy = x1 - c, y1 - c
    x, y = c + (dx - tx * dy) / det, c + (dy - ty * dx) / det
    # undo the flip: cv2 code 0 reverses the rows, 1 the columns, -1 both
    code = draws["code"].view(-1, 1, 1)
    x = torch.where((code == 1) | (code == -1), 2 * c - x, x)
    y = torch.where((code == 0) | (code == -1), 2 * c - y, y)
    # undo the rotation (cv2.getRotationMatrix2D: counter-clockwise as displayed for a positive angle)
    rad = torch.deg2rad(draws["angle"]).view(-1, 1, 1)
    cos, sin = torch.cos(rad), torch.sin(rad)
    dx, dy = x - c, y - c
    x, y = c + cos * dx - sin * dy, c + sin * dx + cos * dy
    # undo the resize (cv2.resize maps pixel centres: source = (x + 0.5) side / size - 0.5)
    ratio = (side / size).view(-1, 1, 1)
    xs, ys = (x + 0.5) * ratio - 0.5, (y + 0.5) * ratio - 0.5
    return torch.stack([(2 * xs + 1) / side - 1, (2 * ys + 1) / side - 1], dim=-1).to(torch.float32)


def flamby_isic(x: torch.Tensor, draws: dict[str, torch.Tensor]) -> torch.Tensor:
    """uint8 ``side`` x ``side`` images ``x`` -> their uint8 200 x 200 augmented crops (:func:`draw_flamby_isic`)."""
    _check_batch(x)
    side = x.shape[-1]
    if x.shape[-2] != side:
        raise ValueError(f"flamby_isic expects square images (FLamby's stored 224 x 224), got {tuple(x.shape[-2:])}")
    if len(x) == 0:
        return x[..., :FLAMBY_CROP, :FLAMBY_CROP]
    grid = _flamby_grid(draws, side).to(x.device)
    out = F.grid_sample(x.float(), grid, mode="bilinear", padding_mode="reflection", align_corners=False)
    alpha = draws["alpha"].to(device=x.device, dtype=torch.float32).view(-1, 1, 1, 1)
    beta = draws["beta"].to(device=x.device, dtype=torch.float32).view(-1, 1, 1, 1)
    # the resampled uint8 image (rounded), then the brightness / contrast lookup table: clip, then astype(uint8)
    out = (out.round_() * alpha + 255.0 * beta).clamp_(0, 255).floor_().to(torch.uint8)
    dropped = draws["dropped"].nonzero().flatten().tolist()
    for i in dropped:
        for top, left in draws["corners"][i].tolist():
            out[i, :, top:top + FLAMBY_HOLE, left:left + FLAMBY_HOLE] = 0
    return out


class BatchAugment:
    """The training batches' augmentation ``name`` with its own random stream: call it on each uint8 batch
    and its targets, in training order."""

    def __init__(self, name: str, generator: torch.Generator, client_generator: torch.Generator | None = None) -> None:
        """``generator``: the per-batch draws. ``client_generator``: the draws made once per client for the whole
        run (flamby_isic's hole count; the engines pass ``client_augment_generator(seed, client)``); without it they
        come from ``generator``, once per ``BatchAugment``."""
        check_augment(name)
        self.name, self.generator = name, generator
        # flamby_isic's hole count, FLamby's random.randint(1, 8), drawn once per client dataset
        self.holes = draw_flamby_holes(client_generator if client_generator is not None else generator) \
            if name == "flamby_isic" else 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The augmented images of a uint8 batch (their targets untouched: classification)."""
        return self.pair(x, None)[0]

    def pair(self, x: torch.Tensor, y: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(augmented images, targets): class labels unchanged, segmentation masks (N x H x W) moved with their
        images (``rot90_flip``; the other augmentations refuse masks)."""
        if self.name == "none":
            return x, y
        _check_batch(x)
        masks = y is not None and y.ndim == 3
        if self.name == "rot90_flip":
            turns, codes = draw_rot90_flip(len(x), self.generator)
            return rot90_flip(x, turns, codes), (rot90_flip(y, turns, codes) if masks else y)
        if masks:
            raise ValueError(f"augment {self.name!r} would move the images but not their masks: use rot90_flip or "
                             "none for segmentation")
        if self.name == "flamby_isic":
            return flamby_isic(x, draw_flamby_isic(len(x), x.shape[-1], self.holes, self.generator)), y
        flip, angle = draw_flip_rotate(len(x), self.generator)
        return flip_rotate(x, flip, angle), y
