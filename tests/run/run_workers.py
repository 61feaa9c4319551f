"""Runs shared by the tests of lsdl_lab.run: the configurations, and the worker that runs
them in one spawned world of 2 (gloo, float64), so many runs cost one world."""

from pathlib import Path

from lsdl_lab.run import Config, train
from lsdl_lab.train import NonFiniteLossError

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

# name -> the world-2 run (out_dir is set per test session)
WORLD2 = {
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
    # Adam: top-k with error feedback still learns (SGD at this size barely moves in 30)
    "topk": dict(CONSTANT, parallel="ddp", compression="topk", compression_ratio=0.1, steps=30),
    "zero2_3_steps": dict(CONSTANT, parallel="zero2", steps=3),
    "zero2_5_steps": dict(CONSTANT, parallel="zero2", steps=5),
    # the uninterrupted twin of tests/run/test_launch.py's killed and restarted run
    "ddp_restart_reference": dict(CONSTANT, parallel="ddp", steps=5),
    "nan": dict(BASE, parallel="zero3", nan_at_step=2, nan_rank=1),
}


def make(base: dict, **changes) -> Config:
    """A Config of ``base`` with ``changes``."""
    return Config(**{**base, **changes})


def config(name: str, root) -> Config:
    return Config(**WORLD2[name], out_dir=str(Path(root) / name))


def run_all(rank: int, world_size: int, root: str) -> dict:
    """Every WORLD2 run in turn; returns rank 0's records per run, and for the NaN run each
    rank's error message."""
    out = {}
    for name in WORLD2:
        try:
            out[name] = train(config(name, root))
        except NonFiniteLossError as e:
            out[name] = f"rank {rank}: {e}"
    return out
