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

A **sharded** checkpoint is a directory of PyTorch's distributed checkpoint (DCP,
``torch.distributed.checkpoint``; PyTorch, 2024): every rank writes the tensors it holds
(:func:`save_sharded`, each replicated tensor once, by one rank), DCP's ``.metadata`` says
where each piece of each tensor lies, and a world of another size or layout reads the
pieces it needs into its own shards (:func:`load_sharded`). With ``asynchronous`` the
tensors are copied to host memory and written by a background thread (``dcp.async_save``),
so training waits for the copy, not for the storage. The numbers and strings of the run
(step, scheduler, hyperparameters) are a file of this module beside DCP's (``state.pt``),
written last: a step directory holding it is complete, one without it was interrupted
and is never read. DCP's own metadata is a pickle; read only directories your job wrote.

A tensor a rank holds as a run of its elements (ZeRO's shards are slices of one flat
vector per unit, cut across rows: :class:`lsdl_lab.memory.ZeroOptimizer`) is written by
:class:`PieceSavePlanner` as the few N-D boxes that tile that run (:func:`boxes`), so
every rank writes its own elements and DCP records them as chunks of the whole tensor,
which any world and layout reads (``pieces`` of :func:`save_sharded`).

How often to checkpoint: :func:`young_interval` (Young, 1974), :func:`daly_interval`
(Daly, 2006) and :func:`expected_waste`, Daly's complete model of the time lost.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import pickle
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ._util import atomic_path, check_nonnegative, check_positive

__all__ = [
    "CheckpointError",
    "PendingSave",
    "PieceSavePlanner",
    "boxes",
    "daly_interval",
    "expected_waste",
    "latest_sharded",
    "load",
    "load_sharded",
    "read_sharded",
    "save",
    "save_sharded",
    "young_interval",
]


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


# -- sharded checkpoints: torch.distributed.checkpoint ----------------------------------

STATE = "state.pt"  # the run's numbers and strings, beside DCP's files, written last


def _step_directory(root, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def _complete(directory: Path) -> bool:
    return (directory / ".metadata").exists() and (directory / STATE).exists()


def latest_sharded(root) -> Path | None:
    """The newest complete step directory under ``root`` (DCP's ``.metadata`` and the
    run's ``state.pt`` both written), or None. A save interrupted by a failure left no
    ``state.pt`` and is skipped (PyTorch, 2024: DCP writes ``.metadata`` last, atomically)."""
    steps = sorted(Path(root).glob("step-*")) if Path(root).is_dir() else []
    done = [d for d in steps if _complete(d)]
    return done[-1] if done else None


def _distributed(group) -> bool:
    return dist.is_initialized() and dist.get_world_size(group) > 1


@contextlib.contextmanager
def _alone(alone: bool):
    """DCP warns that it assumes one process whenever it has no process group; alone
    (``no_dist=True``) that is what was asked, and the warning is dropped."""
    with warnings.catch_warnings():
        if alone:
            warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable")
        yield


# -- a tensor held as a run of its elements: the boxes that tile it ----------------------------


def boxes(shape, start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    r"""The boxes (``(offsets, sizes)``, DCP's chunks) that tile elements ``[start, stop)``
    of a row-major tensor of ``shape`` (one dimension or more), in order. With
    :math:`I = \prod_{d \ge 1} s_d` elements per row, the run is the end of row
    :math:`\lfloor start/I \rfloor` (unless ``start`` begins a row), the whole rows
    before row :math:`\lfloor stop/I \rfloor` (one box), and the beginning of that row
    (unless ``stop`` begins it); a partial row is cut the same way in the dimensions after
    the first. Each box is contiguous in memory, and there are at most :math:`2k - 1` of
    them for :math:`k` dimensions."""
    if start >= stop:
        return []
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    inner = math.prod(shape[1:])
    (row, first), (end, last) = divmod(start, inner), divmod(stop, inner)

    def within(r: int, a: int, b: int) -> list:
        return [((r, *o), (1, *s)) for o, s in boxes(shape[1:], a, b)]

    if row == end:
        return within(row, first, last)
    out = []
    if first:
        out += within(row, first, inner)
        row += 1
    if end > row:
        out.append(((row,) + (0,) * (len(shape) - 1), (end - row, *shape[1:])))
    if last:
        out += within(end, 0, last)
    return out


class PieceSavePlanner(DefaultSavePlanner):
    r"""DCP's default save planner (PyTorch, 2024) for a state in which some tensors are
    held by each rank as a run of their elements. ``pieces`` maps a name of the state to
    ``(shape, start)``: ``state[name]`` on this rank holds elements
    :math:`[start, start + n)` (:math:`n` its ``numel``) of the row-major flattening of a
    tensor of ``shape``, and the ranks' runs tile it. This rank writes exactly those
    elements, as the chunks :func:`boxes` cuts them into (each a view of the run), and
    DCP's metadata records them as chunks of the whole tensor, so that ``dcp.load`` reads
    it under any world size and layout (whole, as DTensor shards, as other runs), as it
    reads a checkpoint written by any other planner. The other tensors and values are the
    default planner's (a replicated tensor written once)."""

    def __init__(self, pieces: dict):
        super().__init__()
        self.pieces, self.views = pieces, {}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        # an asynchronous save hands over its staged copy: the runs are taken from it
        self.runs = {name: state_dict[name] for name in self.pieces}
        rest = {k: v for k, v in state_dict.items() if k not in self.pieces}
        super().set_up_planner(rest, storage_meta, is_coordinator)
        if self.flatten_state_dict:
            self.mappings.update({name: (name,) for name in self.pieces})

    def create_local_plan(self):
        plan, items = super().create_local_plan(), []
        for name, (shape, start) in self.pieces.items():
            run, at = self.runs[name].reshape(-1), 0
            for offsets, sizes in boxes(shape, start, start + run.numel()):
                n = math.prod(sizes)
                self.views[name, offsets] = run[at : at + n].view(sizes)
                at += n
                chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
                data = TensorWriteData(
                    chunk, TensorProperties.create_from_tensor(run), torch.Size(shape)
                )
                index = MetadataIndex(name, torch.Size(offsets))
                items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=data))
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        view = self.views.get((index.fqn, tuple(index.offset or ())))
        return super().lookup_object(index) if view is None else view


class PendingSave:
    """A save in progress: :meth:`wait` blocks until DCP's files are written, then writes
    ``state.pt`` (rank 0), which makes the step directory complete, and removes the older
    step directories. ``blocked`` is the time the caller was held by :func:`save_sharded`."""

    def __init__(self, future, directory: Path, format: str, state: dict, group):
        self.future, self.directory, self.format, self.state = future, directory, format, state
        self.group, self.blocked, self.done = group, 0.0, False

    def wait(self) -> Path:
        """Wait for the write and complete the checkpoint (every rank calls it; once done,
        a second call does nothing)."""
        if self.done:
            return self.directory
        if self.future is not None:
            # dcp.async_save returns a Future, or a response holding one (newer torch)
            getattr(self.future, "upload_completion", self.future).result()
            self.future = None
        save(self.directory / STATE, self.format, self.group, **self.state)
        if not _distributed(self.group) or dist.get_rank(self.group) == 0:
            for older in self.directory.parent.glob("step-*"):
                if older.name < self.directory.name:
                    shutil.rmtree(older, ignore_errors=True)
        self.done = True
        return self.directory


def save_sharded(
    root,
    step: int,
    tensors: dict,
    format: str,
    /,
    *,
    group=None,
    asynchronous=False,
    pieces: dict | None = None,
    **state,
) -> PendingSave:
    """Write ``tensors`` (a flat dict of names to tensors or DTensors, each rank its own)
    to ``root/step-<step>`` with ``dcp.save``, or with ``dcp.async_save`` when
    ``asynchronous`` (PyTorch, 2024): the tensors are staged in host memory, then written
    by a thread while the caller goes on. ``state`` (numbers, strings, small tensors) goes
    to the directory's ``state.pt`` once the tensors are written: by this call when
    synchronous, by the returned :class:`PendingSave`'s ``wait`` otherwise. ``group``:
    the ranks that save together (an asynchronous save's collectives need a group of
    their own, apart from training's). ``pieces`` (name -> ``(shape, start)``): the tensors
    of ``tensors`` that this rank holds as a run of elements ``[start, start + numel)`` of
    a tensor of ``shape``, written as such (:class:`PieceSavePlanner`)."""
    start = time.perf_counter()
    directory = _step_directory(root, step)
    distributed = _distributed(group)
    if not distributed or dist.get_rank(group) == 0:
        shutil.rmtree(directory, ignore_errors=True)  # an interrupted save of this step
        directory.mkdir(parents=True)
    if distributed:
        dist.barrier(group)
    planner = PieceSavePlanner(pieces) if pieces else None
    where = dict(
        checkpoint_id=str(directory), process_group=group, no_dist=not distributed, planner=planner
    )
    with _alone(not distributed):
        if asynchronous:
            future = dcp.async_save(tensors, **where)
        else:
            dcp.save(tensors, **where)
            future = None
    pending = PendingSave(future, directory, format, state, group)
    if not asynchronous:
        pending.wait()
    pending.blocked = time.perf_counter() - start
    return pending


def _shapes(directory: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Each tensor's name, global shape and dtype, from DCP's metadata."""
    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    return {
        name: (m.size, m.properties.dtype)
        for name, m in metadata.state_dict_metadata.items()
        if isinstance(m, dcp.metadata.TensorStorageMetadata)
    }


def _check_same_tensors(directory: Path, saved: dict, expected: dict) -> None:
    """A :class:`CheckpointError` naming what differs between the tensors ``saved`` in
    ``directory`` and those ``expected`` (name -> (shape, dtype)): missing, unexpected,
    or of another shape or dtype."""
    missing = sorted(set(expected) - set(saved))
    extra = sorted(set(saved) - set(expected))
    other = [
        f"{name} {tuple(saved[name][0])} {saved[name][1]} (this run: "
        f"{tuple(expected[name][0])} {expected[name][1]})"
        for name in sorted(set(saved) & set(expected))
        if tuple(saved[name][0]) != tuple(expected[name][0]) or saved[name][1] != expected[name][1]
    ]
    why = []
    for what, names in (("lacks", missing), ("has tensors this run does not", extra)):
        if names:
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            why.append(f"it {what}: {shown}")
    if other:
        why.append("it holds other shapes or dtypes: " + "; ".join(other[:4]))
    if why:
        raise CheckpointError(
            f"checkpoint {directory} was written by another model or optimizer: "
            + "; ".join(why)
            + "; resume with the configuration that wrote it, or delete it to start afresh"
        )


def _global_shape(t: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    return t.shape, t.dtype  # a DTensor's shape is its global shape


def load_sharded(directory, tensors: dict, format: str) -> dict:
    """Read the checkpoint ``directory`` into ``tensors`` (this rank's tensors or DTensors,
    in place: ``dcp.load`` reads the pieces of each that this rank holds, whatever world
    size and layout wrote them; PyTorch, 2024) and return its ``state.pt``. Tensors
    missing, unexpected or of another shape are a :class:`CheckpointError` naming them."""
    directory = Path(directory)
    state = load(directory / STATE, format)
    expected = {name: _global_shape(t) for name, t in tensors.items()}
    _check_same_tensors(directory, _shapes(directory), expected)
    with _alone(not dist.is_initialized()):
        dcp.load(tensors, checkpoint_id=str(directory), no_dist=not dist.is_initialized())
    return state


def read_sharded(directory, format: str, expected: dict | None = None) -> tuple[dict, dict]:
    """Every tensor of the checkpoint ``directory`` whole, on this process (allocated from
    DCP's metadata and filled by ``dcp.load``; PyTorch, 2024), and its ``state.pt``: what
    a mode that holds whole tensors (the library's ZeRO) resumes from. ``expected`` (name
    -> (shape, dtype)), when given, is checked as in :func:`load_sharded` against the
    saved tensors whose names begin as one of its names does (``model.``, say)."""
    directory = Path(directory)
    state = load(directory / STATE, format)
    saved = _shapes(directory)
    if expected is not None:
        prefixes = tuple({name.split(".")[0] + "." for name in expected})
        _check_same_tensors(
            directory, {k: v for k, v in saved.items() if k.startswith(prefixes)}, expected
        )
    tensors = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in saved.items()}
    with _alone(not dist.is_initialized()):
        dcp.load(tensors, checkpoint_id=str(directory), no_dist=not dist.is_initialized())
    return tensors, state


# -- how often: Young's and Daly's intervals -----------------------------------------------


def young_interval(delta: float, mtbf: float) -> float:
    r"""Young's (1974) first-order optimum interval of computation between checkpoints,
    :math:`\tau = \sqrt{2\delta M}`, for a checkpoint that takes ``delta``
    :math:`\delta` seconds and a mean time between failures ``mtbf`` :math:`M`."""
    return math.sqrt(2 * check_positive("delta", delta) * check_positive("mtbf", mtbf))


def daly_interval(delta: float, mtbf: float) -> float:
    r"""Daly's (2006) higher-order optimum interval of computation between checkpoints,

    .. math::
        \tau = \sqrt{2\delta M}\left[1 + \tfrac13\sqrt{\tfrac{\delta}{2M}}
        + \tfrac19\,\tfrac{\delta}{2M}\right] - \delta \quad (\delta < 2M),
        \qquad \tau = M \quad (\delta \ge 2M),

    the perturbation solution that minimizes his complete model (:func:`expected_waste`)
    for Poisson failures; to leading order Young's :math:`\sqrt{2\delta M}` less
    :math:`2\delta/3`."""
    delta, mtbf = check_positive("delta", delta), check_positive("mtbf", mtbf)
    if delta >= 2 * mtbf:
        return mtbf
    x = delta / (2 * mtbf)
    return math.sqrt(2 * delta * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - delta


def expected_waste(tau: float, delta: float, mtbf: float, restart: float = 0.0) -> float:
    r"""The fraction of wall-clock time lost to checkpoints, failures and restarts with
    ``tau`` :math:`\tau` seconds of computation between checkpoints of ``delta``
    :math:`\delta`, Poisson failures every ``mtbf`` :math:`M` seconds on average and a
    restart of ``restart`` :math:`R`, by Daly's (2006) complete model: the wall-clock
    time per second of computation is :math:`M e^{R/M}(e^{(\tau+\delta)/M} - 1)/\tau`,
    so the waste is one minus its inverse (to first order Young's
    :math:`\delta/\tau + (\tau/2 + R)/M`)."""
    tau, delta = check_positive("tau", tau), check_nonnegative("delta", delta)
    mtbf, restart = check_positive("mtbf", mtbf), check_nonnegative("restart", restart)
    wall = mtbf * math.exp(restart / mtbf) * math.expm1((tau + delta) / mtbf) / tau
    return 1 - 1 / wall
