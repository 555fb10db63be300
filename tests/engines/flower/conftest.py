"""Shared pieces of the Flower engine tests (skipped when the ``flower`` extra is not installed)."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr", reason="Flower is not installed: pip install 'fednorm[flower]'")

from ...conftest import tiny_run_config  # noqa: E402


def tiny_config(*extra: str):
    """The tiny federation of the run tests with one method (FedBN) and 3 rounds, evaluated at the last."""
    return tiny_run_config("methods=[fedbn]", "federation.rounds=3", "federation.eval_every=3", *extra)
