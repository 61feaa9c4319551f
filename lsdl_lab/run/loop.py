"""The run itself: :func:`train` does one whole run of a :class:`Config` on this process.

Under ``torchrun`` (the environment names ``RANK`` and ``WORLD_SIZE``) the process joins
the launcher's world with :func:`lsdl_lab.distributed.init_from_env` (each round of restarted
workers under its own keys of torchrun's store), every collective bounded by
``config.timeout``; alone, it runs as a world of one (with a process group of one
only where ZeRO, FSDP2 or a compression hook need one). The device and backend are
:func:`lsdl_lab.distributed.placement`'s for ``config.device``: with ``auto``, ``cuda:LOCAL_RANK``
and NCCL where the machine has a GPU for each of its ranks, else the CPU and gloo (a
world of 2 on a one-GPU machine runs on the CPU); the run's first line says which.

A step: every rank reads the global batch of step ``t``, keeps its slice, runs its
micro-batches (forward under autocast when ``precision`` says so, the loss divided by the
number of micro-batches, backward; only the last micro-batch's backward communicates),
then one all-reduce of (loss, non-finite flag) tells every rank the global loss and
whether any rank's loss was NaN or infinite: then every rank raises
:class:`~lsdl_lab.train.NonFiniteLossError` naming the step, before the update, and no
rank is left waiting in a collective. Otherwise the optimizer steps (through the loss
scaler with fp16), the schedule advances, a metrics record is written every
``log_every`` steps and a checkpoint every ``checkpoint_every`` steps and at the end.

In a dry run (:mod:`lsdl_lab.scale`; the caps reach every rank through the environment,
which ``torchrun`` and :func:`lsdl_lab.distributed.spawn` pass on) the run stops after
``LSDL_MAX_STEPS`` steps, its schedule still the config's, and each global batch holds at
most ``LSDL_MAX_EXAMPLES`` examples, cut into as many micro-batches as the config's.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from .._util import seed_from
from ..distributed.world import Placement, free_port, init_from_env, placement
from ..memory import LossScaler, checkpoint_sequential, mixed_precision_for
from ..scale import capped_steps
from ..train import NonFiniteLossError
from . import checkpoint
from .build import build, make_schedule, rank_slice
from .config import Config
from .metrics import MetricsLog, read_metrics
from .parallel import make_strategy

__all__ = ["Checkpointed", "train"]

CHECKPOINT, METRICS, CONFIG = "checkpoint.pt", "metrics.jsonl", "config.yaml"


class Checkpointed(nn.Sequential):
    """A sequence of blocks run with activation checkpointing in segments of ``every``
    blocks (:func:`lsdl_lab.memory.checkpoint_sequential`); its parameters keep the names
    they had in the plain ``nn.Sequential``."""

    def __init__(self, blocks: nn.Sequential, every: int, implementation: str):
        super().__init__(*blocks)
        self.every, self.implementation = every, implementation

    def forward(self, x):
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
        return _run(config, rank, world, where, why)
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


def _run(config: Config, rank: int, world: int, where: Placement, why: str) -> list[dict]:
    device = where.device
    micro, accumulation = _micro_batch(config, world)
    steps = capped_steps(config.steps)  # the identity, except in a dry run (lsdl_lab.scale)
    if config.kill_at_step >= 0 and config.kill_rank >= world:
        raise ValueError(
            f"Invalid kill_rank: {config.kill_rank} (expected an int in [0, {world - 1}])"
        )
    out = Path(config.out_dir)
    path = out / CHECKPOINT
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
    state = checkpoint.load(path) if config.resume and path.exists() else None
    if state is not None:
        model.load_state_dict(state["model"])
    strategy = make_strategy(model, config, world, built.blocks)
    optimizer = strategy.optimizer
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, make_schedule(config))
    sharded = config.parallel != "ddp"
    scaler = None
    if config.precision == "fp16":
        scaler = LossScaler(process_group=dist.group.WORLD if sharded else None)
    start = 0
    if state is not None:
        strategy.load_optimizer(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        start = state["step"]
        _say(
            rank,
            f"resumed from {path} at step {start} (written at world size "
            f"{state['world_size']} with {state['parallel']})",
        )
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / CONFIG).write_text(config.to_yaml())
    log = MetricsLog(out / METRICS, rank == 0, start)
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.precision)
    bar = tqdm(
        range(start, steps),
        initial=start,
        total=steps,
        disable=rank != 0 or not config.progress,
        desc=f"lsdl_lab.run ({config.parallel}, world {world})",
    )
    window = {"loss": 0.0, "examples": 0, "time": 0.0, "steps": 0, "bytes": 0}
    elapsed = float(state.get("elapsed", 0.0)) if state is not None else 0.0
    for t in bar:
        _inject_kill(config, rank, t, out)
        torch.manual_seed(seed_from("run", config.seed, t, rank))  # dropout of step t
        lr = optimizer.param_groups[0]["lr"]
        batch = built.batches(t)
        # micro, except for a dry run's capped batch: as many micro-batches, smaller
        rows = max(1, min(micro, len(batch[1]) // world // accumulation))
        pairs = rank_slice(batch, rank, world, rows)
        bytes_before = strategy.bytes_sent()
        t0 = time.perf_counter()
        strategy.model.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        examples = 0
        with strategy.communicating():
            for i, (x, y) in enumerate(pairs):
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                last = i == len(pairs) - 1
                with contextlib.nullcontext() if last else strategy.accumulating():
                    with torch.autocast(
                        device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None
                    ):
                        loss = built.task.loss(strategy.model(x), y)
                    # a 16-bit loss (autocast) is summed and scaled in float32
                    loss = loss.float() if loss.element_size() < 4 else loss
                    loss = loss / accumulation
                    if t == config.nan_at_step and rank == config.nan_rank:
                        loss = loss * float("nan")
                    (loss if scaler is None else scaler.scale(loss)).backward()
                loss_sum += loss.detach().double()
                examples += built.task.examples(y)
        # one all-reduce: the global loss, and whether any rank's loss was not finite
        flags = torch.stack([loss_sum, (~torch.isfinite(loss_sum)).double()])
        if world > 1:
            dist.all_reduce(flags)
        global_loss = flags[0].item() / world
        if flags[1].item() > 0:
            raise NonFiniteLossError(global_loss, float(lr), t)
        done = t + 1
        logging = done % config.log_every == 0 or done == steps
        with strategy.communicating():
            stepped = True
            if scaler is None:
                optimizer.step()
            else:
                scaler.step(optimizer)
                scaler.update()
                stepped = not scaler.skipped
            # measured with the gradients still held: the step's peak of model states
            memory = strategy.memory() if logging else None
            optimizer.zero_grad(set_to_none=True)
        if stepped:
            scheduler.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        elapsed += seconds
        window["loss"] += global_loss
        window["examples"] += examples * world
        window["time"] += seconds
        window["steps"] += 1
        window["bytes"] += strategy.bytes_sent() - bytes_before
        if logging:
            record = _record(config, strategy, world, memory, window, done, lr, elapsed, scaler)
            log.write(record)
            bar.set_postfix(loss=f"{record['loss']:.4f}")
            window = dict.fromkeys(window, 0)
            window["loss"] = 0.0
        if (config.checkpoint_every and done % config.checkpoint_every == 0) or done == steps:
            _save(path, strategy, scheduler, scaler, config, world, rank, done, elapsed)
    bar.close()
    if start >= steps:
        _say(rank, f"the checkpoint {path} is already at step {start} of {steps}")
    return read_metrics(out / METRICS) if rank == 0 else []


def _record(config, strategy, world, memory, window, done, lr, elapsed, scaler) -> dict:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        memory["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
    per_rank = _gather(world, (strategy.bytes_sent(), window["bytes"], memory))
    steps = window["steps"]
    record = {
        "step": done,
        "loss": window["loss"] / steps,
        "lr": float(lr),
        "time_s": elapsed,
        "step_time_s": window["time"] / steps,
        "examples_per_s": window["examples"] / max(window["time"], 1e-9),
        "world_size": world,
        "parallel": config.parallel,
        "bytes_sent": [b for b, _, _ in per_rank],
        "bytes_per_step": [w / steps for _, w, _ in per_rank],
        "memory": [m for _, _, m in per_rank],
    }
    if scaler is not None:
        record["loss_scale"] = scaler.get_scale()
    return record


def _save(path, strategy, scheduler, scaler, config, world, rank, done, elapsed) -> None:
    model_state, optimizer_state = strategy.full_state()  # collective
    if rank == 0:
        checkpoint.save(
            path,
            step=done,
            elapsed=elapsed,
            model=model_state,
            optimizer=optimizer_state,
            scheduler=scheduler.state_dict(),
            scaler=scaler.state_dict() if scaler is not None else {},
            world_size=world,
            parallel=config.parallel,
            config=config.to_dict(),
        )
    if world > 1:
        dist.barrier()  # nobody runs ahead of (and so past) a checkpoint being written
