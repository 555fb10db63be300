"""Shared fixtures: tiny federations that train in milliseconds."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fednorm.data.domain import ClientData, Split

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

# the tiny federation of every end-to-end run test: two rendered digit domains (300 images each, no data folder
# needed), 20 % of each, the digit CNN at width 0.125, fp32, 4 rounds with an evaluation every 2
TINY_RUN = [
    "data.domains=[rendered/print, rendered/neon]",
    "data.rendered_size=300",
    "data.pool_size=200",
    "data.percent=0.2",
    "model.width=0.125",
    "training.precision=fp32",
    "federation.rounds=4",
    "federation.eval_every=2",
]


def tiny_run_config(*extra: str, preset: str = "default"):
    """``preset`` with the tiny federation's overrides, then ``extra`` (later overrides win)."""
    from fednorm.runs.config import load_config

    return load_config(preset, TINY_RUN + list(extra))


def real_data_dir() -> Path:
    """The real offline data folder (FEDNORM_DATA, else ../shared/data); skips the test if it is absent."""
    env = os.environ.get("FEDNORM_DATA")
    folder = Path(env) if env else SHARED_DATA
    if not folder.is_dir():
        pytest.skip(f"real data folder {folder} is absent (set FEDNORM_DATA to run this test)")
    return folder


def write_data_folder(root: Path, files: dict[str, dict[str, np.ndarray]], listed=None) -> Path:
    """Write npz files and a manifest.json in the documented format; ``listed`` limits the manifest."""
    manifest = {}
    for relpath, arrays in files.items():
        path = root / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, **arrays)
        if listed is None or relpath in listed:
            data = path.read_bytes()
            manifest[Path(relpath).stem] = {
                "file": relpath,
                "sha256": hashlib.sha256(data).hexdigest(),
                "bytes": len(data),
                "arrays": {k: list(v.shape) for k, v in arrays.items()},
                "source": "test",
            }
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return root


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


def _record_client_runs(engine, keep) -> list:
    """Wrap ``engine.runner.run`` (in-process) so that ``keep(reply, message)`` of every client run is appended to
    the returned list, in the order the clients train."""
    kept: list = []
    run = engine.runner.run

    def recording(*args, **kwargs):
        reply, message, result = run(*args, **kwargs)
        kept.append(keep(reply, message))
        return reply, message, result

    engine.runner.run = recording
    return kept


def record_client_messages(engine) -> list[dict]:
    """Every client's message to the server (HarmoFL's amplitude, SCAFFOLD's control-variate update, ...)."""
    return _record_client_runs(engine, lambda reply, message: message)


def record_client_replies(engine) -> list[dict[str, torch.Tensor]]:
    """A copy of every client's reply state: the entries it sends for the server's aggregation."""
    return _record_client_runs(engine, lambda reply, message: {k: v.clone() for k, v in reply.state.items()})


def batchnorm_keys(model: torch.nn.Module) -> set[str]:
    """Every state entry of the model's BatchNorm layers (affine, running statistics, counter), by module type."""
    return {f"{prefix}.{entry}" for prefix, module in model.named_modules()
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) for entry in module.state_dict()}



def assert_control_variate_is_the_gradient_at(engine, client: str, start: dict, loss_of, train: bool = False) -> None:
    """SCAFFOLD option I: the client's c_i equals the gradient of ``loss_of(model)`` at the client's model of the
    round's start ``start`` (eval-mode BN by default, as the full-data gradient at x; ``train``: train mode, BN on
    the batches ``loss_of`` forms), for every shared parameter and for no other entry."""
    import copy

    model = copy.deepcopy(engine.model)
    model.load_state_dict(start)
    model.train(train)
    loss_of(model).backward()
    state = engine.algorithm_states[client]
    assert set(state) == {f"c_i.{k}" for k in engine.shared_params}
    for k, p in model.named_parameters():
        if k in engine.shared_params:
            torch.testing.assert_close(state[f"c_i.{k}"], p.grad, rtol=1e-4, atol=1e-6)
