"""The measurements of Chapter 8 and Lab 8, as functions: one place that runs each
experiment, so the chapter, the lab and the tests measure the same way.

* :func:`zero_per_rank` -- ZeRO stages 1-3 (:class:`~lsdl_lab.memory.ZeroOptimizer`) on
  the book's GPT in a world of processes, mixed precision as in Rajbhandari et al. (2020):
  bfloat16 weights and gradients, float32 master weights and Adam moments. Each rank
  reports the bytes it holds, its loss per step and which slice of each unit it owns.
* :func:`optimizer_state` and :func:`train_curves` -- the state an optimizer holds after
  a step, and the training loss of a model under several optimizers.
* :func:`gradient_underflow` and :func:`precision_curves` -- what float16 gradients lose
  without loss scaling (Micikevicius et al. 2018), and training under autocast.
* :func:`gpt_checkpoint_sweep` -- activation bytes and time of a GPT's blocks against the
  checkpoint spacing (Chen et al. 2016).
* :func:`measure_gpt` -- bytes of the model states and activations of one training step
  of a GPT, for the calculator (:func:`~lsdl_lab.memory.gpt_memory`) to be held against.
* :func:`moment_block_errors` -- what block-wise 8-bit quantization (Dettmers et al. 2022)
  does to Adam's two moments, block by block, against the bound of half the map's largest
  gap times the block's maximum.
* :func:`fp8_operands`, :func:`fp8_cast_errors` and :func:`fp8_curves` -- the three
  operands of a GPT's linear layers (activations, weights, output gradients) cast to FP8
  in each format and scaling (Micikevicius et al. 2022; the OCP MX specification), and
  training with the linears in emulated FP8 against float32 and bfloat16.

Every run trains through :func:`lsdl_lab.train.fit`, the one loop, with a step of
:mod:`lsdl_lab.steps`' pieces (:class:`LoggedStep`, or fit's default
:func:`~lsdl_lab.train.train_step`), so fit's step counter applies the dry run's cap
(:mod:`lsdl_lab.profiles`). The worker of :func:`zero_per_rank` is a top-level function of
this module, so that :func:`lsdl_lab.distributed.spawn` can start it in fresh processes.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .._util import check_choice, check_int, check_positive
from ..memory.fp8 import FORMATS, convert_to_fp8, fp8_counts, quantize_fp8
from ..memory.measure import SavedTensorBytes, measure
from ..memory.precision import LossScaler
from ..memory.quantize import BLOCK_SIZE, dequantize_blockwise, dynamic_map, quantize_blockwise
from ..memory.recompute import sweep
from ..memory.sharded import ZeroOptimizer
from ..models import GPT
from ..steps import accumulate, update
from ..train import LossFunction, StepResult, fit

__all__ = [
    "PRECISION_MODES",
    "LoggedStep",
    "fp8_cast_errors",
    "fp8_curves",
    "fp8_operands",
    "moment_block_errors",
    "gpt_checkpoint_sweep",
    "gradient_underflow",
    "segment_peak",
    "tanh_chain",
    "lm_loss",
    "measure_gpt",
    "optimizer_state",
    "precision_curves",
    "train_curves",
    "untied_gpt",
    "zero_per_rank",
    "zero_worker",
]

PRECISION_MODES = ("fp32", "bf16", "fp16", "fp16 + scaler")


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, in float32 whatever the logits' dtype (as under autocast)."""
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())


class LoggedStep:
    """:func:`lsdl_lab.train.fit`'s step for this module's runs, which keeps what they
    plot: forward and backward of the batch (:func:`~lsdl_lab.steps.accumulate`, one
    micro-batch; under ``torch.autocast`` in ``dtype`` when given, the loss multiplied by
    ``scaler``'s scale when given), then :func:`~lsdl_lab.steps.update` (the scaler's
    step, which skips an update whose gradients are not finite). :attr:`losses` holds
    every step's loss as computed, finite or not: these runs show what a precision does
    to training, so a loss that overflows is recorded, not raised. With a scaler,
    :attr:`scales` holds the scale each step used and :attr:`skipped` the steps (counted
    from 0) it skipped; :attr:`taken` counts the updates made."""

    def __init__(self, dtype: torch.dtype | None = None, scaler: LossScaler | None = None):
        self.dtype, self.scaler = dtype, scaler
        self.losses: list[float] = []
        self.scales: list[float] = []
        self.skipped: list[int] = []

    @property
    def taken(self) -> int:
        return len(self.losses) - len(self.skipped)

    def __call__(self, model, optimizer, batch, task) -> StepResult:
        if self.scaler is not None:
            self.scales.append(self.scaler.get_scale())
        optimizer.zero_grad(set_to_none=True)
        loss, examples, counts = accumulate(
            model, [batch], task, dtype=self.dtype, scaler=self.scaler
        )
        stepped = update(optimizer, self.scaler)
        if not stepped:
            self.skipped.append(len(self.losses))
        self.losses.append(loss.item())
        return StepResult(self.losses[-1], examples, counts, stepped=stepped)


def _fit(model, optimizer, batches, steps, step, loss_fn, name=None) -> None:
    """:func:`~lsdl_lab.train.fit` on ``loss_fn`` with ``step``; a bar named ``name``
    (none without one), and no gradient norm (what these runs keep is in the step)."""
    fit(
        model,
        optimizer,
        batches,
        steps,
        step=step,
        task=LossFunction(loss_fn),
        progress=name is not None,
        desc=name,
        grad_norm=False,
    )


def untied_gpt(vocab: int, block: int, layers: int, heads: int, dim: int, seed: int = 0) -> GPT:
    """The book's GPT with its output layer given its own copy of the token embedding.
    ZeRO's units are modules, and a weight shared by two modules would be gathered and
    reduced twice (:class:`~lsdl_lab.memory.ZeroOptimizer` refuses it), so the ZeRO runs
    use this GPT: ``vocab x dim`` more parameters than the tied one, the same function at
    initialization."""
    torch.manual_seed(seed)
    gpt = GPT(vocab, block, layers, heads, dim)
    gpt.head.weight = nn.Parameter(gpt.tok.weight.detach().clone())
    return gpt


def zero_worker(rank: int, world_size: int, gpt_args: tuple, batches: list, stages: Sequence[int]):
    """One rank of :func:`zero_per_rank`: for each stage, a fresh bfloat16 GPT
    (:func:`untied_gpt` with ``gpt_args``) under ``ZeroOptimizer(stage, Adam, float32
    master)``, one step per batch on the rank's part of each ``(x, y)`` batch, rows
    ``[r n, (r + 1) n)`` for ``n = len(x) // world_size`` (:func:`~lsdl_lab.train.fit` with
    a :class:`LoggedStep`). A batch of fewer rows than ranks, as a dry run's text batch of
    one sequence (:mod:`lsdl_lab.profiles`), gives rank ``r`` its row ``r mod len(x)``, so
    that no rank steps on an empty batch."""
    # Stage 3's backward pre-hooks fire on modules whose inputs need no gradient (the
    # embeddings take token indices); torch warns about it, and it is intended here.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")

    def part(t: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batches[t]
        rows = len(x) // world_size
        first = rank * rows if rows else rank % len(x)
        return x[first : first + max(rows, 1)], y[first : first + max(rows, 1)]

    out = {}
    for stage in stages:
        model = untied_gpt(*gpt_args).bfloat16()
        opt = ZeroOptimizer(model, torch.optim.Adam, stage=stage, master_dtype=torch.float32)
        step = LoggedStep()
        _fit(model, opt, part, len(batches), step, lm_loss)
        names = {id(m): n for n, m in model.named_modules()}
        out[stage] = {
            "held": opt.held_bytes(),
            "numel": sum(u.numel for u in opt.units),
            "padded": sum(u.padded for u in opt.units),
            "units": [
                {
                    "module": names[id(u.module)] or "(model)",
                    "sizes": [shape.numel() for shape in u.shapes],
                    "numel": u.numel,
                    "padded": u.padded,
                    "own": (u.own.start, u.own.stop),
                }
                for u in opt.units
            ],
            "losses": step.losses,
            # the whole parameters after the last step (a collective at stage 3)
            "params": torch.cat([p.reshape(-1) for p in opt.full_parameters()]),
        }
    return out


def zero_per_rank(
    gpt_args: tuple, batches: list, world_size: int = 2, stages: Sequence[int] = (1, 2, 3)
) -> list[dict]:
    """Run :func:`zero_worker` in one world of ``world_size`` processes (gloo on CPU);
    a list by rank of ``{stage: {"held", "numel", "padded", "units", "losses", "params"}}``
    (``params``: the whole parameters after the last step, flat)."""
    from ..distributed import spawn  # the world machinery only when a world is started

    world_size = check_int("world_size", world_size, 1)
    for stage in stages:
        check_int("stage", stage, 1, 3)
    return spawn(
        zero_worker, world_size, tuple(gpt_args), list(batches), tuple(stages), timeout=120
    )


def optimizer_state(
    new_model: Callable[[], nn.Module],
    optimizers: Mapping[str, Callable],
    batch: tuple[torch.Tensor, torch.Tensor],
    loss_fn: Callable = lm_loss,
) -> dict[str, dict[str, int]]:
    """:func:`~lsdl_lab.memory.measure` of a fresh model and each optimizer after one step
    on ``batch`` (an optimizer's state exists only once it has stepped)."""
    out = {}
    for name, make in optimizers.items():
        model = new_model()
        opt = make(model.parameters())
        loss_fn(model(batch[0]), batch[1]).backward()
        opt.step()
        out[name] = measure(model, opt)
    return out


def train_curves(
    new_model: Callable[[], nn.Module],
    optimizers: Mapping[str, Callable],
    batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    loss_fn: Callable = lm_loss,
) -> dict[str, list[float]]:
    """The training loss of each step of a fresh model under each optimizer, on the same
    batches (``batches(step)``): :func:`~lsdl_lab.train.fit` with a :class:`LoggedStep`."""
    steps = check_int("steps", steps, 1)
    curves = {}
    for name, make in optimizers.items():
        model = new_model()
        step = LoggedStep()
        _fit(model, make(model.parameters()), batches, steps, step, loss_fn, name)
        curves[name] = step.losses
    return curves


def gradient_underflow(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    loss_fn: Callable = lm_loss,
    scale: float = 2.0**16,
    loss_factor: float = 1.0,
) -> dict[str, float]:
    """Fractions of the model's gradient entries that are exactly zero after one backward
    pass in float32, under float16 autocast, and under float16 autocast with the loss
    multiplied by ``scale`` (then divided out in float32); and the fraction of the float32
    gradient's entries below float16's smallest subnormal 2^-24 in magnitude, which a
    float16 gradient cannot hold. ``loss_factor`` multiplies the loss in all three runs
    (a mean over ``loss_factor``-times more tokens has gradients that much smaller)."""
    check_positive("scale", scale)
    check_positive("loss_factor", loss_factor)
    device = next(model.parameters()).device

    def grads(dtype, s):
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.float16, enabled=dtype == torch.float16):
            logits = model(batch[0])
        (loss_fn(logits, batch[1]) * (loss_factor * s)).backward()
        return torch.cat([p.grad.reshape(-1) / s for p in model.parameters()])

    exact = grads(torch.float32, 1.0)
    unscaled = grads(torch.float16, 1.0)
    scaled = grads(torch.float16, scale)
    model.zero_grad(set_to_none=True)
    tiny = 2.0**-24
    return {
        "zero_float32": (exact == 0).float().mean().item(),
        "zero_fp16": (unscaled == 0).float().mean().item(),
        "zero_fp16_scaled": (scaled == 0).float().mean().item(),
        "below_fp16_subnormal": ((exact != 0) & (exact.abs() < tiny)).float().mean().item(),
        "relative_error_fp16": ((unscaled - exact).norm() / exact.norm()).item(),
        "relative_error_fp16_scaled": ((scaled - exact).norm() / exact.norm()).item(),
    }


def _retrying(
    batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]], step: LoggedStep, seen: list
) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """The batches of fit's steps when a skipped step is retried: fit's step ``t`` gets
    ``batches(step.taken)``, the batch of the next update to be made (the index is
    appended to ``seen``)."""

    def batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(step.taken)
        return batches(step.taken)

    return batch


def precision_curves(
    new_model: Callable[[], nn.Module],
    make_optimizer: Callable,
    batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    modes: Sequence[str] = PRECISION_MODES,
    loss_fn: Callable = lm_loss,
    init_scale: float = 2.0**16,
    growth_interval: int = 2000,
) -> dict[str, dict]:
    """Train a fresh model for ``steps`` steps in each precision ``mode``: ``"fp32"``,
    ``"bf16"`` and ``"fp16"`` under autocast (float32 master weights, no scaling), and
    ``"fp16 + scaler"`` with a :class:`~lsdl_lab.memory.LossScaler`. A step that the scaler
    skips is tried again on the same batch, so that the steps taken in every mode see the
    same batches in the same order and the losses compare batch by batch. Per mode:
    ``losses`` (of every step, skipped or not), ``batch`` (the batch index of each step),
    ``seconds`` and, with the scaler, ``scales`` (the scale each step used) and
    ``skipped`` (the steps skipped for an inf/NaN gradient). Each run is
    :func:`~lsdl_lab.train.fit` with a :class:`LoggedStep`, whose batch at each step is
    that of the next update to be taken."""
    steps = check_int("steps", steps, 1)
    for mode in modes:
        check_choice("mode", mode, PRECISION_MODES)
    dtypes = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    out = {}
    for mode in modes:
        model = new_model()
        scaler = None
        if "scaler" in mode:
            scaler = LossScaler(init_scale, growth_interval=growth_interval)
        step, seen = LoggedStep(dtypes[mode.removesuffix(" + scaler")], scaler), []
        opt = make_optimizer(model.parameters())
        start = time.perf_counter()
        _fit(model, opt, _retrying(batches, step, seen), steps, step, loss_fn, mode)
        out[mode] = {
            "losses": step.losses,
            "batch": seen,
            "scales": step.scales,
            "skipped": step.skipped,
            "seconds": time.perf_counter() - start,
        }
    return out


def tanh_chain(layers: int, width: int, seed: int = 0) -> list[nn.Module]:
    """Chen et al.'s setting: ``layers`` blocks ``Linear -> Tanh`` of equal width, each of
    which keeps one tensor for the backward pass (its Tanh output, the next block's
    input, which its Linear keeps too): one unit of activation per block."""
    layers, width = check_int("layers", layers, 1), check_int("width", width, 1)
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)]


def segment_peak(layers: int, every: int | None, input_bytes: float, block_bytes: float) -> float:
    """Activation bytes of ``layers`` blocks checkpointed every ``every`` blocks, when a
    block saves ``block_bytes`` (its input of ``input_bytes`` included) and a segment
    boundary keeps only its input: the other ``ceil(L/k) - 1`` kept inputs plus the ``k``
    blocks of the segment recomputed during the backward pass; ``L`` blocks' worth without
    checkpointing. Minimal near :math:`k = \\sqrt{L\\,i/a}`, which is Chen et al.'s
    :math:`\\sqrt{L}` when a block's activations are its input (:math:`a = i`)."""
    layers = check_int("layers", layers, 1)
    if every is None:
        return layers * block_bytes
    every = check_int("every", every, 1)
    return (math.ceil(layers / every) - 1) * input_bytes + min(every, layers) * block_bytes


def gpt_checkpoint_sweep(
    gpt: GPT,
    idx: torch.Tensor,
    spacings: Sequence[int | None] | None = None,
    repeats: int = 1,
) -> list[dict]:
    """:func:`~lsdl_lab.memory.sweep` over the GPT's blocks, on the embedded tokens
    ``idx`` (the blocks' input, a leaf that requires a gradient); one row per spacing,
    with ``unit_bytes`` (the bytes of one block's saved tensors without checkpointing)
    and ``input_bytes`` (one block's input) added, the two numbers of
    :func:`segment_peak`."""
    with torch.no_grad():
        x = gpt.drop(gpt.tok(idx) + gpt.pos(torch.arange(idx.shape[-1], device=idx.device)))
    x.requires_grad_()
    rows = sweep(list(gpt.blocks), x, spacings, repeats=repeats)
    layers = len(gpt.blocks)
    plain = next((r for r in rows if r["every"] is None), None)
    if plain is None:
        plain = sweep(list(gpt.blocks), x, [None])[0]
    unit = plain["forward_bytes"] / layers
    for row in rows:
        row["unit_bytes"], row["input_bytes"] = unit, x.numel() * x.element_size()
    return rows


def measure_gpt(
    gpt: GPT,
    batch: tuple[torch.Tensor, torch.Tensor],
    make_optimizer: Callable,
) -> dict[str, float]:
    """One training step of ``gpt`` on ``batch``: the model states held after it
    (:func:`~lsdl_lab.memory.measure`) and ``activations``, the peak of the bytes saved
    for backward (:class:`~lsdl_lab.memory.SavedTensorBytes`, parameters excluded)."""
    gpt.zero_grad(set_to_none=True)
    with SavedTensorBytes(gpt) as saved:
        lm_loss(gpt(batch[0]), batch[1]).backward()
    opt = make_optimizer(gpt.parameters())
    opt.step()
    out = measure(gpt, opt)
    out["activations"] = saved.peak
    out["total"] += saved.peak
    return out


def moment_block_errors(
    new_model: Callable[[], nn.Module],
    batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    block_size: int = BLOCK_SIZE,
    lr: float = 3e-3,
    min_size: int = 1,
    loss_fn: Callable = lm_loss,
) -> dict[str, dict[str, torch.Tensor | float]]:
    r"""Train a fresh model ``steps`` steps with float32 AdamW (``torch.optim``), then
    quantize its two moments block-wise, as :class:`~lsdl_lab.optim.AdamW8bit` keeps them:
    the first with the signed dynamic map, the second with the unsigned one, every tensor of
    at least ``min_size`` values in blocks of ``block_size``. Per moment (``"exp_avg"``,
    ``"exp_avg_sq"``): each block's maximum :math:`N_b` (``absmax``), its largest rounding
    error :math:`\max_{i\in b}|x_i - \hat x_i|` (``error``), the map's largest gap
    :math:`\Delta` (``gap``; the bound is :math:`\tfrac{\Delta}{2} N_b`), the relative
    error of the whole moment :math:`\|\hat x - x\| / \|x\|` (``relative``),
    ``negative``, how many decoded values of the moment are below zero, and ``zeroed`` and
    ``zeroed_linear``, the fractions of its nonzero values decoded to zero by the dynamic
    map and by a linear map of 256 values on the same range (the uniform 8-bit quantization
    it replaces). ``absmax`` and ``error`` come back on the CPU, for plotting. The training
    is :func:`~lsdl_lab.train.fit` with its default step (a loss that is not finite stops
    it: its moments would be no measure of anything); the loop over the parameters after
    it measures the trained state and takes no step."""
    steps = check_int("steps", steps, 1)
    model = new_model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    fit(model, opt, batches, steps, task=LossFunction(loss_fn), desc="AdamW", grad_norm=False)
    out = {}
    for name, signed in (("exp_avg", True), ("exp_avg_sq", False)):
        code = dynamic_map(signed)
        linear = torch.linspace(-1.0 if signed else 0.0, 1.0, 256)
        absmax, error, negative, num, den = [], [], 0, 0.0, 0.0
        zeroed = zeroed_linear = nonzero = 0
        for p in model.parameters():
            if p.numel() < min_size:
                continue
            x = opt.state[p][name].reshape(-1)
            code, linear = code.to(x.device), linear.to(x.device)
            codes, scales = quantize_blockwise(x, code, block_size)
            x_hat = dequantize_blockwise(codes, scales, code, x.shape, block_size)
            diff = F.pad((x_hat - x).abs(), (0, -x.numel() % block_size))
            absmax.append(scales.cpu())
            error.append(diff.view(-1, block_size).amax(dim=1).cpu())
            negative += int((x_hat < 0).sum())
            nonzero += int((x != 0).sum())
            zeroed += int(((x_hat == 0) & (x != 0)).sum())
            codes, scales = quantize_blockwise(x, linear, block_size)
            x_lin = dequantize_blockwise(codes, scales, linear, x.shape, block_size)
            zeroed_linear += int(((x_lin == 0) & (x != 0)).sum())
            num, den = num + float((x_hat - x).square().sum()), den + float(x.square().sum())
        out[name] = {
            "absmax": torch.cat(absmax),
            "error": torch.cat(error),
            "gap": float(code.diff().max()),
            "relative": math.sqrt(num / den),
            "negative": negative,
            "zeroed": zeroed / nonzero,
            "zeroed_linear": zeroed_linear / nonzero,
        }
    return out


def fp8_operands(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    loss_fn: Callable = lm_loss,
    skip: Sequence[str] = (),
) -> dict[str, list[torch.Tensor]]:
    """The three operands of every ``nn.Linear`` of ``model`` (but those named in ``skip``)
    in one forward and backward pass on ``batch``, in float32: ``"input"`` (the activations
    entering it), ``"weight"`` and ``"grad_output"`` (the gradient of the loss with respect
    to its output), the operands an FP8 layer casts (:class:`~lsdl_lab.memory.FP8Linear`)."""
    out: dict[str, list[torch.Tensor]] = {"input": [], "weight": [], "grad_output": []}
    handles = []

    def forward_hook(module, inputs, output):
        out["input"].append(inputs[0].detach().float().clone())
        out["weight"].append(module.weight.detach().float().clone())

    def backward_hook(module, grad_input, grad_output):
        out["grad_output"].append(grad_output[0].detach().float().clone())

    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and name not in skip:
            handles.append(m.register_forward_hook(forward_hook))
            handles.append(m.register_full_backward_hook(backward_hook))
    try:
        model.zero_grad(set_to_none=True)
        loss_fn(model(batch[0]), batch[1]).backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    return out


def fp8_cast_errors(
    operands: Mapping[str, Sequence[torch.Tensor]],
    formats: Sequence[str] = tuple(FORMATS),
    scalings: Sequence[str] = ("none", "tensor", "mx"),
) -> dict[tuple[str, str, str], dict[str, float]]:
    r"""Each operand's tensors (as :func:`fp8_operands` returns them) cast to each FP8
    format with each scaling (:func:`~lsdl_lab.memory.quantize_fp8`, one scale per tensor or
    per block of 32) and back. Per ``(operand, format, scaling)``: ``values``, the fractions
    ``overflow`` (:math:`|x_i s| > v_{\max}`, saturated) and ``underflow`` (nonzero values
    that became zero), and ``error``, the relative error :math:`\|\hat x - x\| / \|x\|` over
    all of the operand's tensors together."""
    out = {}
    for operand, tensors in operands.items():
        for fmt in formats:
            for scaling in scalings:
                values = over = under = 0
                num = den = 0.0
                for x in tensors:
                    q = quantize_fp8(x, fmt, scaling)
                    x_hat = q.dequantize()
                    values += x.numel()
                    over += int(q.overflows)
                    under += int(q.underflows)
                    num += float((x_hat - x).square().sum())
                    den += float(x.square().sum())
                out[operand, fmt, scaling] = {
                    "values": values,
                    "overflow": over / values,
                    "underflow": under / values,
                    "error": math.sqrt(num / den),
                }
    return out


def fp8_curves(
    new_model: Callable[[], nn.Module],
    make_optimizer: Callable,
    batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    recipes: Mapping[str, Mapping | str],
    keep: Sequence[str] = ("head",),
    loss_fn: Callable = lm_loss,
) -> dict[str, dict]:
    """Train a fresh model ``steps`` steps under each recipe, on the same batches: a recipe
    is ``"fp32"``, ``"bf16"`` (bfloat16 autocast, float32 master weights) or the
    options of :func:`~lsdl_lab.memory.convert_to_fp8` (``scaling``, formats...), whose
    linears but ``keep`` (the output layer, kept in float32 as FP8 recipes do) then compute
    in emulated FP8. Per recipe: ``losses``, ``seconds`` and, for FP8, ``counts``
    (:func:`~lsdl_lab.memory.fp8_counts` summed over the run). Each run is
    :func:`~lsdl_lab.train.fit` with a :class:`LoggedStep`."""
    steps = check_int("steps", steps, 1)
    out = {}
    for name, recipe in recipes.items():
        model = new_model()
        if isinstance(recipe, str):
            check_choice("recipe", recipe, ("fp32", "bf16"))
        else:
            convert_to_fp8(model, keep=keep, **recipe)
        # FP8 is in the converted linears; the step itself computes in float32
        step = LoggedStep(torch.bfloat16 if recipe == "bf16" else None)
        opt = make_optimizer(model.parameters())
        start = time.perf_counter()
        _fit(model, opt, batches, steps, step, loss_fn, name)
        run = {"losses": step.losses, "seconds": time.perf_counter() - start}
        if not isinstance(recipe, str):
            run["counts"] = fp8_counts(model)
        out[name] = run
    return out
