"""What every lab costs at the ``gpu`` profile on a Colab T4, from counted FLOPs.

No T4 is at hand, so the estimate is arithmetic, stated so that anyone can check it:

* **FLOPs per step, counted**: ``torch.utils.flop_counter.FlopCounterMode`` over one
  training step (forward, loss, backward) or one forward pass of the lab's own model at
  the ``gpu`` profile's sizes (ResNet-20 of width 16 on 3x32x32 images; the six-layer GPT
  of width 384 on windows of 256 characters), built on the ``meta`` device (shapes only,
  so counting takes seconds). The counter counts matrix products and convolutions (what
  dominates); elementwise work (BatchNorm, softmax, the optimizer's update) is left out.
* **Steps, from the labs**: each lab's loops at ``gpu``, uncapped, with the sizes read
  from the notebook itself (the ``gpu=`` value of ``P.pick`` in the named assignment,
  :func:`gpu_pick`), so a lab that changes its sizes changes this table; the test
  (``tests/test_colab_cost.py``) recomputes it and fails when the committed file differs.
* **Throughput, stated**: the T4's peak is 8.1 TFLOP/s in float32 and 65 TFLOP/s in
  float16 on its tensor cores (NVIDIA T4 datasheet). The labs train in float32. A model
  reaches a fraction of peak, its model-FLOPs utilization (Chowdhery et al., 2022, PaLM,
  Appendix B): we take **35%** for the GPT, whose work is matrix products of width 384 to
  1536 (large enough for cuBLAS's float32 kernels; attention and LayerNorm are
  memory-bound), and **15%** for ResNet-20, whose convolutions have only 16 to 64
  channels on maps of 32x32 to 8x8 (too narrow to fill the GPU; BatchNorm and ReLU are
  memory-bound). On top, **5 ms per optimizer step** for kernel launches and Python (a
  ResNet-20 step launches some 500 kernels at about 10 microseconds each).
* Work that a lab runs on the CPU (worlds of processes speaking gloo: Lab 7, and Lab 8's
  ZeRO world and activation checkpointing on the CPU) is not a T4's: it is listed apart,
  at a stated 20 GFLOP/s for Colab's two virtual CPUs (one torch thread per process; a
  GPT step of 10.7M parameters measured 15 GFLOP/s on this project's loaded 2-core
  machine), and Lab 7's communication-bound runs, whose time FLOPs do not predict, are
  not estimated (marked so).

Run from the repository root: ``python -m benchmarks.colab_cost`` (seconds) writes
``benchmarks/results/colab_cost.md``.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from functools import cache

import nbformat
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import ROOT
from lsdl_lab import models
from lsdl_lab.profiles import PROFILES

P = PROFILES["gpu"]
LABS = ROOT / "labs"
RESULT = ROOT / "benchmarks" / "results" / "colab_cost.md"
T4_PEAK = {"fp32": 8.1e12, "fp16": 65e12}  # FLOP/s, NVIDIA T4 datasheet
EFFICIENCY = {"gpt": 0.35, "resnet": 0.15}  # model-FLOPs utilization, see the docstring
STEP_OVERHEAD_S = 0.005  # launches and Python per optimizer step
CPU_FLOPS = 20e9  # Colab's two virtual CPUs, one torch thread per process
LIMIT_S = 600.0  # what a lab may cost at gpu
# The one measurement at hand (issue 26, 2026-11-26): the labs at gpu, uncapped, on the
# synthetic data sets of the dry run, on one NVIDIA H100 (torch 2.11+cu130) with six labs
# running at once on it, so each slower than alone; None: not finished after 250 s.
H100_PEAK_FP32 = 67e12  # FLOP/s, NVIDIA H100 SXM datasheet (non-tensor float32)
H100_MEASURED_S = {
    "lab01": 106.0,
    "lab02": 238.0,
    "lab03": 186.0,
    "lab04a": 107.0,
    "lab04b": 126.0,
    "lab06": None,
}
H100_LONGEST = 250.0
CIFAR_TRAIN, CIFAR_TEST, CLASSES = 50_000, 10_000, 10
VOCAB = 65  # Tiny Shakespeare's characters


# --- FLOPs, counted --------------------------------------------------------------------------


def _count(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@cache
def _model(name: str, depth: int | None = None, layers: int | None = None) -> torch.nn.Module:
    with torch.device("meta"):
        if name == "resnet":
            return models.ResNet(depth or P.resnet_depth, P.resnet_width, CLASSES, 3)
        return models.GPT(VOCAB, P.block_size, layers or P.gpt_layers, P.gpt_heads, P.gpt_dim)


def flops_per_example(name: str, train: bool, depth: int | None = None) -> float:
    """FLOPs of one example (an image; a window of ``block_size`` characters) through the
    lab's model: a training step's forward and backward, or a forward pass alone. ``depth``:
    a ResNet's, when not the profile's."""
    if name != "resnet" or depth == P.resnet_depth:
        depth = None  # one count per model
    return _flops(name, train, depth)


@cache
def _flops(name: str, train: bool, depth: int | None) -> float:
    model, batch = _model(name, depth), 8
    if name == "resnet":
        x = torch.empty(batch, 3, 32, 32, device="meta")
        y = torch.zeros(batch, dtype=torch.long, device="meta")
    else:
        x = torch.zeros(batch, P.block_size, dtype=torch.long, device="meta")
        y = x

    def step():
        out = model(x)
        loss = F.cross_entropy(out.flatten(0, -2), y.flatten())
        if train:
            loss.backward()

    if train:
        return _count(step) / batch
    with torch.no_grad():
        return _count(step) / batch


# --- the labs' sizes, read from the notebooks -------------------------------------------------


@cache
def _cells(lab: str) -> list[ast.Module]:
    (path,) = LABS.glob(f"{lab}_*.ipynb")
    nb = nbformat.read(path, as_version=4)
    return [ast.parse(c.source) for c in nb.cells if c.cell_type == "code"]


def gpu_pick(lab: str, name: str):
    """The ``gpu=`` value of the first ``P.pick(...)`` in the assignment to ``name`` in the
    lab (``Lab 3``'s ``gpt_steps = P.pick(smoke=30, cpu=100, gpu=300)`` gives 300), evaluated
    with the ``gpu`` profile as ``P``."""
    for tree in _cells(lab):
        for node in ast.walk(tree):
            targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
            if not isinstance(node, ast.Assign | ast.AnnAssign) or not any(
                isinstance(t, ast.Name) and t.id == name for t in targets
            ):
                continue
            for call in ast.walk(node.value):
                if (
                    isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Attribute)
                    and call.func.attr == "pick"
                ):
                    (value,) = [k.value for k in call.keywords if k.arg == "gpu"]
                    return eval(compile(ast.Expression(value), lab, "eval"), {"P": P})  # noqa: S307
    raise LookupError(f"{lab}: no assignment `{name} = ... P.pick(..., gpu=...)`")


def literal(lab: str, name: str):
    """The literal assigned to ``name`` in the lab (``L = 16`` gives 16)."""
    for tree in _cells(lab):
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets
            ):
                return ast.literal_eval(node.value)
    raise LookupError(f"{lab}: no literal assigned to `{name}`")


def dict_len(lab: str, name: str) -> int:
    """The number of entries of the dict literal assigned to ``name`` in the lab."""
    for tree in _cells(lab):
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
                and isinstance(node.value, ast.Dict)
            ):
                return len(node.value.keys)
    raise LookupError(f"{lab}: no dict literal assigned to `{name}`")


# --- work ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Work:
    """``examples`` examples through ``model`` (training steps, or forward passes), in
    ``steps`` optimizer steps, on the T4 or on the CPU."""

    what: str
    model: str  # "resnet" or "gpt"
    examples: float
    steps: int = 0
    train: bool = True
    factor: float = 1.0  # a step's cost in training steps (SAM: 2; a Hessian product: 2)
    depth: int | None = None
    cpu: bool = False
    each: float | None = None  # FLOPs of an example of a model that is neither: given

    @property
    def flops(self) -> float:
        if self.each is not None:
            return self.factor * self.examples * self.each
        return self.factor * self.examples * flops_per_example(self.model, self.train, self.depth)

    @property
    def seconds(self) -> float:
        return self.seconds_at(T4_PEAK["fp32"])

    def seconds_at(self, peak: float) -> float:
        """The model's time on a GPU of float32 ``peak`` FLOP/s (the CPU's part as it is)."""
        if self.cpu:
            return self.flops / CPU_FLOPS
        return self.flops / (peak * EFFICIENCY[self.model]) + self.steps * STEP_OVERHEAD_S


def epochs_of(batch: int, epochs: int, drop_last: bool = True) -> int:
    """Optimizer steps of ``epochs`` passes over CIFAR-10's training set."""
    per_epoch = CIFAR_TRAIN // batch if drop_last else math.ceil(CIFAR_TRAIN / batch)
    return epochs * per_epoch


def lab01() -> list[Work]:
    steps = epochs_of(P.batch_size, P.epochs)
    repeats = gpu_pick("lab01", "repeats") + 2
    return [
        Work("training, 30 epochs", "resnet", steps * P.batch_size, steps),
        Work("step timing", "resnet", repeats * P.batch_size, repeats),
        Work("test set, each epoch and after", "resnet", (P.epochs + 1) * CIFAR_TEST, train=False),
    ]


def lab02() -> list[Work]:
    n = gpu_pick("lab02", "n_measured")
    draws, at_least = gpu_pick("lab02", "draws"), gpu_pick("lab02", "examples")
    sizes = [2**k for k in range(math.ceil(math.log2(n)))] + [n]
    sampled = sum(max(draws, at_least // b) * b for b in sizes)
    calls = sum(max(draws, at_least // b) for b in sizes)
    epochs = gpu_pick("lab02", "epochs")
    steps = epochs_of(P.batch_size, epochs)
    return [
        # two points (initial, trained), each: per-example gradients of the n examples, then
        # sampled mini-batch gradients with and without replacement
        Work("gradient noise, 2 points", "resnet", 2 * (n + 2 * sampled), 2 * 2 * calls),
        Work(f"training, {epochs} epochs", "resnet", steps * P.batch_size, steps),
        Work("test set, each epoch", "resnet", epochs * CIFAR_TEST, train=False),
        Work("exercise: 256 per-example gradients, twice", "resnet", 2 * 256),
    ]


def lab03() -> list[Work]:
    n_opt, sweeps = dict_len("lab03", "OPTIMIZERS"), 3
    resnet = gpu_pick("lab03", "resnet_steps") * (CIFAR_TRAIN // P.batch_size)
    gpt, gpt_batch = gpu_pick("lab03", "gpt_steps"), gpu_pick("lab03", "gpt_batch")
    r_steps = n_opt * (sweeps * (resnet // 3) + resnet)
    g_steps = n_opt * (sweeps * (gpt // 3) + gpt)
    return [
        Work(
            f"ResNet race: {n_opt} optimizers x 3 sweeps + a run",
            "resnet",
            r_steps * P.batch_size,
            r_steps,
        ),
        Work("ResNet race: test set per final run", "resnet", n_opt * CIFAR_TEST, train=False),
        Work(
            f"GPT race: {n_opt} optimizers x 3 sweeps + a run", "gpt", g_steps * gpt_batch, g_steps
        ),
        Work(
            "GPT race: validation per final run",
            "gpt",
            n_opt * P.eval_batches * gpt_batch,
            train=False,
        ),
    ]


def lab04a() -> list[Work]:
    sizes, epochs = gpu_pick("lab04a", "batch_sizes"), gpu_pick("lab04a", "EPOCHS")
    depth = gpu_pick("lab04a", "DEPTH")
    runs = [sizes[0]] + [b for b in sizes[1:] for _ in range(3)]  # three policies above B0
    steps = sum(epochs_of(b, epochs, drop_last=False) for b in runs)
    noise = gpu_pick("lab04a", "noise_set")
    return [
        Work(
            f"{len(runs)} runs of {epochs} epochs",
            "resnet",
            len(runs) * epochs * CIFAR_TRAIN,
            steps,
            depth=depth,
        ),
        Work(
            "test set and 10,000 training images per run",
            "resnet",
            len(runs) * 2 * CIFAR_TEST,
            train=False,
            depth=depth,
        ),
        Work("gradient noise, twice", "resnet", 2 * noise, depth=depth),
    ]


def lab04b() -> list[Work]:
    gpt, gpt_batch = gpu_pick("lab04b", "gpt_steps"), gpu_pick("lab04b", "gpt_batch")
    gpt_eval = gpu_pick("lab04b", "text_val")
    image_batch = gpu_pick("lab04b", "image_batch")
    resnet = gpu_pick("lab04b", "resnet_steps") * (CIFAR_TRAIN // image_batch)
    runs, evals = 2 * 3, 8 + 1  # two optimizers x three rates; eval every steps // 8
    return [
        Work(f"GPT sweep: {runs} runs", "gpt", runs * gpt * gpt_batch, runs * gpt),
        Work(
            "GPT: validation 9 times a run", "gpt", runs * evals * gpt_eval * gpt_batch, train=False
        ),
        Work(f"ResNet sweep: {runs} runs", "resnet", runs * resnet * image_batch, runs * resnet),
        Work("ResNet: test set 9 times a run", "resnet", runs * evals * CIFAR_TEST, train=False),
    ]


def lab05() -> list[Work]:
    n = gpu_pick("lab05", "images") or CIFAR_TRAIN
    small, large = gpu_pick("lab05", "small_batch"), gpu_pick("lab05", "large_batch")
    max_epochs = gpu_pick("lab05", "max_epochs")
    depth = gpu_pick("lab05", "depth")
    probe, eval_batches = gpu_pick("lab05", "probe_set"), gpu_pick("lab05", "train_eval")
    train_eval = eval_batches * 1024
    power = gpu_pick("lab05", "power_iters")
    try:
        trace = gpu_pick("lab05", "trace_products")  # XTrace's products
    except LookupError:  # Hutchinson's draws serve the trace too
        trace = gpu_pick("lab05", "trace_samples")
    hvps = power + gpu_pick("lab05", "lanczos_steps") + trace
    # three networks probed; the ghost run's power iteration; the exercises' 2 x power
    # iterations and Hutchinson's draws
    products = 3 * hvps + power + 2 * power + gpu_pick("lab05", "trace_samples")
    grid, alphas = gpu_pick("lab05", "grid"), gpu_pick("lab05", "alphas")
    # Each run stops at the target or after max_epochs passes; the bound is what is costed.
    run = max_epochs * n
    checks = 2 * max_epochs  # a look at the training loss twice an epoch
    return [
        Work(
            f"small batch ({small}): at most {max_epochs} epochs",
            "resnet",
            run,
            run // small,
            depth=depth,
        ),
        Work(
            f"large batch ({large}), ghost batches: at most {max_epochs} epochs each",
            "resnet",
            2 * run,
            2 * run // large,
            depth=depth,
        ),
        Work(
            f"large batch + SAM: at most {max_epochs} epochs, 2 passes a step",
            "resnet",
            run,
            run // large,
            factor=2,
            depth=depth,
        ),
        Work(
            "training-loss checks of the four runs",
            "resnet",
            4 * checks * train_eval,
            train=False,
            depth=depth,
        ),
        Work(
            f"Hessian-vector products: {products} on {probe} images",
            "resnet",
            products * probe,
            factor=2,
            depth=depth,
        ),
        Work(
            f"line ({alphas} points) and planes (2 x {grid}^2)",
            "resnet",
            alphas * (2 * train_eval + CIFAR_TEST) + 2 * grid**2 * probe,
            train=False,
            depth=depth,
        ),
    ]


def lab06() -> list[Work]:
    steps, n_opt = gpu_pick("lab06", "STEPS"), dict_len("lab06", "OPTIMIZERS")
    every = gpu_pick("lab06", "EVAL_EVERY")
    gpt_work = []
    try:
        gpt_steps, gpt_every = gpu_pick("lab06", "GPT_STEPS"), gpu_pick("lab06", "GPT_EVAL_EVERY")
    except LookupError:  # a lab without the GPT race
        gpt_steps = 0
    if gpt_steps:
        gpt_opt = dict_len("lab06", "GPT_OPTIMIZERS")
        gpt_work = [
            # 16 windows a step; K-FAC's and Shampoo's extra work counted as above (their
            # eigendecompositions, which the counter does not count, are left out)
            Work(f"GPT race: {gpt_opt} optimizers", "gpt", (gpt_opt + 2) * gpt_steps * 16,
                 gpt_opt * gpt_steps),
            Work("GPT probe loss (32 windows) every few steps", "gpt",
                 gpt_opt * (gpt_steps // gpt_every) * 32, train=False),
        ]  # fmt: skip
    return gpt_work + [
        # K-FAC's extra backward (sampled labels) and Shampoo's statistics: counted as a
        # second training step for each of the two, a bound
        Work(
            f"ResNet race: {n_opt} optimizers",
            "resnet",
            (n_opt + 2) * steps * P.batch_size,
            n_opt * steps,
        ),
        Work(
            "probe loss (512 images) every few steps",
            "resnet",
            n_opt * (steps // every) * 512,
            train=False,
        ),
    ]


def lab08() -> list[Work]:
    steps, batch = gpu_pick("lab08", "STEPS"), gpu_pick("lab08", "BATCH")
    n_opt = dict_len("lab08", "OPTIMIZERS")
    layers, sequences = literal("lab08", "L"), gpu_pick("lab08", "tokens")
    width, rows = gpu_pick("lab08", "chain"), 8 * P.block_size
    # a tanh chain's example: 2 w^2 FLOPs a layer forward; forward, backward and at most one
    # recomputation: 4 times that
    chain_each = 4 * 2 * width**2 * layers
    return [
        Work(
            f"GPT: {n_opt} optimizers x {steps} steps", "gpt", n_opt * steps * batch, n_opt * steps
        ),
        # on the CPU: ZeRO stages 1-3 (one step of the batch, split over a world of 2) and
        # the checkpointing sweep of an L-layer GPT (6 settings, recomputation at most 2x)
        Work("CPU: ZeRO world, 3 stages x 1 step", "gpt", 3 * batch, cpu=True),
        Work(
            f"CPU: checkpointing sweep, tanh chain of {layers} x {width}, 6 settings",
            "chain",
            6 * rows,
            cpu=True,
            each=chain_each,
        ),
        Work(
            f"CPU: checkpointing sweep, {layers} layers, {sequences} sequences, 6 settings",
            "gpt",
            6 * 2 * sequences * layers / P.gpt_layers,
            cpu=True,
        ),
    ]


COSTED = {
    "lab01": lab01,
    "lab02": lab02,
    "lab03": lab03,
    "lab04a": lab04a,
    "lab04b": lab04b,
    "lab05": lab05,
    "lab06": lab06,
    "lab08": lab08,
}
# Labs whose work FLOPs do not predict, with the reason.
_WORLDS = (
    "worlds of processes on the CPU (gloo) at every profile: bound by communication and "
    "process start-up, which FLOPs do not predict"
)
NOT_COSTED = {"lab07": _WORLDS, "lab09": _WORLDS, "lab10": _WORLDS}


def estimate() -> dict[str, list[Work]]:
    return {lab: fn() for lab, fn in COSTED.items()}


def table(works: dict[str, list[Work]]) -> str:
    lines = [
        "| lab | work | TFLOP | on | minutes |",
        "|---|---|---:|---|---:|",
    ]
    for lab, items in works.items():
        for w in items:
            lines.append(
                f"| {lab} | {w.what} | {w.flops / 1e12:,.1f} | {'CPU' if w.cpu else 'T4'} "
                f"| {w.seconds / 60:.1f} |"
            )
    lines += ["", "| lab | minutes at gpu on a Colab T4 | within 10 |", "|---|---:|---|"]
    for lab, items in works.items():
        total = sum(w.seconds for w in items) / 60
        lines.append(f"| {lab} | {total:.1f} | {'yes' if total <= LIMIT_S / 60 else 'NO'} |")
    for lab, why in NOT_COSTED.items():
        lines.append(f"| {lab} | not estimated: {why} | |")
    return "\n".join(lines)


def against_h100(works: dict[str, list[Work]]) -> str:
    """The model's prediction for an H100, beside the measurement of issue 26."""
    lines = [
        "| lab | predicted alone (s) | of which 5 ms a step | measured, six at once (s) |"
        " measured / predicted |",
        "|---|---:|---:|---:|---:|",
    ]
    for lab, measured in H100_MEASURED_S.items():
        predicted = sum(w.seconds_at(H100_PEAK_FP32) for w in works[lab])
        overhead = sum(w.steps * STEP_OVERHEAD_S for w in works[lab] if not w.cpu)
        seen = f"{measured:.0f}" if measured else f"> {H100_LONGEST:.0f}"
        ratio = (measured or H100_LONGEST) / predicted
        lines.append(
            f"| {lab} | {predicted:.0f} | {overhead:.0f} | {seen} | "
            f"{'> ' if measured is None else ''}{ratio:.1f} |"
        )
    return "\n".join(lines)


def report(works: dict[str, list[Work]]) -> str:
    per_example = ", ".join(
        f"{name} {'training' if train else 'forward'} {flops_per_example(name, train) / 1e9:.3f}"
        for name in ("resnet", "gpt")
        for train in (True, False)
    )
    return f"""# Every lab at the `gpu` profile on a Colab T4: an estimate from counted FLOPs

Written by `python -m benchmarks.colab_cost` (see its docstring for the method);
`tests/test_colab_cost.py` recomputes this file from the current labs and profiles and
fails when it differs or when a lab exceeds 10 minutes.

- T4 peak: {T4_PEAK["fp32"] / 1e12:.1f} TFLOP/s float32 (the labs' precision), \
{T4_PEAK["fp16"] / 1e12:.0f} TFLOP/s float16 tensor cores (NVIDIA T4 datasheet)
- assumed utilization: GPT {EFFICIENCY["gpt"]:.0%}, ResNet-20 {EFFICIENCY["resnet"]:.0%} \
of the float32 peak; {STEP_OVERHEAD_S * 1e3:.0f} ms per optimizer step on top; CPU work at \
{CPU_FLOPS / 1e9:.0f} GFLOP/s
- GFLOP per example at gpu (FlopCounterMode, meta device): {per_example} \
(a GPT example is a window of {P.block_size} characters)
- not measured on a T4: no GPU was at hand; a Colab session also spends a minute or two \
installing `lsdl_lab` and downloading CIFAR-10 (170 MB) once

{table(works)}

## Against a measurement: one H100, six labs at once

The only labs timed on a GPU so far ran on one NVIDIA H100 (torch 2.11), uncapped at `gpu`
on the dry run's synthetic data, six of them at once on the one GPU (issue 26). The same
model, with the H100's {H100_PEAK_FP32 / 1e12:.0f} TFLOP/s float32 peak in place of the \
T4's, predicts each lab alone:

{against_h100(works)}

Each lab shared the GPU and the machine's cores with five others, so a measured time is
an upper bound of the lab's time alone, and a ratio near 1 says little: Labs 1, 3, 4a and
4b are within 2x of the prediction, as sharing alone could make them. Two say more. Lab 6
ran more than five times the prediction, one cell alone for more than 182 s: the model
counts each step's forward and backward passes, but Lab 6 also runs K-FAC's and
Shampoo's preconditioners (eigendecompositions and inverse roots of matrices of up to
1,536 rows, left out of the count, as its rows say), which a GPU computes far below its
peak; its T4 estimate is low for the same reason. Lab 2's 2.6x is more than sharing
explains with the model's terms as they are (more than half of its prediction is the 5 ms
a step assumed for launches and Python); a run of the lab alone will say which term is
short. Until a GPU run times each lab alone, the T4 minutes above are the model's,
corrected for nothing.
"""


def main() -> None:
    text = report(estimate())
    RESULT.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
