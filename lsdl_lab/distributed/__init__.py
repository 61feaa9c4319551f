"""Distributed training on real ``torch.distributed`` worlds (Chapter 7).

* :mod:`~lsdl_lab.distributed.world`: start a world of processes from a notebook (:func:`spawn`)
  or join one under ``torchrun`` (:func:`init_from_env`), with timeouts, the failing
  rank's traceback, and no process left behind.
* :mod:`~lsdl_lab.distributed.collectives`: ring, recursive-doubling, Rabenseifner's,
  binary-tree and hierarchical all-reduce, ring all-gather and reduce-scatter, and the
  pairwise all-to-all, built from point-to-point messages; a blocking ring that deadlocks.
* :mod:`~lsdl_lab.distributed.cost`: the alpha-beta model of each of them and of the
  parameter server, the message size where the ring overtakes another algorithm, measured
  and fitted on the world at hand.
* :mod:`~lsdl_lab.distributed.param_server`: push and pull over point-to-point; synchronous and
  asynchronous SGD with bounded staleness.
* :mod:`~lsdl_lab.distributed.local_sgd`: communicating less often: gradient accumulation with
  ``no_sync``, local SGD and post-local SGD, overlap of communication with the backward pass.
* :mod:`~lsdl_lab.distributed.diloco`: :class:`DiLoCo`, local steps of an inner optimizer and,
  every H steps, an outer Nesterov step on the averaged pseudo-gradient (Douillard et al. 2023).
* :mod:`~lsdl_lab.distributed.traffic`: :class:`CollectiveBytes`, the one count of the bytes
  a rank hands to the collectives, for every experiment and the entry point.

The importable workers that Chapter 7 and Lab 7 spawn live in the book's wing,
:mod:`lsdl_lab.book.communication_experiments`.
"""

from .collectives import (
    all_to_all,
    binary_tree_all_reduce,
    hierarchical_all_reduce,
    naive_ring_all_reduce_blocking,
    node_groups,
    rabenseifner_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    tree_all_reduce,
)
from .cost import (
    AlphaBeta,
    binary_tree_all_reduce_time,
    crossover_nbytes,
    fit_alpha_beta,
    hierarchical_all_reduce_time,
    measure_collective,
    pairwise_all_to_all_time,
    parameter_server_all_reduce_time,
    rabenseifner_all_reduce_time,
    ring_all_reduce_time,
    ring_all_to_all_time,
    tree_all_reduce_time,
)
from .diloco import DiLoCo
from .local_sgd import (
    PeriodicAverager,
    accumulate_gradients,
    all_reduce_gradients,
    average_parameters,
    overlap_times,
    post_local_sgd,
)
from .param_server import all_reduce_sgd, asynchronous_sgd, pull, push, synchronous_sgd
from .traffic import CollectiveBytes
from .world import (
    Placement,
    WorkerError,
    call_each,
    destroy,
    free_port,
    init_from_env,
    placement,
    spawn,
    world_from_env,
)

__all__ = [
    "AlphaBeta",
    "CollectiveBytes",
    "DiLoCo",
    "PeriodicAverager",
    "accumulate_gradients",
    "all_reduce_gradients",
    "average_parameters",
    "overlap_times",
    "post_local_sgd",
    "all_reduce_sgd",
    "asynchronous_sgd",
    "fit_alpha_beta",
    "measure_collective",
    "parameter_server_all_reduce_time",
    "pull",
    "push",
    "ring_all_reduce_time",
    "tree_all_reduce_time",
    "rabenseifner_all_reduce_time",
    "binary_tree_all_reduce_time",
    "hierarchical_all_reduce_time",
    "pairwise_all_to_all_time",
    "ring_all_to_all_time",
    "crossover_nbytes",
    "WorkerError",
    "call_each",
    "destroy",
    "free_port",
    "init_from_env",
    "Placement",
    "placement",
    "naive_ring_all_reduce_blocking",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "spawn",
    "synchronous_sgd",
    "tree_all_reduce",
    "rabenseifner_all_reduce",
    "binary_tree_all_reduce",
    "hierarchical_all_reduce",
    "node_groups",
    "all_to_all",
    "world_from_env",
]
