"""Step time of ``lsdl_lab.optim`` against ``torch.optim(..., foreach=True)``, side by side.

Run from the repository root::

    python -m benchmarks.optimizers                 # 1M, 10M and 50M parameters, minutes
    python -m benchmarks.optimizers --budget 6      # 4x the time per row: steadier ratios
    python -m benchmarks.optimizers --quick         # a tiny model, a few seconds

What is timed: ``optimizer.step()`` alone. Every parameter gets a fixed random gradient
once (no forward or backward pass is run or timed); before every timed step the
gradients are restored from that copy, untimed, because torch.optim's foreach Nesterov
SGD adds the momentum into ``p.grad`` in place. Both optimizers of a pair update the same
parameters, each with its own state, warmed by several steps before timing; the two steps
are then timed in turn (A B, B A, ...) so that both see the same moments of a shared
machine. Every optimizer that ``lsdl_lab.optim.__all__`` exports and torch.optim also has
is included, found by name at run time. ``Muon`` runs on the model's matrices alone on both
sides, the parameters torch.optim.Muon takes (its others are AdamW's, in the AdamW rows).

``LARS`` and ``LAMB``, which torch.optim lacks, get rows of their own, in a separate table
per size, each timed in the same interleaved way against two references: the torch.optim
foreach algorithm with the same memory traffic (LARS against ``SGD(momentum=0.9)``, LAMB
against ``AdamW``; the layer-wise step adds a norm per tensor and the trust ratios to that
traffic), and pytorch-optimizer's ``LARS`` and ``Lamb`` with the settings that make the
two compute the same update (skipped, with a note, when ``pytorch_optimizer`` is not
installed). ``--only LARS,LAMB`` times those rows alone.

The optimizers of the book's newer sections, which torch.optim lacks (or has only in
part), get a third table per size, against the torch.optim foreach step they replace
(``beyond_configurations``): ``Muon`` on the groups of ``muon_param_groups`` (Newton-Schulz
on the hidden matrices, AdamW on the rest; a model without hidden matrices, the ResNet, is
skipped), ``SOAP``, ``ScheduleFreeAdamW`` and ``AdamW8bit`` against ``AdamW``, ``Adam8bit``
against ``Adam``. Their ratio is the price of what they add (or save), not a gap to close;
their state bytes are the point. Besides the medians the table gives the ratio of the
means, which counts the steps that do more than the others: SOAP refreshes its eigenbases
every ``precondition_frequency`` steps, so its rows time a whole number of such periods.

On CUDA (``--device cuda``, the default where a GPU is present) the same rows run on the
GPU and the clock is the wall clock after ``torch.cuda.synchronize()``; on CPU it is the
CPU time of the benchmark's own thread (``--clock``; :func:`benchmarks.timing.device_timer`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import lsdl_lab
import lsdl_lab.optim
from benchmarks import ROOT
from benchmarks.timing import (
    add_device_options,
    compare,
    device_setup,
    device_timer,
    load_average,
    log,
    quartiles,
    results_path,
    state_bytes_per_param,
    write_report,
)
from lsdl_lab.models import GPT, ResNet

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "optimizers.md"
MIN_PAIRS, MAX_PAIRS = 7, 400  # timed pairs per row, unless --repeats fixes them
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
    # the same update on both sides (the defaults differ): Liu et al.'s scaling, a decay
    "Muon": [("Muon", {"weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"})],
}


# Layer-wise optimizers with no torch.optim namesake: (label, reference, factory of the two
# optimizers of the pair from the parameter list). The references' settings:
# * torch.optim: the same algorithm without the trust ratio, so the same state and
#   memory traffic (every tensor adapted, no weight decay on either side).
# * pytorch-optimizer (as tests/test_lars_lamb.py): its LARS adapts tensors with two or more
#   dimensions only and gives the others plain momentum SGD without decay, and has no eps
#   (ours: the groups of ``param_groups_for_layerwise``, eps=0); its Lamb corrects no
#   moment inside the ratio, clamps ||w|| at 10 and decays inside the ratio with
#   weight_decouple=False (ours: bias_correction=False, clamp=(0, 10)); it divides the step
#   by 1 - beta1^t, which changes the values but not the work. foreach=True on both.
LR_LARS, LR_LAMB, WD_LARS, WD_LAMB = 0.1, 1e-3, 1e-4, 0.01


def pytorch_optimizer():
    """The ``pytorch_optimizer`` module, or None when it cannot be imported."""
    try:
        import pytorch_optimizer as po
    except ImportError:
        return None
    return po


def layerwise_configurations() -> list[tuple[str, str, Callable]]:
    """(label, reference, make) of the LARS and LAMB rows; ``make(params)`` returns the pair
    (lsdl_lab optimizer, reference optimizer), or raises ImportError for a missing one."""
    from lsdl_lab.optim import LAMB, LARS, param_groups_for_layerwise

    def po_class(name):
        po = pytorch_optimizer()
        if po is None:
            raise ImportError("pytorch_optimizer is not installed")
        return getattr(po, name)

    return [
        (
            "LARS",
            "torch.optim SGD momentum=0.9",
            lambda ps: (
                LARS(ps, lr=LR_LARS, momentum=0.9),
                torch.optim.SGD(ps, lr=LR_LARS, momentum=0.9, foreach=True),
            ),
        ),
        (
            "LARS",
            f"pytorch-optimizer LARS weight_decay={WD_LARS:g}",
            lambda ps: (
                LARS(param_groups_for_layerwise(ps, WD_LARS), lr=LR_LARS, momentum=0.9, eps=0.0),
                po_class("LARS")(ps, lr=LR_LARS, momentum=0.9, weight_decay=WD_LARS, foreach=True),
            ),
        ),
        (
            "LAMB",
            f"torch.optim AdamW weight_decay={WD_LAMB:g}",
            lambda ps: (
                LAMB(ps, lr=LR_LAMB, weight_decay=WD_LAMB),
                torch.optim.AdamW(ps, lr=LR_LAMB, eps=1e-6, weight_decay=WD_LAMB, foreach=True),
            ),
        ),
        (
            "LAMB",
            f"pytorch-optimizer Lamb weight_decay={WD_LAMB:g}",
            lambda ps: (
                LAMB(
                    ps, lr=LR_LAMB, weight_decay=WD_LAMB, bias_correction=False, clamp=(0.0, 10.0)
                ),
                po_class("Lamb")(
                    ps, lr=LR_LAMB, weight_decay=WD_LAMB, weight_decouple=False, foreach=True
                ),
            ),
        ),
    ]


# The newer optimizers against the torch.optim step they replace: (label, reference,
# period, make), ``make(model, params)`` returning the pair (lsdl_lab optimizer, reference)
# or raising ValueError when the model has nothing for it; ``period``: the timed pairs are
# a multiple of it, so that a step done once every ``period`` steps is counted in its
# share. Defaults on both sides (AdamW's weight decay 0.01, as SOAP's and AdamW8bit's;
# ScheduleFreeAdamW's is 0, its reference's too).
SOAP_PERIOD = 10  # SOAP's precondition_frequency (its default)


def beyond_configurations() -> list[tuple[str, str, int, Callable]]:
    """(label, reference, period, make) of the rows of the optimizers torch.optim lacks."""
    from lsdl_lab.optim import SOAP, Adam8bit, AdamW8bit, Muon, ScheduleFreeAdamW, muon_param_groups

    def adamw(ps, **kwargs):
        return torch.optim.AdamW(ps, foreach=True, **kwargs)

    def muon(model):
        groups = muon_param_groups(model)
        if not any(group["use_muon"] for group in groups):
            raise ValueError("no hidden matrix for Muon (convolution kernels are 4-D)")
        return Muon(groups)

    return [
        ("Muon (muon_param_groups)", "torch.optim AdamW", 1,
         lambda model, ps: (muon(model), adamw(ps))),
        ("SOAP", "torch.optim AdamW", SOAP_PERIOD,
         lambda model, ps: (SOAP(ps, precondition_frequency=SOAP_PERIOD), adamw(ps))),
        ("ScheduleFreeAdamW", "torch.optim AdamW weight_decay=0", 1,
         lambda model, ps: (ScheduleFreeAdamW(ps), adamw(ps, weight_decay=0.0))),
        ("AdamW8bit", "torch.optim AdamW", 1, lambda model, ps: (AdamW8bit(ps), adamw(ps))),
        ("Adam8bit", "torch.optim Adam", 1,
         lambda model, ps: (Adam8bit(ps), torch.optim.Adam(ps, foreach=True))),
    ]  # fmt: skip


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
    reference: str = ""  # what lsdl_lab is compared with, where not its torch.optim namesake
    beyond: bool = False  # a row of the optimizers torch.optim lacks
    mean_ratio: float = float("nan")  # mean lsdl_lab / mean reference


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
    reference: str = "torch",
    timer: Callable[[], float] = time.perf_counter,
    period: int = 1,
) -> None:
    """Warm both optimizers up, then time their steps in alternation into ``row``;
    ``steps`` holds ``lsdl_lab`` and ``reference``; ``timer`` is the clock
    (:func:`benchmarks.timing.device_timer`); the pairs are a multiple of ``period``."""

    def restore_grads():
        torch._foreach_copy_(grads, fixed)

    t0 = timer()
    compare(steps, repeats=1, warmup=warmup - 1, setup=restore_grads)  # untimed
    per_round = (timer() - t0) / warmup
    writers = []
    for name, step in steps.items():  # one more step each: does it write into p.grad?
        restore_grads()
        step()
        if any(not torch.equal(g, f) for g, f in zip(grads, fixed, strict=True)):
            writers.append(name)
    row.writes_grad = " and ".join(writers)
    restore_grads()
    row.pairs = repeats or int(min(max(budget / per_round, MIN_PAIRS), MAX_PAIRS))
    row.pairs = -(-row.pairs // period) * period
    setup = restore_grads if row.writes_grad else None
    result = compare(steps, repeats=row.pairs, warmup=0, setup=setup, timer=timer)
    row.ours_ms = 1e3 * result.median("lsdl_lab")
    row.torch_ms = 1e3 * result.median(reference)
    row.ratio = result.ratio("lsdl_lab", reference)
    row.mean_ratio = statistics.fmean(result.times["lsdl_lab"]) / statistics.fmean(
        result.times[reference]
    )
    row.ratio_q1, row.pair_median, row.ratio_q3 = quartiles(result.ratios("lsdl_lab", reference))


def log_row(row: Row, log) -> None:
    against = f"  vs {row.reference}:" if row.reference else ""
    log(
        f"  {row.label:<24}{against} lsdl_lab {row.ours_ms:9.3f} ms  "
        f"{'reference' if row.reference else 'torch'} {row.torch_ms:9.3f} ms  "
        f"ratio {row.ratio:.3f} (IQR {row.ratio_q1:.3f}-{row.ratio_q3:.3f}, "
        f"{row.pairs} pairs)" + (f"  [{row.writes_grad} writes p.grad]" * bool(row.writes_grad))
    )


def benchmark_size(
    size: str,
    repeats: int | None,
    budget: float,
    warmup: int,
    log=print,
    only: set[str] | None = None,
    device: torch.device | str = "cpu",
    timer: Callable[[], float] | None = None,
) -> tuple[str, list[Row]]:
    """Time every configuration on the model of ``size``, on ``device`` (those of the
    optimizers named in ``only``, when given); returns its description and rows."""
    torch.manual_seed(0)
    timer = timer or device_timer(device)
    model = SIZES[size][1]().to(device)
    params = list(model.parameters())  # tied weights once
    header = describe(size, params)
    log(header)
    fixed = [torch.randn_like(p) for p in params]
    for p, g in zip(params, fixed, strict=True):
        p.grad = g.clone()
    grads = [p.grad for p in params]
    rows = []
    for label, name, kwargs in configurations():
        if only is not None and name not in only:
            continue
        row = Row(label)
        rows.append(row)
        ps, paths = params, {"foreach": True}
        if name == "Muon":  # torch.optim.Muon takes matrices only, one at a time (no foreach)
            ps, paths = [p for p in params if p.dim() == 2], {}
        try:
            ours = getattr(lsdl_lab.optim, name)(ps, **kwargs)
            theirs = getattr(torch.optim, name)(ps, **kwargs, **paths)
        except (TypeError, ValueError) as e:
            row.skipped = f"skipped: {type(e).__name__}: {e}"
            log(f"  {label:<24} {row.skipped}")
            continue
        steps = {"lsdl_lab": ours.step, "torch": theirs.step}
        time_pair(row, steps, grads, fixed, repeats, budget, warmup, timer=timer)
        row.ours_bytes = state_bytes_per_param(ours)
        row.torch_bytes = state_bytes_per_param(theirs)
        log_row(row, log)
        for opt in (ours, theirs):  # free the state now: torch.optim's Adam sits in a cycle
            opt.state.clear()
    for label, reference, make in layerwise_configurations():
        if only is not None and label not in only:
            continue
        row = Row(label, reference=reference)
        rows.append(row)
        try:
            ours, theirs = make(params)
        except ImportError as e:
            row.skipped = f"skipped: {e}"
            log(f"  {label:<24}  vs {reference}: {row.skipped}")
            continue
        steps = {"lsdl_lab": ours.step, "reference": theirs.step}
        time_pair(
            row, steps, grads, fixed, repeats, budget, warmup, reference="reference", timer=timer
        )
        row.ours_bytes = state_bytes_per_param(ours)
        row.torch_bytes = state_bytes_per_param(theirs)
        log_row(row, log)
        for opt in (ours, theirs):
            opt.state.clear()
    for label, reference, period, make in beyond_configurations():
        if only is not None and label.split()[0] not in only:
            continue
        row = Row(label, reference=reference, beyond=True)
        rows.append(row)
        try:
            ours, theirs = make(model, params)
        except ValueError as e:
            row.skipped = f"skipped: {e}"
            log(f"  {label:<24}  vs {reference}: {row.skipped}")
            continue
        steps = {"lsdl_lab": ours.step, "reference": theirs.step}
        time_pair(row, steps, grads, fixed, repeats, budget, warmup, "reference", timer, period)
        row.ours_bytes = state_bytes_per_param(ours)
        row.torch_bytes = state_bytes_per_param(theirs)
        log_row(row, log)
        for opt in (ours, theirs):
            opt.state.clear()
    return header, rows


def load_note() -> list[str]:
    """A line for a results file's header when the machine was busy at the end of the run
    (a 15-minute load average above its usable cores), or none."""
    try:
        load = os.getloadavg()[2]
    except (AttributeError, OSError):
        return []
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if load <= usable:
        return []
    return [
        f"- **loaded machine**: a 15-minute load average of {load:.1f} on {usable} usable "
        "cores: other jobs ran beside this one, so the ms are inflated and noisy; the "
        "ratios of steps timed back to back, and their spread, are what to read"
    ]


def timing_line(repeats: int | None, budget: float, warmup: int) -> str:
    how = (
        f"{repeats} pairs"
        if repeats
        else (f"as many pairs as fit {budget:g} s ({MIN_PAIRS} to {MAX_PAIRS})")
    )
    return (
        f"- timing: {warmup + 1} untimed warm-up steps each, then {how} per row, each pair "
        "timed back to back, which of the two goes first alternating"
    )


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
    for header, all_rows in sections:
        rows = [r for r in all_rows if not r.reference]
        out += ["", f"## {header}"]
        if rows:
            out += [
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
        out += layerwise_table([r for r in all_rows if r.reference and not r.beyond])
        out += beyond_table([r for r in all_rows if r.beyond])
    if all_ratios:
        out += ["", "## Summary", ""]
        for size in dict.fromkeys(size for _, size, _ in all_ratios):
            out.append(f"- {size}: " + summary([x for x in all_ratios if x[1] == size]))
        out.append(f"- all {len(all_ratios)} rows: " + summary(all_ratios))
        above = [f"{label} at {size} ({r:.2f})" for r, size, label in all_ratios if r > GOAL]
        out.append(f"- above {GOAL}: " + ("; ".join(above) if above else "none"))
    return "\n".join(out) + "\n"


def layerwise_table(rows: list[Row]) -> list[str]:
    """The LARS and LAMB rows of one size, against their references (not in the summary:
    the torch.optim references do less work by design, so the goal does not apply)."""
    if not rows:
        return []
    out = [
        "",
        "Layer-wise optimizers (no torch.optim namesake), against references: ratio = "
        "lsdl_lab / reference. Against torch.optim, a ratio above 1 is the cost of the "
        "trust ratio (a norm per tensor and its use), not a gap.",
        "",
        "| optimizer | reference | lsdl_lab ms | reference ms | ratio "
        "| pair ratios: median [IQR] | pairs | B/param lsdl_lab | B/param reference |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.skipped:
            out.append(f"| {r.label} | {r.reference} | | | | | | | {r.skipped} |")
            continue
        mark = " †" if r.writes_grad else ""
        out.append(
            f"| {r.label}{mark} | {r.reference} | {r.ours_ms:.3f} | {r.torch_ms:.3f} "
            f"| {r.ratio:.2f} | {r.pair_median:.2f} [{r.ratio_q1:.2f}–{r.ratio_q3:.2f}] "
            f"| {r.pairs} | {r.ours_bytes:.3f} | {r.torch_bytes:.3f} |"
        )
    for r in rows:
        if r.writes_grad:
            who = r.writes_grad.replace("reference", r.reference)
            out += [
                "",
                f"† {who}: `step()` writes into `p.grad` (in place); the fixed gradients "
                "are restored before every step of this row, untimed.",
            ]
    return out


def beyond_table(rows: list[Row]) -> list[str]:
    """The rows of the optimizers torch.optim lacks, against the step they replace (not in
    the summary: different algorithms, so the goal does not apply)."""
    if not rows:
        return []
    out = [
        "",
        "Optimizers torch.optim lacks, against the torch.optim foreach step they replace: "
        "ratio = lsdl_lab / reference, the price of what each adds (Newton-Schulz on the "
        "matrices, the eigenbasis, the average, the quantization), not a gap. ratio of "
        "means: mean / mean, which counts the steps that do more (SOAP's eigenbasis "
        f"refresh every {SOAP_PERIOD} steps: its pairs are a multiple of {SOAP_PERIOD}).",
        "",
        "| optimizer | reference | lsdl_lab ms | reference ms | ratio "
        "| pair ratios: median [IQR] | ratio of means | pairs | B/param lsdl_lab "
        "| B/param reference |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.skipped:
            out.append(f"| {r.label} | {r.reference} | | | | | | | | {r.skipped} |")
            continue
        out.append(
            f"| {r.label} | {r.reference} | {r.ours_ms:.3f} | {r.torch_ms:.3f} "
            f"| {r.ratio:.2f} | {r.pair_median:.2f} [{r.ratio_q1:.2f}–{r.ratio_q3:.2f}] "
            f"| {r.mean_ratio:.2f} | {r.pairs} | {r.ours_bytes:.3f} | {r.torch_bytes:.3f} |"
        )
    return out


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", default="1M,10M,50M", help=f"comma-separated, from {', '.join(SIZES)}"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed pairs per row (default: --budget)"
    )
    parser.add_argument(
        "--budget", type=float, default=1.5, help="seconds of timed pairs per row (default 1.5)"
    )
    add_device_options(parser)
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    parser.add_argument("--quick", action="store_true", help="the tiny model, 5 pairs: a test")
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated lsdl_lab optimizer names (e.g. LARS,LAMB): their rows alone; "
        "no file is written unless --out is given",
    )
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
    only = None
    if args.only is not None:
        only = {s.strip() for s in args.only.split(",") if s.strip()}
        known = (
            {name for _, name, _ in configurations()}
            | {label for label, _, _ in layerwise_configurations()}
            | {label.split()[0] for label, _, _, _ in beyond_configurations()}
        )
        if not only or only - known:
            parser.error(f"unknown --only {sorted(only - known)}; choose from {sorted(known)}")
    device, timer, head = device_setup(parser, args)
    sections = [
        benchmark_size(s, args.repeats, args.budget, args.warmup, log, only, device, timer)
        for s in sizes
    ]
    head += [
        f"- load average at end: {load_average()}",
        *load_note(),
        timing_line(args.repeats, args.budget, args.warmup),
    ]
    text = table(sections, head)
    default = None if args.quick or only is not None else results_path(DEFAULT_OUT, device)
    out = args.out if args.out is not None else default
    write_report(text, out, log)
    return text


if __name__ == "__main__":
    main()
