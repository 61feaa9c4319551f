"""ZeRO's stages against DDP at world 2: training-step time and bytes held per rank.

Run from the repository root::

    python -m benchmarks.zero                       # the cpu profile's GPT, world 2
    python -m benchmarks.zero --quick               # a tiny GPT, a few seconds, no file

In one world of 2 processes (gloo, :func:`lsdl_lab.distributed.spawn`), eight data-parallel
set-ups each train their own copy of the same float32 GPT (untied output layer:
:func:`lsdl_lab.book.memory_experiments.untied_gpt`, as ZeRO's units need) with Adam on the
rank's half of the same batch:

* ``DDP``: ``DistributedDataParallel`` and ``torch.optim.Adam`` (plain data parallelism);
* ``ZeRO-1``, ``ZeRO-2``, ``ZeRO-3``: :class:`lsdl_lab.memory.ZeroOptimizer` at that
  stage around ``torch.optim.Adam`` (no DDP: it averages the gradients itself);
* ``torch ZeroRedundancyOptimizer``: DDP and ``ZeroRedundancyOptimizer(Adam)``, torch's
  stage 1 (whole parameters assigned to ranks);
* ``torch FSDP2``: ``fully_shard`` on each transformer block and on the model, Adam on the
  sharded parameters (stage 3, as FSDP's ``FULL_SHARD``);
* ``ZeRO-3 offload`` and ``torch FSDP2 offload``: the same with the optimizer state (and
  the master shard) kept in CPU memory and stepped there (ZeRO-Offload's idea, Ren et al.
  2021; FSDP2's ``CPUOffloadPolicy(pin_memory=False)``). On a CPU-only machine there is no
  device-to-host copy to pay: these rows time only the offload path's own bookkeeping;
  its real cost, the PCIe traffic, needs a GPU.

A training step is ``zero_grad``, forward, backward and ``step``: ZeRO moves the
communication into the backward pass (reduce-scatter) and around the step (all-gather),
so the step alone would not compare. The set-ups take one step each in rounds, the first
of each round rotating, a barrier before every step (untimed); a step's time is the wall
clock of the slower rank (a collective waits for its peer, which no CPU clock sees).

Bytes per rank after a step, before ``zero_grad``: parameters, gradients and optimizer
state this rank holds (:meth:`ZeroOptimizer.held_bytes
<lsdl_lab.memory.ZeroOptimizer.held_bytes>` for lsdl_lab; for the others
:func:`lsdl_lab.memory.measure`: each DTensor's local shard, each storage once). DDP's
gradient buckets (a second copy of the gradients, which DDP all-reduces) are not counted.
"""

from __future__ import annotations

import argparse
import statistics
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import ROOT
from benchmarks.communication import world_compare
from benchmarks.timing import (
    add_device_options,
    device_setup,
    load_average,
    log,
    quartiles,
    results_path,
    write_report,
)
from lsdl_lab.book.memory_experiments import lm_loss, untied_gpt
from lsdl_lab.distributed import spawn
from lsdl_lab.memory import ZeroOptimizer
from lsdl_lab.memory.measure import CATEGORIES, measure
from lsdl_lab.profiles import PROFILES

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "zero.md"
WORLD = 2
LR = 1e-3
CPU = PROFILES["cpu"]
VOCAB = 128  # the character vocabulary's order of size
# (vocab, block, layers, heads, dim) of untied_gpt, and the global batch in sequences.
MODELS = {
    "cpu": ((VOCAB, CPU.block_size, CPU.gpt_layers, CPU.gpt_heads, CPU.gpt_dim), 16),
    "tiny": ((32, 16, 1, 2, 16), 4),
}
SETUPS = (
    "DDP",
    "ZeRO-1",
    "ZeRO-2",
    "ZeRO-3",
    "ZeRO-3 offload",
    "torch ZeroRedundancyOptimizer",
    "torch FSDP2",
    "torch FSDP2 offload",
)


def make_setup(name: str, gpt_args: tuple, world_size: int):
    """(model, optimizer, bytes()) of one set-up on this rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = untied_gpt(*gpt_args)
    offload = name.endswith(" offload")
    if name.startswith("ZeRO-"):
        opt = ZeroOptimizer(model, torch.optim.Adam, stage=int(name[5]), offload=offload, lr=LR)
        return model, opt, opt.held_bytes
    if name.startswith("torch FSDP2"):
        from torch.distributed.fsdp import CPUOffloadPolicy

        mesh = init_device_mesh("cpu", (world_size,))
        # pin_memory=False: pinning needs CUDA (FACTS.md)
        policy = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
        for block in model.blocks:
            fully_shard(block, mesh=mesh, **policy)
        fully_shard(model, mesh=mesh, **policy)
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        return model, opt, lambda: measure(model, opt)  # each DTensor's local shard
    ddp = DistributedDataParallel(model)
    if name == "DDP":
        opt = torch.optim.Adam(ddp.parameters(), lr=LR)
        return ddp, opt, lambda: measure(model, opt)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
    return ddp, opt, lambda: measure(model, opt.optim)  # the state of this rank's shard


def zero_worker(
    rank: int, world_size: int, gpt_args: tuple, batch: int, repeats: int, warmup: int
) -> dict:
    """One rank: every set-up of :data:`SETUPS` in rounds; bytes held after a last step,
    and the last losses (equal across set-ups at the first step: a check, not a timing)."""
    # Stage 3's backward pre-hooks fire on the embeddings, whose inputs need no gradient.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, gpt_args[0], (batch, gpt_args[1]), generator=g)
    y = torch.randint(0, gpt_args[0], (batch, gpt_args[1]), generator=g)
    rows = batch // world_size
    x, y = x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
    setups = {name: make_setup(name, gpt_args, world_size) for name in SETUPS}
    first_loss = {}

    def trainer(name):
        model, opt, _ = setups[name]

        def step():
            opt.zero_grad(set_to_none=True)
            loss = lm_loss(model(x), y)
            loss.backward()
            opt.step()
            first_loss.setdefault(name, loss.item())

        return step

    steps = {name: trainer(name) for name in SETUPS}
    cpu: dict[str, list[float]] = {}
    times = world_compare(steps, repeats, warmup, cpu=cpu)
    held = {}
    for name, step in steps.items():
        step()
        held[name] = setups[name][2]()
    return {"times": times, "cpu": cpu, "held": held, "first_loss": first_loss}


@dataclass
class Row:
    name: str
    ms: float
    best_ms: float
    ratio: tuple[float, float, float]  # time / DDP's per round: q1, median, q3
    held: dict[str, int]
    cpu_ms: float = float("nan")  # the process's CPU time
    cpu_ratio: tuple[float, float, float] = (float("nan"),) * 3


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.zero", description=__doc__)
    parser.add_argument("--repeats", type=int, default=12, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--quick", action="store_true", help="a tiny GPT, no file")
    parser.add_argument("--out", type=Path, default=None, help="where the table goes")
    add_device_options(parser)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error(f"Invalid --repeats {args.repeats} or --warmup {args.warmup} (>= 1, >= 0)")
    if args.device != "cpu":
        parser.error(f"Invalid --device {args.device!r} (this benchmark runs on cpu, gloo)")
    return parser, args


def table(rows: list[Row], header: list[str], describe: str, n_params: int) -> str:
    out = ["# ZeRO stages against DDP: training-step time and bytes per rank", ""] + header
    out += [
        "",
        f"## {describe}",
        "",
        "ms: median [minimum] of the slower rank's wall-clock time of one training step "
        "(zero_grad, forward, backward, step), after a barrier. CPU ms: the same step's "
        "CPU time of the whole rank process (all threads, gloo's included; waits for the "
        "peer or for a core not counted), slower rank. × DDP: per-round ratio "
        "against DDP's step, median [IQR]. Bytes: held by rank 0 after a step (parameters, "
        "gradients, Adam's state), float32; B/param: per parameter of the model.",
        "",
        "| set-up | step ms | × DDP [IQR] | CPU ms | × DDP, CPU [IQR] | params MB | grads MB "
        "| optimizer state MB | total MB | optimizer state B/param | total B/param |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        q1, med, q3 = r.ratio
        mb = {k: r.held[k] / 1e6 for k in (*CATEGORIES, "total")}
        out.append(
            f"| {r.name} | {r.ms:.1f} [{r.best_ms:.1f}] | {med:.2f} [{q1:.2f}–{q3:.2f}] "
            f"| {r.cpu_ms:.1f} | {r.cpu_ratio[1]:.2f} [{r.cpu_ratio[0]:.2f}–{r.cpu_ratio[2]:.2f}] "
            f"| {mb['params']:.2f} | {mb['grads']:.2f} | {mb['optimizer_state']:.2f} "
            f"| {mb['total']:.2f} | {r.held['optimizer_state'] / n_params:.2f} "
            f"| {r.held['total'] / n_params:.2f} |"
        )
    out += ["", f"- load average at the end: {load_average()}", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> str:
    parser, args = parse_args(argv)
    size = "tiny" if args.quick else "cpu"
    if args.quick:
        args.repeats, args.warmup = 3, 1
    device, timer, header = device_setup(parser, args)
    gpt_args, batch = MODELS[size]
    n_params = sum(p.numel() for p in untied_gpt(*gpt_args).parameters())
    # The worker by its module's real name (run as a script, this module is __main__).
    from benchmarks.zero import zero_worker as worker

    per_rank = spawn(worker, WORLD, gpt_args, batch, args.repeats, args.warmup, timeout=600)
    result = per_rank[0]
    losses = result["first_loss"]
    if max(losses.values()) - min(losses.values()) > 1e-4 * abs(losses["DDP"]):
        raise AssertionError(f"the set-ups' first losses differ: {losses}")
    times, cpu = result["times"], result["cpu"]
    rows = []
    for name in SETUPS:
        ratio = quartiles([a / b for a, b in zip(times[name], times["DDP"], strict=True)])
        rows.append(
            Row(
                name,
                1e3 * statistics.median(times[name]),
                1e3 * min(times[name]),
                ratio,
                result["held"][name],
                1e3 * statistics.median(cpu[name]),
                quartiles([a / b for a, b in zip(cpu[name], cpu["DDP"], strict=True)]),
            )
        )
        log(
            f"  {name:<30} {rows[-1].ms:8.1f} ms  x DDP {ratio[1]:.2f}  CPU "
            f"{rows[-1].cpu_ms:8.1f} ms  x DDP {rows[-1].cpu_ratio[1]:.2f}  {rows[-1].held}"
        )
    vocab, block, layers, heads, dim = gpt_args
    describe = (
        f"GPT (untied), {layers} layers, dim {dim}, {heads} heads, vocab {vocab}, block "
        f"{block}: {n_params:,} parameters; world {WORLD} (gloo), global batch {batch} "
        f"sequences ({batch // WORLD} per rank), Adam"
    )
    header = header[:-1] + [
        "- clock: wall clock of the slower rank (communication waits count), and the CPU "
        "time of the rank's process",
        f"- timing: {args.warmup} untimed rounds, then {args.repeats} rounds of one step each",
    ]
    text = table(rows, header, describe, n_params)
    out = args.out or (None if args.quick else results_path(DEFAULT_OUT, device))
    write_report(text, out, log)
    return text


if __name__ == "__main__":
    main()
