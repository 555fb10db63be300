"""Where the offline data folder is, and checked reading of the ``.npz`` files inside it.

A data folder holds NumPy ``.npz`` files (``digits/mnist.npz``, ``pacs/pacs64.npz``, ...) and a
``manifest.json`` that lists each file's size and sha256 (format: ``../shared/data/README.md``).
The folder is chosen by :func:`resolve_data_dir` (command-line option, then the ``FEDNORM_DATA``
environment variable, then a per-user cache folder) and every file read goes through
:func:`load_npz`, which checks the file against the manifest before trusting it. A wrong, truncated
or missing file therefore fails at load time with a :class:`DataError` that names the file and says
how to fix it, instead of producing silently wrong results. Nothing here downloads anything.
"""

from __future__ import annotations

import json
import os
import warnings
import zipfile
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import platformdirs

from fednorm.data.domain import DataError, DataWarning
from fednorm.data.download import sha256_of

ENV_VAR = "FEDNORM_DATA"
MANIFEST_NAME = "manifest.json"

_FIX = (
    f"Pass --data-dir DIR or set {ENV_VAR} to a folder in the documented format "
    "(npz files plus manifest.json, e.g. ../shared/data from the project root)"
)


def _other_folder(data_dir: Path) -> str:
    """The hint for a file that is there but damaged: the folder is probably the right one."""
    return f"If {data_dir} is not the data folder you meant, pass --data-dir DIR or set {ENV_VAR}"

# Files whose checksum already matched in this process, keyed by (path, size, mtime_ns, expected
# sha256): a file that has not changed on disk is not hashed again on every load.
_verified: set[tuple[str, int, int, str]] = set()
# Files already warned about as read unchecked in this process (one warning per file, not per load).
_warned_unchecked: set[str] = set()


def is_junk_path(parts: Sequence[str]) -> bool:
    """Files an archiver or OS adds beside the data: macOS ``__MACOSX/`` and ``._x`` AppleDouble
    entries, hidden dot files. Raw-data readers skip them instead of failing to decode them."""
    return "__MACOSX" in parts or parts[-1].startswith(".")


def resolve_data_dir(explicit: str | Path | None = None) -> Path:
    """The data folder: ``explicit`` (the ``--data-dir`` option) if given, else ``$FEDNORM_DATA``
    if set and non-empty, else the per-user cache folder. Nothing is created or checked here."""
    if explicit is not None and str(explicit) != "":
        return Path(explicit).expanduser()
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_cache_dir("fednorm"))


def _manifest_entry(data_dir: Path, relpath: str) -> dict | None:
    """The manifest entry whose ``file`` is ``relpath``, or None when there is no manifest or the
    manifest does not list the file (such a file is read unchecked)."""
    manifest_path = data_dir / MANIFEST_NAME
    if not manifest_path.is_file():
        return None
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(
            f"Cannot read the data manifest {manifest_path}: {exc}. "
            f"Re-copy manifest.json from the data source. {_other_folder(data_dir)}."
        ) from exc
    if not isinstance(manifest, dict):
        raise DataError(
            f"The data manifest {manifest_path} is not a JSON object of file entries. "
            f"Re-copy manifest.json from the data source. {_other_folder(data_dir)}."
        )
    want = Path(relpath).as_posix()
    for entry in manifest.values():
        if isinstance(entry, dict) and Path(str(entry.get("file", ""))).as_posix() == want:
            return entry
    return None


def _redo(data_dir: Path, relpath: str) -> str:
    """How to get ``relpath`` again: its ``fednorm data prepare`` command, or a fresh copy."""
    from .prepare import prepare_command  # prepare reads files through this module

    command = prepare_command(relpath, data_dir)
    return f"Write it again with: {command}" if command else "Re-download or re-copy it from the data source"


def _verify(path: Path, entry: dict, redo: str, data_dir: Path) -> None:
    """Check size then sha256 of ``path`` against its manifest entry (memoized per process)."""
    expected_sha = str(entry.get("sha256", "")).lower()
    expected_size = entry.get("bytes")
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, expected_sha)
    if key in _verified:
        return
    if expected_size is not None and stat.st_size != int(expected_size):
        raise DataError(
            f"Data file {path} has the wrong size: expected {int(expected_size)} bytes (manifest), "
            f"found {stat.st_size}. The file is truncated or not the listed one. {redo}. {_other_folder(data_dir)}."
        )
    if expected_sha:
        actual = sha256_of(path)
        if actual != expected_sha:
            raise DataError(
                f"Checksum mismatch for data file {path}: expected sha256 {expected_sha} "
                f"(manifest), got {actual}. The file is corrupt or not the listed one. "
                f"{redo}. {_other_folder(data_dir)}."
            )
    _verified.add(key)


def load_npz(
    data_dir: Path, relpath: str, *, keys: Sequence[str] | None = None
) -> dict[str, np.ndarray]:
    """Read ``data_dir/relpath`` into a dict of arrays, verifying it against the manifest first.

    If ``data_dir/manifest.json`` lists the file (its ``file`` field equals ``relpath``), the size
    and sha256 must match; a file it does not list loads with a :class:`DataWarning` (once per file).
    ``keys`` restricts loading to those arrays and makes each of them required; without it every
    array of the file is loaded. Pickled arrays are refused.
    """
    data_dir = Path(data_dir)
    path = data_dir / relpath
    if not data_dir.is_dir():
        raise DataError(f"Data folder {data_dir} does not exist, so {path} cannot be read. {_FIX}.")
    if not path.is_file():
        raise DataError(
            f"Data file {path} is missing from the data folder {data_dir}. "
            f"{_redo(data_dir, relpath).replace(' again', '')}. {_FIX}."
        )
    entry = _manifest_entry(data_dir, relpath)
    if entry is not None:
        _verify(path, entry, _redo(data_dir, relpath), data_dir)
    try:
        npz = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(
            f"Data file {path} is not a readable npz archive ({type(exc).__name__}: {exc}). "
            f"{_redo(data_dir, relpath)}. {_other_folder(data_dir)}."
        ) from exc
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise DataError(
            f"Data file {path} holds a single .npy array, not an npz archive of named arrays. "
            f"{_redo(data_dir, relpath)}. {_other_folder(data_dir)}."
        )
    with npz:
        available = list(npz.files)
        wanted = available if keys is None else list(keys)
        missing = [k for k in wanted if k not in available]
        if missing:
            raise DataError(
                f"Data file {path} lacks the array(s) {missing}; it has {available}. "
                f"It is not in the documented format. {_redo(data_dir, relpath)}. {_other_folder(data_dir)}."
            )
        try:
            arrays = {k: npz[k] for k in wanted}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
            raise DataError(
                f"Data file {path} has an unreadable array ({type(exc).__name__}: {exc}). "
                f"{_redo(data_dir, relpath)}. {_other_folder(data_dir)}."
            ) from exc
    if entry is None and str(path.resolve()) not in _warned_unchecked:
        _warned_unchecked.add(str(path.resolve()))
        why = "lists no such file" if (data_dir / MANIFEST_NAME).is_file() else "is missing"
        warnings.warn(
            f"Data file {path} was read without a size and checksum check: {data_dir / MANIFEST_NAME} {why}. "
            "`fednorm data prepare` writes the files it makes into the manifest; for a file made by hand, add its "
            "entry (format: ../shared/data/README.md)", DataWarning, stacklevel=2)
    return arrays


def verify_folder(data_dir: Path) -> list[tuple[str, str]]:
    """Check every file the manifest lists: ``[(file, "ok" | what is wrong)]``, in manifest order."""
    data_dir = Path(data_dir)
    manifest_path = data_dir / MANIFEST_NAME
    if not manifest_path.is_file():
        raise DataError(f"{data_dir} has no {MANIFEST_NAME}, so there is nothing to verify. {_FIX}.")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"Cannot read the data manifest {manifest_path}: {exc}. {_FIX}.") from exc
    report = []
    for entry in manifest.values() if isinstance(manifest, dict) else []:
        if not isinstance(entry, dict) or "file" not in entry:
            continue
        path = data_dir / str(entry["file"])
        if not path.is_file():
            report.append((str(entry["file"]), "missing"))
            continue
        try:
            _verify(path, entry, _redo(data_dir, str(entry["file"])), data_dir)
            report.append((str(entry["file"]), "ok"))
        except DataError as exc:
            report.append((str(entry["file"]), str(exc).split(". ")[0]))
    return report
