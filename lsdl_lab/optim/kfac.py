r"""K-FAC: Kronecker-factored approximate curvature (Martens and Grosse, 2015), for
``nn.Linear`` and ``nn.Conv2d`` layers (Grosse and Martens, 2016, "KFC").

For a layer :math:`s = W a` (the bias folded into :math:`W` as its last column, with a
constant 1 appended to the input :math:`a`), the Fisher block of :math:`W` is approximated
by a Kronecker product of two small matrices, the second moments of the layer's inputs
and of the gradients with respect to its outputs:

.. math::
    F_W \approx G \otimes A, \qquad
    A = \mathbb{E}[a a^\top], \qquad G = \mathbb{E}[g g^\top], \quad g = \nabla_s \ell(y)

(with :math:`\operatorname{vec}` taken row by row of the ``(out, in + 1)`` matrix). For a
convolution, :math:`a` runs over the input patches and :math:`g` over the output
positions (Grosse and Martens, 2016): :math:`A` averages over examples and positions,
:math:`G` sums over positions and averages over examples, the normalization of
curvlinops' ``KFACLinearOperator`` ("expand", Eschenhagen et al., 2023), which the tests
check factor for factor. Both are exponential moving averages over steps (``factor_decay``),
captured by hooks: a forward hook stores :math:`a`, and the gradient reaching the layer's
output gives :math:`g`. The loss is taken to be a *mean* over its :math:`N` terms
(``F.cross_entropy``'s default), so the gradient each hook sees is scaled back by
:math:`N` to a per-term gradient. :math:`N` is the number of rows of the model's output
``(..., C)``: the examples of a classifier, the :math:`B T` tokens of a language model
(each token a term of the loss, as in curvlinops' "expand" setting) — not the layer's
batch dimension, which for a sequence model would leave :math:`G` off by :math:`T^2`.

**Which Fisher.** ``fisher="true"`` (the default) is the Fisher proper: :math:`y` is
*sampled* from the model's predictive distribution (a categorical over the last dimension
of the model's output, the likelihood of ``cross_entropy``), which needs a second backward
pass: call ``optimizer.backward(loss)`` instead of ``loss.backward()``; it backpropagates
the sampled-label loss to the layer outputs only, then the training loss to the
parameters. ``fisher="empirical"`` uses the training labels' gradients, those of
``loss.backward()`` itself (Kunstner et al., 2019, explain why that is a worse curvature
estimate, and the chapter shows it).

**Damping: in the eigenbasis.** Every ``update_freq`` steps, :math:`A = Q_A \Lambda_A
Q_A^\top` and :math:`G = Q_G \Lambda_G Q_G^\top` by ``eigh`` in float64. Then the damped
inverse of the Kronecker product itself is exact and cheap (kfac-pytorch's eigen method,
Pauloski et al., 2020):

.. math::
    (G \otimes A + \lambda I)^{-1} \operatorname{vec}(\nabla_W) =
    \operatorname{vec}\Big(Q_G \Big[\frac{Q_G^\top \nabla_W Q_A}
    {\lambda_G \lambda_A^\top + \lambda}\Big] Q_A^\top\Big)

(elementwise division). This is Tikhonov damping of the Kronecker approximation exactly;
Martens and Grosse's factored damping :math:`(G + \pi^{-1}\sqrt\lambda I) \otimes (A +
\pi\sqrt\lambda I)` (their §6.3) adds cross terms :math:`\sqrt\lambda(\pi^{-1} A + \pi G)`
that the π-correction only balances; it is preferred where eigendecompositions are too
slow, which is not the case for layers of the sizes of this book's models.

**KL-clipping** (Ba et al., 2017, §5; kfac-pytorch's ``kl_clip``), per parameter group:
the preconditioned gradients :math:`v` are scaled by
:math:`\nu = \min\big(1, \sqrt{\kappa / (\eta^2 \sum_l \langle v_l, \nabla_{W_l} \rangle)}\big)`,
so the step's predicted change of the model's distribution,
:math:`\frac12\eta^2 v^\top F v`, stays below about :math:`\kappa/2`; ``kl_clip=None``
turns it off.

**The update**, for every parameter: the direction :math:`d` is the (clipped)
preconditioned gradient for the weights and biases of the layers K-FAC handles, and the
plain gradient for every other parameter (LayerNorm, embeddings, BatchNorm, a bias of a
layer whose weight is frozen, grouped convolutions): a stated first-order fallback, SGD
with heavy-ball momentum and coupled weight decay, as kfac-pytorch's wrapped SGD does:
:math:`b_t = \mu b_{t-1} + (d_t + \lambda_{wd} w)`, :math:`w_t = w_{t-1} - \eta b_t`. As
in kfac-pytorch, the preconditioned gradient replaces ``p.grad``.

**The variant, and where it departs from Martens and Grosse (2015).** Block-diagonal K-FAC
(their §4.2; not the block-tridiagonal inverse of §4.3) with the true Fisher's factors
(§5), in kfac-pytorch's form: **eigenbasis damping** and **KL-clipping** (Pauloski et al.,
2020; Ba et al., 2017). Against the paper:

- the damping is Tikhonov damping of :math:`G \otimes A` in the factors' eigenbases, exact,
  where the paper uses factored Tikhonov damping with its :math:`\pi`-correction (§6.3);
- :math:`\lambda` is fixed: the paper adapts it every few steps by the
  Levenberg-Marquardt rule on the reduction ratio of its quadratic model (§6.5), with a
  separate damping :math:`\gamma` for the factors (§6.6);
- the step size and momentum are fixed (``lr``, ``momentum``: heavy-ball SGD on the
  preconditioned gradient), the length capped by KL-clipping; the paper chooses both at
  every step, :math:`\alpha` and :math:`\mu`, by minimizing the quadratic model, with
  exact Fisher-vector products, over the span of the proposal and the previous update
  (§6.4, §7).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._util import check_choice, check_int, check_positive, check_real, generator
from .base import Optimizer
from .pieces import add_scaled_, coupled_weight_decay, momentum

__all__ = ["KFAC", "kfac_precondition"]


def kfac_precondition(M: Tensor, QA, dA, QG, dG, damping: float) -> Tensor:
    r""":math:`(G \otimes A + \lambda I)^{-1}\operatorname{vec}(M)` for a gradient matrix
    ``M`` of shape ``(out, in)`` from the eigendecompositions of ``A`` and ``G``, in their
    (float64) precision."""
    M = M.to(QA.dtype)
    return QG @ ((QG.T @ M @ QA) / (dG[:, None] * dA[None, :] + damping)) @ QA.T


class Layer:
    """What K-FAC keeps for one Linear or Conv2d layer: its parameters and the last batch's
    inputs and output gradients, captured by hooks."""

    def __init__(self, module: nn.Module, bias: bool):
        self.module, self.bias = module, bias
        self.batch = 0  # N, the number of terms the loss is a mean over
        self.a: Tensor | None = None  # the last input
        self.output: Tensor | None = None  # the last output, for the sampled backward
        self.g: Tensor | None = None  # the loss's gradient at the last output

    @property
    def params(self) -> list[Tensor]:
        return [self.module.weight, self.module.bias] if self.bias else [self.module.weight]

    def rows(self, x: Tensor) -> Tensor:
        """The layer's input as rows :math:`a` (patches for a convolution), 1 appended."""
        m = self.module
        if isinstance(m, nn.Conv2d):
            x = F.unfold(x, m.kernel_size, m.dilation, m.padding, m.stride).transpose(1, 2)
        x = x.reshape(-1, x.shape[-1])
        return torch.cat([x, x.new_ones(len(x), 1)], 1) if self.bias else x

    def grad_rows(self, g: Tensor) -> Tensor:
        if isinstance(self.module, nn.Conv2d):
            g = g.flatten(2).transpose(1, 2)
        return g.reshape(-1, g.shape[-1]) * self.batch  # the loss is a mean over the batch

    def matrix(self, tensors: list[Tensor]) -> Tensor:
        """Weight-shaped tensors (and the bias's) as one ``(out, in + 1)`` matrix."""
        w = tensors[0].reshape(len(tensors[0]), -1)
        return torch.cat([w, tensors[1][:, None]], 1) if self.bias else w

    def unmatrix(self, M: Tensor) -> list[Tensor]:
        w = self.module.weight
        if not self.bias:
            return [M.reshape(w.shape)]
        return [M[:, :-1].reshape(w.shape), M[:, -1]]


def _supported(module: nn.Module) -> bool:
    if isinstance(module, nn.Linear):
        return True
    return (  # grouped convolutions and other paddings need other patches: fall back
        isinstance(module, nn.Conv2d)
        and module.groups == 1
        and module.padding_mode == "zeros"
        and not isinstance(module.padding, str)
    )


class KFAC(Optimizer):
    r"""K-FAC preconditioning of ``model``'s Linear and Conv2d layers, SGD with momentum on
    the preconditioned gradients (and on the plain gradients of the other parameters): the
    eigenbasis-damping variant with KL-clipping of kfac-pytorch, with a fixed damping,
    learning rate and momentum where Martens and Grosse (2015) adapt :math:`\lambda` and
    choose :math:`\alpha` and :math:`\mu` at every step (the module's docstring).

    ``params`` (default ``model.parameters()``) may be parameter groups; a layer is
    preconditioned when its weight is among them (with its group's hyperparameters), and
    its bias is folded into its factors when the bias is there too and trainable.
    Step it as ``loss = ...; optimizer.backward(loss); optimizer.step()`` (or
    ``loss.backward()`` with ``fisher="empirical"``); the model's output is ``(..., C)``
    logits and the loss a mean over its rows (examples, or a language model's tokens).
    ``remove_hooks()`` detaches it from the model.

    The defaults are kfac-pytorch's (damping 1e-3, factor_decay 0.95, kl_clip 1e-3,
    momentum 0.9). KL-clipping then sets the step length whatever the learning rate; on the
    digits MLP of the tests, ``damping=1e-2, kl_clip=1e-2, momentum=0`` reached a training
    loss of 0.1 in 21-22 steps where the best SGD took 39-48 and the best Adam 30-37 (three
    seeds); without clipping, a learning rate of 0.3 or more diverged.
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = 1e-2,
        damping: float = 1e-3,
        update_freq: int = 10,
        factor_decay: float = 0.95,
        kl_clip: float | None = 1e-3,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        fisher: str = "true",
        *,
        params=None,
        seed: int | None = None,
        foreach: bool = True,
        compile: bool = False,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"Invalid model: a {type(model).__name__} (expected an nn.Module)")
        self.fisher = check_choice("fisher", fisher, ("true", "empirical"))
        defaults = dict(
            lr=lr,
            damping=damping,
            update_freq=update_freq,
            factor_decay=factor_decay,
            kl_clip=kl_clip,
            momentum=momentum,
            weight_decay=weight_decay,
        )
        super().__init__(
            model.parameters() if params is None else params, defaults, foreach, compile
        )
        if not any(_supported(m) for m in model.modules()):
            raise ValueError(
                f"Invalid model: a {type(model).__name__} without nn.Linear or nn.Conv2d "
                "layers (K-FAC preconditions only those; use SGD or Adam)"
            )
        trainable = {p for group in self.param_groups for p in group["params"]}
        self.layers = {}  # weight -> Layer
        self.hooks = []
        for m in model.modules():
            if _supported(m) and m.weight in trainable and m.weight.requires_grad:
                bias = m.bias is not None and m.bias in trainable and m.bias.requires_grad
                self.layers[m.weight] = layer = Layer(m, bias)
                self.hooks.append(m.register_forward_hook(self._capture(layer)))
        # registered last, so that it runs after the layers' hooks even when the model is
        # itself one layer (hooks of one module run in the order they were registered)
        self.hooks.append(model.register_forward_hook(self._keep_output))
        # the sampling stream's seed lives in the state, so that a resumed run samples the
        # labels the uninterrupted run would have
        seed = int(torch.randint(2**31, ()).item()) if seed is None else seed
        self.state["kfac"] = dict(step=0, seed=check_int("seed", seed, 0))
        self._output = None

    def remove_hooks(self) -> None:
        """Detach the optimizer from the model (its forward passes are then not recorded)."""
        for handle in self.hooks:
            handle.remove()

    def check(self, group):
        check_real("damping", group["damping"], 0.0)
        check_int("update_freq", group["update_freq"], 1)
        check_real("factor_decay", group["factor_decay"], 0.0, 1.0, high_open=True)
        if group["kl_clip"] is not None:
            check_positive("kl_clip", group["kl_clip"])
        check_real("momentum value", group["momentum"], 0.0, 1.0, high_open=True)

    # -- capturing the factors' statistics ------------------------------------------------

    def _capture(self, layer: Layer):
        def hook(module, inputs, output):
            if not (module.training and torch.is_grad_enabled()):
                return  # evaluation passes leave the factors alone
            # layer.batch, N, is set by the model's own hook once the output's rows are known
            layer.a, layer.g, layer.output = inputs[0].detach(), None, output
            if self.fisher == "empirical":
                output.register_hook(lambda g: self._capture_grad(layer, g))

        return hook

    @staticmethod
    def _capture_grad(layer: Layer, g: Tensor) -> None:
        layer.g = g.detach()

    def _keep_output(self, module, inputs, output):
        if module.training and torch.is_grad_enabled():
            self._output = output
            # the loss averages over the rows of the output: examples, or tokens
            terms = output.numel() // output.shape[-1] if output.dim() > 1 else output.numel()
            for layer in self.layers.values():
                if layer.a is not None:
                    layer.batch = terms

    def backward(self, loss: Tensor) -> None:
        """``loss.backward()``, preceded for ``fisher="true"`` by the backward of the loss of
        labels sampled from the model's output (a categorical over its last dimension), to
        the layers' outputs only: that gives the :math:`G` factors of the true Fisher."""
        if self.fisher == "true":
            if self._output is None:
                raise RuntimeError("KFAC.backward needs a forward pass of the model in training")
            logits = self._output.detach().reshape(-1, self._output.shape[-1])
            run = self.state["kfac"]
            stream = generator("kfac labels", run["seed"], run["step"])
            y = torch.multinomial(logits.softmax(-1).cpu(), 1, generator=stream)
            sampled = F.cross_entropy(self._output.reshape(logits.shape), y[:, 0].to(logits.device))
            layers = [lay for lay in self.layers.values() if lay.output is not None]
            grads = torch.autograd.grad(
                sampled, [lay.output for lay in layers], retain_graph=True, allow_unused=True
            )
            for lay, g in zip(layers, grads):
                lay.g = None if g is None else g.detach()
            self._output = None
        loss.backward()

    # -- the step ---------------------------------------------------------------------------

    def step(self, closure=None):
        """One step: the closure (when given) computes the gradients, K-FAC preconditions
        them in place, and the base class's loop applies :meth:`update`."""

        def closure_then_precondition():
            loss = None if closure is None else closure()
            with torch.no_grad():
                self.state["kfac"]["step"] += 1
                for group in self.param_groups:
                    self.precondition_(group)
            return loss

        return super().step(closure_then_precondition)

    def factors_(self, layer: Layer, group: dict) -> dict:
        r"""Fold the last batch into the moving averages :math:`A` and :math:`G` (the first
        batch sets them), and refresh their eigendecompositions every ``update_freq`` steps;
        returns the layer's state."""
        state = self.state[layer.module.weight]
        if layer.a is not None and layer.g is not None:
            a, g = layer.rows(layer.a), layer.grad_rows(layer.g)
            A, G = a.T @ a / len(a), g.T @ g / layer.batch
            rho = group["factor_decay"] if "A" in state else 0.0
            for name, new in (("A", A), ("G", G)):
                state[name] = new if rho == 0 else torch.lerp(new, state[name], rho)
            layer.a = layer.g = layer.output = None
        elif "A" not in state:
            raise RuntimeError(
                "KFAC has no factors for a layer: with fisher='true', call "
                "optimizer.backward(loss) instead of loss.backward()"
            )
        # its own count: "step" is the base class's per-parameter step count
        state["factor_step"] = t = state.get("factor_step", 0) + 1
        if (t - 1) % group["update_freq"] == 0:
            for name in ("A", "G"):
                try:
                    lam, Q = torch.linalg.eigh(state[name].to(torch.float64))
                except torch.linalg.LinAlgError:
                    if "Q" + name in state:
                        continue  # keep the last eigenbasis (kfac-pytorch users meet this)
                    raise
                state["d" + name], state["Q" + name] = lam.clamp(min=0.0), Q
        return state

    def precondition_(self, group: dict) -> None:
        """Replace the gradients of the group's K-FAC layers by their preconditioned
        gradients, KL-clipped over the group."""
        layers = [self.layers[p] for p in group["params"] if p in self.layers]
        layers = [lay for lay in layers if lay.module.weight.grad is not None]
        if not layers:
            return
        vg, pairs = 0.0, []
        for layer in layers:
            s = self.factors_(layer, group)
            M = layer.matrix([p.grad for p in layer.params])
            V = kfac_precondition(M, s["QA"], s["dA"], s["QG"], s["dG"], group["damping"])
            vg += float((V * M.to(V.dtype)).sum())
            pairs.append((layer, V))
        nu = 1.0
        if group["kl_clip"] is not None and group["lr"] > 0 and vg > 0:
            nu = min(1.0, (group["kl_clip"] / (group["lr"] ** 2 * vg)) ** 0.5)
        for layer, V in pairs:
            for p, v in zip(layer.params, layer.unmatrix(V * nu), strict=True):
                p.grad.copy_(v)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        # torch.optim casts floating state to its parameter's dtype: put back the float64
        # eigendecompositions, or a resumed run would precondition in float32
        params = [p for group in self.param_groups for p in group["params"]]
        for i, saved in state_dict["state"].items():
            if isinstance(i, int):
                for name in ("QA", "dA", "QG", "dG"):
                    if name in saved:
                        self.state[params[i]][name] = saved[name].to(params[i].device, copy=True)

    def update(self, group, params, grads):
        r"""SGD with heavy-ball momentum on the directions ``grads`` (preconditioned where
        K-FAC applies): :math:`b_t = \mu b_{t-1} + (d_t + \lambda w)`,
        :math:`w_t = w_{t-1} - \eta b_t`."""
        mu = group["momentum"]
        d = coupled_weight_decay(grads, params, group["weight_decay"])
        if mu:
            first = not self.has_state(params, "momentum_buffer")
            d = momentum(self.buffer(params, "momentum_buffer", like=d), d, mu, 0.0, False, first)
        add_scaled_(params, d, -group["lr"])
