"""`fednorm bench`: the bookkeeping of the measurements (never their speed)."""

import json

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from fednorm.cli.main import app
from fednorm.runs import bench
from fednorm.runs.config import ConfigError
from fednorm.runs.runner import build_federation_data

from ..conftest import batchnorm_keys
from .test_runner import TINY, tiny_config

SETS = [arg for item in TINY for arg in ("--set", item)]
TWO_DOMAINS = ("rendered/print", "rendered/neon")


def _get(tree: dict, dotted: str):
    for part in dotted.split("."):
        assert isinstance(tree, dict) and part in tree, f"missing {dotted!r} (at {part!r})"
        tree = tree[part]
    return tree


def test_flops_of_one_linear_layer_are_exact():
    layer = nn.Linear(8, 5)
    x, y = torch.randn(4, 8), torch.randint(0, 5, (4,))
    forward, total = bench.training_flops(layer, x.requires_grad_(True), y)
    assert forward == 2 * 8 * 5 * 4  # 2 * in * out per sample
    assert total == 3 * forward  # backward: input gradient and weight gradient, each as much as the forward
    forward, total = bench.training_flops(nn.Linear(8, 5), torch.randn(4, 8), y)
    assert total == 2 * forward  # an input without gradient: autograd computes the weight gradient only


def test_phases_add_up_to_the_round_and_the_reference_sees_the_same_batches():
    cfg = tiny_config()
    method_cfg, seed = bench.select_cell(cfg, "fedbn")
    clients = build_federation_data(cfg, None)
    speed = bench.bench_speed(cfg, method_cfg, seed, clients, rounds=2, warmup=1)
    assert len(speed["per_round"]) == 2
    for r in speed["per_round"]:
        named = sum(r[f"{p}_s"] for p in ("training", "aggregation", "evaluation", "checkpointing"))
        # other_s is the round minus the named phases: it is never negative when the phases are timed apart (no
        # phase counted twice, none timed outside the round)
        assert r["other_s"] >= -1e-9 and r["training_s"] + r["aggregation_s"] <= r["run_round_s"] + 1e-9
        # the timed phases cover the round: what is left is the engine's bookkeeping between them
        assert named >= r["round_s"] - max(0.25 * r["round_s"], 0.05)
        assert r["reference_samples"] == r["samples"] == sum(c.num_train for c in clients)
        assert r["participants"] == len(clients)
    # FedBN keeps exactly its BN entries (affine, running statistics, counter) on each client
    from fednorm.models import DigitCNN

    model = DigitCNN(width=0.125)
    state, bn = model.state_dict(), batchnorm_keys(model)
    assert speed["client_state_bytes"] == len(clients) * sum(state[k].numel() * state[k].element_size() for k in bn)
    # FLOPs of the width-1/8 digit CNN at 28 x 28 (multiply-adds x 2: convs 3-8-8-16 of 5 x 5, FCs 784-256-64-10);
    # training is forward + input gradient + weight gradient, except the first layer's input gradient
    conv1 = 2 * 3 * 8 * 25 * 28 * 28
    forward = conv1 + 2 * 8 * 8 * 25 * 14 * 14 + 2 * 8 * 16 * 25 * 7 * 7 + 2 * 784 * 256 + 2 * 256 * 64 + 2 * 64 * 10
    assert speed["flops"]["forward_per_sample"] == forward
    assert speed["flops"]["train_per_sample"] == 3 * forward - conv1


def test_segmentation_bench_trains_the_reference_with_the_task_loss():
    """The reference loop and the FLOP count take the run's task (masks, CE + Dice), not class labels."""
    from fednorm.data.domain import ClientData
    from fednorm.runs.config import load_config
    from fednorm.runs.runner import needs_data_folder

    from ..engines.test_segmentation_engine import synthetic_segmentation

    cfg = load_config("harmofl_prostate", ["model.width=0.125", "seeds=[0]", "methods=[fedavg]",
                                           "training.batch_size=4"])
    clients = [ClientData(d, d, synthetic_segmentation(8, i), synthetic_segmentation(4, 10 + i))
               for i, d in enumerate(cfg.data.domains)]
    method_cfg, seed = bench.select_cell(cfg, "fedavg")
    speed = bench.bench_speed(cfg, method_cfg, seed, clients, rounds=1, warmup=1)
    assert speed["per_round"][0]["reference_samples"] == speed["per_round"][0]["samples"] == 8 * len(clients)
    # FLOPs by hand from the layer shapes of the run's U-Net on a 4-image batch: 2 x multiply-adds of every
    # convolution (C_in/groups x C_out x k x k per output pixel; a transposed one per input pixel) and linear layer;
    # training adds the input and the weight gradient of each, except the first layer's input gradient
    from fednorm.runs.runner import build_engine

    model = build_engine(cfg, method_cfg, seed, clients).model
    layers: list[int] = []

    def count(module, inputs, output):
        if isinstance(module, nn.ConvTranspose2d):
            layers.append(2 * module.weight.numel() * inputs[0].shape[2] * inputs[0].shape[3])
        elif isinstance(module, nn.Conv2d):
            layers.append(2 * module.weight.numel() * output.shape[2] * output.shape[3])
        elif isinstance(module, nn.Linear):
            layers.append(2 * module.weight.numel())

    for module in model.modules():
        module.register_forward_hook(count)
    model.eval()(torch.rand(1, 3, *clients[0].train.x.shape[2:]))  # eval: BN on one image; shapes are the same
    assert len(layers) == 23  # 4 encoder blocks, the bottleneck, 4 up-convolutions, 4 decoder blocks, the head
    assert speed["flops"]["batch"] == 4
    assert speed["flops"]["forward_per_sample"] == sum(layers)
    assert speed["flops"]["train_per_sample"] == 3 * sum(layers) - layers[0]
    # a run whose only files are its external clients' still needs the data folder
    assert needs_data_folder(tiny_config("external.domains=[usps]")) and not needs_data_folder(tiny_config())


def test_phase_clock_restores_the_wrapped_methods():
    class Thing:
        def work(self, x):
            return 2 * x

    thing, clock, seen = Thing(), bench.PhaseClock(), []
    clock.wrap(thing, "work", "training", after=lambda args, kwargs, out: seen.append(out))
    assert thing.work(3) == 6 and seen == [6] and clock.calls["training"] == 1
    clock.restore()
    assert "work" not in vars(thing) and thing.work(1) == 2
    with pytest.raises(bench.BenchError, match="no method"):
        clock.wrap(thing, "missing", "training")


def test_cli_writes_every_field(tmp_path):
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, [
        "bench", *SETS, "--method", "fedavg", "--rounds", "1", "--warmup", "0", "--peak-size", "64", "--mode", "all",
        "--clients", "2", "--memory-domains", ",".join(TWO_DOMAINS), "--memory-rounds", "1", "--out", str(out),
        "--quiet"])
    assert result.exit_code == 0, result.output
    assert "engine overhead ratio" in result.output and "peak memory by client count" in result.output
    data = json.loads(out.read_text())
    for key in (
        "schema", "created", "argv",
        "machine.cpu_model", "machine.cpu_capability", "machine.native_bf16", "machine.amx", "machine.avx512_bf16",
        "machine.torch_threads", "machine.cpu_count", "machine.load_average", "machine.load_average_end",
        "config.name", "config.method", "config.seed", "config.model", "config.batch_size", "config.precision",
        "config.channels_last", "config.clients",
        "speed.engine_samples_per_s", "speed.local_training_samples_per_s", "speed.reference_samples_per_s",
        "speed.overhead_ratio", "speed.training_ratio", "speed.overhead_ratio_per_round.median",
        "speed.target_overhead_ratio", "speed.samples", "speed.per_round", "speed.checkpoint_bytes",
        *(f"speed.phases_mean_s.{p}" for p in (*bench.PHASES, "round")),
        "speed.flops.forward_per_sample", "speed.flops.train_per_sample",
        "speed.memory.ru_maxrss_mib", "speed.memory.rss_after_data_mib", "speed.memory.rounds_rss_peak_mib",
        "speed.memory.how", "speed.client_state_bytes",
        "peak.fp32.gflops", "peak.fp32.size", "peak.bf16.gflops", "peak.bf16.size",
        "throughput.gflops.engine", "throughput.gflops.reference", "throughput.peak_gflops",
        "throughput.share_of_peak.engine", "throughput.share_of_peak.reference",
        "memory_scaling.counts", "memory_scaling.runs", "memory_scaling.how", "memory_scaling.ru_maxrss_spread_mib",
    ):
        _get(data, key)
    assert data["config"]["method"] == "fedavg" and data["speed"]["rounds"] == 1
    # the summary figures are the per-round measurements' ratios, with the FLOP count and the fp32 peak
    speed, throughput, (r,) = data["speed"], data["throughput"], data["speed"]["per_round"]
    assert speed["engine_samples_per_s"] == pytest.approx(r["samples"] / r["run_round_s"])
    assert speed["reference_samples_per_s"] == pytest.approx(r["reference_samples"] / r["reference_s"])
    assert speed["overhead_ratio"] == pytest.approx(speed["engine_samples_per_s"] / speed["reference_samples_per_s"])
    assert speed["overhead_ratio"] == pytest.approx(r["overhead_ratio"])
    assert speed["training_ratio"] == pytest.approx(r["samples"] / r["training_s"] / speed["reference_samples_per_s"])
    assert throughput["peak_gflops"] == data["peak"]["fp32"]["gflops"]
    for k in ("engine", "reference"):
        assert throughput["gflops"][k] == pytest.approx(speed["flops"]["train_per_sample"]
                                                        * speed[f"{k}_samples_per_s"] / 1e9)
        assert throughput["share_of_peak"][k] == pytest.approx(throughput["gflops"][k] / throughput["peak_gflops"])
    for key in ("training_s", "aggregation_s", "evaluation_s", "checkpointing_s", "other_s", "round_s",
                "reference_s", "overhead_ratio"):
        assert key in data["speed"]["per_round"][0]
    (run,) = data["memory_scaling"]["runs"]
    assert run["clients"] == 2 and run["clients_per_domain"] == 1 and run["participants_per_round"] == 1
    for key in ("ru_maxrss_mib", "rounds_rss_peak_mib", "rss_after_data_mib", "rss_after_import_mib",
                "client_state_bytes", "round_s"):
        assert key in run


def test_memory_config_forces_the_cross_device_federation():
    cfg = tiny_config()
    method_cfg, seed = bench.select_cell(cfg, "fedavg", 3)
    mem = bench.memory_config(cfg, method_cfg, seed, 10, TWO_DOMAINS)
    assert mem.data.partition == "even" and mem.data.clients_per_domain == 5 and mem.data.percent == 1.0
    assert mem.federation.setting == "cross_device" and mem.federation.fraction == 0.1
    assert [m.name for m in mem.methods] == ["fedavg"] and mem.seeds == [3]
    assert mem.model == cfg.model and mem.training == cfg.training
    kept = bench.memory_config(cfg, method_cfg, seed, 4, TWO_DOMAINS, overrides=["data.percent=0.2"])
    assert kept.data.percent == 0.2
    with pytest.raises(bench.BenchError, match="split evenly"):
        bench.memory_config(cfg, method_cfg, seed, 5, TWO_DOMAINS)
    with pytest.raises(ConfigError, match="stateless"):
        bench.memory_config(cfg, bench.select_cell(cfg, "fedbn")[0], seed, 4, TWO_DOMAINS)


def test_unknown_method_and_bad_counts_fail_clearly(tmp_path):
    with pytest.raises(bench.BenchError, match="neither a method of the config"):
        bench.select_cell(tiny_config(), "fedbnn")
    result = CliRunner().invoke(app, ["bench", *SETS, "--mode", "memory", "--clients", "3",
                                      "--memory-domains", ",".join(TWO_DOMAINS), "--out", str(tmp_path / "b.json")])
    assert result.exit_code == 2 and "split evenly" in result.output
    assert not (tmp_path / "b.json").exists()
    for counts, message in (("10,x", "comma-separated integers"), ("0", "at least one positive count"),
                            (",", "at least one positive count")):
        result = CliRunner().invoke(app, ["bench", *SETS, "--mode", "memory", "--clients", counts,
                                          "--out", str(tmp_path / "b.json")], terminal_width=400)
        assert result.exit_code == 2 and message in result.output, (counts, result.output)
        assert not (tmp_path / "b.json").exists()


def test_a_config_error_keeps_its_bracketed_advice(tmp_path):
    # the message is printed as text: "[global]" is not read as a style tag and dropped
    result = CliRunner().invoke(app, ["bench", "unifed_camelyon17", "--set", "model.bn_mode=batch",
                                      "--out", str(tmp_path / "b.json")], terminal_width=400)
    assert result.exit_code == 2
    assert "use external.modes: [global], or model.bn_mode: running" in " ".join(result.output.split())


def test_matmul_peak_shrinks_to_its_time_budget():
    peak = bench.matmul_peak(torch.float32, size=512, budget_s=1e-9, min_time=0.0)
    assert peak["size"] == 64 and peak["requested_size"] == 512 and "reduced from 512" in peak["note"]
    assert peak["repeats"] >= 3 and peak["gflops"] == pytest.approx(2 * 64**3 / peak["best_s"] / 1e9)


def test_memory_probes():
    with bench.RssSampler(interval=0.001) as sampler:
        torch.zeros(1 << 20).add_(1)
    if bench.rss_mib() is not None:  # Linux
        assert sampler.peak > 0 and sampler.samples >= 2
    assert bench.max_rss_mib() > 0
    assert bench.tensor_bytes({"a": torch.zeros(3), "b": [torch.zeros(2, dtype=torch.float64)], "c": 1}) == 28


def test_the_reference_loop_augments_as_the_engine_does(monkeypatch):
    """With training.augment the reference trains on the very batches the engine trained on, augmented with the
    same draws: the augmentation is the data pipeline's cost, not engine overhead."""
    import fednorm.methods.local_update as local_update
    from fednorm.methods.augment import BatchAugment

    seen = {"engine": [], "reference": []}

    def recording(where):
        class Recording(BatchAugment):
            def pair(self, x, y):
                out = super().pair(x, y)
                seen[where].append(out[0])
                return out
        return Recording

    monkeypatch.setattr(local_update, "BatchAugment", recording("engine"))
    monkeypatch.setattr(bench, "BatchAugment", recording("reference"))
    cfg = tiny_config("training.augment=fedbn_objects")
    method_cfg, seed = bench.select_cell(cfg, "fedavg")
    bench.bench_speed(cfg, method_cfg, seed, build_federation_data(cfg, None), rounds=1, warmup=0)
    assert len(seen["engine"]) == len(seen["reference"]) > 0
    assert all(torch.equal(a, b) for a, b in zip(seen["engine"], seen["reference"]))
    assert not torch.equal(seen["engine"][0], seen["engine"][1])  # augmented batches, not one repeated
