"""FP8 matrix multiplies against bfloat16 on a CUDA GPU: the speed that FP8 training is for.

Chapter 8 emulates FP8 on the CPU (:mod:`lsdl_lab.memory.fp8`: the casts, their scales, the
error they make) and makes no speed claim there. The speed is the GPU's: from compute
capability 8.9 (Ada, Hopper) the tensor cores multiply FP8 operands at twice their bf16
rate (Micikevicius et al. 2022). This benchmark times one product
:math:`C = (A_8 / s_A)(B_8 / s_B)`, its operands cast by the library
(``quantize_fp8(x, "e4m3", "tensor")``: per-tensor current scaling), against the same
product in bf16, at square sizes, and reports the ratio, each one's TFLOP/s (2mnk
operations a product) and the FP8 product's error against the bf16 one.

torch has no public FP8 matrix multiply: ``torch._scaled_mm`` is the one torchao's float8
training calls, and the one this benchmark times (a private API, used here because the
issue that asked for this row named it and nothing public does the work;
``tests/test_benchmarks_fp8.py`` calls it on the CPU, where torch has a reference kernel,
and fails loudly if its signature or meaning changes). It wants ``A`` row-major, ``B``
column-major, dimensions multiples of 16, and the *inverse* scales (the factors that turn
the FP8 values back into the originals), float32 0-d tensors.

On a GPU below 8.9 or without CUDA it refuses (``--allow-cpu`` rehearses it on the CPU at
small sizes: the numbers are then a reference kernel's, not a speed). ``make test-gpu``
runs it after the other benchmarks on a GPU that has FP8.

Run from the repository root::

    python -m benchmarks.fp8_matmul                       # CUDA, 8.9 or later
    python -m benchmarks.fp8_matmul --allow-cpu --sizes 64,128
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import ROOT
from benchmarks.timing import compare, device_timer, log, machine_lines, write_report
from lsdl_lab.memory.fp8 import quantize_fp8

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "cuda" / "fp8_matmul.md"
DEFAULT_SIZES = (2048, 4096, 8192)
FP8_CAPABILITY = (8, 9)


def has_fp8_matmul(device: torch.device) -> bool:
    """Whether ``device`` multiplies FP8 in hardware: CUDA of compute capability >= 8.9."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_CAPABILITY


@dataclass(frozen=True)
class Operands:
    """One product's operands: bf16 ``a`` (m x k) and ``b`` (k x n), and their FP8 casts
    with the inverse scales ``_scaled_mm`` takes (``b8`` column-major)."""

    a: torch.Tensor
    b: torch.Tensor
    a8: torch.Tensor
    b8: torch.Tensor
    inv_a: torch.Tensor
    inv_b: torch.Tensor


def operands(m: int, k: int, n: int, device: torch.device, seed: int = 0) -> Operands:
    """Random operands of a product of ``m x k`` by ``k x n``, each a multiple of 16."""
    for name, value in (("m", m), ("k", k), ("n", n)):
        if not isinstance(value, int) or value < 16 or value % 16:
            raise ValueError(f"Invalid {name}: {value!r} (expected a multiple of 16, >= 16)")
    g = torch.Generator(device="cpu").manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
    b = torch.randn(n, k, generator=g).to(device, torch.bfloat16).t()  # column-major k x n
    ca, cb = quantize_fp8(a, "e4m3", "tensor"), quantize_fp8(b.t(), "e4m3", "tensor")
    return Operands(a, b, ca.data, cb.data.t(), 1 / ca.scale, 1 / cb.scale)


def fp8_product(x: Operands) -> torch.Tensor:
    """:math:`(A_8 s_A^{-1})(B_8 s_B^{-1})` in bf16, by the GPU's FP8 multiply."""
    return torch._scaled_mm(x.a8, x.b8, scale_a=x.inv_a, scale_b=x.inv_b, out_dtype=torch.bfloat16)


def bf16_product(x: Operands) -> torch.Tensor:
    return x.a @ x.b


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """:math:`\\|C_8 - C\\|_F / \\|C\\|_F`, in float32."""
    approx, exact = approx.float(), exact.float()
    return ((approx - exact).norm() / exact.norm()).item()


@dataclass(frozen=True)
class Row:
    size: int
    bf16_ms: float
    fp8_ms: float
    error: float

    @property
    def speedup(self) -> float:
        return self.bf16_ms / self.fp8_ms

    def tflops(self, ms: float) -> float:
        return 2 * self.size**3 / (ms * 1e-3) / 1e12


def measure(size: int, device: torch.device, repeats: int) -> Row:
    """The median time of each product over ``repeats`` interleaved rounds, and the error."""
    x = operands(size, size, size, device)
    error = relative_error(fp8_product(x), bf16_product(x))
    timed = compare(
        {"bf16": lambda: bf16_product(x), "fp8": lambda: fp8_product(x)},
        repeats,
        warmup=3,
        timer=device_timer(device),
    )
    ms = {name: 1e3 * statistics.median(t) for name, t in timed.times.items()}
    return Row(size, ms["bf16"], ms["fp8"], error)


def report(rows: list[Row], head: list[str], device: torch.device) -> str:
    lines = ["# FP8 against bf16 matrix multiplies (`benchmarks/fp8_matmul.py`)", "", *head]
    if not has_fp8_matmul(device):
        lines.append("- a rehearsal without an FP8 GPU: times of a reference kernel, no speed")
    lines += ["", "Square products m = n = k; the median of interleaved rounds; error of the FP8"]
    lines += ["product (e4m3, per-tensor current scaling) against the bf16 product.", ""]
    lines += ["| size | bf16 ms | FP8 ms | FP8 / bf16 speed | bf16 TFLOP/s | FP8 TFLOP/s | error |"]
    lines += ["|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r.size} | {r.bf16_ms:.3f} | {r.fp8_ms:.3f} | {r.speedup:.2f} | "
            f"{r.tflops(r.bf16_ms):.1f} | {r.tflops(r.fp8_ms):.1f} | {r.error:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--allow-cpu", action="store_true", help="rehearse without an FP8 GPU (no speed)"
    )
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not has_fp8_matmul(device) and not args.allow_cpu:
        parser.error(
            f"no FP8 GPU here ({device}): FP8 products need CUDA of compute capability "
            f">= {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} (--allow-cpu rehearses it)"
        )
    if not has_fp8_matmul(device):
        device = torch.device("cpu")
    if args.repeats < 1:
        parser.error(f"Invalid --repeats: {args.repeats} (expected >= 1)")
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        parser.error(f"Invalid --sizes: {args.sizes!r} (expected integers, comma-separated)")
    rows = []
    for size in sizes:
        rows.append(measure(size, device, args.repeats))
        log(f"size {size}: FP8 {rows[-1].speedup:.2f}x bf16, error {rows[-1].error:.3f}")
    write_report(report(rows, machine_lines(device), device), args.out, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
