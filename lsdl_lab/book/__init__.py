"""The book's wing: what exists only to run a page or a lab of the book.

The library's packages hold the ideas the book teaches; this package holds what a chapter
or a lab needs around them to show them: the experiments it runs on a world of processes,
its races, its 2-D problems, its interactive explorers. The library never imports it (the
test ``tests/test_imports.py`` holds that), so the library stays what the book explains
and this package may depend on any of it.

* :mod:`~lsdl_lab.book.communication_experiments`: the importable workers that Chapter 7
  and Lab 7 spawn (collectives timed, compressors trained, local SGD, tensor and pipeline
  parallelism, parameter-server staleness).
* :mod:`~lsdl_lab.book.memory_experiments`: the measurements of Chapter 8 and Lab 8 (ZeRO
  per rank, optimizer state, fp16 underflow, checkpoint spacing) and their worker.
* :mod:`~lsdl_lab.book.memory_form`: the memory calculator as an HTML table and as a form
  (ipywidgets), Chapter 8.
* :mod:`~lsdl_lab.book.planning`: the planner at lab scale, the world-2 CPU cluster from a
  measured alpha-beta, set against a measured run of the entry point (Chapter 9).
* :mod:`~lsdl_lab.book.problems`: two-dimensional test problems and the paths optimizers
  take on them (Chapter 3, Lab 3).
* :mod:`~lsdl_lab.book.races`: races of optimizers, loss against steps and wall-clock and
  the bytes of state each keeps (Chapter 6, Lab 6).
* :mod:`~lsdl_lab.book.scaling_experiments`: the workers of Chapter 10 (all-to-all and the
  all-reduces that scale, expert parallelism, sequence and context parallelism, DiLoCo).
* :mod:`~lsdl_lab.book.scaling_lab`: the workers of Lab 10 that Chapter 10's do not cover.
* :mod:`~lsdl_lab.book.widgets`: the optimizer explorer (ipywidgets) on a plain drawing
  function (Lab 3).

Submodules load on first use (``lsdl_lab.book.races`` works after ``import lsdl_lab``);
ipywidgets is imported only when a form or an explorer is built.
"""

from __future__ import annotations

import importlib
import pkgutil

# Every module of the wing, found on disk, none imported until it is asked for.
_SUBMODULES = {m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")}


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'lsdl_lab.book' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | _SUBMODULES)
