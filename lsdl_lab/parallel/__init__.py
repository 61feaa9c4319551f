"""Model parallelism (Chapter 7.6): a layer split across ranks, layers split into stages.

* :mod:`~lsdl_lab.parallel.tensor`: Megatron-style tensor parallelism (Shoeybi et al.,
  2019): the f and g operators, column- and row-parallel linear layers, and the book's
  GPT block with its MLP and attention split across ranks.
* :mod:`~lsdl_lab.parallel.pipeline`: a pipeline of stages over point-to-point messages
  with the GPipe and 1F1B schedules, measuring the bubble and the activations in flight.
"""

from .pipeline import (
    SCHEDULES,
    PipelineReport,
    bubble_fraction,
    gpipe_schedule,
    one_f_one_b_schedule,
    pipeline_step,
    torch_pipeline_step,
)
from .tensor import (
    ColumnParallelLinear,
    CopyToParallel,
    ReduceFromParallel,
    RowParallelLinear,
    TensorParallelAttention,
    TensorParallelBlock,
    TensorParallelMLP,
    copy_to_parallel,
    reduce_from_parallel,
    shard,
    tensor_parallel_gpt,
)

__all__ = [
    "SCHEDULES",
    "ColumnParallelLinear",
    "CopyToParallel",
    "PipelineReport",
    "ReduceFromParallel",
    "RowParallelLinear",
    "TensorParallelAttention",
    "TensorParallelBlock",
    "TensorParallelMLP",
    "bubble_fraction",
    "copy_to_parallel",
    "gpipe_schedule",
    "one_f_one_b_schedule",
    "pipeline_step",
    "reduce_from_parallel",
    "shard",
    "tensor_parallel_gpt",
    "torch_pipeline_step",
]
