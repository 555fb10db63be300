"""Resumable, checksum-verified download of one official dataset file.

:func:`download` streams a URL into ``dest.part`` with :mod:`urllib`, resumes an existing partial
``.part`` with an HTTP ``Range`` request when the server honours it (restarts from zero when it does
not, and finishes a ``.part`` the server's 416 says is already whole), shows a rich progress bar, checks the sha256 and/or md5 the caller knows, and only then
renames the file to ``dest`` atomically. A file at ``dest`` therefore always passed its checks. Every
failure is a :class:`DataError` that names the URL or file and says how to fix it.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from fednorm.data.domain import DataError

_CHUNK = 1 << 16
_HASH_CHUNK = 1 << 20
_USER_AGENT = "fednorm-data-downloader"
_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")


def _digest(path: Path, algorithm: str) -> str:
    h = hashlib.new(algorithm)
    with Path(path).open("rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_of(path: str | Path) -> str:
    """Hex sha256 of a file, read in 1 MB chunks (files can be gigabytes)."""
    return _digest(Path(path), "sha256")


def md5_of(path: str | Path) -> str:
    """Hex md5 of a file: what torchvision publishes for SVHN and CIFAR-10 (no sha256 is known)."""
    return _digest(Path(path), "md5")


def _mismatch(path: Path, sha256: str | None, md5: str | None) -> tuple[str, str, str] | None:
    """(algorithm, expected, actual) of the first failing known digest, else None."""
    for algorithm, expected in (("sha256", sha256), ("md5", md5)):
        if expected:
            actual = _digest(path, algorithm)
            if actual != expected.lower():
                return algorithm, expected.lower(), actual
    return None


def verify_file(path: str | Path, *, sha256: str | None = None, md5: str | None = None) -> None:
    """Raise :class:`DataError` if ``path`` does not match the known digests (None = not known)."""
    path = Path(path)
    bad = _mismatch(path, sha256, md5)
    if bad is not None:
        algorithm, expected, actual = bad
        raise DataError(
            f"Checksum mismatch for {path}: expected {algorithm} {expected}, got {actual}. "
            f"The file is corrupt, truncated or not the official one. Delete it and download it "
            f"again from the official source."
        )


@dataclass
class _RangeRefused:
    """The server's 416 to a resume: ``total`` is the file's size from ``Content-Range: bytes */N``."""

    total: int | None


def _open(url: str, start: int, timeout: float):
    """The response, or :class:`_RangeRefused` when a resume from ``start`` is refused (416)."""
    headers = {"User-Agent": _USER_AGENT}
    if start > 0:
        headers["Range"] = f"bytes={start}-"
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and start > 0:  # the .part is already whole, or not a prefix the server knows
            match = re.fullmatch(r"bytes\s+\*/(\d+)", (exc.headers or {}).get("Content-Range", "").strip())
            return _RangeRefused(int(match.group(1)) if match else None)
        raise DataError(
            f"Download of {url} failed: HTTP {exc.code} {exc.reason}. Check that the URL is still "
            f"the official one, or download the file by hand and put it where it is expected."
        ) from exc
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", exc)
        raise DataError(
            f"Cannot download {url}: {reason}. This needs network access; without it, download "
            f"the file elsewhere and put it where it is expected."
        ) from exc


def _progress(enabled: bool):
    if not enabled:
        return None
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )


def download(
    url: str,
    dest: str | Path,
    sha256: str | None,
    progress: bool = True,
    *,
    md5: str | None = None,
    timeout: float = 60.0,
) -> Path:
    """Download ``url`` to ``dest`` and return ``dest``; the digests given (None = unknown) must match.

    An existing ``dest`` is checked against the digests and kept (no network is used); if it does
    not match, :class:`DataError` asks to delete it (a file the user placed is never deleted here).
    A leftover ``dest.part`` is resumed with ``Range: bytes=<size>-``; a server answering 200
    instead of 206 is downloaded again from the start. A connection that ends early keeps the
    ``.part`` for the next call to resume. A digest mismatch deletes the ``.part``.
    """
    dest = Path(dest)
    if dest.is_file():
        verify_file(dest, sha256=sha256, md5=md5)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    start = part.stat().st_size if part.is_file() else 0

    response = _open(url, start, timeout)
    if isinstance(response, _RangeRefused):
        if response.total == start:  # the .part is whole: an earlier run stopped before its rename
            return _finish(part, dest, url, sha256, md5)
        part.unlink(missing_ok=True)  # not a prefix of the server's file: start again from nothing
        start = 0
        response = _open(url, 0, timeout)
    with response:
        total: int | None = None
        if start > 0 and response.status == 206:
            match = _CONTENT_RANGE.match(response.headers.get("Content-Range", ""))
            if match is None or int(match.group(1)) != start:
                raise DataError(
                    f"Download of {url} failed: the server resumed at an unexpected offset "
                    f"(Content-Range {response.headers.get('Content-Range')!r}, wanted byte {start}). "
                    f"Delete {part} and run again."
                )
            if match.group(3) != "*":
                total = int(match.group(3))
            mode = "ab"
        else:  # 200: a fresh download, or a server that ignores Range
            start = 0
            mode = "wb"
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit():
                total = int(length)
        done = start
        bar = _progress(progress)
        try:
            if bar is not None:
                bar.start()
                task = bar.add_task(dest.name, total=total, completed=start)
            with part.open(mode) as fh:
                while chunk := response.read(_CHUNK):
                    fh.write(chunk)
                    done += len(chunk)
                    if bar is not None:
                        bar.update(task, completed=done)
        except (OSError, http.client.HTTPException) as exc:  # IncompleteRead: a chunked reply cut short
            raise DataError(
                f"Download of {url} was interrupted after {done} bytes ({exc}). "
                f"The partial file {part} is kept: run again to resume."
            ) from exc
        finally:
            if bar is not None:
                bar.stop()
    if total is not None and done != total:
        raise DataError(
            f"Download of {url} ended after {done} of {total} bytes. "
            f"The partial file {part} is kept: run again to resume."
        )
    return _finish(part, dest, url, sha256, md5)


def _finish(part: Path, dest: Path, url: str, sha256: str | None, md5: str | None) -> Path:
    """Check the whole ``.part`` against the known digests, then rename it to ``dest``."""
    bad = _mismatch(part, sha256, md5)
    if bad is not None:
        algorithm, expected, actual = bad
        part.unlink(missing_ok=True)
        raise DataError(
            f"Checksum mismatch for {dest.name} downloaded from {url}: expected {algorithm} "
            f"{expected}, got {actual}. The download was deleted. Run again to download it afresh; "
            f"if it keeps failing, the server's file has changed: get the official file by hand."
        )
    os.replace(part, dest)
    return dest
