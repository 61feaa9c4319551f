"""What the project itself costs to run: each lab, the test suite and the book build, timed.

Parts (``--only`` picks some of them, comma-separated):

- ``labs-smoke``, ``labs-cpu``: every ``labs/*.ipynb`` executed at that profile by
  nbclient (``jupyter execute``, as nbgrader and jupyter-book execute them; nothing is written
  back to the lab);
- ``tests``: what ``make test`` runs after the lint,
  ``LSDL_SCALE=smoke python -m pytest -n 2 --dist loadfile tests``;
- ``book``: ``jupyter-book build . -W --keep-going`` at the cpu profile, into a temporary
  folder (``--path-output``): the repository's ``_build`` is neither used nor touched, so
  every page is executed afresh.

Every command runs with one torch thread (``OMP_NUM_THREADS=1``, as the Makefile sets) and
without progress bars (``TQDM_DISABLE=1``). The table gives the wall-clock seconds of each
command, whether it passed, and the load average before and after it: on a shared machine
other processes' work lengthens every figure, so measure on a quiet machine.

Run from the repository root::

    python -m benchmarks.project_cost                     # everything: tens of minutes
    python -m benchmarks.project_cost --only labs-smoke --labs lab01
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks import ROOT
from benchmarks.timing import load_average, log, machine_lines, write_report

PARTS = ("labs-smoke", "labs-cpu", "tests", "book")
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "project_cost.md"
BIN = Path(sys.executable).parent  # the virtual environment's scripts, beside its python


@dataclass
class Timing:
    part: str
    item: str
    command: str
    seconds: float
    returncode: int
    load_before: str
    load_after: str
    tail: str = ""  # the end of the output when the command failed

    @property
    def status(self) -> str:
        if self.returncode == 0:
            return "passed"
        return "timed out" if self.returncode == -9 else f"failed ({self.returncode})"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(PARTS), help=f"from {', '.join(PARTS)}")
    parser.add_argument(
        "--labs",
        default="",
        help="only labs whose file name contains one "
        "of these comma-separated strings (default: every lab)",
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per command")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}")
    args = parser.parse_args(argv)
    args.parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown or not args.parts:
        parser.error(f"Invalid --only {args.only!r} (choose from {', '.join(PARTS)})")
    if not args.timeout > 0:
        parser.error(f"Invalid --timeout: {args.timeout} (expected > 0)")
    args.lab_filters = [s.strip() for s in args.labs.split(",") if s.strip()]
    return args


def select_labs(filters: list[str], root: Path = ROOT) -> list[Path]:
    """``labs/*.ipynb`` in name order; with ``filters``, those whose name contains one."""
    labs = sorted((root / "labs").glob("*.ipynb"))
    if filters:
        labs = [p for p in labs if any(f in p.name for f in filters)]
    return labs


def commands(parts: list[str], labs: list[Path], tmp: Path) -> list[tuple[str, str, list, dict]]:
    """(part, item, argv, extra environment) of every command to time, in order."""
    out = []
    for part in parts:
        if part.startswith("labs-"):
            profile = part.removeprefix("labs-")
            for lab in labs:
                # nbclient's runner: executes every cell, writes nothing back to the lab
                argv = [str(BIN / "jupyter"), "execute", "--timeout=-1", str(lab)]
                out.append((part, lab.stem, argv, {"LSDL_SCALE": profile}))
        elif part == "tests":
            argv = [
                str(BIN / "python"), "-m", "pytest", "-n", "2", "--dist", "loadfile",
                "tests",
            ]  # fmt: skip
            out.append((part, "make test (without lint)", argv, {"LSDL_SCALE": "smoke"}))
        elif part == "book":
            argv = [
                str(BIN / "jupyter-book"), "build", ".", "-W", "--keep-going",
                "--path-output", str(tmp / "book"),
            ]  # fmt: skip
            out.append((part, "jupyter-book build", argv, {"LSDL_SCALE": "cpu"}))
    return out


def run_timed(part, item, argv, env, timeout, clock: Callable[[], float] = time.perf_counter):
    """Run ``argv`` in the repository root with one torch thread; its wall-clock time."""
    full_env = {
        **os.environ,
        # jupyter finds its subcommands (jupyter-nbconvert) on PATH: the environment's first
        "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")]),
        "OMP_NUM_THREADS": "1",
        "TQDM_DISABLE": "1",
        "PYDEVD_DISABLE_FILE_VALIDATION": "1",
        **env,
    }
    before = load_average()
    t0 = clock()
    try:
        done = subprocess.run(
            argv, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout
        )
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        code, output = -9, str(e)
    seconds = clock() - t0
    shown = " ".join(
        [f"{k}={v}" for k, v in env.items()] + [Path(argv[0]).name, *argv[1:]]
    ).replace(str(ROOT) + "/", "")
    tail = "" if code == 0 else "\n".join(output.strip().splitlines()[-5:])
    return Timing(part, item, shown, seconds, code, before, load_average(), tail)


def table(timings: list[Timing], head: list[str]) -> str:
    """The Markdown report: the machine, one row per command, and the total per part."""
    out = ["# What the project costs to run", "", *head, ""]
    out += [
        "Wall-clock seconds of each command (one torch thread, no progress bars); load "
        "average (1 minute) before → after it. Other processes' work lengthens every figure.",
        "",
        "| part | item | seconds | status | load before → after |",
        "|---|---|---:|---|---|",
    ]
    for t in timings:
        before, after = t.load_before.split(",")[0], t.load_after.split(",")[0]
        out.append(f"| {t.part} | {t.item} | {t.seconds:.1f} | {t.status} | {before} → {after} |")
    parts = list(dict.fromkeys(t.part for t in timings))
    if parts:
        out += ["", "| part | total seconds | commands | failed |", "|---|---:|---:|---:|"]
        for part in parts:
            mine = [t for t in timings if t.part == part]
            failed = sum(t.returncode != 0 for t in mine)
            out.append(f"| {part} | {sum(t.seconds for t in mine):.1f} | {len(mine)} | {failed} |")
    out += ["", "Commands:", ""] + [f"- `{t.command}`" for t in timings]
    for t in timings:
        if t.tail:
            out += ["", f"{t.part} {t.item} ({t.status}), last lines:", "", "```", t.tail, "```"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    labs = select_labs(args.lab_filters)
    if any(p.startswith("labs-") for p in args.parts) and not labs:
        raise SystemExit(f"no lab matches --labs {args.labs!r}")
    head = machine_lines("cpu")
    timings = []
    with tempfile.TemporaryDirectory(prefix="lsdl-cost-") as tmp:
        for part, item, cmd, env in commands(args.parts, labs, Path(tmp)):
            log(f"{part}: {item} ...")
            timings.append(run_timed(part, item, cmd, env, args.timeout))
            t = timings[-1]
            log(f"  {t.seconds:.1f} s, {t.status}")
    head.append(f"- load average at end: {load_average()}")
    text = table(timings, head)
    write_report(text, args.out, log)
    return text


if __name__ == "__main__":
    main()
