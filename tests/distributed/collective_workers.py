"""The rank-side half of test_collectives.py's checks of all-to-all and of the all-reduces
that scale (Rabenseifner's, the binary tree, the hierarchical one). A spawned rank imports
its worker by module name, so it lives in this plain module (pytest's pythonpath setting
puts this folder on sys.path, which the ranks inherit).

Every hand-built collective runs inside ``SentMessages(forbid=True)``: it counts the bytes
each rank sends, and any built-in collective called inside raises. The references
(``dist.all_to_all_single``, ``dist.all_reduce``) run outside it."""

import hashlib
import zlib

import torch
import torch.distributed as dist

from lsdl_lab.distributed.collectives import (
    all_to_all,
    binary_tree_all_reduce,
    hierarchical_all_reduce,
    rabenseifner_all_reduce,
)
from lsdl_lab.distributed.traffic import SentMessages

# sizes smaller than the world, prime, and one that every world of 2-4 divides (where the
# bytes sent are checked against the formulas)
SIZES = (1, 3, 7, 1000, 1200, 10_007)
EVEN = 1200
DTYPES = (torch.float32, torch.float64, torch.int64, torch.float16, torch.bfloat16, torch.uint8)


def _generator(*seed):
    return torch.Generator().manual_seed(zlib.crc32(repr(seed).encode()))  # same on every rank


def _values(shape, dtype, *seed):
    gen = _generator(*seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(0, 100, shape, generator=gen).to(dtype)


def _digest(tensor):
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def uneven_splits(rank, world_size):
    """Rows rank ``i`` sends rank ``j`` in the uneven cases, zeros among them."""
    return [[(3 * i + j) % 4 for j in range(world_size)] for i in range(world_size)][rank]


def all_to_all_report(rank, world_size):
    """For each dtype, even blocks of 2-D tensors, uneven blocks, and a world's worth of
    single rows: equal to dist.all_to_all_single, bytes sent, and nothing left of the
    input changed."""
    w, report = world_size, {}
    incoming = [uneven_splits(i, w)[rank] for i in range(w)]
    cases = {"even": (6 * w, None, None), "uneven": (None, uneven_splits(rank, w), incoming)}
    cases["one row each"] = (w, None, None)
    for dtype in DTYPES:
        for case, (rows, sends, receives) in cases.items():
            rows_in = rows if sends is None else sum(sends)
            rows_out = rows if receives is None else sum(receives)
            x = _values((rows_in, 3), dtype, rank, case, str(dtype))
            kept = x.clone()
            mine, ref = torch.empty(rows_out, 3, dtype=dtype), torch.empty(rows_out, 3, dtype=dtype)
            dist.all_to_all_single(ref, x, receives, sends)
            with SentMessages(forbid=True) as sent:
                returned = all_to_all(mine, x, output_split_sizes=receives, input_split_sizes=sends)
            report[str(dtype), case] = {
                "equal": torch.equal(mine, ref),
                "returned": returned is mine,
                "input_unchanged": torch.equal(x, kept),
                "bytes": sent.bytes,
                "input_bytes": x.numel() * x.element_size(),
                "others_bytes": (rows_in - (rows_in // w if sends is None else sends[rank]))
                * 3
                * x.element_size(),
                "messages": len(sent.numels),
            }
    return report


def _all_reduces(world_size):
    """(name, function) of every all-reduce checked in a world of this size: the
    hierarchical one at each node size that divides it."""
    out = [("rabenseifner", rabenseifner_all_reduce), ("binary tree", binary_tree_all_reduce)]
    for local in (k for k in range(1, world_size + 1) if world_size % k == 0):
        out.append((f"hierarchical {local}", _hierarchical(local)))
    return out


def _hierarchical(local_size):
    def run(tensor, group=None):
        return hierarchical_all_reduce(tensor, local_size, group=group, timeout=30)

    return run


def all_reduce_report(rank, world_size):
    """For every all-reduce and size: exact on integers, float64 error against
    dist.all_reduce, a digest (to compare ranks), the bytes this rank sent, and the same
    on a 2-D float32 tensor."""
    report = {}
    for n in SIZES:
        exact = sum(_values((n,), torch.int64, i, n) for i in range(world_size))
        builtin = _values((n,), torch.float64, rank, n)
        dist.all_reduce(builtin)
        for name, all_reduce in _all_reduces(world_size):
            ints = _values((n,), torch.int64, rank, n)
            x = _values((n,), torch.float64, rank, n)
            with SentMessages(forbid=True) as sent:
                returned = all_reduce(x)
                all_reduce(ints)
            report[name, n] = {
                "int_exact": torch.equal(ints, exact),
                "returned": returned is x,
                "error": ((x - builtin).abs().max() / builtin.abs().max()).item(),
                "digest": _digest(x),
                "bytes": sent.bytes // 2,  # the float64 and the int64 call alike
            }
    matrix = _values((5, 7), torch.float32, rank, "matrix")
    total = matrix.clone()
    dist.all_reduce(total)
    for name, all_reduce in _all_reduces(world_size):
        x = matrix.clone()
        all_reduce(x)
        report[name, "5x7"] = {"error": ((x - total).abs().max() / total.abs().max()).item()}
    return report


def subgroup_report(rank, world_size):
    """Every all-reduce on the group of ranks 1..W-1 (3 ranks at W=4, one at W=2): peers
    must be addressed by their rank in the group. (The hierarchical one at node sizes 1
    and W-1, which need no sub-groups of their own.)"""
    members = list(range(1, world_size))
    group = dist.new_group(members)
    report = None
    if rank in members:
        report = {}
        for n in (1, 7, 1000):
            exact = sum(_values((n,), torch.int64, i, n) for i in members)
            for name, all_reduce in _all_reduces(len(members)):
                ints = _values((n,), torch.int64, rank, n)
                all_reduce(ints, group=group)
                report[name, n] = torch.equal(ints, exact)
    dist.barrier()  # rank 0 holds the store: it must not leave while the others use it
    return report


def _error(call):
    try:
        call()
    except (TypeError, ValueError) as error:
        return type(error).__name__, str(error)
    return None


def bad_arguments_report(rank, world_size):
    """The errors of bad calls, each raised before any message is sent (so the world goes
    on): (type, message) per case, None where nothing was raised."""
    w, x = world_size, torch.zeros(2 * world_size, 3)
    out = torch.empty_like(x)
    not_dividing = next((k for k in range(2, w) if w % k), w + 1)  # W=2: out of range
    return {
        "rows not divisible": _error(lambda: all_to_all(out[:-1], x[:-1])),
        "splits of the wrong length": _error(
            lambda: all_to_all(out, x, input_split_sizes=[2] * (w - 1) + [1])
        ),
        "splits not adding up": _error(lambda: all_to_all(out, x, input_split_sizes=[1] * w)),
        "other columns": _error(lambda: all_to_all(torch.empty(2 * w, 4), x)),
        "other dtype": _error(lambda: all_to_all(out.double(), x)),
        "own block mismatch": _error(
            lambda: all_to_all(
                torch.empty(2 * w + 1, 3),
                x,
                output_split_sizes=[3 if i == rank else 2 for i in range(w)],
            )
        ),
        "splits passed as group": _error(lambda: all_to_all(out, x, [2] * w)),
        "local_size not dividing": _error(
            lambda: hierarchical_all_reduce(torch.zeros(4), not_dividing)
        ),
        "local_size 0": _error(lambda: hierarchical_all_reduce(torch.zeros(4), 0)),
        "non-contiguous": _error(lambda: rabenseifner_all_reduce(torch.zeros(3, 3).T)),
        "tree non-contiguous": _error(lambda: binary_tree_all_reduce(torch.zeros(3, 3).T)),
    }
