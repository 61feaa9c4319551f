"""Model parallelism (Chapter 7.6): a layer split across ranks, layers split into stages.

* :mod:`~lsdl_lab.parallel.tensor`: Megatron-style tensor parallelism (Shoeybi et al.,
  2019): the f and g operators, column- and row-parallel linear layers, and the book's
  GPT block with its MLP and attention split across ranks; with sequence parallelism
  (Korthikanti et al., 2022), its LayerNorms and dropouts split along the sequence.
* :mod:`~lsdl_lab.parallel.expert`: expert parallelism (GShard, Switch): a mixture of
  experts' experts split across ranks, the tokens dispatched and combined by all-to-all.
* :mod:`~lsdl_lab.parallel.pipeline`: a pipeline of stages over point-to-point messages
  with the GPipe and 1F1B schedules, measuring the bubble and the activations in flight.
* :mod:`~lsdl_lab.parallel.context`: context parallelism, one sequence split across
  ranks: ring attention (Liu et al., 2023) and DeepSpeed-Ulysses (Jacobs et al., 2023).
"""

from .context import (
    online_softmax_step,
    ring_attention,
    ring_attention_bytes,
    ulysses_attention,
    ulysses_attention_bytes,
)
from .expert import AllToAll, AllToAllBytes, ExpertParallelMoE, expert_parallel_gpt
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
    GatherFromSequenceParallel,
    ReduceFromParallel,
    ReduceScatterToSequenceParallel,
    RowParallelLinear,
    TensorParallelAttention,
    TensorParallelBlock,
    TensorParallelMLP,
    all_reduce_sequence_parallel_grads,
    copy_to_parallel,
    gather_from_sequence_parallel,
    reduce_from_parallel,
    reduce_scatter_to_sequence_parallel,
    shard,
    tensor_parallel_gpt,
)

__all__ = [
    "SCHEDULES",
    "AllToAll",
    "AllToAllBytes",
    "ExpertParallelMoE",
    "expert_parallel_gpt",
    "ColumnParallelLinear",
    "CopyToParallel",
    "GatherFromSequenceParallel",
    "PipelineReport",
    "ReduceFromParallel",
    "ReduceScatterToSequenceParallel",
    "RowParallelLinear",
    "TensorParallelAttention",
    "TensorParallelBlock",
    "TensorParallelMLP",
    "all_reduce_sequence_parallel_grads",
    "bubble_fraction",
    "copy_to_parallel",
    "gather_from_sequence_parallel",
    "gpipe_schedule",
    "one_f_one_b_schedule",
    "online_softmax_step",
    "pipeline_step",
    "reduce_from_parallel",
    "reduce_scatter_to_sequence_parallel",
    "ring_attention",
    "ring_attention_bytes",
    "shard",
    "tensor_parallel_gpt",
    "torch_pipeline_step",
    "ulysses_attention",
    "ulysses_attention_bytes",
]
