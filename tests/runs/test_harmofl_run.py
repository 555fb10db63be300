"""End to end: `fednorm run` of a tiny HarmoFL config (the harmofl_digits preset on rendered digits) writes its
run folder, with the ablation's methods, an alpha-sweep label and the averaged amplitude in the checkpoint."""

import json

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
    "methods=[fedavg, harmofl, {name: harmofl, label: harmofl-a0.5, weight_perturbation: 0.5}]",
]


def test_fednorm_run_of_a_tiny_harmofl_config(tmp_path):
    out = tmp_path / "run"
    args = ["run", "harmofl_digits", *[a for item in TINY_HARMOFL for a in ("--set", item)], "--out", str(out),
            "--quiet"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "test accuracy (%)" in result.output and "harmofl-a0.5" in result.output
    table = json.loads((out / "results.json").read_text())
    assert list(table["methods"]) == ["fedavg", "harmofl", "harmofl-a0.5"]
    assert table["score"] == "accuracy"
    ckpt = torch.load(out / "harmofl" / "seed0" / "checkpoint.pt", weights_only=False)
    assert ckpt["round"] == 2 and ckpt["input_state"]["amp.global"].shape == (3, 28, 28)
    # the global amplitude (Alg. 1 l.17): the uniform mean of the clients' round-1 amplitudes, each the mean
    # per-channel FFT amplitude of the client's training images in [0, 1] (one batch: Eq. 3's first value)
    from fednorm.runs.runner import build_federation_data

    clients = build_federation_data(load_config("harmofl_digits", TINY_HARMOFL), None)
    expected = torch.stack([torch.fft.fft2(c.train.x.double() / 255).abs().mean(0) for c in clients]).mean(0)
    for label in ("harmofl", "harmofl-a0.5"):
        amp = torch.load(out / label / "seed0" / "checkpoint.pt", weights_only=False)["input_state"]["amp.global"]
        torch.testing.assert_close(amp, expected.float(), rtol=1e-5, atol=1e-4)
    assert "amp.global" not in torch.load(out / "fedavg" / "seed0" / "checkpoint.pt", weights_only=False)["input_state"]
    summary = json.loads((out / "harmofl-a0.5" / "seed0" / "summary.json").read_text())
    assert summary["metric"] == "accuracy" and len(summary["clients"]) == 2


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
    for name, loss in (("harmofl_camelyon17", "ce"), ("harmofl_nuclei", "dice"), ("harmofl_prostate", "ce_dice")):
        cfg = load_config(name)
        assert cfg.task().loss_name == loss and cfg.federation.weighting == "uniform"
        assert set(cfg.paper) <= {m.display for m in cfg.methods}
