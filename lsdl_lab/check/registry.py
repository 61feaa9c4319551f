"""Named checkers: each exercise's checker registers itself under the exercise's name.

A module of checkers decorates each one with :func:`exercise`; importing the module
registers them. A lab imports its own module of checkers, then asks for one by name::

    from lsdl_lab.exercises import lab01            # registers Lab 1's checkers
    check.checker("lab01.top_k_accuracy")(top_k_accuracy)

The labs name their exercises ``labNN.function`` and keep their checkers in
``lsdl_lab.exercises.labNN``; this module imports none of them, so a checker that is not
registered yet is an error that says which module to import.
"""

from __future__ import annotations

from collections.abc import Callable

_CHECKERS: dict[str, Callable[[Callable], None]] = {}

# Where the labs' checkers live (named in the error for a checker not registered yet).
LABS_PACKAGE = "lsdl_lab.exercises"


def exercise(name: str) -> Callable[[Callable], Callable]:
    """Register the decorated ``check_xxx(student_fn)`` as the checker of exercise
    ``name``, so that a lab can call ``checker(name)(student_fn)``."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"Invalid name: {name!r} (expected a non-empty string)")

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
    """The checker registered with :func:`exercise` under ``name``; a ``LookupError`` that
    names the module to import when there is none."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"Invalid name: {name!r} (expected a non-empty string)")
    if name in _CHECKERS:
        return _CHECKERS[name]
    lab, dot, _ = name.partition(".")
    where = f"{LABS_PACKAGE}.{lab}" if dot else "the module that defines it"
    raise LookupError(
        f"no checker {name!r} is registered; import {where} first "
        f"(registered now: {', '.join(registered()) or 'none'})"
    )


def registered() -> list[str]:
    """The names of every registered checker, sorted."""
    return sorted(_CHECKERS)


def _qualified(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
