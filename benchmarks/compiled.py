"""The compiled path against the memory-bandwidth roof: every optimizer's own ``update``
through ``torch.compile`` (``compile=True``), beside its eager foreach path, torch.optim's
fused kernel where torch has one, and pytorch-optimizer's where it has the optimizer.

The rows come from the package: every optimizer class that ``lsdl_lab.optim.__all__``
exports, with the variants of :data:`VARIANTS` (momentum, Nesterov, AMSGrad); a class whose
``update`` cannot be compiled (its ``not_compilable`` reason: Shampoo, Newton,
Hessian-free) is listed with the reason it falls back to eager, and one whose step needs
more than fixed gradients (SAM, K-FAC: :data:`NOT_TIMED`) with why it is not timed here.

For each optimizer and model size: the step time of each implementation (caches flushed
before every step, all implementations interleaved round by round with B*, the streaming
reference of ``benchmarks/bandwidth.py``: a ``_foreach_add_`` over tensors shaped like the
model, timed in the same rounds), the **minimum** bytes per parameter any implementation
must move (:func:`benchmarks.bandwidth.minimum_bytes_per_param`), and so the fraction of
the streaming bandwidth each reaches; and for the compiled path, the bytes its kernels move
by TorchInductor's own count and the number of kernels it generated (replayed from the
cache when the graph came from there). The compiled optimizer's compilation (its first
compiled step) is timed apart, kept out of the step times, and marked when TorchInductor's
on-disk cache served it.

Then the labs (:data:`LAB_RUNS`): each lab's optimizer on its model, eager and compiled, at
the smoke and cpu profiles (measured) and at gpu (estimated from the model's size and the
bytes its eager step moves): does compiling pay for a lab's run? Finally the cache across
processes: a fresh process compiles Adam's update with an empty TorchInductor cache, a
second one with the cache the first left (:data:`CACHE_SCRIPT`).

Goals (issue 18): compiled within 1.1x of torch's fused kernel for SGD with momentum,
Adagrad, Adam and AdamW; at least 80% of B* for every optimizer. A row that misses one says
why, from what was measured.

Run from the repository root::

    python -m benchmarks.compiled                        # every row: over an hour cold
    python -m benchmarks.compiled --rows-minutes 9 --labs-minutes 2   # 13 min, goal rows first
    python -m benchmarks.compiled --sizes 10M --only Adam,SGD
    python -m benchmarks.compiled --quick                # one optimizer, tiny: a test

A cold compile of one optimizer for the 10M model takes 1-2 min here (TorchInductor's
scheduling and code generation, then the C++ compiler), a compile served by the cache a few
seconds: ``--all-at`` runs every optimizer at some sizes only, the goal rows at the others.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks import ROOT, optimizers
from benchmarks.bandwidth import implemented_bytes_per_param, minimum_bytes_per_param
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
from lsdl_lab import data, models, optim
from lsdl_lab.profiles import PROFILES

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "compiled.md"
# The benchmark's own TorchInductor cache (unless TORCHINDUCTOR_CACHE_DIR names one): every
# graph in it was compiled with TorchInductor's byte count on, which a cache hit replays
CACHE_DIR = Path(tempfile.gettempdir()) / "lsdl_benchmarks_inductor"
FLUSH_MB = 256  # read before every timed step: beyond this machine's 105 MB L3 cache
MIN_ROUNDS, MAX_ROUNDS = 5, 40
FUSED_GOAL, ROOF_GOAL = 1.1, 0.8
FUSED = ("SGD", "Adagrad", "Adam", "AdamW")  # torch.optim's fused CPU kernels
GOAL_ROWS = ("SGD momentum=0.9", "Adagrad", "Adam", "AdamW")  # the fused goal
# The order rows run in, so that a time budget keeps the goal rows, then the optimizers
# torch has no fused kernel for (issue 18 names these), then the others in the package's order
FIRST = (*GOAL_ROWS, "LARS", "LAMB", "Adafactor", "SM3")

# Variants of one class that run different code (a class not listed: one row, defaults).
VARIANTS = {
    "SGD": [
        ("SGD", dict(lr=1e-3)),
        ("SGD momentum=0.9", dict(lr=1e-3, momentum=0.9)),
        ("SGD nesterov", dict(lr=1e-3, momentum=0.9, nesterov=True)),
    ],
    "Adam": [("Adam", {}), ("Adam amsgrad", dict(amsgrad=True))],
    # pytorch-optimizer's settings that compute the same update (benchmarks/optimizers.py)
    "LARS": [("LARS", dict(lr=0.1, momentum=0.9, eps=0.0))],
    "LAMB": [("LAMB", dict(lr=1e-3, weight_decay=0.01, bias_correction=False, clamp=(0, 10)))],
}
LARS_DECAY = 1e-4  # LARS's groups (param_groups_for_layerwise) as pytorch-optimizer's


def theirs(name: str):
    """pytorch-optimizer's factory for the lsdl_lab optimizer ``name`` (from the parameter
    list), or None where it has none; it raises ImportError when not installed."""

    def make(po_name, **kwargs):
        def build(params):
            module = optimizers.pytorch_optimizer()
            if module is None:
                raise ImportError("pytorch_optimizer is not installed")
            return getattr(module, po_name)(params, **kwargs)

        return build

    return {
        "LARS": make("LARS", lr=0.1, momentum=0.9, weight_decay=LARS_DECAY, foreach=True),
        "LAMB": make("Lamb", lr=1e-3, weight_decay=0.01, weight_decouple=False, foreach=True),
        "Adafactor": make("AdaFactor", betas=(None, 0.999)),
        "SM3": make("SM3", foreach=True),
    }.get(name)


# Optimizers whose step is more than an update from fixed gradients.
NOT_TIMED = {
    "SAM": "wraps a base optimizer (compile=True goes to the base, in base_kwargs: its "
    "update is the base's row here); its own perturbation needs a second forward and "
    "backward pass per step",
    "KFAC": "preconditions eagerly (per-layer factors from the model's forward and backward "
    "hooks, refreshed every update_freq steps) and compiles only its momentum update (the "
    "SGD momentum row's); its step cannot run from fixed gradients alone",
}


# Why a row stays below the roof, from reading TorchInductor's generated C++ (TORCH_LOGS=
# output_code) and profiling its steps: added to the measured reason of a row that misses
ANALYSIS = {
    "SGD": "plain SGD is one streaming pass, so the compiled step's fixed cost (the lists of "
    "parameters and gradients, the checks of every tensor before the direct call, the Python "
    "wrapper around the kernels) is a large share of so short a step, where the eager step "
    "is a single ATen call",
    "LARS": "its norms are two more reductions before the step (torch's _foreach_norm, a "
    "call TorchInductor leaves to ATen, reads w and g once more); the trust ratios are "
    "computed once, before the loops, and the loops move the minimum",
    "LAMB": "the trust ratio needs ||u|| of the whole layer before any of its weights moves: "
    "two passes per layer, by the algorithm; TorchInductor then runs every layer's norm "
    "loop before any layer's step loop, so the second pass reads w, g, m and v back from "
    "memory, not the caches, and recomputes m, v and u",
    "Adafactor": "TorchInductor's CPU loops never fuse a mean along the rows with one along "
    "the columns, so G is read three times; and the step is bound by arithmetic: U_t = G_t "
    "rsqrt(max(V_hat, eps1^2)) is computed in two loops (for RMS(U_t), then for the step), "
    "each with an exact square root and a division per 8 numbers (storing U_t costs more)",
    "SM3": "the row maxima and the column maxima of nu = min(mu_row, mu_col) + g^2 are two "
    "more loops over g (TorchInductor fuses neither into the step's loop; the column maxima "
    "walk strided column strips), each recomputing nu, and the step takes an exact "
    "square root and a division per 8 numbers",
}


@dataclass
class Entry:
    """One row of the benchmark (``options`` set) or one optimizer only listed (``reason``)."""

    label: str
    name: str
    options: dict = field(default_factory=dict)
    reason: str = ""


def book_rows() -> list[Entry]:
    """Every optimizer of ``lsdl_lab.optim.__all__``, in its order: its variants' rows, or
    the reason it falls back to eager or is not timed here."""
    out = []
    for name in optim.__all__:
        cls = getattr(optim, name)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            continue
        if cls is optim.Optimizer:
            continue
        if getattr(cls, "not_compilable", ""):
            out.append(Entry(name, name, reason="falls back to eager: " + cls.not_compilable))
        elif name in NOT_TIMED:
            out.append(Entry(name, name, reason="not timed here: " + NOT_TIMED[name]))
        else:
            out += [Entry(label, name, opts) for label, opts in VARIANTS.get(name, [(name, {})])]
    return out


def minimum_bytes(name: str, options: dict, params: list[torch.Tensor]) -> float:
    """Minimum bytes per parameter of one step (:func:`minimum_bytes_per_param`). SM3 has no
    count there, since it depends on the model: a matrix's accumulators are vectors (one per
    row, one per column, a negligible share of the traffic, as Adafactor's), so it moves what
    SGD with the same momentum moves; a vector's accumulator is a full-size array (SM3 is
    Adagrad there), what RMSprop with the same momentum moves. Muon's matrices move what its
    count says; its other parameters (:func:`lsdl_lab.optim.muon_param_groups`) AdamW's."""
    size = params[0].element_size()
    if name not in ("SM3", "Muon"):
        return minimum_bytes_per_param(name, options, size)
    momentum = {"momentum": options.get("momentum", 0.0)}
    matrix = minimum_bytes_per_param("SGD", momentum, size)
    vector = minimum_bytes_per_param("RMSprop", momentum, size)
    if name == "Muon":  # its matrices' count (the iteration uncounted), AdamW's for the rest
        matrix, vector = (minimum_bytes_per_param(n, {}, size) for n in ("Muon", "AdamW"))
    n = sum(p.numel() for p in params)
    return sum((matrix if p.dim() >= 2 else vector) * p.numel() for p in params) / n


def lsdl(entry: Entry, params, compile: bool):
    if entry.name == "LARS":
        params = optim.param_groups_for_layerwise(params, LARS_DECAY)
    if entry.name == "Muon":
        params = optim.muon_param_groups(params)
    return getattr(optim, entry.name)(params, **entry.options, compile=compile)


# The compiled path through torch's public interfaces alone (dynamo's guards before every
# step, no direct call of the kernels): what the one private piece of lsdl_lab.optim.compiled
# (DirectCall) is measured against, in the rows of the fused goal
PUBLIC = "compiled, dynamo's guards"


def public_path(entry: Entry, params):
    """The row's compiled optimizer as a class of this module's: ``compile=True`` calls the
    kernels of a class defined outside ``lsdl_lab`` through dynamo only (its guards, then
    its gathering of the inputs), the public path."""
    cls = getattr(optim, entry.name)
    outside = type(cls.__name__, (cls,), {"__module__": __name__})
    return outside(params, **entry.options, compile=True)


def candidates(entry: Entry, params) -> list[tuple[str, object]]:
    """(implementation, optimizer or the reason it is missing) of one row."""
    out = [("eager foreach", lsdl(entry, params, False)), ("compiled", lsdl(entry, params, True))]
    if entry.label in GOAL_ROWS:
        out.append((PUBLIC, public_path(entry, params)))
    if entry.name in FUSED:
        torch_cls = getattr(torch.optim, entry.name)
        out.append(("torch fused", torch_cls(params, **entry.options, fused=True)))
    factory = theirs(entry.name)
    if factory is not None:
        try:
            out.append(("pytorch-optimizer", factory(params)))
        except ImportError as e:
            out.append(("pytorch-optimizer", str(e)))
    return out


def quiet_inductor_metrics() -> None:
    """Have TorchInductor count the bytes each compiled graph's kernels move (it counts only
    with its metrics log at INFO), without printing that log. Importing TorchInductor fixes
    its cache directory: set ``TORCHINDUCTOR_CACHE_DIR`` before."""
    from torch._inductor import compile_fx

    torch._logging.set_logs(inductor_metrics=True)
    log = compile_fx.inductor_metrics_log
    log.handlers[:] = [logging.NullHandler()]
    log.propagate = False


def inductor_counts() -> dict[str, int]:
    """TorchInductor's running counts: its on-disk (FX-graph) cache's hits and misses, the
    kernels it generated and the bytes they move by its count (both replayed on a hit)."""
    from torch._inductor import metrics

    counters = torch._dynamo.utils.counters["inductor"]
    return dict(
        hits=counters["fxgraph_cache_hit"],
        misses=counters["fxgraph_cache_miss"],
        kernels=metrics.generated_kernel_count,
        bytes=metrics.num_bytes_accessed,
    )


class Deadline:
    """A time budget in minutes from now (None: unlimited): a row or lab measurement that
    would start after it is listed as not measured, with the reason, instead of run."""

    def __init__(self, minutes: float | None):
        self.minutes = minutes
        self.end = math.inf if minutes is None else time.perf_counter() + 60 * minutes

    def passed(self) -> bool:
        return time.perf_counter() > self.end

    def reason(self, what: str) -> str:
        return f"not measured in this run: its {self.minutes:g}-minute budget for {what} was spent"


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
    tensors: int
    impls: list[Impl] = field(default_factory=list)
    stream: float = float("nan")  # B*: GB/s, median of the rounds
    compile_s: float = float("nan")
    cached: str = ""  # "cold", "cache" or "mixed": how the compile was served
    kernels: int = 0  # kernels TorchInductor generated for the step's graphs
    inductor_bytes: float = float("nan")  # bytes per parameter by TorchInductor's count
    rounds: int = 0


def model_params(size: str, device) -> list[torch.Tensor]:
    """The parameters of the model of ``size``, detached from it and trainable, as a model's
    are (``param_groups_for_layerwise``, LARS's groups, keeps only trainable ones)."""
    torch.manual_seed(0)
    return [
        p.detach().to(device).requires_grad_() for p in optimizers.SIZES[size][1]().parameters()
    ]


def benchmark_size(size, device, rounds, budget, timer, flush, entries, deadline, skipped):
    """The rows of ``entries`` on the model of ``size``: (header, parameters, rows). A row
    due after ``deadline`` is appended to ``skipped`` as (size, label) instead."""
    params = model_params(size, device)
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

    def restore():  # Nesterov, LARS and others write into p.grad: the same input each time
        torch._foreach_copy_(grads, fixed)

    def setup():
        restore()
        flush()

    rows = []
    for entry in entries:
        if deadline.passed():
            skipped.append((size, entry.label))
            continue
        row = Row(
            entry.label, minimum_bytes(entry.name, entry.options, params), tensors=len(params)
        )
        steps = {}
        for impl, opt in candidates(entry, params):
            if isinstance(opt, str):
                row.impls.append(Impl(impl, note=opt))
                continue
            restore()
            opt.step()  # creates the state (eagerly, on every path)
            restore()
            before, start = inductor_counts(), time.perf_counter()
            opt.step()  # the compiled path's first compiled step: the compilation
            if impl == "compiled":
                after = inductor_counts()
                row.compile_s = opt.compiled.compile_seconds
                hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
                row.cached = "mixed" if hits and misses else "cache" if hits else "cold"
                row.kernels = after["kernels"] - before["kernels"]
                row.inductor_bytes = (after["bytes"] - before["bytes"]) / n
                if opt.compiled.failure:
                    row.impls.append(Impl(impl, note=f"eager: {opt.compiled.failure[:80]}"))
                    continue
            warm = time.perf_counter() - start
            log(f"  {entry.label:<18} {impl:<18} first warm step {warm:.2f} s")
            steps[impl] = opt.step
            row.impls.append(Impl(impl))
        restore()
        t0 = timer()
        compare(steps, repeats=1, warmup=1, setup=restore, timer=timer)
        row.rounds = rounds or int(min(max(budget / (timer() - t0), MIN_ROUNDS), MAX_ROUNDS))
        result = compare({**steps, "B*": stream}, row.rounds, warmup=1, setup=setup, timer=timer)
        row.stream = quartiles([12 * n / t / 1e9 for t in result.times["B*"]])[1]
        for impl in row.impls:
            if impl.name in steps:
                q1, med, q3 = quartiles(result.times[impl.name])
                impl.ms, impl.q = 1e3 * med, (1e3 * q1, 1e3 * q3)
        rows.append(row)
        for impl in row.impls:
            log(f"  {entry.label:<18} {impl.name:<18} " + (impl.note or f"{impl.ms:9.3f} ms"))
        log(f"  {entry.label:<18} B* {row.stream:.2f} GB/s; compile {row.compile_s:.1f} s "
            f"({row.cached}); {row.kernels} kernels, {row.inductor_bytes:.1f} B/param")  # fmt: skip
        del steps
    return header, n, rows


# --- the labs -----------------------------------------------------------------------------

# The data each profile's labs read: (training images, image shape, characters of the text
# vocabulary). smoke and cpu load theirs (digits and Python's source ship with the
# packages); gpu's are CIFAR-10's 50,000 training images of 3x32x32 and Tiny Shakespeare's
# 65 characters (Karpathy's char-rnn file), which need a download.
GPU_DATA = (50_000, (3, 32, 32), 65)
# A T4's memory bandwidth (GB/s, NVIDIA's data sheet): Colab's free GPU, the slowest the gpu
# profile runs on, where a step's bytes cost the most time and compiling saves the most.
GPU_GBPS = 320.0


def profile_data(profile) -> tuple[int, tuple[int, ...], int]:
    if profile.name == "gpu":
        return GPU_DATA
    images = data.load_images(profile.image_dataset).subset(profile.max_train_examples)
    text = data.load_text(profile.text_dataset, max_chars=profile.max_text_chars)
    return len(images.train_y), tuple(images.input_shape), text.vocab_size


def lab_resnet(P, d, depth=None):
    return models.ResNet(depth or P.resnet_depth, P.resnet_width, 10, d[1][0])


def lab6_gpt(P, d):
    layers, heads, width, block = P.pick(
        smoke=(P.gpt_layers, P.gpt_heads, P.gpt_dim, P.block_size),
        cpu=(1, 2, 64, 32),
        gpu=(P.gpt_layers, P.gpt_heads, P.gpt_dim, P.block_size),
    )
    return models.GPT(d[2], block, layers, heads, width)


def epochs_of(batch):
    """Steps of ``epochs`` passes over a profile's training images in batches of ``batch``."""
    return lambda epochs, d: epochs * math.ceil(d[0] / batch)


# Each lab's runs with an lsdl_lab optimizer, as the notebooks build them (labs/*.ipynb):
# (lab and run, model (profile, data), optimizer and options, optimizer steps of one run
# (profile, data)). Labs 1, 2, 5 and 7 train with torch.optim, which has no compile=True.
LAB_RUNS = [
    ("Lab 3, ResNet race (10 optimizers)", lambda P, d: models.resnet_for(P, 10, d[1][0]),
     ("Adam", {}), lambda P, d: P.pick(smoke=2, cpu=3, gpu=1) * math.ceil(d[0] / P.batch_size)),
    ("Lab 3, GPT race (10 optimizers)", lambda P, d: models.gpt_for(P, d[2]), ("Adam", {}),
     lambda P, d: P.pick(smoke=30, cpu=100, gpu=120)),
    ("Lab 4a, ResNet at B0 (SGD momentum)",
     lambda P, d: lab_resnet(P, d, P.pick(smoke=P.resnet_depth, cpu=8, gpu=P.resnet_depth)),
     ("SGD", dict(lr=0.04, momentum=0.9, weight_decay=5e-4)),
     lambda P, d: P.pick(smoke=20, cpu=30, gpu=4)
     * math.ceil(d[0] / P.pick(smoke=16, cpu=16, gpu=128))),
    ("Lab 4b, ResNet (LARS)", lambda P, d: models.resnet_for(P, 10, d[1][0]),
     ("LARS", dict(lr=3.0, momentum=0.9)),
     lambda P, d: P.pick(smoke=15, cpu=30, gpu=4) * math.ceil(d[0] / P.batch_size)),
    ("Lab 4b, GPT (LAMB)", lambda P, d: models.gpt_for(P, d[2]), ("LAMB", dict(lr=0.05)),
     lambda P, d: P.pick(smoke=40, cpu=60, gpu=50)),
    ("Lab 6, ResNet (Adam; K-FAC's momentum as SGD's)",
     lambda P, d: lab_resnet(P, d, P.pick(smoke=P.resnet_depth, cpu=8, gpu=P.resnet_depth)),
     ("Adam", dict(lr=1e-2)), lambda P, d: P.pick(smoke=40, cpu=50, gpu=400)),
    ("Lab 6, GPT (Adam)", lab6_gpt, ("Adam", dict(lr=3e-3)),
     lambda P, d: P.pick(smoke=40, cpu=80, gpu=300)),
    ("Lab 8, GPT (Adam, Adafactor, SM3)", lambda P, d: models.gpt_for(P, d[2]),
     ("Adam", dict(lr=3e-3)), lambda P, d: P.pick(smoke=60, cpu=60, gpu=300)),
    ("Lab 9, MLP (AdamW, per rank)",
     lambda P, d: models.MLP(math.prod(d[1]), 10, P.mlp_hidden), ("AdamW", dict(lr=3e-3)),
     lambda P, d: P.pick(smoke=12, cpu=60, gpu=300)),
]  # fmt: skip


@dataclass
class LabRow:
    lab: str
    profile: str
    n: int
    tensors: int
    optimizer: str
    steps: int
    eager_ms: float = float("nan")
    compiled_ms: float = float("nan")  # NaN: not compiled (then ``floor`` decides)
    compile_s: float = float("nan")
    cached: str = ""  # "cold" or "cache": how the compile was served
    estimated: bool = False  # gpu: from bytes and an assumed bandwidth, not timed
    floor: float = float("nan")  # seconds: the fastest compile measured in this run

    @property
    def eager_run_s(self) -> float:
        """Seconds of the run's optimizer steps on the eager path."""
        return self.steps * self.eager_ms / 1e3

    @property
    def saved_s(self) -> float:
        """Seconds the compiled path saves over the run's steps, less its compilation."""
        return self.steps * (self.eager_ms - self.compiled_ms) / 1e3 - self.compile_s

    @property
    def break_even(self) -> float:
        """Steps after which the compiled path has repaid its compilation."""
        saved = (self.eager_ms - self.compiled_ms) / 1e3
        return self.compile_s / saved if saved > 0 else float("inf")

    @property
    def verdict(self) -> str:
        """Whether compiling pays for the run: from the timed compiled step where there is
        one; else "no" when the whole run's eager steps take less than the fastest compile
        of this run (no compiled step, however fast, can then repay its compilation)."""
        if not math.isnan(self.compiled_ms) and not math.isnan(self.compile_s):
            return "yes" if self.break_even < self.steps else "no"
        if self.eager_run_s < self.floor:
            return "no (bound)"
        return "unknown"


@contextlib.contextmanager
def empty_inductor_cache():
    """TorchInductor's on-disk cache pointed at a new, empty folder while the block runs
    (``TORCHINDUCTOR_CACHE_DIR``, read at every compile), then removed: a compilation as a
    student's first run meets it, in a fresh runtime whose cache is empty."""
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="lsdl_inductor_") as empty:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = empty
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


def lab_step(make, name, options, compile):
    """An optimizer ``name`` over a fresh model's parameters, with fixed gradients and its
    state created (and, compiled, its graph): (optimizer, parameters)."""
    torch.manual_seed(0)
    params = [p.detach() for p in make().parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = getattr(optim, name)(params, **options, compile=compile)
    opt.step()
    return opt, params


def time_steps(fns, timer, budget) -> dict[str, float]:
    """Median milliseconds of each step of ``fns``, interleaved, for about ``budget`` s."""
    t0 = timer()
    compare(fns, repeats=1, warmup=1, timer=timer)
    repeats = int(min(max(budget / (timer() - t0), MIN_ROUNDS), 200))
    result = compare(fns, repeats, timer=timer)
    return {name: 1e3 * result.median(name) for name in fns}


def lab_rows(profiles, timer, budget, deadline, compiles) -> list[LabRow]:
    """Each lab run's optimizer step at the timed ``profiles`` (eager always; compiled and
    its compilation while ``deadline`` allows, largest models first) and its estimate at
    gpu. ``compiles``: compile times measured earlier in this run, for the lower bound. No
    cache flush: a lab's small state stays in the caches between steps. A model and
    optimizer that several runs share is measured once."""
    runs = []
    for pname in [*profiles, "gpu"]:
        P = PROFILES[pname]
        d = profile_data(P)
        for lab, model, (name, options), steps in LAB_RUNS:
            make = functools.partial(model, P, d)
            probe = make()
            params = list(probe.parameters())
            row = LabRow(lab, pname, sum(p.numel() for p in params), len(params), name,
                         steps(P, d))  # fmt: skip
            runs.append((row, make, options, (pname, repr(probe), name)))
    measured = {}
    timed = [r for r in runs if r[0].profile != "gpu"]
    for row, make, options, key in sorted(timed, key=lambda r: -r[0].n):
        if key in measured:
            continue
        eager, _ = lab_step(make, row.optimizer, options, False)
        fns = {"eager": eager.step}
        compile_s, cached = float("nan"), ""
        if not deadline.passed():
            before = inductor_counts()
            compiled, _ = lab_step(make, row.optimizer, options, True)
            with empty_inductor_cache():  # as in a student's fresh runtime
                compiled.step()  # compiles
            cached = "cache" if inductor_counts()["hits"] > before["hits"] else "cold"
            compile_s = compiled.compiled.compile_seconds
            compiles.append(compile_s)
            fns["compiled"] = compiled.step
        ms = time_steps(fns, timer, budget)
        measured[key] = (ms["eager"], ms.get("compiled", float("nan")), compile_s, cached)
        log(f"  {row.lab} at {row.profile}: {row.n:,} parameters, {ms} ms, compile "
            f"{compile_s:.1f} s ({cached or 'not compiled: the budget'})")  # fmt: skip
    floor = min((c for c in compiles if c > 0), default=float("nan"))
    for row, make, options, key in runs:
        row.floor = floor
        if row.profile != "gpu":
            row.eager_ms, row.compiled_ms, row.compile_s, row.cached = measured[key]
            continue
        row.estimated = True
        opt, params = lab_step(make, row.optimizer, options, False)
        row.eager_ms = implemented_bytes_per_param(opt.step, row.n) * row.n / GPU_GBPS / 1e6
        row.compiled_ms = minimum_bytes(row.optimizer, options, params) * row.n / GPU_GBPS / 1e6
        row.compile_s = floor  # a lower bound: a GPU's compile adds Triton's
    return [r[0] for r in runs]


# --- the compile cache across processes -----------------------------------------------------

CACHE_SCRIPT = """
import sys, torch
torch.set_num_threads(1)
from lsdl_lab import optim
from benchmarks.optimizers import SIZES
params = [p.detach() for p in SIZES[sys.argv[1]][1]().parameters()]
for p in params:
    p.grad = torch.randn_like(p)
opt = optim.Adam(params, compile=True)
opt.step()
opt.step()
counters = torch._dynamo.utils.counters["inductor"]
print(opt.compiled.compile_seconds, counters["fxgraph_cache_hit"], counters["fxgraph_cache_miss"])
"""


def cache_reuse(size: str) -> list[tuple[float, int, int]]:
    """(compile seconds, FX-graph cache hits, misses) of Adam's update on the model of
    ``size``, compiled in a fresh process with an empty TorchInductor cache, then in a second
    fresh process with the cache the first left on disk."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
        runs = []
        for _ in range(2):
            out = subprocess.run(
                [sys.executable, "-c", CACHE_SCRIPT, size],
                cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=1800,
            )  # fmt: skip
            seconds, hits, misses = out.stdout.strip().splitlines()[-1].split()
            runs.append((float(seconds), int(hits), int(misses)))
    return runs


# --- the report -----------------------------------------------------------------------------


def gbps(row: Row, impl: Impl, n: int) -> float:
    return row.minimum * n / (impl.ms * 1e-3) / 1e9


def roof_ms(row: Row, bytes_per_param: float, n: int) -> float:
    """Milliseconds ``bytes_per_param`` take at B*, the row's streaming bandwidth."""
    return bytes_per_param * n / (row.stream * 1e9) * 1e3


def why_slow(row: Row, compiled: Impl, n: int) -> str:
    """The measured reason a compiled step is slower than the roof: the traffic of its
    kernels (TorchInductor's count) at B*, against the rest of its time."""
    moved = row.inductor_bytes
    kernels = f"{row.kernels} kernels for {row.tensors} tensors"
    if not moved > 0:  # its cache served a graph compiled without TorchInductor's count
        return f"{kernels} (TorchInductor's byte count missing: a graph from another cache)"
    at_roof = roof_ms(row, moved, n)
    if moved > 1.1 * row.minimum:
        return (
            f"its kernels move {moved:.1f} B/param by TorchInductor's count ({kernels}), "
            f"{moved / row.minimum:.2f}x the minimum: that traffic alone takes "
            f"{at_roof:.2f} ms at B\\*, of its {compiled.ms:.2f} ms"
        )
    return (
        f"its kernels move the minimum ({moved:.1f} B/param by TorchInductor's count, "
        f"{kernels}), {at_roof:.2f} ms at B\\*: the other {compiled.ms - at_roof:.2f} ms of "
        f"its {compiled.ms:.2f} ms are not memory traffic (arithmetic in the kernels' loops, "
        "or the fixed cost of a step: the optimizer's lists of parameters, gradients and "
        "states, the checks of every tensor before the compiled kernels are called directly, "
        "and the Python wrapper around the few C++ functions that hold every tensor's loops)"
    )


def goals(rows: list[Row], n: int) -> list[str]:
    """The goals met and missed in one section, row by row, with the measured reason."""
    lines = []
    for row in rows:
        by = {i.name: i for i in row.impls if not i.note}
        if "compiled" not in by:
            note = next(i.note for i in row.impls if i.name == "compiled")
            lines.append(f"- {row.label}: not compiled ({note}).")
            continue
        c = by["compiled"]
        share = gbps(row, c, n) / row.stream
        met = share >= ROOF_GOAL
        text = f"- {row.label}: compiled at {share:.0%} of B\\*"
        text += " (goal met)" if met else f" (**goal of {ROOF_GOAL:.0%} missed**)"
        if "torch fused" in by and row.label in GOAL_ROWS:
            f = by["torch fused"]
            ratio = c.ms / f.ms
            text += f"; {ratio:.2f}x torch fused (goal ≤ {FUSED_GOAL}: "
            text += "met)" if ratio <= FUSED_GOAL else "**missed**)"
            if ratio > FUSED_GOAL:
                met = False
                text += f"; fused {f.ms:.2f} ms, {gbps(row, f, n) / row.stream:.0%} of B\\*"
        why = "" if met else f": {why_slow(row, c, n)}"
        if not met and row.label in ANALYSIS:
            why += f"; why: {ANALYSIS[row.label]}"
        lines.append(text + why + ".")
    return lines


def size_table(header: str, n: int, rows: list[Row]) -> list[str]:
    out = [
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
            cells = f"| {row.label} | {row.stream:.2f} " if impl is row.impls[0] else "| | "
            if impl.note:
                out.append(f"{cells}| {impl.name} | {impl.note} | | | | | |")
                continue
            rate = gbps(row, impl, n)
            ratio = f"{compiled.ms / impl.ms:.2f}" if compiled and impl is not compiled else ""
            comp = f"{row.compile_s:.1f} ({row.cached})" if impl.name == "compiled" else ""
            out.append(
                f"{cells}| {impl.name} | {impl.ms:.2f} [{impl.q[0]:.2f}–{impl.q[1]:.2f}] "
                f"| {row.minimum:.4g} | {rate:.2f} | {rate / row.stream:.0%} | {ratio} | {comp} |"
            )
    return out + ["", *goals(rows, n)]


def lab_table(rows: list[LabRow]) -> list[str]:
    floor = next((r.floor for r in rows), float("nan"))
    out = [
        "",
        "## Does it pay in the labs?",
        "",
        "Each lab run's optimizer (`LAB_RUNS`: the model and optimizer the notebook builds at "
        "that profile, and the optimizer steps of one run) with fixed gradients, no cache "
        "flush (a lab's state stays in the caches between steps). smoke and cpu: timed here, "
        "eager always, compiled (and its compilation, with an empty TorchInductor cache, "
        "as in a student's fresh runtime) for the largest models while the "
        "labs' time budget lasted. gpu: *estimated* (est.): the bytes per parameter the "
        "eager step's operations move (`benchmarks.bandwidth.implemented_bytes_per_param`) "
        f"and the compiled step's minimum, at {GPU_GBPS:.0f} GB/s (a T4, Colab's GPU; "
        "neither path's fixed cost per call counted). Compile s at gpu, and the bound: the "
        f"fastest compile measured in this run, {floor:.1f} s (a lower bound for any "
        "other). pays?: *yes* when the run's steps pass the break-even (the steps after "
        "which the time saved has repaid the compilation); *no (bound)* when the run's "
        "eager steps take less in all than that fastest compile, so that no compiled step, "
        "however fast, could repay it. saved s: over the run, less the compilation.",
        "",
        "| lab run | profile | parameters (tensors) | optimizer | eager ms | compiled ms "
        "| compile s | steps | eager run s | break-even steps | saved s | pays? |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        est = " est." if r.estimated else ""
        compiled = not math.isnan(r.compiled_ms)
        comp = (
            f"≥ {r.compile_s:.1f}"
            if r.estimated
            else f"{r.compile_s:.1f} ({r.cached})"
            if compiled
            else "not compiled"
        )
        out.append(
            f"| {r.lab} | {r.profile} | {r.n:,} ({r.tensors}) | {r.optimizer} "
            f"| {r.eager_ms:.3f}{est} | "
            + (f"{r.compiled_ms:.3f}{est}" if compiled else "")
            + f" | {comp} | {r.steps:,} | {r.eager_run_s:.2f}{est} | "
            + (f"{r.break_even:,.0f} | {r.saved_s:,.1f}" if compiled else " | ")
            + f" | {r.verdict} |"
        )
    gaining = [f"{r.lab} at {r.profile}" for r in rows if r.verdict == "yes"]
    unknown = [f"{r.lab} at {r.profile}" for r in rows if r.verdict == "unknown"]
    timed = [r for r in rows if not r.estimated and not math.isnan(r.compiled_ms)]
    slower = sum(r.compiled_ms >= r.eager_ms for r in timed)
    if gaining:
        text = "Runs that gain: " + "; ".join(gaining) + "."
    else:
        text = "No lab's run gains: "
        if slower:
            text += (
                f"the compiled step was slower than the eager one in {slower} of the "
                f"{len(timed)} models compiled (its fixed cost per call outweighs the traffic "
                "a small model's step saves), and where it is faster, or where the run was "
            )
        elif timed:
            text += (
                f"the compiled step was faster than the eager one in all {len(timed)} models "
                "compiled, but there, as where the run was "
            )
        else:
            text += "where the run was "
        text += "not compiled, the run's steps save less than a compilation costs."
    if unknown:
        text += " Undecided (not compiled, and the bound does not settle it): "
        text += "; ".join(unknown) + "."
    return out + ["", text]


def report(sections, listed, labs, cache, head, skipped=(), skip_reason="") -> str:
    out = ["# The compiled path: every optimizer's update through torch.compile", "", *head, ""]
    out += [
        "ms: median step time [interquartile range], caches flushed before every step "
        "(backward not included; fixed gradients, warm state). GB/s: the step's *minimum* "
        "bytes per parameter (`benchmarks.bandwidth.minimum_bytes_per_param`: each array read "
        "and written once) / time; of B\\*: that as a fraction of B\\*, the streaming "
        "reference (`_foreach_add_` over tensors shaped like the model) timed in the same "
        f"rounds (goal ≥ {ROOF_GOAL:.0%}). compiled ÷ this: the ratio of the medians (goal ≤ "
        f"{FUSED_GOAL} against torch fused for {', '.join(GOAL_ROWS)}). compile s: the "
        "compiled optimizer's first compiled step (tracing, TorchInductor's code generation, "
        "the C++ compiler), kept out of its step time; *cold* when TorchInductor compiled "
        "every graph, *cache* when its on-disk cache served them (a graph this machine "
        "compiled before, in any process).",
    ]
    for header, n, rows in sections:
        out += size_table(header, n, rows)
    if listed or skipped:
        out += ["", "## Optimizers not in the tables", ""]
        out += [f"- {e.label}: {e.reason}." for e in listed]
        by_size = {}
        for size, label in skipped:
            by_size.setdefault(size, []).append(label)
        out += [f"- at {size}: {', '.join(labels)}: {skip_reason}." for size, labels in
                by_size.items()]  # fmt: skip
    if labs:
        out += lab_table(labs)
    if cache is not None:
        size, ((cold, _, cold_miss), (warm, warm_hit, _)) = cache
        out += [
            "",
            "## The compile cache across processes",
            "",
            f"Adam's update on the {size} model, compiled in a fresh process with an empty "
            f"TorchInductor cache: {cold:.1f} s ({cold_miss} graphs compiled); in a second "
            f"fresh process with the cache the first left on disk: {warm:.1f} s "
            f"({warm_hit} graphs from the cache), {cold / warm:.1f}x faster. What remains is "
            "tracing the update (dynamo) and loading the cached kernels.",
        ]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1M,10M,50M", help="from tiny,1M,10M,50M")
    add_device_options(parser)
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per row")
    parser.add_argument("--budget", type=float, default=2.0, help="seconds per row (default 2)")
    parser.add_argument("--only", default=None, help="comma-separated optimizer names or labels")
    parser.add_argument(
        "--all-at",
        default=None,
        help="sizes with every optimizer (default: every size); the others run the goal rows "
        f"only ({', '.join(GOAL_ROWS)}): a cold compile takes minutes",
    )
    parser.add_argument(
        "--rows-minutes",
        type=float,
        default=None,
        help="time budget of the optimizer rows (the goal rows first); rows due later are "
        "listed as not measured (default: none)",
    )
    parser.add_argument("--labs-minutes", type=float, default=None, help="the same, for the labs")
    parser.add_argument("--labs", default="cpu,smoke", help="profiles timed in the labs' table")
    parser.add_argument("--no-labs", action="store_true", help="skip the labs' table")
    parser.add_argument("--cache-size", default="1M", help="model of the cache measurement")
    parser.add_argument("--no-cache", action="store_true", help="skip the cache measurement")
    parser.add_argument("--quick", action="store_true", help="SGD momentum, tiny: a test")
    parser.add_argument("--out", type=Path, default=None, help=f"default {DEFAULT_OUT}")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.rounds, args.no_cache, args.no_labs = "tiny", args.rounds or 2, True, True
        args.only = args.only or "SGD momentum=0.9"
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    all_at = sizes if args.all_at is None else [s.strip() for s in args.all_at.split(",")]
    for flag, given in (("--sizes", sizes), ("--all-at", all_at)):
        if not given and flag == "--sizes" or any(s not in optimizers.SIZES for s in given):
            parser.error(f"Invalid {flag} {given} (choose from {', '.join(optimizers.SIZES)})")
    labs = [s.strip() for s in args.labs.split(",") if s.strip()]
    if any(s not in ("smoke", "cpu") for s in labs):
        parser.error(f"Invalid --labs {args.labs!r} (choose from smoke, cpu; gpu is estimated)")
    entries = book_rows()
    if args.only is not None:
        only = {s.strip() for s in args.only.split(",") if s.strip()}
        known = {e.name for e in entries} | {e.label for e in entries}
        if not only or only - known:
            parser.error(f"Invalid --only {sorted(only - known)} (choose from {sorted(known)})")
        entries = [e for e in entries if e.name in only or e.label in only or e.reason]
    timed = [e for e in entries if not e.reason]
    timed.sort(key=lambda e: FIRST.index(e.label) if e.label in FIRST else len(FIRST))
    device, timer, head = device_setup(parser, args)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(CACHE_DIR))
    quiet_inductor_metrics()
    scratch = torch.ones(int(FLUSH_MB * 2**20 / 4) if not args.quick else 2**18, device=device)

    def flush():
        scratch.sum()

    start = time.perf_counter()
    sections, skipped, deadline = [], [], Deadline(args.rows_minutes)
    for s in sizes:
        rows = timed if s in all_at else [e for e in timed if e.label in GOAL_ROWS]
        size_rows = benchmark_size(
            s, device, args.rounds, args.budget, timer, flush, rows, deadline, skipped
        )
        if size_rows[2]:
            sections.append(size_rows)
    cache = None
    if not args.no_cache and device.type == "cpu":
        cache = (args.cache_size, cache_reuse(args.cache_size))
        log(f"  cache: {cache[1]}")
    lab = []
    if not args.no_labs and device.type == "cpu":
        compiles = [r.compile_s for _, _, rows in sections for r in rows]
        compiles += [seconds for seconds, _, _ in cache[1]] if cache else []
        lab = lab_rows(labs, timer, args.budget, Deadline(args.labs_minutes), compiles)
    head += [
        f"- load average at end: {load_average()}",
        f"- run time: {(time.perf_counter() - start) / 60:.1f} min (compilations included)",
        "- timing: 2 untimed steps each (the first creates the state, the second compiles), "
        "then "
        + (f"{args.rounds} rounds" if args.rounds else f"{MIN_ROUNDS}–{MAX_ROUNDS} rounds")
        + f" per row (a budget of {args.budget:g} s), every implementation and B* once per "
        f"round, the first alternating; a {FLUSH_MB} MiB read before every timed step",
    ]
    reason = deadline.reason("the optimizer rows") if skipped else ""
    colds = sorted(r.compile_s for _, _, rows in sections for r in rows if r.cached == "cold")
    if skipped and colds:
        reason += f" (a cold compile took {colds[0]:.0f}–{colds[-1]:.0f} s in this run)"
    text = report(sections, [e for e in entries if e.reason], lab, cache, head, skipped, reason)
    default = None if args.quick or args.only is not None else results_path(DEFAULT_OUT, device)
    out = args.out if args.out is not None else default
    write_report(text, out, log)
    return text


if __name__ == "__main__":
    main()
