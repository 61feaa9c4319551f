"""The library's shared private helpers, written once and used by every module.

* **Argument checks** with one message format, ``Invalid <name>: <value> (expected ...)``:
  a value of the wrong *type* raises ``TypeError``, a value of the right type outside its
  range raises ``ValueError``. Each check returns the value (converted to ``int``,
  ``float`` or ``bool``), so ``self.k = check_int("k", k, 1)`` validates and stores.
* :func:`eval_mode`: evaluation mode inside a block, every submodule's own mode restored
  after it, also when the block raises.
* :func:`flatten` / :func:`unflatten`: a list of tensors as one vector and back.
* :func:`atomic_path`: write a file under a temporary name, ``fsync`` it, rename it into
  place, so a reader never sees half a file.
* :func:`generator`: a CPU ``torch.Generator`` seeded from any tuple of parts, so every use
  (an epoch's permutation, a probe's vectors) has its own reproducible stream.
* :data:`LossFn` and :func:`weighted_batches`: the loss-function type and the batches of a
  mean loss, shared by the curvature, landscape and noise modules.
* :func:`all_gather_single` / :func:`reduce_scatter_single` and :data:`NO_BUFFER_SYNC`:
  ``torch.distributed`` and DDP as every supported torch spells them (the package's floor
  torch lacks the newer names; the newest torch warns on the older ones).

No module imports another module's private names; what several modules need lives here.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import math
import numbers
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# -- argument checks ----------------------------------------------------------------------


def _invalid(name: str, value, expected: str) -> str:
    return f"Invalid {name}: {value!r} (expected {expected})"


def _interval(low: float, high: float, low_open: bool, high_open: bool) -> str:
    if high == math.inf and not high_open:
        high_open = True
    if low == -math.inf:
        return f"a number {'<' if high_open else '<='} {high:g}"
    if high == math.inf:
        return f"a number {'>' if low_open else '>='} {low:g}"
    return f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def check_bool(name: str, value) -> bool:
    """``value`` must be ``True`` or ``False`` (not 0, 1 or "yes": a flag is a bool)."""
    if not isinstance(value, bool):
        raise TypeError(_invalid(name, value, "True or False"))
    return value


def check_int(name: str, value, low: int | None = None, high: int | None = None) -> int:
    """An integer (not a bool) in ``[low, high]`` (either bound may be ``None``)."""
    if low is not None and high is not None:
        expected = f"an int in [{low}, {high}]"
    elif low is not None:
        expected = f"an int >= {low}"
    elif high is not None:
        expected = f"an int <= {high}"
    else:
        expected = "an int"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(_invalid(name, value, expected))
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(_invalid(name, value, expected))
    return int(value)


def check_real(
    name: str,
    value,
    low: float = -math.inf,
    high: float = math.inf,
    *,
    low_open: bool = False,
    high_open: bool = False,
    finite: bool = True,
) -> float:
    """A real number (not a bool) in the interval from ``low`` to ``high``; NaN is always
    refused and, with ``finite`` (the default), so is an infinity."""
    expected = _interval(low, high, low_open, high_open)
    if finite:
        expected = "a finite " + expected.removeprefix("a ")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(_invalid(name, value, expected))
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (above and below) or (finite and not math.isfinite(value)):  # NaN fails both
        raise ValueError(_invalid(name, value, expected))
    return float(value)


def check_nonnegative(name: str, value) -> float:
    """A finite number >= 0."""
    return check_real(name, value, 0.0)


def check_positive(name: str, value) -> float:
    """A finite number > 0."""
    return check_real(name, value, 0.0, low_open=True)


def check_fraction(name: str, value, *, closed: bool = False) -> float:
    """A number in (0, 1), or in [0, 1] with ``closed``."""
    return check_real(name, value, 0.0, 1.0, low_open=not closed, high_open=not closed)


def check_choice(name: str, value, choices: Sequence):
    """One of ``choices`` (compared with ``==``)."""
    if value not in choices:
        raise ValueError(_invalid(name, value, "one of " + ", ".join(map(repr, choices))))
    return value


def check_tensor(name: str, value, ndim: int | None = None) -> torch.Tensor:
    """A ``torch.Tensor`` (of ``ndim`` dimensions, when given)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"Invalid {name}: a {type(value).__name__} (expected a torch.Tensor)")
    if ndim is not None and value.ndim != ndim:
        raise ValueError(
            f"Invalid {name}: a tensor of shape {tuple(value.shape)} "
            f"(expected {ndim} dimension{'s' if ndim != 1 else ''})"
        )
    return value


# -- models -------------------------------------------------------------------------------


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Evaluation mode inside the block (BatchNorm uses its running statistics, dropout is
    off); afterwards every submodule is back in its own mode, even if the block raised.

    Restoring only the top module (``model.train(was_training)``) would put a submodule
    that was deliberately frozen in eval mode back into training mode.
    """
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, training in modes:
            m.training = training


def device_of(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); CPU for a stateless model."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors as one flat vector (a new tensor, in their order)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(vector: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``vector`` cut into views shaped like ``like`` (the inverse of :func:`flatten`)."""
    numels = [t.numel() for t in like]
    if vector.ndim != 1 or vector.numel() != sum(numels):
        raise ValueError(
            f"Invalid vector: shape {tuple(vector.shape)} (expected a flat vector of "
            f"{sum(numels)} entries, the size of the tensors it unflattens into)"
        )
    return [v.view_as(t) for v, t in zip(vector.split(numels), like)]


def weighted_batches(batches) -> tuple[list, list[float]]:
    """``batches`` (one ``(x, y)`` pair, or an iterable of them) as a list, with the weight
    ``n_b / N`` of each batch in the mean loss over all of them."""
    if isinstance(batches, (tuple, list)) and len(batches) == 2 and torch.is_tensor(batches[0]):
        batches = [batches]  # a single (x, y) pair
    batches = list(batches)
    if not batches:
        raise ValueError("Invalid batches: empty (expected at least one (x, y) pair)")
    sizes = [len(x) for x, _ in batches]
    return batches, [n / sum(sizes) for n in sizes]


# -- torch.distributed on every supported torch ------------------------------------------

# Newer torch (2.13, not 2.11) names the flat all-gather and reduce-scatter
# ``all_gather_single`` and ``reduce_scatter_single``, the older names deprecated aliases
# that call them; the floor torch (2.9) has only the older names. The name is looked up at
# every call, so a counter that rebinds the function in ``torch.distributed`` sees the
# call, once.
ALL_GATHER_SINGLE = (
    "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
)
REDUCE_SCATTER_SINGLE = (
    "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
)


def all_gather_single(output, input, group=None, async_op=False):
    """``output`` = the concatenation of every rank's ``input`` (torch's flat all-gather
    under the name this torch gives it)."""
    gather = getattr(dist, ALL_GATHER_SINGLE)
    return gather(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """``output`` = this rank's slice of the sum over ranks of ``input`` (torch's flat
    reduce-scatter under the name this torch gives it)."""
    scatter = getattr(dist, REDUCE_SCATTER_SINGLE)
    return scatter(output, input, op=op, group=group, async_op=async_op)


# DistributedDataParallel's option to leave buffers (BatchNorm's statistics) unsynchronized
# in the forward pass: ``forward_sync_buffers=False`` in newer torch (2.13, which
# deprecates ``broadcast_buffers``), ``broadcast_buffers=False`` in older torch (2.9,
# 2.11). The newer option still broadcasts the buffers once at construction, the older
# one does not: the same for models whose ranks start equal, as every model built from
# one seed does.
NO_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)


# -- randomness ---------------------------------------------------------------------------


def seed_from(*parts) -> int:
    """A 63-bit seed from a tuple such as ``("epoch", seed, e)``: one stream per use."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def generator(*parts) -> torch.Generator:
    """A CPU generator seeded by :func:`seed_from`; always on the CPU, so the same parts give
    the same numbers on every device."""
    return torch.Generator().manual_seed(seed_from(*parts))


# -- files --------------------------------------------------------------------------------


def _fsync_dir(directory: Path) -> None:
    # The rename itself lives in the directory: without this a crash right after it can
    # lose the new name on some file systems. Not possible on Windows; harmless to skip.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary ``<name>.*.part`` path beside ``path``; when the block succeeds, the
    file written there is flushed to disk (``fsync``) and renamed to ``path`` (atomic on
    POSIX and Windows: a reader sees the old file or the new one, never half of one). When
    the block raises, the temporary file is removed and ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.", suffix=".part")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
