"""The one training entry point (Chapter 9): the same command from one process to
``torchrun`` on many nodes.

* :mod:`~lsdl_lab.run.config`: :class:`Config`, filled from a YAML file and flags;
* :mod:`~lsdl_lab.run.build`: the model, batches, optimizer and schedule it names;
* :mod:`~lsdl_lab.run.parallel`: :func:`~lsdl_lab.run.parallel.parallelize` the model
  (DDP, FSDP2), build the optimizer once after it (ZeRO 1-3 wrap it), the whole state
  under any mode, the bytes handed to collectives;
* :mod:`~lsdl_lab.run.loop`: :func:`train`, one run on this process: :func:`lsdl_lab.train.fit`
  with a :class:`~lsdl_lab.steps.DataParallelStep` and the run's checkpoint (a file of
  :mod:`lsdl_lab.checkpoint`, or a sharded one of ``torch.distributed.checkpoint``, written
  in the background with ``async_checkpoint``);
* :mod:`~lsdl_lab.run.metrics`: the JSON-lines metrics log;
* :mod:`~lsdl_lab.run.launch`: :func:`launch` (``torchrun`` from a notebook),
  :func:`spawn_run` (a world of :func:`lsdl_lab.distributed.spawn`) and the CLI.

From a shell::

    python -m lsdl_lab.run --config run.yaml
    torchrun --standalone --nproc-per-node 2 -m lsdl_lab.run --config run.yaml

From a notebook::

    records = launch(Config(model="mlp", steps=50, out_dir="runs/a"), nproc=2)
"""

from ..checkpoint import CheckpointError
from .config import Config, load_config, parser
from .launch import LaunchError, launch, main, run_rank, spawn_run, torchrun_command
from .loop import train
from .metrics import read_metrics

__all__ = [
    "CheckpointError",
    "Config",
    "LaunchError",
    "launch",
    "load_config",
    "main",
    "parser",
    "read_metrics",
    "run_rank",
    "spawn_run",
    "torchrun_command",
    "train",
]
