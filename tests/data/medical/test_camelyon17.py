"""Camelyon17: a tiny WILDS v1.0 bundle (metadata.csv + 96 x 96 PNG patches), prepared and loaded."""

from __future__ import annotations

import csv
import tarfile

import numpy as np
import pytest
import torch

from fednorm.data.domain import DataError
from fednorm.data.medical import camelyon17 as cam
from fednorm.data.medical import load_camelyon17, load_unifed_camelyon17, prepare_camelyon17

from .helpers import corrupt, manifest, write_image

SIZES = (100, 25, 10, 10, 12)  # patches per hospital (WILDS center 0..4)


def _bundle(root, sizes=SIZES, seed=0):
    """WILDS layout: root/metadata.csv and root/patches/...png; returns {center: [(label, colour)]}."""
    rng = np.random.default_rng(seed)
    rows, truth = [], {}
    for center, n in enumerate(sizes):
        truth[center] = []
        for i in range(n):
            patient, node = f"{center * 20 + i % 4:03d}", i % 2
            x, y, label = 100 + i, 200 + center, int(i % 3 == 0)
            colour = rng.integers(0, 256, 3)
            img = np.broadcast_to(colour.astype(np.uint8), (96, 96, 3)).copy()
            img[0, 0] = (1, 2, 3)  # a marker pixel: orientation must survive
            write_image(root / cam.patch_path(patient, str(node), str(x), str(y)), img)
            slide = center * 10 + i % 10
            rows.append([len(rows), patient, node, x, y, label, slide, center, 0])
            truth[center].append((label, tuple(int(c) for c in colour)))
    with (root / "metadata.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["", "patient", "node", "x_coord", "y_coord", "tumor", "slide", "center", "split"])
        w.writerows(rows)
    return truth


def patch_index(patches) -> dict[tuple, int]:
    """Patch number by its colour (each of the bundle's patches has one of its own)."""
    index = {colour: i for i, (_, colour) in enumerate(patches)}
    assert len(index) == len(patches)  # the seeded colours are distinct
    return index


def test_prepare_and_load_harmofl_splits(tmp_path):
    raw = tmp_path / "raw" / "camelyon17_v1.0"
    truth = _bundle(raw)
    data = tmp_path / "data"
    paths = prepare_camelyon17(data, raw_dir=tmp_path / "raw", download=False)
    assert [p.name for p in paths] == [f"hospital{k}.npz" for k in range(1, 6)]
    with np.load(paths[0]) as f:
        assert f["x"].shape == (100, 96, 96, 3) and f["x"].dtype == np.uint8
        assert f["y"].tolist() == [lab for lab, _ in truth[0]]
        assert tuple(f["x"][5, 50, 50]) == truth[0][5][1] and tuple(f["x"][5, 0, 0]) == (1, 2, 3)
    entry = manifest(data)["camelyon17_hospital1"]
    assert entry["file"] == "camelyon17/hospital1.npz" and entry["arrays"]["x"] == [100, 96, 96, 3]
    assert "worksheets.codalab.org" in entry["source"]

    dom = load_camelyon17("hospital1", data, seed=0)
    assert (len(dom.train), len(dom.val), len(dom.test)) == (64, 16, 20)
    assert dom.train.x.shape == (64, 3, 96, 96) and dom.train.x.dtype == torch.uint8
    assert dom.train.y.dtype == torch.int64 and dom.num_classes == 2 and dom.name == "camelyon17/hospital1"
    assert [int(v) for v in dom.test.x[0, :, 0, 0]] == [1, 2, 3]  # channel order, NCHW
    small = load_camelyon17("hospital2", data)
    assert (len(small.train), len(small.val), len(small.test)) == (16, 4, 5)
    # seeded and disjoint: the three splits together are the hospital's patches, each once with its own label
    index = patch_index(truth[0])
    found = [index[tuple(int(c) for c in img[:, 50, 50])]
             for split in (dom.train, dom.val, dom.test) for img in split.x]
    assert sorted(found) == list(range(100))
    labels = torch.cat([dom.train.y, dom.val.y, dom.test.y]).tolist()
    assert labels == [truth[0][i][0] for i in found]
    assert torch.equal(load_camelyon17("hospital1", data, seed=0).train.x, dom.train.x)
    assert not torch.equal(load_camelyon17("hospital1", data, seed=1).train.x, dom.train.x)


def test_slide_split_and_unifed_protocol(tmp_path):
    truth = _bundle(tmp_path / "raw")
    data = tmp_path / "data"
    prepare_camelyon17(data, raw_dir=tmp_path / "raw", download=False)
    x, y, slide = cam.load_camelyon17_pool("hospital1", data)
    assert slide.tolist() == [i % 10 for i in range(100)]
    dom = load_camelyon17("hospital1", data, split_by="slide")
    assert len(dom.train) + len(dom.val) + len(dom.test) == 100
    # ten slides of ten patches: whole slides, 60/20/20 (the slide whose middle is in each share)
    assert (len(dom.train), len(dom.val), len(dom.test)) == (60, 20, 20)
    index = patch_index(truth[0])
    slides = [{index[tuple(int(c) for c in img[:, 50, 50])] % 10 for img in split.x}
              for split in (dom.train, dom.val, dom.test)]
    assert [len(s) for s in slides] == [6, 2, 2] and set().union(*slides) == set(range(10))  # no slide in two
    uni = load_unifed_camelyon17(data)
    # UniFed's external "hospital4-5" are the WILDS paper's OOD validation and test hospitals: WILDS centers 1 and 2
    assert list(uni) == ["hospital1", "hospital4", "hospital5", "hospital2", "hospital3"]
    assert cam.UNIFED_EXTERNAL == ("hospital2", "hospital3")
    assert [cam.CAMELYON17_CENTER[h] for h in cam.UNIFED_EXTERNAL] == [1, 2]
    assert (len(uni["hospital1"].train), len(uni["hospital1"].val), len(uni["hospital1"].test)) == (70, 10, 20)
    for h in cam.UNIFED_EXTERNAL:
        assert len(uni[h].train) == 0 and len(uni[h].val) == 0 and uni[h].train.x.shape[1:] == (3, 96, 96)
    assert len(uni["hospital2"].test) == SIZES[1] and len(uni["hospital3"].test) == SIZES[2]
    with pytest.raises(ValueError, match="split_by"):
        load_camelyon17("hospital1", data, split_by="patient")
    with pytest.raises(ValueError, match="hospital"):
        load_camelyon17("hospital9", data)


def test_prepare_from_archive_and_subset(tmp_path, monkeypatch):
    bundle = tmp_path / "bundle"
    truth = _bundle(bundle, sizes=(6, 5, 4, 4, 4))
    raw = tmp_path / "raw"
    raw.mkdir()
    with tarfile.open(raw / "camelyon17_v1.0.tar.gz", "w:gz") as tar:
        for p in sorted(bundle.rglob("*")):
            tar.add(p, arcname=p.relative_to(bundle).as_posix(), recursive=False)
    size = (raw / "camelyon17_v1.0.tar.gz").stat().st_size
    with pytest.raises(DataError, match="truncated"):  # far under the official size (no checksum exists)
        prepare_camelyon17(tmp_path / "d0", raw_dir=raw, download=False)
    monkeypatch.setattr(cam, "CAMELYON17_MIN_BYTES", size + 1)
    with pytest.raises(DataError, match=f"{size} bytes, fewer than the official file's {size + 1:,}"):
        prepare_camelyon17(tmp_path / "d0", raw_dir=raw, download=False)
    # a bundle of another length than WILDS states, but not short of it, is read (CodaLab builds the tar.gz anew)
    monkeypatch.setattr(cam, "CAMELYON17_MIN_BYTES", size - 100)
    prepare_camelyon17(tmp_path / "data", raw_dir=raw, download=False, max_per_hospital=3)
    assert (raw / "camelyon17_v1.0" / "metadata.csv").is_file()
    # each hospital keeps a seeded subset of 3 patches, in metadata order, each with its own label: one generator
    # (seed 0) draws hospital by hospital
    rng = np.random.default_rng(0)
    for k, n in enumerate((6, 5, 4, 4, 4)):
        x, y, _ = cam.load_camelyon17_pool(f"hospital{k + 1}", tmp_path / "data")
        assert x.shape == (3, 3, 96, 96)
        index = patch_index(truth[k])
        kept = [index[tuple(int(c) for c in img[:, 50, 50])] for img in x]
        assert kept == np.sort(rng.choice(n, size=3, replace=False)).tolist()
        assert y.tolist() == [truth[k][i][0] for i in kept]


@pytest.mark.parametrize("filters", [True, False], ids=["extraction-filters", "python-without-filters"])
def test_bundle_extraction_refuses_members_outside_the_folder(tmp_path, monkeypatch, filters):
    """Python before 3.10.12 / 3.11.4 has no tarfile filters: the same archives extract or are refused."""
    if not filters:
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    good, evil = tmp_path / "good.tar", tmp_path / "evil.tar"
    (tmp_path / "metadata.csv").write_text("x")
    with tarfile.open(good, "w") as tar:
        tar.add(tmp_path / "metadata.csv", arcname="camelyon17_v1.0/metadata.csv")
    with tarfile.open(evil, "w") as tar:
        tar.add(tmp_path / "metadata.csv", arcname="../escaped.csv")
    cam._extract(good, tmp_path / "out")
    assert (tmp_path / "out" / "camelyon17_v1.0" / "metadata.csv").read_text() == "x"
    with pytest.raises(DataError, match="evil.tar"):
        cam._extract(evil, tmp_path / "out2")
    assert not (tmp_path / "escaped.csv").exists()


def test_missing_and_corrupt_files_are_named(tmp_path):
    with pytest.raises(DataError, match="codalab") as info:
        prepare_camelyon17(tmp_path / "data", raw_dir=tmp_path / "raw", download=False)
    assert "camelyon17_v1.0.tar.gz" in str(info.value) and "metadata.csv" in str(info.value)

    raw = tmp_path / "raw"
    _bundle(raw, sizes=(3, 3, 3, 3, 3))
    victim = next(iter(sorted((raw / "patches").rglob("*.png"))))
    victim.write_bytes(victim.read_bytes()[:40])
    with pytest.raises(DataError, match="Cannot decode") as info:
        prepare_camelyon17(tmp_path / "data", raw_dir=raw, download=False)
    assert victim.name in str(info.value)
    victim.unlink()
    with pytest.raises(DataError, match="missing") as info:
        prepare_camelyon17(tmp_path / "data", raw_dir=raw, download=False)
    assert victim.name in str(info.value)

    write_image(victim, np.zeros((64, 64, 3)))
    with pytest.raises(DataError, match="expected 96 x 96"):
        prepare_camelyon17(tmp_path / "data", raw_dir=raw, download=False)
    write_image(victim, np.zeros((96, 96, 3)))
    data = tmp_path / "data"
    prepare_camelyon17(data, raw_dir=raw, download=False)
    corrupt(data / "camelyon17" / "hospital3.npz")
    with pytest.raises(DataError, match="Checksum mismatch"):
        load_camelyon17("hospital3", data)

    (raw / "metadata.csv").write_text("patient,node\n1,2\n")
    with pytest.raises(DataError, match="lacks the column"):
        prepare_camelyon17(data, raw_dir=raw, download=False)


def test_the_unifed_camelyon17_preset_builds_unifeds_federation(tmp_path):
    """unifed_camelyon17: WILDS' training centers (hospital1, 4, 5) train on 0.7 / 0.1 / 0.2 splits, untruncated; its
    OOD validation and test centers (hospital2, 3: UniFed's "hospital4-5") never train and are scored on every patch."""
    from fednorm.runs.config import load_config
    from fednorm.runs.runner import build_federation_data

    _bundle(tmp_path / "raw")
    data = tmp_path / "data"
    prepare_camelyon17(data, raw_dir=tmp_path / "raw", download=False)
    cfg = load_config("unifed_camelyon17")
    clients = build_federation_data(cfg, data)
    internal = [c for c in clients if not c.meta.get("external")]
    external = [c for c in clients if c.meta.get("external")]
    assert [c.domain for c in internal] == [f"camelyon17/{h}" for h in cam.UNIFED_INTERNAL]
    assert [(len(c.train), len(c.val), len(c.test)) for c in internal] == [(70, 10, 20), (7, 1, 2), (8, 1, 3)]
    assert [c.domain for c in external] == [f"camelyon17/{h}" for h in cam.UNIFED_EXTERNAL]
    assert [len(c.test) for c in external] == [SIZES[1], SIZES[2]]
    assert cfg.external.modes == ["global", "test_time_bn", "fedbn_average"] and len(cfg.methods) == 16
