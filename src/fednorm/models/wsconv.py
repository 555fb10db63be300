"""Scaled weight standardization (FedWon, after Brock et al. 2021a) and a normalization-free converter.

:class:`WSConv2d` reproduces FedWon's Listing 1: per output channel ``i``,

    W_hat_i = gain_i * (W_i - mean(W_i)) / sqrt(max(fan_in * var(W_i), eps))

with ``fan_in = (in_channels / groups) * kh * kw``, a learnable ``gain`` of shape (out, 1, 1, 1)
initialised to 1, ``eps = 1e-4`` on ``fan_in * var`` (not on ``var``), Xavier-normal weights and the
conv bias kept. The standardization is recomputed at every forward pass, identically in training and
evaluation: there is no batch dependency and no running statistic, so a WSConv model has no state
that a client could keep to itself.

The paper is inconsistent about the variance: Eq. 3 writes the population variance (1/N), while
Listing 1 calls ``torch.var``, which is unbiased (1/(N-1)). The default is Listing 1's
(``variance="unbiased"``), the code the authors print; ``variance="biased"`` is Eq. 3's reading.

:func:`convert_to_ws` turns an arbitrary torch model into a normalization-free one: every
normalization layer (BatchNorm, GroupNorm, LayerNorm, InstanceNorm, LocalResponseNorm, RMSNorm,
torchvision's FrozenBatchNorm2d) becomes an
``Identity`` and every ``Conv2d`` (grouped, depthwise and downsample convolutions included) a
:class:`WSConv2d` with the same geometry. Modules are selected by type, never by name.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

VARIANCES = ("unbiased", "biased")
WS_EPS = 1e-4

def _norm_layer_types() -> tuple[type[nn.Module], ...]:
    types: list[type[nn.Module]] = [_BatchNorm, _InstanceNorm, nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm]
    if hasattr(nn, "RMSNorm"):
        types.append(nn.RMSNorm)
    try:  # torchvision's detection backbones freeze their BN into this (not a _BatchNorm)
        from torchvision.ops import FrozenBatchNorm2d

        types.append(FrozenBatchNorm2d)
    except ImportError:
        pass
    return tuple(types)


NORM_LAYER_TYPES: tuple[type[nn.Module], ...] = _norm_layer_types()


class WSConv2d(nn.Conv2d):
    """Conv2d with scaled weight standardization and a learnable per-channel gain (FedWon Listing 1)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size,
        stride=1,
        padding=0,
        dilation=1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        *,
        eps: float = WS_EPS,
        variance: str = "unbiased",
    ) -> None:
        if variance not in VARIANCES:
            raise ValueError(f"unknown WSConv variance {variance!r}; choose one of {', '.join(VARIANCES)}")
        if padding_mode != "zeros":
            # Listing 1's forward calls F.conv2d, which always zero-pads; refuse rather than ignore it
            raise ValueError(f"WSConv2d supports padding_mode='zeros' only (as FedWon Listing 1), got {padding_mode!r}")
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode)
        if self.weight.shape[1:].numel() < 2:
            raise ValueError(
                f"WSConv2d({in_channels}, {out_channels}, kernel_size={kernel_size}, groups={groups}) has a fan-in of 1: "
                "standardizing a single weight per output channel zeroes it (and its unbiased variance is undefined)"
            )
        nn.init.xavier_normal_(self.weight)
        self.gain = nn.Parameter(torch.ones(self.out_channels, 1, 1, 1))
        self.variance = variance
        # non-persistent: never in state_dict, never aggregated nor checkpointed (Listing 1)
        self.register_buffer("eps", torch.tensor(float(eps)), persistent=False)
        self.register_buffer("fan_in", torch.tensor(float(self.weight.shape[1:].numel())), persistent=False)

    def standardized_weight(self) -> torch.Tensor:
        w = self.weight
        mean = w.mean(dim=(1, 2, 3), keepdim=True)
        var = w.var(dim=(1, 2, 3), keepdim=True, unbiased=self.variance == "unbiased")
        scale = torch.rsqrt(torch.maximum(var * self.fan_in, self.eps))
        return (w - mean) * scale * self.gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.standardized_weight(), self.bias, self.stride, self.padding, self.dilation, self.groups)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", variance={self.variance}, eps={float(self.eps):g}"


def is_norm_layer(module: nn.Module) -> bool:
    return isinstance(module, NORM_LAYER_TYPES)


def _own_forward(module: nn.Module) -> bool:
    """True when ``module``'s forward is defined outside PyTorch / torchvision: a subclass that computes something
    of its own (timm's BatchNormAct2d: BN then an activation)."""
    return not type(module).forward.__module__.startswith(("torch.", "torchvision."))


def remove_norm_layers(model: nn.Module, _prefix: str = "") -> nn.Module:
    """Replace every normalization layer of ``model`` (in place) by ``nn.Identity``; returns the model. A norm
    layer subclass with its own forward is refused (ValueError naming it): it may do more than normalize (timm's
    BatchNormAct2d applies an activation too), which an Identity would silently drop."""
    for name, child in list(model.named_children()):
        path = f"{_prefix}{name}"
        if is_norm_layer(child):
            if _own_forward(child):
                raise ValueError(f"norm layer {path!r} is a {type(child).__name__}, a {type(child).__mro__[1].__name__} "
                                 "subclass with its own forward, which may do more than normalize (an activation, "
                                 "a drop path); removing it would drop that too: replace it by its plain parts "
                                 "(e.g. nn.BatchNorm2d followed by its activation) first")
            setattr(model, name, nn.Identity())
        else:
            remove_norm_layers(child, f"{path}.")
    return model


def convert_to_ws(
    model: nn.Module, *, bias: bool | None = True, eps: float = WS_EPS, variance: str = "unbiased"
) -> nn.Module:
    """FedWon's conversion, in place: remove every normalization layer and swap each Conv2d for WSConv2d (other
    convolutions, 1-D, 3-D or transposed, have no standardized form in the paper: left as they are, with a warning).

    ``bias=True`` (default) gives every WSConv a bias, as Listing 1's default: the removed
    normalization layer carried the per-channel shift, and torchvision convs followed by BN are built
    with ``bias=False``. ``bias=None`` keeps each conv's own choice (Listing 1's class dropped into torchvision's
    ``bias=False`` convs): ResNet-18 "ws" then has 11,176,842 parameters instead of 11,181,642; the models'
    builders use the default. Converted convs are freshly initialised (Xavier normal, gain 1), as FedWon trains
    from scratch.
    """
    remove_norm_layers(model)

    def swap(parent: nn.Module, prefix: str) -> None:
        for name, child in list(parent.named_children()):
            path = f"{prefix}{name}"
            if isinstance(child, nn.Conv2d) and not isinstance(child, WSConv2d):
                if type(child).forward is not nn.Conv2d.forward:
                    # e.g. timm's Conv2dSame (dynamic padding): swapping it would silently change what it computes
                    raise ValueError(f"conv {path!r} is a {type(child).__name__}, a Conv2d subclass with its own "
                                     "forward; convert_to_ws cannot keep that behaviour in a WSConv2d: replace it "
                                     "by a plain nn.Conv2d first")
                ws = WSConv2d(
                    child.in_channels, child.out_channels, child.kernel_size, child.stride, child.padding,
                    child.dilation, child.groups, bias=child.bias is not None if bias is None else bias,
                    padding_mode=child.padding_mode, eps=eps, variance=variance,
                )
                setattr(parent, name, ws.to(device=child.weight.device, dtype=child.weight.dtype))
            else:
                swap(child, f"{path}.")

    swap(model, "")
    plain = [f"{name} ({type(m).__name__})" for name, m in model.named_modules()
             if isinstance(m, nn.modules.conv._ConvNd) and not isinstance(m, nn.Conv2d)]
    if plain:
        # FedWon defines WSConv for 2-D convolutions only (Listing 1); a 1-D / 3-D or transposed conv has no
        # standardized form in the paper, so it is left as it is, and said
        warnings.warn(f"convert_to_ws standardizes nn.Conv2d only (FedWon Listing 1); {len(plain)} other "
                      f"convolution(s) stay unstandardized: {', '.join(plain[:5])}"
                      + (", ..." if len(plain) > 5 else ""), stacklevel=2)
    return model
