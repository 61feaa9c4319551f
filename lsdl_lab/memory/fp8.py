r"""FP8 numerics, emulated: the two 8-bit float formats, the scalings that fit a tensor into
them, and a linear layer whose matrix products take FP8 operands (Micikevicius et al., 2022,
"FP8 Formats for Deep Learning", arXiv:2209.05433).

**The formats** (torch's ``float8_e4m3fn`` and ``float8_e5m2``; :data:`FORMATS`):

================  ==================================  ===================================
\                  e4m3 (``float8_e4m3fn``)            e5m2 (``float8_e5m2``)
================  ==================================  ===================================
bits              sign, 4 exponent (bias 7), 3 man.   sign, 5 exponent (bias 15), 2 man.
largest           :math:`448 = 1.75 \cdot 2^8`         :math:`57344 = 1.75 \cdot 2^{15}`
smallest normal   :math:`2^{-6}`                      :math:`2^{-14}`
smallest value    :math:`2^{-9}` (subnormal)          :math:`2^{-16}` (subnormal)
rounding error    :math:`\le 2^{-4} |x|`              :math:`\le 2^{-3} |x|`
special values    NaN only ("fn": finite)             :math:`\pm\infty` and NaN, as IEEE
================  ==================================  ===================================

The rounding error is half a unit in the last place, :math:`2^{-(m+1)}` of the value for
:math:`m` mantissa bits, in the normal range; below it the absolute step is fixed (the
smallest subnormal). e4m3 gives up infinities to keep seven values in its top binade, so it
reaches 448 rather than 240. The paper's recipe (its Section 4, Transformer Engine's
``Format.HYBRID``): **e4m3 forward** (weights and activations want precision), **e5m2
backward** (gradients want range: 32 binades against e4m3's 18).

**Scaling.** Neither format covers a tensor's values as they come (e4m3's smallest value is
0.002; a gradient's entries are often smaller), so a tensor is multiplied by a scale
:math:`s` before the cast and divided by it after:

.. math::
    q = \operatorname{sat}\!\big(\operatorname{RN}(x\, s)\big), \qquad \hat x = q / s,
    \qquad \operatorname{sat}(v) = \max(-v_{\max}, \min(v, v_{\max})),

rounding to nearest (ties to even) and *saturating*: a value beyond the format's largest
:math:`v_{\max}` becomes :math:`\pm v_{\max}` rather than infinity or NaN, as Transformer
Engine casts. Four choices of :math:`s` (the ``scaling`` argument, :data:`SCALINGS`):

* ``"none"``: :math:`s = 1`.
* ``"tensor"`` (per-tensor *current* scaling): :math:`s = v_{\max} / \max_i |x_i|`, so the
  largest value lands on :math:`v_{\max}` and nothing overflows. It needs the tensor's
  maximum before the cast: one more pass over it.
* ``"delayed"`` (per-tensor *delayed* scaling, NVIDIA Transformer Engine's ``DelayedScaling``
  recipe): the maximum is taken from a history of the :math:`H` previous casts' maxima,
  :math:`s_t = v_{\max} / \max(a_{t-H}, \dots, a_{t-1})`, and the cast records
  :math:`a_t = \max_i |x_i|` for the casts to come (:class:`DelayedScaling`). No extra pass,
  but a tensor whose maximum jumps overflows (and saturates) until its history catches up.
* ``"mx"`` (per-block, the OCP Microscaling Formats (MX) Specification v1.0, 2023, its
  conversion of a vector of floats; Rouhani et al., 2023, arXiv:2310.10537): blocks of
  :math:`k = 32` consecutive values along the last dimension share a power-of-two scale,
  stored as an 8-bit exponent (E8M0):

  .. math::
      X = 2^{\lfloor \log_2 \max_{i \in b} |x_i| \rfloor - e_{\max}}, \qquad s = 1 / X,

  :math:`e_{\max}` the exponent of the format's largest normal (8 for e4m3, 15 for e5m2).
  A block's maximum then lands in :math:`[2^{e_{\max}}, 2^{e_{\max}+1})`, the format's top
  binade, whose upper part (above 448 or 57344) saturates: the specification clamps the
  converted values to the format's largest normal. One outlier coarsens its own 32 values,
  not the whole tensor.

Here the scale multiplies (:math:`s`, Transformer Engine's ``scale``); the specification's
:math:`X` is its reciprocal. :func:`quantize_fp8` returns the FP8 values, the scale and two
counts that say what the cast lost: *overflows*, the values with :math:`|x_i s| > v_{\max}`
(before saturation), and *underflows*, the nonzero values that became zero.

**The layer** (:class:`FP8Linear`, :func:`convert_to_fp8`): :math:`y = \hat x \hat W^\top + b`
with :math:`x` and :math:`W` cast to e4m3, and in the backward pass the output's gradient
:math:`g` cast to e5m2, :math:`\partial x = \hat g \hat W`, :math:`\partial W = \hat g^\top
\hat x`, :math:`\partial b = \sum g`. **An emulation:** the products are float32 matrix
products of the dequantized values: the operands are exactly an FP8 multiply's, the sums are
float32's (an FP8 tensor core's accumulator may keep fewer bits, and sums in another order);
there is no speed here, only the numerics. A GPU of compute capability 8.9 or more (Ada,
Hopper) multiplies FP8 operands in hardware (``torch._scaled_mm``).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._util import check_choice, check_int

__all__ = [
    "FORMATS",
    "SCALINGS",
    "DelayedScaling",
    "FP8Cast",
    "FP8Format",
    "FP8Linear",
    "convert_to_fp8",
    "dequantize_fp8",
    "fp8_counts",
    "fp8_round_trip",
    "quantize_fp8",
]


@dataclass(frozen=True)
class FP8Format:
    """One FP8 format's numbers (the module's table)."""

    name: str
    dtype: torch.dtype
    mantissa_bits: int
    max: float  # v_max, the largest finite value
    min_normal: float
    min_subnormal: float
    emax: int  # exponent of the largest normal: floor(log2(max))

    @property
    def relative_error(self) -> float:
        r"""The largest relative rounding error in the normal range: :math:`2^{-(m+1)}`."""
        return 2.0 ** -(self.mantissa_bits + 1)


FORMATS = {
    "e4m3": FP8Format("e4m3", torch.float8_e4m3fn, 3, 448.0, 2.0**-6, 2.0**-9, 8),
    "e5m2": FP8Format("e5m2", torch.float8_e5m2, 2, 57344.0, 2.0**-14, 2.0**-16, 15),
}
SCALINGS = ("none", "tensor", "delayed", "mx")
#: values per shared scale in the MX formats (OCP MX specification v1.0)
MX_BLOCK = 32
#: the exponents an E8M0 scale holds: 2^-127 to 2^127 (its 255th code is NaN)
E8M0_EXPONENTS = (-127, 127)
#: Transformer Engine's example recipe keeps 16 maxima
HISTORY_LEN = 16
OPERANDS = ("input", "weight", "grad_output")


def format_of(name) -> FP8Format:
    return FORMATS[check_choice("format", name, tuple(FORMATS))]


@dataclass
class FP8Cast:
    """What :func:`quantize_fp8` returns: the FP8 values (``data``, in the format's dtype,
    ``x``'s shape), the scale :math:`s` (float32: a 0-d tensor, or one per block of the last
    dimension with MX scaling), the MX block size (``None`` otherwise) and the cast's counts
    (0-d int64 tensors, left on the device: reading them waits for it)."""

    data: Tensor
    scale: Tensor
    block_size: int | None
    overflows: Tensor
    underflows: Tensor

    def dequantize(self) -> Tensor:
        r""":math:`\hat x = q / s`, float32."""
        return dequantize_fp8(self.data, self.scale, self.block_size)


def amax_of(x: Tensor) -> Tensor:
    r""":math:`\max_i |x_i|` in float32 (0 for an empty tensor)."""
    x = x.detach()
    return x.abs().amax().float() if x.numel() else x.new_zeros((), dtype=torch.float32)


def scale_for(amax: Tensor, fmt: FP8Format) -> Tensor:
    r"""The per-tensor scale :math:`s = v_{\max} / a`, float32; 1 where :math:`a` is 0 or
    not finite (as Transformer Engine, which keeps its previous scale there, 1 at first).
    Where float32's rounding would lift :math:`a s` above :math:`v_{\max}`, :math:`s` is
    lowered by one ulp, so the largest value itself never counts as an overflow."""
    s = (fmt.max / amax).clamp(max=torch.finfo(torch.float32).max)
    s = torch.where(amax * s > fmt.max, torch.nextafter(s, torch.zeros_like(s)), s)
    return torch.where((amax > 0) & amax.isfinite(), s, torch.ones_like(s))


def mx_scale(x: Tensor, fmt: FP8Format, block_size: int) -> Tensor:
    r"""The MX scales of ``x``'s blocks along its last dimension (the last one padded with
    zeros): :math:`s = 2^{e_{\max} - \lfloor \log_2 \max_b |x_i| \rfloor}`, the exponent
    clamped to E8M0's range; a block of zeros gets the smallest scale."""
    amax = blocks_of(x.detach().float(), block_size).abs().amax(dim=-1)
    _, e = torch.frexp(amax)  # amax = m 2^e, m in [0.5, 1): floor(log2 amax) = e - 1
    shared = torch.where(amax > 0, e - 1 - fmt.emax, E8M0_EXPONENTS[0])
    shared = shared.clamp(*E8M0_EXPONENTS)
    return torch.ldexp(torch.ones_like(amax), -shared)


def blocks_of(x: Tensor, block_size: int) -> Tensor:
    """``x`` of shape (..., n) as (..., ceil(n / B), B), the last block padded with zeros."""
    n = x.shape[-1]
    padded = F.pad(x, (0, -n % block_size))
    return padded.unflatten(-1, (padded.shape[-1] // block_size, block_size))


def per_value(scale: Tensor, shape: torch.Size, block_size: int | None) -> Tensor:
    """The scale of each value of a tensor of ``shape``: one per tensor as it is; one per
    block repeated over the block's values."""
    if block_size is None:
        return scale
    return scale.repeat_interleave(block_size, dim=-1)[..., : shape[-1]]


class DelayedScaling(nn.Module):
    r"""The state of per-tensor delayed scaling: the maxima of the last ``history_len``
    casts (newest first, a float32 buffer, so it moves with ``.to`` and is saved in
    ``state_dict``). The cast at step :math:`t` uses
    :math:`s_t = v_{\max} / \max(a_{t-H}, \dots, a_{t-1})` and then records :math:`a_t`
    (NVIDIA Transformer Engine's ``DelayedScaling`` with ``amax_compute_algo="max"`` and
    ``margin=0``; its documented example keeps :math:`H = 16`). Before any record the
    history is zeros and the scale 1."""

    def __init__(self, history_len: int = HISTORY_LEN, device=None):
        super().__init__()
        check_int("history_len", history_len, 1)
        self.register_buffer("amax_history", torch.zeros(history_len, device=device))

    def scale(self, fmt: FP8Format) -> Tensor:
        r""":math:`v_{\max} / \max(\text{history})` for the format ``fmt``."""
        return scale_for(self.amax_history.max(), fmt)

    @torch.no_grad()
    def record(self, amax: Tensor) -> None:
        """Push ``amax`` into the history, dropping the oldest."""
        history = self.amax_history
        history.copy_(torch.cat([amax.reshape(1).to(history), history[:-1]]))


def quantize_fp8(
    x: Tensor,
    format: str = "e4m3",
    scaling: str = "tensor",
    *,
    block_size: int | None = None,
    history: DelayedScaling | None = None,
) -> FP8Cast:
    r"""``x`` cast to FP8: :math:`q = \operatorname{sat}(\operatorname{RN}(x s))` in
    ``format`` (``"e4m3"`` or ``"e5m2"``), :math:`s` chosen by ``scaling`` (``"none"``,
    ``"tensor"``, ``"delayed"`` or ``"mx"``, as the module's docstring writes them), with
    the counts of overflows (:math:`|x_i s| > v_{\max}`, saturated) and underflows
    (:math:`x_i \ne 0`, :math:`q_i = 0`).

    ``block_size`` (MX only; default 32, the specification's) is the number of values along
    the last dimension that share a scale. ``history`` (delayed only, required there) is the
    :class:`DelayedScaling` whose maxima set the scale; the cast records ``x``'s maximum in
    it. ``x`` is read in float32; NaNs stay NaN (and spoil their MX block's scale) and are
    counted as neither.
    """
    if not isinstance(x, Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"Invalid x: {got} (expected a floating tensor)")
    fmt = format_of(format)
    check_choice("scaling", scaling, SCALINGS)
    if block_size is not None and scaling != "mx":
        raise ValueError(
            f"Invalid block_size: {block_size!r} with scaling={scaling!r} (a block size "
            "belongs to scaling='mx' only)"
        )
    if (history is not None) != (scaling == "delayed"):
        raise ValueError(
            f"Invalid history: {type(history).__name__} with scaling={scaling!r} (expected a "
            "DelayedScaling with scaling='delayed', and none with any other scaling)"
        )
    if history is not None and not isinstance(history, DelayedScaling):
        raise TypeError(f"Invalid history: a {type(history).__name__} (expected DelayedScaling)")
    x = x.detach().float()
    if scaling == "mx":
        block_size = check_int("block_size", MX_BLOCK if block_size is None else block_size, 1)
        if x.ndim == 0:
            raise ValueError(
                "Invalid x: a 0-d tensor (expected a last dimension to cut into blocks)"
            )
        scale = mx_scale(x, fmt, block_size)
    elif scaling == "tensor":
        scale = scale_for(amax_of(x), fmt)
    elif scaling == "delayed":
        scale = history.scale(fmt)
        history.record(amax_of(x))
    else:
        scale = x.new_ones(())
    scaled = x * per_value(scale, x.shape, block_size)
    data = scaled.clamp(-fmt.max, fmt.max).to(fmt.dtype)
    overflows = (scaled.abs() > fmt.max).sum()
    underflows = ((data == 0) & (x != 0)).sum()
    return FP8Cast(data, scale, block_size, overflows, underflows)


def dequantize_fp8(data: Tensor, scale: Tensor, block_size: int | None = None) -> Tensor:
    r"""The float32 values :math:`\hat x = q / s` of FP8 ``data`` under ``scale`` (one per
    tensor, or one per block of ``block_size`` values along the last dimension)."""
    return data.float() / per_value(scale, data.shape, block_size)


def fp8_round_trip(
    x: Tensor,
    format: str = "e4m3",
    scaling: str = "tensor",
    *,
    block_size: int | None = None,
    history: DelayedScaling | None = None,
) -> tuple[Tensor, Tensor]:
    r"""``x`` cast to FP8 with the named scaling and back: ``(x_hat, scale)``, the float32
    tensor :math:`\hat x = \operatorname{sat}(\operatorname{RN}(x s)) / s` and the scale
    :math:`s` (arguments as :func:`quantize_fp8`, whose result also counts what was lost)."""
    q = quantize_fp8(x, format, scaling, block_size=block_size, history=history)
    return q.dequantize(), q.scale


# -- the layer ----------------------------------------------------------------------------


class _FP8Matmul(torch.autograd.Function):
    """:math:`y = \\hat x \\hat W^\\top + b`; backward with :math:`\\hat g` (see FP8Linear)."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        xq, wq = layer.cast("input", x), layer.cast("weight", weight)
        # the FP8 bytes are what the backward pass keeps, one a value, as on an FP8 GPU
        ctx.save_for_backward(xq.data, xq.scale, wq.data, wq.scale)
        ctx.layer, ctx.block_size = layer, xq.block_size
        ctx.dtypes = x.dtype, weight.dtype, None if bias is None else bias.dtype
        b = None if bias is None else bias.float()
        return F.linear(xq.dequantize(), wq.dequantize(), b).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        x_data, x_scale, w_data, w_scale = ctx.saved_tensors
        x_hat = dequantize_fp8(x_data, x_scale, ctx.block_size)
        w_hat = dequantize_fp8(w_data, w_scale, ctx.block_size)
        g_hat = ctx.layer.cast("grad_output", grad_y).dequantize()
        need_x, need_w, need_b, _ = ctx.needs_input_grad
        dtypes = ctx.dtypes
        grad_x = (g_hat @ w_hat).to(dtypes[0]) if need_x else None
        rows = g_hat.reshape(-1, g_hat.shape[-1]).T  # every token's gradient, summed over
        grad_w = (rows @ x_hat.reshape(-1, x_hat.shape[-1])).to(dtypes[1]) if need_w else None
        # the bias's gradient from g itself, before the cast (Transformer Engine's fused
        # cast computes it from the high-precision gradient too)
        grad_b = grad_y.reshape(-1, grad_y.shape[-1]).sum(0).to(dtypes[2]) if need_b else None
        return grad_x, grad_w, grad_b, None


class FP8Linear(nn.Linear):
    r"""An ``nn.Linear`` whose products take FP8 operands, emulated in float32 (no speed):

    .. math::
        y = \hat x \hat W^\top + b, \qquad
        \partial x = \hat g \hat W, \qquad \partial W = \hat g^\top \hat x, \qquad
        \partial b = \textstyle\sum g,

    :math:`\hat x, \hat W` cast to ``forward_format`` (e4m3), the output's gradient
    :math:`g` to ``backward_format`` (e5m2): the hybrid recipe of Micikevicius et al.
    (2022). Each operand has its own scale by ``scaling`` (``"none"``, ``"tensor"``,
    ``"delayed"`` with ``history_len`` maxima each, or ``"mx"`` with blocks of
    ``block_size`` along the last dimension; :func:`quantize_fp8`). With MX scaling the
    backward products reuse the forward's blocks, which run along the input dimension; MX
    hardware wants blocks along each product's summed dimension and casts :math:`W` and
    :math:`x` once more for the backward pass (Rouhani et al., 2023), which rounds a little
    differently. The
    weight stays float32 (the master weights); its cast is redone at every call.

    The buffer ``counts`` (int64, one row per operand of :data:`OPERANDS`, columns: values
    cast, overflows, underflows) accumulates over calls; :func:`fp8_counts` sums a model's.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        scaling: str = "tensor",
        forward_format: str = "e4m3",
        backward_format: str = "e5m2",
        *,
        history_len: int | None = None,
        block_size: int | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.scaling = check_choice("scaling", scaling, SCALINGS)
        self.forward_format = check_choice("forward_format", forward_format, tuple(FORMATS))
        self.backward_format = check_choice("backward_format", backward_format, tuple(FORMATS))
        if history_len is not None and scaling != "delayed":
            raise ValueError(
                f"Invalid history_len: {history_len!r} with scaling={scaling!r} (a history "
                "belongs to scaling='delayed' only)"
            )
        if block_size is not None and scaling != "mx":
            raise ValueError(
                f"Invalid block_size: {block_size!r} with scaling={scaling!r} (a block size "
                "belongs to scaling='mx' only)"
            )
        self.block_size = None
        if scaling == "mx":
            self.block_size = check_int(
                "block_size", MX_BLOCK if block_size is None else block_size, 1
            )
        self.history_len = None
        if scaling == "delayed":
            self.history_len = check_int(
                "history_len", HISTORY_LEN if history_len is None else history_len, 1
            )
        self.reset_fp8_state()

    def reset_fp8_state(self) -> None:
        """Zero the counts and (with delayed scaling) empty the histories, on the weight's
        device."""
        device = self.weight.device
        self.histories = None
        if self.scaling == "delayed":
            self.histories = nn.ModuleDict(
                {op: DelayedScaling(self.history_len, device=device) for op in OPERANDS}
            )
        counts = torch.zeros(len(OPERANDS), 3, dtype=torch.int64, device=device)
        self.register_buffer("counts", counts, persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **options) -> FP8Linear:
        """An FP8Linear holding ``linear``'s own parameters (the same tensors: an optimizer
        built before, or a weight tied elsewhere, keeps working); ``options`` as the class's."""
        has_bias = linear.bias is not None
        # made on the meta device: no weights of its own, the linear's are put in
        layer = cls(linear.in_features, linear.out_features, has_bias, device="meta", **options)
        layer.weight, layer.bias = linear.weight, linear.bias
        layer.reset_fp8_state()
        return layer

    def cast(self, operand: str, x: Tensor) -> FP8Cast:
        """``x`` cast as ``operand`` (one of :data:`OPERANDS`) is cast; its counts added."""
        i = OPERANDS.index(operand)
        fmt = self.backward_format if operand == "grad_output" else self.forward_format
        history = None if self.histories is None else self.histories[operand]
        q = quantize_fp8(x, fmt, self.scaling, block_size=self.block_size, history=history)
        with torch.no_grad():
            self.counts[i, 0] += x.numel()
            self.counts[i, 1] += q.overflows
            self.counts[i, 2] += q.underflows
        return q

    def forward(self, x: Tensor) -> Tensor:
        return _FP8Matmul.apply(x, self.weight, self.bias, self)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, scaling={self.scaling!r}, "
            f"forward_format={self.forward_format!r}, backward_format={self.backward_format!r}"
        )


def convert_to_fp8(
    model: nn.Module, scaling: str = "tensor", *, keep: Collection[str] = (), **options
) -> nn.Module:
    """Swap ``model``'s ``nn.Linear`` layers for :class:`FP8Linear` with ``scaling`` (and
    ``options``: formats, ``history_len``, ``block_size``), in place, keeping their
    parameters; the layers named in ``keep`` (qualified names, as ``named_modules`` gives
    them: ``{"head"}`` keeps a GPT's output layer in float32, as FP8 recipes usually do)
    stay as they are. Returns ``model`` (the new layer when ``model`` is itself a linear)."""
    linears = {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and not isinstance(m, FP8Linear)
    }
    unknown = sorted(set(keep) - set(linears))
    if unknown:
        raise ValueError(
            f"Invalid keep: {unknown} (expected names of the model's linear layers: "
            f"{sorted(linears)})"
        )
    for name, linear in linears.items():
        if name in keep:
            continue
        layer = FP8Linear.from_linear(linear, scaling=scaling, **options)
        if name == "":
            return layer
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
    return model


def fp8_counts(model: nn.Module) -> dict[str, dict[str, int]]:
    """Values cast, overflows and underflows of each operand (:data:`OPERANDS`), summed over
    ``model``'s :class:`FP8Linear` layers since they were made (or their ``counts`` zeroed)."""
    total = sum(
        (m.counts.cpu() for m in model.modules() if isinstance(m, FP8Linear)),
        torch.zeros(len(OPERANDS), 3, dtype=torch.int64),
    )
    return {
        op: dict(zip(("values", "overflows", "underflows"), row.tolist()))
        for op, row in zip(OPERANDS, total)
    }
