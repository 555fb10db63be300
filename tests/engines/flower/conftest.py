"""Shared pieces of the Flower engine tests (skipped when the ``flower`` extra is not installed)."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr", reason="Flower is not installed: pip install 'fednorm[flower]'")

from fednorm.runs.config import load_config  # noqa: E402

# the tiny federation of tests/runs/test_runner.py, one method
TINY = [
    "methods=[fedbn]",
    "data.domains=[rendered/print, rendered/neon]",
    "data.rendered_size=300",
    "data.pool_size=200",
    "data.percent=0.2",
    "model.width=0.125",
    "training.precision=fp32",
    "federation.rounds=3",
    "federation.eval_every=3",
]


def tiny_config(*extra: str):
    return load_config("default", TINY + list(extra))
