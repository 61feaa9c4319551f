"""Side-by-side timing on a shared machine, and the size of an optimizer's state.

On a machine where other processes come and go, the absolute time of one call drifts by
tens of percent from minute to minute; the *ratio* of two implementations measured in
the same moments does not. :func:`compare` therefore calls the implementations in turn
(A B, B A, A B, ...: each goes first equally often, so neither always finds the caches
warmed by the other), after warm-up calls that are not timed, and keeps every timing, so
that a ratio comes with its spread: the ratios of the pairs measured back to back.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lsdl_lab.book.races import state_bytes

__all__ = [
    "CLOCKS",
    "CLOCK_TEXT",
    "Comparison",
    "add_device_options",
    "compare",
    "device_setup",
    "device_timer",
    "git_commit",
    "load_average",
    "log",
    "machine_lines",
    "quartiles",
    "results_path",
    "state_bytes_per_param",
]


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile) of ``xs``."""
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


@dataclass
class Comparison:
    """Seconds per call of each implementation, one entry per repeat, in call order."""

    times: dict[str, list[float]]
    order: list[tuple[str, ...]] = field(default_factory=list)  # who ran when, per repeat

    def median(self, name: str) -> float:
        return statistics.median(self.times[name])

    def iqr(self, name: str) -> tuple[float, float]:
        q1, _, q3 = quartiles(self.times[name])
        return q1, q3

    def ratios(self, name: str, baseline: str) -> list[float]:
        """Per-pair ratios ``name / baseline``, each of two calls made back to back."""
        return [a / b for a, b in zip(self.times[name], self.times[baseline], strict=True)]

    def ratio(self, name: str, baseline: str) -> float:
        """The ratio of the medians, ``median(name) / median(baseline)``."""
        return self.median(name) / self.median(baseline)

    def ratio_iqr(self, name: str, baseline: str) -> tuple[float, float]:
        """Interquartile range of the per-pair ratios: the spread of :meth:`ratio`."""
        q1, _, q3 = quartiles(self.ratios(name, baseline))
        return q1, q3


def compare(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    warmup: int = 1,
    setup: Callable[[], object] | None = None,
    timer: Callable[[], float] = time.perf_counter,
) -> Comparison:
    """Time each function of ``fns`` ``repeats`` times, interleaved.

    Round ``r`` calls the functions once each, starting from the ``r``-th (mod ``len(fns)``)
    and going round, so that with two functions the order alternates A B, B A, A B, ...
    ``warmup`` rounds run first and are not timed. ``setup``, when given, runs before
    every call, untimed (e.g. to restore inputs that a function overwrites). The garbage
    collector is off while timing, as in :mod:`timeit`.
    """
    if not fns:
        raise ValueError("compare needs at least one function")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"Invalid repeats={repeats!r} or warmup={warmup!r}")
    names = list(fns)
    result = Comparison({name: [] for name in names})
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(warmup + repeats):
            k = r % len(names)
            order = tuple(names[k:] + names[:k])
            for name in order:
                if setup is not None:
                    setup()
                t0 = timer()
                fns[name]()
                t1 = timer()
                if r >= warmup:
                    result.times[name].append(t1 - t0)
            if r >= warmup:
                result.order.append(order)
    finally:
        if gc_was_enabled:
            gc.enable()
    return result


def state_bytes_per_param(optimizer: torch.optim.Optimizer) -> float:
    """Bytes of every tensor in ``optimizer.state``, divided by the number of parameters
    (:func:`lsdl_lab.book.races.state_bytes`, which is :func:`lsdl_lab.memory.measure`'s count).

    Every tensor counts, including torch.optim's 0-d ``step`` tensors (4 bytes per
    parameter *tensor*, so under 1e-4 bytes per parameter for the benchmark's models);
    a Python number in the state (``lsdl_lab`` keeps ``step`` as an ``int``) counts 0.
    Parameters shared by several groups or tied modules count once.
    """
    params = {id(p): p for group in optimizer.param_groups for p in group["params"]}
    n = sum(p.numel() for p in params.values())
    nbytes = state_bytes(optimizer)
    return nbytes / n if n else 0.0


CLOCKS = ("wall", "thread")
CLOCK_TEXT = {  # for a results file's header
    "thread": "CPU time of the benchmark's thread (`time.thread_time`): the moments other "
    "processes held the core do not count; their memory traffic still slows ours",
    "wall": "wall-clock time (`time.perf_counter`; on CUDA after `torch.cuda.synchronize`)",
}


def device_timer(device: torch.device | str, clock: str = "wall") -> Callable[[], float]:
    """A clock for timing work on ``device``.

    ``"wall"``: :func:`time.perf_counter`, which on CUDA first waits for the device to finish
    (kernels run asynchronously: without the wait, a timing measures the launch, not the
    work). ``"thread"``: :func:`time.thread_time`, the CPU time of the calling thread, user
    and system (page faults included); for CPU work on one torch thread, where every
    operation and the autograd engine run on the calling thread, it is the wall time
    without the moments other processes held the core, the robust figure on a shared
    machine. It cannot time a GPU, whose work no CPU clock sees.
    """
    device = torch.device(device)
    if clock not in CLOCKS:
        raise ValueError(f"Invalid clock: {clock!r} (expected one of {CLOCKS})")
    if clock == "thread":
        if device.type != "cpu":
            raise ValueError(f"Invalid clock: 'thread' times CPU work only, not {device}")
        return time.thread_time
    if device.type != "cuda":
        return time.perf_counter

    def timer() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return timer


def load_average() -> str:
    """The 1-, 5- and 15-minute load averages, or "unknown" where the system has none."""
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except (AttributeError, OSError):
        return "unknown"


def log(*parts) -> None:
    """Progress for the person watching: to standard error, so the table alone goes to
    standard output."""
    print(*parts, file=sys.stderr, flush=True)


def add_device_options(parser: argparse.ArgumentParser) -> None:
    """``--device``, ``--clock`` and ``--threads``, the options every benchmark shares."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--clock",
        choices=CLOCKS,
        default=None,
        help="thread: CPU time of this thread (the default on CPU: robust to other processes); "
        "wall: elapsed time (the default on CUDA, after torch.cuda.synchronize)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")


def device_setup(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[torch.device, Callable[[], float], list[str]]:
    """From the options of :func:`add_device_options`: set torch's threads and return the
    device, its clock (:func:`device_timer`; a clock the device cannot use is a usage
    error) and the results header (:func:`machine_lines` and the clock)."""
    device = torch.device(args.device)
    clock = args.clock or ("thread" if device.type == "cpu" else "wall")
    try:
        timer = device_timer(device, clock)
    except ValueError as e:
        parser.error(str(e))
    torch.set_num_threads(args.threads)
    return device, timer, machine_lines(device) + [f"- clock: {CLOCK_TEXT[clock]}"]


def results_path(default: Path, device: torch.device | str) -> Path:
    """Where a benchmark's table goes unless ``--out`` says: ``default``
    (``benchmarks/results/NAME.md``) for a CPU run, ``benchmarks/results/cuda/NAME.md`` for
    a GPU's, so that a run on a GPU machine never overwrites the CPU tables."""
    device = torch.device(device)
    return default if device.type == "cpu" else default.parent / device.type / default.name


def write_report(text: str, out, log: Callable[[str], None]) -> None:
    """Print a benchmark's Markdown report and, when ``out`` is a path, write it there."""
    print(text, end="")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        log(f"written to {out}")


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def git_commit() -> str:
    """``git describe --always --dirty`` of the repository, or "" outside a git checkout."""
    try:
        return subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=Path(__file__).resolve().parents[1],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_lines(device: torch.device | str = "cpu") -> list[str]:
    """Markdown bullet lines naming what a result was measured on, and when: date, CPU
    and cores, the GPU when ``device`` is CUDA, Python, torch and lsdl_lab versions (with
    the git commit), torch threads and the load average now (other processes' work:
    absolute times move with it)."""
    import lsdl_lab

    device = torch.device(device)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines = [
        f"- date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
        f"- CPU: {cpu_name()}; {os.cpu_count()} logical cores, {usable} usable",
    ]
    if device.type == "cuda":
        lines.append(f"- GPU: {torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})")
    lines += [
        f"- Python {platform.python_version()}, torch {torch.__version__}, lsdl_lab "
        f"{lsdl_lab.__version__}" + (f" (git {commit})" if (commit := git_commit()) else ""),
        f"- torch threads {torch.get_num_threads()}, device {device}",
        f"- load average at start: {load_average()}",
    ]
    return lines
