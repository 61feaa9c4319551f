"""Hessian probes of ``lsdl_lab.curvature`` against PyHessian 0.1 (Yao et al., 2020), side by side.

Each case is one model and one data set, given to both libraries: the book's MLP and its
CIFAR-style ResNet (He et al., 2016) at a small size, on scikit-learn's 8x8 digits, the
weights drawn from the same seed and BatchNorm's running statistics set by the same digits;
256 examples, in one batch and (PyHessian's ``dataloader`` path) in four batches of 64.
Every probe runs with the same settings on both sides, and the table prints the answers
beside the times so that the work is visibly equal:

- one Hessian-vector product, on the same vector (the answer: its v^T H v);
- the top eigenvalue by power iteration, the same iteration limit and tolerance;
- the trace by Hutchinson's estimator, the same number of Rademacher probes (PyHessian's
  early stop switched off), with the standard error of each mean;
- the spectral density by stochastic Lanczos quadrature, the same number of Lanczos steps.
  PyHessian 0.1's ``density`` spends its products and then fails on current torch
  (``torch.eig`` was removed); the row says so, with the time it took to fail.

The calls are timed in interleaved pairs (``benchmarks.timing.compare``) after an untimed
warm-up round; the number of Hessian-vector products each call made is counted too, so
that a difference in convergence is not mistaken for a difference in speed. PyHessian
draws its random vectors from torch's global generator, seeded before each of its calls;
``lsdl_lab`` from its own generator, seeded alike. On CPU both draw Hutchinson's Rademacher
signs with ``randint(0, 2)``, tensor after tensor, from the same stream, so the traces agree
digit for digit; power iteration starts from different Gaussian vectors, so the top
eigenvalues agree as far as the iterations converged.

Run from the repository root::

    python -m benchmarks.hessian            # about 2 minutes on a quiet 2-core machine
    python -m benchmarks.hessian --quick    # a tiny model, seconds: a test
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import statistics
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

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
from lsdl_lab import curvature, models
from lsdl_lab.data import load_digits

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "hessian.md"
GOAL = 2.0  # the target: lsdl_lab at least twice as fast as PyHessian on the ResNet


@dataclass
class Settings:
    examples: int = 256  # the same examples in every case, in one batch or several
    iters: int = 20  # power iteration: at most this many products per eigenvalue
    tol: float = 1e-4  # relative change of the Rayleigh quotient that stops it
    probes: int = 20  # Hutchinson
    lanczos: int = 20  # SLQ steps (one run)
    hvp_repeats: int = 10  # timed pairs of single products, at least
    probe_repeats: int = 3  # timed pairs of whole probes, at least
    budget: float = 2.0  # seconds: cheap calls get more pairs, as many as fit (at most 25)
    seed: int = 0


# name -> (description, model factory, number of batches)
CASES = {
    "mlp": ("MLP 64-128-128-10, 1 batch", lambda: models.MLP(64, 10, hidden=128, depth=2), 1),
    "resnet8": ("ResNet-8, width 8, 1 batch", lambda: models.ResNet(8, 8, 10, 1), 1),
    "resnet8x4": ("ResNet-8, width 8, 4 batches", lambda: models.ResNet(8, 8, 10, 1), 4),
    "resnet14": ("ResNet-14, width 16, 1 batch", lambda: models.ResNet(14, 16, 10, 1), 1),
    "tiny": ("MLP 64-8-10, 1 batch", lambda: models.MLP(64, 10, hidden=8, depth=1), 1),
}
DEFAULT_CASES = "mlp,resnet8,resnet8x4"
DEFAULT_EQUAL_CASES = "mlp,resnet8"


def pyhessian():
    """The ``pyhessian`` module, or None when it cannot be imported."""
    try:
        import pyhessian as ph
    except ImportError:
        return None
    return ph


def make_case(name: str, settings: Settings, device) -> tuple[nn.Module, list]:
    """The case's model (seeded weights, BatchNorm's running statistics from the digits; each
    library sets eval mode itself) and ``settings.examples`` digits in the case's number of
    batches, on ``device``."""
    data = load_digits(seed=settings.seed)
    _, factory, n_batches = CASES[name]
    torch.manual_seed(settings.seed)
    model = factory().to(device)
    x, y = data.train_x.to(device), data.train_y.to(device)
    if not n_batches <= settings.examples <= len(x):
        raise ValueError(
            f"Invalid examples: {settings.examples} (expected {n_batches} to {len(x)})"
        )
    with torch.no_grad():  # running statistics of BatchNorm from real batches
        for i in range(0, len(x), 256):
            model(x[i : i + 256])
    size = settings.examples // n_batches
    batches = [(x[i : i + size], y[i : i + size]) for i in range(0, n_batches * size, size)]
    return model, batches


def counted(fn: Callable, counter: list[int]) -> Callable:
    def wrapper(*args, **kwargs):
        counter[0] += 1
        return fn(*args, **kwargs)

    return wrapper


class Theirs:
    """PyHessian's ``hessian`` on a copy of the model, with its products counted."""

    def __init__(self, ph, model, batches, device):
        self.ph, self.count = ph, [0]
        cuda = torch.device(device).type == "cuda"
        with warnings.catch_warnings():  # its backward(create_graph=True) warns of a cycle
            warnings.simplefilter("ignore", UserWarning)
            if len(batches) == 1:
                self.h = ph.hessian(
                    copy.deepcopy(model), F.cross_entropy, data=batches[0], cuda=cuda
                )
            else:
                self.h = ph.hessian(
                    copy.deepcopy(model), F.cross_entropy, dataloader=batches, cuda=cuda
                )
        self.single = len(batches) == 1
        if not self.single:
            self.h.dataloader_hv_product = counted(self.h.dataloader_hv_product, self.count)

    def hvp(self, v: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.single:
            self.count[0] += 1
            return list(self.ph.utils.hessian_vector_product(self.h.gradsH, self.h.params, v))
        return self.h.dataloader_hv_product(v)[1]

    def call(self, method: str, seed: int, **kwargs):
        """One of PyHessian's probes, its global generator seeded, its single-batch products
        counted (they go through the module's ``hessian_vector_product``)."""
        module = sys.modules[type(self.h).__module__]
        original = module.hessian_vector_product
        module.hessian_vector_product = counted(original, self.count)
        torch.manual_seed(seed)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return getattr(self.h, method)(**kwargs)
        finally:
            module.hessian_vector_product = original


@dataclass
class Row:
    probe: str
    pairs: int = 0
    answer: dict[str, str] = field(default_factory=dict)  # who -> the answer, as text
    ms: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # q1, median, q3
    hvps: dict[str, float] = field(default_factory=dict)  # products per call
    speedup: tuple[float, float, float] = (math.nan,) * 3  # PyHessian / lsdl_lab, per pair
    note: str = ""


MAX_PAIRS = 25


def timed(
    row: Row,
    fns: dict[str, Callable],
    counts: dict[str, Callable[[], int]],
    repeats: int,
    timer,
    budget: float = 0.0,
):
    """Time ``fns`` in interleaved pairs into ``row``, after one untimed round; each records
    its answer itself, and ``counts[who]()`` tells how many products ``who`` has made so
    far. At least ``repeats`` pairs, more when more fit ``budget`` seconds (at most
    ``MAX_PAIRS``): a 50-millisecond probe timed three times is at the mercy of one slow
    moment."""
    before = {who: count() for who, count in counts.items()}
    t0 = timer()
    for fn in fns.values():  # the untimed round
        fn()
    per_round = timer() - t0
    if budget > 0 and per_round > 0:
        repeats = max(repeats, min(MAX_PAIRS, int(budget / per_round)))
    row.pairs = repeats
    result = compare(fns, repeats=repeats, warmup=0, timer=timer)
    for who in fns:
        row.ms[who] = tuple(1e3 * t for t in quartiles(result.times[who]))
        row.hvps[who] = (counts[who]() - before[who]) / (repeats + 1)
    if len(fns) == 2:
        row.speedup = quartiles(result.ratios("PyHessian", "lsdl_lab"))


def fmt_mean(samples: list[float]) -> str:
    mean = statistics.fmean(samples)
    se = statistics.stdev(samples) / math.sqrt(len(samples)) if len(samples) > 1 else math.nan
    return f"{mean:.4g} ± {se:.2g}"


def probes(H: curvature.HessianOperator, theirs: Theirs | None, s: Settings, device) -> list:
    """(probe, repeats, lsdl_lab call, PyHessian call): each call returns its answer as text."""
    gen = torch.Generator(device=device).manual_seed(s.seed)
    v = [torch.randn(p.shape, generator=gen, device=device) for p in H.params]

    def vhv(hv) -> str:
        return f"vᵀHv = {sum((a * b).sum() for a, b in zip(v, hv)).item():.6g}"

    def their_density() -> str:
        try:
            theirs.call("density", s.seed, iter=s.lanczos, n_v=1)
        except Exception as e:  # noqa: BLE001 - PyHessian 0.1 fails here on current torch
            return f"fails: {type(e).__name__}: {str(e).splitlines()[0][:90]}"
        return "ran"

    def top_eigenvalue() -> float:
        return curvature.top_eigenvalues(H, iters=s.iters, tol=s.tol, seed=s.seed, method="power")[
            0
        ][0]

    def ritz_range(sd) -> str:
        return f"Ritz values in [{sd.nodes.min():.4g}, {sd.nodes.max():.4g}]"

    return [
        (
            "Hessian-vector product",
            s.hvp_repeats,
            lambda: vhv(H.matvec(v)),
            lambda: vhv(theirs.hvp(v)),
        ),
        (
            f"top eigenvalue (≤ {s.iters} iterations, tol {s.tol:g})",
            s.probe_repeats,
            lambda: f"λ₁ = {top_eigenvalue():.6g}",
            lambda: (
                f"λ₁ = {theirs.call('eigenvalues', s.seed, maxIter=s.iters, tol=s.tol)[0][0]:.6g}"
            ),
        ),
        (
            f"trace ({s.probes} Rademacher probes)",
            s.probe_repeats,
            lambda: "tr H = {:.4g} ± {:.2g}".format(
                *curvature.trace(H, samples=s.probes, seed=s.seed)
            ),
            # tol = -inf: its relative-change stop never fires, so it takes every probe
            lambda: (
                f"tr H = {fmt_mean(theirs.call('trace', s.seed, maxIter=s.probes, tol=-math.inf))}"
            ),
        ),
        (
            f"density (SLQ, {s.lanczos} Lanczos steps, 1 run)",
            s.probe_repeats,
            lambda: ritz_range(curvature.spectral_density(H, runs=1, m=s.lanczos, seed=s.seed)),
            their_density,
        ),
    ]


def benchmark_case(name: str, settings: Settings, device, timer, log) -> tuple[str, int, list[Row]]:
    """Every probe of one case: (description, number of parameters, rows)."""
    model, batches = make_case(name, settings, device)
    H = curvature.HessianOperator(model, F.cross_entropy, batches)
    counts = {"lsdl_lab": lambda: H.products}
    ph = pyhessian()
    theirs = Theirs(ph, model, batches, device) if ph is not None else None
    if theirs is not None:
        counts["PyHessian"] = lambda: theirs.count[0]
    n = H.num_parameters
    header = f"{CASES[name][0]}: {n:,} parameters, {sum(len(x) for x, _ in batches)} examples"
    log(header)
    rows = []
    for probe, repeats, ours, their in probes(H, theirs, settings, device):
        row = Row(probe)
        fns = {"lsdl_lab": ours, "PyHessian": their} if theirs is not None else {"lsdl_lab": ours}
        if theirs is None:
            row.note = "PyHessian is not installed"

        def record(who, fn, row=row):
            def call():
                row.answer[who] = fn()

            return call

        calls = {who: record(who, fn) for who, fn in fns.items()}
        timed(row, calls, counts, repeats, timer, settings.budget)
        rows.append(row)
        log(
            f"  {probe:<40} "
            + "  ".join(f"{w} {row.ms[w][1]:9.2f} ms ({row.answer[w]})" for w in row.ms)
        )
    return header, n, rows


# --- at equal error: fewer products (Lanczos, Hutch++) against PyHessian's ------------------


@dataclass
class Equal:
    """The equal-error comparison: each side at the loosest setting of its own knob that
    reaches the target on this case, found by a sweep before timing."""

    train_epochs: int = 100  # full-batch Adam steps before measuring: a trained network
    k: int = 3  # top-k eigenvalues
    eig_error: float = 1e-3  # largest relative error of the k eigenvalues, against a reference
    trace_error: float = 0.02  # standard error of the trace, relative to the reference trace
    max_iters: int = 500  # per eigenvalue (power iteration) or in all (Lanczos)
    ref_samples: int = 300  # XTrace products of the reference trace
    max_probes: int = 3000  # Hutchinson's probes at most
    repeats: int = 3  # timed pairs
    seeds: int = 5  # further seeds at each side's chosen setting: the error's spread
    fro_probes: int = 30  # Rademacher products estimating ||H||_F^2 = E||Hv||^2


POWER_TOLS = (1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5, 1e-5, 3e-6, 1e-6, 1e-7)
LANCZOS_TOLS = (3e-1, 1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 1e-5, 1e-6)
TRACE_PRODUCTS = (12, 18, 24, 30, 36, 48, 60, 72, 96, 128, 192, 256, 384, 768, 1536)


@dataclass
class Side:
    setting: str = ""
    hvps: float = math.nan
    error: str = ""
    answer: str = ""


@dataclass
class EqualRow:
    probe: str
    target: str
    sides: dict[str, Side] = field(default_factory=dict)  # "lsdl_lab", "PyHessian"
    ms: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    speedup: tuple[float, float, float] = (math.nan,) * 3
    pairs: int = 0
    products: int = 0  # lsdl_lab's trace setting (its sketch is a third or a half of it)


def relative_error(values, reference) -> float:
    values = sorted(values, key=abs, reverse=True)
    return max(abs(a - b) / abs(b) for a, b in zip(values, reference))


def loosest(run: Callable, settings, good: Callable):
    """The first of ``settings`` (loosest first) whose result is good, with its result; the
    last one's if none is."""
    for setting in settings:
        result = run(setting)
        if good(result):
            break
    return setting, result


def time_equal(row: EqualRow, fns: dict, counts: dict, repeats: int, timer) -> None:
    """Time the chosen settings in interleaved pairs; products per call from ``counts``."""
    before = {who: count() for who, count in counts.items()}
    result = compare(fns, repeats=repeats, warmup=1, timer=timer)
    row.pairs = repeats
    for who in fns:
        row.ms[who] = tuple(1e3 * t for t in quartiles(result.times[who]))
        row.sides[who].hvps = (counts[who]() - before[who]) / (repeats + 1)
    if len(fns) == 2:
        row.speedup = quartiles(result.ratios("PyHessian", "lsdl_lab"))


def top_k_row(H, theirs: Theirs | None, counts, eq: Equal, seed: int, timer) -> EqualRow:
    """Top-k eigenvalues: Lanczos (its residual tolerance swept) against PyHessian's power
    iteration with deflation (its relative-change tolerance swept), at the same largest
    relative error against a tightly converged reference (Lanczos, another seed)."""
    k = eq.k
    reference, _ = curvature.top_eigenvalues(H, k=k, iters=1000, tol=1e-10, seed=seed + 1)
    row = EqualRow(f"top {k} eigenvalues", f"largest relative error ≤ {eq.eig_error:g}")

    def ours(tol):
        return curvature.top_eigenvalues(H, k=k, iters=eq.max_iters, tol=tol, seed=seed)[0]

    def good(values):
        return relative_error(values, reference) <= eq.eig_error

    tol, values = loosest(ours, LANCZOS_TOLS, good)
    fns = {"lsdl_lab": lambda: ours(tol)}
    row.sides["lsdl_lab"] = Side(
        f"Lanczos, tol {tol:g}", error=f"{relative_error(values, reference):.1e}"
    )
    if theirs is not None:

        def their(t):
            return theirs.call("eigenvalues", seed, maxIter=eq.max_iters, tol=t, top_n=k)[0]

        their_tol, their_values = loosest(their, POWER_TOLS, good)
        fns["PyHessian"] = lambda: their(their_tol)
        row.sides["PyHessian"] = Side(
            f"power iteration, tol {their_tol:g}",
            error=f"{relative_error(their_values, reference):.1e}",
        )
    time_equal(row, fns, {w: counts[w] for w in fns}, eq.repeats, timer)
    return row


def pilot_probes(theirs: Theirs, target: float, eq: Equal, seed: int) -> int:
    """The Hutchinson probes PyHessian needs for a standard error of ``target``, from its own
    pilot of 30 probes (sigma^2 / target^2)."""
    pilot = theirs.call("trace", seed, maxIter=30, tol=-math.inf)
    return min(eq.max_probes, max(2, math.ceil((statistics.stdev(pilot) / target) ** 2)))


def trace_row(
    H, theirs: Theirs | None, counts, eq: Equal, seed: int, timer, method: str, reference, n
) -> EqualRow:
    """The trace: Hutch++ or XTrace (products doubled until the standard error reaches the
    target) against PyHessian's Hutchinson with ``n`` probes (what its pilot's spread asks
    for), at the same standard error; the distance to ``reference`` beside it."""
    ref, ref_se = reference
    target = eq.trace_error * abs(ref)
    name = {"hutch++": "Hutch++", "xtrace": "XTrace"}[method]
    row = EqualRow(
        f"trace ({name})",
        f"standard error ≤ {100 * eq.trace_error:g}% of tr H = {ref:.4g} ± {ref_se:.1g}",
    )

    def ours(m):
        return curvature.trace(H, samples=m, seed=seed, method=method)

    def describe(mean, se, estimate):
        # the spread over further seeds: one seed's standard error is itself a noisy estimate
        seeds = range(seed + 10, seed + 10 + eq.seeds)
        rms = math.sqrt(statistics.fmean((estimate(s) - ref) ** 2 for s in seeds))
        return (
            f"SE {100 * se / abs(ref):.1f}%, off by {100 * abs(mean - ref) / abs(ref):.1f}%; "
            f"RMS over {eq.seeds} more seeds {100 * rms / abs(ref):.1f}%"
        )

    m, (mean, se) = loosest(ours, TRACE_PRODUCTS, lambda r: r[1] <= target)
    row.products = m
    fns = {"lsdl_lab": lambda: ours(m)}
    error = describe(mean, se, lambda s: curvature.trace(H, samples=m, seed=s, method=method)[0])
    row.sides["lsdl_lab"] = Side(f"{name}, {m} products", error=error)
    if theirs is not None:

        def their(s=seed):
            samples = theirs.call("trace", s, maxIter=n, tol=-math.inf)
            return statistics.fmean(samples), statistics.stdev(samples) / math.sqrt(n)

        fns["PyHessian"] = their
        error = describe(*their(), lambda s: their(s)[0])
        row.sides["PyHessian"] = Side(f"Hutchinson, {n} probes", error=error)
    time_equal(row, fns, {w: counts[w] for w in fns}, eq.repeats, timer)
    return row


def frobenius_shares(H, ks: list[int], eq: Equal, seed: int) -> tuple[dict[int, float], float]:
    r"""For each k, the share of :math:`\|H\|_F^2 = \sum_i \lambda_i^2` that the k eigenvalues
    of largest magnitude hold (Lanczos, tol 1e-3), :math:`\|H\|_F^2` estimated as
    :math:`\mathbb E\|Hv\|^2` over Rademacher :math:`v`. What Hutch++ and XTrace leave to
    their Hutchinson part is what their sketch misses, at best :math:`H` less its top k.
    Returns the shares and the estimate of :math:`\|H\|_F^2`."""
    k = max(ks)
    values, _ = curvature.top_eigenvalues(H, k=k, iters=max(eq.max_iters, 4 * k), tol=1e-3,
                                          seed=seed)  # fmt: skip
    gen = torch.Generator(device=H.device).manual_seed(seed)
    fro = statistics.fmean(
        (H @ (2 * torch.randint(0, 2, (H.dim,), generator=gen, device=H.device) - 1).to(H.dtype))
        .square()
        .sum()
        .item()
        for _ in range(eq.fro_probes)
    )
    squares = sorted((v * v for v in values), reverse=True)
    return {j: sum(squares[:j]) / fro for j in ks}, fro


def trained(model: nn.Module, batches, epochs: int) -> nn.Module:
    """``epochs`` full-batch Adam steps (lr 3e-3) on the batches: near a minimum, where the
    book measures curvature (Chapter 5), the spectrum decays as it does not at
    initialization, and Hutch++ and XTrace can deflate its top."""
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(epochs):
        opt.zero_grad()
        sum(len(x) * F.cross_entropy(model(x), y) for x, y in batches).backward()
        opt.step()
    return model


def equal_error_case(name: str, settings: Settings, eq: Equal, device, timer, log):
    """Both equal-error rows of one case: (header, rows)."""
    model, batches = make_case(name, settings, device)
    with torch.no_grad():
        before = sum(len(x) * F.cross_entropy(model(x), y) for x, y in batches).item()
    model = trained(model, batches, eq.train_epochs)
    with torch.no_grad():
        after = sum(len(x) * F.cross_entropy(model(x), y) for x, y in batches).item()
    n_examples = sum(len(x) for x, _ in batches)
    H = curvature.HessianOperator(model, F.cross_entropy, batches)
    ph = pyhessian()
    theirs = Theirs(ph, model, batches, device) if ph is not None else None
    counts = {"lsdl_lab": lambda: H.products}
    if theirs is not None:
        counts["PyHessian"] = lambda: theirs.count[0]
    header = (
        f"{CASES[name][0]}: {H.num_parameters:,} parameters, trained {eq.train_epochs} "
        f"full-batch Adam steps (loss {before / n_examples:.3g} → {after / n_examples:.2g})"
    )
    log(header)
    seed = settings.seed
    reference = curvature.trace(H, samples=eq.ref_samples, seed=seed + 1, method="xtrace")
    target = eq.trace_error * abs(reference[0])
    n = pilot_probes(theirs, target, eq, seed + 2) if theirs is not None else 0
    rows = [top_k_row(H, theirs, counts, eq, seed, timer)]
    for method in ("hutch++", "xtrace"):
        rows.append(trace_row(H, theirs, counts, eq, seed, timer, method, reference, n))
    hutchpp, xtrace = rows[1].products // 3, rows[2].products // 2  # their sketches' sizes
    shares, fro = frobenius_shares(H, [hutchpp, xtrace], eq, seed + 3)
    header += (
        f"; the top {hutchpp} eigenvalues hold {100 * shares[hutchpp]:.0f}% of ‖H‖_F², "
        f"the top {xtrace} {100 * shares[xtrace]:.0f}%; effective rank tr(H)²/‖H‖_F² ≈ "
        f"{reference[0] ** 2 / fro:.0f} (how many eigenvalues the trace is spread over)"
    )
    for row in rows:
        log(
            f"  {row.probe:<20} "
            + "  ".join(
                f"{w} {row.sides[w].setting}: {row.sides[w].hvps:g} HVPs, {row.ms[w][1]:.1f} ms, "
                f"{row.sides[w].error}"
                for w in row.ms
            )
        )
    return header, rows


def equal_error_report(sections) -> list[str]:
    out = [
        "",
        "# At equal error: fewer Hessian-vector products",
        "",
        "Each side at the loosest setting of its own knob that reaches the row's target on "
        "this case (found by a sweep before timing): Lanczos' residual tolerance against "
        "PyHessian's power iteration with deflation and its relative-change tolerance; "
        "Hutch++'s number of products against PyHessian's Hutchinson with the number of "
        "probes its own pilot's spread asks for (σ²/target²). Each network is trained first "
        "(full-batch Adam on the same examples): the book measures curvature near minima. "
        "Error: the largest relative "
        "error of the k eigenvalues against a reference converged to 1e-10; for the trace, "
        "the estimator's standard error and its distance to a reference trace (XTrace with "
        "many products, another seed), both relative, and the root-mean-square distance to "
        "it of further seeds at the same setting (one seed's standard error is itself noisy). "
        f"Ratios: PyHessian / lsdl_lab (above 1: lsdl_lab needs fewer products, less time; "
        f"the goal is {GOAL:g}, in bold where met). Each header gives the share of ‖H‖_F² held "
        "by the top eigenvalues as many as Hutch++'s sketch (a third of its products) and "
        "XTrace's (a half): at equal products Hutch++'s variance is below Hutchinson's only "
        "when its sketch takes more than about two thirds of ‖H‖_F² (its Hutchinson part gets "
        "a third of the products; Meyer et al., 2021, Theorem 1's argument); how many "
        "products it then needs depends on how many eigenvalues the trace is spread over "
        "(benchmarks/README.md measures it on both networks).",
    ]
    for header, rows in sections:
        out += [
            "",
            f"## {header}",
            "",
            "| probe | target | lsdl_lab | HVPs | ms | error | PyHessian | HVPs | ms | error "
            "| HVP ratio | speed-up | pairs |",
            "|---|---|---|---:|---:|---|---|---:|---:|---|---:|---:|---:|",
        ]
        for r in rows:
            cells = [r.probe, r.target]
            for who in ("lsdl_lab", "PyHessian"):
                if who in r.ms:
                    q1, med, q3 = r.ms[who]
                    side = r.sides[who]
                    cells += [
                        side.setting,
                        f"{side.hvps:g}",
                        f"{med:.1f} [{q1:.1f}–{q3:.1f}]",
                        side.error,
                    ]
                else:
                    cells += ["", "", "", "PyHessian is not installed"]
            hvp_ratio = (
                r.sides["PyHessian"].hvps / r.sides["lsdl_lab"].hvps
                if "PyHessian" in r.ms
                else math.nan
            )
            q1, med, q3 = r.speedup
            cells += [
                "" if math.isnan(hvp_ratio) else bold(f"{hvp_ratio:.1f}", hvp_ratio),
                "" if math.isnan(med) else bold(f"{med:.2f}", med) + f" [{q1:.2f}–{q3:.2f}]",
                str(r.pairs),
            ]
            out.append("| " + " | ".join(cells) + " |")
    out += ["", "## Verdict", ""] + [verdict(header, rows) for header, rows in sections]
    return out


def met(row: EqualRow) -> bool:
    if "PyHessian" not in row.ms:
        return False
    ratio = row.sides["PyHessian"].hvps / row.sides["lsdl_lab"].hvps
    return ratio >= GOAL and row.speedup[1] >= GOAL


def verdict(header: str, rows: list[EqualRow]) -> str:
    """One line per case: which method meets the goal for each probe, and which does not."""
    parts = []
    for r in rows:
        side = r.sides["lsdl_lab"].setting.split(",")[0]
        if "PyHessian" not in r.ms:
            parts.append(f"{r.probe}: PyHessian not installed")
            continue
        ratio = r.sides["PyHessian"].hvps / r.sides["lsdl_lab"].hvps
        parts.append(
            f"{r.probe} by {side}: {ratio:.1f}x fewer products, {r.speedup[1]:.2f}x less time, "
            + ("goal met" if met(r) else "**goal missed**")
        )
    return f"- {header.split(':')[0]}: " + "; ".join(parts) + "."


def bold(text: str, value: float) -> str:
    return f"**{text}**" if value >= GOAL else text


def per_hvp(row: Row, who: str) -> float:
    return row.ms[who][1] / row.hvps[who] if row.hvps.get(who) else math.nan


def report(sections, settings: Settings, head: list[str], equal_sections=()) -> str:
    out = ["# Hessian probes: lsdl_lab against PyHessian 0.1", "", *head, ""]
    out += [
        "Same model, data, seeds and settings on both sides; PyHessian on a copy of the model. "
        "ms: median time of one call [interquartile range]; HVPs: Hessian-vector products "
        "per call; speed-up: PyHessian time / lsdl_lab time, median [IQR] of the pairs timed "
        f"back to back (above 1: lsdl_lab faster; the goal is {GOAL:g}). Answers beside the "
        "times: the Rademacher probes of the trace are the same on both sides (on CPU), the "
        "starting vectors of power iteration and Lanczos are not, so those answers agree as "
        "far as the iterations converged.",
    ]
    for header, _, rows in sections:
        out += [
            "",
            f"## {header}",
            "",
            "| probe | lsdl_lab ms | HVPs | ms/HVP | answer | PyHessian ms | HVPs | ms/HVP "
            "| answer | speed-up | pairs |",
            "|---|---:|---:|---:|---|---:|---:|---:|---|---:|---:|",
        ]
        for r in rows:
            cells = [r.probe]
            for who in ("lsdl_lab", "PyHessian"):
                if who in r.ms:
                    q1, med, q3 = r.ms[who]
                    cells += [
                        f"{med:.1f} [{q1:.1f}–{q3:.1f}]",
                        f"{r.hvps[who]:g}",
                        f"{per_hvp(r, who):.2f}",
                        r.answer.get(who, ""),
                    ]
                else:
                    cells += ["", "", "", r.note]
            q1, med, q3 = r.speedup
            cells.append(
                ""
                if math.isnan(med)
                else f"**{med:.2f}** [{q1:.2f}–{q3:.2f}]"
                if med >= GOAL
                else f"{med:.2f} [{q1:.2f}–{q3:.2f}]"
            )
            cells.append(str(r.pairs))
            out.append("| " + " | ".join(cells) + " |")
    out += [
        "",
        f"Settings: {settings.examples} examples; power iteration ≤ {settings.iters} iterations, "
        f"tol {settings.tol:g}; {settings.probes} trace probes; {settings.lanczos} Lanczos steps; "
        f"at least {settings.hvp_repeats} timed pairs of single products and "
        f"{settings.probe_repeats} of whole probes, more for cheap calls (as many as fit "
        f"{settings.budget:g} s, at most {MAX_PAIRS}), after one untimed round; seed "
        f"{settings.seed}. The density row's PyHessian time is the time until it fails.",
    ]
    if equal_sections:
        out += equal_error_report(equal_sections)
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=DEFAULT_CASES, help=f"from {', '.join(CASES)}")
    parser.add_argument(
        "--equal-cases",
        default=DEFAULT_EQUAL_CASES,
        help="cases of the equal-error table (Lanczos, Hutch++), comma-separated; '' for none",
    )
    add_device_options(parser)
    parser.add_argument("--iters", type=int, default=Settings.iters)
    parser.add_argument("--probes", type=int, default=Settings.probes)
    parser.add_argument("--lanczos", type=int, default=Settings.lanczos)
    parser.add_argument(
        "--repeats", type=int, default=Settings.probe_repeats, help="probe pairs, at least"
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=Settings.budget,
        help=f"seconds per row: cheap probes get more pairs (default {Settings.budget:g})",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny MLP, few iterations: a test")
    parser.add_argument("--out", type=Path, default=None, help=f"default {DEFAULT_OUT}")
    args = parser.parse_args(argv)
    settings = Settings(
        iters=args.iters,
        probes=args.probes,
        lanczos=args.lanczos,
        probe_repeats=args.repeats,
        budget=args.budget,
    )
    equal = Equal()
    if args.quick:
        args.cases = args.equal_cases = "tiny"
        equal = Equal(train_epochs=10, k=2, max_iters=60, ref_samples=60, max_probes=60, repeats=1)
        settings = Settings(
            examples=64, iters=3, probes=3, lanczos=3, hvp_repeats=2, probe_repeats=1, budget=0
        )
    for what in ("iters", "probes", "lanczos", "repeats", "threads"):
        if getattr(args, what) < (2 if what == "probes" else 1):
            parser.error(f"Invalid --{what}: {getattr(args, what)} (too small)")
    if not args.budget >= 0:
        parser.error(f"Invalid --budget: {args.budget} (expected seconds >= 0)")
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not cases or any(c not in CASES for c in cases):
        parser.error(f"Invalid --cases {args.cases!r} (choose from {', '.join(CASES)})")
    equal_cases = [c.strip() for c in args.equal_cases.split(",") if c.strip()]
    if any(c not in CASES for c in equal_cases):
        parser.error(f"Invalid --equal-cases {args.equal_cases!r} (choose from {', '.join(CASES)})")
    device, timer, head = device_setup(parser, args)
    ph = pyhessian()
    head.append(f"- PyHessian {getattr(ph, '__version__', '0.1') if ph else 'not installed'}")
    sections = []
    for case in cases:
        sections.append(benchmark_case(case, settings, device, timer, log))
        gc.collect()  # PyHessian's create_graph backward leaves reference cycles behind
    equal_sections = []
    for case in equal_cases:
        equal_sections.append(equal_error_case(case, settings, equal, device, timer, log))
        gc.collect()
    head.append(f"- load average at end: {load_average()}")
    text = report(sections, settings, head, equal_sections)
    default = None if args.quick else results_path(DEFAULT_OUT, device)
    out = args.out if args.out is not None else default
    write_report(text, out, log)
    return text


if __name__ == "__main__":
    main()
