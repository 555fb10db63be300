"""Where a federated run's time and memory go: the measurements behind `fednorm bench`.

For one (method, seed) cell of an experiment config this measures:

* training samples per second inside :class:`~fednorm.engines.simulation.InProcessEngine` (measured rounds
  after warm-up rounds), and the same model on the same batches in a plain PyTorch loop with no federation
  (the reference: same optimizer, prepare, precision, memory format and task loss). Their ratio is the engine
  overhead; the two alternate client by client so that a change of machine load hits both alike;
* the model's FLOPs per training sample (forward + backward, :class:`torch.utils.flop_counter.FlopCounterMode`:
  matmuls and convolutions only, as is usual), the GFLOP/s this achieves and its share of the machine's
  measured peak (a large square matmul in fp32 and bf16, best of several after a warm-up);
* the time of each round split into local training, aggregation (server ``add`` + ``finish``),
  evaluation and checkpointing, by wrapping the engine's bound methods from outside (no engine code is
  changed, so the engine can evolve without this module);
* peak memory: the process's resident-set high-water mark (``ru_maxrss``, kept by the kernel, so no short
  spike escapes it, but it covers the whole process: imports, data rendering) and an RSS sampler
  (``/proc/self/statm`` every few milliseconds, no tracemalloc) that isolates the training rounds.

:func:`bench_memory` runs the cross-device digits federation with several client counts, each in a fresh
subprocess (so ``ru_maxrss`` belongs to that count alone), to check memory is flat in the number of clients.

The bench measures the CPU (its peak, the process's RSS): engines run on the host here whatever
``federation.device`` says; a GPU run's speed is read from its run folder's metrics, not from this module.

Speed is measured, never asserted: the tests check the bookkeeping only.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

import torch
import yaml
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ..data.domain import ClientData, Split
from ..engines.seeds import augment_generator, client_augment_generator
from ..methods.augment import BatchAugment
from ..methods.tasks import CLASSIFICATION, Task
from ..methods.local_update import LocalTraining, batch_schedule, build_optimizer, has_batchnorm, native_bf16
from . import store
from .config import ExperimentConfig, MethodConfig, load_config, validate

SCHEMA = 1
TARGET_OVERHEAD_RATIO = 0.95
PHASES = ("training", "aggregation", "evaluation", "checkpointing", "other")
# FedWon's cross-device Digits-Five, with rendered stand-ins of its five domains (no data folder needed)
MEMORY_DOMAINS = ("rendered/print", "rendered/textured", "rendered/neon", "rendered/street", "rendered/synth")
MEMORY_COUNTS = (10, 100, 1000)
_MIB = 1024 * 1024

Log = Callable[[str], None]


class BenchError(RuntimeError):
    """The benchmark cannot run as asked; the message says why and what to do."""


# ------------------------------------------------------------------------------------------ machine
def cpu_model() -> str:
    """The CPU's marketing name (``/proc/cpuinfo``), else what :mod:`platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _probe(name: str) -> bool | None:
    fn = getattr(torch.cpu, name, None)
    try:
        return bool(fn()) if fn is not None else None
    except Exception:  # noqa: BLE001 - a probe that fails means "unknown", not an error
        return None


def machine_facts() -> dict:
    """What the numbers depend on: CPU, vector ISA PyTorch uses, native bf16, threads, load."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count()
    return {
        "cpu_model": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": native_bf16(),
        "amx": _probe("_is_amx_tile_supported"),
        "avx512_bf16": _probe("_is_avx512_bf16_supported"),
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "fednorm": __import__("fednorm").__version__,
    }


# ------------------------------------------------------------------------------------------ memory
def rss_mib() -> float | None:
    """The current resident set size in MiB (``/proc/self/statm``; None where there is no /proc)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / _MIB


def max_rss_mib() -> float:
    """The process's RSS high-water mark since it started (``getrusage``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / _MIB if sys.platform == "darwin" else peak / 1024


class RssSampler:
    """Samples the current RSS on a background thread; ``peak`` is the largest sample (MiB).

    Unlike ``ru_maxrss`` it can cover one stretch of the process (the training rounds, not the data
    rendering before them); a spike shorter than ``interval`` may be missed.
    """

    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self.peak: float | None = None
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> None:
        value = rss_mib()
        if value is not None:
            self.peak = value if self.peak is None else max(self.peak, value)
            self.samples += 1

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> "RssSampler":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def tensor_bytes(tree) -> int:
    """Bytes of every tensor in a nested dict / list (a client's kept state, an optimizer state)."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(v) for v in tree)
    return 0


# ------------------------------------------------------------------------------------------ FLOPs and peak
def training_flops(model: nn.Module, x: torch.Tensor, y: torch.Tensor, precision: str = "fp32",
                   task: Task = CLASSIFICATION) -> tuple[int, int]:
    """(forward, forward + backward) FLOPs of one training step of ``model`` on the batch ``(x, y)``.

    Counts what autograd actually runs: matmuls and convolutions (norms, activations and the optimizer
    are not counted); the first layer computes no input gradient when ``x`` does not require one.
    ``model`` is left with gradients and, for BatchNorm, updated running statistics: pass a copy.
    """
    model.train()
    with FlopCounterMode(display=False) as counter:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = model(x)
        forward = counter.get_total_flops()
        task.loss(logits, task.target(y)).backward()
        total = counter.get_total_flops()
    return int(forward), int(total)


def matmul_peak(dtype: torch.dtype, size: int = 2048, budget_s: float = 30.0, min_time: float = 1.0,
                max_repeats: int = 10) -> dict:
    """The machine's measured peak for ``dtype``: the best GFLOP/s of an n x n matmul after a warm-up.

    If a probe (best of two 512-square products) predicts that warm-up plus three products at ``size``
    would exceed ``budget_s`` (bf16 emulated on CPUs without AMX / AVX512-BF16 is ~100x slower than fp32),
    ``n`` is halved until they fit; the size used is recorded.
    """
    probe_n = min(size, 512)
    a = torch.randn(probe_n, probe_n).to(dtype)
    probes = []
    for _ in range(2):
        start = time.perf_counter()
        torch.mm(a, a)
        probes.append(time.perf_counter() - start)
    probe = max(min(probes), 1e-6)
    n, note = size, None
    while n > 64 and probe * (n / probe_n) ** 3 * 4 > budget_s:
        n //= 2
    if n != size:
        note = (f"reduced from {size}: a {size}-square product was predicted to take "
                f"{probe * (size / probe_n) ** 3:.0f} s")
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    c = torch.empty(n, n, dtype=dtype)
    torch.mm(a, b, out=c)  # warm-up
    times: list[float] = []
    while len(times) < max_repeats and (len(times) < 3 or sum(times) < min_time):
        start = time.perf_counter()
        torch.mm(a, b, out=c)
        times.append(time.perf_counter() - start)
    flops = 2.0 * n**3
    times.sort()
    return {"dtype": str(dtype).replace("torch.", ""), "size": n, "requested_size": size, "repeats": len(times),
            "best_s": times[0], "gflops": flops / times[0] / 1e9,
            "median_gflops": flops / statistics.median(times) / 1e9, "note": note}


# ------------------------------------------------------------------------------------------ config
def select_cell(config: ExperimentConfig, method: str | None = None, seed: int | None = None
                ) -> tuple[MethodConfig, int]:
    """The (method, seed) cell to measure: by label (or preset name), default the config's first."""
    if method is None:
        method_cfg = config.methods[0]
    else:
        found = [m for m in config.methods if m.display == method] or [m for m in config.methods if m.name == method]
        if found:
            method_cfg = found[0]
        else:
            try:
                method_cfg = MethodConfig(name=method)
            except Exception:  # noqa: BLE001 - pydantic's error is replaced by one naming the choices
                raise BenchError(f"method {method!r} is neither a method of the config "
                                 f"({', '.join(m.display for m in config.methods)}) nor a preset; "
                                 "see `fednorm methods`") from None
    return method_cfg, config.seeds[0] if seed is None else seed


def memory_config(config: ExperimentConfig, method_cfg: MethodConfig, seed: int, num_clients: int,
                  domains: tuple[str, ...] = MEMORY_DOMAINS, overrides: list[str] = ()) -> ExperimentConfig:
    """The cross-device federation of ``num_clients`` clients built from ``config``'s model and training.

    Forced: even partition over ``domains``, cross-device setting, the one method and seed. The whole pool
    (percent 1) and fraction 0.1 are FedWon's cross-device setting, unless ``overrides`` set them.
    """
    domains = tuple(domains)
    if not domains:
        raise BenchError("the memory mode needs at least one domain")
    if num_clients < len(domains) or num_clients % len(domains):
        raise BenchError(f"{num_clients} clients do not split evenly over {len(domains)} domains "
                         f"({', '.join(domains)}); use multiples of {len(domains)} or other --memory-domains")
    doc = config.model_dump(mode="json")
    doc["name"] = f"{config.name}-cross-device-{num_clients}"
    doc["methods"] = [method_cfg.model_dump(mode="json", exclude_none=True)]
    doc["seeds"] = [seed]
    doc["paper"] = None
    data, fed = doc["data"], doc["federation"]
    data.update(domains=list(domains), partition="even", clients_per_domain=num_clients // len(domains))
    fed["setting"] = "cross_device"
    fed["persistent_optimizer"] = False
    fed["byzantine"] = {}
    keys = {o.split("=", 1)[0].strip() for o in overrides}
    if "data.percent" not in keys:
        data["percent"] = 1.0
    if "federation.fraction" not in keys:
        fed["fraction"] = 0.1
    return validate(doc, source=f"memory-mode config ({num_clients} clients)")


# ------------------------------------------------------------------------------------------ phase clock
class PhaseClock:
    """Seconds spent in wrapped callables, per phase; wraps bound methods of live objects from outside."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list[Callable[[], None]] = []

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1

    def wrap(self, owner: object, attr: str, phase: str, after: Callable | None = None) -> None:
        """Replace ``owner.attr`` (an instance attribute shadowing the method) by a timed call; ``after``
        sees (args, kwargs, result) outside the timed span."""
        original = getattr(owner, attr, None)
        if not callable(original):
            raise BenchError(f"{type(owner).__name__} has no method {attr!r} to time; the engine changed: "
                             "update fednorm.runs.bench's instrumentation")
        had_own = attr in vars(owner)

        def timed(*args, **kwargs):
            with self.phase(phase):
                out = original(*args, **kwargs)
            if after is not None:
                after(args, kwargs, out)
            return out

        setattr(owner, attr, timed)
        self._undo.append(lambda: setattr(owner, attr, original) if had_own else delattr(owner, attr))

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


# ------------------------------------------------------------------------------------------ reference
def plain_training(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[tuple[Split, torch.Tensor]],
                   prepare: Callable[[torch.Tensor], torch.Tensor], precision: str,
                   task: Task = CLASSIFICATION,
                   augment: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[int, float]:
    """The reference: a plain PyTorch training loop over ``batches`` (split, index) with the task's loss, each
    uint8 batch through ``augment`` first when the run augments (its cost is the data pipeline's, not the
    engine's); (samples, seconds)."""
    model.train()
    use_bf16 = precision == "bf16"
    seen, loss_sum = 0, 0.0
    start = time.perf_counter()
    for data, index in batches:
        images, targets = data.x[index], data.y[index]
        if augment is not None:
            images, targets = augment.pair(images, targets)
        x = prepare(images)
        y = task.target(targets)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
            logits = model(x)
        loss = task.loss(logits, y)
        loss.backward()
        optimizer.step()
        loss_sum += loss.item() * len(index)
        seen += len(index)
    return seen, time.perf_counter() - start


def reference_optimizer(model: nn.Module, training: LocalTraining) -> torch.optim.Optimizer:
    """The optimizer :func:`~fednorm.methods.local_update.train_locally` builds, once for the whole loop."""
    return build_optimizer(model.parameters(), training)


# ------------------------------------------------------------------------------------------ speed
def bench_speed(config: ExperimentConfig, method_cfg: MethodConfig, seed: int, clients: list[ClientData],
                rounds: int = 3, warmup: int = 1, work_dir: Path | None = None, log: Log | None = None) -> dict:
    """Engine vs plain-loop samples/s, FLOPs per sample and the per-phase time of ``rounds`` measured rounds
    (each evaluated and checkpointed, so every phase is timed every round) after ``warmup`` rounds."""
    from .runner import build_engine

    if rounds < 1 or warmup < 0:
        raise BenchError(f"need rounds >= 1 and warmup >= 0, got rounds={rounds}, warmup={warmup}")
    method = method_cfg.build()
    if method.union_batches:
        raise BenchError(f"method {method_cfg.display!r} trains one model on the union of the clients' batches "
                         "(no per-client local training to time); bench a per-client method")
    log = log or (lambda _msg: None)
    engine = build_engine(config, method_cfg, seed, clients, device="cpu")  # measures the CPU (module doc)
    training = engine.training
    guard = has_batchnorm(engine.model)
    clock = PhaseClock()
    trained: list[tuple[int, int]] = []  # (examples, steps) of each client of the round
    # the reference: the same model (architecture, memory format, initial weights) and the optimizer
    # train_locally builds, trained on each client's batches right after the engine trained that client, so
    # that a change of machine load hits both alike; its time is taken out of the round's
    reference_model = copy.deepcopy(engine.model)
    reference_opt = reference_optimizer(reference_model, training)
    ref = {"s": 0.0, "samples": 0, "excluded": 0.0}

    def client_batches(client: ClientData, client_seed: int, freeze: bool, examples: int, steps: int):
        """The batches the engine just trained on, redrawn from the client's seed as train_locally does."""
        schedule = batch_schedule(client.num_train, training, torch.Generator().manual_seed(client_seed),
                                  guard and not freeze)
        if len(schedule) != steps or sum(len(i) for i in schedule) != examples:
            raise BenchError(f"could not redraw client {client.name!r}'s batches ({len(schedule)} vs {steps} "
                             "steps): the engine's batch schedule changed; update fednorm.runs.bench")
        return [(client.train, index) for index in schedule]

    def after_client(args, kwargs, out):
        start = time.perf_counter()
        client = args[0] if args else kwargs["client"]
        instructions = args[1] if len(args) > 1 else kwargs["instructions"]
        result = out[2]
        trained.append((result.num_examples, result.num_steps))
        batches = client_batches(client, instructions.seed, instructions.freeze_bn_stats, result.num_examples,
                                 result.num_steps)
        augment = None
        if training.augment != "none":  # the same draws as the engine's, from the client's round seed
            augment = BatchAugment(training.augment, augment_generator(instructions.seed),
                                   client_augment_generator(engine.federation.seed, client.name))
        samples, seconds = plain_training(reference_model, reference_opt, batches, engine.prepare,
                                          training.precision, training.task, augment)
        ref["s"] += seconds
        ref["samples"] += samples
        ref["excluded"] += time.perf_counter() - start

    clock.wrap(engine.runner, "run", "training", after=after_client)
    clock.wrap(engine.server, "add", "aggregation")
    clock.wrap(engine.server, "finish", "aggregation")
    clock.wrap(engine, "evaluate", "evaluation")

    tmp = tempfile.TemporaryDirectory(prefix="fednorm-bench-", dir=work_dir)
    checkpoint = Path(tmp.name) / store.CHECKPOINT_FILE
    per_round: list[dict] = []
    eval_examples = 0
    try:
        with RssSampler(interval=0.05) as sampler:
            for r in range(warmup + rounds):
                measured = r >= warmup
                log(f"{'round' if measured else 'warm-up round'} {r + 1}/{warmup + rounds}")
                clock.reset()
                trained.clear()
                ref.update(s=0.0, samples=0, excluded=0.0)
                start = time.perf_counter()
                engine.run_round()
                run_round_s = time.perf_counter() - start - ref["excluded"]
                evals = engine.evaluate()
                with clock.phase("checkpointing"):
                    store.save_checkpoint(checkpoint, engine.state_dict())
                round_s = time.perf_counter() - start - ref["excluded"]
                eval_examples = sum(e.num_examples for e in evals)
                if not measured:
                    continue
                samples = sum(t[0] for t in trained)
                phases = {p: clock.seconds.get(p, 0.0) for p in ("training", "aggregation", "evaluation",
                                                                  "checkpointing")}
                phases["other"] = round_s - sum(phases.values())
                per_round.append({
                    "round": engine.round, "participants": len(trained), "samples": samples,
                    "steps": sum(t[1] for t in trained), "round_s": round_s, "run_round_s": run_round_s,
                    **{f"{p}_s": v for p, v in phases.items()},
                    "reference_s": ref["s"], "reference_samples": ref["samples"],
                    "overhead_ratio": (samples / run_round_s) / (ref["samples"] / ref["s"]),
                })
        rounds_peak = sampler.peak
    finally:
        clock.restore()
        checkpoint_bytes = checkpoint.stat().st_size if checkpoint.exists() else None
        tmp.cleanup()

    samples = sum(p["samples"] for p in per_round)
    run_round_s = sum(p["run_round_s"] for p in per_round)
    training_s = sum(p["training_s"] for p in per_round)
    ref_samples = sum(p["reference_samples"] for p in per_round)
    ref_s = sum(p["reference_s"] for p in per_round)
    engine_sps, ref_sps = samples / run_round_s, ref_samples / ref_s
    ratios = sorted(p["overhead_ratio"] for p in per_round)

    # FLOPs of one training step on a full batch of the first client, with the engine's own input pipeline
    first = engine.clients[0]
    index = torch.arange(min(training.batch_size, first.num_train))
    forward, total = training_flops(copy.deepcopy(engine.model), engine.prepare(first.train.x[index]),
                                    first.train.y[index], training.precision, training.task)
    n = len(index)
    return {
        "warmup_rounds": warmup,
        "rounds": rounds,
        "samples": samples,
        "engine_samples_per_s": engine_sps,
        "local_training_samples_per_s": samples / training_s,
        "reference_samples_per_s": ref_sps,
        "overhead_ratio": engine_sps / ref_sps,
        "training_ratio": (samples / training_s) / ref_sps,
        "overhead_ratio_per_round": {"min": ratios[0], "median": statistics.median(ratios), "max": ratios[-1]},
        "target_overhead_ratio": TARGET_OVERHEAD_RATIO,
        "phases_mean_s": {**{p: sum(x[f"{p}_s"] for x in per_round) / rounds for p in PHASES},
                          "round": sum(x["round_s"] for x in per_round) / rounds},
        "per_round": per_round,
        "eval_examples_per_round": eval_examples,
        "checkpoint_bytes": checkpoint_bytes,
        "flops": {
            "forward_per_sample": forward / n,
            "train_per_sample": total / n,
            "batch": n,
            "counted": "matmul and convolution FLOPs (torch.utils.flop_counter), forward + backward; "
                       "norms, activations and the optimizer step are not counted",
        },
        "memory": {
            "rounds_rss_peak_mib": rounds_peak,
            "how": "rounds_rss_peak_mib: largest /proc/self/statm RSS sampled every 50 ms during the rounds "
                   "(which hold the reference model and its optimizer too)",
        },
        "client_state_bytes": tensor_bytes([engine.local_states, engine.optimizer_states, engine.algorithm_states]),
        "parameters": sum(p.numel() for p in engine.model.parameters()),
    }


# ------------------------------------------------------------------------------------------ memory
def memory_child(config_path: Path, rounds: int, work_dir: Path | None = None) -> dict:
    """One memory-mode run in this (fresh) process: build the federation, train ``rounds`` rounds, evaluate
    and checkpoint once; RSS at each stage and the process peak."""
    from .runner import build_engine, build_federation_data, needs_data_folder

    after_import = rss_mib()
    config = load_config(config_path)
    method_cfg, seed = config.methods[0], config.seeds[0]
    start = time.perf_counter()
    data_dir = None
    if needs_data_folder(config):
        from ..data.datafolder import resolve_data_dir

        data_dir = resolve_data_dir(config.data.data_dir)
    clients = build_federation_data(config, data_dir)
    data_s = time.perf_counter() - start
    after_data = rss_mib()
    engine = build_engine(config, method_cfg, seed, clients, device="cpu")  # measures the CPU (module doc)
    after_engine = rss_mib()
    round_times = []
    with tempfile.TemporaryDirectory(prefix="fednorm-bench-", dir=work_dir) as tmp, RssSampler(0.01) as sampler:
        for _ in range(rounds):
            t0 = time.perf_counter()
            engine.run_round()
            round_times.append(time.perf_counter() - t0)
        engine.evaluate()
        store.save_checkpoint(Path(tmp) / store.CHECKPOINT_FILE, engine.state_dict())
    participants = len(engine.sample_clients(0))
    return {
        "clients": len(engine.clients),
        "clients_per_domain": config.data.clients_per_domain,
        "participants_per_round": participants,
        "train_samples": sum(c.num_train for c in engine.clients),
        "rounds": rounds,
        "round_s": sum(round_times) / len(round_times),
        "data_s": data_s,
        "rss_after_import_mib": after_import,
        "rss_after_data_mib": after_data,
        "rss_after_engine_mib": after_engine,
        "rounds_rss_peak_mib": sampler.peak,
        "ru_maxrss_mib": max_rss_mib(),
        "client_state_bytes": tensor_bytes([engine.local_states, engine.optimizer_states, engine.algorithm_states]),
        "torch_threads": torch.get_num_threads(),
    }


def bench_memory(config: ExperimentConfig, method_cfg: MethodConfig, seed: int, counts=MEMORY_COUNTS,
                 domains: tuple[str, ...] = MEMORY_DOMAINS, rounds: int = 2, overrides: list[str] = (),
                 data_dir: str | None = None, threads: int | None = None, work_dir: Path | None = None,
                 log: Log | None = None) -> dict:
    """Peak memory of the cross-device federation at each client count, each in a fresh subprocess."""
    log = log or (lambda _msg: None)
    counts = [int(c) for c in counts]
    configs = [memory_config(config, method_cfg, seed, n, domains, list(overrides)) for n in counts]  # errors first
    runs = []
    with tempfile.TemporaryDirectory(prefix="fednorm-bench-", dir=work_dir) as tmp:
        for n, cfg in zip(counts, configs):
            doc = cfg.model_dump(mode="json")
            if data_dir:
                doc["data"]["data_dir"] = str(data_dir)
            path = Path(tmp) / f"memory-{n}.yaml"
            path.write_text(yaml.safe_dump(doc, sort_keys=False))
            cmd = [sys.executable, "-m", "fednorm.runs.bench", "memory-child", str(path), "--rounds", str(rounds)]
            if threads:
                cmd += ["--threads", str(threads)]
            if work_dir:
                cmd += ["--work-dir", str(work_dir)]
            log(f"memory: {n} clients (fresh process)")
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
                raise BenchError(f"the memory run with {n} clients failed (exit {proc.returncode}):\n{tail}")
            try:
                runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            except (IndexError, json.JSONDecodeError):
                raise BenchError(f"the memory run with {n} clients printed no result: {proc.stdout[-500:]!r}") from None
    peaks = [r["rounds_rss_peak_mib"] for r in runs if r["rounds_rss_peak_mib"] is not None]
    maxrss = [r["ru_maxrss_mib"] for r in runs]
    return {
        "domains": list(domains),
        "counts": counts,
        "rounds": rounds,
        "runs": runs,
        "rounds_rss_peak_spread_mib": (max(peaks) - min(peaks)) if peaks else None,
        "ru_maxrss_spread_mib": max(maxrss) - min(maxrss),
        "how": "each count in a fresh `python -m fednorm.runs.bench memory-child` process: ru_maxrss_mib is its "
               "whole-life RSS high-water mark (getrusage; includes imports and data rendering), "
               "rounds_rss_peak_mib the largest RSS sampled every 10 ms during the rounds, final evaluation "
               "and checkpoint",
    }


# ------------------------------------------------------------------------------------------ all together
def run_bench(config: ExperimentConfig, *, source: str | None = None, overrides: list[str] = (),
              method: str | None = None, seed: int | None = None, mode: str = "speed", rounds: int = 3,
              warmup: int = 1, peak_size: int = 2048, peak_budget_s: float = 30.0, counts=MEMORY_COUNTS,
              memory_domains: tuple[str, ...] = MEMORY_DOMAINS, memory_rounds: int = 2, data_dir: str | None = None,
              threads: int | None = None, work_dir: Path | None = None, log: Log | None = None) -> dict:
    """Every measurement of ``mode`` (speed, memory or all) as one JSON-ready dict."""
    from .runner import build_federation_data

    if mode not in ("speed", "memory", "all"):
        raise BenchError(f"mode must be speed, memory or all, got {mode!r}")
    log = log or (lambda _msg: None)
    if threads:
        torch.set_num_threads(threads)
    method_cfg, seed = select_cell(config, method, seed)
    machine = machine_facts()
    training = config.training.build()
    if method_cfg.lr is not None:
        training = replace(training, lr=method_cfg.lr)
    out: dict = {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv,
        "machine": machine,
        "config": {
            "source": source or "default", "overrides": list(overrides), "name": config.name,
            "method": method_cfg.display, "seed": seed, "model": config.model.name,
            "norm": method_cfg.build().norm or config.model.norm, "batch_size": training.batch_size,
            "device": "cpu",
            "precision": training.precision,
            "precision_requested": config.training.precision,
            "channels_last": config.federation.channels_last_for(training.precision),
            "channels_last_requested": config.federation.channels_last,
            "reuse_freed_memory": config.federation.reuse_freed_memory,
            "domains": list(config.data.domains), "setting": config.federation.setting,
            "fraction": config.federation.fraction, "eval_every": config.federation.eval_every,
            "checkpoint_every": config.federation.checkpoint_every,
        },
    }
    if mode in ("speed", "all"):
        from .runner import needs_data_folder

        resolved = None
        if needs_data_folder(config):
            from ..data.datafolder import resolve_data_dir

            resolved = resolve_data_dir(data_dir or config.data.data_dir)
        log("building the federation's data")
        clients = build_federation_data(config, resolved)
        rss_after_data = rss_mib()
        out["config"]["clients"] = len(clients)
        speed = bench_speed(config, method_cfg, seed, clients, rounds=rounds, warmup=warmup, work_dir=work_dir,
                            log=log)
        speed["memory"].update(rss_after_data_mib=rss_after_data, ru_maxrss_mib=max_rss_mib())
        speed["memory"]["how"] += ("; rss_after_data_mib: RSS once the data is built; ru_maxrss_mib: the process's "
                                   "RSS high-water mark (getrusage) at the end of the rounds, which includes "
                                   "imports and data rendering")
        log("timing the machine's matmul peak (fp32, bf16)")
        peaks = {"fp32": matmul_peak(torch.float32, peak_size, peak_budget_s),
                 "bf16": matmul_peak(torch.bfloat16, peak_size, peak_budget_s)}
        peak = peaks["bf16" if training.precision == "bf16" else "fp32"]
        per_sample = speed["flops"]["train_per_sample"]
        achieved = {k: per_sample * speed[f"{k}_samples_per_s"] / 1e9
                    for k in ("engine", "local_training", "reference")}
        out["speed"] = speed
        out["peak"] = peaks
        out["throughput"] = {
            "gflops": achieved,
            "peak_dtype": "bf16" if training.precision == "bf16" else "fp32",
            "peak_gflops": peak["gflops"],
            "share_of_peak": {k: v / peak["gflops"] for k, v in achieved.items()},
        }
    if mode in ("memory", "all"):
        out["memory_scaling"] = bench_memory(config, method_cfg, seed, counts, memory_domains, memory_rounds,
                                             list(overrides), data_dir, threads, work_dir, log)
    out["machine"]["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return out


def _child_main(argv: list[str]) -> int:
    """``python -m fednorm.runs.bench memory-child CONFIG.yaml --rounds R [--threads T] [--work-dir D]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fednorm.runs.bench")
    sub = parser.add_subparsers(dest="command", required=True)
    child = sub.add_parser("memory-child", help="one memory-mode run; prints its JSON result on the last line")
    child.add_argument("config", type=Path)
    child.add_argument("--rounds", type=int, default=2)
    child.add_argument("--threads", type=int, default=None)
    child.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps(memory_child(args.config, args.rounds, args.work_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
