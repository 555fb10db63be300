"""Shared fixtures: tiny federations that train in milliseconds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fednorm.data.domain import ClientData, Split

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def make_split(n: int, seed: int, shift: float = 0.0, size: int = 28) -> Split:
    """Noise images whose left band brightens with the label (learnable), offset by a domain ``shift``."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 10, (n,), generator=g)
    x = torch.rand(n, 3, size, size, generator=g) * 60
    x[:, :, :, :6] += y.view(-1, 1, 1, 1).float() * 15
    return Split((x + shift).clamp(0, 255).to(torch.uint8), y)


@pytest.fixture
def tiny_clients() -> list[ClientData]:
    """Three clients of different 'domains' (brightness shifts) and unequal sizes."""
    return [
        ClientData(f"c{i}", f"d{i}", make_split(n, seed=i, shift=40.0 * i), make_split(20, seed=100 + i, shift=40.0 * i))
        for i, n in enumerate([24, 16, 20])
    ]
