"""Office-Caltech10 and DomainNet: preparing tiny archives in the real on-disk layouts (FedBN's zip
with pickled lists, the official per-domain zips, plain image folders), loading the npz files and
FedBN's object protocol. No network: downloads go to a localhost server."""

from __future__ import annotations

import io
import json
import pickle
import warnings
import zipfile

import numpy as np
import pytest
import torch
from PIL import Image

from fednorm.data import prepare
from fednorm.data.domain import DataError, Split
from fednorm.data.federation import build_clients, image_size, load_domain, num_classes, parse_domain
from fednorm.data.objects import DOMAINNET, OFFICE_CALTECH10, RawImages, image_to_array, load_object_domain
from fednorm.data.prepare import RawFile
from fednorm.data.protocol import fedbn_object_clients

from .local_http import serve_folder

SIZE = 16


def _png(array: np.ndarray, mode: str | None = None) -> bytes:
    image = Image.fromarray(array)
    if mode:
        image = image.convert(mode)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _image(rng, i: int, shape=(SIZE, SIZE)) -> tuple[np.ndarray, str | None]:
    """Mostly RGB images of the output size; every fifth is grey, every seventh RGBA."""
    rgb = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
    if i % 5 == 4:
        return rgb[..., 0], None  # mode L
    return rgb, "RGBA" if i % 7 == 6 else None


def _fedbn_office_zip(path, rng, sizes: dict[str, tuple[int, int]], prefix="office_caltech_10"):
    """FedBN's office_caltech_10_dataset.zip layout: images + {domain}_{train,test}.pkl lists of
    (paths relative to FedBN's data/ folder, text labels). Returns {(domain, part): [(array, label)]}."""
    expected = {}
    with zipfile.ZipFile(path, "w") as zf:
        for domain, (n_train, n_test) in sizes.items():
            for part, n in (("train", n_train), ("test", n_test)):
                paths, labels, items = [], [], []
                for i in range(n):
                    label = (i * 3 + len(domain)) % 10
                    cls = OFFICE_CALTECH10.classes[label]
                    array, mode = _image(rng, i)
                    member = f"{prefix}/{domain}/{cls}/{part}_{i:03d}.png"
                    zf.writestr(member, _png(array, mode))
                    paths.append(member)
                    labels.append(cls)
                    items.append((array, label, mode))
                blob = pickle.dumps((np.array(paths), np.array(labels)))
                zf.writestr(f"{prefix}/{domain}_{part}.pkl", blob)
                expected[domain, part] = items
        zf.writestr("__MACOSX/office_caltech_10/amazon/mug/._x.png", b"junk")
    return expected


def _as_rgb(array: np.ndarray, mode: str | None) -> np.ndarray:
    if array.ndim == 2 or mode == "RGBA":  # FedBN: Grayscale(3) unless the image has three bands
        grey = np.asarray(Image.fromarray(array).convert(mode or "L").convert("L"))
        return np.repeat(grey[..., None], 3, axis=2)
    return array


OFFICE_SIZES = {"amazon": (30, 8), "caltech": (26, 7), "dslr": (24, 6), "webcam": (28, 6)}


@pytest.fixture()
def office_raw(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    expected = _fedbn_office_zip(raw / "office_caltech_10_dataset.zip", np.random.default_rng(0), OFFICE_SIZES)
    return raw, expected


def _manifest(data_dir) -> dict:
    return json.loads((data_dir / "manifest.json").read_text())


def test_office_from_fedbn_zip_to_npz_and_loaded(office_raw, tmp_path):
    raw, expected = office_raw
    data = tmp_path / "data"
    paths = prepare.prepare_office_caltech10(data, raw_dir=raw, download=False, progress=False, size=SIZE)
    assert paths == [data / f"office_caltech10/{d}_{SIZE}.npz" for d in OFFICE_CALTECH10.domains]
    with np.load(paths[0]) as f:
        assert f["x_train"].shape == (30, SIZE, SIZE, 3) and f["x_train"].dtype == np.uint8
        assert f["x_test"].shape == (8, SIZE, SIZE, 3)
        assert f["classes"].tolist() == list(OFFICE_CALTECH10.classes)
        for part in ("train", "test"):
            items = expected["amazon", part]
            assert f[f"y_{part}"].tolist() == [label for _, label, _ in items]  # list order, FedBN label order
            for i, (array, _, mode) in enumerate(items):
                np.testing.assert_array_equal(f[f"x_{part}"][i], _as_rgb(array, mode))
    entry = _manifest(data)[f"office_caltech10_amazon_{SIZE}"]
    assert entry["file"] == f"office_caltech10/amazon_{SIZE}.npz"
    assert entry["arrays"]["x_train"] == [30, SIZE, SIZE, 3]
    assert "FedBN's train/test lists" in entry["source"] and "amazon_train.pkl" in entry["source"]

    train, test = load_object_domain("office_caltech10", "dslr", data, SIZE)
    assert train.x.shape == (24, 3, SIZE, SIZE) and test.x.shape == (6, 3, SIZE, SIZE)
    assert train.y.dtype == torch.int64
    array, _, mode = expected["dslr", "train"][1]
    assert torch.equal(train.x[1], torch.from_numpy(_as_rgb(array, mode)).permute(2, 0, 1))

    domains = [f"office_caltech10/{d}@{SIZE}" for d in OFFICE_CALTECH10.domains]
    assert num_classes(domains) == 10 and image_size(domains) == SIZE
    clients = build_clients(domains, data_dir=data, percent=1.0)
    # The official prepare_data: min train list 24 (dslr) -> train on the first int(0.5 * 24) = 12,
    # validate on the last int(0.4 * 24) = 9, test on the whole test list.
    assert [c.name for c in clients] == domains
    for c, d in zip(clients, OFFICE_CALTECH10.domains):
        full, test = load_object_domain("office_caltech10", d, data, SIZE)
        assert c.num_train == 12 and torch.equal(c.train.x, full.x[:12])
        assert len(c.val) == 9 and torch.equal(c.val.y, full.y[-9:])
        assert torch.equal(c.test.y, test.y)
        assert c.meta["protocol"] == "fedbn-objects" and c.meta["min_train_len"] == 24


def test_office_resize_and_modes_follow_fedbn():
    rng = np.random.default_rng(1)
    rgb = rng.integers(0, 256, (40, 30, 3), dtype=np.uint8)
    out = image_to_array(Image.fromarray(rgb), 16)
    expected = np.asarray(Image.fromarray(rgb).resize((16, 16), Image.BILINEAR))
    np.testing.assert_array_equal(out, expected)  # torchvision Resize([16, 16]) on PIL = this call
    palette = Image.fromarray(rgb).convert("P")
    grey = image_to_array(palette, 16)
    assert (grey[..., 0] == grey[..., 1]).all() and (grey[..., 1] == grey[..., 2]).all()
    cmyk = image_to_array(Image.fromarray(rgb).convert("CMYK"), 8)
    assert cmyk.shape == (8, 8, 3) and (cmyk[..., 0] == cmyk[..., 2]).all()


def test_office_downloaded_once_from_the_registry(office_raw, tmp_path, monkeypatch):
    raw, _ = office_raw
    with serve_folder(raw) as server:
        name = "office_caltech_10_dataset.zip"
        monkeypatch.setitem(prepare.OFFICE_SOURCES, "archive", RawFile(server.url(name), name))
        data = tmp_path / "data"
        prepare.prepare_office_caltech10(data, progress=False, size=SIZE, domains=["webcam"])
        assert [e["path"] for e in server.log] == [f"/{name}"]
        assert (data / "raw/office_caltech10" / name).read_bytes() == (raw / name).read_bytes()
        assert sorted(p.name for p in (data / "office_caltech10").iterdir()) == [f"webcam_{SIZE}.npz"]
        source = _manifest(data)[f"office_caltech10_webcam_{SIZE}"]["source"]
        assert "sha256" in source
        prepare.prepare_office_caltech10(data, progress=False, size=SIZE, domains=["amazon"])
        assert len(server.log) == 1  # the archive is there: no second download


def test_office_image_folders_without_lists_get_a_seeded_stratified_split(tmp_path):
    raw = tmp_path / "raw"
    rng = np.random.default_rng(2)
    for cls in OFFICE_CALTECH10.classes[:4]:
        folder = raw / "office_caltech_10" / "webcam" / cls
        folder.mkdir(parents=True)
        for i in range(10):
            Image.fromarray(rng.integers(0, 256, (12, 20, 3), dtype=np.uint8)).save(folder / f"frame_{i:04d}.jpg")
    data = tmp_path / "data"
    with pytest.warns(UserWarning, match="stratified 80/20"):
        prepare.prepare_office_caltech10(data, raw_dir=raw, download=False, progress=False, size=SIZE,
                                         domains="webcam")
    train, test = load_object_domain("office_caltech10", "webcam", data, SIZE)
    assert len(train) == 32 and len(test) == 8
    assert torch.bincount(test.y, minlength=10).tolist()[:4] == [2, 2, 2, 2]
    assert "seed 0" in _manifest(data)[f"office_caltech10_webcam_{SIZE}"]["source"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = tmp_path / "again"
        prepare.prepare_office_caltech10(again, raw_dir=raw, download=False, progress=False, size=SIZE,
                                         domains="webcam")
    assert torch.equal(load_object_domain("office_caltech10", "webcam", again, SIZE)[1].x, test.x)


def test_office_missing_listed_image_and_missing_archive_are_explained(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    with zipfile.ZipFile(raw / "office_caltech_10_dataset.zip", "w") as zf:
        zf.writestr("office_caltech_10/dslr/mug/a.png", _png(np.zeros((4, 4, 3), np.uint8)))
        lst = (["office_caltech_10/dslr/mug/a.png", "office_caltech_10/dslr/mug/gone.png"], ["mug", "mug"])
        zf.writestr("office_caltech_10/dslr_train.pkl", pickle.dumps(lst))
        zf.writestr("office_caltech_10/dslr_test.pkl", pickle.dumps(lst))
    with pytest.raises(DataError, match="dslr/mug/gone.png"):
        prepare.prepare_office_caltech10(tmp_path / "data", raw_dir=raw, download=False, domains=["dslr"])
    with pytest.raises(DataError) as info:
        prepare.prepare_office_caltech10(tmp_path / "data", raw_dir=tmp_path / "empty", download=False)
    assert "office_caltech_10_dataset.zip" in str(info.value) and str(tmp_path / "empty") in str(info.value)


class _Tampered:
    """A pickle that would create ``path`` when loaded by pickle's own loader (it calls builtins.open)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_fedbn_pickles_are_read_as_arrays_only_and_a_tampered_one_runs_nothing(tmp_path, protocol):
    """FedBN's files come unpickled from a mirror without checksums: arrays, tuples, lists and strings load in every
    pickle protocol and as np.save's object arrays; a pickle naming any other global is refused before it runs."""
    from fednorm.data.objects import load_fedbn_pair

    images, labels = np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3), np.array([3, 7])
    buffer = io.BytesIO()
    np.save(buffer, np.array([images, labels, None], dtype=object)[:2], allow_pickle=True)  # a 2-object .npy
    for data in (pickle.dumps((images, labels), protocol=protocol), pickle.dumps([images, labels], protocol=protocol),
                 buffer.getvalue()):
        x, y = load_fedbn_pair(data, "the test file", "(images, labels)")
        assert np.array_equal(x, images) and x.dtype == np.uint8 and np.array_equal(y, labels)
    marker = tmp_path / "ran"
    for data in (pickle.dumps((_Tampered(marker), labels), protocol=protocol),
                 pickle.dumps(np.array([_Tampered(marker), labels], dtype=object), protocol=protocol)):
        with pytest.raises(DataError, match=r"Cannot unpickle the test file .*(builtins|io)\.open.*Get FedBN's files again"):
            load_fedbn_pair(data, "the test file", "(images, labels)")
    buffer = io.BytesIO()
    np.save(buffer, np.array([_Tampered(marker), labels], dtype=object), allow_pickle=True)
    with pytest.raises(DataError, match=r"(builtins|io)\.open"):
        load_fedbn_pair(buffer.getvalue(), "the test file", "(images, labels)")
    assert not marker.exists()


def test_fedbn_lists_are_read_as_fedbn_reads_them(tmp_path):
    """FedBN loads its lists with np.load(allow_pickle=True): a pickled tuple, a pickled 2 x N array and
    an .npy file under the .pkl name all give the same (paths, labels)."""
    paths = ["office_caltech_10/amazon/mug/a.jpg", "office_caltech_10/amazon/bike/b.jpg"]
    labels = ["mug", "bike"]
    (tmp_path / "amazon_train.pkl").write_bytes(pickle.dumps((np.array(paths), np.array(labels))))
    (tmp_path / "caltech_train.pkl").write_bytes(pickle.dumps(np.array([paths, labels])))
    with (tmp_path / "dslr_train.pkl").open("wb") as fh:
        np.save(fh, np.array([paths, labels]))
    (tmp_path / "webcam_train.pkl").write_bytes(pickle.dumps({"paths": paths}))
    with RawImages(tmp_path) as raw:
        for name in ("amazon_train.pkl", "caltech_train.pkl", "dslr_train.pkl"):
            keys, y, _ = raw.read_list(name, OFFICE_CALTECH10.classes)
            assert keys == [("amazon", "mug", "a.jpg"), ("amazon", "bike", "b.jpg")]
            assert y.tolist() == [OFFICE_CALTECH10.classes.index("mug"), OFFICE_CALTECH10.classes.index("bike")]
        with pytest.raises(DataError, match="webcam_train.pkl must hold a pickled pair"):
            raw.read_list("webcam_train.pkl", OFFICE_CALTECH10.classes)


def test_office_folder_without_its_test_list_downloads_fedbns_archive(office_raw, tmp_path, monkeypatch):
    """Images and a train list but no test list is not FedBN's protocol: the archive is fetched."""
    raw, _ = office_raw
    partial = tmp_path / "partial"
    with zipfile.ZipFile(raw / "office_caltech_10_dataset.zip") as zf:
        zf.extractall(partial, [n for n in zf.namelist() if "/webcam" in n and not n.endswith("_test.pkl")])
    assert (partial / "office_caltech_10/webcam_train.pkl").is_file()
    with serve_folder(raw) as server:
        name = "office_caltech_10_dataset.zip"
        monkeypatch.setitem(prepare.OFFICE_SOURCES, "archive", RawFile(server.url(name), name))
        prepare.prepare_office_caltech10(tmp_path / "data", raw_dir=partial, progress=False, size=SIZE,
                                         domains=["webcam"])
        assert [e["path"] for e in server.log] == [f"/{name}"]
    assert "FedBN's train/test lists" in _manifest(tmp_path / "data")[f"office_caltech10_webcam_{SIZE}"]["source"]


def test_missing_prepared_file_says_which_command_writes_it(tmp_path):
    with pytest.raises(DataError, match="fednorm data prepare office_caltech10 --size 256 --domains caltech"):
        load_domain("office_caltech10/caltech@256", data_dir=tmp_path)
    with pytest.raises(DataError, match="fednorm data prepare domainnet --domains real"):
        load_domain("domainnet/real", data_dir=tmp_path)
    # a file that is there but damaged names the same command, as does a missing CIFAR-10 file
    from fednorm.data.cifar10 import load_cifar10
    from fednorm.data.prepare import write_dataset_file

    x, y = np.zeros((2, SIZE, SIZE, 3), np.uint8), np.zeros(2, np.uint8)
    path = write_dataset_file(tmp_path, OFFICE_CALTECH10.file("dslr", SIZE), {"x_train": x, "y_train": y,
                              "x_test": x, "y_test": y}, key="dslr", source="test")
    path.write_bytes(path.read_bytes()[:-1] + b"x")
    with pytest.raises(DataError, match=f"Checksum mismatch.*fednorm data prepare office_caltech10 --size {SIZE} "
                                        "--domains dslr --data-dir"):
        load_domain(f"office_caltech10/dslr@{SIZE}", data_dir=tmp_path)
    with pytest.raises(DataError, match="cifar10.npz is missing.*fednorm data prepare cifar10 --data-dir"):
        load_cifar10(tmp_path)


def test_domain_names_and_sizes():
    assert parse_domain("office_caltech10/amazon").image_size == 64
    assert parse_domain("domainnet/quickdraw@256").file == "domainnet/quickdraw_256.npz"
    for bad, match in [("office_caltech10/amazon@x", "integer"), ("office_caltech10/amazon@4", "8..1024"),
                       ("domainnet/photo", "unknown domain"), ("office_caltech10", "unknown domain")]:
        with pytest.raises(ValueError, match=match):
            parse_domain(bad)
    with pytest.raises(ValueError, match="mix benchmarks"):
        num_classes(["office_caltech10/amazon", "mnist"])  # both have 10 classes, but not the same ones
    with pytest.raises(ValueError, match="mix image sizes"):
        image_size(["office_caltech10/amazon", "office_caltech10/dslr@256"])


# --- DomainNet -------------------------------------------------------------------------------------


def _domainnet_zips(raw, rng, domain="clipart", n_train=12, n_test=5):
    """The official <domain>.zip (<domain>/<class>/<file>, 345 classes: one extra here) and FedBN's
    domainnet_dataset.zip (DomainNet/<domain>_{train,test}.pkl, paths relative to FedBN's data/)."""
    raw.mkdir(parents=True, exist_ok=True)
    lists = {}
    with zipfile.ZipFile(raw / f"{domain}.zip", "w") as zf:
        zf.writestr(f"{domain}/aircraft_carrier/{domain}_001_000001.jpg", b"not in the ten classes")
        for part, n in (("train", n_train), ("test", n_test)):
            paths, labels = [], []
            for i in range(n):
                cls = DOMAINNET.classes[(i + (part == "test")) % 10]
                name = f"{domain}/{cls}/{domain}_{part}_{i:06d}.png"
                zf.writestr(name, _png(rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)))
                paths.append(f"DomainNet/{name}")
                labels.append(cls)
            lists[part] = (paths, labels)
    with zipfile.ZipFile(raw / "domainnet_dataset.zip", "w") as zf:
        for part, pair in lists.items():
            zf.writestr(f"DomainNet/{domain}_{part}.pkl", pickle.dumps(pair))
    return lists


def test_domainnet_official_zip_and_fedbn_lists(tmp_path):
    raw = tmp_path / "raw"
    lists = _domainnet_zips(raw, np.random.default_rng(3))
    data = tmp_path / "data"
    [path] = prepare.prepare_domainnet(data, raw_dir=raw, download=False, progress=False, size=SIZE,
                                       domains=["clipart"])
    assert path == data / f"domainnet/clipart_{SIZE}.npz"
    train, test = load_domain(f"domainnet/clipart@{SIZE}", data_dir=data).parts()
    assert len(train) == 12 and len(test) == 5
    assert [DOMAINNET.classes[i] for i in train.y.tolist()] == lists["train"][1]
    with zipfile.ZipFile(raw / "clipart.zip") as zf:
        first = Image.open(io.BytesIO(zf.read(lists["train"][0][0].removeprefix("DomainNet/"))))
        expected = np.array(first.convert("RGB").resize((SIZE, SIZE), Image.BILINEAR))
    assert torch.equal(train.x[0], torch.from_numpy(expected).permute(2, 0, 1))
    # int(0.05 * 12) = 0 training samples: the official fractions need realistic list lengths.
    with pytest.raises(ValueError, match="0 samples"):
        build_clients([f"domainnet/clipart@{SIZE}"], data_dir=data, percent=1.0)


def test_domainnet_without_fedbn_lists_uses_the_official_split_files(tmp_path):
    """DomainNet's own <domain>_train.txt / _test.txt (345-class labels) decide train and test when FedBN's
    lists are absent; images outside the ten classes are left out."""
    raw = tmp_path / "raw"
    lists = _domainnet_zips(raw, np.random.default_rng(5))
    (raw / "domainnet_dataset.zip").unlink()
    for part, (paths, _) in lists.items():
        other = "clipart/aircraft_carrier/clipart_001_000001.jpg 1"
        # the official file lists a test image as training and the reverse: the split follows the file
        lines = [f"{p.removeprefix('DomainNet/')} {300 + i}" for i, p in enumerate(lists["test" if part == "train"
                                                                                           else "train"][0])]
        (raw / f"clipart_{part}.txt").write_text("\n".join([other, *lines]) + "\n")
    data = tmp_path / "data"
    with pytest.warns(UserWarning, match="official train/test split"):
        prepare.prepare_domainnet(data, raw_dir=raw, download=False, progress=False, size=SIZE, domains=["clipart"])
    train, test = load_domain(f"domainnet/clipart@{SIZE}", data_dir=data).parts()
    assert len(train) == 5 and len(test) == 12
    assert [DOMAINNET.classes[i] for i in train.y.tolist()] == lists["test"][1]
    assert "official train/test split" in _manifest(data)[f"domainnet_clipart_{SIZE}"]["source"]
    (raw / "clipart_test.txt").write_text("just-a-name 3\n")
    with pytest.raises(DataError, match="clipart_test.txt is not '<domain>/<class>/<image> <label>'"):
        prepare.prepare_domainnet(tmp_path / "d2", raw_dir=raw, download=False, progress=False, size=SIZE,
                                  domains=["clipart"])


def test_domainnet_lists_that_cannot_be_fetched_fall_back_only_to_the_official_split_files(tmp_path, monkeypatch):
    """FedBN's domainnet_dataset.zip unreachable (HTTP 404 here): the official <domain>_train.txt / _test.txt
    give the split, with a warning; without them the run stops rather than invent test sets, and says what to do."""
    raw = tmp_path / "raw"
    lists = _domainnet_zips(raw, np.random.default_rng(6))
    (raw / "domainnet_dataset.zip").unlink()
    served = tmp_path / "served"
    served.mkdir()
    with serve_folder(served) as server:
        gone = RawFile(server.url("domainnet_dataset.zip"), "domainnet_dataset.zip")
        monkeypatch.setitem(prepare.DOMAINNET_SOURCES, "lists", gone)
        with pytest.raises(DataError) as stop:
            prepare.prepare_domainnet(tmp_path / "d1", raw_dir=raw, progress=False, size=SIZE, domains=["clipart"])
        message = str(stop.value)
        for needed in ("domainnet_dataset.zip", gone.url, str(raw), "clipart_train.txt, clipart_test.txt",
                       "--no-download", "HTTP 404"):
            assert needed in message
        assert not (tmp_path / "d1" / f"domainnet/clipart_{SIZE}.npz").exists()

        for part, (paths, _) in lists.items():
            (raw / f"clipart_{part}.txt").write_text("".join(f"{p.removeprefix('DomainNet/')} {i}\n"
                                                             for i, p in enumerate(paths)))
        data = tmp_path / "data"
        with pytest.warns(UserWarning) as caught:
            prepare.prepare_domainnet(data, raw_dir=raw, progress=False, size=SIZE, domains=["clipart"])
        said = " | ".join(str(w.message) for w in caught)
        assert "could not be fetched" in said and "official train/test split" in said
        assert [e["path"] for e in server.log] == ["/domainnet_dataset.zip"] * 2
    train, test = load_domain(f"domainnet/clipart@{SIZE}", data_dir=data).parts()
    assert [DOMAINNET.classes[i] for i in train.y.tolist()] == lists["train"][1]
    assert [DOMAINNET.classes[i] for i in test.y.tolist()] == lists["test"][1]
    assert "official train/test split" in _manifest(data)[f"domainnet_clipart_{SIZE}"]["source"]


def test_domainnet_protocol_fractions_and_missing_zip_download(tmp_path, monkeypatch):
    raw = tmp_path / "raw"
    _domainnet_zips(raw, np.random.default_rng(4), "sketch", n_train=220, n_test=4)
    served = tmp_path / "served"
    served.mkdir()
    (raw / "sketch.zip").rename(served / "sketch.zip")
    with serve_folder(served) as server:
        monkeypatch.setitem(prepare.DOMAINNET_SOURCES, "sketch", RawFile(server.url("sketch.zip"), "sketch.zip"))
        data = tmp_path / "data"
        prepare.prepare_domainnet(data, raw_dir=raw, progress=False, size=SIZE, domains=["sketch"])
        assert [e["path"] for e in server.log] == ["/sketch.zip"]
    clients = build_clients([f"domainnet/sketch@{SIZE}"], data_dir=data, percent=1.0)
    # DomainNet: train on the first int(0.05 * 220) = 11, validate on the last 11.
    assert clients[0].num_train == 11 and len(clients[0].val) == 11 and len(clients[0].test) == 4


# --- the object protocol ---------------------------------------------------------------------------


def _split(n: int, seed: int = 0) -> Split:
    g = torch.Generator().manual_seed(seed)
    return Split(torch.randint(0, 256, (n, 3, 4, 4), generator=g, dtype=torch.uint8), torch.arange(n) % 10)


def test_object_protocol_official_sizes():
    """The datasets' own fractions at their real smallest train lists (125 images in Office-Caltech10's, 2,105 in
    DomainNet's top-10 classes) give the paper's sizes."""
    from fednorm.data.objects import DOMAINNET, OFFICE_CALTECH10

    train, test = _split(157), _split(40, 1)
    # FedBN's Office-Caltech10: 62 training samples per client (paper Sec. 5.2), validation the last int(0.4 * 125)
    [c] = fedbn_object_clients("dslr", train, test, min_train_len=125, train_fraction=OFFICE_CALTECH10.train_fraction,
                               val_fraction=OFFICE_CALTECH10.val_fraction)
    assert c.num_train == 62 and torch.equal(c.train.x, train.x[:62])
    assert len(c.val) == 50 and torch.equal(c.val.x, train.x[-50:]) and c.test is test
    # DomainNet: 105 per client, and as many for validation.
    [d] = fedbn_object_clients("real", _split(3000), test, min_train_len=2105, train_fraction=DOMAINNET.train_fraction,
                               val_fraction=DOMAINNET.val_fraction)
    assert d.num_train == 105 and len(d.val) == 105


def test_object_classes_are_fedbns_label_dicts_in_their_order():
    """The label of each class is its position in FedBN's code's label_dict (fedbn.md 4.2-4.3): another order or
    name would relabel or drop a class."""
    from fednorm.data.objects import DOMAINNET, OFFICE_CALTECH10

    assert OFFICE_CALTECH10.classes == ("back_pack", "bike", "calculator", "headphones", "keyboard",
                                        "laptop_computer", "monitor", "mouse", "mug", "projector")
    assert DOMAINNET.classes == ("bird", "feather", "headphones", "ice_cream", "teapot", "tiger", "whale", "windmill",
                                 "wine_glass", "zebra")


def test_object_protocol_partitions_and_even():
    train, test = _split(125), _split(10)
    halves = fedbn_object_clients("dslr", train, test, min_train_len=125, train_fraction=0.5, val_fraction=0.4,
                                  percent=0.5, clients_per_domain=2)
    assert [c.name for c in halves] == ["dslr-1", "dslr-2"] and [c.num_train for c in halves] == [31, 31]
    assert halves[0].meta["train_pool_range"] == (0, 31) and halves[1].meta["train_pool_range"] == (31, 62)
    assert fedbn_object_clients("dslr", train, test, min_train_len=125, train_fraction=0.5, val_fraction=0.4,
                                percent=0.1)[0].num_train == 6  # a tenth of the pool
    even = fedbn_object_clients("dslr", train, test, min_train_len=125, train_fraction=0.5, val_fraction=0.4,
                                percent=1.0, clients_per_domain=5, partition="even")
    assert [c.num_train for c in even] == [12, 12, 13, 12, 13]
    with pytest.raises(ValueError, match="clients_per_domain <= 1"):
        fedbn_object_clients("dslr", train, test, min_train_len=125, train_fraction=0.5, val_fraction=0.4,
                             percent=1.0, clients_per_domain=2)
    with pytest.raises(ValueError, match="0 samples"):
        fedbn_object_clients("dslr", train, test, min_train_len=12, train_fraction=0.05, val_fraction=0.05)


def test_command_line_prepares_office(office_raw, tmp_path):
    from typer.testing import CliRunner

    from fednorm.cli.main import app

    raw, _ = office_raw
    data = tmp_path / "data"
    result = CliRunner().invoke(app, ["data", "prepare", "office_caltech10", "--data-dir", str(data), "--raw-dir",
                                      str(raw), "--size", str(SIZE), "--domains", "dslr,webcam", "--no-download",
                                      "--quiet"])
    assert result.exit_code == 0, result.output
    assert result.output.count("wrote") == 2
    assert load_domain(f"office_caltech10/webcam@{SIZE}", data_dir=data).train.x.shape == (28, 3, SIZE, SIZE)


def test_the_office_presets_build_fedbns_protocol_at_256(office_raw, tmp_path):
    """fedbn_office / fedwon_office (FedBN and FedWon Table 1): FedBN's lists at 256 x 256, each client trains on
    the first int(0.5 m) of its train list and validates on the last int(0.4 m), with the code's augmentation; the
    paper's columns are the clients' names."""
    from fednorm.runs.config import load_config
    from fednorm.runs.runner import build_federation_data

    raw, _ = office_raw
    data = tmp_path / "data"
    prepare.prepare_office_caltech10(data, raw_dir=raw, download=False, progress=False, size=256)
    for name in ("fedbn_office", "fedwon_office"):
        cfg = load_config(name)
        clients = build_federation_data(cfg, data)
        assert [c.name for c in clients] == [f"office_caltech10/{d}@256" for d in OFFICE_CALTECH10.domains]
        assert all(c.train.x.shape[1:] == (3, 256, 256) for c in clients)
        assert [(c.num_train, len(c.val)) for c in clients] == [(12, 9)] * 4  # m = 24 (dslr's train list)
        assert cfg.training.augment == "fedbn_objects"
        for row in cfg.paper.values():
            assert set(row) == {c.name for c in clients}


def test_fedwon_table12_preset_runs_webcam_as_an_unseen_client_under_the_papers_columns(office_raw, tmp_path):
    """fedwon_office_unseen (FedWon Table 12) on a prepared Office folder: Amazon, Caltech and DSLR train, WebCam is
    only scored, and every paper number of the preset lands on a column the run reports."""
    from fednorm.runs.config import load_config
    from fednorm.runs.runner import start_run

    raw, _ = office_raw
    data = tmp_path / "data"
    prepare.prepare_office_caltech10(data, raw_dir=raw, download=False, progress=False, size=256)
    cfg = load_config("fedwon_office_unseen", ["methods=[fedavg_nobn, fedbn]", "seeds=[0]", "federation.rounds=1",
                                               "model.width=0.125", f"data.data_dir={data}"])
    results = start_run(cfg, tmp_path / "run", data_dir=str(data))
    webcam = "office_caltech10/webcam@256"
    for r in results:
        columns = {c["name"]: c for c in r.summary["clients"]}
        assert [n for n, c in columns.items() if not c.get("external")] == [
            f"office_caltech10/{d}@256" for d in ("amazon", "caltech", "dslr")]
        assert set(cfg.paper[r.label]) <= set(columns)
        assert columns[f"{webcam}:global"]["external"]
    scored = {r.label: [c["name"] for c in r.summary["clients"] if c["name"].startswith(webcam) and "test" in c]
              for r in results}
    # FedAvg w/o BN has no BN: only the global model is scored (its BN-average columns stay empty); FedBN gets the
    # three readings
    assert scored == {"fedavg_nobn": [f"{webcam}:global"],
                      "fedbn": [f"{webcam}:global", f"{webcam}:fedbn_average", f"{webcam}:bn_average"]}
