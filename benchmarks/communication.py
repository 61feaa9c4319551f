"""All-reduce and gradient compression: lsdl_lab's against torch's, side by side.

Run from the repository root::

    python -m benchmarks.communication              # 1e5, 1e6, 1e7 floats; 2^20 entries
    python -m benchmarks.communication --quick      # small sizes, a few seconds, no file

**All-reduce.** In one world of 2 processes (gloo, :func:`lsdl_lab.distributed.spawn`), the
hand-built :func:`~lsdl_lab.distributed.ring_all_reduce` and
:func:`~lsdl_lab.distributed.tree_all_reduce` and ``torch.distributed.all_reduce`` sum a
float32 tensor of each size, called in rounds (the first of each round rotating,
:func:`benchmarks.timing.compare`). Before each call, untimed, the tensor is reset and
the ranks meet at a barrier; a call's time is the wall clock (a collective waits for its
peer: no CPU clock sees that) of the slower rank. The goal (issue 12): the ring at >= 0.8x
the built-in's throughput from 1e6 floats on, i.e. ``time(built-in) / time(ring) >= 0.8``.

**All-to-all and the other all-reduces.** In worlds of 2 and 4 processes, the same way:
:func:`~lsdl_lab.distributed.collectives.all_to_all` (pairwise exchange) against
``dist.all_to_all_single``, and
:func:`~lsdl_lab.distributed.collectives.rabenseifner_all_reduce`,
:func:`~lsdl_lab.distributed.collectives.binary_tree_all_reduce` and, at 4, 2 nodes of 2,
:func:`~lsdl_lab.distributed.collectives.hierarchical_all_reduce` against
``dist.all_reduce``, each checked against its reference's answer first.

**Compression.** In this process, each compressor of :mod:`lsdl_lab.compress` encodes
(``compress``) and decodes (``decompress``) one float32 gradient, a ``side x side``
matrix, against what torch's DDP hooks do to a bucket: the cast of ``fp16_compress_hook``
(``buffer.to(float16).div_(world)``, and the copy back into the float32 buffer) and the
compression of ``powerSGD_hook`` (``P = M Q``, its own ``_orthogonalize``, ``Q = M^T P``;
decode ``P Q^T``), at the same rank as lsdl_lab's PowerSGD. All encoders and decoders
take turns in rounds on the thread's CPU clock; bytes per entry are those of the payload
(``nbytes``) over the entries.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks import ROOT
from benchmarks.timing import (
    add_device_options,
    compare,
    device_setup,
    load_average,
    log,
    quartiles,
    results_path,
    write_report,
)
from lsdl_lab import compress
from lsdl_lab.distributed import ring_all_reduce, spawn, tree_all_reduce
from lsdl_lab.distributed.collectives import (
    all_to_all,
    binary_tree_all_reduce,
    hierarchical_all_reduce,
    rabenseifner_all_reduce,
)

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "communication.md"
GOAL = 0.8  # issue 12: ring throughput / built-in's, from GOAL_FROM floats on
GOAL_FROM = 10**6
WORLD = 2
WORLDS = (2, 4)  # the worlds of the other collectives; hierarchical: 2 nodes of 2 at 4
LOCAL_SIZE = 2  # ranks per "node" of the hierarchical all-reduce
RANK = 4  # PowerSGD's rank, both implementations
RATIO = 0.01  # TopK's and RandomK's fraction of entries


def world_compare(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    warmup: int,
    setup: Callable[[], object] | None = None,
    cpu: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """:func:`benchmarks.timing.compare` on every rank of the world at once (each must call
    it with the same functions), a barrier before every call, untimed; the seconds of each
    call on the slowest rank, by name, in call order. When ``cpu`` is given, it receives
    the same for the CPU time of the whole process (every thread: gloo's too), which
    leaves out the moments a rank waits for its peer or for a core held by another job."""
    spent: dict[str, list[float]] = {name: [] for name in fns}

    def before():
        if setup is not None:
            setup()
        dist.barrier()

    def timed(name, fn):
        def call():
            c0 = time.process_time()
            fn()
            spent[name].append(time.process_time() - c0)

        return call

    result = compare(
        {name: timed(name, fn) for name, fn in fns.items()},
        repeats,
        warmup,
        setup=before,
        timer=time.perf_counter,
    )
    wall = torch.tensor([result.times[name] for name in fns], dtype=torch.float64)
    work = torch.tensor([spent[name][warmup:] for name in fns], dtype=torch.float64)
    both = torch.stack([wall, work])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    if cpu is not None:
        cpu.update({name: row.tolist() for name, row in zip(fns, both[1])})
    return {name: row.tolist() for name, row in zip(fns, both[0])}


ALL_REDUCES = {
    "ring": ring_all_reduce,
    "tree": tree_all_reduce,
    "built-in": dist.all_reduce,
}


def all_reduce_worker(rank: int, world_size: int, sizes: list[int], repeats: int, warmup: int):
    """One rank: for each size, every all-reduce of :data:`ALL_REDUCES` in rounds; checks
    that each sums correctly first (a fast wrong answer is no result). Per size, the wall
    and the CPU seconds (:func:`world_compare`) of each call."""
    out = {}
    for n in sizes:
        x = torch.empty(n)
        for name, fn in ALL_REDUCES.items():
            x.fill_(rank + 1.0)
            fn(x)
            if not torch.all(x == world_size * (world_size + 1) / 2):
                raise AssertionError(f"{name} all-reduce of {n} floats gave a wrong sum")
        fns = {name: (lambda fn=fn, x=x: fn(x)) for name, fn in ALL_REDUCES.items()}
        cpu: dict[str, list[float]] = {}
        wall = world_compare(fns, repeats, warmup, setup=lambda x=x: x.fill_(rank + 1.0), cpu=cpu)
        out[n] = (wall, cpu)
    return out


@dataclass
class ReduceRow:
    n: int
    ms: dict[str, float]  # median per implementation
    best_ms: dict[str, float]  # minimum
    cpu_ms: dict[str, float]  # median CPU time of the slower rank's process, all its threads
    ratio: dict[str, tuple[float, float, float]]  # built-in / impl per round: q1, median, q3
    repeats: int


def all_reduce_rows(sizes: list[int], repeats: int, warmup: int) -> list[ReduceRow]:
    # The worker by its module's real name: run as a script, this module is __main__,
    # which a spawned rank cannot import.
    from benchmarks.communication import all_reduce_worker as worker

    per_rank = spawn(worker, WORLD, list(sizes), repeats, warmup)
    rows = []
    for n, (times, cpu) in per_rank[0].items():  # every rank holds the same maxima
        ratio = {
            name: quartiles([b / a for a, b in zip(ts, times["built-in"], strict=True)])
            for name, ts in times.items()
        }
        rows.append(
            ReduceRow(
                n,
                {k: 1e3 * statistics.median(v) for k, v in times.items()},
                {k: 1e3 * min(v) for k, v in times.items()},
                {k: 1e3 * statistics.median(v) for k, v in cpu.items()},
                ratio,
                repeats,
            )
        )
        log(
            f"  {n:>10,} floats: "
            + "  ".join(f"{k} {v:8.2f} ms" for k, v in rows[-1].ms.items())
            + "  ring throughput x built-in "
            + f"{ratio['ring'][1]:.2f}"
        )
    return rows


# --- the other collectives, worlds 2 and 4 -----------------------------------------------------


def collectives(world_size: int) -> dict[str, tuple[str, Callable]]:
    """name -> (the name of its reference, ``fn(output, input)``) for every collective of
    the second table in a world of ``world_size``: the library's all-to-all against
    ``dist.all_to_all_single`` (``output`` receives), each other all-reduce against
    ``dist.all_reduce`` (in place on ``input``). The hierarchical all-reduce needs nodes of
    :data:`LOCAL_SIZE` ranks and at least two of them."""
    fns = {
        "built-in all_to_all_single": ("built-in all_to_all_single", dist.all_to_all_single),
        "all_to_all": ("built-in all_to_all_single", all_to_all),
        "built-in all_reduce": ("built-in all_reduce", lambda out, x: dist.all_reduce(x)),
        "rabenseifner": ("built-in all_reduce", lambda out, x: rabenseifner_all_reduce(x)),
        "binary tree": ("built-in all_reduce", lambda out, x: binary_tree_all_reduce(x)),
    }
    if world_size % LOCAL_SIZE == 0 and world_size > LOCAL_SIZE:
        fns[f"hierarchical ({world_size // LOCAL_SIZE} nodes of {LOCAL_SIZE})"] = (
            "built-in all_reduce",
            lambda out, x: hierarchical_all_reduce(x, LOCAL_SIZE),
        )
    return fns


def collectives_worker(rank: int, world_size: int, sizes: list[int], repeats: int, warmup: int):
    """One rank: for each size (cut to a multiple of the world, which the all-to-all
    splits evenly), every collective of :func:`collectives` in rounds, after checking each
    against its reference's answer (a fast wrong answer is no result). Per size, the wall
    and the CPU seconds (:func:`world_compare`) of each call."""
    fns = collectives(world_size)
    out = {}
    for size in sizes:
        n = size - size % world_size
        x, output = torch.empty(n), torch.empty(n)

        def reset(x=x, n=n):
            # every rank's entries differ, so a misplaced block shows; small integers, so
            # every order of summation gives the same float32 sum
            torch.arange(n, out=x).remainder_(1024).mul_(world_size).add_(rank)

        answers = {}
        for name, (reference, fn) in fns.items():
            reset()
            output.zero_()
            fn(output, x)
            answers[name] = (output if "all_to_all" in reference else x).clone()
        for name, (reference, _) in fns.items():
            if not torch.equal(answers[name], answers[reference]):
                raise AssertionError(f"{name} of {n} floats at world {world_size} is wrong")
        calls = {name: (lambda fn=fn, x=x, o=output: fn(o, x)) for name, (_, fn) in fns.items()}
        cpu: dict[str, list[float]] = {}
        wall = world_compare(calls, repeats, warmup, setup=reset, cpu=cpu)
        out[n] = (wall, cpu)
    return out


@dataclass
class CollectiveRow:
    world: int
    n: int
    name: str
    reference: str
    ms: float  # median
    best_ms: float  # minimum
    reference_ms: float  # the reference's median
    cpu_ms: float  # median CPU time of the slower rank's process, all its threads
    ratio: tuple[float, float, float]  # reference / ours per round: q1, median, q3
    repeats: int


def collective_rows(
    sizes: list[int], repeats: int, warmup: int, worlds=WORLDS
) -> list[CollectiveRow]:
    from benchmarks.communication import collectives_worker as worker  # see all_reduce_rows

    rows = []
    for world in worlds:
        per_rank = spawn(worker, world, list(sizes), repeats, warmup)
        for n, (times, cpu) in per_rank[0].items():  # every rank holds the same maxima
            for name, (reference, _) in collectives(world).items():
                if name == reference:
                    continue
                ref = times[reference]
                rows.append(
                    CollectiveRow(
                        world,
                        n,
                        name,
                        reference,
                        1e3 * statistics.median(times[name]),
                        1e3 * min(times[name]),
                        1e3 * statistics.median(ref),
                        1e3 * statistics.median(cpu[name]),
                        quartiles([b / a for a, b in zip(times[name], ref, strict=True)]),
                        repeats,
                    )
                )
                log(
                    f"  world {world} {n:>10,} floats: {name:<28} {rows[-1].ms:8.2f} ms, "
                    f"x {reference}: {rows[-1].ratio[1]:.2f}"
                )
    return rows


# --- compression -----------------------------------------------------------------------------


def torch_powersgd(rank: int):
    """Encode and decode of torch's ``powerSGD_hook`` on one matrix, warm-started as the
    hook is (its ``Q`` of the last call)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

    state = {}

    def encode(m: torch.Tensor):
        if "q" not in state:
            state["q"] = torch.randn(m.shape[1], rank, generator=torch.Generator().manual_seed(0))
        p = m @ state["q"]
        _orthogonalize(p[None])  # in place, on a batch of one matrix
        state["q"] = m.T @ p
        return p, state["q"]

    def decode(payload):
        p, q = payload
        return p @ q.T

    return encode, decode


def codecs(side: int) -> dict[str, tuple[Callable, Callable, Callable]]:
    """name -> (encode(g), decode(payload), bytes(payload)) for every compressor and
    torch's two references."""
    ours = {
        "SignSGD": compress.SignSGD(),
        "TernGrad": compress.TernGrad(seed=0),
        "QSGD s=16": compress.QSGD(16, seed=0),
        f"TopK {RATIO:g}": compress.TopK(RATIO),
        f"RandomK {RATIO:g}": compress.RandomK(RATIO, seed=0),
        f"PowerSGD r={RANK}": compress.PowerSGD(RANK),
    }
    out = {name: (c.compress, c.decompress, c.nbytes) for name, c in ours.items()}
    buffer = torch.empty(side * side)
    out["torch fp16 hook"] = (
        lambda g: g.reshape(-1).to(torch.float16).div_(WORLD),
        lambda h: buffer.copy_(h),
        lambda h: h.numel() * h.element_size(),
    )
    encode, decode = torch_powersgd(RANK)
    out[f"torch PowerSGD hook r={RANK}"] = (
        encode,
        decode,
        lambda pq: sum(t.numel() * t.element_size() for t in pq),
    )
    return out


@dataclass
class CodecRow:
    name: str
    encode_ms: float
    decode_ms: float
    bytes_per_entry: float
    against: str  # the reference of the ratio
    ratio: tuple[float, float, float]  # (encode + decode) / reference's, per round: q1, median, q3
    max_error: float  # relative error of one encode-decode, ||g - g_hat|| / ||g||


def reference_of(name: str) -> str:
    return f"torch PowerSGD hook r={RANK}" if name.startswith("PowerSGD") else "torch fp16 hook"


def compression_rows(side: int, repeats: int, warmup: int, timer) -> list[CodecRow]:
    torch.manual_seed(0)
    g = torch.randn(side, side)
    fns, payloads, specs = {}, {}, codecs(side)
    for name, (encode, decode, _) in specs.items():
        payloads[name] = encode(g)
        fns[f"{name} encode"] = lambda encode=encode: encode(g)
        fns[f"{name} decode"] = lambda name=name, decode=decode: decode(payloads[name])
    result = compare(fns, repeats, warmup, timer=timer)

    def both(name):
        return [
            a + b for a, b in zip(result.times[f"{name} encode"], result.times[f"{name} decode"])
        ]

    rows = []
    for name, (encode, decode, nbytes) in specs.items():
        payload = encode(g)
        g_hat = decode(payload).reshape(g.shape) * (WORLD if name == "torch fp16 hook" else 1)
        ref = reference_of(name)
        ratio = quartiles([a / b for a, b in zip(both(name), both(ref))])
        rows.append(
            CodecRow(
                name,
                1e3 * result.median(f"{name} encode"),
                1e3 * result.median(f"{name} decode"),
                nbytes(payload) / g.numel(),
                ref,
                ratio,
                float((g - g_hat).norm() / g.norm()),
            )
        )
        log(
            f"  {name:<26} encode {rows[-1].encode_ms:8.3f} ms  decode {rows[-1].decode_ms:8.3f}"
            f" ms  {rows[-1].bytes_per_entry:.4f} B/entry  x {ref}: {ratio[1]:.2f}"
        )
    return rows


# --- the report ------------------------------------------------------------------------------


def table(
    reduce_rows: list[ReduceRow],
    codec_rows: list[CodecRow],
    header: list[str],
    side: int,
    codec_repeats: int,
    collective_rows: list[CollectiveRow] = (),
) -> str:
    out = ["# Communication: all-reduce and gradient compression", ""] + header
    out += [
        "",
        f"## All-reduce, world {WORLD} (gloo), float32",
        "",
        "ms: median [minimum] of the slower rank's wall-clock time per call, after a barrier. "
        "× built-in: throughput against `dist.all_reduce`, i.e. its time / ours per round "
        f"(median [IQR]); the goal is ring >= {GOAL} from {GOAL_FROM:.0e} floats on. "
        "CPU ms: median CPU time per call of the busier rank's process, every thread "
        "(gloo's event loop and workers too), which the wall clock's waits leave out.",
        "",
        "| floats | ring ms | tree ms | built-in ms | ring × built-in [IQR] "
        "| tree × built-in [IQR] | ring GB/s | built-in GB/s | goal "
        "| ring CPU ms | built-in CPU ms | rounds |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in reduce_rows:
        gbs = {k: 4 * r.n / (v * 1e-3) / 1e9 for k, v in r.ms.items()}
        ring, tree = r.ratio["ring"], r.ratio["tree"]
        goal = "" if r.n < GOAL_FROM else ("met" if ring[1] >= GOAL else "**not met**")
        out.append(
            f"| {r.n:.0e} | {r.ms['ring']:.2f} [{r.best_ms['ring']:.2f}] "
            f"| {r.ms['tree']:.2f} [{r.best_ms['tree']:.2f}] "
            f"| {r.ms['built-in']:.2f} [{r.best_ms['built-in']:.2f}] "
            f"| {ring[1]:.2f} [{ring[0]:.2f}–{ring[2]:.2f}] "
            f"| {tree[1]:.2f} [{tree[0]:.2f}–{tree[2]:.2f}] "
            f"| {gbs['ring']:.2f} | {gbs['built-in']:.2f} | {goal} "
            f"| {r.cpu_ms['ring']:.2f} | {r.cpu_ms['built-in']:.2f} | {r.repeats} |"
        )
    if collective_rows:
        out += [
            "",
            f"## All-to-all and the other all-reduces, worlds {' and '.join(map(str, WORLDS))} "
            "(gloo), float32",
            "",
            "The library's pairwise all-to-all against `dist.all_to_all_single`, and its "
            "Rabenseifner (recursive halving, then doubling), binomial-tree and hierarchical "
            f"(nodes of {LOCAL_SIZE} ranks: a ring within each node, a ring across nodes) "
            "all-reduces against `dist.all_reduce`, each collective of a world called in "
            "rounds with its reference. ms: median [minimum] of the slower rank's wall-clock "
            "time per call, after a barrier. × reference: throughput against the reference, "
            "i.e. its time / ours per round (median [IQR]). CPU ms: as above. A world of 4 "
            "has more processes than this machine has cores: each rank waits for a core as "
            "well as for its peers.",
            "",
            "| world | floats | collective | ms | reference | reference ms "
            "| × reference [IQR] | CPU ms | rounds |",
            "|---:|---:|---|---:|---|---:|---:|---:|---:|",
        ]
        for r in collective_rows:
            q1, med, q3 = r.ratio
            out.append(
                f"| {r.world} | {r.n:.0e} | {r.name} | {r.ms:.2f} [{r.best_ms:.2f}] "
                f"| {r.reference} | {r.reference_ms:.2f} | {med:.2f} [{q1:.2f}–{q3:.2f}] "
                f"| {r.cpu_ms:.2f} | {r.repeats} |"
            )
    out += [
        "",
        f"## Compression of a {side} x {side} float32 gradient ({side * side:,} entries)",
        "",
        "ms: median of the thread's CPU time per call, all encoders and decoders in rounds "
        f"({codec_repeats}). × reference: (encode + decode) / the reference's, per round, "
        "median [IQR]. B/entry: bytes on the wire per gradient entry (float32: 4). error: "
        "||g - decode(encode(g))|| / ||g|| of one call (PowerSGD's after the warm-up calls' "
        "power iterations).",
        "",
        "| compressor | encode ms | decode ms | B/entry | × reference [IQR] | reference | error |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    for r in codec_rows:
        q1, med, q3 = r.ratio
        out.append(
            f"| {r.name} | {r.encode_ms:.3f} | {r.decode_ms:.3f} | {r.bytes_per_entry:.4f} "
            f"| {med:.2f} [{q1:.2f}–{q3:.2f}] | {r.against} | {r.max_error:.3f} |"
        )
    out += ["", f"- load average at the end: {load_average()}", ""]
    return "\n".join(out)


def parse_sizes(text: str) -> list[int]:
    sizes = [int(float(s)) for s in text.split(",") if s.strip()]
    if not sizes or min(sizes) < WORLD:
        raise ValueError(f"Invalid --sizes {text!r} (expected counts of floats >= {WORLD})")
    return sizes


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.communication", description=__doc__)
    parser.add_argument("--sizes", default="1e5,1e6,1e7", help="floats per all-reduce")
    parser.add_argument("--repeats", type=int, default=41, help="all-reduce rounds per size")
    parser.add_argument(
        "--world-repeats",
        type=int,
        default=15,
        help="rounds per size of the all-to-all and the other all-reduces, worlds 2 and 4",
    )
    parser.add_argument("--side", type=int, default=1024, help="the gradient is side x side")
    parser.add_argument("--codec-repeats", type=int, default=15, help="compression rounds")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--quick", action="store_true", help="small sizes, no file")
    parser.add_argument("--out", type=Path, default=None, help="where the table goes")
    parser.add_argument(
        "--note", default="", help="a line for the report's header (what else the machine ran)"
    )
    add_device_options(parser)
    args = parser.parse_args(argv)
    try:
        args.sizes = parse_sizes(args.sizes)
    except ValueError as e:
        parser.error(str(e))
    if (
        min(args.repeats, args.world_repeats, args.codec_repeats) < 1
        or args.warmup < 0
        or args.side < 2 * RANK
    ):
        parser.error(
            f"Invalid --repeats {args.repeats}, --world-repeats {args.world_repeats}, "
            f"--codec-repeats {args.codec_repeats}, --warmup {args.warmup} or --side "
            f"{args.side} (>= 1, >= 1, >= 1, >= 0, >= {2 * RANK})"
        )
    if min(args.sizes) < max(WORLDS):
        parser.error(f"Invalid --sizes {args.sizes} (expected >= {max(WORLDS)} floats each)")
    if args.device != "cpu":
        parser.error(f"Invalid --device {args.device!r} (this benchmark runs on cpu, gloo)")
    return parser, args


def main(argv: list[str] | None = None) -> str:
    parser, args = parse_args(argv)
    if args.quick:
        args.sizes, args.repeats, args.side, args.codec_repeats, args.warmup = (
            [1000, 100_000],
            3,
            64,
            3,
            1,
        )
        args.world_repeats = 3
    device, timer, header = device_setup(parser, args)
    log("all-reduce:")
    reduce_rows = all_reduce_rows(args.sizes, args.repeats, args.warmup)
    log("all-to-all and the other all-reduces:")
    more_rows = collective_rows(args.sizes, args.world_repeats, args.warmup)
    log("compression:")
    codec_rows = compression_rows(args.side, args.codec_repeats, args.warmup, timer)
    header = (
        header[:-1]
        + [  # the all-reduce's clock is the wall clock, across processes
            "- clock: all-reduce: wall clock of the slower rank; compression: "
            + header[-1].removeprefix("- clock: "),
            f"- all-reduce: {args.warmup} untimed rounds, then {args.repeats} per size; the other "
            f"collectives: {args.world_repeats} per size",
        ]
        + ([f"- note: {args.note}"] if args.note else [])
    )
    text = table(reduce_rows, codec_rows, header, args.side, args.codec_repeats, more_rows)
    out = args.out or (None if args.quick else results_path(DEFAULT_OUT, device))
    write_report(text, out, log)
    return text


if __name__ == "__main__":
    main()
