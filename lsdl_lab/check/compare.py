"""The comparison engine: where and how a result differs from the expected one.

:func:`difference` walks both values together (tensors and arrays by type, shape, dtype
and then values, within ``|got - expected| <= atol + rtol * |expected|`` as
``torch.allclose``; numbers the same way; tuples and lists by length, dicts by keys,
dataclasses by fields, then item by item) and returns ``None`` when they match, else one
line naming the path of the first difference (``output[1]``, ``output['v']``), what
differs and, when the result is the expected one with its sign flipped, scaled by a
constant, transposed or reshaped, a hint naming that common mistake.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .summary import dtype_name, number, plural, preview, summary


def difference(got: Any, expected: Any, path: str, rtol: float, atol: float, nan: bool):
    if expected is None:
        return None if got is None else f"{path}: expected None, got {summary(got)}"
    if got is None:
        return f"{path}: got None, expected {summary(expected)}\n  hint: a missing `return`?"
    if isinstance(expected, torch.Tensor):
        return _tensor_difference(got, expected, path, rtol, atol, nan)
    if isinstance(expected, np.ndarray):
        if not isinstance(got, np.ndarray):
            return f"{path}: expected a numpy array, got {summary(got)}"
        if got.shape != expected.shape:
            return f"{path}: shape {got.shape} instead of the expected {expected.shape}"
        if got.dtype != expected.dtype:
            return f"{path}: dtype {got.dtype} instead of the expected {expected.dtype}"
        if expected.dtype.kind not in "biufc":
            equal = np.array_equal(got, expected)
            return None if equal else f"{path}: {summary(got)} instead of {summary(expected)}"
        return _values_difference(
            torch.from_numpy(np.ascontiguousarray(got)),
            torch.from_numpy(np.ascontiguousarray(expected)),
            path, rtol, atol, nan,
        )  # fmt: skip
    if isinstance(expected, (bool, np.bool_)):
        ok = isinstance(got, (bool, np.bool_)) and bool(got) == bool(expected)
        return None if ok else f"{path}: got {summary(got)}, expected {expected!r}"
    if isinstance(expected, numbers.Number):
        return _number_difference(got, expected, path, rtol, atol, nan)
    if dataclasses.is_dataclass(expected) and not isinstance(expected, type):
        if type(got) is not type(expected):
            return f"{path}: expected a {type(expected).__name__}, got {summary(got)}"
        for field in dataclasses.fields(expected):
            name = field.name
            found = difference(
                getattr(got, name), getattr(expected, name), f"{path}.{name}", rtol, atol, nan
            )
            if found:
                return found
        return None
    if isinstance(expected, Mapping):
        if not isinstance(got, Mapping):
            return f"{path}: expected a dict, got {summary(got)}"
        missing = [k for k in expected if k not in got]
        unexpected = [k for k in got if k not in expected]
        if missing or unexpected:
            parts = [f"missing {', '.join(map(repr, missing))}"] if missing else []
            parts += [f"unexpected {', '.join(map(repr, unexpected))}"] if unexpected else []
            return f"{path}: the keys differ: {'; '.join(parts)}"
        for key in expected:
            found = difference(got[key], expected[key], f"{path}[{key!r}]", rtol, atol, nan)
            if found:
                return found
        return None
    if isinstance(expected, (tuple, list)):
        kind = type(expected).__name__
        if not isinstance(got, (tuple, list)):
            return (
                f"{path}: expected a {kind} of {plural(len(expected), 'value')}, got {summary(got)}"
            )
        if len(got) != len(expected):
            return (
                f"{path}: a {type(got).__name__} of {plural(len(got), 'value')} "
                f"instead of {len(expected)}"
            )
        fields = getattr(expected, "_fields", None)
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            sub = f"{path}.{fields[i]}" if fields else f"{path}[{i}]"
            found = difference(g, e, sub, rtol, atol, nan)
            if found:
                return found
        return None
    try:
        equal = bool(got == expected)
    except Exception:
        equal = False
    return None if equal else f"{path}: got {summary(got)}, expected {summary(expected)}"


def _number_difference(got, expected, path, rtol, atol, nan):
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        return f"{path}: got {summary(got)}, expected a number\n  hint: use .item()"
    if not isinstance(got, numbers.Number) or isinstance(got, complex) != isinstance(
        expected, complex
    ):
        return f"{path}: got {summary(got)}, expected a number ({summary(expected)})"
    if got == expected or (nan and _isnan(got) and _isnan(expected)):
        return None
    tolerance = atol + rtol * abs(expected)
    if abs(got - expected) <= tolerance:
        return None
    line = (
        f"{path}: got {summary(got)}, expected {summary(expected)} "
        f"(difference {abs(got - expected):.3g}, tolerance {tolerance:.3g})"
    )
    if expected != 0 and abs(got + expected) <= tolerance:
        line += "\n  hint: that is the expected value with the opposite sign"
    return line


def _isnan(x: numbers.Number) -> bool:
    return isinstance(x, (float, complex)) and x != x


def _tensor_difference(got, expected, path, rtol, atol, nan):
    if not isinstance(got, torch.Tensor):
        hint = ""
        if isinstance(got, (numbers.Number, np.ndarray)):
            hint = "\n  hint: return a torch.Tensor (no .item(), .numpy() or Python floats)"
        return f"{path}: expected a Tensor, got {summary(got)}{hint}"
    if got.shape != expected.shape:
        line = f"{path}: shape {tuple(got.shape)} instead of the expected {tuple(expected.shape)}"
        return line + _layout_hint(got, expected, rtol, atol, nan)
    if got.dtype != expected.dtype:
        got_dtype, expected_dtype = dtype_name(got.dtype), dtype_name(expected.dtype)
        return f"{path}: dtype {got_dtype} instead of the expected {expected_dtype}"
    return _values_difference(got, expected, path, rtol, atol, nan)


def _values_difference(got, expected, path, rtol, atol, nan):
    """Compare values of same-shape, same-dtype tensors; say where they differ most."""
    g, e = _wide(got), _wide(expected)
    if g.is_floating_point() or g.is_complex():
        close = torch.isclose(g, e, rtol=rtol, atol=atol, equal_nan=nan)
    else:
        close = g == e
    if bool(close.all()):
        return None
    wrong = ~close
    gap = (g - e).abs() if not g.dtype == torch.bool else (g != e).double()
    # NaN gaps (nan against a number, inf against inf) are the worst kind of difference.
    gap = torch.where(wrong, gap.double().nan_to_num(nan=math.inf), -1.0)
    worst = int(gap.reshape(-1).argmax())
    index = tuple(int(i) for i in np.unravel_index(worst, tuple(g.shape))) if g.dim() else ()
    g_worst, e_worst = g.reshape(-1)[worst].item(), e.reshape(-1)[worst].item()
    if g.numel() == 1:
        line = f"{path}: got {number(g_worst)}, expected {number(e_worst)}"
    else:
        line = (
            f"{path}: {int(wrong.sum())} of {g.numel()} values differ; the largest "
            f"difference, {gap.max().item():.3g}, is at index {index}: "
            f"expected {number(e_worst)}, got {number(g_worst)}\n"
            f"    expected: {preview(e)}\n"
            f"    got:      {preview(g)}"
        )
    return line + _scale_hint(g, e, rtol, atol)


def _wide(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu()
    if t.is_complex():
        return t.to(torch.complex128)
    return t.to(torch.float64) if t.is_floating_point() else t


def _scale_hint(g: torch.Tensor, e: torch.Tensor, rtol: float, atol: float) -> str:
    """Name a sign flip or a constant factor, the commonest slips in an update rule."""
    if not g.is_floating_point() or not (g.isfinite().all() and e.isfinite().all()):
        return ""
    if not bool((e.abs() > atol).any()):
        return ""
    if torch.allclose(g, -e, rtol=rtol, atol=atol):
        return "\n  hint: your output is exactly the reference with the opposite sign"
    c = float((g * e).sum() / (e * e).sum())
    if c != 0 and abs(c - 1) > 1e-3 and torch.allclose(g, c * e, rtol=rtol, atol=atol):
        return (
            f"\n  hint: your output is the reference times {c:.4g}: a missing or extra "
            f"constant factor (a learning rate, a 1/n, a 2)?"
        )
    return ""


def _layout_hint(got, expected, rtol, atol, nan) -> str:
    if got.numel() != expected.numel() or got.dtype != expected.dtype:
        return ""
    g, e = _wide(got), _wide(expected)
    if g.dim() == 2 and g.shape == e.shape[::-1] and _same(g.T, e, rtol, atol, nan):
        return "\n  hint: your output is the transpose of the reference"
    if _same(g.reshape(e.shape), e, rtol, atol, nan):
        return (
            "\n  hint: the values are right but laid out in another shape "
            "(a missing keepdim, squeeze or view?)"
        )
    return ""


def _same(g, e, rtol, atol, nan) -> bool:
    if g.is_floating_point() or g.is_complex():
        return torch.allclose(g, e, rtol=rtol, atol=atol, equal_nan=nan)
    return torch.equal(g, e)
