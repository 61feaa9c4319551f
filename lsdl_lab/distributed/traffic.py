r"""The one count of the bytes a rank hands to collectives: :class:`CollectiveBytes`.

Every measurement of communication in the book goes through it: the entry point's
records (:mod:`lsdl_lab.run`, every parallel mode), the bytes per step of each gradient
compressor (Chapter 7 and Lab 7, torch's hooks and :mod:`lsdl_lab.compress`'s alike), the
all-reduces of a tensor-parallel forward. ::

    counter = CollectiveBytes()
    with counter:
        loss.backward()  # DDP's hook all-reduces the gradients
    counter.bytes        # 4 d on every rank, for d float32 gradients

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

(The flat forms are ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` before torch
2.13.)

That is the convention of the formulas the book checks (an all-reduce of :math:`n` floats
counts :math:`4n`), not the traffic on a link: a ring all-reduce puts about
:math:`2\frac{p-1}{p}` times what it is handed through each rank's link, a ring all-gather
:math:`p - 1` times (Chapter 7's cost model). Every process group counts, and so does
an ``async_op=True`` call (when it is made, not when it completes).

**Which calls it sees.** Those made from Python through ``torch.distributed``'s module
attributes (``dist.all_reduce(...)``) while a counter's block is open: the block rebinds
those attributes to counting wrappers and restores torch's functions when the last open
block closes. That covers DDP's Python communication hooks (torch's
``default_hooks.allreduce_hook``, ``fp16_compress_hook``, ``powerSGD_hook`` and the hooks
of :mod:`lsdl_lab.compress`), :class:`~lsdl_lab.memory.ZeroOptimizer`, FSDP2 and the
library's collectives. It does not see what C++ calls: DDP's built-in reducer (register
``default_hooks.allreduce_hook`` to count DDP's all-reduces, as :mod:`lsdl_lab.run`
does), the broadcast of DDP's constructor, a compiled graph's collectives; nor
point-to-point messages (``send``, ``recv``), nor a caller that bound the function to a
name of its own before the block opened (``from torch.distributed import all_reduce``).
Where torch 2.13 has both names of a flat collective, both are counted: the deprecated one
calls the new one inside torch, past the wrapper, so a call counts once either way.

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

import torch.distributed as dist

__all__ = ["COUNTED", "CollectiveBytes"]

# collective -> (position, keyword) of the tensor this rank hands to it; the flat forms
# under each name this torch has (see the module's docstring)
_INPUTS = {
    "all_reduce": (0, "tensor"),
    "broadcast": (0, "tensor"),
    "all_gather": (1, "tensor"),
    "all_gather_single": (1, "input_tensor"),
    "all_gather_into_tensor": (1, "input_tensor"),
    "reduce_scatter_single": (1, "input"),
    "reduce_scatter_tensor": (1, "input"),
}
COUNTED = tuple(name for name in _INPUTS if hasattr(dist, name))
"""The names of the ``torch.distributed`` functions a counter sees, on this torch."""

_open: list[CollectiveBytes] = []  # the counters whose blocks are open
_torchs: dict = {}  # torch.distributed's own functions, while a block is open
_lock = threading.Lock()


def _counting(name: str, fn):
    position, keyword = _INPUTS[name]

    @functools.wraps(fn)
    def counted(*args, **kwargs):
        tensor = args[position] if len(args) > position else kwargs[keyword]
        nbytes = tensor.numel() * tensor.element_size()
        for counter in tuple(_open):
            counter.bytes += nbytes
        return fn(*args, **kwargs)

    return counted


class CollectiveBytes(contextlib.AbstractContextManager):
    """Counts, in :attr:`bytes`, the bytes this rank hands to ``torch.distributed``'s
    collectives inside its ``with`` blocks: ``numel * element_size`` of the tensor each call
    is given, for the calls made through the module's attributes from Python (see the
    module's docstring for which collectives, which tensor and what it cannot see)."""

    def __init__(self):
        self.bytes = 0

    def __enter__(self) -> CollectiveBytes:
        with _lock:
            if self in _open:
                raise RuntimeError(
                    "this CollectiveBytes is already counting (its block is open); a nested "
                    "block needs a counter of its own"
                )
            if not _open:
                for name in COUNTED:
                    _torchs[name] = getattr(dist, name)
                    setattr(dist, name, _counting(name, _torchs[name]))
            _open.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _lock:
            _open.remove(self)
            if not _open:
                for name, fn in _torchs.items():
                    setattr(dist, name, fn)
                _torchs.clear()

    @contextlib.contextmanager
    def counting(self):
        """This counter's block around a training step, with ZeRO-3's expected warning
        silenced: :class:`~lsdl_lab.memory.ZeroOptimizer` gathers a unit's parameters in a
        backward pre-hook, which torch warns about for the first layer (whose input needs
        no gradient)."""
        with self, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            yield
