"""Loss-landscape slices around the global model (HarmoFL Fig. 1 and Fig. 6; Li et al. 2018).

Two random directions d1, d2 over the shared parameters, filter-normalized (Li et al. 2018, Sec. 4): each
filter (a slice along the first dimension of a weight tensor) of a Gaussian direction is rescaled to the
norm of the same filter of the global model; biases and 1-D parameters (BN affine) get a zero direction, as
Li et al.'s default "ignore biasbn". Each client's loss is evaluated at theta + a d1 + b d2 on a grid of
(a, b) in [-span, span]^2, with the client's own local entries (its BN under FedBN) kept as they are, on
the first ``samples`` of its training split (the paper plots training loss), in evaluation mode. The same
plane serves every client, so the figure shows whether their minima coincide (HarmoFL: FedAvg's are sharp
and off-centre, HarmoFL's flat and centred, still flat at 8x the range: ``span`` 8).

The directions are seeded; the paper states neither its grid nor its range (the extraction, 7.2).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..figures import pyplot, save_figure

RESULT_FILE = "landscape.json"
PLOT_FILE = "landscape.png"


def filter_normalized_direction(reference: dict[str, torch.Tensor], generator: torch.Generator
                                ) -> dict[str, torch.Tensor]:
    """A Gaussian direction with each filter scaled to the norm of ``reference``'s filter; zero for
    1-D tensors (biases, normalization parameters)."""
    direction = {}
    for name, w in reference.items():
        if w.dim() <= 1:
            direction[name] = torch.zeros_like(w)
            continue
        d = torch.randn(w.shape, generator=generator, dtype=w.dtype).to(w.device)  # CPU stream on any device
        d_norm = d.reshape(d.shape[0], -1).norm(dim=1).clamp_min(1e-12)
        w_norm = w.reshape(w.shape[0], -1).norm(dim=1)
        direction[name] = d * (w_norm / d_norm).reshape(-1, *([1] * (w.dim() - 1)))
    return direction


def grid(span: float, points: int) -> list[float]:
    if points < 2 or span <= 0:
        raise ValueError(f"a landscape needs points >= 2 and span > 0, got points={points}, span={span}")
    return torch.linspace(-span, span, points, dtype=torch.float64).tolist()


def landscape(engine, span: float = 1.0, points: int = 11, samples: int = 256, seed: int = 0) -> dict:
    """Every training client's loss on the (a, b) grid around ``engine``'s global model; restores the model.

    ``engine`` is an :class:`~fednorm.engines.simulation.InProcessEngine` after training (or loaded from a
    checkpoint)."""
    coords = grid(span, points)
    reference = {k: engine.global_state[k].detach().float() for k in engine.shared_params}
    generator = torch.Generator().manual_seed(seed)
    d1 = filter_normalized_direction(reference, generator)
    d2 = filter_normalized_direction(reference, generator)
    prepare = engine.runner.evaluation_prepare(engine.input_state)
    out: dict = {"span": span, "points": points, "samples": samples, "seed": seed, "coords": coords,
                 "round": engine.round, "metric": engine.training.task.metric, "clients": {}}
    for client in engine.clients:
        data = client.train.subset(torch.arange(min(samples, client.num_train)))
        losses = []
        for a in coords:
            row = []
            for b in coords:
                engine.load_client(client.name)
                with torch.no_grad():
                    params = dict(engine.model.named_parameters())
                    for k, w in reference.items():
                        params[k].copy_(w + a * d1[k] + b * d2[k])
                _, loss = engine.evaluate_split(data, prepare)
                row.append(float(loss))
            losses.append(row)
        out["clients"][client.name] = losses
    engine.model.load_state_dict(engine.global_state)
    return out


def save(result: dict, folder: Path, title: str = "") -> None:
    """landscape.json and landscape.png (one contour panel per client, the global model at the centre)."""
    from ..runs.store import dumps  # strict JSON: a loss that overflows far from the centre is written as null

    folder = Path(folder)
    (folder / RESULT_FILE).write_text(dumps(result))
    plot(result, folder / PLOT_FILE, title)


def plot(result: dict, path: Path, title: str = "") -> None:
    plt = pyplot()
    import numpy as np

    clients = list(result["clients"])
    cols = min(len(clients), 3)
    rows = -(-len(clients) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.6 * rows), squeeze=False)
    coords = np.asarray(result["coords"])
    for ax, name in zip(axes.flat, clients):
        # a loss that overflowed far from the centre (inf or NaN) is left blank rather than stretching the levels
        z = np.ma.masked_invalid(np.asarray(result["clients"][name], dtype=float))
        cs = ax.contourf(coords, coords, z.T, levels=20, cmap="viridis")  # z[a][b]: a on x, b on y
        fig.colorbar(cs, ax=ax, fraction=0.046)
        i, j = np.unravel_index(np.argmin(z.filled(np.inf)), z.shape)
        ax.plot(0, 0, "w+", markersize=10, label="global model")
        ax.plot(coords[i], coords[j], "rx", markersize=8, label="client minimum")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("a (direction 1)")
        ax.set_ylabel("b (direction 2)")
    for ax in list(axes.flat)[len(clients):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, loc="upper right")
    fig.suptitle(title or f"training loss around the global model (round {result['round']}, span {result['span']})",
                 fontsize=10)
    save_figure(fig, path)


def read_result(path: Path) -> dict:
    """A saved ``landscape.json``, with the nulls that stand for non-finite losses (strict JSON) back as +inf:
    far from the centre a loss overflows (inf, or NaN from inf - inf in the softmax), and either way it is a
    point that is not flat; +inf keeps :func:`sharpness`'s minimum finite and its mean rise infinite."""
    import json
    import math

    result = json.loads(Path(path).read_text())
    result["clients"] = {name: [[math.inf if v is None else v for v in row] for row in grid]
                         for name, grid in result["clients"].items()}
    return result


def sharpness(result: dict) -> dict[str, dict[str, float]]:
    """Per client: the loss at the centre, the grid minimum and its distance from the centre (in grid units of
    the directions), and the mean rise over the grid (a flatness summary: lower is flatter)."""
    coords = result["coords"]
    centre = len(coords) // 2
    out = {}
    for name, z in result["clients"].items():
        t = torch.tensor(z, dtype=torch.float64)
        i, j = divmod(int(torch.argmin(t)), t.shape[1])
        out[name] = {"centre": float(t[centre, centre]), "minimum": float(t.min()),
                     "minimum_offset": float((coords[i] ** 2 + coords[j] ** 2) ** 0.5),
                     "mean_rise": float((t - t[centre, centre]).mean())}
    return out


def landscape_of_cell(run_dir: Path, label: str | None = None, seed: int | None = None, data_dir: str | None = None,
                      span: float = 1.0, points: int = 11, samples: int = 256) -> Path:
    """Draw the landscape of one cell of a run folder from its last checkpoint (``fednorm landscape``); returns
    the PNG written into the cell folder (``landscape.png``, or ``landscape-span<s>.png`` for another span)."""
    from ..runs import store
    from ..runs.runner import cell_engine

    # each client's loss with its own BN
    engine, label, seed, cell = cell_engine(run_dir, label, seed, data_dir, "fednorm landscape")
    result = landscape(engine, span=span, points=points, samples=samples, seed=seed)
    suffix = "" if span == 1.0 else f"-span{span:g}"
    (cell / f"landscape{suffix}.json").write_text(store.dumps(result))
    path = cell / f"landscape{suffix}.png"
    plot(result, path, title=f"{label}, seed {seed}: training loss around the global model (round {engine.round}, "
         f"span {span:g})")
    return path
