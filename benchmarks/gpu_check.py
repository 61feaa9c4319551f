"""The check of a machine with a CUDA GPU: what a student meets in Colab, run on the GPU.

``make test-gpu`` (= ``python -m benchmarks.gpu_check``) runs four parts and writes one
report, ``benchmarks/results/cuda/gpu_check.md``:

- ``notebooks``: every lab and every chapter at the ``gpu`` profile on CUDA, with the dry
  run's synthetic data sets and caps (``tests/test_gpu_profile.py``: a lab must print
  "profile 'gpu' on cuda"; no cell may fail);
- ``tests``: the library's tests, their CUDA half included (the ``device`` fixture of
  ``tests/conftest.py`` adds ``cuda`` to every tensor test where CUDA is present); the
  toolchain's tests (the book, nbgrader, the browser, the Colab install) are not torch's
  and stay on the CPU machines;
- ``entry``: the entry point ``python -m lsdl_lab.run`` in one process on the GPU, in
  every parallel mode (DDP, ZeRO 1-3, FSDP2), in bf16 and fp16 (with the loss scaler),
  in the precision ``auto`` picks for the GPU, and with the compiled optimizer; then
  ``torchrun --standalone --nproc-per-node 2`` in every parallel mode, whose ranks
  :func:`lsdl_lab.distributed.placement` puts on the GPUs with NCCL when there is one per rank,
  else on the CPU with gloo: each run's first line must say so, and its loss must be
  finite;
- ``bench``: the optimizers on CUDA at 50M parameters (``benchmarks.compiled``: eager,
  compiled, torch's fused and foreach kernels, against the streaming bandwidth B*), alone
  on the GPU after the rest, its table in ``benchmarks/results/cuda/compiled.md``; on a
  GPU of compute capability 8.9 or later, FP8 products (``torch._scaled_mm``) against bf16
  ones (``benchmarks.fp8_matmul``, its table in ``benchmarks/results/cuda/fp8_matmul.md``).

The first three run side by side (the machine's cores shared between them), the benchmark
alone after them. Measured goal: at most 8 minutes on one H100-class GPU.

It needs the library's dependencies and the test tools beside the machine's torch
(``tests/gpu-requirements.txt``); ``make gpu-wheels`` downloads them as wheels for a GPU
machine without internet (``pip install --no-index --find-links .whl -r
tests/gpu-requirements.txt`` there).

Run from the repository root::

    python -m benchmarks.gpu_check                   # everything, on CUDA
    python -m benchmarks.gpu_check --parts entry     # one part
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks import ROOT, fp8_matmul
from benchmarks.timing import log, machine_lines, write_report

PARTS = ("notebooks", "tests", "entry", "bench")
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "cuda" / "gpu_check.md"
# The toolchain's tests: the book's build and browser, nbgrader, the Colab install and the
# pages' portability read the book's tools, not torch (as in `make test-floor`).
TOOLCHAIN = (
    "test_book.py",
    "test_labs_portable.py",
    "test_nbgrader.py",
    "test_nbgrader_later_labs.py",
    "test_colab_install.py",
)
MODES = ("ddp", "zero1", "zero2", "zero3", "fsdp2")
# The entry point's runs: small models of the cpu profile (its data sets ship with the
# library, so a machine without internet runs them), a few steps each.
BASE_ARGS = ["--profile", "cpu", "--steps", "6", "--global-batch", "32", "--log-every", "1"]
BASE_ARGS += ["--warmup-steps", "1", "--no-progress", "--timeout", "120"]


@dataclass
class Outcome:
    """One command of the check: what ran, how long, whether it passed, and what it said."""

    part: str
    name: str
    command: list[str]
    seconds: float
    returncode: int
    output: str
    problems: list[str] = field(default_factory=list)  # checks beyond the return code
    summary: str = ""

    @property
    def passed(self) -> bool:
        return self.returncode == 0 and not self.problems

    @property
    def status(self) -> str:
        if self.passed:
            return "passed"
        if self.returncode == -9:
            return "timed out"
        return f"failed ({self.returncode})" if self.returncode else "failed (checks)"


def run(part: str, name: str, command: list[str], timeout: float, env=None) -> Outcome:
    """Run ``command`` from the repository root, its output captured; killed at ``timeout``."""
    log(f"  {part}: {name}: {' '.join(command)}")
    start = time.perf_counter()
    try:
        done = subprocess.run(
            command,
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
        code, output = done.returncode, done.stdout
    except subprocess.TimeoutExpired as err:
        code, output = -9, err.stdout or ""
        output = output.decode(errors="replace") if isinstance(output, bytes) else output
    outcome = Outcome(part, name, command, time.perf_counter() - start, code, output)
    log(f"  {part}: {name}: {outcome.status} in {outcome.seconds:.0f} s")
    return outcome


def pytest_summary(output: str) -> str:
    """pytest's last line of counts ("12 passed, 2 skipped in 30.1s"), or ''."""
    lines = [line.strip("= ") for line in output.splitlines() if re.search(r" in [\d.]+s", line)]
    return lines[-1] if lines else ""


def workers(share: float) -> int:
    """pytest-xdist workers for a part that gets ``share`` of this machine's cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, int((cores or 1) * share))


def notebooks(timeout: float) -> list[Outcome]:
    command = [sys.executable, "-m", "pytest", "-n", str(workers(0.4)), "-p", "no:cacheprovider"]
    command += ["-rs", "-s", "tests/test_gpu_profile.py"]
    outcome = run("notebooks", "labs and chapters at gpu", command, timeout)
    outcome.summary = pytest_summary(outcome.output)
    ran = re.findall(r"^(\S+): dry run at gpu in ([\d.]+) s", outcome.output, re.M)
    outcome.summary += "; " + ", ".join(f"{name} {float(s):.0f} s" for name, s in ran)
    pages = len(list((ROOT / "labs").glob("lab*.ipynb")))
    pages += len(list((ROOT / "book").glob("ch*.md"))) if torch.cuda.is_available() else 0
    if len(ran) != pages:
        outcome.problems.append(f"{len(ran)} notebooks ran at gpu, not {pages}")
    return [outcome]


def tests(timeout: float) -> list[Outcome]:
    junit = Path(tempfile.mkdtemp(prefix="lsdl-gpu-check-")) / "tests.xml"
    command = [sys.executable, "-m", "pytest", "-n", str(workers(0.4)), "-p", "no:cacheprovider"]
    command += ["-m", "not notebook", "--ignore=tests/test_gpu_profile.py"]
    command += [f"--ignore=tests/{name}" for name in TOOLCHAIN]
    command += [f"--junit-xml={junit}", "tests"]
    outcome = run("tests", "the library's tests (cpu and cuda)", command, timeout)
    on_cuda = cuda_cases(junit) if junit.exists() else 0
    outcome.summary = f"{pytest_summary(outcome.output)}; {on_cuda} of them on cuda"
    if torch.cuda.is_available() and on_cuda == 0:
        outcome.problems.append("no test ran on cuda")
    return [outcome]


def cuda_cases(junit: Path) -> int:
    """The test cases of a JUnit XML report that ran with the ``cuda`` device parameter."""
    import xml.etree.ElementTree as ET

    cases = ET.parse(junit).getroot().iter("testcase")
    return sum(1 for c in cases if re.search(r"\[(.*-)?cuda(-.*)?\]", c.get("name", "")))


def entry_runs(world: int) -> list[tuple[str, list[str]]]:
    """(name, options) of the entry point's runs with ``world`` ranks."""
    runs = [(f"{mode}, mlp", ["--model", "mlp", "--parallel", mode]) for mode in MODES]
    if world == 1:
        gpt = ["--model", "gpt"]
        runs += [
            ("ddp, gpt, bf16", gpt + ["--parallel", "ddp", "--precision", "bf16"]),
            ("fsdp2, gpt, bf16", gpt + ["--parallel", "fsdp2", "--precision", "bf16"]),
            ("ddp, gpt, fp16 + loss scaler", gpt + ["--parallel", "ddp", "--precision", "fp16"]),
            (
                "zero2, gpt, fp16 + loss scaler",
                gpt + ["--parallel", "zero2", "--precision", "fp16"],
            ),
            ("ddp, gpt, compiled AdamW", gpt + ["--optimizer-args", '{"compile": true}']),
            ("ddp, gpt, precision auto", gpt + ["--parallel", "ddp", "--precision", "auto"]),
        ]
    return runs


def entry_command(world: int, options: list[str], out: Path) -> list[str]:
    if world == 1:
        head = [sys.executable, "-m", "lsdl_lab.run"]
    else:
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        head += ["--nproc-per-node", str(world), "-m", "lsdl_lab.run"]
    return head + BASE_ARGS + options + ["--out-dir", str(out)]


def check_entry(outcome: Outcome, world: int, out: Path) -> None:
    """The run's first line names the placement lsdl_lab.distributed.placement gives ``world``
    ranks here; its metrics end at the last step with a finite loss."""
    from lsdl_lab.distributed import placement

    where = placement("auto", world, 0)
    lines = outcome.output.splitlines()
    first = next((line for line in lines if line.startswith("lsdl_lab.run: world size")), "")
    if where.reason not in first:
        outcome.problems.append(f"first line {first!r} does not say {where.reason!r}")
    metrics = out / "metrics.jsonl"
    records = (
        [json.loads(line) for line in metrics.read_text().splitlines()]
        if (metrics.exists())
        else []
    )
    if not records or not math.isfinite(records[-1]["loss"]):
        outcome.problems.append(f"no finite loss in {metrics}")
    else:
        steps = [r["step_time_s"] for r in records[1:]] or [records[0]["step_time_s"]]
        outcome.summary = (
            f"{where.device} ({where.backend}); loss {records[0]['loss']:.3f} -> "
            f"{records[-1]['loss']:.3f}; {1e3 * sorted(steps)[len(steps) // 2]:.1f} ms/step"
        )


def entry(timeout: float) -> list[Outcome]:
    scratch = Path(tempfile.mkdtemp(prefix="lsdl-gpu-check-"))
    jobs = [
        (world, name, options, scratch / f"w{world}-{i}")
        for world in (1, 2)
        for i, (name, options) in enumerate(entry_runs(world))
    ]

    def one(job):
        world, name, options, out = job
        outcome = run(
            "entry", f"{world} rank(s): {name}", entry_command(world, options, out), timeout
        )
        check_entry(outcome, world, out)
        return outcome

    with concurrent.futures.ThreadPoolExecutor(max(1, workers(0.2))) as pool:
        return list(pool.map(one, jobs))


def bench(timeout: float) -> list[Outcome]:
    command = [sys.executable, "-m", "benchmarks.compiled", "--device", "cuda", "--sizes"]
    command += ["50M", "--no-labs", "--no-cache", "--rows-minutes", f"{timeout / 60 * 0.7:.1f}"]
    outcome = run("bench", "optimizers at 50M on cuda", command, timeout)
    outcome.summary = "table: benchmarks/results/cuda/compiled.md"
    outcomes = [outcome]
    if fp8_matmul.has_fp8_matmul(torch.device("cuda")):  # compute capability 8.9 or later
        command = [sys.executable, "-m", "benchmarks.fp8_matmul"]
        outcome = run("bench", "FP8 (torch._scaled_mm) against bf16 products", command, 120)
        outcome.summary = "table: benchmarks/results/cuda/fp8_matmul.md"
        outcomes.append(outcome)
    return outcomes


def report(outcomes: list[Outcome], head: list[str], seconds: float) -> str:
    lines = ["# The GPU check (`make test-gpu`)", "", *head, f"- run time: {seconds / 60:.1f} min"]
    lines += ["", "| part | what | status | seconds | result |", "|---|---|---|---:|---|"]
    for o in outcomes:
        summary = o.summary.replace("|", "/")
        lines.append(f"| {o.part} | {o.name} | {o.status} | {o.seconds:.0f} | {summary} |")
    failed = [o for o in outcomes if not o.passed]
    lines += ["", f"{len(outcomes) - len(failed)} of {len(outcomes)} passed."]
    for o in failed:
        lines += ["", f"## {o.part}: {o.name}: {o.status}", "", f"`{' '.join(o.command)}`", ""]
        lines += [f"- {problem}" for problem in o.problems]
        lines += ["", "```", *o.output.splitlines()[-40:], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"from {', '.join(PARTS)}")
    parser.add_argument("--minutes", type=float, default=4.0, help="limit of each part")
    parser.add_argument("--bench-minutes", type=float, default=3.0, help="limit of the bench")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--allow-cpu", action="store_true", help="run without CUDA (a rehearsal of the check)"
    )
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts or set(parts) - set(PARTS):
        parser.error(f"Invalid --parts {args.parts!r} (choose from {', '.join(PARTS)})")
    if not torch.cuda.is_available() and not args.allow_cpu:
        parser.error("no CUDA GPU here: this check is for a GPU machine (--allow-cpu rehearses it)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    start = time.perf_counter()
    limit = args.minutes * 60
    side_by_side = [globals()[p] for p in ("notebooks", "tests", "entry") if p in parts]
    with concurrent.futures.ThreadPoolExecutor(len(side_by_side) or 1) as pool:
        outcomes = [
            o for f in [pool.submit(part, limit) for part in side_by_side] for o in f.result()
        ]
    if "bench" in parts and device.type == "cuda":
        outcomes += bench(args.bench_minutes * 60)
    head = machine_lines(device)
    if device.type == "cuda":
        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        head.append(f"- bfloat16 arithmetic on this GPU: {'yes' if bf16 else 'no (emulated)'}")
    write_report(report(outcomes, head, time.perf_counter() - start), args.out, log)
    return 0 if all(o.passed for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
