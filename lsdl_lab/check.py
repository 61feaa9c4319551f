"""Checkers for exercises: run a student's function beside the reference and explain any
difference.

A lab marks each exercise's solution the way nbgrader does (``### BEGIN SOLUTION`` …
``### END SOLUTION``); the student version (:mod:`lsdl_lab.student`) replaces it with
``raise NotImplementedError(...)``. The cell that follows calls a checker::

    check.check_function(momentum_step, reference_momentum_step, cases)
    # ✔ momentum_step: all 5 cases match the reference

When the outputs differ, :class:`CheckFailed` says on which case (its arguments,
summarised), where in the output (``output[1]``, ``output['v']``), what differs (type,
length, keys, shape, dtype or values, with the largest difference and its index) and,
when the output is the reference with the sign flipped, scaled by a constant or
transposed, a hint naming that common mistake.

Lab authors register named checkers with :func:`exercise` and students call them with
:func:`checker`::

    @exercise("momentum_step")
    def check_momentum_step(student_fn):
        check_function(student_fn, reference, cases)

    checker("momentum_step")(momentum_step)
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["CheckFailed", "check_function", "check_value", "checker", "exercise"]

# The message lsdl_lab.student writes into each exercise (kept equal by a test).
PLACEHOLDER_MESSAGE = "Exercise: write your solution here"

_VALUES_SHOWN = 6


class CheckFailed(AssertionError):
    """A student's result differs from the reference; the message says where and how."""


# ---------------------------------------------------------------------------------------
# Public checkers


def check_function(
    student: Callable,
    reference: Callable,
    cases: Iterable[Any],
    *,
    name: str | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    equal_nan: bool = False,
) -> None:
    """Call ``student`` and ``reference`` on every case and compare their outputs.

    Each case is a tuple of positional arguments, a dict of keyword arguments, or an
    ``(args_tuple, kwargs_dict)`` pair. Each function gets its own deep copy of the case
    (tensors cloned, ``requires_grad`` kept), so a function that changes its inputs in
    place affects neither the other call nor the caller's cases; both calls start from
    the same random-number state, so functions that draw random numbers can be compared.

    Outputs are compared recursively: tensors and numpy arrays by type, shape, dtype and
    then values (``|got - expected| <= atol + rtol * |expected|``, as ``torch.allclose``);
    numbers the same way; tuples and lists by length, dicts by keys, then item by item.

    Raises :class:`CheckFailed` on the first case that differs or on which the student's
    function raises, and :class:`NotImplementedError` while the exercise still holds
    nbgrader's ``raise NotImplementedError`` stub. Prints one line when all cases match.
    """
    if not callable(student):
        raise TypeError(f"student must be a function, got {type(student).__name__}")
    if not callable(reference):
        raise TypeError(f"reference must be a function, got {type(reference).__name__}")
    if isinstance(cases, (str, bytes, Mapping)) or not isinstance(cases, Iterable):
        raise TypeError(
            f"cases must be a list of cases (tuples of arguments or dicts of keyword "
            f"arguments), got {type(cases).__name__}"
        )
    cases = list(cases)
    if not cases:
        raise ValueError("cases must hold at least one case, got none")
    calls = [_as_call(case, i) for i, case in enumerate(cases)]
    _check_tolerances(rtol, atol)
    name = name or _name_of(student) or _name_of(reference) or "the function"

    for i, (args, kwargs) in enumerate(calls):
        where = f"case {i + 1} of {len(calls)}"
        # fork_rng restores the random state afterwards, so the student's call draws
        # the same random numbers as the reference's did. CUDA's generators only when
        # CUDA is in use: touching them would initialise it (and break forked workers).
        cuda = range(torch.cuda.device_count()) if torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=cuda):
            ref_args, ref_kwargs = _fresh_copy((args, kwargs))
            try:
                expected = reference(*ref_args, **ref_kwargs)
            except Exception as exc:
                raise RuntimeError(
                    f"the reference for {name} raised {type(exc).__name__} on {where}; "
                    f"the case is wrong, not the student's code"
                ) from exc

        st_args, st_kwargs = _fresh_copy((args, kwargs))
        try:
            got = student(*st_args, **st_kwargs)
        except NotImplementedError as exc:
            stub = _stub_name(exc, student, name)
            if stub is None:
                raise _failure(name, where, reference, args, kwargs, _raised(exc)) from exc
            # A clean traceback: the student needs the instruction, not the stack.
            raise NotImplementedError(
                f"{stub} is not implemented yet: replace the `raise NotImplementedError` "
                f"line with your solution"
            ) from None
        except Exception as exc:
            raise _failure(name, where, reference, args, kwargs, _raised(exc)) from exc

        difference = _difference(got, expected, "output", rtol, atol, equal_nan)
        if difference is not None:
            raise _failure(name, where, reference, args, kwargs, difference) from None

    if len(calls) == 1:
        print(f"✔ {name}: the 1 case matches the reference")
    else:
        print(f"✔ {name}: all {len(calls)} cases match the reference")


def check_value(
    name: str,
    got: Any,
    expected: Any,
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    equal_nan: bool = False,
) -> None:
    """Compare a value a student computed (an accuracy, a tensor of norms…) with the
    expected one, with the same rules and messages as :func:`check_function`."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")
    _check_tolerances(rtol, atol)
    difference = _difference(got, expected, name, rtol, atol, equal_nan)
    if difference is not None:
        raise CheckFailed(f"{name} differs from the expected value\n  {difference}")
    print(f"✔ {name} matches the expected value")


# ---------------------------------------------------------------------------------------
# Registry of named checkers, filled by lab authors

_CHECKERS: dict[str, Callable[[Callable], None]] = {}


def exercise(name: str) -> Callable[[Callable], Callable]:
    """Register the decorated ``check_xxx(student_fn)`` as the checker of exercise
    ``name``, so that a lab can call ``checker(name)(student_fn)``."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")

    def register(check_fn: Callable) -> Callable:
        if not callable(check_fn):
            raise TypeError(f"exercise({name!r}) must decorate a function")
        known = _CHECKERS.get(name)
        # Re-running the cell or module that defines a checker redefines it; a second,
        # different definition under the same name is a clash.
        if known is not None and _qualified(known) != _qualified(check_fn):
            raise ValueError(
                f"exercise {name!r} already has a checker, {_qualified(known)}; "
                f"cannot register {_qualified(check_fn)} under the same name"
            )
        _CHECKERS[name] = check_fn
        return check_fn

    return register


def checker(name: str) -> Callable[[Callable], None]:
    """The checker registered with :func:`exercise` under ``name``.

    The labs' checkers live in :mod:`lsdl_lab.exercises`, imported on first use.
    """
    importlib.import_module("lsdl_lab.exercises")
    try:
        return _CHECKERS[name]
    except KeyError:
        known = ", ".join(sorted(_CHECKERS)) or "none yet"
        raise KeyError(f"no checker for exercise {name!r}; registered: {known}") from None


def _qualified(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


# ---------------------------------------------------------------------------------------
# Cases and calls


def _as_call(case: Any, i: int) -> tuple[tuple, dict]:
    if isinstance(case, Mapping):
        return (), dict(case)
    if (
        isinstance(case, tuple)
        and len(case) == 2
        and isinstance(case[0], tuple)
        and isinstance(case[1], Mapping)
    ):
        return case[0], dict(case[1])
    if isinstance(case, tuple):
        return case, {}
    raise TypeError(
        f"cases[{i}] must be a tuple of positional arguments, a dict of keyword arguments "
        f"or an (args, kwargs) pair, got {type(case).__name__}; "
        f"for a single argument x write (x,)"
    )


def _check_tolerances(rtol: float, atol: float) -> None:
    for arg, value in (("rtol", rtol), ("atol", atol)):
        if not isinstance(value, numbers.Real) or not value >= 0:
            raise ValueError(f"{arg} must be a number >= 0, got {value!r}")


def _fresh_copy(obj: Any, memo: dict | None = None) -> Any:
    """A deep copy in which every tensor is a fresh clone.

    ``copy.deepcopy`` refuses tensors that are not graph leaves, so those are detached
    and cloned here (staying ``requires_grad``); a tensor passed twice stays one tensor.
    """
    memo = {} if memo is None else memo
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, torch.Tensor) and not obj.is_leaf:
        memo[id(obj)] = obj.detach().clone().requires_grad_()
        return memo[id(obj)]
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        items = [_fresh_copy(item, memo) for item in obj]
        return type(obj)(items)
    if type(obj) is dict:
        return {key: _fresh_copy(value, memo) for key, value in obj.items()}
    return copy.deepcopy(obj, memo)


def _stub_name(exc: NotImplementedError, student: Callable, name: str) -> str | None:
    """Which function still holds the exercise's stub, or None when ``exc`` comes from
    elsewhere (torch raises NotImplementedError for operators missing for a dtype)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    code = getattr(inspect.unwrap(getattr(student, "__func__", student)), "__code__", None)
    if tb is not None and tb.tb_frame.f_code is code:
        return name
    if str(exc) == PLACEHOLDER_MESSAGE:
        # The stub of another exercise that the student's function calls.
        helper = tb.tb_frame.f_code.co_name if tb is not None else "a function it calls"
        return f"{helper} (called by {name})"
    return None


def _name_of(fn: Callable) -> str | None:
    return getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", None)


def _raised(exc: BaseException) -> str:
    return f"it raised {type(exc).__name__}: {exc}"


def _failure(
    name: str, where: str, reference: Callable, args: tuple, kwargs: dict, what: str
) -> CheckFailed:
    return CheckFailed(
        f"{name} does not match the reference on {where}\n"
        f"  called with: {_summarise_call(reference, args, kwargs)}\n"
        f"  {what}"
    )


# ---------------------------------------------------------------------------------------
# Summaries of arguments and values


def _summarise_call(fn: Callable, args: tuple, kwargs: dict) -> str:
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):
        parts = [_summary(a) for a in args]
        parts += [f"{k}={_summary(v)}" for k, v in kwargs.items()]
    else:
        parts = []
        for param, value in bound.arguments.items():
            kind = bound.signature.parameters[param].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                parts += [_summary(v) for v in value]
            elif kind is inspect.Parameter.VAR_KEYWORD:
                parts += [f"{k}={_summary(v)}" for k, v in value.items()]
            else:
                parts.append(f"{param}={_summary(value)}")
    return ", ".join(parts) or "no arguments"


def _summary(value: Any, depth: int = 0) -> str:
    if isinstance(value, torch.Tensor):
        extra = "".join(
            [
                f", device={value.device}" if value.device.type != "cpu" else "",
                ", requires_grad=True" if value.requires_grad else "",
            ]
        )
        return (
            f"Tensor(shape={tuple(value.shape)}, dtype={_dtype(value.dtype)}{extra}, "
            f"{_preview(value)})"
        )
    if isinstance(value, np.ndarray):
        return f"ndarray(shape={value.shape}, dtype={value.dtype}, {_preview(value)})"
    if isinstance(value, (list, tuple)) and depth < 2:
        items = [_summary(v, depth + 1) for v in value[:4]]
        if len(value) > 4:
            items.append(f"... ({len(value)} items)")
        if isinstance(value, list):
            return "[" + ", ".join(items) + "]"
        return "(" + ", ".join(items) + (",)" if len(value) == 1 else ")")
    if isinstance(value, dict) and depth < 2:
        items = [f"{k!r}: {_summary(v, depth + 1)}" for k, v in list(value.items())[:4]]
        if len(value) > 4:
            items.append(f"... ({len(value)} items)")
        return "{" + ", ".join(items) + "}"
    if isinstance(value, float):
        return f"{value:.6g}"
    text = repr(value).splitlines()[0] if repr(value) else ""
    return text if len(text) <= 60 else text[:57] + "..."


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _preview(array: torch.Tensor | np.ndarray) -> str:
    flat = array.detach().cpu().reshape(-1) if isinstance(array, torch.Tensor) else array.ravel()
    shown = ", ".join(_number(x) for x in flat[:_VALUES_SHOWN].tolist())
    return f"[{shown}{', ...' if len(flat) > _VALUES_SHOWN else ''}]"


def _number(x: Any) -> str:
    return f"{x:.6g}" if isinstance(x, float) else str(x)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


# ---------------------------------------------------------------------------------------
# Comparison: None when got matches expected, else one line (and hints) saying how not


def _difference(got: Any, expected: Any, path: str, rtol: float, atol: float, nan: bool):
    if expected is None:
        return None if got is None else f"{path}: expected None, got {_summary(got)}"
    if got is None:
        return f"{path}: got None, expected {_summary(expected)}\n  hint: a missing `return`?"
    if isinstance(expected, torch.Tensor):
        return _tensor_difference(got, expected, path, rtol, atol, nan)
    if isinstance(expected, np.ndarray):
        if not isinstance(got, np.ndarray):
            return f"{path}: expected a numpy array, got {_summary(got)}"
        if got.shape != expected.shape:
            return f"{path}: shape {got.shape} instead of the expected {expected.shape}"
        if got.dtype != expected.dtype:
            return f"{path}: dtype {got.dtype} instead of the expected {expected.dtype}"
        if expected.dtype.kind not in "biufc":
            equal = np.array_equal(got, expected)
            return None if equal else f"{path}: {_summary(got)} instead of {_summary(expected)}"
        return _values_difference(
            torch.from_numpy(np.ascontiguousarray(got)),
            torch.from_numpy(np.ascontiguousarray(expected)),
            path, rtol, atol, nan,
        )  # fmt: skip
    if isinstance(expected, (bool, np.bool_)):
        ok = isinstance(got, (bool, np.bool_)) and bool(got) == bool(expected)
        return None if ok else f"{path}: got {_summary(got)}, expected {expected!r}"
    if isinstance(expected, numbers.Number):
        return _number_difference(got, expected, path, rtol, atol, nan)
    if dataclasses.is_dataclass(expected) and not isinstance(expected, type):
        if type(got) is not type(expected):
            return f"{path}: expected a {type(expected).__name__}, got {_summary(got)}"
        for field in dataclasses.fields(expected):
            name = field.name
            found = _difference(
                getattr(got, name), getattr(expected, name), f"{path}.{name}", rtol, atol, nan
            )
            if found:
                return found
        return None
    if isinstance(expected, Mapping):
        if not isinstance(got, Mapping):
            return f"{path}: expected a dict, got {_summary(got)}"
        missing = [k for k in expected if k not in got]
        unexpected = [k for k in got if k not in expected]
        if missing or unexpected:
            parts = [f"missing {', '.join(map(repr, missing))}"] if missing else []
            parts += [f"unexpected {', '.join(map(repr, unexpected))}"] if unexpected else []
            return f"{path}: the keys differ: {'; '.join(parts)}"
        for key in expected:
            found = _difference(got[key], expected[key], f"{path}[{key!r}]", rtol, atol, nan)
            if found:
                return found
        return None
    if isinstance(expected, (tuple, list)):
        kind = type(expected).__name__
        if not isinstance(got, (tuple, list)):
            return (
                f"{path}: expected a {kind} of {_plural(len(expected), 'value')}, "
                f"got {_summary(got)}"
            )
        if len(got) != len(expected):
            return (
                f"{path}: a {type(got).__name__} of {_plural(len(got), 'value')} "
                f"instead of {len(expected)}"
            )
        fields = getattr(expected, "_fields", None)
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            sub = f"{path}.{fields[i]}" if fields else f"{path}[{i}]"
            found = _difference(g, e, sub, rtol, atol, nan)
            if found:
                return found
        return None
    try:
        equal = bool(got == expected)
    except Exception:
        equal = False
    return None if equal else f"{path}: got {_summary(got)}, expected {_summary(expected)}"


def _number_difference(got, expected, path, rtol, atol, nan):
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        return f"{path}: got {_summary(got)}, expected a number\n  hint: use .item()"
    if not isinstance(got, numbers.Number) or isinstance(got, complex) != isinstance(
        expected, complex
    ):
        return f"{path}: got {_summary(got)}, expected a number ({_summary(expected)})"
    if got == expected or (nan and _isnan(got) and _isnan(expected)):
        return None
    tolerance = atol + rtol * abs(expected)
    if abs(got - expected) <= tolerance:
        return None
    line = (
        f"{path}: got {_summary(got)}, expected {_summary(expected)} "
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
        return f"{path}: expected a Tensor, got {_summary(got)}{hint}"
    if got.shape != expected.shape:
        line = f"{path}: shape {tuple(got.shape)} instead of the expected {tuple(expected.shape)}"
        return line + _layout_hint(got, expected, rtol, atol, nan)
    if got.dtype != expected.dtype:
        return f"{path}: dtype {_dtype(got.dtype)} instead of the expected {_dtype(expected.dtype)}"
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
        line = f"{path}: got {_number(g_worst)}, expected {_number(e_worst)}"
    else:
        line = (
            f"{path}: {int(wrong.sum())} of {g.numel()} values differ; the largest "
            f"difference, {gap.max().item():.3g}, is at index {index}: "
            f"expected {_number(e_worst)}, got {_number(g_worst)}\n"
            f"    expected: {_preview(e)}\n"
            f"    got:      {_preview(g)}"
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
