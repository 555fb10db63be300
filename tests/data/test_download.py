"""Resumable checked download (fednorm.data.download) against a localhost server: no network."""

from __future__ import annotations

import hashlib

import pytest

from fednorm.data.domain import DataError
from fednorm.data.download import download, md5_of, sha256_of

from .local_http import serve_folder

PAYLOAD = bytes(range(256)) * 1000 + b"tail"  # 256,004 bytes: several read chunks


@pytest.fixture()
def server(tmp_path):
    root = tmp_path / "served"
    root.mkdir()
    (root / "file.bin").write_bytes(PAYLOAD)
    with serve_folder(root) as state:
        yield state


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_digest_helpers(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(PAYLOAD)
    assert sha256_of(path) == _sha(PAYLOAD)
    assert md5_of(path) == hashlib.md5(PAYLOAD).hexdigest()


def test_full_download_with_correct_sha(server, tmp_path):
    dest = tmp_path / "out" / "file.bin"
    assert download(server.url("file.bin"), dest, _sha(PAYLOAD), progress=True) == dest
    assert dest.read_bytes() == PAYLOAD
    assert not dest.with_name("file.bin.part").exists()
    assert [(e["range"], e["status"], e["sent"]) for e in server.log] == [(None, 200, len(PAYLOAD))]
    # Already there and matching: kept, no request made.
    download(server.url("file.bin"), dest, _sha(PAYLOAD), progress=False)
    assert len(server.log) == 1


def test_md5_verified_when_only_md5_is_known(server, tmp_path):
    dest = tmp_path / "file.bin"
    download(server.url("file.bin"), dest, None, progress=False, md5=hashlib.md5(PAYLOAD).hexdigest())
    assert dest.read_bytes() == PAYLOAD
    with pytest.raises(DataError, match="expected md5"):
        download(server.url("file.bin"), tmp_path / "other.bin", None, progress=False, md5="0" * 32)


def test_resume_requests_only_the_remainder(server, tmp_path):
    dest = tmp_path / "file.bin"
    done = 100_000
    dest.with_name("file.bin.part").write_bytes(PAYLOAD[:done])
    download(server.url("file.bin"), dest, _sha(PAYLOAD), progress=False)
    assert dest.read_bytes() == PAYLOAD
    (req,) = server.log
    assert req["range"] == f"bytes={done}-" and req["status"] == 206
    assert req["sent"] == len(PAYLOAD) - done


def test_resume_restarts_when_server_ignores_range(server, tmp_path):
    server.support_range = False
    dest = tmp_path / "file.bin"
    dest.with_name("file.bin.part").write_bytes(b"x" * 5000)  # would corrupt the file if appended to
    download(server.url("file.bin"), dest, _sha(PAYLOAD), progress=False)
    assert dest.read_bytes() == PAYLOAD
    assert [(e["range"], e["status"]) for e in server.log] == [("bytes=5000-", 200)]


def test_interrupted_download_keeps_part_then_resumes(server, tmp_path):
    dest = tmp_path / "file.bin"
    part = dest.with_name("file.bin.part")
    server.cut_after = 70_000
    with pytest.raises(DataError, match="ended after 70000 of 256004 bytes") as info:
        download(server.url("file.bin"), dest, _sha(PAYLOAD), progress=False)
    assert "resume" in str(info.value)
    assert part.read_bytes() == PAYLOAD[:70_000] and not dest.exists()
    server.cut_after = None
    download(server.url("file.bin"), dest, _sha(PAYLOAD), progress=False)
    assert dest.read_bytes() == PAYLOAD
    assert server.log[-1]["range"] == "bytes=70000-" and server.log[-1]["sent"] == len(PAYLOAD) - 70_000


def test_oversized_part_restarts_after_416(server, tmp_path):
    dest = tmp_path / "file.bin"
    dest.with_name("file.bin.part").write_bytes(b"y" * (len(PAYLOAD) + 10))
    download(server.url("file.bin"), dest, _sha(PAYLOAD), progress=False)
    assert dest.read_bytes() == PAYLOAD
    assert [e["status"] for e in server.log] == [416, 200]


def test_whole_part_is_finished_without_downloading_again(server, tmp_path):
    """A run stopped between the last write and the rename: the server's 416 says the .part is whole."""
    dest = tmp_path / "file.bin"
    dest.with_name("file.bin.part").write_bytes(PAYLOAD)
    download(server.url("file.bin"), dest, _sha(PAYLOAD), progress=False)
    assert dest.read_bytes() == PAYLOAD and not dest.with_name("file.bin.part").exists()
    assert [e["status"] for e in server.log] == [416]


def test_chunked_response_cut_short_keeps_part_then_resumes(server, tmp_path):
    """http.client raises IncompleteRead (not an OSError) when a chunked body ends early."""
    dest = tmp_path / "file.bin"
    server.chunked, server.cut_after = True, 70_000
    with pytest.raises(DataError, match="interrupted .* kept: run again to resume"):
        download(server.url("file.bin"), dest, _sha(PAYLOAD), progress=False)
    assert 0 < dest.with_name("file.bin.part").stat().st_size <= 70_000
    server.cut_after = None
    download(server.url("file.bin"), dest, _sha(PAYLOAD), progress=False)
    assert dest.read_bytes() == PAYLOAD and server.log[-1]["status"] == 206


def test_sha_mismatch_deletes_download_and_names_everything(server, tmp_path):
    dest = tmp_path / "file.bin"
    wrong = "ab" * 32
    with pytest.raises(DataError) as info:
        download(server.url("file.bin"), dest, wrong, progress=False)
    msg = str(info.value)
    assert "file.bin" in msg and wrong in msg and _sha(PAYLOAD) in msg
    assert server.url("file.bin") in msg and "Run again" in msg
    assert not dest.exists() and not dest.with_name("file.bin.part").exists()
    assert list(tmp_path.iterdir()) == [tmp_path / "served"]


def test_existing_wrong_file_is_reported_not_deleted(server, tmp_path):
    dest = tmp_path / "file.bin"
    dest.write_bytes(b"not it")
    with pytest.raises(DataError, match="Checksum mismatch") as info:
        download(server.url("file.bin"), dest, _sha(PAYLOAD), progress=False)
    assert str(dest) in str(info.value)
    assert dest.read_bytes() == b"not it" and server.log == []


def test_404_names_the_url(server, tmp_path):
    url = server.url("missing.mat")
    with pytest.raises(DataError, match="HTTP 404") as info:
        download(url, tmp_path / "missing.mat", None, progress=False)
    assert url in str(info.value)
    assert not (tmp_path / "missing.mat").exists() and not (tmp_path / "missing.mat.part").exists()


def test_unreachable_host_is_a_data_error(tmp_path):
    with serve_folder(tmp_path) as state:
        url = state.url("x.bin")
    # The server is shut down: the port refuses connections.
    with pytest.raises(DataError, match="Cannot download") as info:
        download(url, tmp_path / "x.bin", None, progress=False, timeout=5)
    assert url in str(info.value)
