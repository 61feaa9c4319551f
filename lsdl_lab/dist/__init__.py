"""Distributed training on real ``torch.distributed`` worlds (Chapter 7).

* :mod:`~lsdl_lab.dist.world`: start a world of processes from a notebook (:func:`spawn`)
  or join one under ``torchrun`` (:func:`init_from_env`), with timeouts, the failing
  rank's traceback, and no process left behind.
"""

from .world import (
    WorkerError,
    call_each,
    default_backend,
    destroy,
    free_port,
    init_from_env,
    spawn,
    world_from_env,
)

__all__ = [
    "WorkerError",
    "call_each",
    "default_backend",
    "destroy",
    "free_port",
    "init_from_env",
    "spawn",
    "world_from_env",
]
