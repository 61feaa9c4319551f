r"""Muon: momentum, orthogonalized by a Newton–Schulz iteration, for the hidden matrices;
AdamW for every other parameter, in the same optimizer.

Muon (Jordan et al., 2024, "Muon: An optimizer for hidden layers in neural networks",
https://kellerjordan.github.io/posts/muon/) replaces each 2-D update :math:`D = U S V^\top`
by (nearly) its orthogonal factor :math:`U V^\top`: the step of steepest descent under the
spectral norm (Bernstein and Newhouse, 2024, "Old Optimizer, New Norm: An Anthology",
arXiv:2409.20325), which moves every direction of the layer's input-output map by the same
amount however unequal the gradient's singular values. For a weight :math:`W` of shape
:math:`m \times n` with gradient :math:`G_t`:

.. math::
    B_t &= \mu\, B_{t-1} + (1-\mu)\, G_t \qquad (B_0 = 0) \\
    D_t &= (1-\mu)\, G_t + \mu\, B_t \quad\text{(Nesterov)} \qquad D_t = B_t
           \quad\text{(otherwise)} \\
    O_t &= \mathrm{NS}_k(D_t), \qquad X_0 = D_t / \max(\|D_t\|_F, \epsilon), \qquad
           X_{j+1} = a X_j + (b A_j + c A_j^2)\, X_j, \quad A_j = X_j X_j^\top \\
    W_t &= (1 - \eta\lambda)\, W_{t-1} - \eta\, s(m, n)\, O_t, \qquad
           s(m, n) = 0.2\sqrt{\max(m, n)}

The quintic iteration maps each singular value :math:`\sigma` of :math:`X_0` (all at most 1
after the Frobenius normalization) through :math:`p(\sigma) = a\sigma + b\sigma^3 +
c\sigma^5`, keeping the singular vectors; Jordan et al.'s coefficients
:math:`(a, b, c) = (3.4445, -4.7750, 2.0315)` maximize the slope at zero, so that five steps
lift small singular values, at the price of not converging to 1: five steps send every
:math:`\sigma \ge 0.002` into :math:`[0.68, 1.21]` (Jordan et al.: roughly 0.7 to 1.2),
which trains as well as the exact :math:`U V^\top`. The iteration runs on :math:`X^\top`
when :math:`m > n`, so that :math:`A_j` is the smaller Gram matrix.

**The shape scaling** :math:`s(m, n)` is Liu et al.'s (2025, "Muon is Scalable for LLM
Training", Moonshot AI, arXiv:2502.16982): an orthogonal :math:`m \times n` matrix has RMS
:math:`1/\sqrt{\max(m, n)}`, so :math:`0.2\sqrt{\max(m, n)}\, O_t` has RMS 0.2 whatever the
shape, the RMS of a typical AdamW update; AdamW's learning rate and weight decay then carry
over to Muon unchanged, and the parameters given to AdamW in the same optimizer share them.
``adjust_lr_fn`` offers torch.optim.Muon's two choices under its names:
``"match_rms_adamw"`` (Liu et al.; the default here) and ``"original"`` (Jordan et al.'s
:math:`s = \sqrt{\max(1, m/n)}`, torch.optim.Muon's default, also given by ``None``).

**What Muon must not touch.** Embeddings, the output layer, gains and biases are not hidden
maps (an embedding row is a lookup, not a direction; a vector has no singular values), and
Jordan et al. and Liu et al. train them with AdamW. A group with ``use_muon=False`` runs
AdamW's arithmetic (:func:`~lsdl_lab.optim.pieces.adam_moments_`,
:func:`~lsdl_lab.optim.pieces.adam_step_` and the other pieces of
:class:`~lsdl_lab.optim.AdamW`, bit for bit torch.optim.AdamW); a group with
``use_muon=True`` (the default) takes parameters of two dimensions or more, and refuses a
vector or a scalar by name. :func:`muon_param_groups` splits a model that way.

**Convolution kernels** (an opt-in: ``muon_param_groups(model, conv=True)``). A kernel of
shape :math:`c_\text{out} \times c_\text{in} \times k_h \times k_w` is a linear map from
the :math:`c_\text{in} k_h k_w` numbers of an input patch to the :math:`c_\text{out}`
channels of an output pixel, so Muon orthogonalizes its update viewed as out ×
(in·kh·kw), as Jordan et al.'s implementation flattens conv filters, and views the result
back; the shape scaling is Liu et al.'s computed on that 2-D view,
:math:`s(c_\text{out}, c_\text{in} k_h k_w)`. Every tensor of more than two dimensions is
flattened that way (all but the first dimension), so a kernel's step equals, bit for bit,
the step of the same numbers laid out as the matrix (tests/optim/test_muon.py). By default
:func:`muon_param_groups` gives kernels to AdamW, as Liu et al. and torch.optim.Muon do.

**The variant, and where it departs.** The momentum and the iteration are Jordan et al.'s
reference and torch.optim.Muon's, operation for operation: an exponential average of the
gradients (``lerp``), the Nesterov direction ``G.lerp(B, mu)``, the iteration in bfloat16
by default (``ns_dtype``; ``None`` computes in the parameter's own dtype), the Frobenius
norm clamped at ``eps`` (Jordan et al. add ``eps`` instead; the difference is below
bfloat16's resolution), the decay :math:`1 - \eta\lambda` with the unscaled learning rate.
With ``adjust_lr_fn`` and ``weight_decay`` given alike, the matrices' steps equal
torch.optim.Muon's (tests/optim/test_muon.py). Departures: Liu et al.'s scaling is the
default (torch's is Jordan et al.'s), ``weight_decay`` defaults to 0 (torch: 0.1),
``momentum`` must lie in [0, 1) (torch accepts any :math:`\mu \ge 0`); and a group with
``use_muon=True`` takes convolution kernels, flattened as above (torch.optim.Muon refuses
them), though :func:`muon_param_groups` gives them to AdamW unless asked.

**Cost** (exact, from :func:`newton_schulz`; counted by ``torch.utils.flop_counter`` in the
tests). For an :math:`m \times n` matrix with :math:`m \le n` (after the transpose), each of
the :math:`k` iterations multiplies :math:`X X^\top` (:math:`2m^2n` FLOPs), :math:`A A`
(:math:`2m^3`) and :math:`B X` (:math:`2m^2n`): :math:`k(4m^2n + 2m^3)` FLOPs, 30
:math:`m^3` for a square matrix at :math:`k = 5`, and a step's only matrix products. The rest
of the step is elementwise passes over the :math:`m \times n` matrix, a few FLOPs per element
each (two ``lerp``, the decay, the scaled add, the norm and the division, and two casts in
bfloat16), about ten FLOPs per element, :math:`O(mn)`; the products' epilogues
(:math:`aX`, :math:`bA`) add :math:`k(mn + m^2)` more. The ratio is about
:math:`k(4m + 2m^2/n)/10`, hundreds for the book's GPT (:math:`m = 256`: about 770 for a
square matrix), so Muon's step is bound by matrix products, not by memory traffic as
AdamW's is; against a training step's :math:`6\,B\,mn` FLOPs per matrix (:math:`B` tokens
per batch), the iteration adds :math:`k(4m^2n + 2m^3)/(6Bmn)`, :math:`5m/B` for a square
matrix (Jordan et al.'s :math:`Tm/B`). The state is one buffer per matrix (4 bytes per
float32 parameter, SGD with momentum's), AdamW's two for the others.

**Under ZeRO or FSDP** every matrix must be whole where its iteration runs: :math:`X X^\top`
couples all of its rows and columns, so a flat or row-wise shard cannot be orthogonalized
by itself. Each Muon matrix then costs one all-gather of its update, on top of the
sharded gradient's reduce-scatter: Liu et al.'s Distributed Muon gathers each matrix's
update within the data-parallel group, runs the iteration on every rank and keeps the rank's
shard of the result; Jordan et al.'s reference gives whole matrices to the ranks round robin
and all-gathers the orthogonalized results. AdamW's parameters shard as usual.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from .._util import check_bool, check_choice, check_int, check_nonnegative, check_real
from .base import Optimizer
from .pieces import adam_moments_, adam_step_, add_scaled_, decoupled_weight_decay_

__all__ = ["Muon", "muon_param_groups", "newton_schulz", "newton_schulz_flops", "shape_scale"]

#: Jordan et al.'s quintic coefficients (a, b, c): the largest slope at zero that still
#: keeps five steps' output in about [0.7, 1.2]
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
#: torch.optim.Muon's choices of the shape scaling (``None`` is its default, "original")
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def newton_schulz(
    G: Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    dtype: torch.dtype | None = torch.bfloat16,
) -> Tensor:
    r"""The quintic Newton–Schulz iteration on a matrix ``G``: nearly its orthogonal factor
    :math:`U V^\top` (singular values in about [0.7, 1.2], the same singular vectors), in
    ``G``'s dtype, computed in ``dtype`` (``None``: ``G``'s own).

    .. math::
        X_0 = G / \max(\|G\|_F, \epsilon), \qquad A_j = X_j X_j^\top, \qquad
        X_{j+1} = a X_j + (b A_j + c A_j^2)\, X_j

    on :math:`G^\top` when :math:`G` has more rows than columns.
    """
    a, b, c = coefficients
    X = G.to(dtype or G.dtype)
    tall = G.size(0) > G.size(1)
    if tall:  # A = X X^T is then the smaller Gram matrix: min(m, n) squared
        X = X.T
    X = X / X.norm().clamp(min=eps)  # every singular value now at most 1
    for _ in range(steps):
        A = X @ X.T
        B = torch.addmm(A, A, A, beta=b, alpha=c)  # b A + c A^2
        X = torch.addmm(X, B, X, beta=a)  # a X + B X
    return (X.T if tall else X).to(G.dtype)


def newton_schulz_flops(shape: Sequence[int], steps: int = 5) -> int:
    r"""The FLOPs of :func:`newton_schulz`'s matrix products on a matrix of ``shape``:
    :math:`k(4m^2n + 2m^3)`, :math:`m = \min`, :math:`n = \max` of the two sides."""
    m, n = sorted(shape)
    return steps * (4 * m * m * n + 2 * m**3)


def shape_scale(shape: Sequence[int], adjust_lr_fn: str | None = "match_rms_adamw") -> float:
    r"""The factor on the learning rate of an orthogonalized update of ``shape`` (torch's
    ``adjust_lr_fn``): :math:`0.2\sqrt{\max(m, n)}` (``"match_rms_adamw"``, Liu et al.: the
    update's RMS is AdamW's 0.2) or :math:`\sqrt{\max(1, m/n)}` (``"original"`` or ``None``,
    Jordan et al.)."""
    m, n = shape
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(m, n))
    return math.sqrt(max(1, m / n))


def check_coefficients(coefficients) -> tuple:
    """Three finite numbers (a, b, c)."""
    message = f"Invalid ns_coefficients: {coefficients!r} (expected three finite numbers (a, b, c))"
    if isinstance(coefficients, (str, bytes)) or not isinstance(coefficients, Sequence):
        raise TypeError(message)
    if len(coefficients) != 3:
        raise ValueError(message)
    for x in coefficients:
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise TypeError(message)
        if not math.isfinite(x):
            raise ValueError(message)
    return tuple(coefficients)


class Muon(Optimizer):
    r"""Muon for the groups with ``use_muon=True`` (the default; matrices, and kernels of more
    dimensions viewed as out × (in·kh·kw): two dimensions or more), AdamW for those with
    ``use_muon=False`` (embeddings, the output layer, gains and biases:
    :func:`muon_param_groups` makes the two groups).

    Muon's hyperparameters: ``momentum`` :math:`\mu \in [0, 1)`, ``nesterov``, ``ns_steps``
    (an int >= 1), ``ns_coefficients``, ``eps`` (the normalization's floor, torch.optim.Muon's
    name), ``adjust_lr_fn``, ``ns_dtype``; AdamW's: ``betas`` and ``adamw_eps`` (``eps`` is
    Muon's, as in torch.optim.Muon). ``lr`` and ``weight_decay`` (decoupled) are both's: with
    Liu et al.'s scaling, AdamW's values carry over.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        *,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.0,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        adjust_lr_fn: str | None = "match_rms_adamw",
        ns_dtype: torch.dtype | None = torch.bfloat16,
        betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        foreach: bool = True,
        compile: bool = False,
    ):
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            weight_decay=weight_decay,
            ns_coefficients=ns_coefficients,
            eps=eps,
            adjust_lr_fn=adjust_lr_fn,
            ns_dtype=ns_dtype,
            betas=betas,
            adamw_eps=adamw_eps,
            use_muon=True,
        )
        super().__init__(params, defaults, foreach, compile)

    def check(self, group):
        check_real("momentum value", group["momentum"], 0.0, 1.0, high_open=True)
        check_int("ns_steps", group["ns_steps"], 1)
        check_coefficients(group["ns_coefficients"])
        check_choice("adjust_lr_fn", group["adjust_lr_fn"], ADJUST_LR_FNS)
        dtype = group["ns_dtype"]
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(
                f"Invalid ns_dtype: {dtype!r} (expected a floating torch.dtype or None)"
            )
        check_nonnegative("adamw_eps value", group["adamw_eps"])
        if check_bool("use_muon", group["use_muon"]):
            params = group.get("params", ())  # none in the defaults
            for name, p in zip(group.get("param_names") or [None] * len(params), params):
                if p.ndim < 2:
                    what = "a parameter" if name is None else f"the parameter {name!r}"
                    raise ValueError(
                        f"Invalid params: {what} of shape {tuple(p.shape)} in a group with "
                        "use_muon=True (expected two dimensions or more: a matrix, or a kernel "
                        "viewed as out x rest; give vectors and scalars to AdamW in a group "
                        "with use_muon=False, as muon_param_groups does)"
                    )

    def update(self, group, params, grads):
        r"""Muon's step on a group with ``use_muon=True`` (Jordan et al., 2024; the shape
        scaling :math:`s` of Liu et al., 2025), AdamW's (:meth:`adamw_update`) otherwise:

        .. math::
            B_t &= \mu\, B_{t-1} + (1-\mu)\, G_t \\
            D_t &= (1-\mu)\, G_t + \mu\, B_t \quad\text{(Nesterov; otherwise } D_t = B_t) \\
            W_{t-1} &\leftarrow (1 - \eta\lambda)\, W_{t-1} \\
            W_t &= W_{t-1} - \eta\, s(m, n)\, \mathrm{NS}_k(D_t)

        with :math:`D_t` of a kernel viewed as the :math:`m \times n` matrix out × (in·kh·kw),
        and :math:`\mathrm{NS}_k(D_t)` viewed back.
        """
        if not group["use_muon"]:
            self.adamw_update(group, params, grads)
            return
        lr, mu, lam = group["lr"], group["momentum"], group["weight_decay"]
        B = self.buffer(params, "momentum_buffer")
        torch._foreach_lerp_(B, grads, 1 - mu)
        D = torch._foreach_lerp(grads, B, mu) if group["nesterov"] else B
        decoupled_weight_decay_(params, lr, lam)
        # one matrix at a time: the iteration is matrix products, which have no foreach form
        for W, D_W in zip(params, D):
            D_W = D_W.flatten(1)  # a kernel as out x (in*kh*kw), as Jordan et al. flatten it
            O_W = newton_schulz(
                D_W, group["ns_steps"], group["ns_coefficients"], group["eps"], group["ns_dtype"]
            )
            scale = shape_scale(D_W.shape, group["adjust_lr_fn"])
            add_scaled_([W], [O_W.reshape(W.shape)], -lr * scale)

    def adamw_update(self, group, params, grads):
        r"""AdamW's step (Loshchilov and Hutter, 2019), as :class:`~lsdl_lab.optim.AdamW`
        computes it (its pieces, in its order), for a group with ``use_muon=False``:

        .. math::
            w_{t-1} &\leftarrow (1 - \eta\lambda)\, w_{t-1} \\
            m_t &= \beta_1 m_{t-1} + (1-\beta_1)\, g_t, \qquad
            v_t = \beta_2 v_{t-1} + (1-\beta_2)\, g_t^2 \\
            w_t &= w_{t-1} - \frac{\eta}{1-\beta_1^t}\,
            \frac{m_t}{\sqrt{v_t / (1-\beta_2^t)} + \epsilon}
        """
        (beta1, beta2), lr, lam = group["betas"], group["lr"], group["weight_decay"]
        m = self.buffer(params, "exp_avg")
        v = self.buffer(params, "exp_avg_sq")
        t = self.count_steps(params)
        decoupled_weight_decay_(params, lr, lam)
        adam_moments_(m, v, grads, beta1, beta2)
        adam_step_(params, m, v, t, lr, beta1, beta2, group["adamw_eps"])


def muon_param_groups(
    model: nn.Module | Iterable[Tensor],
    adamw: Iterable[str | Tensor] = (),
    *,
    conv: bool = False,
    **adamw_options,
) -> list[dict]:
    """Parameter groups for :class:`Muon`: the hidden matrices in a group with
    ``use_muon=True``; in a group with ``use_muon=False`` (and ``adamw_options``, e.g.
    ``betas``) everything else: the parameters of every ``nn.Embedding``, those of the output
    layer (the model's last ``nn.Linear``; the GPT's is tied to its token embedding), every
    parameter that is not 2-D (biases, LayerNorm and BatchNorm gains, convolution kernels),
    and those ``adamw`` marks (by parameter, by name, or by the name of a module that holds
    them). With ``conv=True`` the parameters of more than two dimensions (convolution
    kernels) go to Muon too, viewed as out × (in·kh·kw) (Jordan et al.'s CIFAR-10 runs);
    the default, ``False``, is Liu et al.'s and torch.optim.Muon's split.

    ``model`` may also be a list of parameters or of (name, parameter) pairs (no modules):
    then only the number of dimensions and ``adamw``'s marks decide. Frozen parameters and
    empty groups are left out; named parameters stay named (torch.optim's ``param_names``),
    a module's tied ones once.
    """
    conv = check_bool("conv", conv)
    marked = list(adamw)
    names = [x for x in marked if isinstance(x, str)]
    tensors = {id(x) for x in marked if isinstance(x, Tensor)}
    if isinstance(model, nn.Module):
        items = list(model.named_parameters())
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
        for module in embeddings + linears[-1:]:
            tensors.update(id(p) for p in module.parameters())
    else:  # parameters, or (name, parameter) pairs
        items = [x if isinstance(x, tuple) else (None, x) for x in model]

    def to_adamw(name, p) -> bool:
        by_name = name is not None and any(name == x or name.startswith(x + ".") for x in names)
        not_a_map = p.ndim < 2 or (p.ndim > 2 and not conv)
        return not_a_map or id(p) in tensors or by_name

    def entry(name, p):
        return p if name is None else (name, p)

    items = [(name, p) for name, p in items if p.requires_grad]
    groups = [
        dict(params=[entry(n, p) for n, p in items if not to_adamw(n, p)], use_muon=True),
        dict(params=[entry(n, p) for n, p in items if to_adamw(n, p)], use_muon=False,
             **adamw_options),
    ]  # fmt: skip
    return [g for g in groups if g["params"]]
