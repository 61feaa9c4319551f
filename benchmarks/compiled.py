"""The compiled path against the memory-bandwidth roof: every optimizer's own ``update``
through ``torch.compile`` (``compile=True``), beside its eager foreach path, torch.optim's
fused kernel where torch has one, and pytorch-optimizer's where it has the optimizer.

For each optimizer and model size: the step time of each implementation (caches flushed
before every step, all implementations interleaved round by round with B*, the streaming
reference of ``benchmarks/bandwidth.py``: a ``_foreach_add_`` over tensors shaped like the
model, timed in the same rounds), the **minimum** bytes per parameter any implementation
must move (:func:`benchmarks.bandwidth.minimum_traffic`), and so the fraction of the
streaming bandwidth each reaches. The compiled optimizer's compilation (its first compiled
step) is timed apart and kept out of the step times. Finally, the cache: a fresh process
compiles Adam's update with an empty TorchInductor cache, a second process with the cache
the first left: the second compiles faster.

Goals (issue 18): compiled within 1.1x of torch's fused kernel for SGD with momentum,
Adagrad, Adam and AdamW; at least 80% of B* for every optimizer.

Run from the repository root::

    python -m benchmarks.compiled                        # 1M, 10M, 50M: long (compiles)
    python -m benchmarks.compiled --sizes 10M --only Adam,SGD
    python -m benchmarks.compiled --quick                # the tiny model: a test

Then the labs' models (Adam's step at the cpu and gpu profiles: does compiling pay
there?) and the cache measurement.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks import ROOT, optimizers
from benchmarks.bandwidth import minimum_bytes_per_param
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
from lsdl_lab import optim
from lsdl_lab.models import GPT, MLP, ResNet

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "compiled.md"
FLUSH_MB = 256  # read before every timed step: beyond this machine's 105 MB L3 cache
MIN_ROUNDS, MAX_ROUNDS = 5, 40
FUSED_GOAL, ROOF_GOAL = 1.1, 0.8
FUSED = ("SGD", "Adagrad", "Adam", "AdamW")  # torch.optim's fused CPU kernels


def po(name: str):
    module = optimizers.pytorch_optimizer()
    if module is None:
        raise ImportError("pytorch_optimizer is not installed")
    return getattr(module, name)


def layerwise(ps, wd):
    return optim.param_groups_for_layerwise(ps, wd)


# (label, lsdl_lab name, lsdl_lab options, torch.optim options or None, pytorch-optimizer
# factory or None). Each pair runs the same algorithm with the same state (the settings of
# benchmarks/optimizers.py and benchmarks/memory_optimizers.py); minimum bytes are counted
# from the lsdl_lab name and options.
ROWS = [
    ("SGD momentum=0.9", "SGD", dict(lr=1e-3, momentum=0.9), {}, None),
    ("Adagrad", "Adagrad", {}, {}, None),
    ("Adam", "Adam", {}, {}, None),
    ("AdamW", "AdamW", {}, {}, None),
    ("RMSprop", "RMSprop", {}, None, None),
    ("Adadelta", "Adadelta", {}, None, None),
    ("Adamax", "Adamax", {}, None, None),
    ("NAdam", "NAdam", {}, None, None),
    ("LARS", "LARS", dict(lr=0.1, momentum=0.9, eps=0.0), None,
     lambda ps: po("LARS")(ps, lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=True)),
    ("LAMB", "LAMB", dict(lr=1e-3, weight_decay=0.01, bias_correction=False, clamp=(0.0, 10.0)),
     None, lambda ps: po("Lamb")(ps, lr=1e-3, weight_decay=0.01, weight_decouple=False,
                                 foreach=True)),
    ("Adafactor", "Adafactor", {}, None, lambda ps: po("AdaFactor")(ps, betas=(None, 0.999))),
    ("SM3", "SM3", {}, None, lambda ps: po("SM3")(ps, foreach=True)),
]  # fmt: skip
LAYERWISE_DECAY = {"LARS": 1e-4, "LAMB": None}  # LARS's groups as pytorch-optimizer's


@dataclass
class Impl:
    name: str
    ms: float = float("nan")
    q: tuple[float, float] = (float("nan"), float("nan"))
    note: str = ""


@dataclass
class Row:
    label: str
    minimum: float  # bytes per parameter
    impls: list[Impl] = field(default_factory=list)
    stream: float = float("nan")  # B*: GB/s, median of the rounds
    compile_s: float = float("nan")
    rounds: int = 0


def lsdl(name, options, params, compile):
    options = dict(options)
    if name == "LARS":
        params = layerwise(params, LAYERWISE_DECAY["LARS"])
    return getattr(optim, name)(params, **options, compile=compile)


def candidates(label, name, options, torch_options, theirs, params):
    """(implementation, optimizer or the reason it is missing) of one row."""
    out = [("eager foreach", lsdl(name, options, params, False)),
           ("compiled", lsdl(name, options, params, True))]  # fmt: skip
    if torch_options is not None:
        kwargs = {**options, **torch_options}
        if name in FUSED:
            out.append(("torch fused", getattr(torch.optim, name)(params, **kwargs, fused=True)))
    if theirs is not None:
        try:
            out.append(("pytorch-optimizer", theirs(params)))
        except ImportError as e:
            out.append(("pytorch-optimizer", str(e)))
    return out


def benchmark_size(size, device, rounds, budget, timer, flush, only, goal_rows_only=False):
    torch.manual_seed(0)
    params = [p.detach().to(device) for p in optimizers.SIZES[size][1]().parameters()]
    header = optimizers.describe(size, params)
    log(header)
    fixed = [torch.randn_like(p) for p in params]
    for p, g in zip(params, fixed, strict=True):
        p.grad = g.clone()
    grads = [p.grad for p in params]
    n = sum(p.numel() for p in params)
    sa, sb = [torch.rand_like(p) for p in params], [torch.rand_like(p) for p in params]

    def stream():  # the plain SGD step's 12 bytes per parameter, no optimizer around it
        torch._foreach_add_(sa, sb, alpha=1e-6)

    def restore():
        torch._foreach_copy_(grads, fixed)

    rows = []
    for label, name, options, torch_options, theirs in ROWS:
        if (only is not None and name not in only) or (goal_rows_only and name not in FUSED):
            continue
        row = Row(label, minimum_bytes_per_param(name, options, params[0].element_size()))
        steps = {}
        for impl, opt in candidates(label, name, options, torch_options, theirs, params):
            if isinstance(opt, str):
                row.impls.append(Impl(impl, note=opt))
                continue
            restore()
            opt.step()  # creates the state (eagerly, on every path)
            restore()
            start = time.perf_counter()
            opt.step()  # the compiled path's first compiled step: the compilation
            if impl == "compiled":
                row.compile_s = opt.compiled.compile_seconds
                if opt.compiled.failure:
                    row.impls.append(Impl(impl, note=f"eager: {opt.compiled.failure[:80]}"))
                    continue
            log(f"  {label:<18} {impl:<18} first warm step {time.perf_counter() - start:.2f} s")
            steps[impl] = opt.step
            row.impls.append(Impl(impl))
        restore()
        t0 = timer()
        compare(steps, repeats=1, warmup=1, setup=restore, timer=timer)
        row.rounds = rounds or int(min(max(budget / (timer() - t0), MIN_ROUNDS), MAX_ROUNDS))

        def setup():
            restore()  # Nesterov, LARS and others write into p.grad: the same input each time
            flush()

        result = compare({**steps, "B*": stream}, row.rounds, warmup=1, setup=setup, timer=timer)
        row.stream = quartiles([12 * n / t / 1e9 for t in result.times["B*"]])[1]
        for impl in row.impls:
            if impl.name in steps:
                q1, med, q3 = quartiles(result.times[impl.name])
                impl.ms, impl.q = 1e3 * med, (1e3 * q1, 1e3 * q3)
        rows.append(row)
        for impl in row.impls:
            log(f"  {label:<18} {impl.name:<18} " + (impl.note or f"{impl.ms:9.3f} ms"))
        log(f"  {label:<18} B* {row.stream:.2f} GB/s; compile {row.compile_s:.1f} s")
        del steps
    return header, n, rows


# The labs' models at the cpu and gpu profiles (lsdl_lab.scale), and the optimizer steps a
# lab takes with them (cpu: 12 epochs of the 1,437 training digits in batches of 64, or
# lm_steps; gpu: 30 epochs of CIFAR-10's 50,000 images in batches of 128, or lm_steps).
# Vocabularies: 96 characters (Python source), 65 (Tiny Shakespeare).
LAB_MODELS = [
    ("cpu", "MLP on digits, hidden 256", lambda: MLP(64, 10, hidden=256), 12 * 23),
    ("cpu", "ResNet-14, width 16, digits", lambda: ResNet(14, 16, 10, 1), 12 * 23),
    ("cpu", "GPT, 2 layers, dim 128, block 64", lambda: GPT(96, 64, layers=2, heads=4, dim=128),
     600),
    ("gpu", "ResNet-20, width 16, CIFAR-10", lambda: ResNet(20, 16, 10, 3), 30 * 391),
    ("gpu", "GPT, 6 layers, dim 384, block 256",
     lambda: GPT(65, 256, layers=6, heads=6, dim=384), 3000),
]  # fmt: skip


@dataclass
class LabRow:
    profile: str
    model: str
    n: int
    steps: int
    eager_ms: float
    compiled_ms: float
    compile_s: float

    @property
    def break_even(self) -> float:
        """Steps after which the compiled path has saved its compilation."""
        saved = (self.eager_ms - self.compiled_ms) / 1e3
        return self.compile_s / saved if saved > 0 else float("inf")


def lab_profiles(device, timer, budget) -> list[LabRow]:
    """Adam's step, eager and compiled, on the labs' models: does compiling pay there?
    No cache flush here: a lab's small state stays in the caches from step to step."""
    rows = []
    for profile, label, make, steps in LAB_MODELS:
        torch.manual_seed(0)
        params = [p.detach().to(device) for p in make().parameters()]
        for p in params:
            p.grad = torch.randn_like(p)
        eager, compiled = optim.Adam(params), optim.Adam(params, compile=True)
        for opt in (eager, compiled, compiled):
            opt.step()
        t0 = timer()
        compare({"eager": eager.step, "compiled": compiled.step}, repeats=1, warmup=1, timer=timer)
        repeats = int(min(max(budget / (timer() - t0), MIN_ROUNDS), 200))
        result = compare({"eager": eager.step, "compiled": compiled.step}, repeats, timer=timer)
        row = LabRow(profile, label, sum(p.numel() for p in params), steps,
                     1e3 * result.median("eager"), 1e3 * result.median("compiled"),
                     compiled.compiled.compile_seconds)  # fmt: skip
        log(f"  lab {profile} {label}: eager {row.eager_ms:.3f} ms, compiled "
            f"{row.compiled_ms:.3f} ms, compile {row.compile_s:.1f} s")  # fmt: skip
        rows.append(row)
    return rows


CACHE_SCRIPT = """
import sys, time, torch
torch.set_num_threads(1)
from lsdl_lab import optim
from benchmarks.optimizers import SIZES
params = [p.detach() for p in SIZES[sys.argv[1]][1]().parameters()]
for p in params:
    p.grad = torch.randn_like(p)
opt = optim.Adam(params, compile=True)
opt.step()
opt.step()
print(opt.compiled.compile_seconds)
"""


def cache_reuse(size: str) -> tuple[float, float]:
    """Seconds to compile Adam's update on the model of ``size`` in a fresh process with an
    empty TorchInductor cache, then in a second fresh process with the cache the first
    left (its FX-graph cache: the generated and compiled kernels)."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
        times = []
        for _ in range(2):
            out = subprocess.run(
                [sys.executable, "-c", CACHE_SCRIPT, size],
                cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=1800,
            )  # fmt: skip
            times.append(float(out.stdout.strip().splitlines()[-1]))
    return times[0], times[1]


def gbps(row: Row, impl: Impl, n: int) -> float:
    return row.minimum * n / (impl.ms * 1e-3) / 1e9


def lab_table(rows: list[LabRow]) -> list[str]:
    out = [
        "",
        "## Does it pay in the labs? Adam on the labs' models",
        "",
        "Adam's step, eager foreach and compiled, on each profile's models (no cache flush: "
        "a lab's state stays in the caches between steps); break-even: the steps after "
        "which the time saved has repaid the compilation; a lab's steps: its optimizer "
        "steps with that model at that profile.",
        "",
        "| profile | model | parameters | eager ms | compiled ms | compile s | break-even "
        "steps | a lab's steps | pays? |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        pays = "yes" if r.break_even < r.steps else "no"
        out.append(
            f"| {r.profile} | {r.model} | {r.n:,} | {r.eager_ms:.3f} | {r.compiled_ms:.3f} "
            f"| {r.compile_s:.1f} | {r.break_even:,.0f} | {r.steps:,} | {pays} |"
        )
    return out


def report(sections, cache, head, labs=()) -> str:
    out = ["# The compiled path: every optimizer's update through torch.compile", "", *head, ""]
    out += [
        "ms: median step time [interquartile range], caches flushed before every step "
        "(backward not included; fixed gradients, warm state). GB/s: the step's *minimum* "
        "bytes per parameter (`benchmarks.bandwidth.minimum_traffic`: each array read and "
        "written once) / time; of B\\*: that as a fraction of B\\*, the streaming reference "
        "(`_foreach_add_` over tensors shaped like the model) timed in the same rounds. "
        "compiled ÷ fused: the ratio of the medians (goal ≤ "
        f"{FUSED_GOAL}); compile: the compiled optimizer's first compiled step (tracing, "
        "code generation, the C++ compiler; or the on-disk cache), not in its step time.",
    ]
    for header, n, rows in sections:
        out += [
            "",
            f"## {header}",
            "",
            "| optimizer | B\\* GB/s | implementation | ms [IQR] | min B/param | GB/s | of B\\* "
            "| compiled ÷ this | compile s |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        for row in rows:
            compiled = next((i for i in row.impls if i.name == "compiled" and not i.note), None)
            for impl in row.impls:
                first = impl is row.impls[0]
                cells = f"| {row.label} | {row.stream:.2f} " if first else "| | "
                if impl.note:
                    out.append(f"{cells}| {impl.name} | {impl.note} | | | | | |")
                    continue
                rate = gbps(row, impl, n)
                ratio = (
                    f"{compiled.ms / impl.ms:.2f}"
                    if compiled is not None and impl is not compiled
                    else ""
                )
                comp = f"{row.compile_s:.1f}" if impl.name == "compiled" else ""
                out.append(
                    f"{cells}| {impl.name} | {impl.ms:.2f} [{impl.q[0]:.2f}–{impl.q[1]:.2f}] "
                    f"| {row.minimum:g} | {rate:.2f} | {rate / row.stream:.0%} | {ratio} | {comp} |"
                )
        out += ["", *goals(rows, n)]
    if labs:
        out += lab_table(labs)
    if cache is not None:
        size, cold, warm = cache
        out += [
            "",
            "## The compile cache across processes",
            "",
            f"Adam's update on the {size} model, compiled in a fresh process with an empty "
            f"TorchInductor cache: {cold:.1f} s; in a second fresh process with the cache the "
            f"first left (TorchInductor's FX-graph cache, on disk): {warm:.1f} s "
            f"({cold / warm:.1f}x faster). What remains is tracing the update (dynamo) and "
            "loading the cached kernels.",
        ]
    return "\n".join(out) + "\n"


def goals(rows, n) -> list[str]:
    """The goals met and missed in one section, row by row."""
    lines = []
    for row in rows:
        by = {i.name: i for i in row.impls if not i.note}
        if "compiled" not in by:
            lines.append(f"- {row.label}: not compiled ({row.impls[1].note}).")
            continue
        share = gbps(row, by["compiled"], n) / row.stream
        text = f"- {row.label}: compiled at {share:.0%} of B\\*"
        text += " (goal met)" if share >= ROOF_GOAL else " (**goal of 80% missed**)"
        if "torch fused" in by:
            ratio = by["compiled"].ms / by["torch fused"].ms
            met = "met" if ratio <= FUSED_GOAL else "**missed**"
            text += f"; {ratio:.2f}x torch fused (goal ≤ {FUSED_GOAL}: {met})"
        lines.append(text + ".")
    return lines


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1M,10M,50M", help="from tiny,1M,10M,50M")
    add_device_options(parser)
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per row")
    parser.add_argument("--budget", type=float, default=2.0, help="seconds per row (default 2)")
    parser.add_argument("--only", default=None, help="comma-separated lsdl_lab names")
    parser.add_argument(
        "--all-at",
        default=None,
        help="sizes with every row (default: all); the others "
        "run the rows with a torch fused kernel only (compiling every row at every size "
        "takes long)",
    )
    parser.add_argument("--cache-size", default="1M", help="model of the cache measurement")
    parser.add_argument("--no-cache", action="store_true", help="skip the cache measurement")
    parser.add_argument("--no-labs", action="store_true", help="skip the labs' models")
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 rounds: a test")
    parser.add_argument("--out", type=Path, default=None, help=f"default {DEFAULT_OUT}")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.rounds, args.no_cache = "tiny", args.rounds or 2, True
        args.no_labs = True
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if not sizes or any(s not in optimizers.SIZES for s in sizes):
        parser.error(f"Invalid --sizes {args.sizes!r} (choose from {', '.join(optimizers.SIZES)})")
    only = None
    if args.only is not None:
        only = {s.strip() for s in args.only.split(",") if s.strip()}
        known = {name for _, name, *_ in ROWS}
        if not only or only - known:
            parser.error(f"Invalid --only {sorted(only - known)} (choose from {sorted(known)})")
    device, timer, head = device_setup(parser, args)
    scratch = torch.ones(int(FLUSH_MB * 2**20 / 4) if not args.quick else 2**18, device=device)

    def flush():
        scratch.sum()

    all_at = sizes if args.all_at is None else [s.strip() for s in args.all_at.split(",")]
    sections = [benchmark_size(s, device, args.rounds, args.budget, timer, flush, only,
                               goal_rows_only=s not in all_at)
                for s in sizes]  # fmt: skip
    labs = [] if args.no_labs else lab_profiles(device, timer, args.budget)
    cache = None
    if not args.no_cache and device.type == "cpu":
        cache = (args.cache_size, *cache_reuse(args.cache_size))
        log(f"  cache: cold {cache[1]:.1f} s, warm {cache[2]:.1f} s")
    head += [
        f"- load average at end: {load_average()}",
        "- timing: 2 untimed steps each (the first creates the state, the second compiles), "
        "then "
        + (f"{args.rounds} rounds" if args.rounds else f"{MIN_ROUNDS}–{MAX_ROUNDS} rounds")
        + " per row, every implementation and B* once per round, the first alternating; "
        f"a {FLUSH_MB} MiB read before every timed step",
    ]
    text = report(sections, cache, head, labs)
    default = None if args.quick or only is not None else results_path(DEFAULT_OUT, device)
    out = args.out if args.out is not None else default
    write_report(text, out, log)
    return text


if __name__ == "__main__":
    main()
