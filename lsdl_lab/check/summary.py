"""Short, readable summaries of the values and calls a checker reports.

A failing check names the case it failed on; tensors and arrays are shown by shape, dtype
and their first few values, containers by their first few items, so a message stays a
few lines long whatever the size of the data.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

_VALUES_SHOWN = 6


def summarise_call(fn: Callable, args: tuple, kwargs: dict) -> str:
    """The call ``fn(*args, **kwargs)`` as ``name=summary, ...`` (by parameter name where
    the signature allows)."""
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):
        parts = [summary(a) for a in args]
        parts += [f"{k}={summary(v)}" for k, v in kwargs.items()]
    else:
        parts = []
        for param, value in bound.arguments.items():
            kind = bound.signature.parameters[param].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                parts += [summary(v) for v in value]
            elif kind is inspect.Parameter.VAR_KEYWORD:
                parts += [f"{k}={summary(v)}" for k, v in value.items()]
            else:
                parts.append(f"{param}={summary(value)}")
    return ", ".join(parts) or "no arguments"


def summary(value: Any, depth: int = 0) -> str:
    """One short line for ``value``: tensors and arrays by shape, dtype and first values,
    containers by their first items (two levels deep), anything else by its ``repr``."""
    if isinstance(value, torch.Tensor):
        extra = "".join(
            [
                f", device={value.device}" if value.device.type != "cpu" else "",
                ", requires_grad=True" if value.requires_grad else "",
            ]
        )
        return (
            f"Tensor(shape={tuple(value.shape)}, dtype={dtype_name(value.dtype)}{extra}, "
            f"{preview(value)})"
        )
    if isinstance(value, np.ndarray):
        return f"ndarray(shape={value.shape}, dtype={value.dtype}, {preview(value)})"
    if isinstance(value, (list, tuple)) and depth < 2:
        items = [summary(v, depth + 1) for v in value[:4]]
        if len(value) > 4:
            items.append(f"... ({len(value)} items)")
        if isinstance(value, list):
            return "[" + ", ".join(items) + "]"
        return "(" + ", ".join(items) + (",)" if len(value) == 1 else ")")
    if isinstance(value, dict) and depth < 2:
        items = [f"{k!r}: {summary(v, depth + 1)}" for k, v in list(value.items())[:4]]
        if len(value) > 4:
            items.append(f"... ({len(value)} items)")
        return "{" + ", ".join(items) + "}"
    if isinstance(value, float):
        return f"{value:.6g}"
    text = repr(value).splitlines()[0] if repr(value) else ""
    return text if len(text) <= 60 else text[:57] + "..."


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def preview(array: torch.Tensor | np.ndarray) -> str:
    flat = array.detach().cpu().reshape(-1) if isinstance(array, torch.Tensor) else array.ravel()
    shown = ", ".join(number(x) for x in flat[:_VALUES_SHOWN].tolist())
    return f"[{shown}{', ...' if len(flat) > _VALUES_SHOWN else ''}]"


def number(x: Any) -> str:
    return f"{x:.6g}" if isinstance(x, float) else str(x)


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
