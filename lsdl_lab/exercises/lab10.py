"""Checkers of Lab 10, communication at scale: an all-to-all from point-to-point messages,
one block step of ring attention (the online-softmax update), and a mixture of experts'
token dispatch.

The all-to-all is checked as Lab 7's ring is (:mod:`lsdl_lab.exercises.lab07`): its
*source* is sent to a real world of three processes, where each rank defines it in a
namespace holding ``torch``, ``dist`` and ``math`` and calls it on uneven blocks (some
empty, some of several columns), the built-in collectives forbidden and every message
it sends counted (:class:`~lsdl_lab.distributed.traffic.SentMessages`). Its result is
compared with ``dist.all_to_all_single`` on the same tensors, called after the student's
function, outside the forbidding block. A pairwise all-to-all sends each block once,
straight to its rank: at most p - 1 messages, and exactly the blocks meant for the other
ranks.

The online-softmax step is compared, step by step, with
:func:`lsdl_lab.parallel.context.online_softmax_step` on a sequence of key/value blocks
(one whose scores would overflow ``exp`` without the running maximum, one that hides
every key from a query), and after the last block ``acc / l`` with full softmax
attention over all the keys. The dispatch is compared with :func:`lsdl_lab.moe.route`,
the library's router: the experts each token chose, the gates, and which assignment
keeps which slot of its expert's queue and which is dropped.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..check import CheckFailed, exercise
from ..check.compare import difference
from ..distributed.traffic import BuiltInCollective, SentMessages
from ..distributed.world import WorkerError, spawn
from ..moe import capacity, route
from ..parallel.context import online_softmax_step
from .lab07 import ring_source

__all__ = [
    "A2A_CASES",
    "A2A_WORLD",
    "all_to_all",
    "all_to_all_inputs",
    "check_all_to_all",
    "check_dispatch",
    "check_online_softmax_step",
    "dispatch",
    "online_softmax_step",
    "run_student_all_to_all",
]

A2A_WORLD = 3  # at 2 ranks "the next rank" and "the previous rank" are the same one
A2A_TIMEOUT = 10.0  # seconds: a deadlocked exchange ends after this
# Each case: (rows[i][j], the rows rank i sends rank j; the columns of a row). Even blocks,
# uneven ones with empty blocks, and rows of several columns.
A2A_CASES = (
    (((2, 2, 2), (2, 2, 2), (2, 2, 2)), 1),
    (((1, 0, 3), (2, 4, 0), (0, 1, 5)), 1),
    (((3, 1, 2), (0, 2, 1), (4, 0, 0)), 3),
)


def all_to_all(output, input, output_split_sizes, input_split_sizes, group=None):
    """The reference pairwise exchange, self-contained as the checker requires: rank r
    copies its own block, then at step s = 1, ..., p - 1 sends its block for rank r + s
    while it receives rank r - s's block for it, the two posted together."""
    r, p = dist.get_rank(group), dist.get_world_size(group)
    sends = input.split(list(input_split_sizes))
    receives = output.split(list(output_split_sizes))
    receives[r].copy_(sends[r])
    for s in range(1, p):
        to, source = (r + s) % p, (r - s) % p
        ops = []
        if sends[to].numel():
            ops.append(dist.P2POp(dist.isend, sends[to].contiguous(), to, group))
        if receives[source].numel():
            ops.append(dist.P2POp(dist.irecv, receives[source], source, group))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
    return output


def all_to_all_inputs(rank: int, rows, columns: int) -> tuple[torch.Tensor, list, list]:
    """Rank ``rank``'s float64 input for a case (``rows[i][j]`` rows from rank i to rank
    j): row k holds ``1000 * rank + k`` plus a tenth of its column, so that every row of
    the world is different; and the input and output split sizes."""
    p = len(rows)
    sent = list(rows[rank])
    base = 1000 * rank + torch.arange(sum(sent), dtype=torch.float64)
    x = base[:, None] + torch.arange(columns, dtype=torch.float64) / 10
    return x, [rows[j][rank] for j in range(p)], sent


def run_student_all_to_all(rank, world_size, source: str, name: str, cases) -> list[dict]:
    """Worker: define the student's function from ``source`` and run it on each case's
    input, the built-in collectives forbidden and its messages counted; then
    ``dist.all_to_all_single`` on the same input. For each case: the largest error, whether
    the output passed was filled in, the entries of each message sent, and the entries of
    the blocks meant for the other ranks."""
    namespace = {"torch": torch, "dist": dist, "math": math}
    exec(compile(source, f"<{name}>", "exec"), namespace)  # noqa: S102 -- the student's code
    fn = namespace[name]
    out = []
    for rows, columns in cases:
        x, out_splits, in_splits = all_to_all_inputs(rank, rows, columns)
        output = torch.full((sum(out_splits), columns), math.nan, dtype=torch.float64)
        with SentMessages(forbid=True) as sent:
            returned = fn(output, x.clone(), list(out_splits), list(in_splits))
        result = returned if isinstance(returned, torch.Tensor) else output
        expected = torch.empty_like(output)
        dist.all_to_all_single(expected, x, out_splits, in_splits)
        same_shape = result.shape == expected.shape
        out.append(
            {
                "rows": rows,
                "error": (result - expected).abs().max().item() if same_shape else math.inf,
                "shape": tuple(result.shape),
                "expected_shape": tuple(expected.shape),
                "own_block_missing": _own_block_missing(result, expected, out_splits, rank),
                "in_place": not output.isnan().any().item() or output.numel() == 0,
                "sends": sent.numels,
                "blocks": [n * columns for j, n in enumerate(in_splits) if j != rank and n],
            }
        )
    return out


def _own_block_missing(result, expected, out_splits, rank) -> bool:
    """Whether every block but this rank's own is right, and its own is not."""
    if result.shape != expected.shape:
        return False
    mine = torch.zeros(result.shape[0], dtype=torch.bool)
    start = sum(out_splits[:rank])
    mine[start : start + out_splits[rank]] = True
    wrong = ~torch.isclose(result, expected).all(-1)
    return bool(wrong.any()) and bool((wrong <= mine).all())


def _worker_failure(err: WorkerError, name: str) -> Exception:
    """What to tell the student when a rank raised: the stub, a built-in collective, a
    deadlock, a helper the ranks do not have."""
    last = err.traceback.strip().splitlines()[-1]
    lasts = [last, *err.others.values()]  # a rank may only have lost its peer
    if "NotImplementedError" in err.traceback:
        return NotImplementedError(
            f"{name} is not implemented yet: replace the `raise NotImplementedError` with "
            "your solution"
        )
    for line in lasts:
        if BuiltInCollective.__name__ in line:
            collective = line.partition(": ")[2].partition(" is a built-in")[0]
            return CheckFailed(
                f"{name}: {collective} is a built-in collective, not allowed here: send "
                "each block with dist.isend / dist.P2POp and receive with dist.irecv"
            )
    hint = ""
    if any("timed out" in line.lower() or "timeout" in line.lower() for line in lasts):
        hint = (
            "\n  hint: the ranks waited for each other until the timeout. At step s rank r "
            "sends to r + s and receives from r - s (not from r + s, which is sending to "
            "r + 2s); post the send and the receive together before waiting"
        )
    elif "NameError" in last:
        hint = (
            "\n  hint: the ranks run your function alone, with only torch, dist and math "
            "defined: put every helper inside the function"
        )
    elif "split" in last.lower() or "size" in last.lower():
        hint = (
            "\n  hint: cut input by input_split_sizes (what this rank sends each rank) and "
            "output by output_split_sizes (what it receives from each)"
        )
    return CheckFailed(f"{name} failed on rank {err.rank} of a world of {A2A_WORLD}: {last}{hint}")


@exercise("lab10.all_to_all")
def check_all_to_all(student_fn) -> None:
    source = ring_source(student_fn)
    name = student_fn.__name__
    try:
        ranks = spawn(
            run_student_all_to_all, A2A_WORLD, source, name, A2A_CASES, timeout=A2A_TIMEOUT
        )
    except WorkerError as err:
        raise _worker_failure(err, name) from None
    for rank, results in enumerate(ranks):
        for case, r in enumerate(results, 1):
            rows = r["rows"]
            where = f"{name}: on rank {rank}, case {case} (rows[i][j] sent from i to j: {rows})"
            if r["shape"] != r["expected_shape"]:
                raise CheckFailed(
                    f"{where}: the result has shape {r['shape']}, dist.all_to_all_single's "
                    f"{r['expected_shape']}"
                )
            if r["own_block_missing"]:
                raise CheckFailed(
                    f"{where}: every block is right but the rank's own: block r of the "
                    "input stays on rank r (copy it into block r of the output)"
                )
            if r["error"] > 0:  # copies of float64 values: nothing may change them
                raise CheckFailed(
                    f"{where}: the output differs from dist.all_to_all_single's by up to "
                    f"{r['error']:.3g}; block j of rank i's input must become block i of "
                    "rank j's output"
                )
            if not r["in_place"]:
                raise CheckFailed(
                    f"{where}: write the result into the output tensor passed, as "
                    "dist.all_to_all_single does"
                )
            sends, blocks = r["sends"], r["blocks"]
            if len(sends) > A2A_WORLD - 1 or sorted(s for s in sends if s) != sorted(blocks):
                raise CheckFailed(
                    f"{where}: the rank sent {len(sends)} messages of {sends} numbers; a "
                    f"pairwise exchange sends each block once, straight to its rank: "
                    f"{sorted(blocks)} (nothing to itself, nothing for an empty block, at "
                    f"most p - 1 = {A2A_WORLD - 1} messages)"
                )
    print(
        f"✔ {name}: equals dist.all_to_all_single at world {A2A_WORLD} on "
        f"{len(A2A_CASES)} cases (even, uneven with empty blocks, rows of 3 columns), each "
        "block sent once, straight to its rank, no built-in collective"
    )


# ---------------------------------------------------------------------------------------
# One block of ring attention: the online-softmax update


def _softmax_cases():
    """(q, [(k, v, mask), ...]) sequences: float64, 2 heads, 3 queries of 4 features."""
    g = torch.Generator().manual_seed(10)

    def rand(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=g, dtype=torch.float64)

    q = rand(1, 2, 3, 4)
    plain = [(rand(1, 2, n, 4), rand(1, 2, n, 4), None) for n in (3, 2, 4)]
    # the second block's scores reach hundreds: exp overflows without the running max
    first = (rand(1, 2, 3, 4), rand(1, 2, 3, 4), None)
    loud = [first, (rand(1, 2, 2, 4, scale=400.0), rand(1, 2, 2, 4), None)]
    # the first block hides every key from query 0 (it has seen none yet); the diagonal
    # block of causal ring attention comes second
    hidden = torch.tensor([[False, False, False], [True, False, True], [True, True, True]])
    causal = torch.ones(3, 3, dtype=torch.bool).tril()
    masked = [
        (rand(1, 2, 3, 4), rand(1, 2, 3, 4), hidden),
        (rand(1, 2, 3, 4), rand(1, 2, 3, 4), causal),
    ]
    return {"three plain blocks": (q, plain), "large scores": (q, loud), "masks": (q, masked)}


def _full_attention(q, blocks):
    """softmax(q K^T / sqrt(d)) V over every block's keys, masked keys left out."""
    k = torch.cat([b[0] for b in blocks], -2)
    v = torch.cat([b[1] for b in blocks], -2)
    masks = [
        torch.ones(q.shape[-2], b[0].shape[-2], dtype=torch.bool) if b[2] is None else b[2]
        for b in blocks
    ]
    s = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(
        ~torch.cat(masks, -1), -math.inf
    )
    return s.softmax(-1) @ v


def _step_hint(got, expected) -> str:
    """What a wrong (acc, m, l) most often means."""
    acc, m, l = got
    acc0, m0, l0 = expected
    if any(t.isnan().any() for t in got):
        return (
            "NaN: a query that has seen no key yet has m = -inf, and exp(-inf - (-inf)) is "
            "NaN; shift its scores by 0 instead (m'.nan_to_num(neginf=0.0))"
        )
    unshifted = l0 * torch.exp(m0.nan_to_num(neginf=0.0))  # the sums without the max
    if any(t.isinf().any() for t in (acc, l)) or torch.allclose(l, unshifted):
        return (
            "subtract the new running maximum m' from the scores before exp: exp(S - m'), "
            "not exp(S), which overflows once a score passes 709 (in float64)"
        )
    if torch.equal(m, m0) and torch.allclose(l, l0) and not torch.allclose(acc, acc0):
        return "l is right but acc is not: rescale the old acc by exp(m - m') too"
    if torch.equal(m, m0) and not torch.allclose(l, l0):
        return "m is right but l is not: l' = exp(m - m') l + sum_j exp(S_j - m')"
    if not torch.allclose(m, m0):
        return "m' is the running maximum of the scores S = q k^T / sqrt(d) (masked keys excluded)"
    return ""


@exercise("lab10.online_softmax_step")
def check_online_softmax_step(student_fn) -> None:
    for label, (q, blocks) in _softmax_cases().items():
        shape = q.shape[:-1]
        state = (torch.zeros_like(q), q.new_full(shape, -math.inf), q.new_zeros(shape))
        expected = state
        for i, (k, v, mask) in enumerate(blocks, 1):
            args = (q.clone(), k.clone(), v.clone())
            extra = () if mask is None else (mask.clone(),)
            expected = online_softmax_step(*expected, *args, *extra)
            try:
                got = student_fn(*(t.clone() for t in state), *args, *extra)
            except NotImplementedError:
                raise NotImplementedError(
                    f"{student_fn.__name__} is not implemented yet: replace the `raise "
                    "NotImplementedError` with your solution"
                ) from None
            except Exception as exc:
                raise CheckFailed(
                    f"{student_fn.__name__}: {label}, block {i} of {len(blocks)} raised "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            if not isinstance(got, tuple | list) or len(got) != 3:
                raise CheckFailed(
                    f"{student_fn.__name__}: return the triple (acc, m, l), got "
                    f"{type(got).__name__}"
                )
            for what, a, b in zip(("acc", "m", "l"), got, expected, strict=True):
                found = difference(a, b, what, 1e-9, 1e-12, True)
                if found is not None:
                    hint = _step_hint(tuple(got), expected)
                    raise CheckFailed(
                        f"{student_fn.__name__}: {label}, block {i} of {len(blocks)}"
                        f"{'' if mask is None else ' (with a mask)'}: {what} differs from "
                        f"lsdl_lab.parallel.context.online_softmax_step's\n  {found}"
                        + (f"\n  hint: {hint}" if hint else "")
                    )
            state = tuple(got)
        acc, m, l = state
        found = difference(
            acc / l[..., None], _full_attention(q, blocks), "acc / l", 1e-9, 1e-12, False
        )
        if found is not None:  # unreachable when every step matched; kept as the claim
            raise CheckFailed(
                f"{student_fn.__name__}: {label}: acc / l is not attention\n  {found}"
            )
    print(
        f"✔ {student_fn.__name__}: equals online_softmax_step block by block, and acc / l "
        "after the last block is softmax attention over all the keys (large scores and "
        "masks included)"
    )


# ---------------------------------------------------------------------------------------
# A mixture of experts' token dispatch


def dispatch(logits, top_k, capacity_factor):
    """Top-k routing with capacity (GShard, Lepikhin et al. 2021; Switch, Fedus et al.
    2022): for each token t and choice c (best first), ``expert[t, c]``, ``gate[t, c]``
    (the softmax probability, renormalized over the k choices when k > 1) and
    ``slot[t, c]``, the assignment's place in its expert's queue, or -1 when it is past
    the capacity C = ceil(capacity_factor * T * k / E) and dropped. Every token's first
    choice queues before any token's second."""
    T, E = logits.shape
    probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(-1)
    gate, expert = probs.topk(top_k, dim=-1)
    if top_k > 1:
        gate = gate / gate.sum(-1, keepdim=True)
    C = math.ceil(capacity_factor * T * top_k / E)
    place = _places(expert, E)
    return expert, gate, torch.where(place < C, place, -1)


def _places(expert: torch.Tensor, E: int, choice_major: bool = True) -> torch.Tensor:
    """Each assignment's place in its expert's queue, (T, k), before the capacity cut:
    choice-major (every token's first choice, then every second), or token-major."""
    T, k = expert.shape
    queue = expert.t().reshape(-1) if choice_major else expert.reshape(-1)
    place = F.one_hot(queue, E).cumsum(0).gather(1, queue[:, None]).squeeze(1) - 1
    return place.view(k, T).t() if choice_major else place.view(T, k)


def _dispatch_cases():
    g = torch.Generator().manual_seed(4)
    skewed = torch.randn(12, 4, generator=g, dtype=torch.float64)
    skewed[:, 0] += 2.0  # most tokens want expert 0: drops
    return {
        "8 tokens, 4 experts, top-2, capacity factor 1": (
            torch.randn(8, 4, generator=g, dtype=torch.float64),
            2,
            1.0,
        ),
        "10 tokens, 4 experts, top-1 (Switch), capacity factor 1.25": (
            torch.randn(10, 4, generator=g, dtype=torch.float64),
            1,
            1.25,
        ),
        "12 tokens preferring expert 0, top-2, capacity factor 0.75": (skewed, 2, 0.75),
        "6 tokens, 3 experts, top-3, capacity factor 2 (float32)": (
            torch.randn(6, 3, generator=g),
            3,
            2.0,
        ),
    }


def _kept_by_expert(expert, slot, E):
    """For each expert, its kept tokens in slot order (from a student's answer)."""
    T, k = expert.shape
    token = torch.arange(T)[:, None].expand(T, k)
    out = []
    for e in range(E):
        here = (expert == e) & (slot >= 0)
        order = slot[here].argsort()
        out.append((token[here][order].tolist(), sorted(slot[here].tolist())))
    return out


def _dispatch_hint(logits, top_k, capacity_factor, slot) -> str:
    """Name the usual mistakes: token-major queueing, a floor or off-by-one capacity."""
    T, E = logits.shape
    expert = dispatch(logits, top_k, capacity_factor)[0]
    C = capacity(T, E, top_k, capacity_factor)
    token_major = _places(expert, E, choice_major=False)
    if torch.equal(slot, torch.where(token_major < C, token_major, -1)):
        return (
            "you queued token by token (token 0's choices, then token 1's); every token's "
            "first choice queues before any token's second (GShard)"
        )
    place = _places(expert, E)
    for wrong, what in (
        (math.floor(capacity_factor * T * top_k / E), "C = floor(...); it is ceil(...)"),
        (C + 1, "one slot too many: slots 0, ..., C - 1 are kept"),
        (C - 1, "one slot too few: slots 0, ..., C - 1 are kept"),
    ):
        if wrong != C and torch.equal(slot, torch.where(place < wrong, place, -1)):
            return what
    return ""


@exercise("lab10.dispatch")
def check_dispatch(student_fn) -> None:
    name = student_fn.__name__
    for label, (logits, k, cf) in _dispatch_cases().items():
        T, E = logits.shape
        try:
            got = student_fn(logits.clone(), k, cf)
        except NotImplementedError:
            raise NotImplementedError(
                f"{name} is not implemented yet: replace the `raise NotImplementedError` "
                "with your solution"
            ) from None
        except Exception as exc:
            raise CheckFailed(f"{name}: {label} raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(got, tuple | list) or len(got) != 3:
            raise CheckFailed(f"{name}: return (expert, gate, slot), got {type(got).__name__}")
        expert, gate, slot = (torch.as_tensor(t) for t in got)
        for what, t in (("expert", expert), ("gate", gate), ("slot", slot)):
            if t.shape != (T, k):
                raise CheckFailed(
                    f"{name}: {label}: {what} has shape {tuple(t.shape)} (expected (T, k) = "
                    f"{(T, k)}: one entry per token and choice)"
                )
        routing = route(logits, k, cf)
        routed = torch.bincount(expert.reshape(-1).long(), minlength=E)
        if not torch.equal(routed, routing.routed):
            raise CheckFailed(
                f"{name}: {label}: the experts chosen give {routed.tolist()} assignments per "
                f"expert, lsdl_lab.moe.route {routing.routed.tolist()}\n  hint: each token "
                "picks the k experts of largest softmax probability, best first"
            )
        ref_expert, ref_gate, _ = dispatch(logits, k, cf)
        if not torch.equal(expert.long(), ref_expert):
            raise CheckFailed(
                f"{name}: {label}: the right experts, in another order: list each token's "
                "choices best first (torch.topk's order)"
            )
        found = difference(gate.to(ref_gate.dtype), ref_gate, "gate", 1e-6, 1e-9, False)
        if found is not None:
            hint = "for k > 1 the k gates are renormalized to add up to 1 (GShard)" if k > 1 else ""
            raise CheckFailed(
                f"{name}: {label}: the gates differ\n  {found}"
                + (f"\n  hint: {hint}" if hint else "")
            )
        start = torch.cat([routing.counts.new_zeros(1), routing.counts.cumsum(0)]).tolist()
        mine = _kept_by_expert(expert.long(), slot.long(), E)
        for e in range(E):
            want = routing.token[start[e] : start[e + 1]].tolist()
            tokens, slots = mine[e]
            if tokens != want or slots != list(range(len(want))):
                hint = _dispatch_hint(logits, k, cf, slot.long())
                raise CheckFailed(
                    f"{name}: {label}: expert {e} (capacity C = {routing.capacity}) keeps "
                    f"tokens {tokens} in slots {slots}; lsdl_lab.moe.route keeps {want} in "
                    f"slots {list(range(len(want)))} ({routing.dropped} assignments dropped in "
                    "all, slot -1)" + (f"\n  hint: {hint}" if hint else "")
                )
        dropped = int((slot < 0).sum())
        if dropped != routing.dropped:
            raise CheckFailed(
                f"{name}: {label}: {dropped} assignments have slot -1; route drops "
                f"{routing.dropped}"
            )
    print(
        f"✔ {name}: the experts, gates, slots and drops of lsdl_lab.moe.route on "
        f"{len(_dispatch_cases())} batches (top-1, top-2, top-3, capacity factors 0.75 to 2)"
    )
