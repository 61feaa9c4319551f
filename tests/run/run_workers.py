"""Runs shared by the tests of lsdl_lab.run: the configurations, grouped as the tests that
read them (the world-2 runs that must follow one process, the compressed run, the run that
stops on a NaN, the runs a resumed one is compared with), and the worker that trains a
group in one spawned world of 2 (gloo, float64): a world per group, so a failure names its
case, and a few runs per world, so the worlds stay few."""

from pathlib import Path

from lsdl_lab.distributed import spawn
from lsdl_lab.run import Config, train
from lsdl_lab.train import NonFiniteLossError

# float64 sums of two ranks' halves against one process's whole batch differ in the last
# bits; after a few Adam steps that is ~1e-16 (measured 5.6e-17 on the weights).
TOL = 1e-12

# A small MLP on 512 digits, float64, so the runs can be compared to ~1e-15.
BASE = dict(
    model="mlp",
    profile="smoke",
    width=16,
    dtype="float64",
    optimizer="AdamW",
    lr=0.01,
    weight_decay=0.01,
    warmup_steps=1,
    steps=4,
    global_batch=32,
    progress=False,
    timeout=60.0,
)
# Constant rate: the schedule does not depend on `steps`, so a run of 3 steps resumed
# for 5 computes what one run of 5 computes.
CONSTANT = dict(BASE, schedule="constant", warmup_steps=0)

# name -> a world-2 run that must follow the one-process run of BASE (tests/run/test_loop.py)
EQUIVALENT = {
    "ddp": dict(BASE, parallel="ddp"),
    "ddp_accumulate": dict(BASE, parallel="ddp", micro_batch=4),
    "zero1": dict(BASE, parallel="zero1"),
    "zero2": dict(BASE, parallel="zero2"),
    "zero2_accumulate": dict(BASE, parallel="zero2", micro_batch=8),
    "zero3": dict(BASE, parallel="zero3"),
    "zero3_accumulate": dict(BASE, parallel="zero3", micro_batch=4),
    "fsdp2": dict(BASE, parallel="fsdp2"),
    "fsdp2_accumulate": dict(BASE, parallel="fsdp2", micro_batch=8),
    "fsdp2_recompute": dict(BASE, parallel="fsdp2", activation_checkpoint=2),
    "zero3_recompute": dict(BASE, parallel="zero3", activation_checkpoint=2),
    "ddp_recompute_lsdl": dict(
        BASE, parallel="ddp", activation_checkpoint=2, checkpoint_impl="lsdl"
    ),
}
# Adam: top-k with error feedback still learns (SGD at this size barely moves in 30)
COMPRESSED = {
    "topk": dict(CONSTANT, parallel="ddp", compression="topk", compression_ratio=0.1, steps=30)
}
STOPPED = {"nan": dict(BASE, parallel="zero3", nan_at_step=2, nan_rank=1)}
# a ZeRO-2 run of 3 steps to resume elsewhere, and its uninterrupted twin of 5
RESUMABLE = {
    "zero2_3_steps": dict(CONSTANT, parallel="zero2", steps=3),
    "zero2_5_steps": dict(CONSTANT, parallel="zero2", steps=5),
}
# sharded checkpoints (torch.distributed.checkpoint) written at world 2 after 3 steps, to
# resume at worlds 1 and 4 (tests/run/test_checkpoint.py); two save in the background
# after every step
SHARDED = {
    name: dict(CONSTANT, parallel=parallel, steps=3, checkpoint_format="dcp", **extra)
    for name, parallel, extra in (
        ("ddp", "ddp", {}),
        ("fsdp2", "fsdp2", {}),
        ("zero2", "zero2", {}),
        ("fsdp2_async", "fsdp2", dict(async_checkpoint=True, checkpoint_every=1)),
        ("zero3_async", "zero3", dict(async_checkpoint=True, checkpoint_every=1)),
    )
}
# tests/run/test_launch.py's killed and restarted run, and its uninterrupted twin
RESTARTED = dict(CONSTANT, parallel="ddp", steps=5)


def make(base: dict, **changes) -> Config:
    """A Config of ``base`` with ``changes``."""
    return Config(**{**base, **changes})


def train_each(rank: int, world_size: int, configs: dict[str, Config]) -> dict:
    """A worker for :func:`lsdl_lab.distributed.spawn`: every run of ``configs`` in turn;
    per run, rank 0's records (the other ranks' are empty), or, for a run that stops on a
    non-finite loss, this rank's error message."""
    del world_size
    out = {}
    for name, config in configs.items():
        try:
            out[name] = train(config)
        except NonFiniteLossError as e:
            out[name] = f"rank {rank}: {e}"
    return out


def train_in_a_world(runs: dict[str, dict], root: Path, world: int) -> list[dict]:
    """Train every run of ``runs`` (name -> Config fields) into ``root / name`` in one
    spawned world of ``world`` ranks; each rank's :func:`train_each` results, rank by
    rank."""
    configs = {name: make(fields, out_dir=str(Path(root) / name)) for name, fields in runs.items()}
    return spawn(train_each, world, configs, timeout=60 * world)


def train_in_a_world_of_two(runs: dict[str, dict], root: Path) -> list[dict]:
    """:func:`train_in_a_world` of 2."""
    return train_in_a_world(runs, root, 2)
