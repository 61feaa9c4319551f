"""Step time of ``lsdl_lab.optim`` against ``torch.optim(..., foreach=True)``, side by side.

Run from the repository root (either form)::

    python -m benchmarks.optimizers                 # 1M, 10M and 50M parameters, ~6 minutes
    python benchmarks/optimizers.py --quick         # a tiny model, a few seconds

What is timed: ``optimizer.step()`` alone. Every parameter gets a fixed random gradient
once (no forward or backward pass is run or timed); before every timed step the
gradients are restored from that copy, untimed, because torch.optim's foreach Nesterov
SGD adds the momentum into ``p.grad`` in place. Both optimizers of a pair update the same
parameters, each with its own state, warmed by several steps before timing; the two steps
are then timed in turn (A B, B A, ...) so that both see the same moments of a shared
machine. Every optimizer that ``lsdl_lab.optim.__all__`` exports and torch.optim also has
is included, found by name at run time.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(ROOT))

import lsdl_lab  # noqa: E402
import lsdl_lab.optim  # noqa: E402
from benchmarks.timing import compare, quartiles, state_bytes_per_param  # noqa: E402
from lsdl_lab.models import GPT, ResNet  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "optimizers.md"
MIN_PAIRS, MAX_PAIRS = 11, 400  # timed pairs per row, unless --repeats fixes them
GOAL = 1.1  # the project's target: lsdl_lab at most 10% slower than torch.optim foreach

# Models of the book, sized by parameter count: convolutions with BatchNorm vectors
# (ResNet), or matrices with LayerNorm vectors and embeddings (GPT).
SIZES = {
    "tiny": ("GPT, 1 layer, dim 32, vocab 64", lambda: GPT(64, 16, layers=1, heads=2, dim=32)),
    "1M": ("ResNet-20, width 32", lambda: ResNet(depth=20, width=32)),
    "10M": (
        "GPT, 12 layers, dim 256, vocab 2048, block 256",
        lambda: GPT(2048, 256, layers=12, heads=8, dim=256),
    ),
    "50M": (
        "GPT, 16 layers, dim 512, vocab 2048, block 256",
        lambda: GPT(2048, 256, layers=16, heads=8, dim=512),
    ),
}

# Configurations that take different code paths; an optimizer not listed runs with its
# defaults, so an optimizer added to lsdl_lab.optim joins the benchmark by itself.
CONFIGS = {
    "SGD": [
        ("SGD", {}),
        ("SGD momentum=0.9", {"momentum": 0.9}),
        ("SGD nesterov", {"momentum": 0.9, "nesterov": True}),
    ],
    "Adam": [
        ("Adam", {}),
        ("Adam amsgrad", {"amsgrad": True}),
        ("Adam weight_decay=0.01", {"weight_decay": 0.01}),
    ],
}


def optimizer_names() -> list[str]:
    """Names in ``lsdl_lab.optim.__all__`` that are optimizers torch.optim also has."""
    names = []
    for name in lsdl_lab.optim.__all__:
        ours, theirs = getattr(lsdl_lab.optim, name, None), getattr(torch.optim, name, None)
        if (
            isinstance(ours, type)
            and isinstance(theirs, type)
            and issubclass(theirs, torch.optim.Optimizer)
            and theirs is not torch.optim.Optimizer
        ):
            names.append(name)
    return names


def configurations() -> list[tuple[str, str, dict]]:
    """(label, optimizer name, constructor arguments) of every row of the table."""
    return [
        (label, name, kwargs)
        for name in optimizer_names()
        for label, kwargs in CONFIGS.get(name, [(name, {})])
    ]


@dataclass
class Row:
    label: str
    ours_ms: float = float("nan")
    torch_ms: float = float("nan")
    ratio: float = float("nan")
    pair_median: float = float("nan")
    ratio_q1: float = float("nan")
    ratio_q3: float = float("nan")
    pairs: int = 0
    ours_bytes: float = float("nan")
    torch_bytes: float = float("nan")
    writes_grad: str = ""  # which implementation's step writes into p.grad, if any
    skipped: str = ""


def describe(size: str, params: list[torch.Tensor]) -> str:
    """The size's model, with its exact parameter and tensor counts."""
    kinds = {
        "conv": sum(p.dim() == 4 for p in params),
        "matrix": sum(p.dim() == 2 for p in params),
        "vector": sum(p.dim() == 1 for p in params),
    }
    kinds_text = ", ".join(f"{k} {v}" for k, v in kinds.items() if v)
    n = sum(p.numel() for p in params)
    return f"{size}: {SIZES[size][0]}: {n:,} parameters in {len(params)} tensors ({kinds_text})"


def time_pair(
    row: Row,
    steps: dict[str, Callable[[], object]],
    grads: list[torch.Tensor],
    fixed: list[torch.Tensor],
    repeats: int | None,
    budget: float,
    warmup: int,
) -> None:
    """Warm both optimizers up, then time their steps in alternation into ``row``."""

    def restore_grads():
        torch._foreach_copy_(grads, fixed)

    t0 = time.perf_counter()
    compare(steps, repeats=1, warmup=warmup - 1, setup=restore_grads)  # untimed
    per_round = (time.perf_counter() - t0) / warmup
    writers = []
    for name, step in steps.items():  # one more step each: does it write into p.grad?
        restore_grads()
        step()
        if any(not torch.equal(g, f) for g, f in zip(grads, fixed, strict=True)):
            writers.append(name)
    row.writes_grad = " and ".join(writers)
    restore_grads()
    row.pairs = repeats or int(min(max(budget / per_round, MIN_PAIRS), MAX_PAIRS))
    setup = restore_grads if row.writes_grad else None
    result = compare(steps, repeats=row.pairs, warmup=0, setup=setup)
    row.ours_ms = 1e3 * result.median("lsdl_lab")
    row.torch_ms = 1e3 * result.median("torch")
    row.ratio = result.ratio("lsdl_lab", "torch")
    row.ratio_q1, row.pair_median, row.ratio_q3 = quartiles(result.ratios("lsdl_lab", "torch"))


def benchmark_size(
    size: str, repeats: int | None, budget: float, warmup: int, log=print
) -> tuple[str, list[Row]]:
    """Time every configuration on the model of ``size``; returns its description and rows."""
    torch.manual_seed(0)
    params = list(SIZES[size][1]().parameters())  # tied weights once
    header = describe(size, params)
    log(header)
    fixed = [torch.randn_like(p) for p in params]
    for p, g in zip(params, fixed, strict=True):
        p.grad = g.clone()
    grads = [p.grad for p in params]
    rows = []
    for label, name, kwargs in configurations():
        row = Row(label)
        rows.append(row)
        try:
            ours = getattr(lsdl_lab.optim, name)(params, **kwargs)
            theirs = getattr(torch.optim, name)(params, **kwargs, foreach=True)
        except (TypeError, ValueError) as e:
            row.skipped = f"skipped: {type(e).__name__}: {e}"
            log(f"  {label:<24} {row.skipped}")
            continue
        steps = {"lsdl_lab": ours.step, "torch": theirs.step}
        time_pair(row, steps, grads, fixed, repeats, budget, warmup)
        row.ours_bytes = state_bytes_per_param(ours)
        row.torch_bytes = state_bytes_per_param(theirs)
        log(
            f"  {label:<24} lsdl_lab {row.ours_ms:9.3f} ms  torch {row.torch_ms:9.3f} ms  "
            f"ratio {row.ratio:.3f} (IQR {row.ratio_q1:.3f}-{row.ratio_q3:.3f}, "
            f"{row.pairs} pairs)" + (f"  [{row.writes_grad} writes p.grad]" * bool(row.writes_grad))
        )
        for opt in (ours, theirs):  # free the state now: torch.optim's Adam sits in a cycle
            opt.state.clear()
    return header, rows


def machine(threads: int, repeats: int | None, budget: float, warmup: int) -> list[str]:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    how = (
        f"{repeats} pairs"
        if repeats
        else (f"as many pairs as fit {budget:g} s ({MIN_PAIRS} to {MAX_PAIRS})")
    )
    return [
        f"- date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
        f"- CPU: {cpu}; {os.cpu_count()} logical cores, {usable} usable; "
        f"load average at start {load}",
        f"- Python {platform.python_version()}, torch {torch.__version__}, "
        f"lsdl_lab {lsdl_lab.__version__}" + (f" (git {commit})" if commit else ""),
        f"- torch threads: {torch.get_num_threads()} (requested {threads})",
        f"- timing: {warmup + 1} untimed warm-up steps each, then {how} per row, each pair "
        "timed back to back, which of the two goes first alternating",
    ]


def fmt_ratio(x: float) -> str:
    return f"**{x:.2f}**" if x > GOAL else f"{x:.2f}"


def summary(ratios: list[tuple[float, str, str]]) -> str:
    """Median, geometric mean and largest of (ratio, size, label) triples."""
    values = [r for r, _, _ in ratios]
    worst = max(ratios)
    return (
        f"ratio median {statistics.median(values):.2f}, geometric mean "
        f"{statistics.geometric_mean(values):.2f}, largest {worst[0]:.2f} ({worst[2]})"
    )


def table(sections: list[tuple[str, list[Row]]], lines_machine: list[str]) -> str:
    out = ["# Optimizer step time: lsdl_lab against torch.optim (foreach=True)", ""]
    out += lines_machine
    out += [
        "",
        "ms: median time of one `optimizer.step()` (fixed gradients, state warm; backward "
        "not included). ratio: median lsdl_lab / median torch (below 1: lsdl_lab faster; "
        f"bold: above the goal {GOAL}). pair ratios: ratios of the two steps "
        "timed back to back, their median and interquartile range (the spread). "
        "B/param: bytes of optimizer state per parameter.",
    ]
    all_ratios = []
    for header, rows in sections:
        out += [
            "",
            f"## {header}",
            "",
            "| optimizer | lsdl_lab ms | torch ms | ratio | pair ratios: median [IQR] | pairs "
            "| B/param lsdl_lab | B/param torch |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            if r.skipped:
                out.append(f"| {r.label} | | | | | | | {r.skipped} |")
                continue
            all_ratios.append((r.ratio, header.split(":")[0], r.label))
            mark = " †" if r.writes_grad else ""
            out.append(
                f"| {r.label}{mark} | {r.ours_ms:.3f} | {r.torch_ms:.3f} | {fmt_ratio(r.ratio)} "
                f"| {r.pair_median:.2f} [{r.ratio_q1:.2f}–{r.ratio_q3:.2f}] | {r.pairs} "
                f"| {r.ours_bytes:.3f} | {r.torch_bytes:.3f} |"
            )
        for who in dict.fromkeys(r.writes_grad for r in rows if r.writes_grad):
            out += [
                "",
                f"† {who}: `step()` writes into `p.grad` (in place); the fixed gradients "
                "are restored before every step of this row, untimed.",
            ]
    if all_ratios:
        out += ["", "## Summary", ""]
        for size in dict.fromkeys(size for _, size, _ in all_ratios):
            out.append(f"- {size}: " + summary([x for x in all_ratios if x[1] == size]))
        out.append(f"- all {len(all_ratios)} rows: " + summary(all_ratios))
        above = [f"{label} at {size} ({r:.2f})" for r, size, label in all_ratios if r > GOAL]
        out.append(f"- above {GOAL}: " + ("; ".join(above) if above else "none"))
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", default="1M,10M,50M", help=f"comma-separated, from {', '.join(SIZES)}"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed pairs per row (default: --budget)"
    )
    parser.add_argument(
        "--budget", type=float, default=6.0, help="seconds of timed pairs per row (default 6)"
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--quick", action="store_true", help="the tiny model, 5 pairs: a test")
    parser.add_argument(
        "--out", type=Path, default=None, help=f"Markdown file (default {DEFAULT_OUT})"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.repeats, args.warmup = "tiny", args.repeats or 5, min(args.warmup, 2)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown or not sizes:
        parser.error(f"unknown sizes {unknown}; choose from {', '.join(SIZES)}")
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.warmup < 1 or args.threads < 1:
        parser.error("--warmup and --threads must be at least 1")
    torch.set_num_threads(args.threads)

    def log(*a):
        print(*a, file=sys.stderr, flush=True)

    head = machine(args.threads, args.repeats, args.budget, args.warmup)
    sections = [benchmark_size(s, args.repeats, args.budget, args.warmup, log) for s in sizes]
    if hasattr(os, "getloadavg"):
        head.append("- load average at end " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    text = table(sections, head)
    print(text, end="")
    out = args.out if args.out is not None else (None if args.quick else DEFAULT_OUT)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        log(f"written to {out}")
    return text


if __name__ == "__main__":
    main()
