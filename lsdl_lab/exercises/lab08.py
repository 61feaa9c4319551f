"""Checkers of Lab 8, memory: a dynamic loss scaler's update, Adafactor's factored second
moment and how far it is from Adam's, and the slice of each parameter that a rank owns
under ZeRO stage 1.

The references drive the library: :class:`lsdl_lab.memory.LossScaler` through its public
methods, :meth:`lsdl_lab.optim.Adafactor.factored_second_moment`, and the flat, padded
partition of :class:`lsdl_lab.memory.ZeroOptimizer` (its docstring). A student whose
function passes has reproduced what the lab's runs did. When a function fails, the
checker looks for the usual slips and names the one it finds.
"""

from __future__ import annotations

import torch

from .. import optim
from ..check import CheckFailed, answer_or_none, check_function, exercise, with_hints
from ..memory import LossScaler


def scaler_update(
    scale: float,
    growth_tracker: int,
    found_inf: bool,
    growth_interval: int = 2000,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    min_scale: float = 1.0,
) -> tuple[float, int]:
    """The scale and the count of clean steps after one iteration of dynamic loss scaling
    (Micikevicius et al. 2018, Section 3.2; ``torch.amp.GradScaler.update``): on an
    inf/NaN, back off (never below ``min_scale``) and restart the count; else count the
    clean step, and grow the scale when the count reaches ``growth_interval``."""
    scaler = LossScaler(max(scale, min_scale), growth_factor, backoff_factor, growth_interval)
    scaler.load_state_dict(
        {
            "scale": scale,
            "growth_factor": growth_factor,
            "backoff_factor": backoff_factor,
            "growth_interval": growth_interval,
            "_growth_tracker": growth_tracker,
            "min_scale": min_scale,
        }
    )
    # One parameter whose gradient is inf or finite: the scaler's own check decides.
    p = torch.zeros(1, requires_grad=True)
    p.grad = torch.full((1,), float("inf") if found_inf else 1.0)
    scaler.unscale_(torch.optim.SGD([p], lr=0.0))
    scaler.update()
    return scaler.get_scale(), scaler.state_dict()["_growth_tracker"]


def factored_second_moment(
    row: torch.Tensor, col: torch.Tensor, grad: torch.Tensor, beta2: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Adafactor's factored second moment of an :math:`n \times m` gradient (Shazeer and
    Stern 2018, Algorithm 4): the running row means :math:`R` (shape ``(n, 1)``) and column
    means :math:`C` (shape ``(1, m)``) of :math:`G^2`, updated with weight
    :math:`1 - \beta_2`, and :math:`\hat V = R C / \operatorname{mean}(R)`. Returns
    ``(R, C, V_hat)``; the inputs are left unchanged."""
    w = torch.zeros_like(grad, requires_grad=True)
    opt = optim.Adafactor([w])
    state = opt.state[w]
    state["row_var"], state["col_var"] = row.clone(), col.clone()
    v_hat = opt.factored_second_moment([w], [grad], [1.0 - beta2], [0.0])[0]
    return state["row_var"], state["col_var"], v_hat


def second_moment_gap(grads: list[torch.Tensor], beta2: float) -> float:
    r"""How far Adafactor's factored estimate is from Adam's second moment after the
    gradients ``grads`` (:math:`G_1, \dots, G_T`, each :math:`n \times m`), from zero
    statistics: :math:`\max|\hat V_T - V_T| / \max V_T`, with :math:`\hat V_T` from
    :func:`factored_second_moment` and :math:`V_t = \beta_2 V_{t-1} + (1 - \beta_2)\,G_t^2`,
    the same average of the :math:`G_t^2` whose row and column means are :math:`R_t` and
    :math:`C_t`. Zero (to rounding) exactly when :math:`V_T` has rank one (Chapter 8)."""
    n, m = grads[0].shape
    row = grads[0].new_zeros(n, 1)
    col = grads[0].new_zeros(1, m)
    v = torch.zeros_like(grads[0])
    for g in grads:
        row, col, v_hat = factored_second_moment(row, col, g, beta2)
        v = beta2 * v + (1 - beta2) * g**2
    return ((v_hat - v).abs().max() / v.max()).item()


def zero1_partition(sizes: list[int], world_size: int, rank: int) -> list[tuple[int, int]]:
    """The elements of each parameter of one unit that ``rank`` owns: the unit's
    parameters laid end to end in one flat vector, zero-padded to a multiple of
    ``world_size``, cut into ``world_size`` equal slices, the rank owning slice ``rank``
    (:class:`lsdl_lab.memory.ZeroOptimizer`). One ``(start, stop)`` per parameter, in the
    parameter's own flattened indices; ``(0, 0)`` for a parameter the rank owns nothing of."""
    total = sum(sizes)
    size = -(-total // world_size)
    lo, hi = rank * size, (rank + 1) * size
    out, offset = [], 0
    for n in sizes:
        start, stop = max(lo - offset, 0), min(hi - offset, n)
        out.append((start, stop) if start < stop else (0, 0))
        offset += n
    return out


@exercise("lab08.scaler_update")
def check_scaler_update(student_fn) -> None:
    cases = [
        (65536.0, 0, True),  # an overflow: halve, restart the count
        (65536.0, 5, False),  # a clean step: count it
        (65536.0, 1999, False),  # the 2000th clean step in a row: grow
        (2.0, 3, True, 2000, 2.0, 0.5, 1.0),  # backing off to the floor
        (1.0, 0, True, 2000, 2.0, 0.5, 1.0),  # at the floor: stay there
        (1024.0, 4, False, 5, 2.0, 0.5, 1.0),  # growth_interval 5, as in the lab
        (1024.0, 4, False, 5, 4.0, 0.25, 1.0),  # other factors
        (2.0**127, 1, False, 2, 2.0, 0.5, 1.0),  # 2^128 overflows float32: keep 2^127
        {"scale": 256.0, "growth_tracker": 2, "found_inf": True, "backoff_factor": 0.25},
    ]
    try:
        check_function(student_fn, scaler_update, cases, name="scaler_update", rtol=0, atol=0)
    except CheckFailed as failure:
        hints = []
        if answer_or_none(student_fn, 65536.0, 1999, False) == (65536.0, 2000):
            hints.append("when the count reaches growth_interval, grow the scale and reset it to 0")
        if answer_or_none(student_fn, 65536.0, 5, True) == (32768.0, 5):
            hints.append("an overflow restarts the count of clean steps at 0")
        if answer_or_none(student_fn, 1.0, 0, True, 2000, 2.0, 0.5, 1.0) == (0.5, 0):
            hints.append("the scale never goes below min_scale")
        big = answer_or_none(student_fn, 2.0**127, 1, False, 2, 2.0, 0.5, 1.0)
        if big is not None and big[0] == float("inf"):
            hints.append("a grown scale that overflows (inf) is not taken: keep the old one")
        raise with_hints(failure, hints) from None
    print("✔ scaler_update: every case equals lsdl_lab.memory.LossScaler.update")


@exercise("lab08.factored_second_moment")
def check_factored_second_moment(student_fn) -> None:
    g = torch.Generator().manual_seed(8)
    cases = []
    for n, m, beta2 in ((3, 4, 0.0), (5, 2, 0.9), (4, 6, 0.999), (1, 7, 0.5), (8, 8, 0.8)):
        grad = torch.randn(n, m, generator=g)
        row = torch.rand(n, 1, generator=g) * (beta2 > 0)
        col = torch.rand(1, m, generator=g) * (beta2 > 0)
        cases.append((row, col, grad, beta2))
    try:
        check_function(student_fn, factored_second_moment, cases, name="factored_second_moment")
    except CheckFailed as failure:
        hints = []
        row, col, grad, beta2 = cases[1]
        got = answer_or_none(student_fn, row.clone(), col.clone(), grad.clone(), beta2)
        if isinstance(got, tuple) and len(got) == 3 and isinstance(got[0], torch.Tensor):
            if got[0].shape != row.shape or got[1].shape != col.shape:
                hints.append("keep R as a column (n, 1) and C as a row (1, m): keepdim=True")
            sums_r = beta2 * row + (1 - beta2) * (grad**2).sum(1, keepdim=True)
            if got[0].shape == row.shape and torch.allclose(got[0], sums_r):
                hints.append("R holds the row *means* of G², not sums (the same V̂, other R)")
            if got[2].shape == grad.shape and torch.allclose(got[2], got[0] @ got[1]):
                hints.append("divide R C by the mean of R: otherwise V̂ is off by that factor")
        raise with_hints(failure, hints) from None
    print("✔ factored_second_moment: R, C and V̂ equal lsdl_lab.optim.Adafactor's")


def _number(answer) -> float | None:
    """A student's answer as a float, or None when it is not one number."""
    try:
        return float(answer)
    except (TypeError, ValueError, RuntimeError):
        return None


def _signed_root(square: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A gradient whose square is ``square``, with random signs (only G² matters)."""
    return square.sqrt() * (torch.randint(0, 2, square.shape, generator=g) * 2 - 1)


@exercise("lab08.second_moment_gap")
def check_second_moment_gap(student_fn) -> None:
    g = torch.Generator().manual_seed(8)

    def factor(*shape):  # positive, spread over two decades
        return 10 ** (2 * torch.rand(*shape, generator=g, dtype=torch.float64) - 1)

    a, b = factor(4, 1), factor(1, 3)
    cases = [
        ([_signed_root(a @ b, g) for _ in range(6)], 0.9),  # one outer product: exact
        ([_signed_root(a @ factor(1, 3), g) for _ in range(5)], 0.8),  # a shared factor: exact
        ([_signed_root(factor(4, 1) @ factor(1, 3), g) for _ in range(5)], 0.9),  # not exact
        ([torch.randn(5, 2, generator=g, dtype=torch.float64) for _ in range(3)], 0.5),
        ([torch.randn(3, 6, generator=g, dtype=torch.float64)], 0.0),
    ]
    try:
        check_function(student_fn, second_moment_gap, cases, name="second_moment_gap")
    except CheckFailed as failure:
        hints = []
        grads, beta2 = cases[0]  # V has rank one: the right gap is 0
        got = _number(answer_or_none(student_fn, [t.clone() for t in grads], beta2))
        if got is not None and abs(got - beta2) < 1e-6:
            hints.append("average G² into V with weight 1 - beta2, as R and C are averaged")
        elif got is not None and abs(got - beta2 ** len(grads)) < 1e-6:
            hints.append("compare V̂ with Adam's running average V, not with the last G²")
        grads, beta2 = cases[3]
        once = _number(answer_or_none(student_fn, [t.clone() for t in grads], beta2))
        tenfold = _number(answer_or_none(student_fn, [10 * t for t in grads], beta2))
        if once and tenfold is not None and abs(tenfold / once - 100) < 1e-3:
            hints.append("divide by the largest entry of V: the gap is relative")
        raise with_hints(failure, hints) from None
    print("✔ second_moment_gap: every case equals the gap of lsdl_lab.optim.Adafactor's estimate")


@exercise("lab08.zero1_partition")
def check_zero1_partition(student_fn) -> None:
    cases = [
        ([6, 4], 2, 0),  # 10 elements: 5 each
        ([6, 4], 2, 1),
        ([7], 2, 1),  # padded to 8: the last slot of rank 1 is padding
        ([3, 3, 3], 4, 3),  # 9 padded to 12: rank 3 owns 6..9, parameter 2's 0..3
        ([3, 3, 3], 4, 0),
        ([1, 1], 4, 3),  # a rank that owns only padding
        ([100, 10, 1000], 8, 5),
        ([64, 64, 3 * 64 * 64, 3 * 64], 2, 1),  # a LayerNorm-and-QKV-like unit
    ]
    try:
        check_function(student_fn, zero1_partition, cases, name="zero1_partition")
    except CheckFailed as failure:
        hints = []
        seven = answer_or_none(student_fn, [7], 2, 1)
        if isinstance(seven, list) and seven and tuple(seven[0])[:1] == (3,):
            hints.append("pad the unit to a multiple of world_size first: 7 elements -> 8, 4 each")
        if answer_or_none(student_fn, [6, 4], 2, 1) == [(5, 10)]:
            hints.append("give one range per parameter, in that parameter's own indices")
        if answer_or_none(student_fn, [1, 1], 4, 3) == [(0, 0), (1, 1)]:
            hints.append("a parameter the rank owns nothing of is (0, 0)")
        raise with_hints(failure, hints) from None
    print("✔ zero1_partition: every case equals lsdl_lab.memory.ZeroOptimizer's partition")
