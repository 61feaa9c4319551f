"""lsdl_lab: the lab library of the runnable textbook "Large-Scale Deep Learning Optimization".

One module per idea (see the book's chapter table). Submodules load on first use, so
``import lsdl_lab`` is cheap and ``lsdl_lab.models`` works without a separate import.
"""

from __future__ import annotations

import importlib
import pkgutil

from .profiles import Profile, setup

__version__ = "0.1.0"
__all__ = ["Profile", "setup", "__version__"]

# Every module of the package, found on disk, so a new module needs no registration here.
_SUBMODULES = {m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")}


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'lsdl_lab' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | _SUBMODULES)
