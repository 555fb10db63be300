"""ABIDE I: a tiny phenotype CSV and CPAC rois_ho .1D time series, windowed connectomes, subject folds."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import torch

from fednorm.data.domain import DataError
from fednorm.data.medical import FEDBN_NUM_FEATURES, load_abide, prepare_abide, prepare_abide_vectors
from fednorm.data.medical import abide as ab
from fednorm.data.medical import standardize_features

from ..local_http import serve_folder
from .helpers import manifest

N_ROIS = 111  # CPAC's Harvard-Oxford rois_ho
ZERO_ROI = 82  # one ROI with a constant (zero) signal: 110 kept -> 5995 features
FRAMES = {"NYU": 40, "USM": 36}


def _write_1d(path, ts):
    path.parent.mkdir(parents=True, exist_ok=True)
    header = "\t".join(f"#{i + 1}" for i in range(ts.shape[1]))
    path.write_text(header + "\n" + "\n".join("\t".join(f"{v:.6f}" for v in row) for row in ts) + "\n")


def _raw(root, subjects=10, seed=0):
    """Phenotype CSV in the PCP column layout + one .1D file per subject; returns {site: [labels]}."""
    rng = np.random.default_rng(seed)
    rows, labels = [], {}
    for site in FRAMES:
        labels[site] = []
        for s in range(subjects):
            file_id = f"{ab.ABIDE_SITE_IDS[site]}_{50000 + s:07d}"
            dx = 1 + s % 2  # 1 autism, 2 control
            rows.append([len(rows), len(rows), 50000 + s, 1, 50000 + s, ab.ABIDE_SITE_IDS[site], file_id, dx])
            ts = rng.normal(size=(FRAMES[site], N_ROIS))
            ts[:, ZERO_ROI] = 0.0
            _write_1d(root / "rois_ho" / f"{file_id}_rois_ho.1D", ts)
            labels[site].append(dx % 2)
    rows.append([len(rows), len(rows), 1, 1, 1, "NYU", "no_filename", 1])  # skipped, as FedBN
    rows.append([len(rows), len(rows), 2, 1, 2, "KKI", "KKI_0050001", 1])  # another site
    with (root / "Phenotypic_V1_0b_preprocessed1.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["", "Unnamed: 0", "SUB_ID", "X", "subject", "SITE_ID", "FILE_ID", "DX_GROUP"])
        w.writerows(rows)
    return labels


def test_connectome_matches_nilearn_style_ledoit_wolf():
    from sklearn.covariance import ledoit_wolf

    rng = np.random.default_rng(3)
    windows = rng.normal(size=(4, 32, 12))
    x = ab._standardize(windows)
    for w in range(4):
        assert np.allclose(ab.ledoit_wolf_covariance(x[w:w + 1])[0], ledoit_wolf(x[w])[0], atol=1e-12)
    ts = rng.normal(size=(35, 12))
    vec = ab.window_connectomes(ts, clip_negative=False)
    assert vec.shape == (4, 66) and vec.dtype == np.float32
    cov = ledoit_wolf(ab._standardize(ts[:32]))[0]
    d = np.sqrt(np.diag(cov))
    corr = cov / d[:, None] / d[None, :]
    assert np.allclose(vec[0], np.arctanh(corr[np.triu_indices(12, 1)]), atol=1e-5)
    pearson = ab.window_connectomes(ts, estimator="pearson", clip_negative=False)
    assert np.allclose(pearson[1], np.arctanh(np.corrcoef(ts[1:33].T)[np.triu_indices(12, 1)]), atol=1e-5)
    assert ab.window_connectomes(ts).min() == 0.0  # negatives clipped, as Fed_ABIDE


def test_prepare_and_load_fedbn_vectors(tmp_path):
    raw = tmp_path / "raw"
    labels = _raw(raw)
    data = tmp_path / "data"
    prepare_abide(data, raw_dir=raw, download=False, sites=("NYU", "USM"))
    with np.load(data / ab.ABIDE_FILE) as f:
        windows = FRAMES["NYU"] - 32 + 1
        assert f["x_NYU"].shape == (10 * windows, FEDBN_NUM_FEATURES) and f["x_NYU"].dtype == np.float32
        assert f["x_USM"].shape == (10 * (FRAMES["USM"] - 31), 5995)
        assert ZERO_ROI not in f["rois"].tolist() and len(f["rois"]) == 110
        assert f["y_NYU"].tolist() == [lab for lab in labels["NYU"] for _ in range(windows)]
        assert f["file_ids_NYU"][0] == "NYU_0050000" and np.isfinite(f["x_NYU"]).all()
    assert "rois_ho" in manifest(data)["abide"]["source"]

    dom = load_abide("NYU", data, fold=0, num_folds=5)
    tr, te = dom.train, dom.test
    assert tr.x.dtype == torch.float32 and tr.y.dtype == torch.int64 and dom.val is None and dom.num_classes == 2
    assert len(tr) + len(te) == 10 * 9 and len(te) == 2 * 9  # 2 of 10 subjects, all their windows
    assert not set(tr.groups.tolist()) & set(te.groups.tolist())
    assert sorted(te.y.unique().tolist()) == [0, 1]  # stratified
    folds = [set(load_abide("NYU", data, fold=k).test.groups.tolist()) for k in range(5)]
    assert set().union(*folds) == set(range(10)) and sum(map(len, folds)) == 10
    with_val = load_abide("USM", data, fold=1, val_fraction=0.25)
    assert len(set(with_val.val.groups.tolist())) == 2
    s_tr, s_te = standardize_features(tr, te)
    # Fed_ABIDE's sepnorm: the site's TRAINING mean and std per feature, applied to its test split too
    keep = tr.x.std(0) > 0
    mean, std = tr.x.double().mean(0), tr.x.double().std(0)
    torch.testing.assert_close(s_tr.x.mean(0)[keep], torch.zeros(int(keep.sum())), rtol=0, atol=1e-4)
    torch.testing.assert_close(s_tr.x.std(0)[keep], torch.ones(int(keep.sum())), rtol=0, atol=1e-4)
    torch.testing.assert_close(s_te.x.double()[:, keep], ((te.x.double() - mean) / std)[:, keep], rtol=1e-5,
                               atol=1e-5)
    with pytest.raises(DataError, match="too few"):
        load_abide("USM", data, num_folds=6)


def test_download_from_public_urls(tmp_path, monkeypatch):
    served = tmp_path / "s3"
    _raw(served, subjects=5)
    with serve_folder(served) as server:
        monkeypatch.setattr(ab, "ABIDE_PHENOTYPE", ab.RawFile(server.url("Phenotypic_V1_0b_preprocessed1.csv"),
                                                             "Phenotypic_V1_0b_preprocessed1.csv"))
        monkeypatch.setattr(ab, "ABIDE_ROI_URL", server.base_url + "/rois_ho/{file_id}_rois_ho.1D")
        prepare_abide(tmp_path / "data", raw_dir=tmp_path / "raw", progress=False, sites=("USM",))
    assert len(list((tmp_path / "raw" / "rois_ho").glob("*.1D"))) == 5
    assert np.load(tmp_path / "data" / ab.ABIDE_FILE)["x_USM"].shape == (5 * 5, 5995)


def test_errors_and_precomputed_vectors(tmp_path):
    raw = tmp_path / "raw"
    with pytest.raises(DataError, match="Phenotypic_V1_0b_preprocessed1.csv") as info:
        prepare_abide(tmp_path / "data", raw_dir=raw, download=False)
    assert "s3.amazonaws.com/fcp-indi" in str(info.value)
    _raw(raw, subjects=5)
    victim = raw / "rois_ho" / "USM_0050002_rois_ho.1D"
    victim.unlink()
    with pytest.raises(DataError, match="USM_0050002_rois_ho.1D") as info:
        prepare_abide(tmp_path / "data", raw_dir=raw, download=False, sites=("USM",))
    assert "fetch_abide_pcp" in str(info.value)
    victim.write_text("#1\t#2\n0.1\tnot-a-number\n")
    with pytest.raises(DataError, match="line 2"):
        prepare_abide(tmp_path / "data", raw_dir=raw, download=False, sites=("USM",))

    vec = tmp_path / "vec"
    vec.mkdir()
    rng = np.random.default_rng(0)
    for site in ab.ABIDE_SITES:
        np.save(vec / f"{site}_x.npy", rng.normal(size=(20, 7)))
        np.save(vec / f"{site}_y.npy", np.arange(20) // 2 % 2)
        np.save(vec / f"{site}_subject.npy", np.arange(20) // 2)
    prepare_abide_vectors(tmp_path / "data", vec)
    assert load_abide("UCLA", tmp_path / "data").train.x.shape[1] == 7
    (vec / "UM_y.npy").unlink()
    with pytest.raises(DataError, match="UM_y.npy"):
        prepare_abide_vectors(tmp_path / "data", vec)


def test_the_fedbn_abide_preset_runs_fold_0_of_each_site(tmp_path):
    """fedbn_abide (FedBN Table 1) on the two sites of the tiny release: each site tests on its fold-0 subjects'
    windows, FedProx has the paper's mu 0.2, and a round of FedBN and FedProx trains the MLP."""
    from fednorm.runs.config import load_config
    from fednorm.runs.runner import build_federation_data, start_run

    _raw(tmp_path / "raw")
    data = tmp_path / "data"
    prepare_abide(data, raw_dir=tmp_path / "raw", download=False, sites=("NYU", "USM"))
    cfg = load_config("fedbn_abide", ["data.domains=[abide/NYU, abide/USM]", "seeds=[0]", "federation.rounds=1",
                                      "federation.eval_every=1", "training.precision=fp32"])
    assert {m.display: m.build().prox_mu for m in cfg.methods} == {"singleset": 0.0, "fedavg": 0.0, "fedprox": 0.2,
                                                                    "fedbn": 0.0}
    clients = build_federation_data(cfg, data)
    for client, site in zip(clients, ("NYU", "USM")):
        fold0 = load_abide(site, data, fold=0)
        assert torch.equal(client.test.y, fold0.test.y) and len(client.train) == len(fold0.train)
    results = start_run(cfg, tmp_path / "run", data_dir=str(data))
    assert [r.label for r in results] == ["singleset", "fedavg", "fedprox", "fedbn"]
    assert [c["name"] for c in results[3].summary["clients"]] == ["abide/NYU", "abide/USM"]
