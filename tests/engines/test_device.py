"""Where training runs (``federation.device``): resolution on this machine, and, where a CUDA GPU is present,
the same federation on the GPU as on the CPU (skipped on CPU-only machines such as CI's)."""

import json

import pytest
import torch

from fednorm.data.domain import normalize_batch
from fednorm.engines.device import resolve_device, to_device
from fednorm.engines.simulation import Federation, InProcessEngine
from fednorm.methods import LocalTraining, resolve_method
from fednorm.methods.local_update import resolve_precision
from fednorm.models import DigitCNN
from fednorm.runs import store
from fednorm.runs.config import ConfigError, load_config

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")


def test_auto_takes_a_gpu_when_pytorch_sees_one_and_the_cpu_otherwise(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="2 CUDA GPU"):
        resolve_device("cuda:2")


def test_asking_for_a_missing_gpu_or_an_unknown_device_says_what_to_set(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA GPU.*device: cpu or auto"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="auto, cpu, cuda or cuda:N"):
        resolve_device("gpu")
    with pytest.raises(ConfigError, match="device"):
        load_config("default", ["federation.device=gpu"])


def test_auto_precision_on_a_gpu_is_bf16_where_the_gpu_has_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for supported, expected in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, v=supported, **k: v)
        assert resolve_precision("auto", "cuda") == expected
    assert resolve_precision("fp32", "cuda") == "fp32"
    # and bf16 on a GPU turns channels_last on under `auto`, as on an AMX CPU
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert load_config("default").federation.channels_last_for("auto", "cuda") is True


def test_moving_to_the_device_a_tensor_is_on_copies_nothing():
    tree = {"a": torch.ones(3), "b": [torch.zeros(2), (torch.arange(2), 5)], "c": None}
    moved = to_device(tree, "cpu")
    assert moved["a"] is tree["a"] and moved["b"][0] is tree["b"][0] and moved["b"][1][0] is tree["b"][1][0]
    assert moved["b"][1][1] == 5 and moved["c"] is None and isinstance(moved["b"][1], tuple)


def test_runs_on_the_resolved_device_and_records_it(tmp_path, monkeypatch):
    from fednorm.runs.runner import build_engine, build_federation_data, start_run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = load_config("default", ["data.domains=[rendered/print, rendered/neon]", "data.rendered_size=60",
                                     "data.pool_size=60", "model.width=0.125", "federation.rounds=1",
                                     "methods=[fedbn]"])
    assert config.federation.device == "auto"  # the default
    engine = build_engine(config, config.methods[0], 0, build_federation_data(config, None))
    assert engine.federation.device == "cpu" and engine.device == torch.device("cpu")
    assert all(t.device.type == "cpu" for t in engine.global_state.values())
    start_run(config, tmp_path / "run")
    assert json.loads((tmp_path / "run" / "run.json").read_text())["device"] == "cpu"


def _engine(clients, device, method):
    """``method`` with all BN state local (UniFed's add-on): shared, local and algorithm state all move."""
    torch.manual_seed(0)
    return InProcessEngine(DigitCNN(width=0.125), clients, resolve_method(method, policy="local_bn"),
                           LocalTraining(batch_size=8, lr=0.05, momentum=0.9),
                           Federation(seed=0, device=device, channels_last=False, persistent_optimizer=True),
                           normalize_batch)


@needs_cuda
@pytest.mark.parametrize("method", ["fedavg", "scaffold", "fedadam"])
def test_a_gpu_federation_matches_the_cpu_one_and_resumes_from_a_cpu_checkpoint(tiny_clients, method, tmp_path):
    cpu, gpu = _engine(tiny_clients, "cpu", method), _engine(tiny_clients, "cuda", method)
    for _ in range(2):
        cpu.run_round()
        gpu.run_round()
    assert all(t.device.type == "cuda" for t in gpu.global_state.values())
    for key, value in cpu.global_state.items():
        torch.testing.assert_close(gpu.global_state[key].cpu(), value, rtol=1e-3, atol=1e-4)
    for c in tiny_clients:
        for key, value in cpu.local_states[c.name].items():
            torch.testing.assert_close(gpu.local_states[c.name][key].cpu(), value, rtol=1e-3, atol=1e-4)
    on_cpu = {(e.client, e.split): e for e in cpu.evaluate()}
    on_gpu = {(e.client, e.split): e for e in gpu.evaluate()}
    assert on_cpu.keys() == on_gpu.keys()
    for key, e in on_gpu.items():  # the same scores: at most one sample may flip on rounding
        assert e.num_examples == on_cpu[key].num_examples
        assert e.accuracy == pytest.approx(on_cpu[key].accuracy, abs=1 / e.num_examples + 1e-9)
        assert e.loss == pytest.approx(on_cpu[key].loss, rel=1e-3)
    # a checkpoint is read to the host (store.load_checkpoint) and resumes on the GPU
    store.save_checkpoint(tmp_path / "checkpoint.pt", cpu.state_dict())
    resumed = _engine(tiny_clients, "cuda", method)
    resumed.load_state_dict(store.load_checkpoint(tmp_path / "checkpoint.pt"))
    resumed.run_round()
    cpu.run_round()
    for key, value in cpu.global_state.items():
        torch.testing.assert_close(resumed.global_state[key].cpu(), value, rtol=1e-3, atol=1e-4)
