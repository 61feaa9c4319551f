"""Step time and state bytes of K-FAC and Shampoo beside Adam and pytorch-optimizer's Shampoo.

Run from the repository root::

    python -m benchmarks.second_order               # the MLP and ResNet-14 of the cpu profile
    python -m benchmarks.second_order --quick       # tiny models, a few seconds, no file

Each optimizer trains its own copy of the same model (same initial weights) on the same
fixed batch (digits-sized: 64 images of 1 x 8 x 8, 10 classes). One *training step* is
``zero_grad``, forward, backward (``KFAC.backward`` for K-FAC, which adds the backward of
the sampled labels' loss that its true-Fisher factors need) and ``step``; the optimizers
take training steps in rounds, back to back, the first of each round rotating
(:func:`benchmarks.timing.compare`), so all see the same moments of a shared machine.
Every training step's time is kept, and the time of its ``optimizer.step()`` alone too.

A second-order optimizer recomputes its preconditioner every ``update_freq`` steps
(K-FAC: the factors' eigendecompositions; Shampoo: the inverse roots) and reuses it in
between, so its steps come in two kinds, reported apart: the *refresh* steps and the
others. All three use ``update_freq`` = :data:`UPDATE_FREQ` (K-FAC's default;
pytorch-optimizer calls it ``preconditioning_compute_steps``). The amortized step is
``((k - 1) * other + refresh) / k``.

State bytes: every tensor reachable from ``optimizer.state`` (nested lists and dicts
included: Shampoo keeps lists of per-block statistics and roots), each storage once, per
parameter of the model.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
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
from lsdl_lab.book.races import state_bytes
from lsdl_lab.models import MLP, ResNet
from lsdl_lab.optim import KFAC, Adam, Shampoo
from lsdl_lab.profiles import PROFILES

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "second_order.md"
UPDATE_FREQ = 10
BATCH = 64
CPU = PROFILES["cpu"]
# The models of the cpu profile (its MLP width, its ResNet depth and width) on 8x8 digits.
CASES = {
    "mlp": (
        f"MLP 64-{CPU.mlp_hidden}-{CPU.mlp_hidden}-10",
        lambda: MLP(64, 10, hidden=CPU.mlp_hidden),
    ),
    "resnet": (
        f"ResNet-{CPU.resnet_depth}, width {CPU.resnet_width}",
        lambda: ResNet(CPU.resnet_depth, CPU.resnet_width, in_channels=1),
    ),
    "tiny-mlp": ("MLP 64-16-16-10", lambda: MLP(64, 10, hidden=16)),
    "tiny-resnet": ("ResNet-8, width 4", lambda: ResNet(8, 4, in_channels=1)),
}


def pytorch_optimizer_shampoo():
    """pytorch-optimizer's ``Shampoo`` class, or None when the package is missing."""
    try:
        from pytorch_optimizer import Shampoo as PoShampoo
    except ImportError:
        return None
    return PoShampoo


def optimizers(k: int = UPDATE_FREQ) -> dict[str, tuple[Callable, Callable[[int], bool]]]:
    """name -> (make(model) -> optimizer, refreshes(t) -> whether the t-th step (from 1)
    recomputes the preconditioner). The refresh rules are each implementation's own
    (``(t - 1) % k == 0`` in lsdl_lab: the first step has a preconditioner; ``t % k == 0``
    in pytorch-optimizer, whose first k - 1 steps use its identity initialization); the
    tests check them against the state each step changes."""
    out = {
        "Adam": (lambda m: Adam(m.parameters(), lr=1e-3), lambda t: False),
        "K-FAC": (
            lambda m: KFAC(m, lr=0.01, damping=1e-2, update_freq=k, seed=0),
            lambda t: (t - 1) % k == 0,
        ),
        "Shampoo": (
            lambda m: Shampoo(m.parameters(), lr=0.1, update_freq=k),
            lambda t: (t - 1) % k == 0,
        ),
    }
    po = pytorch_optimizer_shampoo()
    if po is not None:
        out["pytorch-optimizer Shampoo"] = (
            # Its default learning rate: at 0.1 its ungrafted step diverges on the MLP.
            lambda m: po(m.parameters(), lr=1e-3, preconditioning_compute_steps=k),
            lambda t: t % k == 0,
        )
    return out


@dataclass
class Trainer:
    """One optimizer on its own copy of the model, timing each training step."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    x: torch.Tensor
    y: torch.Tensor
    timer: Callable[[], float]
    steps: int = 0
    loss: float = float("nan")  # the last step's
    step_times: list[float] = field(default_factory=list)  # optimizer.step() alone

    def __call__(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(self.x), self.y)
        if isinstance(self.optimizer, KFAC):
            self.optimizer.backward(loss)
        else:
            loss.backward()
        t0 = self.timer()
        self.optimizer.step()
        self.step_times.append(self.timer() - t0)
        self.steps += 1
        self.loss = loss.item()


@dataclass
class Row:
    name: str
    other_ms: float = float("nan")  # training step, steps that reuse the preconditioner
    refresh_ms: float = float("nan")  # training step, steps that recompute it
    step_other_ms: float = float("nan")  # optimizer.step() alone
    step_refresh_ms: float = float("nan")
    amortized_ms: float = float("nan")
    ratio: float = float("nan")  # median pair ratio against Adam, non-refresh steps
    ratio_q1: float = float("nan")
    ratio_q3: float = float("nan")
    refreshes: int = 0
    others: int = 0
    bytes_per_param: float = float("nan")


def median_ms(xs: list[float]) -> float:
    return 1e3 * statistics.median(xs) if xs else float("nan")


def benchmark_case(
    case: str, rounds: int, warmup: int, timer: Callable[[], float], k: int = UPDATE_FREQ
) -> tuple[str, list[Row]]:
    """Time every optimizer on the model of ``case``; its description and rows."""
    torch.manual_seed(0)
    label, make_model = CASES[case]
    base = make_model()
    x, y = torch.randn(BATCH, 1, 8, 8), torch.randint(0, 10, (BATCH,))
    n_params = sum(p.numel() for p in base.parameters())
    specs = optimizers(k)
    trainers = {}
    for name, (make, _) in specs.items():
        model = copy.deepcopy(base)
        trainers[name] = Trainer(model, make(model), x, y, timer)
    result = compare(trainers, repeats=rounds, warmup=warmup, timer=timer)
    diverged = {name: t.loss for name, t in trainers.items() if not math.isfinite(t.loss)}
    if diverged:  # a step on NaNs is no measure of a step
        raise RuntimeError(f"Training diverged on {case}: last losses {diverged}")
    rows = []
    for name, trainer in trainers.items():
        refreshes = specs[name][1]
        kinds = [refreshes(warmup + 1 + r) for r in range(rounds)]
        whole = result.times[name]
        alone = trainer.step_times[warmup:]
        row = Row(name, refreshes=sum(kinds), others=rounds - sum(kinds))
        row.other_ms = median_ms([t for t, kind in zip(whole, kinds) if not kind])
        row.refresh_ms = median_ms([t for t, kind in zip(whole, kinds) if kind])
        row.step_other_ms = median_ms([t for t, kind in zip(alone, kinds) if not kind])
        row.step_refresh_ms = median_ms([t for t, kind in zip(alone, kinds) if kind])
        row.amortized_ms = (
            row.other_ms if not row.refreshes else ((k - 1) * row.other_ms + row.refresh_ms) / k
        )
        if "Adam" in trainers:
            ratios = [r for r, kind in zip(result.ratios(name, "Adam"), kinds) if not kind]
            row.ratio_q1, row.ratio, row.ratio_q3 = quartiles(ratios)
        row.bytes_per_param = state_bytes(trainer.optimizer) / n_params
        rows.append(row)
        log(
            f"  {name:<28} other {row.other_ms:8.2f} ms  refresh {row.refresh_ms:8.2f} ms  "
            f"step alone {row.step_other_ms:7.2f}/{row.step_refresh_ms:7.2f} ms  "
            f"x Adam {row.ratio:.2f}  {row.bytes_per_param:.1f} B/param"
        )
    return f"{case}: {label}, {n_params:,} parameters, batch {BATCH} of 1x8x8", rows


def fmt(x: float, digits: int = 2) -> str:
    return "—" if x != x else f"{x:.{digits}f}"


def table(sections: list[tuple[str, list[Row]]], header: list[str], k: int) -> str:
    out = ["# Second-order optimizers: step time and state bytes", ""] + header
    out += [
        "",
        "Training step: zero_grad, forward, backward (K-FAC: `KFAC.backward`, which adds the "
        "sampled labels' backward), `step`, timed in rounds with the first of each round "
        f"rotating. Preconditioners recomputed every {k} steps (*refresh* steps); *other*: "
        "the steps that reuse them. ms: medians. amortized: ((k-1) other + refresh) / k. "
        "× Adam: per-round ratios of the other steps' training-step times against Adam's, "
        "median [IQR]. step(): `optimizer.step()` alone. B/param: bytes of optimizer state "
        "per parameter.",
    ]
    for title, rows in sections:
        out += [
            "",
            f"## {title}",
            "",
            "| optimizer | training step ms (other) | (refresh) | amortized | × Adam [IQR] "
            "| step() ms (other) | (refresh) | steps other/refresh | B/param |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            out.append(
                f"| {r.name} | {fmt(r.other_ms)} | {fmt(r.refresh_ms)} | {fmt(r.amortized_ms)} "
                f"| {fmt(r.ratio)} [{fmt(r.ratio_q1)}–{fmt(r.ratio_q3)}] "
                f"| {fmt(r.step_other_ms, 3)} | {fmt(r.step_refresh_ms, 3)} "
                f"| {r.others}/{r.refreshes} | {fmt(r.bytes_per_param, 1)} |"
            )
    if pytorch_optimizer_shampoo() is None:
        out += ["", "pytorch-optimizer is not installed: its Shampoo row is missing."]
    out += ["", f"- load average at the end: {load_average()}", ""]
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.second_order", description=__doc__)
    parser.add_argument("--cases", default="mlp,resnet", help=f"from {','.join(CASES)}")
    parser.add_argument("--rounds", type=int, default=3 * UPDATE_FREQ, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--quick", action="store_true", help="tiny models, 2 refreshes, no file")
    parser.add_argument("--out", type=Path, default=None, help="where the table goes")
    add_device_options(parser)
    args = parser.parse_args(argv)
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not args.cases or any(c not in CASES for c in args.cases):
        parser.error(f"Invalid --cases {','.join(args.cases)!r} (choose from {', '.join(CASES)})")
    if args.rounds < 1 or args.warmup < 0:
        parser.error(f"Invalid --rounds {args.rounds} or --warmup {args.warmup} (>= 1, >= 0)")
    if args.device != "cpu":
        parser.error(f"Invalid --device {args.device!r} (this benchmark runs on cpu)")
    return parser, args


def main(argv: list[str] | None = None) -> str:
    parser, args = parse_args(argv)
    k = UPDATE_FREQ
    if args.quick:
        args.cases, args.rounds, args.warmup, k = ["tiny-mlp", "tiny-resnet"], 6, 1, 3
    device, timer, header = device_setup(parser, args)
    sections = []
    for case in args.cases:
        log(f"{case}:")
        sections.append(benchmark_case(case, args.rounds, args.warmup, timer, k))
    header += [
        f"- timing: {args.warmup} untimed rounds, then {args.rounds} rounds of one training "
        "step per optimizer",
    ]
    text = table(sections, header, k)
    out = args.out or (None if args.quick else results_path(DEFAULT_OUT, device))
    write_report(text, out, log)
    return text


if __name__ == "__main__":
    main()
