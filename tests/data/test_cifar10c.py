"""The released CIFAR-10-C (fednorm.data.cifar10c, prepare_cifar10c): tiny archives in the release's layout
(``CIFAR-10-C/<corruption>.npy`` of 5 N images by severity, ``CIFAR-10-C/labels.npy`` repeated per severity),
prepared into the data folder and loaded as ``cifar10c/<corruption>/<severity>`` domains. No network:
the download goes to a localhost server."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
import torch

from fednorm.data import prepare
from fednorm.data.cifar10c import (BENCHMARK_CORRUPTIONS, CORRUPTIONS, cifar10c_domains, load_cifar10c,
                                   parse_cifar10c_name)
from fednorm.data.corrupt import CORRUPTIONS as GENERATED_CORRUPTIONS
from fednorm.data.domain import DataError
from fednorm.data.download import md5_of, sha256_of
from fednorm.data.federation import build_clients, load_pool, parse_domain
from fednorm.data.prepare import RawFile, prepare_command, prepare_dataset, preparer_for

from .local_http import serve_folder

N = 20  # images per severity (the release: 10,000)


def _release(rng, corruptions=("fog", "snow")):
    """Arrays in the release's layout: per corruption (5 N, 32, 32, 3) uint8, severity s in rows (s-1) N .. s N,
    and labels (5 N,) = the same N labels five times. Image i of severity s has pixel (0, 0, 0) = 20 s + i."""
    labels = np.tile(rng.permutation(np.arange(N, dtype=np.uint8) % 2 * 7), 5)  # classes 0 and 7, ten each
    arrays = {}
    for c in corruptions:
        x = rng.integers(0, 256, (5 * N, 32, 32, 3), dtype=np.uint8)
        for s in range(1, 6):
            for i in range(N):
                x[(s - 1) * N + i, 0, 0, 0] = 20 * s + i
        arrays[c] = x
    return arrays, labels


def _npy_bytes(array) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def _write_tar(path, arrays, labels, *, skip=()):
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:  # the release is an uncompressed tar
        for name, array in [*arrays.items(), ("labels", labels)]:
            if name in skip:
                continue
            blob = _npy_bytes(array)
            info = tarfile.TarInfo(f"CIFAR-10-C/{name}.npy")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))


@pytest.fixture()
def unofficial(monkeypatch):
    """The tiny archive is not the release: no digest to check."""
    src = prepare.CIFAR10C_SOURCES["archive"]
    monkeypatch.setitem(prepare.CIFAR10C_SOURCES, "archive", RawFile(src.url, src.filename))


def test_names_parse_and_the_benchmark_is_unifeds_fifteen():
    assert parse_cifar10c_name("cifar10c/fog/3") == ("fog", 3)
    assert BENCHMARK_CORRUPTIONS == GENERATED_CORRUPTIONS  # the same 15 as the generated corruptions
    assert len(CORRUPTIONS) == 19 and "speckle_noise" in CORRUPTIONS
    assert cifar10c_domains(5)[:2] == ["cifar10c/gaussian_noise/5", "cifar10c/shot_noise/5"]
    spec = parse_domain("cifar10c/speckle_noise/1")
    assert (spec.benchmark, spec.num_classes, spec.image_size, spec.file) == ("cifar10", 10, 32,
                                                                            "cifar10c/speckle_noise.npz")
    for bad, what in [("cifar10c/fog", "cifar10c/<corruption>/<severity>"), ("cifar10c/fog/6", "1..5"),
                      ("cifar10c/mist/3", "unknown CIFAR-10-C corruption")]:
        with pytest.raises(ValueError, match=what):
            parse_domain(bad)
    assert preparer_for("cifar10c/fog/2") == "cifar10c"
    assert prepare_command("cifar10c/fog.npz", "D") == "fednorm data prepare cifar10c --domains fog --data-dir D"


def test_prepare_from_the_archive_and_load_each_severity(tmp_path, unofficial):
    arrays, labels = _release(np.random.default_rng(0))
    raw = tmp_path / "raw"
    _write_tar(raw / "CIFAR-10-C.tar", arrays, labels)
    data = tmp_path / "data"
    written = prepare.prepare_cifar10c(data, raw_dir=raw, download=False, progress=False, corruptions=("fog", "snow"))
    assert written == [data / "cifar10c/fog.npz", data / "cifar10c/snow.npz"]
    entry = json.loads((data / "manifest.json").read_text())["cifar10c/fog"]
    assert entry["sha256"] == sha256_of(written[0]) and entry["arrays"] == {"x": [5, N, 32, 32, 3], "y": [N]}
    for corruption in ("fog", "snow"):
        for severity in (1, 3, 5):
            x, y = load_cifar10c(corruption, severity, data)
            assert x.shape == (N, 3, 32, 32) and x.dtype == torch.uint8 and y.dtype == torch.int64
            rows = arrays[corruption][(severity - 1) * N: severity * N]
            np.testing.assert_array_equal(x.permute(0, 2, 3, 1).numpy(), rows)  # NHWC -> NCHW, channels kept
            assert [int(v) for v in x[:, 0, 0, 0]] == [20 * severity + i for i in range(N)]
            assert y.tolist() == labels[:N].tolist()
    # the domain is one pool of the severity's images, as the federation protocol re-splits it
    x, y = load_pool("cifar10c/snow/2", data_dir=data)
    np.testing.assert_array_equal(x.permute(0, 2, 3, 1).numpy(), arrays["snow"][N: 2 * N])

    written[0].write_bytes(written[0].read_bytes()[:-10])  # damaged after preparing: named, with its command
    with pytest.raises(DataError, match="fednorm data prepare cifar10c --domains fog"):
        load_cifar10c("fog", 1, data)


def test_an_extracted_release_folder_needs_no_archive(tmp_path):
    arrays, labels = _release(np.random.default_rng(1), ("pixelate",))
    folder = tmp_path / "raw" / "CIFAR-10-C"
    folder.mkdir(parents=True)
    np.save(folder / "pixelate.npy", arrays["pixelate"])
    np.save(folder / "labels.npy", labels)
    data = tmp_path / "data"
    prepare_dataset("cifar10c", data, raw_dir=tmp_path / "raw", download=False, progress=False, domains="pixelate")
    x, _ = load_cifar10c("pixelate", 4, data)
    np.testing.assert_array_equal(x.permute(0, 2, 3, 1).numpy(), arrays["pixelate"][3 * N: 4 * N])
    with pytest.raises(DataError, match="frost.npy is missing"):
        prepare_dataset("cifar10c", data, raw_dir=tmp_path / "raw", download=False, domains="frost")
    # --raw-dir pointing at the extracted folder itself reads it too (and never downloads the archive into it)
    other = tmp_path / "other"
    prepare_dataset("cifar10c", other, raw_dir=folder, progress=False, domains="pixelate")
    assert torch.equal(load_cifar10c("pixelate", 4, other)[0], x) and not (folder / "CIFAR-10-C.tar").exists()


def test_bad_releases_are_refused_naming_what_is_wrong(tmp_path, unofficial):
    rng = np.random.default_rng(2)
    arrays, labels = _release(rng, ("fog",))
    cases = {
        "lacks CIFAR-10-C/fog.npy": dict(arrays={}, labels=labels),
        "labels.npy is not the same": dict(arrays=arrays, labels=np.arange(5 * N, dtype=np.uint8) % 7),
        r"uint8 \(5 N, 32, 32, 3\)": dict(arrays={"fog": arrays["fog"][:, :16]}, labels=labels),
        f"holds {5 * N - 5} labels for {5 * N} images": dict(arrays=arrays, labels=labels[:-5]),
    }
    for i, (message, case) in enumerate(cases.items()):
        raw = tmp_path / f"raw{i}"
        _write_tar(raw / "CIFAR-10-C.tar", case["arrays"], case["labels"])
        with pytest.raises(DataError, match=message):
            prepare.prepare_cifar10c(tmp_path / f"data{i}", raw_dir=raw, download=False, corruptions=("fog",))
        assert not (tmp_path / f"data{i}" / "cifar10c/fog.npz").exists()
    with pytest.raises(DataError, match="Zenodo record 2535967"):  # nothing there and no download allowed
        prepare.prepare_cifar10c(tmp_path / "d", raw_dir=tmp_path / "empty", download=False, corruptions=("fog",))
    with pytest.raises(ValueError, match="unknown CIFAR-10-C corruption"):
        prepare.prepare_cifar10c(tmp_path / "d", raw_dir=tmp_path / "empty", download=False, corruptions=("mist",))


def test_the_archive_is_downloaded_and_its_digests_checked(tmp_path, monkeypatch):
    arrays, labels = _release(np.random.default_rng(3), ("brightness",))
    served = tmp_path / "served"
    _write_tar(served / "CIFAR-10-C.tar", arrays, labels)
    tar = served / "CIFAR-10-C.tar"
    with serve_folder(served) as server:
        monkeypatch.setitem(prepare.CIFAR10C_SOURCES, "archive",
                            RawFile(server.url("CIFAR-10-C.tar"), "CIFAR-10-C.tar", sha256_of(tar), md5_of(tar)))
        data = tmp_path / "data"
        prepare.prepare_cifar10c(data, progress=False, corruptions=("brightness",))
        assert [e["path"] for e in server.log] == ["/CIFAR-10-C.tar"]
        assert (data / "raw/cifar10c/CIFAR-10-C.tar").read_bytes() == tar.read_bytes()
        assert "sha256" in json.loads((data / "manifest.json").read_text())["cifar10c/brightness"]["source"]
        monkeypatch.setitem(prepare.CIFAR10C_SOURCES, "archive",
                            RawFile(server.url("CIFAR-10-C.tar"), "CIFAR-10-C.tar", "0" * 64, None))
        with pytest.raises(DataError, match="expected sha256 0{64}"):
            prepare.prepare_cifar10c(tmp_path / "other", progress=False, corruptions=("brightness",))


def test_corruption_clients_train_on_the_protocols_split(tmp_path, unofficial):
    """Two corruption clients of one severity: each re-split 80/20 (sklearn's stratified split of the severity's
    labels, seed 0) from its own pool of the severity's images. The release repeats the same clean images under
    every corruption, so both clients hold the same image ids, each in its own corruption."""
    from sklearn.model_selection import StratifiedShuffleSplit

    arrays, labels = _release(np.random.default_rng(4))
    _write_tar(tmp_path / "raw/CIFAR-10-C.tar", arrays, labels)
    data = tmp_path / "data"
    prepare.prepare_cifar10c(data, raw_dir=tmp_path / "raw", download=False, progress=False, corruptions=("fog", "snow"))
    clients = build_clients(["cifar10c/fog/5", "cifar10c/snow/5"], data_dir=data, percent=1.0, pool_size=16)
    assert [c.domain for c in clients] == ["cifar10c/fog/5", "cifar10c/snow/5"]
    [(train_ids, test_ids)] = StratifiedShuffleSplit(n_splits=1, test_size=0.2, random_state=0).split(
        np.zeros(N), labels[:N])
    assert (len(train_ids), len(test_ids)) == (16, 4)
    for client, corruption in zip(clients, ("fog", "snow")):
        pool = arrays[corruption][4 * N:]  # severity 5: image i has pixel (0, 0, 0) = 100 + i
        for split, ids in ((client.train, train_ids), (client.test, test_ids)):
            assert [int(v) - 100 for v in split.x[:, 0, 0, 0]] == ids.tolist()  # in sklearn's order
            np.testing.assert_array_equal(split.x.permute(0, 2, 3, 1).numpy(), pool[ids])
            assert split.y.tolist() == labels[ids].tolist()


def test_the_unifed_cifar10c_preset_runs_on_a_prepared_folder(tmp_path, unofficial):
    """unifed_cifar10c_external end to end on tiny files (small AlexNet, no pretrained weights): two corruption
    clients train, a held-out one is scored on all its images under every external mode."""
    from fednorm.runs.config import load_config
    from fednorm.runs.runner import start_run

    arrays, labels = _release(np.random.default_rng(5), ("fog", "snow", "gaussian_noise"))
    _write_tar(tmp_path / "raw/CIFAR-10-C.tar", arrays, labels)
    data = tmp_path / "data"
    prepare_dataset("cifar10c", data, raw_dir=tmp_path / "raw", download=False, progress=False,
                    domains="fog,snow,gaussian_noise")
    cfg = load_config("unifed_cifar10c_external", [
        "data.domains=[cifar10c/fog/2, cifar10c/snow/2]", "external.domains=[cifar10c/gaussian_noise/2]",
        "data.pool_size=16", "methods=[fedavg]", "seeds=[0]", "model.pretrained=none", "model.width=0.125",
        "model.input_size=64", "training.precision=fp32", "training.batch_size=4", "federation.rounds=1",
        "federation.eval_every=1"])
    [result] = start_run(cfg, tmp_path / "run", data_dir=data)
    clients = {c["name"]: c for c in result.summary["clients"]}
    assert list(clients) == ["cifar10c/fog/2", "cifar10c/snow/2", "cifar10c/gaussian_noise/2:global",
                             "cifar10c/gaussian_noise/2:test_time_bn", "cifar10c/gaussian_noise/2:fedbn_average"]
    # the external client is scored on every image of its severity (external.data: all), internal ones on their
    # protocol's 20 % test split
    from fednorm.runs import store

    records = store.read_metrics(tmp_path / "run" / "fedavg" / "seed0" / "metrics.jsonl")
    tested = {r["client"]: r["n"] for r in records if r["split"] == "test"}
    assert tested == {"cifar10c/fog/2": 4, "cifar10c/snow/2": 4, **{f"cifar10c/gaussian_noise/2:{mode}": N for mode in
                                                                    ("global", "test_time_bn", "fedbn_average")}}


def test_every_missing_file_of_a_run_is_named_in_one_message_with_one_command_per_dataset(tmp_path):
    from fednorm.data.prepare import check_data_files

    data = tmp_path / "data"
    (data / "cifar10c").mkdir(parents=True)
    (data / "cifar10c" / "fog.npz").write_bytes(b"present")  # present files are not named
    domains = ["cifar10c/fog/3", "cifar10c/snow/3", "cifar10c/snow/5", "cifar10c/frost/1", "prostate/HK", "mnist",
               "rendered/neon"]
    with pytest.raises(DataError) as info:
        check_data_files(domains, data)
    text = str(info.value)
    assert "lacks 4 file(s)" in text and "cifar10c/fog.npz" not in text  # snow once for its two severities
    assert f"fednorm data prepare cifar10c --domains snow,frost --data-dir {data}" in text
    assert f"fednorm data prepare prostate --domains HK --data-dir {data}" in text
    assert "digits/mnist.npz: these come with the offline copy" in text
    check_data_files(["cifar10c/fog/2", "rendered/neon"], data)  # nothing missing: no error
