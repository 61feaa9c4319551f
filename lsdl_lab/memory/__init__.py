"""Memory: measure it, then trade it (Chapter 8).

* :mod:`~lsdl_lab.memory.measure` -- bytes held per category and dtype, bytes saved for
  backward, tables per rank.
* :mod:`~lsdl_lab.memory.checkpoint` -- activation checkpointing (Chen et al. 2016).
"""

from .checkpoint import (
    Recompute,
    checkpoint_sequential,
    segments,
    sqrt_spacing,
    sweep,
    theoretical_peak,
)
from .measure import SavedTensorBytes, format_bytes, format_table, measure, measure_by_dtype

__all__ = [
    "Recompute",
    "SavedTensorBytes",
    "checkpoint_sequential",
    "format_bytes",
    "format_table",
    "measure",
    "measure_by_dtype",
    "segments",
    "sqrt_spacing",
    "sweep",
    "theoretical_peak",
]
