"""Character-level text: Python's own source (offline) and Tiny Shakespeare (downloaded).

At the ``smoke`` and ``cpu`` scales the labs read a corpus made from the standard-library
source of the running Python; at the ``gpu`` scale, Tiny Shakespeare (Karpathy's
char-rnn), downloaded once and verified (:mod:`lsdl_lab.data.files`). Either way the text
comes as a :class:`TextData`: token ids over the sorted characters, the validation split
the text right after the training split::

    text = load_text("python_source", max_chars=200_000)
"""

from __future__ import annotations

import hashlib
import os
import platform
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .._util import check_choice, check_fraction, check_int
from .files import REMOTE_FILES, DataIntegrityError, RemoteFile, fetch

__all__ = [
    "TextData",
    "load_python_source",
    "load_text",
    "load_tiny_shakespeare",
    "python_source_files",
]


@dataclass(eq=False)
class TextData:
    """A character-level corpus: token ids index ``vocab``, the sorted characters."""

    name: str
    train: torch.Tensor  # int64 (n_train,)
    val: torch.Tensor  # int64 (n_val,): the text right after the train split
    vocab: tuple[str, ...]
    source: str = ""  # where the text came from, with its checksum
    _codes: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        self._codes = np.array([ord(c) for c in self.vocab], dtype=np.uint32)
        if len(self.vocab) == 0 or np.any(np.diff(self._codes.astype(np.int64)) <= 0):
            raise ValueError("Invalid vocab: expected distinct single characters, sorted")

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> torch.Tensor:
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)  # one per character
        ids = np.searchsorted(self._codes, codes)
        known = ids < len(self._codes)
        known[known] = self._codes[ids[known]] == codes[known]
        if not known.all():
            unknown = sorted({text[i] for i in np.flatnonzero(~known)})
            raise ValueError(f"Characters not in the vocabulary of {self.name!r}: {unknown!r}")
        return torch.from_numpy(ids.astype(np.int64))

    def decode(self, ids) -> str:
        ids = torch.as_tensor(ids).reshape(-1).cpu().numpy()
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"Invalid ids: expected values in [0, {self.vocab_size - 1}]")
        return self._codes[ids].tobytes().decode("utf-32-le")


def _text_data(name: str, text: str, max_chars, val_fraction, source: str) -> TextData:
    if max_chars is not None:
        text = text[: check_int("max_chars", max_chars, 2)]
    val_fraction = check_fraction("val_fraction", val_fraction)
    n_train = int(len(text) * (1 - val_fraction))
    if not 0 < n_train < len(text):
        raise ValueError(
            f"Invalid val_fraction: {val_fraction} leaves an empty split of {len(text)} characters"
        )
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    source = f"{source}; {len(text):,} characters, sha256 {digest}"
    empty = torch.empty(0, dtype=torch.long)
    data = TextData(name, empty, empty, tuple(sorted(set(text))), source)
    ids = data.encode(text)
    # No shuffle: validation is the text after the training text, so no window straddles both.
    data.train, data.val = ids[:n_train], ids[n_train:]
    return data


def python_source_files() -> list[Path]:
    """The standard-library files of the running Python that make up the corpus, in order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if not stdlib.is_dir():
        stdlib = Path(os.__file__).parent
    return sorted(
        (
            p
            for p in stdlib.glob("*.py")
            if not (p.stem.startswith("test") or p.stem.endswith("_test"))
        ),
        key=lambda p: p.name,
    )


def load_python_source(max_chars: int | None = None, val_fraction: float = 0.1) -> TextData:
    """A character corpus from Python's own standard library; ships with Python, no network.

    The top-level ``Lib/*.py`` files of the running interpreter (tests excluded), sorted
    by name and concatenated, each after a ``# ==== name ====`` header line. The first
    ``max_chars`` characters are kept; the last ``val_fraction`` of them is the validation
    split. The corpus depends on the Python version: :func:`python_source_files` lists
    the files and ``TextData.source`` records the version and the text's sha256.
    """
    files = python_source_files()
    if not files:
        raise RuntimeError(
            "No standard-library source found (is this Python installation stripped?)"
        )
    # errors="replace" keeps a stray byte from failing the load; stdlib sources are UTF-8.
    text = "".join(
        f"# ==== {p.name} ====\n{p.read_text(encoding='utf-8', errors='replace')}\n\n"
        for p in files
    )
    source = f"Python {platform.python_version()} standard library, {len(files)} files"
    return _text_data("python_source", text, max_chars, val_fraction, source)


def load_tiny_shakespeare(
    root=None,
    download: bool = True,
    max_chars: int | None = None,
    val_fraction: float = 0.1,
    *,
    remote: RemoteFile | None = None,
) -> TextData:
    """Tiny Shakespeare: 1,115,394 characters of Shakespeare's plays.

    From Karpathy's char-rnn (``data/tinyshakespeare/input.txt``), checked against the
    size and sha256 recorded by tensorflow_datasets (the record
    ``REMOTE_FILES["tiny_shakespeare"]``, or ``remote``). As in nanoGPT's ``prepare.py``
    the first 90% is the training split and the last 10% the validation split.
    """
    remote = REMOTE_FILES["tiny_shakespeare"] if remote is None else remote
    path = fetch(remote, root, download=download)
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataIntegrityError(
            f"{path} is not UTF-8 text ({err}). Delete {path} and re-run: "
            f"it will be downloaded again."
        ) from err
    return _text_data("tiny_shakespeare", text, max_chars, val_fraction, remote.url)


TEXT_DATASETS = {"python_source": load_python_source, "tiny_shakespeare": load_tiny_shakespeare}


def load_text(name: str, **kwargs) -> TextData:
    """Load a character corpus by name: ``"python_source"`` or ``"tiny_shakespeare"``."""
    check_choice("name", name, list(TEXT_DATASETS))
    return TEXT_DATASETS[name](**kwargs)
