"""UniFed's test-time BN ablation (Fig. 6): external accuracy against the test batch size and the momentum.

Re-evaluates the external clients of a finished run from its checkpoints (no training): every cell
(method, seed) of the run folder, test-time BN statistics with each test batch size of
:data:`fednorm.methods.external.ABLATION_TEST_BATCH_SIZES` at the run's momentum, and each momentum of
:data:`~fednorm.methods.external.ABLATION_MOMENTA` at batch size 32; the global model ("aggregated BN", flat
in both) is the baseline row. Writes ``unifed_ablation.md`` into the run folder.

    python -m fednorm.runs.unifed_ablation RUN [--data-dir DIR]
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from ..data.datafolder import resolve_data_dir
from ..methods.external import ABLATION_MOMENTA, ABLATION_TEST_BATCH_SIZES, evaluate_external
from . import store
from .runner import _needs_data_folder, build_engine, build_federation_data, load_run_config, split_external


def ablation_rows(run_dir: Path, data_dir: str | None = None) -> list[tuple[str, str, float, float]]:
    """(cell, setting, external client, accuracy %) for every finished cell and ablation setting."""
    config = load_run_config(run_dir)
    if not config.external.domains:
        raise SystemExit(f"{run_dir}: the run has no external clients (external.domains); nothing to ablate")
    resolved = resolve_data_dir(data_dir or config.data.data_dir) if _needs_data_folder(config) else None
    clients = build_federation_data(config, resolved)
    _, external = split_external(clients)
    rows = []
    base = config.external.bn()
    for method_cfg in config.methods:
        for seed in config.seeds:
            cell = store.cell_dir(run_dir, method_cfg.display, seed)
            checkpoint = cell / store.CHECKPOINT_FILE
            if not checkpoint.exists():
                continue
            engine = build_engine(config, method_cfg, seed, clients)
            engine.load_state_dict(store.load_checkpoint(checkpoint))
            prepare = engine.runner.evaluation_prepare(engine.input_state)
            label = f"{method_cfg.display}/seed{seed}"
            settings = [("global", "global", base), ("fedbn_average (App. G)", "fedbn_average", None)]
            settings += [(f"batch {b}", "test_time_bn", replace(base, batch_size=b)) for b in ABLATION_TEST_BATCH_SIZES]
            settings += [(f"momentum {m}", "test_time_bn", replace(base, batch_size=32, momentum=m))
                         for m in ABLATION_MOMENTA]
            for client in external:
                for name, mode, bn in settings:
                    engine.model.load_state_dict(engine.global_state)
                    states = [engine.local_states[c.name] for c in engine.clients if c.name in engine.local_states]
                    result = evaluate_external(engine.model, client.test, prepare, mode, bn,
                                               client_states=states or [engine.global_state])
                    rows.append((label, name, client.name, 100 * result.accuracy))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--data-dir")
    args = parser.parse_args(argv)
    rows = ablation_rows(args.run, args.data_dir)
    clients = sorted({r[2] for r in rows})
    cells = sorted({r[0] for r in rows})
    lines = ["| cell | setting | " + " | ".join(clients) + " | mean |", "|---|---|" + "---|" * (len(clients) + 1)]
    for cell in cells:
        settings = [r[1] for r in rows if r[0] == cell]
        for setting in dict.fromkeys(settings):
            accs = {r[2]: r[3] for r in rows if r[0] == cell and r[1] == setting}
            mean = sum(accs.values()) / len(accs)
            lines.append(f"| {cell} | {setting} | " + " | ".join(f"{accs[c]:.2f}" for c in clients) + f" | {mean:.2f} |")
    text = "\n".join(lines) + "\n"
    (args.run / "unifed_ablation.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
