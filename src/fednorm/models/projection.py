"""MOON's projection head (Li, He, Song, CVPR 2021), added to any model with a linear output layer.

MOON's network (the official ``ModelFedCon``) is base encoder -> projection head -> output layer: the encoder's
feature h (d values) goes through Linear(d, d) -> ReLU -> Linear(d, out_dim), the representation z the
model-contrastive loss compares, and the output layer Linear(out_dim, classes) classifies z. Here the base encoder
is the model without its output layer (its last ``nn.Linear``), which :func:`add_projection_head` replaces by
that head and a new output layer from z. MOON's representation (``client_algorithms.representation_module``: the
input of the last ``nn.Linear``) is then z, the projection's output. The head is part of the model, so every
method aggregates it as any other weight (MOON's code trains its baselines with the same network); under
``local_bn`` it has no BN to keep local. The paper's out_dim is 256.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

MOON_OUT_DIM = 256  # MOON Sec. 4.1 / the official code's default out_dim


def output_layer(model: nn.Module) -> tuple[str, nn.Linear] | None:
    """The model's last ``nn.Linear`` (in registration order: the output layer of every fednorm classifier), or
    None when it has none. The one place that says which layer MOON's head precedes and MOON's z enters."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    return linears[-1] if linears else None


def add_projection_head(model: nn.Module, out_dim: int = MOON_OUT_DIM) -> nn.Module:
    """``model`` with its output layer Linear(d, classes) replaced, in place, by MOON's projection head and a new
    output layer: Linear(d, d) -> ReLU -> Linear(d, out_dim) -> Linear(out_dim, classes). New layers take
    PyTorch's default initialisation from the global random stream (seeded as the model's own)."""
    if out_dim < 1:
        raise ValueError(f"the projection head's out_dim must be >= 1, got {out_dim}")
    found = output_layer(model)
    if found is None:
        raise ValueError(f"{type(model).__name__} has no nn.Linear output layer to put MOON's projection head "
                         "before (a segmentation U-Net ends in a convolution); leave model.projection_dim unset")
    name, last = found
    if not name:
        raise ValueError("the model itself is a single nn.Linear; wrap it in nn.Sequential first")
    d = last.in_features
    head = nn.Sequential(OrderedDict(
        project1=nn.Linear(d, d), relu=nn.ReLU(inplace=True), project2=nn.Linear(d, out_dim),
        output=nn.Linear(out_dim, last.out_features, bias=last.bias is not None),
    ))
    head.to(device=last.weight.device, dtype=last.weight.dtype)
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, head)
    return model
