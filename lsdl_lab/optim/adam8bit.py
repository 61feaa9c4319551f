r"""Adam with 8-bit states (Dettmers, Lewis, Shleifer and Zettlemoyer, 2022, "8-bit Optimizers
via Block-wise Quantization", ICLR): Adam's two moments kept as one byte a value.

Adam keeps two float32 numbers per parameter, 8 bytes, twice the parameter itself; for a
billion parameters 8 GB, which the paper brings to 2 GB. Here each moment of a parameter
of at least ``min_8bit_size`` values is kept block-wise quantized
(:mod:`lsdl_lab.memory.quantize`): a ``uint8`` index per value into a dynamic map and a
float32 scale per block of :math:`B` values (``block_size``, the paper's 2048), the first
moment with the signed map, the second with the unsigned one, so that it stays
non-negative. Each step decodes the moments, runs Adam's update in full precision, and
encodes the new moments:

.. math::
    \tilde m_{t-1} &= \mathrm{D}(\mathrm{Q}_\pm(m_{t-1})), \qquad
    \tilde v_{t-1} = \mathrm{D}(\mathrm{Q}_+(v_{t-1})) \\
    m_t &= \beta_1 \tilde m_{t-1} + (1-\beta_1)\, g_t, \qquad
    v_t = \beta_2 \tilde v_{t-1} + (1-\beta_2)\, g_t^2 \\
    w_t &= w_{t-1} - \frac{\eta}{1-\beta_1^t}\,
           \frac{m_t}{\sqrt{v_t / (1-\beta_2^t)} + \epsilon}, \qquad
    \text{then store } \mathrm{Q}_\pm(m_t),\ \mathrm{Q}_+(v_t)

(Q: quantize block-wise, D: decode; :math:`\pm` the signed map, :math:`+` the unsigned).
The step itself uses the exact :math:`m_t, v_t`, as bitsandbytes's kernels do; rounding
touches only what is kept for the next step, within half a gap of its map times the
block's maximum (0.70% of it for :math:`m`, 0.35% for :math:`v`). The first step is Adam's
to the bit (the moments start at an exact zero).

**Bytes per parameter**: :math:`2 + 8/B` for the two moments (a byte each, and two float32
scales per block), :math:`2.004` at :math:`B = 2048`, against Adam's 8
(``tests/optim/test_adam8bit.py`` counts the state's tensors). **Small tensors** (fewer than
``min_8bit_size`` values, bitsandbytes's 4096 by default: biases, LayerNorm gains, small
embeddings) keep Adam's full-precision states, in the parameter's dtype as Adam's: their
share of the bytes is small, and a block's scale would cost more there; they take Adam's
steps to the bit. Which form a parameter's state takes is decided once, when it is created.

**Weight decay** as :class:`~lsdl_lab.optim.Adam`'s: coupled (:math:`g_t + \lambda w_{t-1}`)
by default, decoupled with ``decoupled_weight_decay=True`` (:class:`AdamW8bit`), so that the
8-bit run differs from the float32 run by the rounding of the states alone. (bitsandbytes's
``Adam8bit`` decays decoupled, after the step.) No AMSGrad. ``compile=True`` warns and
runs the eager update (:attr:`Adam8bit.not_compilable` says why).

**What the paper adds** that is not here: a stable embedding layer (a LayerNorm after the
embedding, initialized by Xavier) for language models, whose embedding gradients are the
most non-uniform; and CUDA kernels that decode, update and encode each block in one pass.
Here the steps are ``torch`` operations: the decoded moments are full-precision temporaries
of one parameter at a time with ``foreach=False``, of a group with ``foreach=True``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._util import check_int
from ..memory.quantize import (
    BLOCK_SIZE,
    MIN_8BIT_SIZE,
    dequantize_blockwise,
    dynamic_map,
    quantize_blockwise,
)
from .base import Optimizer
from .pieces import adam_step_, decayed_adam_moments_

# MIN_8BIT_SIZE, the fewest values a parameter needs for 8-bit states, is the quantization's
# (lsdl_lab.memory.quantize, which the memory calculator reads too); re-exported here
__all__ = ["Adam8bit", "AdamW8bit", "MIN_8BIT_SIZE"]

#: the state of a parameter with 8-bit moments: (codes, block scales) of m, then of v
QUANTIZED = ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax")


class Adam8bit(Optimizer):
    """Adam whose moments are kept in 8 bits, block-wise (``block_size`` values a block), for
    every parameter of at least ``min_8bit_size`` values; coupled (L2) weight decay, or
    decoupled with ``decoupled_weight_decay=True``: :class:`AdamW8bit`.

    State per parameter: ``exp_avg_codes`` and ``exp_avg_sq_codes`` (``uint8``, one per
    value, flattened) and ``exp_avg_absmax`` and ``exp_avg_sq_absmax`` (float32, one per
    block); or, for a smaller one, Adam's ``exp_avg`` and ``exp_avg_sq``.
    """

    not_compilable = (
        "its update decodes and encodes each parameter's 8-bit state apart (checked "
        "arguments, a binary search, a table lookup), which torch.compile(fullgraph=True) "
        "did not trace as one graph when tried (torch 2.13, CPU)"
    )

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        block_size: int = BLOCK_SIZE,
        min_8bit_size: int = MIN_8BIT_SIZE,
        foreach: bool = True,
        compile: bool = False,
        decoupled_weight_decay: bool = False,
    ):
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            block_size=block_size,
            min_8bit_size=min_8bit_size,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        self.maps: dict[tuple[bool, torch.device], Tensor] = {}
        super().__init__(params, defaults, foreach, compile)

    def check(self, group):
        check_int("block_size", group["block_size"], 1)
        check_int("min_8bit_size", group["min_8bit_size"], 0)

    def update(self, group, params, grads):
        r"""Adam's step (Kingma and Ba, 2015) on moments decoded from 8 bits and encoded back
        (Dettmers et al., 2022); coupled or decoupled weight decay as Adam's:

        .. math::
            g_t &\leftarrow g_t + \lambda\, w_{t-1} \quad\text{(coupled)} \qquad
            w_{t-1} \leftarrow (1 - \eta\lambda)\, w_{t-1} \quad\text{(decoupled)} \\
            m_t &= \beta_1 \tilde m_{t-1} + (1-\beta_1)\, g_t, \qquad
            v_t = \beta_2 \tilde v_{t-1} + (1-\beta_2)\, g_t^2 \\
            w_t &= w_{t-1} - \frac{\eta}{1-\beta_1^t}\,
            \frac{m_t}{\sqrt{v_t / (1-\beta_2^t)} + \epsilon} \\
            &\text{keep } \mathrm{Q}_\pm(m_t),\ \mathrm{Q}_+(v_t)
            \quad\text{(so that } \tilde m_t = \mathrm{D}(\mathrm{Q}_\pm(m_t)),\
            \tilde v_t = \mathrm{D}(\mathrm{Q}_+(v_t)))
        """
        (beta1, beta2), lr, eps = group["betas"], group["lr"], group["eps"]
        lam, decoupled = group["weight_decay"], group["decoupled_weight_decay"]
        m, v = self.decoded_moments(group, params)
        t = self.count_steps(params)
        decayed_adam_moments_(
            params, grads, m, v, beta1, beta2, lr=lr, lam=lam, decoupled=decoupled
        )
        adam_step_(params, m, v, t, lr, beta1, beta2, eps)
        self.encode_moments(group, params, m, v)

    def decoded_moments(self, group, params) -> tuple[list[Tensor], list[Tensor]]:
        r""":math:`\tilde m_{t-1}` and :math:`\tilde v_{t-1}` of each parameter: decoded (new
        tensors) from its 8-bit state, or its full-precision state itself; the state is
        created on first use, as exact zeros, 8-bit when the parameter has at least
        ``min_8bit_size`` values."""
        size = group["block_size"]
        m, v = [], []
        for p in params:
            state = self.state[p]
            if "exp_avg" not in state and "exp_avg_codes" not in state:
                if p.numel() >= group["min_8bit_size"]:
                    zeros = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_codes"], state["exp_avg_absmax"] = quantize_blockwise(
                        zeros, self.map(True, p.device), size
                    )
                    state["exp_avg_sq_codes"], state["exp_avg_sq_absmax"] = quantize_blockwise(
                        zeros, self.map(False, p.device), size
                    )
                else:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if "exp_avg" in state:
                m.append(state["exp_avg"])
                v.append(state["exp_avg_sq"])
                continue
            for out, name, signed in ((m, "exp_avg", True), (v, "exp_avg_sq", False)):
                decoded = dequantize_blockwise(
                    state[name + "_codes"], state[name + "_absmax"], self.map(signed, p.device),
                    p.shape, size,
                )  # fmt: skip
                out.append(decoded.to(p.dtype))
        return m, v

    def encode_moments(self, group, params, m, v) -> None:
        """Store each 8-bit parameter's new moments :math:`m_t, v_t` as their codes and block
        scales (the full-precision states were updated in place)."""
        for p, m_p, v_p in zip(params, m, v):
            state = self.state[p]
            if "exp_avg" in state:
                continue
            for x, name, signed in ((m_p, "exp_avg", True), (v_p, "exp_avg_sq", False)):
                codes, absmax = quantize_blockwise(
                    x, self.map(signed, p.device), group["block_size"]
                )
                state[name + "_codes"].copy_(codes)
                state[name + "_absmax"].copy_(absmax)

    def map(self, signed: bool, device: torch.device) -> Tensor:
        """The dynamic map (signed for m, unsigned for v) on ``device``, made once."""
        key = (signed, device)
        if key not in self.maps:
            self.maps[key] = dynamic_map(signed).to(device)
        return self.maps[key]

    def load_state_dict(self, state_dict: dict) -> None:
        """torch.optim's, except that the 8-bit state keeps its dtypes: torch casts every
        state tensor of a floating parameter to the parameter's dtype, which would make the
        codes floats (and the block scales of a bfloat16 parameter lossy)."""
        super().load_state_dict(state_dict)
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        ours = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved, ours):
            for name in QUANTIZED:
                if name in state_dict["state"].get(i, {}):
                    value = state_dict["state"][i][name]
                    self.state[p][name] = value.to(device=p.device, copy=True)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.maps = {}


class AdamW8bit(Adam8bit):
    """Adam8bit with decoupled weight decay (Loshchilov and Hutter, 2019):
    ``Adam8bit(..., decoupled_weight_decay=True)`` with torch.optim.AdamW's defaults."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        block_size: int = BLOCK_SIZE,
        min_8bit_size: int = MIN_8BIT_SIZE,
        foreach: bool = True,
        compile: bool = False,
    ):
        super().__init__(
            params, lr, betas, eps, weight_decay, block_size=block_size,
            min_8bit_size=min_8bit_size, foreach=foreach, compile=compile,
            decoupled_weight_decay=True,
        )  # fmt: skip
