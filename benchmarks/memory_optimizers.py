"""Step time and state bytes of the memory-efficient optimizers (Adafactor, SM3, 8-bit
Adam and AdamW) beside Adam, torch.optim's Adafactor and pytorch-optimizer's AdaFactor and
SM3, and of the newer optimizers (Muon, SOAP, schedule-free AdamW) beside AdamW.

Run from the repository root::

    python -m benchmarks.memory_optimizers          # 1M and 10M parameters, 2 minutes
    python -m benchmarks.memory_optimizers --quick  # a tiny model, seconds, no file

What is timed: ``optimizer.step()`` alone, on the models of :mod:`benchmarks.optimizers`
(fixed random gradients, restored before every step, untimed; the state warmed by
``--warmup`` rounds first). The rows come in groups, lsdl_lab's optimizer and its
references, each group timed on its own: every optimizer of the group steps the same
parameters once per round, the first of a round rotating (:func:`benchmarks.timing.compare`),
so that all see the same moments of a shared machine; the group's state is freed before
the next. (Timing all ten in one round measured the allocator instead: a step that
followed another optimizer's large temporaries ran up to twice as long.) State: the bytes
of every tensor in ``optimizer.state`` after the warm-up
(:func:`benchmarks.timing.state_bytes_per_param`).

Settings, chosen so that rows compare like with like: every Adafactor without first moment
(torch.optim's and lsdl_lab's defaults; pytorch-optimizer's with ``betas=(None, 0.999)``,
its momentum being on by default), and one lsdl_lab row with ``beta1=0.9`` to show what
the first moment costs; SM3 with ``momentum=0`` and ``0.9`` on both sides (pytorch-optimizer
keeps its momentum buffer even at 0). The three Adafactors compute different variants
(``lsdl_lab/optim/adafactor.py`` says how); lsdl_lab's and torch.optim's compute the same
steps to rounding (``tests/optim/test_adafactor.py``), both SM3s bit for bit
(``tests/optim/test_sm3.py``).

``Adam8bit`` and ``AdamW8bit`` keep both moments of every tensor of at least
``min_8bit_size`` numbers in 8 bits with a float32 scale per block (the rest in float32),
beside torch.optim's float32 ``Adam`` and ``AdamW``. The newer optimizers are here for
their state beside AdamW's: ``Muon`` on the groups of ``muon_param_groups`` (a momentum
for each hidden matrix, AdamW's two moments for the rest; not on the ResNet, which has no
hidden matrix), ``SOAP`` (Adam's moments, two Kronecker factors and their eigenbases per
matrix), ``ScheduleFreeAdamW`` (z and the second moment: AdamW's bytes). Their times are
medians, which leave out SOAP's eigenbasis refresh every ten steps; the rows of
:mod:`benchmarks.optimizers` count it (the ratio of the means).

Each lsdl_lab row has a ``foreach=False`` twin (the same update, one parameter at a time):
on a CPU a model-sized pass streams from memory, while one tensor's passes stay in the
cache, so past the cache's size the per-tensor loop can win (pytorch-optimizer's SM3 runs
one tensor at a time too).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks import ROOT
from benchmarks.optimizers import SIZES, describe, load_note, pytorch_optimizer
from benchmarks.timing import (
    add_device_options,
    compare,
    device_setup,
    load_average,
    log,
    quartiles,
    results_path,
    state_bytes_per_param,
    write_report,
)
from lsdl_lab import optim

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "memory_optimizers.md"
BASELINE = "lsdl_lab Adam"


def po(name: str):
    """pytorch-optimizer's class ``name``; ImportError when it is not installed."""
    module = pytorch_optimizer()
    if module is None:
        raise ImportError("pytorch_optimizer is not installed")
    return getattr(module, name)


def muon(model: torch.nn.Module) -> optim.Muon:
    """Muon on ``model``'s groups from :func:`lsdl_lab.optim.muon_param_groups`; ValueError
    when the model has no hidden matrix (then Muon would be AdamW alone)."""
    groups = optim.muon_param_groups(model)
    if not any(group["use_muon"] for group in groups):
        raise ValueError("no hidden matrix for Muon (convolution kernels are 4-D)")
    return optim.Muon(groups)


# Groups of rows timed together, each row (label, factory of the optimizer from the model);
# the first row of a group is lsdl_lab's, the others its references.
GROUPS: list[list[tuple[str, Callable]]] = [
    [(BASELINE, lambda m: optim.Adam(m.parameters())),
     ("lsdl_lab Adam foreach=False", lambda m: optim.Adam(m.parameters(), foreach=False)),
     ("torch.optim Adam", lambda m: torch.optim.Adam(m.parameters(), foreach=True))],
    [("lsdl_lab Adafactor", lambda m: optim.Adafactor(m.parameters())),
     ("lsdl_lab Adafactor foreach=False", lambda m: optim.Adafactor(m.parameters(), foreach=False)),
     ("torch.optim Adafactor", lambda m: torch.optim.Adafactor(m.parameters(), foreach=True)),
     ("pytorch-optimizer AdaFactor",
      lambda m: po("AdaFactor")(m.parameters(), betas=(None, 0.999)))],
    [("lsdl_lab Adafactor beta1=0.9", lambda m: optim.Adafactor(m.parameters(), beta1=0.9))],
    [("lsdl_lab SM3", lambda m: optim.SM3(m.parameters())),
     ("lsdl_lab SM3 foreach=False", lambda m: optim.SM3(m.parameters(), foreach=False)),
     ("pytorch-optimizer SM3", lambda m: po("SM3")(m.parameters(), foreach=True))],
    [("lsdl_lab SM3 momentum=0.9", lambda m: optim.SM3(m.parameters(), momentum=0.9)),
     ("lsdl_lab SM3 momentum=0.9 foreach=False",
      lambda m: optim.SM3(m.parameters(), momentum=0.9, foreach=False)),
     ("pytorch-optimizer SM3 momentum=0.9",
      lambda m: po("SM3")(m.parameters(), momentum=0.9, foreach=True))],
    [("lsdl_lab Adam8bit", lambda m: optim.Adam8bit(m.parameters())),
     ("lsdl_lab Adam8bit foreach=False", lambda m: optim.Adam8bit(m.parameters(), foreach=False)),
     ("torch.optim Adam", lambda m: torch.optim.Adam(m.parameters(), foreach=True))],
    [("lsdl_lab AdamW8bit", lambda m: optim.AdamW8bit(m.parameters())),
     ("torch.optim AdamW", lambda m: torch.optim.AdamW(m.parameters(), foreach=True))],
    [("lsdl_lab Muon (muon_param_groups)", muon),
     ("torch.optim AdamW", lambda m: torch.optim.AdamW(m.parameters(), foreach=True))],
    [("lsdl_lab SOAP", lambda m: optim.SOAP(m.parameters())),
     ("torch.optim AdamW", lambda m: torch.optim.AdamW(m.parameters(), foreach=True))],
    [("lsdl_lab ScheduleFreeAdamW", lambda m: optim.ScheduleFreeAdamW(m.parameters())),
     ("torch.optim AdamW weight_decay=0",
      lambda m: torch.optim.AdamW(m.parameters(), weight_decay=0.0, foreach=True))],
]  # fmt: skip


def benchmark_size(
    size: str, repeats: int, warmup: int, device, timer, log=print
) -> tuple[str, list[tuple[str, str]], list[str]]:
    """Time every group of rows on the model of ``size``; returns its description, the
    table's rows (label, Markdown cells) and the rows skipped (with why)."""
    torch.manual_seed(0)
    model = SIZES[size][1]().to(device)
    params = list(model.parameters())
    header = describe(size, params)
    log(header)
    fixed = [torch.randn_like(p) for p in params]
    for p, g in zip(params, fixed, strict=True):
        p.grad = g.clone()
    grads = [p.grad for p in params]
    n = sum(p.numel() for p in params)
    rows, skipped, adam_ms = [], [], None
    for group in GROUPS:
        opts = {}
        for label, make in group:
            try:
                opts[label] = make(model)
            except (ImportError, ValueError) as e:
                skipped.append(f"{label}: skipped, {e}")
        if group[0][0] not in opts:  # no lsdl_lab row: nothing to compare with
            continue
        result = compare(
            {label: opt.step for label, opt in opts.items()},
            repeats=repeats,
            warmup=warmup,
            setup=lambda: torch._foreach_copy_(grads, fixed),
            timer=timer,
        )
        first = group[0][0]
        adam_ms = adam_ms or result.median(BASELINE)
        for label, opt in opts.items():
            per_param = state_bytes_per_param(opt)
            r1, _, r3 = quartiles(result.ratios(label, first))
            q1, q3 = result.iqr(label)
            cells = (
                f"{1e3 * result.median(label):.2f} | {1e3 * q1:.2f}–{1e3 * q3:.2f} "
                f"| {result.median(label) / adam_ms:.2f} "
                f"| {result.ratio(label, first):.2f} [{r1:.2f}–{r3:.2f}] "
                f"| {per_param * n / 2**20:.3f} | {per_param:.4f}"
            )
            rows.append((label, cells))
            log(f"  {label:<36} {cells}")
        for opt in opts.values():  # free the state before the next group
            opt.state.clear()
    return header, rows, skipped


def table(sections, head: list[str]) -> str:
    out = ["# Memory-efficient optimizers: step time and state bytes", "", *head, ""]
    out.append(
        "ms: median time of one `optimizer.step()` (fixed gradients, state warm; backward "
        "not included), with its interquartile range. × Adam: median / median of "
        f"{BASELINE} (timed in other rounds). vs lsdl_lab: median / median of the lsdl_lab "
        "row of the same group, timed in the same rounds [the interquartile range of the "
        "per-round ratios]; groups are separated by their lsdl_lab row. state: bytes of "
        "every tensor in the optimizer's state, in MiB and per parameter (Adam: 8 B/param "
        "in float32)."
    )
    for header, rows, skipped in sections:
        out += ["", f"## {header}", ""]
        out += [
            "| optimizer | ms | ms IQR | × Adam | vs lsdl_lab [IQR] | state MiB | state B/param |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        out += [f"| {label} | {cells} |" for label, cells in rows]
        out += [f"- {s}" for s in skipped]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1M,10M", help=f"from {', '.join(SIZES)}")
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds (default 15)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds (default 2)")
    parser.add_argument("--quick", action="store_true", help="the tiny model, 3 rounds: a test")
    parser.add_argument("--out", type=Path, default=None, help=f"(default {DEFAULT_OUT})")
    add_device_options(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.repeats, args.warmup = "tiny", 3, 1
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if not sizes or any(s not in SIZES for s in sizes):
        parser.error(f"Invalid --sizes {args.sizes!r} (choose from {', '.join(SIZES)})")
    if args.repeats < 1 or args.warmup < 1:
        parser.error("--repeats and --warmup must be at least 1")
    device, timer, head = device_setup(parser, args)
    sections = [benchmark_size(s, args.repeats, args.warmup, device, timer, log) for s in sizes]
    head += [
        f"- load average at end: {load_average()}",
        *load_note(),
        f"- timing: untimed warm-up rounds {args.warmup}, timed rounds {args.repeats}; each "
        "optimizer steps once per round, the first of a round rotating",
    ]
    text = table(sections, head)
    out = (
        args.out
        if args.out is not None
        else None
        if args.quick
        else results_path(DEFAULT_OUT, device)
    )
    write_report(text, out, log)
    return text


if __name__ == "__main__":
    main()
