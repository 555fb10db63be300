"""BatchNorm statistics per client against the server's (FedWon Fig. 1b / Fig. 12; FedBN's motivation).

FedWon shows the channel-wise running mean and variance of BN layers differing strongly between two clients of
different domains, and between a client and the server, for a model trained by FedAvg: the statistics the server
averages describe no client. :func:`bn_statistics` measures that on any BN model of an engine: for each client,
the population statistics (mean and biased variance per channel, what BN normalizes with in training) of its own
training data through its own model at the final weights (global state plus its local state; exact layer by layer,
:func:`population_statistics`), beside the running
statistics the model holds (the server's for a method that shares BN, each client's own under FedBN / SiloBN).
``fednorm bn-stats RUN`` draws them from a finished cell's checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..methods.external import bn_layers


def bn_statistics(engine, layers: list[str] | None = None) -> dict:
    """``{"layers": [...], "server": {layer: {mean, var}}, "clients": {name: {"data": {layer: {mean, var}},
    "stored": {layer: {mean, var}}}}}`` (lists of floats per channel) for the engine's current state; ``layers``
    names BN layers by their module path (default: every BN layer)."""
    names = list(bn_layers(engine.model))
    layers = names if layers is None else layers
    unknown = [n for n in layers if n not in names]
    if unknown:
        raise ValueError(f"no BatchNorm layer named {', '.join(unknown)}; the model's are {', '.join(names)}")

    def stats(state_or_model) -> dict[str, dict[str, list[float]]]:
        out = {}
        for name in layers:
            if isinstance(state_or_model, dict):
                mean, var = state_or_model[f"{name}.running_mean"], state_or_model[f"{name}.running_var"]
            else:
                layer = bn_layers(state_or_model)[name]
                mean, var = layer.running_mean, layer.running_var
            out[name] = {"mean": mean.double().tolist(), "var": var.double().tolist()}
        return out

    prepare = engine.runner.evaluation_prepare(engine.input_state)
    result = {"layers": layers, "server": stats(engine.global_state), "clients": {}}
    last = max(names.index(n) for n in layers)
    for client in engine.clients:
        engine.load_client(client.name)
        stored = stats(engine.model)
        data = population_statistics(engine.model, client.train, prepare, names[:last + 1],
                                     engine.federation.eval_batch_size)
        result["clients"][client.name] = {"data": {n: data[n] for n in layers}, "stored": stored}
    return result


@torch.no_grad()
def population_statistics(model, data, prepare, layers: list[str], batch_size: int = 500) -> dict:
    """Exact population statistics (mean, biased variance per channel, float64) of each BN layer's input over
    ``data``, layer by layer in ``layers``' order (module order, the forward order of a feed-forward model): one
    pass per layer, the earlier layers normalizing with their exact statistics, set into the model as they are
    found (it is left holding them). A single pass folding every layer at once (the engine's BN recalibration) is
    exact for the first layer only: the deeper ones would see inputs normalized by statistics still moving."""
    found = {}
    model.eval()
    by_name = bn_layers(model)
    for name in layers:
        layer = by_name[name]
        sums: list[torch.Tensor] = []

        def measure(module, inputs):
            x = inputs[0].detach().double().transpose(0, 1).reshape(inputs[0].shape[1], -1)  # channels x values
            part = torch.stack([torch.full((x.shape[0],), float(x.shape[1]), dtype=torch.float64), x.sum(1),
                                (x * x).sum(1)])
            sums.append(part if not sums else sums.pop() + part)

        handle = layer.register_forward_pre_hook(measure)
        try:
            for start in range(0, len(data), batch_size):
                model(prepare(data.x[start:start + batch_size]))
        finally:
            handle.remove()
        count, total, squares = sums[0]
        mean = total / count
        var = (squares / count - mean * mean).clamp_min(0)
        layer.running_mean.copy_(mean.to(layer.running_mean.dtype))
        layer.running_var.copy_(var.to(layer.running_var.dtype))
        found[name] = {"mean": mean.tolist(), "var": var.tolist()}
    return found


def plot_bn_statistics(result: dict, path: Path, title: str, shared: bool, max_channels: int = 64) -> Path:
    """One row per layer, mean and variance per channel: each client's data statistics (solid) and the running
    statistics held: the server's (black, dashed) when BN is shared, each client's own (dotted) when it is local.
    The first ``max_channels`` channels of a layer (all of them in the JSON), so the lines stay readable."""
    from ..figures import pyplot, save_figure

    plt = pyplot()
    layers = result["layers"]
    fig, axes = plt.subplots(len(layers), 2, figsize=(11, 3 * len(layers)), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, layer in zip(axes, layers):
        for ax, key in zip(row, ("mean", "var")):
            for i, (client, entry) in enumerate(result["clients"].items()):
                colour = colours[i % len(colours)]
                ax.plot(entry["data"][layer][key][:max_channels], color=colour, lw=1, label=f"{client}: its data")
                if not shared:
                    ax.plot(entry["stored"][layer][key][:max_channels], color=colour, lw=1, ls=":",
                            label=f"{client}: its running")
            if shared:
                ax.plot(result["server"][layer][key][:max_channels], color="black", lw=1.2, ls="--",
                        label="server: running")
            channels = len(result["server"][layer][key])
            shown = "" if channels <= max_channels else f" (first {max_channels} of {channels})"
            ax.set_title(f"{layer}: {'mean' if key == 'mean' else 'variance'} per channel{shown}", fontsize=9)
            ax.set_xlabel("channel")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def bn_statistics_of_cell(run_dir: Path, label: str | None = None, seed: int | None = None,
                          data_dir: str | None = None, layers: list[str] | None = None) -> Path:
    """``fednorm bn-stats``: :func:`bn_statistics` of one cell from its last checkpoint, written as
    ``bn_statistics.json`` and ``bn_statistics.png`` in the cell folder (default layers: the last two BN layers,
    as FedWon Fig. 1b shows its CNN's 4th and 5th); returns the PNG's path."""
    from ..runs import store
    from ..runs.runner import RunError, cell_engine

    engine, label, seed, cell = cell_engine(run_dir, label, seed, data_dir, "fednorm bn-stats")
    names = list(bn_layers(engine.model))
    if not names:
        raise RunError(f"{label} has no BatchNorm layer: there are no BN statistics to compare")
    with torch.no_grad():
        result = bn_statistics(engine, layers or names[-2:])
    (cell / "bn_statistics.json").write_text(store.dumps(result))
    shared = not any(k.endswith("running_mean") for k in engine.local_keys)
    held = "the server's" if shared else "its own"
    return plot_bn_statistics(result, cell / "bn_statistics.png",
                              f"{label}, seed {seed}, round {engine.round}: BN statistics of each client's data "
                              f"against {held} running statistics", shared)
