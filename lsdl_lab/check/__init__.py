"""Checkers for exercises: run a student's function beside the reference and explain any
difference.

* :mod:`~lsdl_lab.check.checkers`: :func:`check_function` (a student's function against
  the reference on a list of cases) and :func:`check_value` (a value against the
  expected one); :class:`CheckFailed` says on which case, where in the output and how
  they differ;
* :mod:`~lsdl_lab.check.compare`: the comparison engine and its hints (a flipped sign, a
  constant factor, a transpose);
* :mod:`~lsdl_lab.check.summary`: the short summaries of values and calls in messages;
* :mod:`~lsdl_lab.check.registry`: named checkers, registered by the module that defines
  them (:func:`exercise`) and looked up by name (:func:`checker`).

A lab imports its own checkers (``from lsdl_lab.exercises import lab01``), which registers
them, then calls one by name::

    check.checker("lab01.top_k_accuracy")(top_k_accuracy)
    # ✔ top_k_accuracy: all 5 cases match the reference

This package imports none of the labs' checkers.
"""

from .checkers import (
    PLACEHOLDER_MESSAGE,
    CheckFailed,
    answer_or_none,
    check_function,
    check_value,
    with_hints,
)
from .registry import checker, exercise, registered

__all__ = [
    "PLACEHOLDER_MESSAGE",
    "CheckFailed",
    "answer_or_none",
    "check_function",
    "check_value",
    "checker",
    "exercise",
    "with_hints",
    "registered",
]
