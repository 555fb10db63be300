"""The AlexNet of FedBN (Table 9) and FedWon (Table 6) for Office-Caltech-10 and DomainNet.

Five convolutions (64, 192, 384, 256, 256 channels; kernels 11, 5, 3, 3, 3; max-pool after convs
1, 2 and 5), an adaptive average pool to 6 x 6 and three linear layers (9216 -> 4096 -> 4096 ->
classes). The normalization after each convolution is a parameter; FedAvg+GN uses FedWon Table 6's
group counts (32 after convs 1-2, 64 after convs 3-5). The classifier comes in two variants:

- ``fedbn``: the normalization also follows FC1 and FC2 (FedBN Table 9: "BN layer after each
  convolutional layer and fully-connected layer (except the last layer)"), no dropout;
- ``fedwon``: Dropout before FC1 and FC2 and no normalization in the classifier (FedWon Table 6,
  used for all of FedWon's methods). The dropout probability is not stated; PyTorch's 0.5 is used.

The papers resize to 256 x 256; thanks to the adaptive pool any input of at least 63 x 63 works
(PACS is 64 x 64 here). Smaller inputs vanish in the third max-pool and are refused.

Two options serve UniFed's CIFAR-10-C benchmark ("AlexNet pre-trained with the ImageNet and BN layers
added after each convolution and fully-connected layer", CIFAR images "resized into [size lost]"):

- ``pretrained="imagenet"`` loads the five convolutions and FC1, FC2 from torchvision's
  ``AlexNet_Weights.IMAGENET1K_V1`` (torch.hub's cache, downloaded once). torchvision's AlexNet has
  this very layout without the normalization layers (``features.0/3/6/8/10``, ``classifier.1/.4``);
  the class layer and every normalization layer stay freshly initialised, since UniFed *adds* the BN
  layers (how it initialises them is not stated: PyTorch's default, weight 1 and bias 0, is used). It
  needs the papers' model (``width=1``, 3 input channels) and plain convolutions (``norm="ws"``
  would standardize the pretrained filters, so it is refused). The weights expect ImageNet-standardized
  inputs: the ``unifed_cifar10c_*`` presets set ``data.input_norm: imagenet`` (the model does not
  standardize its inputs itself).
- ``input_size`` resizes every batch to ``input_size x input_size`` at the start of :meth:`forward`
  (bilinear, ``align_corners=False``, no antialiasing: when upsampling, torchvision's ``Resize`` on
  tensors up to float rounding), so 32 x 32 CIFAR images reach the network at 224 x 224 without a
  resized copy of the pools in memory. The size is lost from UniFed's text; 224, the ImageNet
  weights' training size, is our choice. The 63-pixel minimum then applies to ``input_size``.
  Downsampling (``input_size`` below the images' side) would alias without antialiasing; the option
  is meant for upsampling (prepare large images at their size instead).
"""

from __future__ import annotations

import os
from urllib.parse import urlparse

import torch
import torch.nn.functional as F
from torch import nn

from ..data.domain import DataError
from .classifier import check_classifier, three_layer_classifier
from .norm import check_norm, make_conv, make_norm

MIN_INPUT = 63  # smallest side whose feature map survives conv1 (stride 4) and the three 3/2 max-pools
PRETRAINED = ("none", "imagenet")
# torchvision's AlexNet (torchvision/models/alexnet.py) is ours without normalization layers: its convs 1-5 are
# features.0/3/6/8/10 (each followed by a ReLU, max-pools after convs 1, 2, 5) and FC1/FC2 classifier.1/.4 (each
# after a Dropout); classifier.6 is the 1000 ImageNet classes, which we do not load
TORCHVISION_CONVS = ("features.0", "features.3", "features.6", "features.8", "features.10")
TORCHVISION_FCS = ("classifier.1", "classifier.4")


class AlexNet(nn.Module):
    def __init__(
        self,
        num_classes: int = 10,
        norm: str = "bn",
        in_channels: int = 3,
        classifier: str = "fedbn",
        plain_conv3: bool = False,
        dropout: float = 0.5,
        width: float = 1.0,
        pretrained: str = "none",
        input_size: int | None = None,
    ) -> None:
        """``width`` scales every channel and feature count (1.0 = the papers' model; tests use less).

        ``norm="in"`` with the ``fedbn`` classifier raises ``ValueError`` (no instance norm after a
        linear layer); use ``classifier="fedwon"``. ``pretrained`` and ``input_size``: see the module
        docstring; the pretrained layers are loaded after the random initialisation, which therefore draws
        the same random numbers with or without them.
        """
        super().__init__()
        check_classifier(classifier)
        check_norm(norm)
        check_pretrained(pretrained, norm=norm, width=width, in_channels=in_channels)
        if input_size is not None and input_size < MIN_INPUT:
            raise ValueError(f"AlexNet's input_size must be at least {MIN_INPUT} (its third max-pool), "
                             f"got {input_size}")
        self.input_size = input_size
        c1, c2, c3, c4, c5, f = (max(1, round(c * width)) for c in (64, 192, 384, 256, 256, 4096))
        flat = c5 * 6 * 6
        # FedWon Table 6 prints layer 3 of the FedWon column as a plain Conv2D(192, 384, 3, 1, 1) while
        # convs 1, 2, 4, 5 are WSConv2D; the text says FedWon replaces *the* convolutions, so this is
        # almost certainly a typo. Default: WSConv everywhere; plain_conv3=True reproduces the table
        # literally (only has an effect with norm="ws": for the other kinds every conv is plain anyway).
        conv3 = nn.Conv2d(c2, c3, 3, 1, 1) if plain_conv3 and norm == "ws" else make_conv(norm, c2, c3, 3, 1, 1)
        self.features = nn.Sequential(
            make_conv(norm, in_channels, c1, 11, 4, 2),
            make_norm(norm, c1, groups=32),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2),
            make_conv(norm, c1, c2, 5, 1, 2),
            make_norm(norm, c2, groups=32),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2),
            conv3,
            make_norm(norm, c3, groups=64),
            nn.ReLU(inplace=True),
            make_conv(norm, c3, c4, 3, 1, 1),
            make_norm(norm, c4, groups=64),
            nn.ReLU(inplace=True),
            make_conv(norm, c4, c5, 3, 1, 1),
            make_norm(norm, c5, groups=64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = three_layer_classifier(classifier, norm, flat, f, f, num_classes, dropout)
        if pretrained == "imagenet":
            load_imagenet_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_size is not None and tuple(x.shape[-2:]) != (self.input_size, self.input_size):
            x = F.interpolate(x, size=(self.input_size, self.input_size), mode="bilinear", align_corners=False,
                              antialias=False)
        if min(x.shape[-2:]) < MIN_INPUT:
            raise ValueError(f"AlexNet needs inputs of at least {MIN_INPUT} x {MIN_INPUT}, got {tuple(x.shape[-2:])} "
                             "(resize them with input_size, e.g. 224)")
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def check_pretrained(pretrained: str, norm: str = "bn", width: float = 1.0, in_channels: int = 3) -> str:
    """``pretrained`` is known and the model can take the ImageNet weights; ValueError saying why not otherwise."""
    if pretrained not in PRETRAINED:
        raise ValueError(f"unknown pretrained {pretrained!r}; choose one of {', '.join(PRETRAINED)}")
    if pretrained == "none":
        return pretrained
    if width != 1:
        raise ValueError(f"pretrained AlexNet weights have the papers' layer sizes: width must be 1, got {width:g}")
    if norm == "ws":
        raise ValueError("pretrained AlexNet weights need plain convolutions: norm 'ws' standardizes the filters, "
                         "which would rescale the pretrained ones (use bn, gn, ln, in, none or fbn)")
    if in_channels != 3:
        raise ValueError(f"pretrained AlexNet weights take RGB images: in_channels must be 3, got {in_channels}")
    return pretrained


def imagenet_checkpoint_path() -> str:
    """Where torch.hub caches torchvision's ImageNet AlexNet: ``$TORCH_HOME/hub/checkpoints/<file of its URL>``."""
    from torchvision.models import AlexNet_Weights

    name = os.path.basename(urlparse(AlexNet_Weights.IMAGENET1K_V1.url).path)
    return os.path.join(torch.hub.get_dir(), "checkpoints", name)


def load_imagenet_weights(model: AlexNet) -> None:
    """Copy torchvision's ImageNet weights (``AlexNet_Weights.IMAGENET1K_V1``) into ``model``'s convs and FC1, FC2,
    layer by layer; the class layer and the normalization layers are left as they are. The file comes from
    torch.hub's cache, which downloads it once (its hash is checked then); DataError if it can be neither found
    nor downloaded, or is not torchvision's AlexNet."""
    from torchvision.models import AlexNet_Weights

    weights = AlexNet_Weights.IMAGENET1K_V1
    path = imagenet_checkpoint_path()
    try:
        # no progress bar: it would tear the run's own; torch.hub prints the download's URL and path
        state = weights.get_state_dict(progress=False, check_hash=True, map_location="cpu")
    except Exception as exc:
        if os.path.exists(path):  # torch.load of a truncated, foreign or unreadable file (zip, pickle, OS errors)
            raise DataError(f"cannot load the ImageNet AlexNet weights at {path} ({exc}): delete the file to download "
                            f"it again, or put torchvision's {weights.url} there") from None
        if isinstance(exc, OSError):  # urllib's URLError (offline, blocked) is an OSError, as an unwritable cache
            raise DataError(
                f"cannot download the ImageNet AlexNet weights ({exc}): download {weights.url} and put the file at "
                f"{path} (or point TORCH_HOME at a folder whose hub/checkpoints holds it)") from None
        raise  # e.g. a download whose hash does not match: torch.hub's own message
    convs = [m for m in model.features if isinstance(m, nn.Conv2d)]
    fcs = [m for m in model.classifier if isinstance(m, nn.Linear)][:2]
    with torch.no_grad():
        for key, layer in zip(TORCHVISION_CONVS + TORCHVISION_FCS, convs + fcs, strict=True):
            for param in ("weight", "bias"):
                tensor = state.get(f"{key}.{param}") if isinstance(state, dict) else None
                target = getattr(layer, param)
                if tensor is None or tensor.shape != target.shape:
                    found = "missing" if tensor is None else f"of shape {tuple(tensor.shape)}"
                    raise DataError(f"{path} is not torchvision's ImageNet AlexNet: {key}.{param} is {found}, "
                                    f"expected {tuple(target.shape)}; delete it to download it again from "
                                    f"{weights.url}")
                target.copy_(tensor)
