"""Checkers of Lab 7, communication: a ring all-reduce, an error-feedback step, a 1-bit
compressor; and :class:`SentMessages`, the count of the point-to-point messages a rank
sends, which the ring's checker and the book's measurement of the collectives share.

The ring all-reduce is checked on a real world of processes. A spawned rank cannot import
a function defined in a notebook (it would re-run the notebook, pytorch #20375), so the
checker sends the function's *source* (``inspect.getsource``) to the ranks, each rank
runs it with ``exec`` in a namespace that holds ``torch``, ``dist`` and ``math``, and
calls it on tensors of several sizes, some smaller than the world. The function must
therefore be self-contained: one ``def`` using only those names. What runs on the ranks
is exactly the student's code, on real ``isend``/``irecv`` messages. Inside the call the
built-in collectives raise (a ring that calls ``dist.all_reduce`` is not a ring), and every
message the rank sends is counted: a ring sends 2(p - 1) messages of one chunk each, at
most ceil(n / p) numbers. The result is compared with the sum, computed from the inputs;
a ring that deadlocks ends by the group's timeout and is reported as such.

The other two are checked in this process against the library (:mod:`lsdl_lab.compress`).
"""

from __future__ import annotations

import inspect
import math
import textwrap

import torch
import torch.distributed as dist

from ..check import CheckFailed, exercise
from ..check.compare import difference
from ..compress import ErrorFeedback, SignSGD, TopK, unpack_bits
from ..distributed.traffic import BuiltInCollective, SentMessages
from ..distributed.world import WorkerError, spawn

RING_WORLD = 3  # a world of 2 hides chunk-index mistakes that 3 ranks expose
RING_SIZES = (1, 2, 3, 7, 1000)
RING_TIMEOUT = 10.0  # seconds: a deadlocked ring ends after this


def ring_source(fn) -> str:
    """The source of ``fn``, dedented, to be sent to the ranks; a clear error when
    ``inspect`` cannot find it (a function typed at an interactive prompt)."""
    if not callable(fn):
        raise TypeError(f"Invalid fn: {fn!r} (expected a function)")
    try:
        return textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as exc:
        raise CheckFailed(
            f"cannot read the source of {getattr(fn, '__name__', fn)!r} ({exc}); define it "
            "with def in a notebook cell or a file"
        ) from None


def ring_all_reduce(tensor, group=None):
    """The reference ring, self-contained as the checker requires (it uses only ``torch``
    and ``dist``): a reduce-scatter, then an all-gather, each in p - 1 exchanges of one
    chunk with the neighbours, the send and the receive posted together."""
    r, p = dist.get_rank(group), dist.get_world_size(group)
    chunks = list(torch.tensor_split(tensor.view(-1), p))

    def exchange(send, recv):
        ops = []
        if send.numel():
            ops.append(dist.P2POp(dist.isend, send, (r + 1) % p, group))
        if recv.numel():
            ops.append(dist.P2POp(dist.irecv, recv, (r - 1) % p, group))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()

    for s in range(p - 1):  # reduce-scatter: chunk r ends with the sum of all ranks' chunk r
        recv = chunks[(r - s - 2) % p]
        incoming = torch.empty_like(recv)
        exchange(chunks[(r - s - 1) % p], incoming)
        recv += incoming
    for s in range(p - 1):  # all-gather: pass on the chunk received last
        exchange(chunks[(r - s) % p], chunks[(r - s - 1) % p])
    return tensor


def ring_inputs(rank: int, world_size: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s float64 tensor of ``n`` entries, ``(rank + 1) * [1, 2, ..., n] +
    rank``, and the sum of all ranks' tensors: ``p(p+1)/2 * [1, ..., n] + p(p-1)/2``, exact
    (integers in float64), computed without a collective."""
    ramp = torch.arange(1, n + 1, dtype=torch.float64)
    p = world_size
    return (rank + 1) * ramp + rank, p * (p + 1) // 2 * ramp + p * (p - 1) // 2


def run_student_ring(rank, world_size, source: str, name: str, sizes) -> list[dict]:
    """Worker: define the student's function from ``source`` and run it on the float64
    tensors of :func:`ring_inputs` of each size, the built-in collectives forbidden (by
    ``torch.distributed``'s names and by those of ``torch.distributed.distributed_c10d``,
    which defines them) and the messages it sends counted (:class:`SentMessages`). For
    each size: the largest error against the sum, whether the result is the input tensor
    changed in place, the result itself, and the entries of each message this rank
    sent."""
    namespace = {"torch": torch, "dist": dist, "math": math}
    exec(compile(source, f"<{name}>", "exec"), namespace)  # noqa: S102 -- the student's code
    fn = namespace[name]
    out = []
    for n in sizes:
        x, expected = ring_inputs(rank, world_size, n)
        before = x.clone()
        with SentMessages(forbid=True) as sent:
            returned = fn(x)
        result = returned if isinstance(returned, torch.Tensor) else x
        out.append(
            {
                "size": n,
                "error": (result - expected).abs().max().item(),
                "in_place": not torch.equal(x, before) or n == 0,
                "unchanged": torch.equal(result, before),
                "result": result.clone(),
                "sends": sent.numels,
            }
        )
    return out


def _check_sends(name: str, rank: int, n: int, sends: list[int], p: int = RING_WORLD) -> None:
    """A ring sends 2(p - 1) messages (p - 1 to reduce-scatter, p - 1 to all-gather), each
    one chunk of at most ceil(n / p) entries: 2(p - 1)/p n in all (Patarasuk & Yuan 2009)."""
    chunk = math.ceil(n / p)
    if sends and max(sends) > chunk:
        raise CheckFailed(
            f"{name}: on rank {rank}, for a tensor of {n} entries one message carried "
            f"{max(sends)} numbers; in a ring every message is one chunk, at most ceil({n} / "
            f"{p}) = {chunk} numbers (a rank that sends its whole tensor is not a ring)"
        )
    if len(sends) > 2 * (p - 1):
        raise CheckFailed(
            f"{name}: on rank {rank}, for a tensor of {n} entries {len(sends)} messages were "
            f"sent; a ring sends 2(p - 1) = {2 * (p - 1)} (p - 1 in the reduce-scatter, p - 1 "
            "in the all-gather)"
        )


@exercise("lab07.ring_all_reduce")
def check_ring_all_reduce(student_fn) -> None:
    source = ring_source(student_fn)
    name = student_fn.__name__
    try:
        ranks = spawn(run_student_ring, RING_WORLD, source, name, RING_SIZES, timeout=RING_TIMEOUT)
    except WorkerError as err:
        last = err.traceback.strip().splitlines()[-1]
        # the first rank to fail may only have lost its peer (a rank that timed out or
        # raised first): what each rank's error says counts
        lasts = [last, *err.others.values()]
        if "NotImplementedError" in err.traceback:
            raise NotImplementedError(
                f"{name} is not implemented yet: replace the `raise NotImplementedError` "
                "with your solution"
            ) from None
        for line in lasts:
            if BuiltInCollective.__name__ in line:
                raise CheckFailed(f"{name}: {line.partition(': ')[2]}") from None
        hint = ""
        timed_out = ("timed out" in line.lower() or "timeout" in line.lower() for line in lasts)
        if "Timed out" in err.traceback or any(timed_out):
            hint = (
                "\n  hint: the ranks waited for each other until the timeout: a blocking "
                "send before a recv deadlocks in a ring; post the send and the receive "
                "together (dist.isend and dist.irecv, or dist.batch_isend_irecv), then wait"
            )
        elif "NameError" in last:
            hint = (
                "\n  hint: the ranks run your function alone, with only torch, dist and math "
                "defined: put every helper inside the function"
            )
        raise CheckFailed(
            f"{name} failed on rank {err.rank} of a world of {RING_WORLD}: {last}{hint}"
        ) from None
    for rank, results in enumerate(ranks):
        for r in results:
            n = r["size"]
            if r["unchanged"]:
                raise CheckFailed(
                    f"{name}: on rank {rank}, a tensor of {n} entries came back unchanged "
                    "(expected the sum over the ranks, written into the tensor)"
                )
            if r["error"] > 1e-9:  # integers in float64: every order of addition is exact
                small = " (fewer entries than ranks: some chunks are empty)" if n < 3 else ""
                raise CheckFailed(
                    f"{name}: on rank {rank}, a tensor of {n} entries{small} is off by "
                    f"{r['error']:.3g} from the sum over the ranks"
                )
            if not r["in_place"]:
                raise CheckFailed(
                    f"{name}: the sum must be written into the tensor passed (in place), "
                    "as dist.all_reduce does"
                )
            if not torch.equal(r["result"], ranks[0][RING_SIZES.index(n)]["result"]):
                raise CheckFailed(
                    f"{name}: ranks 0 and {rank} hold different bits for {n} entries; in a "
                    "ring each chunk's sum is computed once and copied, so they must agree"
                )
            _check_sends(name, rank, n, r["sends"])
    print(
        f"✔ {name}: the sum at world {RING_WORLD} for sizes "
        f"{', '.join(map(str, RING_SIZES))}, identical on every rank, from at most "
        f"2(p - 1) = {2 * (RING_WORLD - 1)} messages of one chunk (ceil(n / p) numbers) "
        "each, no built-in collective"
    )


def error_feedback_step(grad: torch.Tensor, error: torch.Tensor, compressor):
    r"""One step of error feedback (Seide et al. 2014; Karimireddy et al. 2019):
    :math:`p = C(g + e)`, :math:`e' = g + e - D(p)`; returns ``(payload, e')``."""
    corrected = grad + error
    payload = compressor.compress(corrected)
    return payload, corrected - compressor.decompress(payload)


def _same(name: str, got, expected, tol: float = 1e-12) -> None:
    """Raise :class:`CheckFailed` with the comparison engine's explanation if ``got``
    differs from ``expected``; silent when they agree (one line is printed per exercise)."""
    found = difference(got, expected, name, tol, tol, False)
    if found is not None:
        raise CheckFailed(f"{name} differs from the expected value\n  {found}")


@exercise("lab07.error_feedback_step")
def check_error_feedback_step(student_fn) -> None:
    g = torch.Generator().manual_seed(7)
    for make in (lambda: TopK(0.1), SignSGD):
        compressor = make()
        reference = ErrorFeedback(make())
        error = torch.zeros(50, dtype=torch.float64)
        total_sent = torch.zeros_like(error)
        total_grad = torch.zeros_like(error)
        for step in range(6):
            grad = torch.randn(50, generator=g, dtype=torch.float64)
            payload, error = student_fn(grad.clone(), error.clone(), compressor)
            sent = compressor.decompress(payload)
            expected_sent = reference.decompress(reference.compress(grad))
            what = f"{type(compressor).__name__}, step {step}"
            _same(f"what is sent ({what})", sent, expected_sent)
            _same(f"the new error ({what})", error, reference.error)
            total_sent += sent
            total_grad += grad
        _same(
            "sum of what was sent + the last error (it must telescope to the sum of gradients)",
            total_sent + error,
            total_grad,
            tol=1e-10,
        )
    print("✔ error_feedback_step: equals lsdl_lab.compress.ErrorFeedback, and telescopes")


class PackedSign:
    """The reference 1-bit compressor: ``compress(g)`` returns ``(bits, scale)``, the signs
    packed 8 to a byte (uint8) and the mean magnitude; ``decompress(bits, scale, d)``
    returns ``scale * sign`` with a zero sent as ``+`` (:class:`~lsdl_lab.compress.SignSGD`,
    whose packing it uses)."""

    def compress(self, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        payload = SignSGD().compress(grad)
        return payload.bits, payload.scale

    def decompress(self, bits: torch.Tensor, scale: torch.Tensor, d: int) -> torch.Tensor:
        negative = unpack_bits(bits, 1, d)
        return scale * (1 - 2 * negative.to(scale.dtype))


sign_compressor = PackedSign()  # the reference the checker of "lab07.sign_compressor" takes


@exercise("lab07.sign_compressor")
def check_sign_compressor(compressor) -> None:
    """``compressor``: an object (or a class, instantiated without arguments) with
    ``compress(g) -> (bits, scale)`` and ``decompress(bits, scale, d) -> tensor``."""
    if isinstance(compressor, type):
        compressor = compressor()
    g = torch.Generator().manual_seed(3)
    cases = {
        "8 entries": torch.randn(8, generator=g),
        "13 entries (not a multiple of 8)": torch.randn(13, generator=g),
        "1000 entries": torch.randn(1000, generator=g),
        "with zeros": torch.tensor([0.0, -1.0, 2.0, 0.0, -3.0]),
        "all zeros": torch.zeros(9),
    }
    reference = SignSGD()
    for label, grad in cases.items():
        d = grad.numel()
        bits, scale = compressor.compress(grad.clone())
        if not isinstance(bits, torch.Tensor) or bits.dtype != torch.uint8:
            raise CheckFailed(
                f"compress({label}): the signs must be a uint8 tensor of packed bits, "
                f"got {type(bits).__name__} {getattr(bits, 'dtype', '')}"
            )
        if bits.numel() != math.ceil(d / 8):
            raise CheckFailed(
                f"compress({label}): {bits.numel()} bytes of signs for {d} entries "
                f"(expected ceil({d} / 8) = {math.ceil(d / 8)}: one bit per entry)"
            )
        scale = torch.as_tensor(scale)
        if scale.numel() != 1:
            raise CheckFailed(f"compress({label}): the scale must be one number")
        got = compressor.decompress(bits, scale, d)
        expected = reference.decompress(reference.compress(grad))
        _same(f"decompress(compress(g)) for {label}", got, expected, tol=1e-6)
    print("✔ compress / decompress: 1 bit per entry, the round trip equals SignSGD's")


__all__ = [
    "PackedSign",
    "ring_all_reduce",
    "sign_compressor",
    "check_error_feedback_step",
    "check_ring_all_reduce",
    "check_sign_compressor",
    "error_feedback_step",
    "ring_inputs",
    "run_student_ring",
]
