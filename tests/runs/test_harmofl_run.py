"""End to end: `fednorm run` of a tiny HarmoFL config (the harmofl_digits preset on rendered digits) writes its
run folder, with the ablation's methods, an alpha-sweep label and the averaged amplitude in the checkpoint."""

import json

import pytest
import torch
from typer.testing import CliRunner

from fednorm.cli.main import app
from fednorm.runs.config import load_config

TINY_HARMOFL = [
    "data.domains=[rendered/print, rendered/neon]",
    "data.rendered_size=300",
    "data.pool_size=200",
    "model.width=0.125",
    "training.precision=fp32",
    "federation.rounds=2",
    "federation.eval_every=1",
    "training.batch_size=128",  # one batch per client and round: its round-1 amplitude is the batch's mean
    "seeds=[0]",
    "methods=[fedavg, harmofl, {name: harmofl, label: harmofl-a0.5, weight_perturbation: 0.5}, "
    "{name: harmofl, label: harmofl-code-init, amplitude_init: first_batch}]",
]


def test_fednorm_run_of_a_tiny_harmofl_config(tmp_path):
    out = tmp_path / "run"
    args = ["run", "harmofl_digits", *[a for item in TINY_HARMOFL for a in ("--set", item)], "--out", str(out),
            "--quiet"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "test accuracy (%)" in result.output and "harmofl-a0.5" in result.output
    table = json.loads((out / "results.json").read_text())
    assert list(table["methods"]) == ["fedavg", "harmofl", "harmofl-a0.5", "harmofl-code-init"]
    assert table["score"] == "accuracy"
    ckpt = torch.load(out / "harmofl" / "seed0" / "checkpoint.pt", weights_only=False)
    assert ckpt["round"] == 2 and ckpt["input_state"]["amp.global"].shape == (3, 28, 28)
    # the global amplitude (Alg. 1 l.17): the uniform mean of the clients' round-1 amplitudes, each Eq. 3's first
    # value from the client's one batch, the mean per-channel FFT amplitude of its training images in [0, 1]: times
    # v = 0.1 from the paper's Abar_0 = 0 (default), times 1 from the official code's first-batch start
    from fednorm.runs.runner import build_federation_data

    clients = build_federation_data(load_config("harmofl_digits", TINY_HARMOFL), None)
    batch_mean = torch.stack([torch.fft.fft2(c.train.x.double() / 255).abs().mean(0) for c in clients]).mean(0)
    for label, weight in (("harmofl", 0.1), ("harmofl-a0.5", 0.1), ("harmofl-code-init", 1.0)):
        amp = torch.load(out / label / "seed0" / "checkpoint.pt", weights_only=False)["input_state"]["amp.global"]
        torch.testing.assert_close(amp, (weight * batch_mean).float(), rtol=1e-5, atol=1e-4)
    assert "amp.global" not in torch.load(out / "fedavg" / "seed0" / "checkpoint.pt", weights_only=False)["input_state"]
    summary = json.loads((out / "harmofl-a0.5" / "seed0" / "summary.json").read_text())
    assert summary["metric"] == "accuracy" and len(summary["clients"]) == 2


class Stop(Exception):
    pass


@pytest.mark.parametrize("written, weight", [("without the key", 1.0), ("with a null key", 0.1)])
def test_a_run_folder_written_before_config_yaml_recorded_the_amplitude_start_resumes_with_its_start(
        tmp_path, written, weight):
    """Before 2026-11-30 AmpNorm started from the first batch and config.yaml had no amplitude_init: such a run
    resumes with that start, and the fingerprint it recorded (without the key) accepts its config. A null key (written
    on 2026-11-30 before config.yaml recorded the start) is the default, the paper's zero start."""
    import hashlib

    import yaml

    from fednorm.runs.runner import build_federation_data, resume_run, start_run

    cfg = load_config("harmofl_digits", TINY_HARMOFL + ["methods=[fedavg, harmofl]", "federation.rounds=1"])
    run = tmp_path / "run"

    def stop_before_harmofl(label, *args):
        if label == "fedavg":
            raise Stop()

    with pytest.raises(Stop):
        start_run(cfg, run, progress=stop_before_harmofl)
    document = yaml.safe_load((run / "config.yaml").read_text())
    assert [m["amplitude_init"] for m in document["methods"]] == [None, "zero"]  # the start is recorded
    for entry in document["methods"]:
        del entry["amplitude_band"], entry["amplitude_decay"]  # fields added after that fednorm
        if written == "without the key":
            del entry["amplitude_init"]
        else:
            entry["amplitude_init"] = None
    (run / "config.yaml").write_text(yaml.safe_dump(document, sort_keys=False))
    # what that fednorm recorded in run.json: the sha256 of the methods as written, without the key
    info = json.loads((run / "run.json").read_text())
    written_methods = [{k: v for k, v in m.items() if k != "amplitude_init"} for m in document["methods"]]
    info["config_fingerprint"]["methods"] = hashlib.sha256(
        json.dumps(written_methods, sort_keys=True).encode()).hexdigest()[:16]
    (run / "run.json").write_text(json.dumps(info))
    resume_run(run)
    clients = build_federation_data(cfg, None)
    batch_mean = torch.stack([torch.fft.fft2(c.train.x.double() / 255).abs().mean(0) for c in clients]).mean(0)
    amp = torch.load(run / "harmofl" / "seed0" / "checkpoint.pt", weights_only=False)["input_state"]["amp.global"]
    torch.testing.assert_close(amp, (weight * batch_mean).float(), rtol=1e-5, atol=1e-4)


def test_harmofl_presets_build_the_ablation_switches():
    ablation = load_config("harmofl_ablation_camelyon17")
    methods = {m.display: m.build() for m in ablation.methods}
    assert (methods["fedavg"].amplitude_norm, methods["fedavg"].weight_perturbation) == (None, 0.0)
    assert (methods["fedavg_ampnorm"].amplitude_norm, methods["fedavg_ampnorm"].weight_perturbation) == ("full", 0.0)
    assert (methods["fedavg_wp"].amplitude_norm, methods["fedavg_wp"].weight_perturbation) == (None, 0.05)
    assert (methods["harmofl"].amplitude_norm, methods["harmofl"].weight_perturbation) == ("full", 0.05)
    assert sorted(m.weight_perturbation for label, m in methods.items() if label.startswith("harmofl")) == [
        0.0005, 0.005, 0.05, 0.5, 1.0]
    code = load_config("harmofl_digits", ["methods=[{name: harmofl, amplitude_norm: code}]"]).methods[0].build()
    assert code.amplitude_norm == "code"
    # where the running amplitude starts: the paper's zero unless the method names the code's first batch; the
    # code variant's momentum 0 would keep a zero start at zero, and without AmpNorm there is nothing to start
    assert (methods["harmofl"].amplitude_init, code.amplitude_init) == ("zero", "first_batch")
    cfg = load_config("harmofl_digits", ["methods=[{name: harmofl, amplitude_init: first_batch}]"])
    assert cfg.methods[0].build().amplitude_init == "first_batch"
    for bad, says in (("{name: harmofl, amplitude_norm: code, amplitude_init: zero}", "keep it at zero"),
                      ("{name: harmofl, amplitude_norm: off, amplitude_init: zero}", "amplitude normalization is off"),
                      ("{name: fedavg, amplitude_init: first_batch}", "amplitude normalization is off"),
                      ("{name: harmofl, amplitude_init: ones}", "amplitude_init"),
                      ("{name: harmofl, amplitude_band: 0.1}", "amplitude_norm full replaces the whole spectrum"),
                      ("{name: harmofl, amplitude_norm: off, amplitude_decay: 0.1}", "amplitude normalization is off"),
                      ("{name: harmofl, amplitude_decay: 0}", "keep it at zero"),
                      ("{name: harmofl, amplitude_norm: code, amplitude_band: 0.6}", "amplitude_band")):
        with pytest.raises(ValueError, match=says):
            load_config("harmofl_digits", [f"methods=[{bad}]"])
    # the code variant's window and momentum as options: L = 0.01 with the momentum the code meant (0.1), which
    # now lets its running amplitude start from zero as the paper's
    intended = load_config("harmofl_digits", ["methods=[{name: harmofl, amplitude_norm: code, amplitude_band: 0.01, "
                                              "amplitude_decay: 0.1, amplitude_init: zero}]"]).methods[0].build()
    assert intended.amplitude_settings() == {"band_ratio": 0.01, "decay": 0.1, "init": "zero"}
    assert code.amplitude_settings() == {"band_ratio": 0.0, "decay": 0.0, "init": "first_batch"}
    assert methods["harmofl"].amplitude_settings() == {"band_ratio": None, "decay": 0.1, "init": "zero"}
    for name, loss in (("harmofl_camelyon17", "ce"), ("harmofl_nuclei", "dice"), ("harmofl_prostate", "ce_dice")):
        cfg = load_config(name)
        assert cfg.task().loss_name == loss and cfg.federation.weighting == "uniform"
        # the code validates the server model after every round and keeps the best: selection needs every round
        assert cfg.federation.eval_every == load_config(name.replace("harmofl_", "harmofl_ablation_")).federation.eval_every == 1
        assert set(cfg.paper) <= {m.display for m in cfg.methods}
