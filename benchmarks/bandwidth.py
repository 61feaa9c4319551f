"""The hardware limit of an optimizer step: memory bandwidth, and how close each step gets.

An optimizer step does a handful of arithmetic operations per number it reads or writes,
far fewer than a core can do while memory delivers that number: its time is set by the
bytes it moves divided by the memory bandwidth (the roofline model of Williams, Waterman and
Patterson, 2009, "Roofline", Commun. ACM 52(4)). This script measures

1. the machine's streaming bandwidth: ``copy_``, ``add_`` and ``_foreach_add_`` on arrays far
   larger than the caches, bytes read + written / time (:func:`stream_bandwidth`);
2. for every optimizer step of ``lsdl_lab`` and its peers (torch.optim's ``foreach`` and,
   where torch has one, ``fused`` kernel; pytorch-optimizer's LARS and Lamb): the step time,
   the **minimum** bytes per parameter any implementation must move
   (:func:`minimum_traffic`), and the bytes its operations **do** move, counted operation by
   operation (:func:`implemented_bytes_per_param`). Minimum bytes / step time is the
   achieved bandwidth; its fraction of the streaming bandwidth is how close the step comes
   to the hardware limit, and implemented / minimum bytes is the main reason why not.

Run from the repository root::

    python -m benchmarks.bandwidth                  # the 10M model: about a minute
    python -m benchmarks.bandwidth --sizes 10M,50M  # and 50M, beyond every cache: 3 more
    python -m benchmarks.bandwidth --quick      # a tiny model, seconds: a test

On CUDA (the default device when there is one) the same rows run on the GPU, the clock waits
for the device (``torch.cuda.synchronize``) and the fused kernels are torch's CUDA ones.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import lsdl_lab.optim
from benchmarks import ROOT, optimizers
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

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "bandwidth.md"
STREAM_MB = 256  # bytes per stream array: well beyond this machine's 105 MB L3 cache
FLUSH_MB = 256  # read before every timed step, so that no step starts with warm caches
MIN_ROUNDS, MAX_ROUNDS = 5, 50


# --- the minimum traffic of each step --------------------------------------------------------


def minimum_traffic(name: str, kwargs: dict | None = None) -> tuple[int, int]:
    """(arrays read, arrays written) per parameter: the least any implementation of the step
    ``name`` (an ``lsdl_lab.optim`` class name) with options ``kwargs`` must move.

    A fused one-pass step reads the parameter ``p``, its gradient ``g`` and each state array
    once, and writes ``p`` and each state array once; scalars (step counts, bias
    corrections, NAdam's running product of mu) are not arrays. LARS and LAMB need a norm of
    every tensor before they can update any element of it, so they take two passes, and the
    first pass's reads count too. Weight decay reads ``p``, already read: it adds nothing.

    ====================================  =====================  ===========  =====  ==========
    step                                   reads                  writes      words  fp32 bytes
    ====================================  =====================  ===========  =====  ==========
    SGD                                    p g                    p           3      12
    SGD momentum (and Nesterov)            p g b                  p b         5      20
    Adagrad                                p g s                  p s         5      20
    RMSprop (+ centered: ḡ; + momentum: b) p g v (ḡ) (b)          p v (ḡ)(b)  5 (+2) 20 (+8)
    Adadelta                               p g v u                p v u       7      28
    Adam, AdamW, Adamax, NAdam             p g m v                p m v       7      28
    Adam/AdamW amsgrad                     p g m v v_max          p m v v_max 9      36
    LARS: pass 1 norms ||p|| ||g||,        p g, then p g b        p b         7      28
    then the momentum step
    LAMB: pass 1 moments and ||p|| ||u||,  p g m v, then p m v    m v, then p 10     40
    then p -= lr tau u (u recomputed)
    Adafactor (factored v, relative step,  p g, then g, then p g  p           6      24
    update clipping): pass 1 RMS(p) and
    the row/column sums of g^2, pass 2
    RMS(u), pass 3 the step (+ beta1: m)
    Muon, its matrices                     p g b                  p b         5      20
    ====================================  =====================  ===========  =====  ==========

    LARS without momentum (``momentum=0``) drops ``b``: 2 + 3 = 5 words. Muon's count is
    its matrices' (its other parameters are AdamW's, 7 words): the Newton–Schulz iteration
    between reading ``b`` and writing ``p`` is matrix products of one matrix, bound by
    arithmetic (O(m^2 n) FLOPs per m x n matrix, lsdl_lab.optim.muon), and its
    intermediates are not counted, so the roof says little of Muon's step. Raises
    ``ValueError`` for an optimizer without a count here (add its row when you add one).
    """
    kwargs = kwargs or {}
    one_pass_state = {
        "Adagrad": 1,
        "Adadelta": 2,
        "Adam": 2 + bool(kwargs.get("amsgrad")),
        "AdamW": 2 + bool(kwargs.get("amsgrad")),
        "Adamax": 2,
        "NAdam": 2,
        "SGD": int(kwargs.get("momentum", 0) != 0),
        "Muon": 1,
        "RMSprop": 1 + bool(kwargs.get("centered")) + (kwargs.get("momentum", 0) != 0),
    }
    if name in one_pass_state:
        s = one_pass_state[name]
        return 2 + s, 1 + s
    if name == "LARS":
        b = int(kwargs.get("momentum", 0.9) != 0)
        return 2 + (2 + b), 1 + b
    if name == "LAMB":
        return 4 + 3, 2 + 1
    if name == "Adafactor":  # the factored statistics are O(n + m): not counted
        m = int(kwargs.get("beta1") is not None)
        return 2 + 1 + (2 + m), 1 + m
    known = sorted([*one_pass_state, "LARS", "LAMB", "Adafactor"])
    raise ValueError(f"Invalid optimizer: {name!r} (no byte count; expected one of {known})")


def minimum_bytes_per_param(name: str, kwargs: dict | None = None, itemsize: int = 4) -> int:
    """Bytes per parameter of :func:`minimum_traffic`, for elements of ``itemsize`` bytes."""
    reads, writes = minimum_traffic(name, kwargs)
    return (reads + writes) * itemsize


# --- the traffic an implementation does move, counted operation by operation ------------------

# Operations whose first argument is written and not read (a write-allocate cache reads the
# destination anyway; that hidden read is the hardware's, not the program's).
WRITE_ONLY = {"copy_", "_foreach_copy_", "fill_", "_foreach_fill_", "zero_", "_foreach_zero_"}


def _key(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.numel(), t.dtype


def op_traffic(func, args: tuple, kwargs: dict, out) -> tuple[int, int]:
    """(bytes read, bytes written) by one aten operation: each distinct tensor argument is
    read once, each argument the schema marks as mutated is written once (read too, except
    by the write-only operations), and each new output tensor is written once. A view
    (an output aliasing an input without writing) moves nothing."""
    schema = func._schema
    if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
        return 0, 0
    name = func.overloadpacket.__name__
    bound = dict(zip((a.name for a in schema.arguments), args))
    bound.update(kwargs)
    read, written = {}, {}
    for arg in schema.arguments:
        tensors = [t for t in tree_leaves(bound.get(arg.name)) if isinstance(t, torch.Tensor)]
        writes = arg.alias_info is not None and arg.alias_info.is_write
        if writes and name.startswith("_fused_") and arg.name == "grads":
            # the fused kernels store the gradients back only when they unscale them
            writes = bound.get("grad_scale") is not None
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            if writes:
                written[_key(t)] = nbytes
            if not (writes and arg.name == "self" and name in WRITE_ONLY):
                read[_key(t)] = nbytes
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor) and _key(t) not in written:
            written[_key(t)] = t.numel() * t.element_size()
    return sum(read.values()), sum(written.values())


class TrafficCounter(TorchDispatchMode):
    """Inside ``with TrafficCounter() as c:``, ``c.read`` and ``c.written`` add up the bytes of
    every aten operation (:func:`op_traffic`); ``c.ops`` counts the operations."""

    def __init__(self):
        super().__init__()
        self.read = self.written = self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        r, w = op_traffic(func, args, kwargs, out)
        self.read, self.written, self.ops = self.read + r, self.written + w, self.ops + 1
        return out


def implemented_bytes_per_param(step: Callable[[], object], num_params: int) -> float:
    """Bytes per parameter that one call of ``step`` moves, as its operations are written
    (:class:`TrafficCounter`). Run it after the state exists: it is one more step."""
    with TrafficCounter() as c:
        step()
    return (c.read + c.written) / num_params


# --- streaming bandwidth ---------------------------------------------------------------------


@dataclass
class Stream:
    kernel: str
    words: int  # arrays read + written per element
    numel: int
    gbps: list[float] = field(default_factory=list)  # one per timed call

    @property
    def median(self) -> float:
        return quartiles(self.gbps)[1]


def stream_kernels(numel: int, device, chunks: int = 64) -> list[tuple[str, int, Callable]]:
    """(name, arrays read + written per element, call) of the streaming kernels, on two fresh
    arrays of ``numel`` float32 numbers. ``_foreach_add_`` adds ``chunks`` slices at once, as
    an optimizer's multi-tensor step does."""
    a = torch.rand(numel, device=device)
    b = torch.rand(numel, device=device)
    la, lb = list(a.chunk(chunks)), list(b.chunk(chunks))
    return [
        ("copy_: b = a", 2, lambda: b.copy_(a)),
        ("add_: b += a", 3, lambda: b.add_(a)),
        (f"_foreach_add_: b += a, {chunks} slices", 3, lambda: torch._foreach_add_(lb, la)),
    ]


def stream_bandwidth(numel: int, device, repeats: int, timer) -> list[Stream]:
    """Bytes read + written per second of each streaming kernel, interleaved ``repeats``
    times after two untimed calls each."""
    kernels = stream_kernels(numel, device)
    result = compare({k: fn for k, _, fn in kernels}, repeats=repeats, warmup=2, timer=timer)
    streams = []
    for kernel, words, _ in kernels:
        nbytes = words * numel * 4
        streams.append(
            Stream(kernel, words, numel, [nbytes / t / 1e9 for t in result.times[kernel]])
        )
    return streams


# --- optimizer steps -------------------------------------------------------------------------


@dataclass
class Impl:
    name: str  # "lsdl_lab", "torch.optim foreach", ...
    ms: float = float("nan")
    q1_ms: float = float("nan")
    q3_ms: float = float("nan")
    implemented: float = float("nan")  # bytes per parameter its operations move
    vs_ours: tuple[float, float, float] = (float("nan"),) * 3  # lsdl_lab / this: q1, median, q3
    note: str = ""


@dataclass
class StepRow:
    label: str
    name: str  # lsdl_lab class name
    minimum: float  # bytes per parameter (minimum_bytes_per_param)
    impls: list[Impl] = field(default_factory=list)
    rounds: int = 0
    writes_grad: str = ""
    stream: tuple[float, float, float] = (float("nan"),) * 3  # B* of this row: GB/s quartiles


def candidates(name: str, kwargs: dict, params: list) -> list[tuple[str, object]]:
    """(implementation name, optimizer or the reason it is missing) for one row."""
    if name in ("LARS", "LAMB"):
        make = next(
            m
            for lbl, ref, m in optimizers.layerwise_configurations()
            if lbl == name and ref.startswith("pytorch-optimizer")
        )
        try:
            ours, theirs = make(params)
        except ImportError as e:
            return [("lsdl_lab", LAYERWISE_ALONE[name](params)), ("pytorch-optimizer", str(e))]
        return [("lsdl_lab", ours), ("pytorch-optimizer", theirs)]
    ours = params
    if name == "Muon":  # matrices to Muon, the others to AdamW (torch.optim.Muon: matrices)
        ours = [dict(params=[p for p in params if p.dim() == 2]),
                dict(params=[p for p in params if p.dim() != 2], use_muon=False)]  # fmt: skip
    out = [("lsdl_lab", getattr(lsdl_lab.optim, name)(ours, **kwargs))]
    for path in ("foreach", "fused"):
        try:
            out.append(
                (
                    f"torch.optim {path}",
                    getattr(torch.optim, name)(params, **kwargs, **{path: True}),
                )
            )
        except (TypeError, ValueError, RuntimeError) as e:
            out.append((f"torch.optim {path}", f"not available: {type(e).__name__}"))
    return out


LAYERWISE_ALONE = {
    "LARS": lambda ps: lsdl_lab.optim.LARS(ps, lr=optimizers.LR_LARS, momentum=0.9),
    "LAMB": lambda ps: lsdl_lab.optim.LAMB(
        ps, lr=optimizers.LR_LAMB, weight_decay=optimizers.WD_LAMB
    ),
}


def rows_to_run() -> list[tuple[str, str, dict]]:
    """(label, lsdl_lab name, options): the optimizer benchmark's rows, then LARS and LAMB
    (against pytorch-optimizer, with the settings under which both compute the same update)."""
    rows = optimizers.configurations()
    return rows + [("LARS", "LARS", {"momentum": 0.9}), ("LAMB", "LAMB", {})]


STREAM = "stream"  # the reference timed in every round of a row


def time_row(row, opts, grads, fixed, stream, rounds, budget, warmup, timer, flush) -> None:
    """Warm every implementation up, then time their steps interleaved into ``row``, with the
    streaming reference ``stream`` (a ``_foreach_add_`` over tensors shaped like the
    parameters, 12 bytes per parameter) in every round: the row's B*, measured in the
    same moments and the same way (caches flushed) as the steps it is compared with."""

    def restore_grads():
        torch._foreach_copy_(grads, fixed)

    steps = {}
    for impl, opt in opts:
        if isinstance(opt, str):
            row.impls.append(Impl(impl, note=opt))
            continue
        try:  # a fused kernel may refuse the device or a dtype only at its first step
            restore_grads()
            opt.step()
        except (RuntimeError, NotImplementedError) as e:
            row.impls.append(Impl(impl, note=f"fails: {type(e).__name__}: {str(e)[:80]}"))
            continue
        steps[impl] = opt.step
    writers = []
    for impl, step in steps.items():  # warm-up, and: does the step write into p.grad?
        for _ in range(warmup):
            restore_grads()
            step()
        if any(not torch.equal(g, f) for g, f in zip(grads, fixed, strict=True)):
            writers.append(impl)
    row.writes_grad = " and ".join(writers)
    t0 = timer()
    compare(steps, repeats=1, warmup=0, setup=restore_grads, timer=timer)
    per_round = timer() - t0
    row.rounds = rounds or int(min(max(budget / per_round, MIN_ROUNDS), MAX_ROUNDS))

    def setup():
        if writers:
            restore_grads()
        flush()

    result = compare({**steps, STREAM: stream}, row.rounds, warmup=0, setup=setup, timer=timer)
    n = sum(p.numel() for p in grads)
    row.stream = quartiles([12 * n / t / 1e9 for t in result.times[STREAM]])
    for impl, step in steps.items():
        q1, med, q3 = quartiles(result.times[impl])
        entry = Impl(impl, 1e3 * med, 1e3 * q1, 1e3 * q3)
        if impl != "lsdl_lab" and "lsdl_lab" in steps:
            entry.vs_ours = quartiles(result.ratios("lsdl_lab", impl))
        restore_grads()
        entry.implemented = implemented_bytes_per_param(step, n)
        row.impls.append(entry)
    order = [name for name, _ in opts]
    row.impls.sort(key=lambda i: order.index(i.name))


def benchmark_size(size, device, rounds, budget, warmup, timer, flush, log, only=None):
    """Every row on the model of ``size``: (description, number of parameters, rows)."""
    torch.manual_seed(0)
    params = [p.detach().to(device) for p in optimizers.SIZES[size][1]().parameters()]
    header = optimizers.describe(size, params)
    log(header)
    fixed = [torch.randn_like(p) for p in params]
    for p, g in zip(params, fixed, strict=True):
        p.grad = g.clone()
    grads = [p.grad for p in params]
    sa, sb = [torch.rand_like(p) for p in params], [torch.rand_like(p) for p in params]

    def stream():  # the plain SGD step's traffic, with no optimizer around it
        torch._foreach_add_(sa, sb, alpha=1e-6)

    rows = []
    for label, name, kwargs in rows_to_run():
        if only is not None and name not in only:
            continue
        try:
            minimum = minimum_bytes_per_param(name, kwargs, params[0].element_size())
        except ValueError as e:
            log(f"  {label}: skipped: {e}")
            continue
        row = StepRow(label, name, minimum)
        opts = candidates(name, kwargs, params)
        time_row(row, opts, grads, fixed, stream, rounds, budget, warmup, timer, flush)
        rows.append(row)
        for impl in row.impls:
            log(f"  {label:<24} {impl.name:<22} " + (impl.note or f"{impl.ms:9.3f} ms"))
        log(f"  {label:<24} {'B* (stream)':<22} {row.stream[1]:9.2f} GB/s")
        for _, opt in opts:  # free the state now
            if not isinstance(opt, str):
                opt.state.clear()
    return header, sum(p.numel() for p in params), rows


# --- the report ------------------------------------------------------------------------------


def gbps(bytes_per_param: float, impl: Impl, n: int) -> float:
    """GB/s of moving ``bytes_per_param`` for each of ``n`` parameters in ``impl``'s time."""
    return bytes_per_param * n / (impl.ms * 1e-3) / 1e9


def report(streams: list[Stream], sections, head: list[str]) -> str:
    """The Markdown tables; ``sections`` holds (description, number of parameters, rows)."""
    best = max(streams, key=lambda s: s.median)
    out = ["# Optimizer steps against the memory bandwidth", "", *head, ""]
    out += [
        "## Streaming bandwidth",
        "",
        f"Two float32 arrays of {streams[0].numel:,} numbers ({streams[0].numel * 4 / 2**20:.0f} "
        "MiB each, beyond the caches); GB/s = bytes read + written (as the program counts "
        "them) / time; median and interquartile range of the timed calls.",
        "",
        "| kernel | arrays read + written | GB/s median | IQR |",
        "|---|---:|---:|---:|",
    ]
    for s in streams:
        q1, med, q3 = quartiles(s.gbps)
        out.append(f"| `{s.kernel}` | {s.words} | {med:.2f} | {q1:.2f}–{q3:.2f} |")
    out += [
        "",
        f"The fastest, `{best.kernel}`, moves {best.median:.2f} GB/s. `copy_` counts 2 arrays "
        "but a write-allocate cache also reads the destination before writing it (3 "
        "transfers), so its counted figure is lower; an optimizer's in-place updates read "
        "every array they write, as `add_` does.",
        "",
        "**B\\*, the limit each row is measured against**, is timed inside the row: in every "
        "round, beside the steps, a `_foreach_add_` over two sets of tensors shaped like the "
        "model's (the plain SGD step's 12 bytes per parameter, with no optimizer around it), "
        "its caches flushed like theirs. So B\\* sees the same load and the same caches as "
        "the steps: a step's last writes can still sit in the cache when its clock stops "
        "(written back during the next flush, untimed), which lets B\\* and the steps "
        "exceed the steady streaming figures above, alike.",
    ]
    for header, n, rows in sections:
        out += [
            "",
            f"## {header}",
            "",
            "| step | B\\* GB/s | implementation | ms median [IQR] | minimum B/param "
            "| GB/s (minimum bytes / time) | of B\\* | implemented B/param | its GB/s (of B\\*) "
            "| lsdl_lab ÷ this: pair ratios median [IQR] |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in rows:
            mark = " †" if row.writes_grad else ""
            limit = row.stream[1]
            for impl in row.impls:
                first = impl is row.impls[0]
                head_cells = f"| {row.label}{mark} | {limit:.2f} " if first else "| | "
                if impl.note:
                    out.append(f"{head_cells}| {impl.name} | {impl.note} | | | | | | |")
                    continue
                rate = gbps(row.minimum, impl, n)
                its = gbps(impl.implemented, impl, n)
                vs = (
                    f"{impl.vs_ours[1]:.2f} [{impl.vs_ours[0]:.2f}–{impl.vs_ours[2]:.2f}]"
                    if impl.name != "lsdl_lab" and impl.vs_ours[1] == impl.vs_ours[1]
                    else ""
                )
                out.append(
                    f"{head_cells}| {impl.name} "
                    f"| {impl.ms:.2f} [{impl.q1_ms:.2f}–{impl.q3_ms:.2f}] | {row.minimum:g} "
                    f"| {rate:.2f} | {rate / limit:.0%} "
                    f"| {impl.implemented:.1f} | {its:.2f} ({its / limit:.0%}) | {vs} |"
                )
        for r in rows:
            if r.writes_grad:
                out += [
                    "",
                    f"† {r.label}: the step of {r.writes_grad} writes into `p.grad`; the "
                    "gradients are restored before every step of the row, untimed.",
                ]
    out += [
        "",
        "Reading: *minimum B/param* is `minimum_traffic` (one pass; two for LARS and LAMB); "
        "*implemented B/param* adds up what each operation of the step reads and writes "
        "(`TrafficCounter`), so implemented / minimum is how many times more memory traffic "
        "the implementation's sequence of operations causes than a fused kernel would, and "
        "*its GB/s* (implemented bytes / time) how well each of those operations streams. A "
        "step's time is about implemented bytes / B\\* at best; what remains beyond that is "
        "mostly new temporaries (fresh memory from the system: page faults, which no byte "
        "count shows) and per-operation overhead. B\\* is a reference, not a ceiling: a "
        "fused kernel that streams four arrays in and three out at once keeps more memory "
        "requests in flight than `_foreach_add_`'s two in, one out, and can exceed it.",
    ]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10M", help="from tiny,1M,10M,50M (default 10M)")
    add_device_options(parser)
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per row")
    parser.add_argument("--budget", type=float, default=2.0, help="seconds per row (default 2)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps each (default 2)")
    parser.add_argument("--stream-mb", type=float, default=STREAM_MB, help="MiB per array")
    parser.add_argument("--only", default=None, help="comma-separated lsdl_lab names")
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 rounds: a test")
    parser.add_argument("--out", type=Path, default=None, help=f"default {DEFAULT_OUT}")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.rounds, args.warmup = "tiny", args.rounds or 2, 1
        args.stream_mb = min(args.stream_mb, 1.0)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if not sizes or any(s not in optimizers.SIZES for s in sizes):
        parser.error(f"Invalid --sizes {args.sizes!r} (choose from {', '.join(optimizers.SIZES)})")
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"Invalid --rounds: {args.rounds} (expected >= 1)")
    if args.warmup < 1 or args.threads < 1 or not args.stream_mb > 0:
        parser.error("Invalid --warmup, --threads or --stream-mb (expected >= 1, >= 1, > 0)")
    only = None
    if args.only is not None:
        only = {s.strip() for s in args.only.split(",") if s.strip()}
        known = {name for _, name, _ in rows_to_run()}
        if not only or only - known:
            parser.error(f"Invalid --only {sorted(only - known)} (choose from {sorted(known)})")
    device, timer, head = device_setup(parser, args)
    scratch = torch.ones(int(FLUSH_MB * 2**20 / 4), device=device)

    def flush():  # read more than the last-level cache holds: evict the previous step's data
        scratch.sum()

    numel = int(args.stream_mb * 2**20 / 4)
    streams = stream_bandwidth(numel, device, repeats=5 if args.quick else 21, timer=timer)
    for s in streams:
        log(f"  stream {s.kernel:<36} {s.median:7.2f} GB/s")
    sections = [
        benchmark_size(s, device, args.rounds, args.budget, args.warmup, timer, flush, log, only)
        for s in sizes
    ]
    head += [
        f"- load average at end: {load_average()}",
        f"- timing: {args.warmup} untimed steps each, then "
        + (
            f"{args.rounds} rounds"
            if args.rounds
            else f"{MIN_ROUNDS}–{MAX_ROUNDS} rounds (as many as fit {args.budget:g} s)"
        )
        + " per row; in each round every implementation steps once, back to back, the "
        f"first alternating; before every timed step a {FLUSH_MB} MiB read evicts the caches",
    ]
    text = report(streams, sections, head)
    default = None if args.quick or only is not None else results_path(DEFAULT_OUT, device)
    out = args.out if args.out is not None else default
    write_report(text, out, log)
    return text


if __name__ == "__main__":
    main()
