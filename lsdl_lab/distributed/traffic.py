r"""The one count of the bytes a rank hands to collectives, :class:`CollectiveBytes`, and
its counterpart for point-to-point messages, :class:`SentMessages`.

Every measurement of communication in the book goes through it: the entry point's
records (:mod:`lsdl_lab.run`, every parallel mode), the bytes per step of each gradient
compressor (Chapter 7 and Lab 7, torch's hooks and :mod:`lsdl_lab.compress`'s alike), the
all-reduces of a tensor-parallel forward. ::

    counter = CollectiveBytes()
    with counter:
        loss.backward()  # DDP's hook all-reduces the gradients
    counter.bytes        # 4 d on every rank, for d float32 gradients
    counter.calls        # [Call("all_reduce", bytes=4 d, group_size=p)]: one per call

**What it counts.** For each call, the bytes of the tensor this rank *hands* to the
collective, :math:`\text{numel} \times \text{element size}` (a packed payload of uint8
counts one byte an entry):

| collective | the tensor counted |
|---|---|
| ``all_reduce(tensor)`` | ``tensor`` |
| ``broadcast(tensor, src)`` | ``tensor``, on every rank (the source's, the others' buffer) |
| ``all_gather(tensor_list, tensor)`` | ``tensor``, this rank's contribution (not the list) |
| ``all_gather_single(output, input)`` (the flat all-gather) | ``input``, this rank's shard |
| ``reduce_scatter_single(output, input)`` (the flat reduce-scatter) | ``input``, all of it |
| ``all_to_all_single(output, input)`` | ``input``, all of it (this rank's own block too) |
| ``all_to_all(output_list, input_list)`` | every tensor of ``input_list`` |

(The flat forms are ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` before torch
2.13.)

That is the convention of the formulas the book checks (an all-reduce of :math:`n` floats
counts :math:`4n`), not the traffic on a link: a ring all-reduce puts about
:math:`2\frac{p-1}{p}` times what it is handed through each rank's link, a ring all-gather
:math:`p - 1` times (Chapter 7's cost model). Every process group counts, and so does
an ``async_op=True`` call (when it is made, not when it completes).

Each call is also kept, in order, in :attr:`CollectiveBytes.calls`: the collective's name,
the bytes handed and the size of its process group, from which a formula of the traffic on
the links (Chapter 10's ring bytes, say) is computed without a second counter.

**Which calls it sees.** Those made from Python through ``torch.distributed``'s module
attributes (``dist.all_reduce(...)``) or those of the module that defines them,
``torch.distributed.distributed_c10d``, while a counter's block is open: the block rebinds
those attributes in both modules to counting wrappers and restores torch's functions when
the last open block closes. That covers DDP's Python communication hooks (torch's
``default_hooks.allreduce_hook``, ``fp16_compress_hook``, ``powerSGD_hook`` and the hooks
of :mod:`lsdl_lab.compress`), :class:`~lsdl_lab.memory.ZeroOptimizer`, FSDP2 and the
library's code that calls them (the tensor-parallel layers, for one). It does not see
what C++ calls: DDP's built-in reducer (register ``default_hooks.allreduce_hook`` to count
DDP's all-reduces, as :mod:`lsdl_lab.run` does), the broadcast of DDP's constructor, a
compiled graph's collectives; nor point-to-point messages (``send``, ``recv``): the
library's collectives built from them (:mod:`lsdl_lab.distributed.collectives`: the ring,
the trees, the all-to-all) are counted by :class:`SentMessages`; nor a caller that bound
the function to a name of its own before the block opened
(``from torch.distributed import all_reduce``).
A call counts once: a counted function that torch calls while running another (2.13's
deprecated flat name calls the new one, ``send`` calls ``isend``) is not counted again.

:class:`SentMessages` counts, the same way, the point-to-point messages a rank sends
(``send``, ``isend``, and the ``isend`` operations handed to ``batch_isend_irecv``): the
messages of the collectives Chapter 7 builds by hand, and of a student's ring, whose
checker it can also forbid the built-in collectives, under both of their names.

**Blocks.** Bytes accumulate over every block of a counter (a run opens its counter
around each step and reads the total). Blocks of *different* counters may nest or
overlap: a call is counted by every counter whose block is open. A counter whose block
is already open refuses to open it again (:class:`RuntimeError`); nothing is counted
outside the blocks.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist

__all__ = [
    "BUILT_IN_COLLECTIVES",
    "COUNTED",
    "BuiltInCollective",
    "Call",
    "CollectiveBytes",
    "SentMessages",
]

# torch.distributed re-exports the functions of the module that defines them: a block
# rebinds both names, so that neither goes round it
_C10D = dist.distributed_c10d
_MODULES = (dist, _C10D)

# collective -> (position, keyword) of the tensor this rank hands to it, position of its
# group; the flat forms under each name this torch has (see the module's docstring)
_INPUTS = {
    "all_reduce": (0, "tensor", 2),
    "broadcast": (0, "tensor", 2),
    "all_gather": (1, "tensor", 2),
    "all_gather_single": (1, "input_tensor", 2),
    "all_gather_into_tensor": (1, "input_tensor", 2),
    "reduce_scatter_single": (1, "input", 3),
    "reduce_scatter_tensor": (1, "input", 3),
    "all_to_all_single": (1, "input", 4),
    "all_to_all": (1, "input_tensor_list", 2),  # a list: all of its tensors
}
COUNTED = tuple(name for name in _INPUTS if hasattr(dist, name))
"""The names of the ``torch.distributed`` functions a counter sees, on this torch."""

_open: list[CollectiveBytes] = []  # the counters whose blocks are open
_torchs: dict = {}  # (module, name) -> torch's own function, while a block is open
_lock = threading.Lock()
_calling = threading.local()  # .active: a counted function runs on this thread


def _once(fn, count):
    """``fn``, which first calls ``count(*args, **kwargs)``, unless it is called while
    another counted function runs on this thread (torch's call of one from another)."""

    @functools.wraps(fn)
    def counted(*args, **kwargs):
        if getattr(_calling, "active", False):
            return fn(*args, **kwargs)
        count(*args, **kwargs)
        _calling.active = True
        try:
            return fn(*args, **kwargs)
        finally:
            _calling.active = False

    return counted


def _rebind(saved: dict, functions: dict) -> None:
    """Set each ``name`` of ``functions`` in both modules, keeping torch's in ``saved``."""
    for name, fn in functions.items():
        for module in _MODULES:
            saved[module, name] = getattr(module, name)
            setattr(module, name, fn)


def _restore(saved: dict) -> None:
    for (module, name), fn in saved.items():
        setattr(module, name, fn)
    saved.clear()


class Call(NamedTuple):
    """One call a :class:`CollectiveBytes` counted."""

    name: str  # the collective, as torch.distributed names it ("all_reduce")
    bytes: int  # numel * element_size of what this rank handed it
    group_size: int  # the ranks of its process group


def _counting(name: str, fn):
    position, keyword, group_at = _INPUTS[name]

    def count(*args, **kwargs) -> None:
        handed = args[position] if len(args) > position else kwargs[keyword]
        tensors = handed if isinstance(handed, list | tuple) else [handed]
        group = args[group_at] if len(args) > group_at else kwargs.get("group")
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        call = Call(name, nbytes, dist.get_world_size(group))
        for counter in tuple(_open):
            counter.bytes += call.bytes
            counter.calls.append(call)

    return _once(fn, count)


class CollectiveBytes(contextlib.AbstractContextManager):
    """Counts, in :attr:`bytes`, the bytes this rank hands to ``torch.distributed``'s
    collectives inside its ``with`` blocks: ``numel * element_size`` of the tensor each call
    is given, for the calls made through the module's attributes from Python (see the
    module's docstring for which collectives, which tensor and what it cannot see).
    :attr:`calls` keeps each call, in order: a :class:`Call` (name, bytes, group size)."""

    def __init__(self):
        self.bytes = 0
        self.calls: list[Call] = []

    def __enter__(self) -> CollectiveBytes:
        with _lock:
            if self in _open:
                raise RuntimeError(
                    "this CollectiveBytes is already counting (its block is open); a nested "
                    "block needs a counter of its own"
                )
            if not _open:
                _rebind(_torchs, {name: _counting(name, getattr(dist, name)) for name in COUNTED})
            _open.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _lock:
            _open.remove(self)
            if not _open:
                _restore(_torchs)

    @contextlib.contextmanager
    def counting(self):
        """This counter's block around a training step, with ZeRO-3's expected warning
        silenced: :class:`~lsdl_lab.memory.ZeroOptimizer` gathers a unit's parameters in a
        backward pre-hook, which torch warns about for the first layer (whose input needs
        no gradient)."""
        with self, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            yield


# -- point-to-point messages ------------------------------------------------------------

# torch.distributed's collectives (those this torch has): inside a SentMessages block with
# forbid=True each raises BuiltInCollective
BUILT_IN_COLLECTIVES = tuple(
    name
    for name in (
        "all_reduce",
        "all_reduce_coalesced",
        "reduce",
        "broadcast",
        "all_gather",
        "all_gather_coalesced",
        "all_gather_into_tensor",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_to_all",
        "all_to_all_single",
        "gather",
        "scatter",
        "all_gather_object",
        "broadcast_object_list",
        "gather_object",
        "scatter_object_list",
    )
    if hasattr(dist, name)
)
# torch's own point-to-point functions, as imported
_SEND, _ISEND = dist.send, dist.isend


class BuiltInCollective(RuntimeError):
    """A built-in collective was called inside a block that forbids them."""


class SentMessages(contextlib.AbstractContextManager):
    """The point-to-point messages this rank sends inside the ``with`` block: ``numels``
    holds the entries of each, in order, and :attr:`bytes` their total size. Counted:
    ``dist.send``, ``dist.isend`` and every ``dist.P2POp`` of ``isend`` handed to
    ``dist.batch_isend_irecv``, called through the attributes of ``torch.distributed`` or
    of ``torch.distributed.distributed_c10d`` (as
    :class:`~lsdl_lab.distributed.CollectiveBytes` counts the collectives, which it does and
    this does not). With ``forbid=True`` each of :data:`BUILT_IN_COLLECTIVES` raises
    :class:`BuiltInCollective` inside the block, under both names. The block rebinds those
    attributes in both modules and restores them when it closes; blocks do not nest.

    Inside the block ``isend`` *is* the counting function, in both modules (torch checks a
    ``P2POp``'s function against the module's ``isend``, and ``batch_isend_irecv`` runs each
    op's function, which counts its message): a ``P2POp`` is built and run in one block."""

    def __init__(self, forbid: bool = False):
        self.forbid = forbid
        self.numels: list[int] = []
        self.bytes = 0
        self._saved: dict = {}

    def _record(self, tensor: torch.Tensor, *args, **kwargs) -> None:
        self.numels.append(tensor.numel())
        self.bytes += tensor.numel() * tensor.element_size()

    def __enter__(self) -> SentMessages:
        if self._saved or any(m.isend is not _ISEND for m in _MODULES):
            raise RuntimeError("a SentMessages block is already open (blocks do not nest)")

        def forbidden(name):
            def call(*args, **kwargs):
                raise BuiltInCollective(
                    f"dist.{name} is a built-in collective, not allowed here: build the "
                    "all-reduce from point-to-point messages (dist.isend, dist.irecv, "
                    "dist.P2POp with dist.batch_isend_irecv)"
                )

            return call

        functions = {"send": _once(_SEND, self._record), "isend": _once(_ISEND, self._record)}
        for name in BUILT_IN_COLLECTIVES if self.forbid else ():
            functions[name] = forbidden(name)
        _rebind(self._saved, functions)
        return self

    def __exit__(self, *exc) -> None:
        _restore(self._saved)
