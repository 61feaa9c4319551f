"""The run's checkpoints: one file, written atomically, readable with ``weights_only=True``.

A checkpoint holds only tensors, numbers, strings and lists or dicts of them, so
``torch.load(path, weights_only=True)`` reads it and a checkpoint from elsewhere cannot
run code on load (pickle can). Its keys:

* ``format``: ``"lsdl_lab.run/1"``; ``step``: the optimizer steps done;
* ``model``: the whole model's state dict; ``optimizer``: the optimizer state keyed by
  parameter *name* (not by position in a sharded list), as one process holds it, so a
  checkpoint written by DDP, ZeRO or FSDP2 at any world size loads into any of them
  (:mod:`lsdl_lab.run.parallel` cuts the shards again);
* ``scheduler``, ``scaler``: the learning-rate scheduler's and the loss scaler's states;
* ``world_size``, ``parallel``, ``config``: where it came from (the config as a dict).

Randomness needs no saved state: each step seeds its own generator from (seed, step, rank)
and the batches are a function of the step, so a resumed run computes what an
uninterrupted one computes.

The file is written by rank 0 under a temporary name, fsynced and renamed
(:func:`lsdl_lab._util.atomic_path`): a worker killed while saving leaves the previous
checkpoint intact. A file that exists but cannot be read (truncated, corrupt, not a
checkpoint) is a :class:`CheckpointError` naming it, never a silent start from scratch.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from .._util import atomic_path

__all__ = ["FORMAT", "CheckpointError", "load", "save"]

FORMAT = "lsdl_lab.run/1"
KEYS = ("format", "step", "model", "optimizer", "scheduler", "world_size", "parallel", "config")


class CheckpointError(RuntimeError):
    """A checkpoint file exists but cannot be used; the message names the file."""


def save(path, **state) -> Path:
    """Write ``state`` (with ``format`` added) to ``path`` atomically."""
    with atomic_path(path) as tmp:
        torch.save({"format": FORMAT, **state}, tmp)
    return Path(path)


def _damaged(path: Path, e: Exception) -> CheckpointError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return CheckpointError(
        f"checkpoint {path} cannot be read: it is corrupt or truncated ({type(e).__name__}: "
        f"{first}); the run does not start afresh over it: restore it, or delete it (or set "
        "resume: false) to start from step 0"
    )


def load(path) -> dict:
    """Read the checkpoint at ``path`` (``weights_only=True``, on the CPU) and check that it
    is one; a missing file is ``FileNotFoundError``, anything else wrong a
    :class:`CheckpointError` that names the file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "Unsupported global" not in str(e):  # a damaged pickle, not a forbidden one
            raise _damaged(path, e) from e
        raise CheckpointError(
            f"checkpoint {path} cannot be read: it holds objects other than tensors and plain "
            "containers, which weights_only=True refuses (unpickling them could run code); "
            "the run does not start afresh over it: delete it (or set resume: false) to start "
            "from step 0"
        ) from e
    except Exception as e:  # zip and EOF errors of many kinds
        raise _damaged(path, e) from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {path} is not a lsdl_lab.run checkpoint (expected format {FORMAT!r})"
        )
    missing = [k for k in KEYS if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {', '.join(missing)}")
    return state
