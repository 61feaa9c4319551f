"""Checkpoint files: one module for :func:`lsdl_lab.train.fit` and the entry point
(:mod:`lsdl_lab.run`).

A checkpoint is one file holding a dict of tensors, numbers, strings, ``None`` and lists,
tuples or dicts of them (what ``state_dict()`` methods return), with a ``format`` key
naming who wrote it. So ``torch.load(path, weights_only=True)`` reads it, and a file from
elsewhere cannot run code when it is loaded (a full unpickle can).

:func:`save` writes under a temporary name, ``fsync``\\ s and renames
(:func:`lsdl_lab._util.atomic_path`): a process killed while saving leaves the previous
checkpoint intact. In a world of processes only rank 0 writes, and every rank waits for
the file before it goes on (:func:`save` with ``group``). :func:`load` reads with
``weights_only=True``; a file that exists but cannot be used (truncated, corrupt, holding
objects other than tensors, written by someone else) is a :class:`CheckpointError` that
names it and says what to do, never a silent start from scratch.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
import torch.distributed as dist

from ._util import atomic_path

__all__ = ["CheckpointError", "load", "save"]


class CheckpointError(RuntimeError):
    """A checkpoint file exists but cannot be used; the message names the file."""


def save(path, format: str, group=None, **state) -> Path:
    """Write ``state`` with ``format`` to ``path`` atomically. In a world (``group``, or
    the default group when there is one), rank 0 writes and every rank waits until the
    file is in place."""
    distributed = dist.is_initialized() and dist.get_world_size(group) > 1
    if not distributed or dist.get_rank(group) == 0:
        with atomic_path(path) as tmp:
            torch.save({"format": format, **state}, tmp)
    if distributed:
        dist.barrier(group)  # no rank runs past (and so overwrites) a checkpoint in writing
    return Path(path)


def _unusable(path: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} cannot be read: {why}; a run does not start afresh over it: "
        "restore it, or delete it (or do not resume) to start from step 0"
    )


def load(path, format: str | None = None, map_location="cpu") -> dict:
    """The checkpoint at ``path``, read with ``weights_only=True`` onto ``map_location``;
    with ``format``, it must be one of that format. A missing file is
    ``FileNotFoundError``; anything else wrong a :class:`CheckpointError` naming it."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        if "Unsupported global" not in str(e):  # a damaged pickle, not a forbidden one
            raise _unusable(path, f"it is corrupt or truncated ({_first_line(e)})") from e
        raise _unusable(
            path,
            "it holds objects other than tensors and plain containers, which "
            "weights_only=True refuses (unpickling them could run code)",
        ) from e
    except Exception as e:  # zip and EOF errors of many kinds
        raise _unusable(path, f"it is corrupt or truncated ({_first_line(e)})") from e
    if format is not None and (not isinstance(state, dict) or state.get("format") != format):
        raise CheckpointError(
            f"checkpoint {path} is not a {format.split('/')[0]} checkpoint (expected format "
            f"{format!r})"
        )
    return state


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__
