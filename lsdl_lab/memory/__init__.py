"""Memory: measure it, then trade it (Chapter 8).

* :mod:`~lsdl_lab.memory.measure` -- bytes held per category and dtype, bytes saved for
  backward, tables per rank.
* :mod:`~lsdl_lab.memory.precision` -- the dynamic loss scaler (GradScaler's semantics,
  a floor, one skip decision over a process group) and fp16/bf16 demonstrations.
* :mod:`~lsdl_lab.memory.quantize` -- block-wise 8-bit quantization with the dynamic map
  (Dettmers et al. 2022), which keeps :class:`~lsdl_lab.optim.Adam8bit`'s states in one
  byte a value.
* :mod:`~lsdl_lab.memory.fp8` -- FP8 numerics emulated (Micikevicius et al. 2022): the e4m3
  and e5m2 formats, per-tensor (current, delayed) and per-block (MX) scaling, a linear layer
  with FP8 operands.
* :mod:`~lsdl_lab.memory.recompute` -- activation checkpointing (Chen et al. 2016).
* :mod:`~lsdl_lab.memory.zero` -- bytes per rank under ZeRO's stages (Rajbhandari et al.
  2020).
* :mod:`~lsdl_lab.memory.sharded` -- ZeRO's stages 1-3 on a real process group
  (:class:`ZeroOptimizer`).
* :mod:`~lsdl_lab.memory.calculator` -- bytes per rank of each category for training a
  GPT (activations by Korthikanti et al. 2022) or the book's ResNet.
"""

from .calculator import (
    GPTShape,
    ResNetShape,
    activation_bytes,
    active_parameters,
    gpt_memory,
    gpt_param_shapes,
    layer_traffic,
    optimizer_state_bytes,
    resnet_activation_bytes,
    resnet_memory,
    resnet_param_shapes,
)
from .fp8 import (
    DelayedScaling,
    FP8Linear,
    convert_to_fp8,
    dequantize_fp8,
    fp8_counts,
    fp8_round_trip,
    quantize_fp8,
)
from .measure import (
    LargestTensor,
    SavedTensorBytes,
    format_bytes,
    format_table,
    measure,
    measure_by_dtype,
)
from .precision import (
    LossScaler,
    amp_step,
    bf16_range_vs_precision,
    fp16_underflow,
    mixed_precision_for,
)
from .quantize import (
    dequantize_blockwise,
    dynamic_map,
    quantize_blockwise,
    quantized_bytes,
)
from .recompute import (
    Recompute,
    checkpoint_sequential,
    segments,
    sqrt_spacing,
    sweep,
    theoretical_peak,
)
from .sharded import ZeroOptimizer
from .zero import zero_bytes

__all__ = [
    "GPTShape",
    "activation_bytes",
    "active_parameters",
    "amp_step",
    "bf16_range_vs_precision",
    "checkpoint_sequential",
    "convert_to_fp8",
    "DelayedScaling",
    "dequantize_fp8",
    "dequantize_blockwise",
    "dynamic_map",
    "format_bytes",
    "format_table",
    "fp8_counts",
    "fp8_round_trip",
    "FP8Linear",
    "fp16_underflow",
    "gpt_memory",
    "gpt_param_shapes",
    "LargestTensor",
    "LossScaler",
    "measure",
    "measure_by_dtype",
    "mixed_precision_for",
    "layer_traffic",
    "optimizer_state_bytes",
    "quantize_blockwise",
    "quantize_fp8",
    "quantized_bytes",
    "Recompute",
    "ResNetShape",
    "resnet_activation_bytes",
    "resnet_memory",
    "resnet_param_shapes",
    "SavedTensorBytes",
    "segments",
    "sqrt_spacing",
    "sweep",
    "theoretical_peak",
    "zero_bytes",
    "ZeroOptimizer",
]
