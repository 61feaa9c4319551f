"""Memory: measure it, then trade it (Chapter 8).

* :mod:`~lsdl_lab.memory.measure` -- bytes held per category and dtype, bytes saved for
  backward, tables per rank.
* :mod:`~lsdl_lab.memory.precision` -- the dynamic loss scaler (GradScaler's semantics,
  a floor, one skip decision over a process group) and fp16/bf16 demonstrations.
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
from .precision import LossScaler, bf16_range_vs_precision, fp16_underflow

__all__ = [
    "LossScaler",
    "bf16_range_vs_precision",
    "fp16_underflow",
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
