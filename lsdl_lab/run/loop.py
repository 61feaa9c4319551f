"""The run itself: :func:`train` does one whole run of a :class:`Config` on this process.

Under ``torchrun`` (the environment names ``RANK`` and ``WORLD_SIZE``) the process joins
the launcher's world with :func:`lsdl_lab.distributed.init_from_env` (each round of restarted
workers under its own keys of torchrun's store), every collective bounded by
``config.timeout``; alone, it runs as a world of one (with a process group of one
only where ZeRO, FSDP2 or a compression hook need one). The device and backend are
:func:`lsdl_lab.distributed.placement`'s for ``config.device``: with ``auto``, ``cuda:LOCAL_RANK``
and NCCL where the machine has a GPU for each of its ranks, else the CPU and gloo (a
world of 2 on a one-GPU machine runs on the CPU); the run's first line says which.

The run is :func:`lsdl_lab.train.fit`, the library's one training loop, with the step
:class:`lsdl_lab.steps.DataParallelStep`: every rank reads the global batch of step ``t``
and keeps its slice (:class:`_RankBatches`), runs its micro-batches (forward under
autocast when ``precision`` says so, the loss divided by the number of micro-batches,
backward; only the last micro-batch's backward communicates), then one all-reduce of
(loss, non-finite flag) tells every rank the global loss and whether any rank's loss was
NaN or infinite: then every rank raises :class:`~lsdl_lab.train.NonFiniteLossError`
naming the step, before the update, and no rank is left waiting in a collective.
Otherwise the optimizer steps (through the loss scaler with fp16) and the schedule
advances. What is the run's own: the model wrapped by :func:`.parallel.parallelize` and
the optimizer built once after it, a metrics record every ``log_every`` steps
(:class:`_Records`, fit's callback) and a checkpoint every ``checkpoint_every`` steps and
at the end (:class:`RunCheckpoint`, the checkpoint fit is given): one file written by rank
0 (``checkpoint_format: file``), or a directory of PyTorch's distributed checkpoint that
every rank writes its part of (``dcp``), in the background with ``async_checkpoint``.

In a dry run (:mod:`lsdl_lab.profiles`; the caps reach every rank through the environment,
which ``torchrun`` and :func:`lsdl_lab.distributed.spawn` pass on) the run stops after
``LSDL_MAX_STEPS`` steps, its schedule still the config's, and each global batch holds at
most ``LSDL_MAX_EXAMPLES`` examples, cut into as many micro-batches as the config's.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from .. import checkpoint as files
from .._util import seed_from
from ..distributed.traffic import CollectiveBytes
from ..distributed.world import Placement, free_port, init_from_env, placement
from ..memory import LossScaler, checkpoint_sequential, mixed_precision_for
from ..profiles import capped_steps
from ..steps import DataParallelStep
from ..train import Checkpoint, History, fit
from .build import build, make_schedule
from .config import Config
from .metrics import MetricsLog, read_metrics
from .parallel import (
    build_optimizer,
    full_state,
    load_full_optimizer_state,
    load_sharded_state,
    model_states,
    names_of,
    parallelize,
    sharded_state,
    unwrapped,
    whole_state,
)

__all__ = ["FORMAT", "SHARDED_FORMAT", "Checkpointed", "RunCheckpoint", "train"]

CHECKPOINT, SHARDED = "checkpoint.pt", "checkpoint.dcp"
METRICS, CONFIG = "metrics.jsonl", "config.yaml"
# The run's checkpoint formats and the keys each must hold (RunCheckpoint): the file, and
# the state.pt beside a sharded checkpoint's tensors (the tensors are DCP's)
FORMAT = "lsdl_lab.run/1"
SHARDED_FORMAT = "lsdl_lab.run.sharded/1"
SMALL = ("format", "step", "scheduler", "world_size", "parallel", "config")
KEYS = {FORMAT: SMALL + ("model", "optimizer"), SHARDED_FORMAT: SMALL + ("others",)}


class Checkpointed(nn.Sequential):
    """A sequence of blocks run with activation checkpointing in segments of ``every``
    blocks (:func:`lsdl_lab.memory.checkpoint_sequential`); its parameters keep the names
    they had in the plain ``nn.Sequential``."""

    def __init__(self, blocks: nn.Sequential, every: int, implementation: str):
        super().__init__(*blocks)
        self.every, self.implementation = every, implementation

    def forward(self, x):
        """The blocks on ``x``, recomputed in the backward pass segment by segment."""
        return checkpoint_sequential(list(self), x, self.every, self.implementation)


def _placement(config: Config) -> Placement:
    """This rank's device and its world's backend: :func:`lsdl_lab.distributed.placement` for
    ``config.device`` (NCCL with a GPU per rank on this machine, else gloo on the CPU),
    the backend ``config.backend`` where it is not ``auto``."""
    where = placement(config.device)
    if config.backend in ("auto", where.backend):
        return where
    if config.backend == "nccl":
        raise ValueError(
            f"Invalid backend: 'nccl' on {where.device} (expected 'gloo' or 'auto': NCCL "
            f"needs CUDA tensors, one GPU per rank; here {where.reason})"
        )
    return Placement(where.device, "gloo", f"gloo on {where.device}, as asked")


def _precision(config: Config, device: torch.device) -> tuple[Config, str]:
    """``config`` with ``precision="auto"`` made concrete for ``device``
    (:func:`lsdl_lab.memory.mixed_precision_for`: bf16 where the GPU computes in it, fp16
    with the loss scaler on an older GPU, none on a CPU), and why; else as it is."""
    if config.precision != "auto":
        return config, ""
    precision, why = mixed_precision_for(device)
    if precision == "fp16" and config.parallel == "fsdp2":
        precision, why = "none", f"float32: FSDP2 here takes bf16 only, and {why}"
    return config.replace(precision=precision), why


def _join(config: Config, backend: str) -> tuple[int, int, bool]:
    """(rank, world size, whether this call created the process group)."""
    if dist.is_initialized():  # a world started by lsdl_lab.distributed.spawn
        return dist.get_rank(), dist.get_world_size(), False
    # torchrun (each round of restarted workers under its own keys) or another launcher
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        rank, world = init_from_env(backend, config.timeout)
        return rank, world, True
    if config.parallel != "ddp" or config.compression != "none":
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=config.timeout),
        )
        return 0, 1, True
    return 0, 1, False


def train(config: Config) -> list[dict]:
    """Run ``config`` on this process (one rank of its world) and return the metrics
    records (rank 0; the other ranks return an empty list)."""
    if not isinstance(config, Config):
        raise TypeError(f"Invalid config: a {type(config).__name__} (expected a Config)")
    where = _placement(config)
    config, why = _precision(config, where.device)
    rank, world, created = _join(config, where.backend)
    try:
        records = _run(config, rank, world, where, why)
        if created and world > 1:  # no rank tears the group down while a peer still uses it
            dist.barrier()
        return records
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def _micro_batch(config: Config, world: int) -> tuple[int, int]:
    """(micro-batch size, micro-batches per step), checked against the world size."""
    if config.global_batch % world:
        raise ValueError(
            f"Invalid global_batch: {config.global_batch} (expected a multiple of the world "
            f"size {world})"
        )
    per_rank = config.global_batch // world
    micro = config.micro_batch or per_rank
    if per_rank % micro:
        raise ValueError(
            f"Invalid micro_batch: {micro} (expected a divisor of global_batch / world size "
            f"= {per_rank})"
        )
    accumulation = per_rank // micro
    if config.parallel == "zero1" and accumulation > 1:
        raise ValueError(
            f"Invalid micro_batch: {micro} with parallel='zero1' (expected {per_rank}: ZeRO "
            "stage 1 takes one backward pass per step; accumulate with zero2 or zero3)"
        )
    return micro, accumulation


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


def _inject_kill(config: Config, rank: int, t: int, out: Path) -> None:
    """``kill_at_step``: rank ``kill_rank`` dies by SIGKILL, once (a marker file remembers
    it across the restart), as a machine failure would end it: no cleanup, no message."""
    marker = out / f"killed_at_step_{t}.marker"
    if t == config.kill_at_step and rank == config.kill_rank and not marker.exists():
        marker.touch()
        print(f"rank {rank}: killing itself (SIGKILL) at step {t}, as asked", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def _gather(world: int, value) -> list:
    if world == 1:
        return [value]
    out = [None] * world
    dist.all_gather_object(out, value)
    return out


class RunCheckpoint(Checkpoint):
    """The run's checkpoint: the model and the optimizer state by parameter name, the
    scheduler and the loss scaler, the step, the elapsed time and where it was written.
    Loadable under any parallel mode and world size, in either format:

    * ``file`` (:data:`FORMAT`): the whole state (:func:`.parallel.full_state`, a
      collective) written by rank 0 to one file of :mod:`lsdl_lab.checkpoint`; the model's
      weights are loaded into the unwrapped model before it is parallelized (``state``,
      read once by :func:`_run`), the optimizer's by :meth:`restore`;
    * ``dcp``: a step directory of :func:`lsdl_lab.checkpoint.save_sharded` under
      ``checkpoint.dcp/``, every rank writing its part (:func:`.parallel.sharded_state`),
      asynchronously with ``async_checkpoint`` (its collectives in a process group of
      their own); :meth:`restore` reads each rank's part into the parallelized model and
      its optimizer (ZeRO reads it whole, as a file).

    ``blocked[step]`` is the time the save after ``step`` held this rank's training."""

    def __init__(self, *, path, state, model, optimizer, scheduler, step, config, world):
        self.path, self.state, self.config, self.world = path, state, config, world
        self.model, self.optimizer, self.scheduler, self.step = model, optimizer, scheduler, step
        self.pending, self.blocked, self.group = None, {}, None
        if config.async_checkpoint and world > 1:  # apart from training's collectives
            self.group = dist.new_group(backend="gloo")

    def _small(self, step: int, elapsed: float) -> dict:
        return dict(
            step=step,
            elapsed=elapsed,
            scheduler=self.scheduler.state_dict(),
            scaler=self.step.state_dict()["scaler"],
            world_size=self.world,
            parallel=self.config.parallel,
            config=self.config.to_dict(),
        )

    def save(self, step: int, history, elapsed: float) -> None:
        """Write the run's state after ``step`` steps (every rank calls it: gathering the
        whole state, or writing the shards, is a collective). The history is not kept:
        the metrics log is the run's record."""
        start = time.perf_counter()
        if self.config.checkpoint_format == "file":
            model_state, optimizer_state = full_state(self.model, self.optimizer)  # collective
            files.save(
                self.path,
                FORMAT,
                model=model_state,
                optimizer=optimizer_state,
                **self._small(step, elapsed),
            )
        else:
            self.finish()  # the previous asynchronous save, before its group is used again
            tensors, others, runs = sharded_state(self.model, self.optimizer)
            self.pending = files.save_sharded(
                self.path,
                step,
                tensors,
                SHARDED_FORMAT,
                group=self.group,
                asynchronous=self.config.async_checkpoint,
                pieces=runs,
                others=others,
                **self._small(step, elapsed),
            )
        self.blocked[step] = time.perf_counter() - start

    def finish(self) -> None:
        """Wait for an asynchronous save still in flight and complete it."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None

    def restore(self):
        """Load the checkpoint's optimizer, scheduler and loss-scaler states (and, from a
        sharded checkpoint, the model's: a file's weights were loaded before the model was
        wrapped) and return (an empty history, the step, the elapsed time); None without
        a checkpoint."""
        if self.state is None:
            return None
        if "optimizer" in self.state:  # a whole state: a file, or a sharded one read whole
            load_full_optimizer_state(self.model, self.optimizer, self.state["optimizer"])
        else:
            tensors, _, _ = sharded_state(self.model, self.optimizer)
            files.load_sharded(self.state["directory"], tensors, SHARDED_FORMAT)
            load_sharded_state(self.model, self.optimizer, tensors, self.state["others"])
        self.scheduler.load_state_dict(self.state["scheduler"])
        self.step.load_state_dict({"scaler": self.state.get("scaler", {})})
        return History(), self.state["step"], float(self.state.get("elapsed", 0.0))


def _found(out: Path, format: str) -> bool:
    """Whether ``out`` holds a checkpoint of ``format`` (``file`` or ``dcp``)."""
    if format == "file":
        return (out / CHECKPOINT).exists()
    return files.latest_sharded(out / SHARDED) is not None


def _refuse_the_other_format(config: Config, out: Path) -> None:
    """A run never starts afresh beside a checkpoint of the other format: it names it."""
    other = "dcp" if config.checkpoint_format == "file" else "file"
    if _found(out, other) and not _found(out, config.checkpoint_format):
        raise files.CheckpointError(
            f"{out} holds a checkpoint of checkpoint_format={other!r} "
            f"({out / (SHARDED if other == 'dcp' else CHECKPOINT)}), and this run's is "
            f"{config.checkpoint_format!r}: resume with checkpoint_format={other!r}, or "
            "delete it (or do not resume) to start from step 0"
        )


def _load(config: Config, out: Path, model: nn.Module) -> dict | None:
    """The checkpoint to resume from, or None: a file read once (every rank reads it),
    or a sharded checkpoint's ``state.pt`` with its ``directory`` (the tensors are read
    by :meth:`RunCheckpoint.restore` into the parallelized model), or, for ZeRO, read
    whole into the state a file would hold."""
    if not config.resume:
        return None
    _refuse_the_other_format(config, out)
    if config.checkpoint_format == "file":
        path = out / CHECKPOINT
        if not path.exists():
            return None
        state = files.load(path, FORMAT)
    else:
        path = files.latest_sharded(out / SHARDED)
        if path is None:
            return None
        if config.parallel.startswith("zero"):
            expected = {f"model.{k}": (v.shape, v.dtype) for k, v in model.state_dict().items()}
            tensors, state = files.read_sharded(path, SHARDED_FORMAT, expected)
            state["model"], state["optimizer"] = whole_state(
                {**tensors, **state["others"]}, names_of(unwrapped(model))
            )
        else:
            state = files.load(path / files.STATE, SHARDED_FORMAT)
        state["directory"] = path
    missing = [k for k in KEYS[state["format"]] if k not in state]
    if missing:
        raise files.CheckpointError(f"checkpoint {path} lacks {', '.join(missing)}")
    return state


class _RankBatches:
    """The batches of this rank: its ``1/world`` of the global batch of step ``t``.
    Reading step ``t``'s batch also seeds the step's random numbers (dropout) from (seed,
    step, rank), so a resumed run draws what an uninterrupted one draws, and runs the
    config's injected kill (a test's fault: rank ``kill_rank`` dies by SIGKILL once, at
    step ``kill_at_step``, as a machine failure would, with no cleanup). It remembers the
    step, for the injected NaN."""

    def __init__(self, batches, config: Config, rank: int, world: int, out: Path):
        self.batches, self.config, self.rank, self.world, self.out = (
            batches,
            config,
            rank,
            world,
            out,
        )
        self.t = -1

    def __call__(self, t: int) -> tuple:
        self.t = t
        _inject_kill(self.config, self.rank, t, self.out)
        torch.manual_seed(seed_from("run", self.config.seed, t, self.rank))
        x, y = self.batches(t)
        per_rank = len(x) // self.world
        part = slice(self.rank * per_rank, (self.rank + 1) * per_rank)
        return x[part], y[part]

    def poisoned(self) -> bool:
        """Whether this step's loss is to become NaN (``nan_at_step``, ``nan_rank``)."""
        return self.t == self.config.nan_at_step and self.rank == self.config.nan_rank


class _Records:
    """fit's callback: at each logging step, the run's metrics record (the loss, rate
    and time fit logged, and every rank's bytes handed to collectives and bytes held,
    gathered), appended to ``metrics.jsonl`` by rank 0. Every rank calls it after every
    step (the gathering is a collective)."""

    def __init__(
        self, *, config, world, rank, model, optimizer, counter, scaler, path, state, blocked
    ):
        self.config, self.world, self.model, self.optimizer = config, world, model, optimizer
        self.counter, self.scaler, self.blocked = counter, scaler, blocked
        start = state["step"] if state is not None else 0
        self.log = MetricsLog(path, rank == 0, start)
        elapsed = float(state.get("elapsed", 0.0)) if state is not None else 0.0
        self.last = {"step": start, "time": elapsed, "bytes": 0}

    def __call__(self, done: int, history: History) -> None:
        if not history.train or history.train[-1]["step"] != done:
            return
        logged = history.train[-1]
        memory = model_states(self.model, self.optimizer)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            memory["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
        sent = self.counter.bytes
        per_rank = _gather(self.world, (sent, sent - self.last["bytes"], memory))
        steps = done - self.last["step"]
        seconds = logged["time"] - self.last["time"]
        record = {
            "step": done,
            "loss": logged["loss"],
            "lr": logged["lr"],
            "time_s": logged["time"],
            "step_time_s": seconds / steps,
            "examples_per_s": logged["examples"] / max(seconds, 1e-9),
            "world_size": self.world,
            "parallel": self.config.parallel,
            "bytes_sent": [b for b, _, _ in per_rank],
            "bytes_per_step": [w / steps for _, w, _ in per_rank],
            "memory": [m for _, _, m in per_rank],
        }
        if self.scaler is not None:
            record["loss_scale"] = self.scaler.get_scale()
        if done in self.blocked:
            record["checkpoint_s"] = self.blocked[done]
        self.log.write(record)
        self.last = {"step": done, "time": logged["time"], "bytes": sent}


def _run(config: Config, rank: int, world: int, where: Placement, why: str) -> list[dict]:
    """Set up one rank's run of ``config`` and run it with :func:`lsdl_lab.train.fit`."""
    device = where.device
    micro, accumulation = _micro_batch(config, world)
    if config.kill_at_step >= 0 and config.kill_rank >= world:
        raise ValueError(
            f"Invalid kill_rank: {config.kill_rank} (expected an int in [0, {world - 1}])"
        )
    out = Path(config.out_dir)
    path = out / (CHECKPOINT if config.checkpoint_format == "file" else SHARDED)
    _say(
        rank,
        f"lsdl_lab.run: world size {world}, {config.parallel}, device {device} "
        f"({dist.get_backend() if dist.is_initialized() else 'no process group'}: "
        f"{where.reason}), "
        f"{accumulation} micro-batch(es) of {micro} per rank and step\n{config.describe()}",
    )
    if why:
        _say(rank, f"precision auto: {why}")
    built = build(config, device)
    model = built.model
    if config.activation_checkpoint:
        blocks = getattr(model, built.blocks)
        setattr(
            model,
            built.blocks,
            Checkpointed(blocks, config.activation_checkpoint, config.checkpoint_impl),
        )
    state = _load(config, out, model)
    if state is not None and "model" in state:
        model.load_state_dict(state["model"])  # before parallelize shards the model
    model = parallelize(model, config, world, built.blocks)
    optimizer = build_optimizer(model, config)  # once, after the model is wrapped
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, make_schedule(config))
    scaler = None
    if config.precision == "fp16":
        sharded = config.parallel != "ddp"  # each rank sees a shard: skip together
        scaler = LossScaler(process_group=dist.group.WORLD if sharded else None)
    batches = _RankBatches(built.batches, config, rank, world, out)
    counter = CollectiveBytes()
    step = DataParallelStep(
        accumulation,
        precision=config.precision,
        scaler=scaler,
        around=counter.counting,
        faults=batches.poisoned,
    )
    checkpoint = RunCheckpoint(
        path=path,
        state=state,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        step=step,
        config=config,
        world=world,
    )
    start = state["step"] if state is not None else 0
    if state is not None:
        _say(
            rank,
            f"resumed from {state.get('directory', path)} at step {start} (written at world "
            f"size "
            f"{state['world_size']} with {state['parallel']})",
        )
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / CONFIG).write_text(config.to_yaml())
    records = _Records(
        config=config,
        world=world,
        rank=rank,
        model=model,
        optimizer=optimizer,
        counter=counter,
        scaler=scaler,
        path=out / METRICS,
        state=state,
        blocked=checkpoint.blocked,
    )
    fit(
        model,
        optimizer,
        batches,
        config.steps,
        step=step,
        task=built.task,
        scheduler=scheduler,
        device=device,
        log_every=config.log_every,
        checkpoint=checkpoint,
        checkpoint_every=config.checkpoint_every or None,
        resume=config.resume,
        progress=rank == 0 and config.progress,
        callback=records,
        desc=f"lsdl_lab.run ({config.parallel}, world {world})",
        grad_norm=False,
    )
    checkpoint.finish()
    steps = capped_steps(config.steps)
    if start >= steps:
        _say(rank, f"the checkpoint {path} is already at step {start} of {steps}")
    return read_metrics(out / METRICS) if rank == 0 else []
