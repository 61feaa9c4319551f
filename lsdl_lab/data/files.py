"""Verified downloads: a data file is fetched once, checked, and only then put in place.

Each downloaded data set is described by a small record, a :class:`RemoteFile` (where it
comes from, the name it gets here, its size and published checksum), kept in the registry
:data:`REMOTE_FILES`. A loader takes its record from there unless it is given one, so a
test (or a mirror) passes its own record instead of patching the module.

Downloads are atomic: bytes stream into a ``*.part`` file beside the target, are checked
(size and checksum), and only then renamed into place, so a killed download never leaves
a file that a later run would load. Files live under :data:`DEFAULT_ROOT` (``$LSDL_DATA``
if set, else ``~/.cache/lsdl_lab``). On a machine without internet, put the file at the
path the error message names; it is verified, not downloaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import time
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from .._util import atomic_path, check_bool, check_int

__all__ = [
    "DEFAULT_ROOT",
    "REMOTE_FILES",
    "STALE_PART_SECONDS",
    "DataIntegrityError",
    "RemoteFile",
    "download",
    "fetch",
    "verify",
]

DEFAULT_ROOT = Path(os.environ.get("LSDL_DATA") or Path.home() / ".cache" / "lsdl_lab")

# A part file untouched this long belongs to a killed process, not to a running download.
STALE_PART_SECONDS = 3600.0


class DataIntegrityError(RuntimeError):
    """A data file is not what it should be (size, checksum or format)."""


@dataclass(frozen=True)
class RemoteFile:
    """A file to download once and verify: its ``url``, the ``filename`` it is saved as
    under the data root, its ``size`` in bytes and its published ``md5`` and/or ``sha256``
    (at least one checksum: an unchecked download could be anything)."""

    title: str  # what the file is, for messages ("the CIFAR-10 archive")
    url: str
    filename: str
    size: int
    md5: str | None = None
    sha256: str | None = None

    def __post_init__(self):
        check_int("size", self.size, 0)
        if self.md5 is None and self.sha256 is None:
            raise ValueError(
                f"Invalid md5, sha256 of {self.filename}: None, None (expected at least one)"
            )
        if Path(self.filename).name != self.filename:
            raise ValueError(f"Invalid filename: {self.filename!r} (expected a bare file name)")

    @property
    def checksums(self) -> dict:
        """The keyword arguments of :func:`verify` and :func:`download` for this file."""
        return {"md5": self.md5, "sha256": self.sha256, "size": self.size}

    def path(self, root=None) -> Path:
        """Where the file lives under ``root`` (default :data:`DEFAULT_ROOT`)."""
        return (Path(root) if root is not None else DEFAULT_ROOT) / self.filename


REMOTE_FILES: dict[str, RemoteFile] = {
    # https://www.cs.toronto.edu/~kriz/cifar.html (the md5 is the one published there).
    "cifar10": RemoteFile(
        title="CIFAR-10 archive",
        url="https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
        filename="cifar-10-python.tar.gz",
        size=170_498_071,
        md5="c58f30108f718f92721af3b95e74349a",
    ),
    # Size and sha256 as recorded by tensorflow_datasets (url_checksums/tiny_shakespeare.txt).
    "tiny_shakespeare": RemoteFile(
        title="Tiny Shakespeare",
        url="https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
        filename="tiny_shakespeare.txt",
        size=1_115_394,
        sha256="86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
    ),
}


def _mismatches(path: Path, md5: str | None, sha256: str | None, size: int | None) -> list[str]:
    problems = []
    actual_size = path.stat().st_size
    if size is not None and actual_size != size:
        problems.append(f"size {actual_size} bytes, expected {size}")
    for algorithm, expected in (("md5", md5), ("sha256", sha256)):
        # A size mismatch already condemns the file; hashing it too would only cost time.
        if expected is None or problems:
            continue
        h = hashlib.new(algorithm)
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        if h.hexdigest() != expected.lower():
            problems.append(f"{algorithm} {h.hexdigest()}, expected {expected.lower()}")
    return problems


def verify(path, *, md5: str | None = None, sha256: str | None = None, size: int | None = None):
    """Check a file's size (bytes) and checksums; raise :class:`DataIntegrityError` if off.

    A missing file raises :class:`FileNotFoundError`.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No file at {path}")
    problems = _mismatches(path, md5, sha256, size)
    if problems:
        raise DataIntegrityError(
            f"{path} is corrupt or incomplete ({'; '.join(problems)}). "
            f"Delete {path} and re-run: it will be downloaded again."
        )


def _remove_stale_parts(path: Path) -> None:
    """Delete the ``*.part`` files of downloads of ``path`` killed long ago; a recent one
    may belong to a download still running in another process, and is left alone."""
    now = time.time()
    for part in path.parent.glob(f"{path.name}.*.part"):
        with contextlib.suppress(OSError):  # another process may remove it first
            if now - part.stat().st_mtime > STALE_PART_SECONDS:
                part.unlink()


def download(
    url: str,
    path,
    *,
    md5: str | None = None,
    sha256: str | None = None,
    size: int | None = None,
    progress: bool = True,
) -> Path:
    """Download ``url`` to ``path`` once, verified; return ``path``.

    If ``path`` exists and verifies, nothing is downloaded. Otherwise the bytes stream
    into a temporary ``*.part`` file in the same directory, are checked against ``size``
    and the checksums, and are renamed into place. A mismatch raises
    :class:`DataIntegrityError` and leaves nothing at ``path``.
    """
    path = Path(path)
    progress = check_bool("progress", progress)
    if path.is_file():
        problems = _mismatches(path, md5, sha256, size)
        if not problems:
            return path
        warnings.warn(
            f"{path} fails verification ({'; '.join(problems)}); downloading it again",
            stacklevel=2,
        )
    _remove_stale_parts(path)
    with atomic_path(path) as tmp:
        try:
            with urllib.request.urlopen(url, timeout=60) as response, open(tmp, "wb") as f:
                total = size or int(response.headers.get("Content-Length") or 0) or None
                with tqdm(
                    total=total, unit="B", unit_scale=True, desc=path.name, disable=not progress
                ) as bar:
                    for chunk in iter(lambda: response.read(1 << 20), b""):
                        f.write(chunk)
                        bar.update(len(chunk))
        except (OSError, http.client.HTTPException) as err:  # URLError is an OSError
            raise RuntimeError(
                f"Could not download {url} ({err}). On a machine without internet, fetch "
                f"the file elsewhere and place it at {path} (size {size} bytes, "
                f"md5 {md5}, sha256 {sha256}); a file there is verified, not downloaded."
            ) from err
        problems = _mismatches(tmp, md5, sha256, size)
        if problems:
            raise DataIntegrityError(
                f"Downloaded {url} does not match ({'; '.join(problems)}); nothing was saved "
                f"at {path}. Re-run to try again; if it persists the file upstream has changed."
            )
    return path


_download = download  # fetch's ``download`` flag shadows the function's name


def fetch(remote: RemoteFile, root=None, *, download: bool = True, progress: bool = True) -> Path:
    """The verified local copy of ``remote`` under ``root``: downloaded once if missing
    (:func:`download`), or, with ``download=False``, a file that must already be there and
    is verified, never fetched."""
    if not isinstance(remote, RemoteFile):
        raise TypeError(f"Invalid remote: {remote!r} (expected a RemoteFile)")
    path = remote.path(root)
    if check_bool("download", download):
        return _download(remote.url, path, progress=progress, **remote.checksums)
    if not path.is_file():
        raise FileNotFoundError(
            f"No {remote.title} at {path} and download=False; "
            f"download {remote.url} and place it there."
        )
    verify(path, **remote.checksums)
    return path
