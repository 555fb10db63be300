"""Medical sites as federation domains: names resolve; tiny data folders in the real formats become clients with
the loaders' own splits (no re-split), through build_clients and through a run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fednorm.data.domain import DataError, Split
from fednorm.data.federation import (build_clients, class_names, domain_file, known_domains, load_domain,
                                     num_classes, parse_domain)
from fednorm.data.medical import (MEDICAL_DATASETS, FeatureSplit, SegmentationSplit, load_camelyon17,
                                  medical_domain_names, prepare_abide_vectors, prepare_camelyon17)
from fednorm.runs import store
from fednorm.runs.config import ConfigError, load_config
from fednorm.runs.runner import build_engine, build_federation_data, start_run

from ..conftest import write_data_folder
from .medical.test_camelyon17 import _bundle

HOSPITALS = [f"camelyon17/hospital{k}" for k in range(1, 6)]
SIZES = (20, 10, 10, 10, 12)  # patches per hospital: train 12, 6, 6, 6, 7 under the 64/16/20 split


@pytest.fixture(scope="module")
def camelyon_dir(tmp_path_factory):
    """A data folder prepared from a tiny WILDS camelyon17 v1.0 bundle (96 x 96 PNG patches)."""
    root = tmp_path_factory.mktemp("camelyon")
    _bundle(root / "raw" / "camelyon17_v1.0", sizes=SIZES)
    prepare_camelyon17(root / "data", raw_dir=root / "raw", download=False, progress=False)
    return root / "data"


def test_every_medical_site_is_a_domain_with_its_dataset_facts():
    names = medical_domain_names()
    assert {"camelyon17/hospital1", "prostate/BIDMC", "prostate/ISBI_1.5", "nuclei/tnbc", "fed_isic2019/bcn",
            "abide/NYU"} <= set(names)
    assert set(names) <= set(known_domains())
    for name in names:
        spec = parse_domain(name)
        ds = MEDICAL_DATASETS[spec.benchmark]
        assert spec.medical and spec.official_split and spec.origin == "real"
        assert (spec.num_classes, spec.task, spec.input_shape) == (ds.num_classes, ds.task, ds.input_shape)
        assert domain_file(name) == spec.file and spec.file.endswith(".npz")
        assert len(class_names(name)) == spec.num_classes
    assert parse_domain("camelyon17/hospital3").file == "camelyon17/hospital3.npz"
    assert (parse_domain("prostate/HK").image_size, parse_domain("nuclei/tnbc").image_size) == (384, 256)
    assert (parse_domain("fed_isic2019/msk").num_classes, parse_domain("abide/UM").image_size) == (8, 0)
    assert parse_domain("abide/UCLA").file == "abide/abide_ho_w32.npz"
    assert class_names("camelyon17/hospital1") == ("normal", "tumor")
    with pytest.raises(ValueError, match="unknown domain 'camelyon17/hospital9'.*camelyon17/hospital1"):
        parse_domain("camelyon17/hospital9")
    with pytest.raises(ValueError, match="corrupted copies of medical domains"):
        parse_domain("corrupt/fog/3/camelyon17/hospital1")
    with pytest.raises(ValueError, match="mix benchmarks"):
        num_classes(["camelyon17/hospital1", "prostate/HK"])


def test_camelyon17_folder_becomes_clients_with_the_official_splits(camelyon_dir):
    clients = build_clients(HOSPITALS, data_dir=camelyon_dir, truncate_train=False)
    assert [c.name for c in clients] == HOSPITALS and all(c.domain == c.name for c in clients)
    for c, n in zip(clients, SIZES):
        site = load_camelyon17(c.name.split("/")[1], camelyon_dir, seed=0)  # no re-split: the loader's splits
        assert torch.equal(c.train.x, site.train.x) and torch.equal(c.val.y, site.val.y)
        assert torch.equal(c.test.x, site.test.x) and isinstance(c.train, Split)
        assert len(c.train) + len(c.val) + len(c.test) == n and c.origin == "real"
    # HarmoFL's truncation: every training split cut to the smallest one, keeping the first samples
    cut = build_clients(HOSPITALS, data_dir=camelyon_dir)  # None = the paper's choice for Camelyon17: truncate
    assert [len(c.train) for c in cut] == [6] * 5
    assert torch.equal(cut[0].train.x, clients[0].train.x[:6]) and torch.equal(cut[0].test.x, clients[0].test.x)
    assert cut[0].meta["truncated_to"] == 6 and cut[0].meta["train_len"] == 12
    # the split seed and the loader's options reach the loader
    other = build_clients(HOSPITALS[:2], data_dir=camelyon_dir, split_seed=1, truncate_train=False)
    assert not torch.equal(other[0].train.x, clients[0].train.x)
    by_slide = build_clients(HOSPITALS[:1], data_dir=camelyon_dir, medical_options={"split_by": "slide"})
    assert torch.equal(by_slide[0].test.y, load_camelyon17("hospital1", camelyon_dir, split_by="slide").test.y)
    loaded = load_domain("camelyon17/hospital2", data_dir=camelyon_dir)
    assert len(loaded.all()) == SIZES[1] and loaded.val is not None


def test_medical_data_errors_are_clear(tmp_path, camelyon_dir):
    with pytest.raises(DataError, match=r"hospital1\.npz.*missing.*fednorm data prepare camelyon17 --data-dir"):
        build_clients(HOSPITALS, data_dir=tmp_path)
    with pytest.raises(DataError, match=r"fednorm data prepare prostate --domains BIDMC --data-dir"):
        build_clients(["prostate/BIDMC"], data_dir=tmp_path)
    with pytest.raises(DataError, match="needs a data folder"):
        build_clients(HOSPITALS, data_dir=None)
    with pytest.raises(ValueError, match="one client per site"):
        build_clients(HOSPITALS, data_dir=camelyon_dir, clients_per_domain=2)
    with pytest.raises(ValueError, match="cannot share a federation"):
        build_clients(["camelyon17/hospital1", "rendered/print"], data_dir=camelyon_dir)
    with pytest.raises(ValueError, match="no option"):
        build_clients(HOSPITALS, data_dir=camelyon_dir, medical_options={"split": "slide"})
    with pytest.raises(ValueError, match="medical domains only"):
        build_clients(["rendered/print"], data_dir=None, truncate_train=True)


def _nuclei_folder(root, clients=("monuseg2018", "tnbc"), side=32):
    """nuclei/<client>.npz in the prepared format: x_train/x_test (N, H, W, 3) uint8, y_* (N, H, W) 0/1 masks."""
    g = np.random.default_rng(0)
    files = {}
    for k, client in enumerate(clients):
        arrays = {}
        for split, n in (("train", 10 + 5 * k), ("test", 3)):
            y = np.zeros((n, side, side), np.uint8)
            y[:, 8:20, 6 + k:18 + k] = 1
            x = (g.integers(0, 60, (n, side, side, 3)) + 40 * k + 120 * y[..., None]).astype(np.uint8)
            arrays[f"x_{split}"], arrays[f"y_{split}"] = x, y
        files[f"nuclei/{client}.npz"] = arrays
    return write_data_folder(root, files)


def test_nuclei_segmentation_sites_keep_their_sizes_and_masks(tmp_path):
    folder = _nuclei_folder(tmp_path)
    clients = build_clients(["nuclei/monuseg2018", "nuclei/tnbc"], data_dir=folder)
    assert all(isinstance(c.train, SegmentationSplit) and c.train.y.dtype == torch.uint8 for c in clients)
    # nuclei keep client imbalance (no truncation by default); 20 % of train is validation
    assert [(len(c.train), len(c.val), len(c.test)) for c in clients] == [(8, 2, 3), (12, 3, 3)]


def test_camelyon17_through_the_runner(tmp_path, camelyon_dir):
    cfg = load_config("harmofl_camelyon17", [
        "methods=[harmofl]", "seeds=[0]", "data.domains=[camelyon17/hospital1, camelyon17/hospital2]",
        "model.width=0.0625", "training.batch_size=4", "training.precision=fp32", "federation.rounds=1",
        "federation.eval_batch_size=8"])
    clients = build_federation_data(cfg, camelyon_dir)
    assert [len(c.train) for c in clients] == [6, 6]  # truncate_train: true in the preset
    start_run(cfg, tmp_path / "run", data_dir=str(camelyon_dir))
    summary = json.loads((tmp_path / "run" / "harmofl" / "seed0" / "summary.json").read_text())
    assert summary["metric"] == "accuracy" and [c["name"] for c in summary["clients"]] == HOSPITALS[:2]
    # the recorded test accuracy is the final model's on the client's test patches, fed as HarmoFL evaluates:
    # amplitude-normalized with the frozen global amplitude (recomputed from the checkpoint)
    engine = build_engine(cfg, cfg.methods[0], 0, clients)
    engine.load_state_dict(store.load_checkpoint(tmp_path / "run" / "harmofl" / "seed0" / store.CHECKPOINT_FILE))
    assert "amp.global" in engine.input_state
    prepare = engine.runner.evaluation_prepare(engine.input_state)
    records = store.read_metrics(tmp_path / "run" / "harmofl" / "seed0" / store.METRICS_FILE)
    engine.model.load_state_dict(engine.global_state)
    engine.model.eval()
    for client in clients:
        with torch.no_grad():
            logits = engine.model(prepare(client.test.x))
        final = next(r for r in records if r["client"] == client.name and r["split"] == "test" and r["round"] == 1)
        assert final["acc"] == pytest.approx(float((logits.argmax(1) == client.test.y).double().mean()), abs=1e-12)
        # the loss tells the inputs apart where 4 patches' accuracy may not
        assert final["loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, client.test.y.long())),
                                              rel=1e-5)
        assert next(c for c in summary["clients"] if c["name"] == client.name)["test"]["final_acc"] == final["acc"]
    assert "Test accuracy (%)" in (tmp_path / "run" / "results.md").read_text()


def test_nuclei_segmentation_through_the_runner_reports_dice(tmp_path):
    folder = _nuclei_folder(tmp_path / "data")
    cfg = load_config("harmofl_nuclei", [
        "methods=[fedavg, fedbn]", "seeds=[0]", "data.domains=[nuclei/monuseg2018, nuclei/tnbc]",
        "model.width=0.125", "training.batch_size=4", "training.precision=fp32", "federation.rounds=2",
        "federation.eval_every=1"])
    assert cfg.task().loss_name == "dice" and cfg.task().kind == "segmentation"
    start_run(cfg, tmp_path / "run", data_dir=str(folder))
    records = store.read_metrics(tmp_path / "run" / "fedbn" / "seed0" / "metrics.jsonl")
    evals = [r for r in records if r["split"] in ("test", "val")]
    assert evals and all(r["metric"] == "dice" and 0 <= r["acc"] <= 1 for r in evals)
    # the recorded score is the foreground Dice 2|P & G| / (|P| + |G|) of each test image (every mask here has
    # nuclei), averaged over the images: recomputed from the final checkpoint with each client's own BN
    run_cfg = load_config(str(tmp_path / "run" / "config.yaml"))
    engine = build_engine(run_cfg, run_cfg.methods[1], 0, build_federation_data(run_cfg, folder))
    engine.load_state_dict(store.load_checkpoint(tmp_path / "run" / "fedbn" / "seed0" / store.CHECKPOINT_FILE))
    prepare = engine.runner.evaluation_prepare(engine.input_state)
    for client in engine.clients:
        engine.model.load_state_dict({**engine.global_state, **engine.local_states[client.name]})
        engine.model.eval()
        with torch.no_grad():
            predicted = engine.model(prepare(client.test.x)).argmax(dim=1).bool()
        truth = client.test.y.bool()
        overlap = (predicted & truth).sum(dim=(1, 2)).double()
        dice = 2 * overlap / (predicted.sum(dim=(1, 2)) + truth.sum(dim=(1, 2))).double()
        final = next(r for r in records if r["client"] == client.name and r["split"] == "test" and r["round"] == 2)
        assert final["acc"] == pytest.approx(float(dice.mean()), rel=1e-6, abs=1e-9)
    assert "Test Dice (%)" in (tmp_path / "run" / "results.md").read_text()
    assert json.loads((tmp_path / "run" / "results.json").read_text())["score"] == "dice"


def _abide_folder(root, dim=12):
    vec = root / "vec"
    vec.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for k, site in enumerate(("NYU", "USM", "UM", "UCLA")):
        subjects = np.repeat(np.arange(12), 3)  # 12 subjects (6 per class), 3 windows each
        y = subjects % 2
        x = rng.normal(size=(len(y), dim)) + y[:, None] * 1.5 + 3.0 * k  # sites shifted
        np.save(vec / f"{site}_x.npy", x)
        np.save(vec / f"{site}_y.npy", y)
        np.save(vec / f"{site}_subject.npy", subjects)
    prepare_abide_vectors(root / "data", vec)
    return root / "data"


def test_abide_feature_vectors_train_an_mlp_through_the_runner(tmp_path):
    folder = _abide_folder(tmp_path)
    sites = ["abide/NYU", "abide/USM", "abide/UM", "abide/UCLA"]
    raw = build_clients(sites, data_dir=folder, standardize_features=False)
    clients = build_clients(sites, data_dir=folder)
    assert all(isinstance(c.train, FeatureSplit) and c.val is None for c in clients)
    assert raw[3].train.x.mean() > 5  # the sites are shifted apart
    for r, c in zip(raw, clients):  # each site standardized with its own training statistics, test split too
        mean, std = r.train.x.double().mean(0), r.train.x.double().std(0)
        torch.testing.assert_close(c.train.x.double(), (r.train.x.double() - mean) / std, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c.test.x.double(), (r.test.x.double() - mean) / std, rtol=1e-5, atol=1e-5)
    overrides = ["data.domains=[abide/NYU, abide/USM, abide/UM, abide/UCLA]", "model.name=mlp",
                 "training.batch_size=8", "federation.rounds=2", "federation.eval_every=1", "methods=[fedavg, fedbn]"]
    cfg = load_config("default", overrides)
    engine = build_engine(cfg, cfg.methods[1], 0, clients)
    assert engine.model.layers[0].in_features == 12 and not engine.federation.channels_last
    start_run(cfg, tmp_path / "run", data_dir=str(folder))
    summary = json.loads((tmp_path / "run" / "fedbn" / "seed0" / "summary.json").read_text())
    assert summary["metric"] == "accuracy" and len(summary["clients"]) == 4
    with pytest.raises(ConfigError, match="model.name mlp"):
        load_config("default", overrides[:1])
    with pytest.raises(ConfigError, match="amplitude"):
        load_config("default", overrides[:2] + ["methods=[harmofl]"])
    assert load_config("default", overrides[:2] + ["methods=[{name: harmofl, amplitude_norm: off}]"])


def test_config_checks_for_medical_domains():
    seg = ["data.domains=[nuclei/tnbc, nuclei/monuseg2018]"]
    with pytest.raises(ConfigError, match="needs model.name unet"):
        load_config("harmofl_camelyon17", ["model.name=unet"])
    with pytest.raises(ConfigError, match="segmentation loss"):
        load_config("harmofl_camelyon17", ["training.loss=dice"])
    with pytest.raises(ConfigError, match="one client per site"):
        load_config("harmofl_nuclei", seg + ["data.clients_per_domain=2"])
    with pytest.raises(ConfigError, match="own"):
        load_config("harmofl_nuclei", seg + ["methods=[{name: fedavg, client: {name: perfedavg}}]"])
    with pytest.raises(ConfigError, match="moon_layer"):
        load_config("harmofl_nuclei", seg + ["methods=[{name: fedavg, client: {name: moon}}]"])
    with pytest.raises(ConfigError, match="medical_options"):
        load_config("harmofl_prostate", ["data.medical_options={fold: 1}"])
    with pytest.raises(ConfigError, match="medical domains only"):
        load_config("default", ["data.truncate_train=true"])
    assert load_config("harmofl_prostate", ["data.medical_options={split_by: case}"]).task().loss_name == "ce_dice"


def test_data_show_views_a_classification_site_and_refuses_masks(camelyon_dir, tmp_path):
    from fednorm.data.show import view_domain

    view = view_domain("camelyon17/hospital1", data_dir=camelyon_dir)
    assert {k: sum(v) for k, v in view.counts.items()} == {"train": 12, "val": 4, "test": 4}
    assert view.classes == ("normal", "tumor") and "split harmofl by patch" in view.note
    with pytest.raises(ValueError, match="segmentation masks"):
        view_domain("prostate/HK", data_dir=tmp_path)
