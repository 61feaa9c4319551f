"""Tests of lsdl_lab.data.files: verified, atomic downloads and the records that describe them.

Nothing here touches the network: downloads use file:// URLs or a patched urlopen.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from lsdl_lab.data import files as F


def _digests(payload: bytes) -> dict:
    return {
        "md5": hashlib.md5(payload).hexdigest(),
        "sha256": hashlib.sha256(payload).hexdigest(),
        "size": len(payload),
    }


@pytest.fixture
def remote(tmp_path):
    """A file served through a file:// URL, and the digests it must match."""
    payload = os.urandom(3 << 20)  # several chunks of the 1 MiB read size
    src = tmp_path / "remote" / "blob.bin"
    src.parent.mkdir()
    src.write_bytes(payload)
    return src.as_uri(), payload


def _parts(directory: Path) -> list[Path]:
    return list(directory.glob("*.part"))


# -- download and verify -----------------------------------------------------------------


def test_download_writes_verified_file(tmp_path, remote):
    url, payload = remote
    dest = tmp_path / "cache" / "blob.bin"
    assert F.download(url, dest, **_digests(payload), progress=False) == dest
    assert dest.read_bytes() == payload
    assert not _parts(dest.parent)


def test_download_wrong_checksum_leaves_nothing(tmp_path, remote):
    url, payload = remote
    dest = tmp_path / "blob.bin"
    wrong = "0" * 64
    with pytest.raises(F.DataIntegrityError) as err:
        F.download(url, dest, sha256=wrong, progress=False)
    message = str(err.value)
    assert url in message and wrong in message and hashlib.sha256(payload).hexdigest() in message
    assert str(dest) in message
    assert not dest.exists() and not _parts(tmp_path)


def test_download_wrong_size_leaves_nothing(tmp_path, remote):
    url, payload = remote
    dest = tmp_path / "blob.bin"
    with pytest.raises(F.DataIntegrityError, match=f"size {len(payload)} bytes"):
        F.download(url, dest, size=len(payload) + 1, progress=False)
    assert not dest.exists()


def _fail_urlopen(*args, **kwargs):
    raise urllib.error.URLError("no network in this test")


def test_existing_valid_file_is_not_downloaded(tmp_path, remote, monkeypatch):
    url, payload = remote
    dest = tmp_path / "blob.bin"
    dest.write_bytes(payload)
    monkeypatch.setattr(urllib.request, "urlopen", _fail_urlopen)
    assert F.download(url, dest, **_digests(payload), progress=False) == dest


def test_existing_bad_file_is_replaced(tmp_path, remote):
    url, payload = remote
    dest = tmp_path / "blob.bin"
    dest.write_bytes(payload[:100])
    with pytest.warns(UserWarning, match="fails verification"):
        F.download(url, dest, **_digests(payload), progress=False)
    assert dest.read_bytes() == payload


def test_download_failure_says_where_to_put_the_file(tmp_path):
    dest = tmp_path / "blob.bin"
    missing = (tmp_path / "nowhere.bin").as_uri()
    with pytest.raises(RuntimeError, match="place it at") as err:
        F.download(missing, dest, md5="0" * 32, progress=False)
    assert str(dest) in str(err.value) and not dest.exists()


class _BrokenStream(io.BytesIO):
    """A response that delivers some bytes, then loses the connection."""

    headers: dict = {}

    def read(self, n=-1):
        if self.tell() >= 1 << 20:
            raise ConnectionResetError("connection lost")
        return super().read(n)


def test_download_killed_midway_leaves_no_file(tmp_path, remote, monkeypatch):
    url, payload = remote
    dest = tmp_path / "blob.bin"
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: _BrokenStream(payload))
    with pytest.raises(RuntimeError, match="connection lost"):
        F.download(url, dest, **_digests(payload), progress=False)
    assert not dest.exists() and not _parts(tmp_path)


def test_stale_part_is_never_loaded_and_is_cleaned(tmp_path, remote, monkeypatch):
    url, payload = remote
    dest = tmp_path / "blob.bin"
    stale = tmp_path / "blob.bin.killed.part"
    stale.write_bytes(payload)  # even complete, a part file is not the file
    fresh = tmp_path / "blob.bin.running.part"  # another process, still downloading
    fresh.write_bytes(b"")
    old = time.time() - 2 * F.STALE_PART_SECONDS
    os.utime(stale, (old, old))
    with monkeypatch.context() as m:
        m.setattr(urllib.request, "urlopen", _fail_urlopen)
        with pytest.raises(RuntimeError):
            F.download(url, dest, **_digests(payload), progress=False)
    assert not dest.exists()
    F.download(url, dest, **_digests(payload), progress=False)
    assert not stale.exists() and fresh.exists()


def test_download_progress_must_be_a_bool(tmp_path, remote):
    url, payload = remote
    with pytest.raises(TypeError, match="Invalid progress: 0 "):
        F.download(url, tmp_path / "blob.bin", **_digests(payload), progress=0)


def test_verify(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"abc")
    F.verify(path, **_digests(b"abc"))
    with pytest.raises(F.DataIntegrityError, match=f"Delete {re.escape(str(path))}"):
        F.verify(path, md5=hashlib.md5(b"abd").hexdigest())
    with pytest.raises(FileNotFoundError):
        F.verify(tmp_path / "missing")


# -- records and fetch -------------------------------------------------------------------


def test_registry_holds_the_published_checksums():
    cifar, shakespeare = F.REMOTE_FILES["cifar10"], F.REMOTE_FILES["tiny_shakespeare"]
    assert cifar.md5 == "c58f30108f718f92721af3b95e74349a" and cifar.size == 170_498_071
    assert cifar.url == "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
    assert shakespeare.size == 1_115_394
    assert shakespeare.sha256 == "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
    assert cifar.path() == F.DEFAULT_ROOT / "cifar-10-python.tar.gz"
    assert cifar.path("/some/root") == Path("/some/root/cifar-10-python.tar.gz")
    with pytest.raises(AttributeError):  # frozen: a record is replaced, never edited
        cifar.md5 = "0" * 32


def test_fetch_downloads_once_then_verifies_offline(tmp_path, record_of, monkeypatch):
    server = tmp_path / "server" / "input.txt"
    server.parent.mkdir()
    server.write_bytes(os.urandom(5000))
    record = record_of(server, filename="saved.txt")
    root = tmp_path / "root"
    with pytest.raises(FileNotFoundError, match=f"No {record.title} at .*download=False"):
        F.fetch(record, root, download=False)
    assert F.fetch(record, root, progress=False) == root / "saved.txt"
    assert (root / "saved.txt").read_bytes() == server.read_bytes()
    monkeypatch.setattr(urllib.request, "urlopen", _fail_urlopen)
    assert F.fetch(record, root, download=False) == root / "saved.txt"
    assert F.fetch(record, root) == root / "saved.txt"  # there and valid: nothing fetched


def test_a_record_with_a_wrong_checksum_fails_verification(tmp_path, record_of):
    path = tmp_path / "blob.bin"
    path.write_bytes(b"the real bytes")
    for wrong in ({"md5": "0" * 32}, {"sha256": "f" * 64}, {"size": 3}):
        record = record_of(path, **wrong)
        with pytest.raises(F.DataIntegrityError, match="Delete"):
            F.fetch(record, tmp_path, download=False)
        root = tmp_path / "fresh"
        with pytest.raises(F.DataIntegrityError, match="nothing was saved"):
            F.fetch(record, root, progress=False)
        assert not record.path(root).exists()


@pytest.mark.parametrize(
    "changes, error, match",
    [
        ({"md5": None, "sha256": None}, ValueError, "Invalid md5, sha256 of blob.bin: None, None"),
        ({"filename": "sub/blob.bin"}, ValueError, "Invalid filename: 'sub/blob.bin'"),
        ({"size": -1}, ValueError, "Invalid size: -1"),
        ({"size": True}, TypeError, "Invalid size: True"),
    ],
)
def test_bad_records_are_refused(tmp_path, record_of, changes, error, match):
    path = tmp_path / "blob.bin"
    path.write_bytes(b"x")
    with pytest.raises(error, match=match):
        record_of(path, **changes)


def test_fetch_bad_arguments(tmp_path, record_of):
    path = tmp_path / "blob.bin"
    path.write_bytes(b"x")
    with pytest.raises(TypeError, match="Invalid download: 'no' "):
        F.fetch(record_of(path), tmp_path, download="no")
    with pytest.raises(TypeError, match="Invalid remote: .*RemoteFile"):
        F.fetch(path.as_uri(), tmp_path)
