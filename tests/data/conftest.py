"""Shared by the data tests: a RemoteFile record describing a file the test made itself, so
the loaders' real download and verification code runs with nothing fetched from the
network (a file:// URL)."""

import hashlib
from pathlib import Path

import pytest

from lsdl_lab.data import RemoteFile


def _record_of(path: Path, filename: str | None = None, **changes) -> RemoteFile:
    payload = Path(path).read_bytes()
    fields = {
        "title": f"test file {Path(path).name}",
        "url": Path(path).as_uri(),
        "filename": filename or Path(path).name,
        "size": len(payload),
        "md5": hashlib.md5(payload).hexdigest(),
        "sha256": hashlib.sha256(payload).hexdigest(),
    }
    return RemoteFile(**{**fields, **changes})


@pytest.fixture
def record_of():
    """``record_of(path, filename=None, **changes)``: the record of the file at ``path``
    (served from its file:// URL, saved as ``filename``), with ``changes`` to its fields."""
    return _record_of
