"""Data folder resolution and checked npz loading (fednorm.data.datafolder)."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import numpy as np
import platformdirs
import pytest

from fednorm.data import datafolder
from fednorm.data.datafolder import ENV_VAR, load_npz, resolve_data_dir
from fednorm.data.domain import DataError, DataWarning

from ..conftest import real_data_dir, write_data_folder

REAL_DIGIT_FILES = ["digits/mnist.npz", "digits/mnistm.npz", "digits/usps.npz", "digits/semeion.npz"]






def _arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x_train": rng.integers(0, 256, size=(6, 16, 16), dtype=np.uint8),
        "y_train": rng.integers(0, 10, size=6, dtype=np.uint8),
    }


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# --- resolve_data_dir ------------------------------------------------------------------------


def test_resolve_explicit_beats_env(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "from_env"))
    assert resolve_data_dir(tmp_path / "explicit") == tmp_path / "explicit"
    assert resolve_data_dir(str(tmp_path / "explicit")) == tmp_path / "explicit"


def test_resolve_env_beats_default(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "from_env"))
    assert resolve_data_dir() == tmp_path / "from_env"
    assert resolve_data_dir(None) == tmp_path / "from_env"


def test_resolve_default_is_user_cache(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_data_dir() == Path(platformdirs.user_cache_dir("fednorm"))
    monkeypatch.setenv(ENV_VAR, "")  # an empty variable counts as unset
    assert resolve_data_dir() == Path(platformdirs.user_cache_dir("fednorm"))


def test_resolve_creates_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "nowhere"))
    resolve_data_dir()
    assert not (tmp_path / "nowhere").exists()


# --- load_npz --------------------------------------------------------------------------------


def test_listed_file_is_verified_and_loaded(tmp_path, monkeypatch):
    arrays = _arrays()
    root = write_data_folder(tmp_path, {"digits/a.npz": arrays})
    hashed = []
    real_sha = datafolder.sha256_of
    monkeypatch.setattr(datafolder, "sha256_of", lambda p: hashed.append(p) or real_sha(p))

    out = load_npz(root, "digits/a.npz")
    assert set(out) == {"x_train", "y_train"}
    np.testing.assert_array_equal(out["x_train"], arrays["x_train"])
    np.testing.assert_array_equal(out["y_train"], arrays["y_train"])
    assert hashed == [root / "digits/a.npz"]

    load_npz(root, "digits/a.npz")  # unchanged file: the verification is memoized
    assert len(hashed) == 1


def test_changed_file_is_rehashed_and_rejected(tmp_path):
    root = write_data_folder(tmp_path, {"digits/a.npz": _arrays()})
    path = root / "digits/a.npz"
    load_npz(root, "digits/a.npz")
    stat = path.stat()
    _flip_byte(path, stat.st_size // 2)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(DataError, match="Checksum mismatch"):
        load_npz(root, "digits/a.npz")


def test_corrupted_file_names_file_checksums_and_fix(tmp_path):
    root = write_data_folder(tmp_path, {"digits/a.npz": _arrays()})
    path = root / "digits/a.npz"
    expected = json.loads((root / "manifest.json").read_text())["a"]["sha256"]
    _flip_byte(path, 40)  # same size, different content
    actual = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(DataError) as info:
        load_npz(root, "digits/a.npz")
    msg = str(info.value)
    assert str(path) in msg
    assert expected in msg and actual in msg
    assert "--data-dir" in msg and ENV_VAR in msg and "re-copy" in msg


def test_wrong_size_is_rejected_before_hashing(tmp_path, monkeypatch):
    root = write_data_folder(tmp_path, {"digits/a.npz": _arrays()})
    path = root / "digits/a.npz"
    path.write_bytes(path.read_bytes()[:-10])
    monkeypatch.setattr(datafolder, "sha256_of", lambda p: pytest.fail("hashed a truncated file"))
    with pytest.raises(DataError, match="wrong size") as info:
        load_npz(root, "digits/a.npz")
    assert str(path) in str(info.value)
    # the folder holds the file, so it is probably the right one: the hint says so, not "pass --data-dir"
    assert f"If {root} is not the data folder you meant, pass --data-dir DIR" in str(info.value)
    assert "in the documented format" not in str(info.value)


def test_missing_file(tmp_path):
    root = write_data_folder(tmp_path, {"digits/a.npz": _arrays()})
    with pytest.raises(DataError, match="missing") as info:
        load_npz(root, "digits/b.npz")
    assert str(root / "digits/b.npz") in str(info.value)
    assert "--data-dir" in str(info.value) and ENV_VAR in str(info.value)


def test_missing_folder(tmp_path):
    with pytest.raises(DataError, match="does not exist") as info:
        load_npz(tmp_path / "absent", "digits/a.npz")
    assert str(tmp_path / "absent") in str(info.value)
    assert "--data-dir" in str(info.value) and ENV_VAR in str(info.value)


def test_unlisted_file_loads_without_manifest(tmp_path):
    arrays = _arrays(1)
    (tmp_path / "digits").mkdir()
    np.savez(tmp_path / "digits/a.npz", **arrays)
    with pytest.warns(DataWarning, match=r"digits/a.npz was read without a size and checksum check: .*manifest.json is missing"):
        out = load_npz(tmp_path, "digits/a.npz")
    np.testing.assert_array_equal(out["x_train"], arrays["x_train"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per file, not on every load
        load_npz(tmp_path, "digits/a.npz")
    root = write_data_folder(tmp_path / "listed", {"digits/a.npz": arrays, "digits/b.npz": arrays}, listed=["digits/a.npz"])
    with pytest.warns(DataWarning, match=r"digits/b.npz was read .*manifest.json lists no such file"):
        load_npz(root, "digits/b.npz")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a listed, checked file: no warning
        load_npz(root, "digits/a.npz")


def test_unreadable_npz(tmp_path):
    (tmp_path / "digits").mkdir()
    (tmp_path / "digits/a.npz").write_bytes(b"this is not a zip archive" * 10)
    with pytest.raises(DataError, match="not a readable npz") as info:
        load_npz(tmp_path, "digits/a.npz")
    assert str(tmp_path / "digits/a.npz") in str(info.value)


def test_missing_array_key_and_key_selection(tmp_path):
    root = write_data_folder(tmp_path, {"digits/a.npz": _arrays()})
    assert set(load_npz(root, "digits/a.npz", keys=["y_train"])) == {"y_train"}
    with pytest.raises(DataError, match="x_test") as info:
        load_npz(root, "digits/a.npz", keys=["x_train", "x_test"])
    assert str(root / "digits/a.npz") in str(info.value)


def test_broken_manifest(tmp_path):
    root = write_data_folder(tmp_path, {"digits/a.npz": _arrays()})
    (root / "manifest.json").write_text("{not json")
    with pytest.raises(DataError, match="manifest") as info:
        load_npz(root, "digits/a.npz")
    assert str(root / "manifest.json") in str(info.value)


# --- real data -------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("relpath", REAL_DIGIT_FILES)
def test_real_digit_files_match_manifest(relpath):
    root = real_data_dir()
    manifest = json.loads((root / "manifest.json").read_text())
    entry = next(e for e in manifest.values() if e["file"] == relpath)
    path = root / relpath
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == entry["sha256"]
    assert path.stat().st_size == entry["bytes"]
    # The loader runs the same check and reads the arrays the manifest lists.
    out = load_npz(root, relpath)
    assert {k: list(v.shape) for k, v in out.items()} == entry["arrays"]
