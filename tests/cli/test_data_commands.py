"""``fednorm data show`` with several domains and pixel histograms; ``data prepare`` and ``data list`` for the
medical datasets. Nothing downloads (``--no-download``, or files put in place)."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from fednorm.cli.main import app

runner = CliRunner()
PNG = b"\x89PNG"


def _flat(output: str) -> str:
    return " ".join(output.split())


def test_data_show_compares_several_domains_on_one_histogram_figure(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["data", "show", "rendered/print", "rendered/neon", "--per-class", "1",
                                 "--hist-images", "20"])
    assert result.exit_code == 0, result.output
    for name in ("rendered_print.png", "rendered_neon.png", "rendered_print_rendered_neon_hist.png"):
        assert (tmp_path / name).read_bytes()[:4] == PNG
    text = _flat(result.output)
    assert "sample grid: rendered_print.png" in text and "sample grid: rendered_neon.png" in text
    assert "rendered/print: 20 train images" in text and "rendered_print_rendered_neon_hist.png" in text
    assert text.count("7438") == 2  # one counts table per domain


def test_data_show_out_names_the_grid_and_the_histograms_beside_it(tmp_path):
    out = tmp_path / "figs" / "one.png"
    result = runner.invoke(app, ["data", "show", "rendered/street", "--out", str(out), "--per-class", "1",
                                 "--linear-hist"])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:4] == PNG and (tmp_path / "figs" / "one_hist.png").read_bytes()[:4] == PNG
    out = tmp_path / "two.png"
    result = runner.invoke(app, ["data", "show", "rendered/street", "rendered/outline", "--out", str(out),
                                 "--per-class", "1", "--hist-images", "0"])
    assert result.exit_code == 0, result.output
    for name in ("two_rendered_street.png", "two_rendered_outline.png", "two_hist.png"):
        assert (tmp_path / name).is_file()
    assert "rendered/outline: 7438 train images" in _flat(result.output)  # 0 = every training image
    twice = runner.invoke(app, ["data", "show", "rendered/street", "rendered/street"])
    assert twice.exit_code == 2 and "named twice" in twice.output


def test_data_show_histograms_real_medical_patches(tmp_path):
    from fednorm.data.medical import prepare_camelyon17

    from ..data.medical.test_camelyon17 import _bundle

    _bundle(tmp_path / "raw" / "camelyon17_v1.0", sizes=(10, 10, 10, 10, 10))
    prepare_camelyon17(tmp_path / "data", raw_dir=tmp_path / "raw", download=False, progress=False)
    out = tmp_path / "cam.png"
    result = runner.invoke(app, ["data", "show", "camelyon17/hospital1", "camelyon17/hospital4", "--data-dir",
                                 str(tmp_path / "data"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "cam_hist.png").is_file() and (tmp_path / "cam_camelyon17_hospital4.png").is_file()
    assert "camelyon17/hospital4: 6 train images" in _flat(result.output)  # HarmoFL's 64 % of 10


@pytest.mark.parametrize("dataset, expected", [
    ("camelyon17", "camelyon17_v1.0.tar.gz"),
    ("prostate", "liuquande.github.io/SAML"),
    ("nuclei", "monusac2020_breast"),
    ("abide", "Phenotypic_V1_0b_preprocessed1.csv"),
    ("fed_isic2019", "train_test_split"),
])
def test_data_prepare_medical_prints_what_to_download(tmp_path, dataset, expected):
    result = runner.invoke(app, ["data", "prepare", dataset, "--no-download", "--quiet", "--data-dir", str(tmp_path)])
    assert result.exit_code == 2
    text = "".join(result.output.split())  # rich wraps long paths and URLs
    assert expected in text and str(tmp_path / "raw" / dataset) in text


def test_data_prepare_medical_sites_and_raw_dir(tmp_path):
    from ..data.medical.test_nuclei import _pair

    rng = np.random.default_rng(0)
    raw = tmp_path / "official"
    for i in range(4):
        _pair(raw / "tnbc" / "train", f"S{i}", rng)
    _pair(raw / "tnbc" / "test", "T0", rng)
    result = runner.invoke(app, ["data", "prepare", "nuclei", "--domains", "tnbc", "--raw-dir", str(raw),
                                 "--no-download", "--quiet", "--data-dir", str(tmp_path / "data")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "data" / "nuclei" / "tnbc.npz").is_file() and "nuclei/tnbc.npz" in _flat(result.output)
    bad = runner.invoke(app, ["data", "prepare", "camelyon17", "--domains", "hospital1", "--data-dir", str(tmp_path)])
    assert bad.exit_code == 2 and "--size and --domains" in bad.output
    bad = runner.invoke(app, ["data", "prepare", "prostate", "--domains", "Mars", "--no-download",
                              "--data-dir", str(tmp_path)])
    assert bad.exit_code == 2 and "unknown prostate site 'Mars'" in bad.output


def test_data_prepare_prostate_seeded_order(tmp_path):
    """Without HarmoFL's slice-order files the error names --seeded-order, which then prepares the site."""
    from ..data.medical.test_prostate import _site

    raw = tmp_path / "official"
    _site(raw, "BIDMC", [15, 14])
    args = ["data", "prepare", "prostate", "--domains", "BIDMC", "--raw-dir", str(raw), "--no-download", "--quiet",
            "--data-dir", str(tmp_path / "data")]
    refused = runner.invoke(app, args)
    assert refused.exit_code == 2 and "fednorm data prepare prostate --seeded-order" in _flat(refused.output)
    result = runner.invoke(app, [*args, "--seeded-order"])
    assert result.exit_code == 0, result.output
    with np.load(tmp_path / "data" / "prostate" / "BIDMC.npz") as f:
        assert f["cases"].tolist() == ["Case00.nii.gz", "Case01.nii.gz"] and "harmofl_index" not in f
    bad = runner.invoke(app, ["data", "prepare", "nuclei", "--seeded-order", "--data-dir", str(tmp_path)])
    assert bad.exit_code == 2 and "--seeded-order applies to prostate only" in bad.output


def test_data_list_says_how_to_get_every_domain(tmp_path):
    listed = runner.invoke(app, ["data", "list", "--data-dir", str(tmp_path)])
    assert listed.exit_code == 0
    rows = {line.split("│")[1].strip(): line for line in listed.output.splitlines() if line.count("│") >= 4}
    for domain, dataset in (("camelyon17/hospital5", "camelyon17"), ("prostate/UCL", "prostate"),
                            ("nuclei/monuseg2018", "nuclei"), ("abide/UCLA", "abide"),
                            ("fed_isic2019/vienna_dias", "fed_isic2019"), ("svhn", "svhn"),
                            ("domainnet/real", "domainnet")):
        assert f"fednorm data prepare {dataset}" in rows[domain] and " no " in rows[domain]
    assert "offline copy" in rows["mnist"] and "offline copy" in rows["pacs/photo"]
