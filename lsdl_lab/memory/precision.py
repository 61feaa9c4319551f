"""Mixed precision: the dynamic loss scaler, and what fp16 and bf16 lose without care.

Mixed-precision training (Micikevicius et al. 2018) computes the forward and backward
passes in 16 bits (``torch.autocast``) and keeps fp32 *master weights* that the optimizer
updates. Float16 has a narrow range (largest 65504, smallest subnormal 2^-24 = 6.0e-8),
so small gradients flush to zero; *loss scaling* multiplies the loss by S before the
backward pass, which multiplies every gradient by S and lifts it into range, and divides
the fp32 gradients by S before the step. A *dynamic* scaler picks S by trial: when a
gradient overflows (inf or NaN) it skips the step and halves S; after ``growth_interval``
clean steps it doubles S (Micikevicius et al. 2018, Section 3.2; the scheme of
``torch.amp.GradScaler``, of Megatron-LM's and DeepSpeed's dynamic loss scalers).
Bfloat16 keeps fp32's 8 exponent bits, so its range needs no scaling, but has only 8
bits of precision (Kalamkar et al. 2019): :func:`bf16_range_vs_precision` shows both sides.

:class:`LossScaler` is the library's scaler with GradScaler's interface and arithmetic
(scale held as a float32 number, unscaling by the float32 reciprocal computed in float64),
so a run with it equals a run with ``torch.amp.GradScaler`` step for step.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .._util import check_choice, check_int, check_positive, check_real, generator
from ..steps import accumulate, update
from ..train import LossFunction

__all__ = [
    "LossScaler",
    "amp_step",
    "bf16_range_vs_precision",
    "fp16_underflow",
    "mixed_precision_for",
]


def _float32(x: float) -> float:
    """``x`` rounded to float32 (inf when it overflows), the precision of GradScaler's scale."""
    return torch.tensor(x, dtype=torch.float32).item()


class LossScaler:
    """Dynamic loss scaling with ``torch.amp.GradScaler``'s semantics and a floor.

    ``scale(loss)`` returns ``loss * S``; after ``backward``, ``step(optimizer)`` unscales
    the gradients (unless :meth:`unscale_` already did, e.g. to clip them), and calls
    ``optimizer.step()`` only if every gradient is finite; ``update()`` then sets S for the
    next iteration:

    * an inf/NaN was found: :math:`S \\leftarrow \\max(S \\cdot \\text{backoff\\_factor},
      \\text{min\\_scale})` and the count of clean steps restarts;
    * else the count grows, and when it reaches ``growth_interval``,
      :math:`S \\leftarrow S \\cdot \\text{growth\\_factor}` (if finite) and it restarts.

    A skipped step must not advance anything else either: ``step`` returns ``None`` and
    :attr:`skipped` is ``True``, so a learning-rate schedule is stepped with
    ``if not scaler.skipped: scheduler.step()``; :attr:`skipped_steps` counts them all.

    ``min_scale`` (default 1, as Megatron-LM's and DeepSpeed's dynamic scalers) is a
    floor GradScaler lacks: below 1 the "scaling" would shrink gradients into fp16's
    underflow instead of out of it. Above the floor the two scalers agree exactly.

    ``process_group``: with a sharded optimizer (ZeRO) each rank sees only its shard of
    the gradients, so one rank may find an inf the others do not; the found-inf flag is
    all-reduced with MAX over the group, so every rank skips or steps together and the
    scales stay equal.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
        process_group=None,
    ):
        check_positive("init_scale", init_scale)
        check_real("growth_factor", growth_factor, 1.0, low_open=True)
        check_real("backoff_factor", backoff_factor, 0.0, 1.0, low_open=True, high_open=True)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = check_int("growth_interval", growth_interval, 1)
        self.min_scale = check_real("min_scale", min_scale, 0.0)
        if init_scale < min_scale:
            raise ValueError(f"Invalid init_scale: {init_scale!r} (expected >= min_scale)")
        self.process_group = process_group
        self._scale = _float32(init_scale)
        self._growth_tracker = 0
        self._found_inf: dict[int, bool | None] = {}  # per optimizer: None = unscaled
        self._stepped: set[int] = set()
        self.skipped = False
        self.skipped_steps = 0

    def get_scale(self) -> float:
        """The current scale S."""
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S`` (S as a float32 tensor on the loss's device, as GradScaler)."""
        return loss * torch.tensor(self._scale, dtype=torch.float32, device=loss.device)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients of ``optimizer``'s parameters by S, in place, and note
        whether any is inf or NaN (all-reduced over ``process_group`` when given)."""
        key = id(optimizer)
        if key in self._stepped:
            raise RuntimeError("unscale_() is being called after step().")
        if key in self._found_inf:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
        grads = [g for g in grads if g is not None]
        if any(g.dtype == torch.float16 for g in grads):
            raise ValueError(
                "Attempting to unscale FP16 gradients: keep the parameters (master weights) "
                "in float32 and let torch.autocast compute in float16"
            )
        device = grads[0].device if grads else torch.device("cpu")
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
        # Reciprocal in float64, rounded to float32, as GradScaler: the same bits.
        inv_scale = torch.tensor(1.0 / self._scale, dtype=torch.float64).float().item()
        with torch.no_grad():
            for g in grads:
                found_inf = torch.maximum(found_inf, (~torch.isfinite(g)).any().to(device))
            if grads:
                torch._foreach_mul_(grads, inv_scale)
        if self.process_group is not None:
            # NCCL reduces CUDA tensors only; with offloaded optimizer state the gradients,
            # and so the flag, may live in CPU memory
            if dist.get_backend(self.process_group) == "nccl" and found_inf.device.type != "cuda":
                found_inf = found_inf.to(torch.device("cuda", torch.cuda.current_device()))
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.process_group)
        self._found_inf[key] = bool(found_inf.item())

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """Unscale (if not done yet) and take ``optimizer.step()`` unless a gradient was
        inf/NaN; returns the step's result, or ``None`` when the step was skipped."""
        if "closure" in kwargs or args:
            raise RuntimeError("LossScaler.step does not support a closure (as GradScaler)")
        key = id(optimizer)
        if key in self._stepped:
            raise RuntimeError("step() has already been called since the last update().")
        if key not in self._found_inf:
            self.unscale_(optimizer)
        self._stepped.add(key)
        self.skipped = self._found_inf[key]
        if self.skipped:
            self.skipped_steps += 1
            return None
        return optimizer.step(**kwargs)

    def update(self) -> None:
        """Set S for the next iteration from this iteration's inf/NaN checks."""
        if not self._found_inf:
            raise RuntimeError("No inf checks were recorded prior to update().")
        if any(self._found_inf.values()):
            self._scale = max(_float32(self._scale * self.backoff_factor), self.min_scale)
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                grown = _float32(self._scale * self.growth_factor)
                if math.isfinite(grown):
                    self._scale = grown
                self._growth_tracker = 0
        self._found_inf.clear()
        self._stepped.clear()

    def state_dict(self) -> dict:
        """GradScaler's keys (so either loads the other's), plus ``min_scale``."""
        return {
            "scale": self._scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": self._growth_tracker,
            "min_scale": self.min_scale,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` (or a ``torch.amp.GradScaler``'s, whose missing
        ``min_scale`` keeps this scaler's)."""
        if not state:
            raise RuntimeError("The source state dict is empty")
        self._scale = _float32(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self._growth_tracker = int(state["_growth_tracker"])
        self.min_scale = float(state.get("min_scale", self.min_scale))


def amp_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn,
    batch: tuple[torch.Tensor, torch.Tensor],
    dtype: torch.dtype = torch.bfloat16,
    scaler: LossScaler | None = None,
    scheduler=None,
) -> float:
    """One mixed-precision step (Micikevicius et al. 2018): forward and loss under
    ``torch.autocast`` in ``dtype`` (bfloat16 or float16, on the batch's device, CPU or
    CUDA), the loss in float32, backward, and the optimizer's step on the float32
    parameters, which are the master weights. With a ``scaler`` the loss is scaled, a
    step with inf/NaN gradients is skipped, and ``scheduler`` (if any) advances only on
    steps taken. Returns the (unscaled) loss. The pieces are those of every run's step
    (:mod:`lsdl_lab.steps`): :func:`~lsdl_lab.steps.accumulate` of one micro-batch, then
    :func:`~lsdl_lab.steps.update`.
    """
    check_choice("dtype", dtype, (torch.bfloat16, torch.float16))
    if scaler is not None and not isinstance(scaler, LossScaler):
        raise TypeError(f"Invalid scaler: a {type(scaler).__name__} (expected a LossScaler)")
    optimizer.zero_grad(set_to_none=True)
    loss, _, _ = accumulate(model, [batch], LossFunction(loss_fn), dtype=dtype, scaler=scaler)
    if update(optimizer, scaler) and scheduler is not None:
        scheduler.step()
    return loss.item()


# -- demonstrations -----------------------------------------------------------------------


def fp16_underflow(
    grad_size: float = 2.0**-28, scale: float = 2.0**16, size: int = 64, seed: int = 0
) -> dict[str, float]:
    """Gradients of a float16 linear layer lost to underflow, and saved by loss scaling.

    A layer ``y = x W`` computes in float16 (as under ``torch.autocast``); the gradient
    reaching ``y`` has entries of typical size ``grad_size`` (a mean loss over a large
    batch late in training makes them small). Below 2^-24, float16's smallest subnormal,
    they round to zero, and so does ``W``'s gradient ``x^T dy``. Multiplying the loss by
    ``scale`` first, then dividing the float32 gradient by it, keeps them.

    Returns the fraction of exact zeros in ``W``'s gradient without and with scaling, and
    the largest relative error of the scaled gradient against a float32 computation.
    """
    check_positive("grad_size", grad_size)
    check_positive("scale", scale)
    size = check_int("size", size, 1)
    g = generator("fp16_underflow", seed)
    x = torch.randn(4 * size, size, generator=g)
    w = torch.randn(size, size, generator=g) / math.sqrt(size)
    upstream = torch.randn(4 * size, size, generator=g) * grad_size  # d loss / d y

    def weight_grad(dtype: torch.dtype, s: float) -> torch.Tensor:
        weight = w.to(dtype, copy=True).requires_grad_()
        y = x.to(dtype) @ weight
        # The float32 loss's gradient is cast to float16 on its way into the layer.
        (y.float() * (upstream * s)).sum().backward()
        return weight.grad.float() / s

    exact = weight_grad(torch.float32, 1.0)
    unscaled = weight_grad(torch.float16, 1.0)
    scaled = weight_grad(torch.float16, scale)
    return {
        "zero_fraction_unscaled": (unscaled == 0).float().mean().item(),
        "zero_fraction_scaled": (scaled == 0).float().mean().item(),
        "zero_fraction_float32": (exact == 0).float().mean().item(),
        "max_relative_error_scaled": ((scaled - exact).abs().max() / exact.abs().max()).item(),
    }


def mixed_precision_for(device: torch.device | str) -> tuple[str, str]:
    """The 16-bit arithmetic to train in on ``device``, and why: ``("bf16", ...)`` on a GPU
    that computes in bfloat16 (NVIDIA's from Ampere on), ``("fp16", ...)`` on an older
    GPU (a T4 or a V100 has float16 tensor cores and only emulates bfloat16: float16 with
    the loss scaler), ``("none", ...)`` on a CPU, whose 16-bit matrix products are
    emulated and many times slower than float32 (Chapter 8 measures it)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "none", f"float32: {device.type} has no fast 16-bit arithmetic"
    name = torch.cuda.get_device_name(device)
    with torch.cuda.device(device):  # is_bf16_supported asks the current device
        native = torch.cuda.is_bf16_supported(including_emulation=False)
    if native:
        return "bf16", f"bfloat16: {name} computes in it"
    return "fp16", f"float16 with the loss scaler: {name} has no bfloat16 arithmetic"


def bf16_range_vs_precision() -> dict[str, dict[str, float]]:
    """Float16 against bfloat16 (and float32): range against precision, by example.

    For each dtype: ``max`` (largest finite), ``tiny`` (smallest normal), ``eps`` (the gap
    above 1: precision), and what happens to four numbers stored in it: ``70000.0`` (above
    fp16's range: inf), ``1e-8`` (below fp16's range: 0), ``1 + 2^-9`` (finer than bf16's
    8 bits: 1), and ``1 + 1000 * 1e-3`` accumulated one ``1e-3`` at a time (bf16 stalls at
    1.0: each addend is below half its gap at 1, which is why optimizers keep fp32 master
    weights; Micikevicius et al. 2018, Section 3.1; Kalamkar et al. 2019).
    """
    rows = {}
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        info = torch.finfo(dtype)
        acc = torch.ones((), dtype=dtype)
        step = torch.tensor(1e-3, dtype=dtype)
        for _ in range(1000):
            acc = acc + step
        rows[str(dtype).removeprefix("torch.")] = {
            "max": info.max,
            "tiny": info.tiny,
            "eps": info.eps,
            "70000": torch.tensor(70000.0, dtype=dtype).item(),
            "1e-8": torch.tensor(1e-8, dtype=dtype).item(),
            "1+2^-9": torch.tensor(1 + 2.0**-9, dtype=dtype).item(),
            "sum of 1000 x 1e-3 onto 1": acc.item(),
        }
    return rows
