"""Bytes actually held, per category and per dtype, and bytes saved for backward.

Every number Chapter 8 states about memory is measured here, not estimated:

* :func:`measure` -- the bytes of a model's parameters, their gradients and an optimizer's
  state (the three categories of Rajbhandari et al. 2020, Section 3.1), with their total;
  :func:`measure_by_dtype` -- the same split by dtype (``float32``, ``bfloat16``, ...).
* :class:`SavedTensorBytes` -- the activations: the bytes autograd saves for the backward
  pass, counted through :func:`torch.autograd.graph.saved_tensors_hooks`, so it works on
  the CPU, where there is no allocator statistics; on CUDA it also reads the allocator's
  peak (``torch.cuda.max_memory_allocated``).
* :class:`LargestTensor` -- the most entries of any tensor an operation makes inside a
  block: the largest intermediate a rank holds at once (a block of attention scores, a
  message buffer), which the saved tensors alone do not show.
* :func:`format_table` -- a table of bytes per category, one column per rank.

Two counting rules make the numbers honest:

1. **Each storage once.** A tensor is a view of a storage; tied weights (the GPT's
   embedding and output layer), views such as ``weight.t()`` and the ``q``, ``k``, ``v``
   slices of one projection share storage, and counting each tensor would count the same
   bytes several times. The key is the storage's device and data pointer, the size is the
   whole storage's ``nbytes`` (the bytes held, even when a view uses part of them).
2. **Parameters are not activations.** Autograd saves the weight of a linear layer for
   its backward pass; those bytes are already counted as parameters, so storages of the
   excluded tensors (the model's parameters and buffers) are not counted again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "CATEGORIES",
    "LargestTensor",
    "SavedTensorBytes",
    "format_bytes",
    "format_table",
    "measure",
    "measure_by_dtype",
]

CATEGORIES = ("params", "grads", "optimizer_state")


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (FSDP2, tensor parallelism: a rank holds only its
    shard, and a DTensor has no storage of its own); any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _tensors_in(obj) -> Iterable[torch.Tensor]:
    """The tensors in an optimizer's per-parameter state (a dict, possibly holding lists)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors_in(value)


def _category_tensors(model: nn.Module, optimizer) -> dict[str, list[torch.Tensor]]:
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = []
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"Invalid optimizer: a {type(optimizer).__name__} "
                "(expected a torch.optim.Optimizer or None)"
            )
        for per_param in optimizer.state.values():
            state.extend(_tensors_in(per_param))
    return {"params": params, "grads": grads, "optimizer_state": state}


def measure_by_dtype(model: nn.Module, optimizer=None) -> dict[str, dict[str, int]]:
    """Bytes held per category and dtype: ``{"params": {"float32": 1024, ...}, ...}``.

    Each storage is counted once over all categories (the first category that holds it
    owns it, in the order params, grads, optimizer_state). Optimizer state is every tensor
    in ``optimizer.state`` (moments, step counters when they are tensors, master weights
    when the optimizer keeps them there). A DTensor counts its shard on this rank.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"Invalid model: a {type(model).__name__} (expected an nn.Module)")
    seen: set[tuple[str, int]] = set()
    out: dict[str, dict[str, int]] = {}
    for category, tensors in _category_tensors(model, optimizer).items():
        per_dtype: dict[str, int] = {}
        for t in map(_local, tensors):
            key = _storage_key(t)
            if key in seen:
                continue
            seen.add(key)
            name = str(t.dtype).removeprefix("torch.")
            per_dtype[name] = per_dtype.get(name, 0) + t.untyped_storage().nbytes()
        out[category] = per_dtype
    return out


def measure(model: nn.Module, optimizer=None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state actually held, and their total.

    Returns ``{"params", "grads", "optimizer_state", "total"}`` in bytes, the keys of
    :func:`lsdl_lab.memory.zero_bytes`, so a measurement and its formula compare key by key.
    Gradients not yet created (``p.grad is None``) hold nothing; an optimizer's state
    exists only after its first step. :func:`measure_by_dtype` splits the same bytes by
    dtype.
    """
    by_dtype = measure_by_dtype(model, optimizer)
    out = {category: sum(by_dtype[category].values()) for category in CATEGORIES}
    out["total"] = sum(out.values())
    return out


class _Held:
    """A saved tensor wrapped so that the counter learns when autograd releases it."""

    __slots__ = ("counter", "key", "tensor")

    def __init__(self, counter: SavedTensorBytes, key, tensor: torch.Tensor):
        self.counter, self.key, self.tensor = counter, key, tensor

    def __del__(self):
        self.counter._release(self.key)


def _tensors_of(out) -> Iterable[torch.Tensor]:
    """The tensors of an operation's output: a tensor, or tensors in tuples and lists."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for item in out:
            yield from _tensors_of(item)


class LargestTensor(TorchDispatchMode):
    """The most entries (``numel``) of any tensor an operation returns inside a ``with``
    block, forward and backward: the largest intermediate a rank holds at once, as the
    operators torch dispatches see it (a fused kernel's own scratch space is not seen).

    A dispatch mode sees every operator autograd's backward runs too, which the Python-level
    ``torch.overrides.TorchFunctionMode`` does not: the reason for this class of
    ``torch.utils._python_dispatch``, the mechanism torch's "Extending PyTorch" notes
    document for such modes. ``tests/memory/test_measure.py`` holds it to a written-out
    attention's score matrix and its backward, so a torch that changes it fails there.
    """

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _tensors_of(out):
            self.numel = max(self.numel, t.numel())
        return out


class SavedTensorBytes(contextlib.AbstractContextManager):
    """Count the bytes autograd saves for backward inside a ``with`` block.

    ``exclude`` is a module (its parameters and buffers) or an iterable of tensors whose
    storages are not activations. Run the forward *and* the backward pass inside the block
    to see the whole life of the saved tensors; afterwards:

    * ``total``: bytes of all distinct storages saved in the block;
    * ``peak``: the largest number of bytes saved and not yet released at any moment: the
      activation memory. Without recomputation it is reached at the end of the forward
      pass; with checkpointing (Chen et al. 2016) it includes the activations recomputed
      for one segment during the backward pass, which is why ``peak`` and not ``total``
      is the quantity the square-root rule minimizes;
    * ``live``: bytes held now (0 after a backward pass that freed its graph);
    * ``allocator_peak``: on CUDA (``device`` a CUDA device), the allocator's peak above
      its level when the block started (``torch.cuda.max_memory_allocated``), which also
      counts temporaries and parameters' gradients; ``None`` elsewhere.

    A saved tensor is released when autograd frees the node that holds it (after its
    backward step, unless ``retain_graph=True``); the counter notices because its packed
    object is deleted then. ``torch.utils.checkpoint`` installs its own hooks inside its
    region, so the tensors it saves there are invisible to this counter.
    """

    def __init__(self, exclude: nn.Module | Iterable[torch.Tensor] | None = None, device=None):
        if isinstance(exclude, nn.Module):
            tensors = [*exclude.parameters(), *exclude.buffers()]
        elif exclude is None:
            tensors = []
        else:
            tensors = list(exclude)
            if not all(isinstance(t, torch.Tensor) for t in tensors):
                raise TypeError("Invalid exclude: expected an nn.Module or tensors")
        self._excluded = {_storage_key(t) for t in tensors}
        self.device = None if device is None else torch.device(device)
        self._held: dict[tuple[str, int], list[int]] = {}  # key -> [nbytes, references]
        self.live = self.peak = self.total = 0
        self.allocator_peak: int | None = None
        self._hooks = None

    def _pack(self, t: torch.Tensor):
        if t.layout != torch.strided:
            return t
        key = _storage_key(t)
        if key in self._excluded:
            return t
        entry = self._held.get(key)
        if entry is None:
            nbytes = t.untyped_storage().nbytes()
            self._held[key] = [nbytes, 1]
            self.live += nbytes
            self.total += nbytes
            self.peak = max(self.peak, self.live)
        else:
            entry[1] += 1
        return _Held(self, key, t)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Held) else packed

    def _release(self, key) -> None:
        entry = self._held.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._held[key]
            self.live -= entry[0]

    def _on_cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def __enter__(self) -> SavedTensorBytes:
        if self._on_cuda():
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._allocated_at_start = torch.cuda.memory_allocated(self.device)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        if self._on_cuda():
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            self.allocator_peak = peak - self._allocated_at_start


# -- tables -------------------------------------------------------------------------------

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units: ``format_bytes(3 * 2**20) == "3.00 MiB"``."""
    value, unit = float(n), _UNITS[0]
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            break
        value /= 1024
    return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"


def format_table(reports: Mapping[str, float] | Sequence[Mapping[str, float]]) -> str:
    """A plain-text table of bytes per category: one column, or one per rank.

    ``reports`` is one dict of bytes per category (``measure``'s, ``zero_bytes``'s, or any
    dict of numbers) or a list of them, one per rank; rows follow the first dict's keys.
    """
    if isinstance(reports, Mapping):
        reports, headers = [reports], ["bytes"]
    else:
        reports = list(reports)
        if not reports or not all(isinstance(r, Mapping) for r in reports):
            raise ValueError("Invalid reports: expected a dict or a non-empty list of dicts")
        headers = [f"rank {i}" for i in range(len(reports))]
    rows = [k for k, v in reports[0].items() if isinstance(v, (int, float))]
    cells = [[format_bytes(r[k]) if k in r else "-" for r in reports] for k in rows]
    first = max([len("category")] + [len(k) for k in rows])
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(headers)]
    lines = ["  ".join(["category".ljust(first), *(h.rjust(w) for h, w in zip(headers, widths))])]
    lines.append("  ".join(["-" * first, *("-" * w for w in widths)]))
    for k, c in zip(rows, cells):
        lines.append("  ".join([k.ljust(first), *(x.rjust(w) for x, w in zip(c, widths))]))
    return "\n".join(lines)
