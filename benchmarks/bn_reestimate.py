"""Re-estimate the BN running statistics of a finished run cell and re-evaluate each client's test accuracy:
are a method's stored statistics what holds its accuracy back?

  python benchmarks/bn_reestimate.py <run folder of one method and seed> [--union] [--cumulative-b4] [--ema-draws 5]

Needs the cell's checkpoint.pt (not committed: only on the machine that ran it). Read-only for the run folder:
builds the run's clients and engine with fednorm's own code (build_federation_data / build_engine /
store.load_checkpoint / engine.load_state_dict / engine.evaluate) and swaps BN running_mean / running_var in memory.
Variants: per client, statistics recomputed over the client's training split at the final weights (train-mode BN,
momentum None = cumulative average, fixed shuffle) in batches of --batch, of the whole split, and (--cumulative-b4)
of 4; --ema-draws N repeats the stored statistics' own procedure at the final weights (batch 4, momentum 0.1, one
epoch from the stored values, N shuffles): if these score like the precise ones, the stored statistics are off by
staleness, not by small-batch noise; --union recomputes shared statistics over all clients' training data
(meaningful for a method with shared BN only). See benchmarks/fedwon.md, "Table 20 on PACS, B = 4".
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from fednorm.methods.external import ExternalBN, reestimate_bn_statistics
from fednorm.runs import store
from fednorm.runs.runner import (build_engine, build_federation_data, load_cell_state, load_run_config,
                                 partition_record, split_external)

ap = argparse.ArgumentParser()
ap.add_argument("run_dir")
ap.add_argument("--data-dir", default="../shared/data")
ap.add_argument("--batch", type=int, default=32)
ap.add_argument("--union", action="store_true", help="also re-estimate over the union of all clients' train data")
ap.add_argument("--max-train", type=int, default=None, help="cap per-client training images (fixed subset)")
ap.add_argument("--out", default=None)
ap.add_argument("--ema-draws", type=int, default=0,
                help="noise check: N re-draws of the stored-stats procedure (start from stored stats, one epoch of "
                     "train-mode BN at batch 4, momentum 0.1, differently shuffled), each evaluated")
ap.add_argument("--cumulative-b4", action="store_true", help="also cumulative (momentum None) re-estimation at batch 4")
args = ap.parse_args()

t0 = time.time()
run_dir = Path(args.run_dir)
config = load_run_config(run_dir)
assert len(config.methods) == 1 and len(config.seeds) == 1
method_cfg, seed = config.methods[0], config.seeds[0]
clients = build_federation_data(config, Path(args.data_dir))
# the same data the run trained on?
saved = json.loads((run_dir / "partitions.json").read_text())
print("partitions identical to partitions.json:", saved == partition_record(clients))
engine = build_engine(config, method_cfg, seed, clients)
cell = store.cell_dir(run_dir, method_cfg.display, seed)
load_cell_state(engine, cell / store.CHECKPOINT_FILE, "python benchmarks/bn_reestimate.py", client_state=True)
print(f"method {method_cfg.display}, round {engine.round}, policy {engine.method.policy}, "
      f"#local keys {len(engine.local_keys)}, setup {time.time()-t0:.1f}s", flush=True)
summary = json.loads((cell / store.SUMMARY_FILE).read_text())
recorded = {c["name"]: c["test"]["final_acc"] for c in summary["clients"]}

bn_layers = {n: m for n, m in engine.model.named_modules() if isinstance(m, _BatchNorm)}
print("BN layers:", {n: m.num_features for n, m in bn_layers.items()}, "momentum", {m.momentum for m in bn_layers.values()})
train_clients, _ = split_external(clients)
prepare = engine.runner.evaluation_prepare(engine.input_state)  # == engine.prepare (no amplitude norm); augment none


def evaluate(label: str) -> dict[str, float]:
    t = time.time()
    evals = engine.evaluate(splits=("test",))
    acc = {e.client: e.accuracy for e in evals}
    print(f"[{label}] " + "  ".join(f"{k.split('/')[-1]} {100*v:.2f}" for k, v in acc.items())
          + f"  Avg {100*sum(acc.values())/len(acc):.2f}   ({time.time()-t:.1f}s)", flush=True)
    return acc


def subset(split, n_max, seed=0):
    if n_max is None or len(split) <= n_max:
        return split
    idx = torch.randperm(len(split), generator=torch.Generator().manual_seed(seed))[:n_max].sort().values
    return split.subset(idx)


# The re-estimation below runs the BN layers in train mode (each layer normalizes with the batch's statistics and
# folds them into its running ones), as local training does, so that --ema-draws replays exactly how the stored
# statistics were made. The library's `reestimate_bn_statistics` (fednorm.methods.external, UniFed's test-time BN /
# FedBN App. G) normalizes each batch with the tracked statistics instead (eval mode); its population estimate is
# run as a cross-check (row "library population statistics").
@torch.no_grad()
def reestimate(state: dict[str, torch.Tensor], data, batch: int, momentum=None, reset=True,
               shuffle_seed=1234) -> dict[str, torch.Tensor]:
    """Load ``state`` into the working model, recompute BN running stats over ``data`` (train-mode BN, momentum
    None = cumulative average over batches, shuffled with a fixed seed); return {key: new running_mean/var}."""
    engine.model.load_state_dict(state)
    engine.model.eval()  # dropout off (it sits after every BN anyway); BN layers in train mode
    saved_m = {}
    for n, m in bn_layers.items():
        saved_m[n] = m.momentum
        if reset:
            m.reset_running_stats()
        m.momentum = momentum
        m.train()
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(shuffle_seed))
    for s in range(0, len(data), batch):
        idx = order[s:s + batch]
        if len(idx) < 2:
            continue
        engine.model(prepare(data.x[idx]))
    out = {}
    for n, m in bn_layers.items():
        out[f"{n}.running_mean"] = m.running_mean.detach().clone()
        out[f"{n}.running_var"] = m.running_var.detach().clone()
        m.momentum = saved_m[n]
    engine.model.eval()
    return out


def stat_diff(stored: dict, new: dict) -> dict:
    rows = {}
    for n in bn_layers:
        sv, nv = stored[f"{n}.running_var"].float(), new[f"{n}.running_var"].float()
        sm, nm = stored[f"{n}.running_mean"].float(), new[f"{n}.running_mean"].float()
        rel_var = ((sv - nv).abs() / nv.clamp_min(1e-12))
        rows[n] = {"var_rel_mean": rel_var.mean().item(), "var_rel_median": rel_var.median().item(),
                   "log_var_ratio_mean": (sv / nv).log().mean().item(),  # >0: stored larger
                   "mean_shift_in_std": ((sm - nm).abs() / nv.sqrt()).mean().item()}
    return rows


results = {"recorded": recorded}
results["stored"] = evaluate("stored stats (baseline)")
print("max |baseline - recorded| =", max(abs(results["stored"][k] - recorded[k]) for k in recorded))

global_state = engine.global_state
orig_local = {k: dict(v) for k, v in engine.local_states.items()}


def evaluate_with(local_states: dict, label: str) -> dict[str, float]:
    """Score every client with ``local_states`` in place of the stored ones (in memory only: load_client overlays
    them on the global state), then restore the stored local states."""
    engine.local_states = local_states
    try:
        return evaluate(label)
    finally:
        engine.local_states = {k: dict(v) for k, v in orig_local.items()}
diffs = {}
precise = {}  # client -> its statistics re-estimated at --batch (the reference of the --ema-draws check)
variants = [(args.batch, f"b{args.batch}"), (None, "fullbatch")] + ([(4, "b4")] if args.cumulative_b4 else [])
for batch, tag in variants:
    new_local = {}
    for c in train_clients:
        data = subset(c.train, args.max_train)
        b = batch or len(data)
        base = {**global_state, **orig_local.get(c.name, {})}
        new = reestimate(base, data, b)
        new_local[c.name] = {**orig_local.get(c.name, {}), **new}
        if tag == f"b{args.batch}":
            diffs[c.name] = stat_diff(base, new)
            precise[c.name] = new
    results[f"per_client_{tag}"] = evaluate_with(new_local, f"per-client re-estimated, {tag}")

# cross-check with the library's population statistics (FedBN App. G's estimator) at the same batch size and order
new_local = {}
for c in train_clients:
    engine.model.load_state_dict({**global_state, **orig_local.get(c.name, {})})
    net = reestimate_bn_statistics(engine.model, subset(c.train, args.max_train), prepare,
                                   ExternalBN(batch_size=args.batch, momentum=None, predict="after_pass",
                                              shuffle_seed=1234, unbiased=True))
    new_local[c.name] = {**orig_local.get(c.name, {}),
                         **{k: v for k, v in net.state_dict().items() if k.endswith(("running_mean", "running_var"))}}
results["per_client_library_population"] = evaluate_with(
    new_local, f"per-client library population statistics, b{args.batch}")

for draw in range(args.ema_draws):
    new_local = {}
    for c in train_clients:
        base = {**global_state, **orig_local.get(c.name, {})}
        new = reestimate(base, c.train, 4, momentum=0.1, reset=False, shuffle_seed=100 + draw)
        if draw == 0:  # how far same-noise stats at the final weights are from the precise ones
            diffs[f"{c.name} [EMA draw0 vs precise]"] = stat_diff(new, precise[c.name])
        new_local[c.name] = {**orig_local.get(c.name, {}), **new}
    results[f"ema_draw{draw}"] = evaluate_with(
        new_local, f"noise check: stored-style EMA (b4, momentum 0.1, 1 epoch) draw {draw}")

if args.union:
    from fednorm.data.domain import Split
    union = Split.concat([subset(c.train, args.max_train) for c in train_clients])
    new = reestimate(dict(global_state), union, args.batch)
    results[f"union_b{args.batch}"] = evaluate_with(
        {c.name: {**orig_local.get(c.name, {}), **new} for c in train_clients},
        f"union re-estimated, b{args.batch} (n={len(union)})")
    diffs["__union__"] = stat_diff(global_state, new)

print("\nBN stat differences, stored vs re-estimated (b%d): per layer" % args.batch)
for cname, rows in diffs.items():
    print(f"  {cname}")
    for n, r in rows.items():
        print(f"    {n:14s} var |rel diff| mean {r['var_rel_mean']:.3f} median {r['var_rel_median']:.3f}  "
              f"mean log(stored/new var) {r['log_var_ratio_mean']:+.3f}  |mean shift|/std {r['mean_shift_in_std']:.3f}")
results["stat_diffs"] = diffs
results["wall_s"] = time.time() - t0
print(f"wall {results['wall_s']:.1f}s, process CPU {time.process_time():.1f}s")
if args.out:
    Path(args.out).write_text(json.dumps(results, indent=2))
