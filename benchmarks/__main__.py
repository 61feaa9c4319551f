"""Every benchmark, one after the other: ``python -m benchmarks`` from the repository root.

``--only`` picks some (comma-separated, in this order): ``bandwidth`` (the hardware limit
of an optimizer step, ``benchmarks/bandwidth.py``), ``hessian`` (the Hessian probes against
PyHessian), ``optimizers`` (step times against torch.optim, LARS and LAMB against their
references), ``communication`` (the hand-built ring and tree all-reduce against
``dist.all_reduce``, the compressors against torch's DDP hooks), ``zero`` (ZeRO's stages
against DDP, ZeroRedundancyOptimizer and FSDP2 at world 2), ``second-order`` (K-FAC and
Shampoo beside Adam and pytorch-optimizer's Shampoo), ``compiled`` (every optimizer's
``compile=True`` path against eager, torch's fused kernels, pytorch-optimizer and the
bandwidth roof, the labs' verdict and the compile cache: about half an hour, most of it
compiling, so not in the default set) and ``project-cost`` (each lab, the tests and the
book build, timed: tens of minutes, not in the default set either). Each
writes its table to ``benchmarks/results/``; ``--quick`` runs each on a tiny model and
writes nothing (a test that everything runs);
``--full`` gives each more time and sizes (:data:`FULL`): steadier ratios, about three
times as long.
"""

from __future__ import annotations

import argparse
import time

BENCHMARKS = (
    "bandwidth",
    "hessian",
    "optimizers",
    "communication",
    "zero",
    "second-order",
    "compiled",
    "project-cost",
)
DEFAULT = "bandwidth,hessian,optimizers,communication,zero,second-order"
# --full: three times the timed pairs per optimizer row, both large models for bandwidth,
# and the larger ResNet for the Hessian probes.
FULL = {
    "bandwidth": ["--sizes", "10M,50M", "--budget", "4"],
    "hessian": ["--cases", "mlp,resnet8,resnet8x4,resnet14"],
    "optimizers": ["--budget", "6", "--warmup", "3"],
    "communication": [
        "--sizes",
        "1e5,3e5,1e6,3e6,1e7",
        "--repeats",
        "60",
        "--codec-repeats",
        "100",
    ],
    "zero": ["--repeats", "60"],
    "second-order": ["--rounds", "100"],
    "compiled": ["--budget", "6"],
    "project-cost": [],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--only", default=DEFAULT, help=f"from {', '.join(BENCHMARKS)}")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="tiny sizes, no files: a test")
    mode.add_argument("--full", action="store_true", help="more sizes and time per figure")
    args = parser.parse_args(argv)
    args.names = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in args.names if s not in BENCHMARKS]
    if unknown or not args.names:
        parser.error(f"Invalid --only {args.only!r} (choose from {', '.join(BENCHMARKS)})")
    if args.quick and "project-cost" in args.names:
        parser.error("Invalid --quick with project-cost (it runs the real labs and build)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from benchmarks import (
        bandwidth,
        communication,
        compiled,
        hessian,
        optimizers,
        project_cost,
        second_order,
        zero,
    )
    from benchmarks.timing import log

    mains = {
        "bandwidth": bandwidth.main,
        "hessian": hessian.main,
        "optimizers": optimizers.main,
        "communication": communication.main,
        "zero": zero.main,
        "second-order": second_order.main,
        "compiled": compiled.main,
        "project-cost": project_cost.main,
    }
    for name in [n for n in BENCHMARKS if n in args.names]:
        log(f"== {name}")
        t0 = time.perf_counter()
        mains[name](["--quick"] if args.quick else FULL[name] if args.full else [])
        log(f"== {name}: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
