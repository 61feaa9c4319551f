"""The run's configuration: one small dataclass, filled from a YAML file and command-line flags.

Every option is a field of :class:`Config` with its default, its allowed values and one
line of help; the command line is generated from the fields, so ``python -m lsdl_lab.run
--help`` lists every option and a YAML file uses the same names (with underscores, the
flags with dashes)::

    python -m lsdl_lab.run --config run.yaml --steps 200 --parallel zero2

Flags override the file, the file overrides the defaults. A value outside its range is a
``ValueError`` (a wrong type a ``TypeError``) naming the option and what it allows, raised
before any process group or model is built. A size left at 0 is taken from the scale
profile (:mod:`lsdl_lab.profiles`), as the labs take theirs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from .. import optim
from .._util import check_bool, check_choice, check_int, check_real

__all__ = [
    "COMPRESSIONS",
    "MODELS",
    "OPTIMIZERS",
    "PARALLELS",
    "Config",
    "load_config",
    "parser",
]

MODELS = ("mlp", "resnet", "gpt")
DATASETS = ("", "digits", "cifar10", "python_source", "tiny_shakespeare")
# The optimizers of lsdl_lab.optim whose step() needs nothing but the gradients: not SAM
# (a closure), Newton and HessianFree (a closure), K-FAC (hooks on the model), nor
# schedule-free AdamW (its train/eval switch, which the loop does not make).
OPTIMIZERS = tuple(
    name
    for name in optim.__all__
    if isinstance(getattr(optim, name), type)
    and name not in ("Optimizer", "SAM", "Newton", "HessianFree", "KFAC", "ScheduleFreeAdamW")
)
SCHEDULES = ("constant", "cosine", "linear")
PARALLELS = ("ddp", "zero1", "zero2", "zero3", "fsdp2")
COMPRESSIONS = ("none", "signsgd", "terngrad", "qsgd", "topk", "randomk", "powersgd")
PRECISIONS = ("none", "bf16", "fp16", "auto")


def _opt(default, help: str, **check):
    """A field with its help line and its check (``choices=``, or ``low=``/``high=``)."""
    factory = {"default_factory": lambda: dict(default)} if isinstance(default, dict) else {}
    if not factory:
        factory = {"default": default}
    return field(**factory, metadata={"help": help, **check})


@dataclass
class Config:
    """Everything a run needs; see the module's docstring. Printed in full at start."""

    # what is trained
    model: str = _opt(
        "mlp",
        "the model: MLP, CIFAR ResNet or GPT (lsdl_lab.models)",
        choices=MODELS,
    )
    profile: str = _opt(
        "",
        "scale profile for sizes left at 0 ('' = $LSDL_SCALE, else by device)",
        choices=("", "smoke", "cpu", "gpu"),
    )
    data: str = _opt("", "data set ('' = the profile's, images or text by model)", choices=DATASETS)
    max_examples: int = _opt(0, "cap on the training images (0 = the profile's cap)", low=0)
    width: int = _opt(
        0,
        "MLP hidden units, ResNet first-stage channels, GPT dim (0 = profile)",
        low=0,
    )
    depth: int = _opt(0, "MLP hidden layers, ResNet depth 6n+2, GPT blocks (0 = profile)", low=0)
    heads: int = _opt(0, "GPT attention heads (0 = profile)", low=0)
    block_size: int = _opt(0, "GPT context length (0 = profile)", low=0)
    dtype: str = _opt("float32", "parameter dtype", choices=("float32", "float64"))
    seed: int = _opt(0, "seed of the initialization, the batches and dropout", low=0)
    # how it is optimized
    optimizer: str = _opt("AdamW", "optimizer of lsdl_lab.optim", choices=OPTIMIZERS)
    lr: float = _opt(1e-3, "peak learning rate", low=0.0, low_open=True)
    weight_decay: float = _opt(0.0, "weight decay", low=0.0)
    optimizer_args: dict = _opt(
        {},
        "other optimizer arguments (a YAML mapping; JSON on the command line)",
    )
    schedule: str = _opt("cosine", "decay after warmup (lsdl_lab.schedules)", choices=SCHEDULES)
    warmup_steps: int = _opt(0, "linear warmup steps (Goyal et al., 2017)", low=0)
    steps: int = _opt(100, "optimizer steps", low=1)
    global_batch: int = _opt(64, "examples per optimizer step, over all ranks", low=1)
    micro_batch: int = _opt(
        0,
        "examples per forward pass on a rank (0 = global_batch / world size); "
        "gradient accumulation over global_batch / (world size x micro_batch) passes",
        low=0,
    )
    # memory
    precision: str = _opt(
        "none",
        "autocast dtype (fp16 adds lsdl_lab's loss scaler; auto: bf16 on a GPU that computes "
        "in it, fp16 on an older GPU, none on a CPU)",
        choices=PRECISIONS,
    )
    activation_checkpoint: int = _opt(
        0,
        "checkpoint the model's blocks in segments of this many (0 = off; Chen et al., 2016)",
        low=0,
    )
    checkpoint_impl: str = _opt(
        "torch",
        "recomputation: torch.utils.checkpoint or lsdl's Recompute",
        choices=("torch", "lsdl"),
    )
    # data parallelism
    parallel: str = _opt(
        "ddp",
        "data parallelism: DDP, ZeRO stage 1-3 (lsdl_lab), FSDP2",
        choices=PARALLELS,
    )
    compression: str = _opt(
        "none",
        "gradient compression (DDP comm hook, lsdl_lab.compress)",
        choices=COMPRESSIONS,
    )
    compression_ratio: float = _opt(
        0.01,
        "fraction kept by topk and randomk",
        low=0.0,
        high=1.0,
        low_open=True,
    )
    compression_rank: int = _opt(2, "rank of PowerSGD's factors", low=1)
    qsgd_levels: int = _opt(16, "QSGD quantization levels", low=1)
    error_feedback: bool = _opt(
        True,
        "error feedback around the compressor (not PowerSGD: it has its own)",
    )
    backend: str = _opt(
        "auto",
        "process group backend (auto: nccl with a GPU per rank, else gloo)",
        choices=("auto", "gloo", "nccl"),
    )
    device: str = _opt(
        "auto",
        "device (auto: cuda:LOCAL_RANK with a GPU for each rank on this machine, else cpu)",
        choices=("auto", "cpu", "cuda"),
    )
    timeout: float = _opt(120.0, "seconds before a collective that cannot complete fails", low=1.0)
    # output
    out_dir: str = _opt(
        "runs/lsdl",
        "directory of metrics.jsonl, the checkpoint (checkpoint.pt or checkpoint.dcp/) and "
        "config.yaml",
    )
    log_every: int = _opt(1, "steps between metrics records", low=1)
    checkpoint_every: int = _opt(0, "steps between checkpoints (0 = only at the end)", low=0)
    checkpoint_format: str = _opt(
        "file",
        "file: one checkpoint.pt written by rank 0; dcp: checkpoint.dcp/, each rank writing "
        "its shards with torch.distributed.checkpoint, resharded on resume",
        choices=("file", "dcp"),
    )
    async_checkpoint: bool = _opt(
        False,
        "with checkpoint_format dcp: copy to host memory and write in the background "
        "(dcp.async_save) instead of stopping training for the write",
    )
    resume: bool = _opt(True, "continue from out_dir's checkpoint when it exists")
    progress: bool = _opt(True, "progress bar on rank 0")
    # fault injection, to watch a restart or a NaN stop (the lab and the tests use them)
    kill_at_step: int = _opt(
        -1,
        "kill rank kill_rank with SIGKILL once at this step (-1 = never)",
        low=-1,
    )
    kill_rank: int = _opt(1, "the rank that kill_at_step kills", low=0)
    nan_at_step: int = _opt(-1, "make rank nan_rank's loss NaN at this step (-1 = never)", low=-1)
    nan_rank: int = _opt(0, "the rank whose loss nan_at_step poisons", low=0)

    def __post_init__(self):
        for f in fields(self):
            setattr(self, f.name, _checked(f, getattr(self, f.name)))
        if self.async_checkpoint and self.checkpoint_format != "dcp":
            raise ValueError(
                f"Invalid async_checkpoint: True with checkpoint_format="
                f"{self.checkpoint_format!r} (expected checkpoint_format='dcp': only "
                "torch.distributed.checkpoint saves in the background)"
            )

    @classmethod
    def from_dict(cls, values: dict) -> Config:
        """A config from a mapping of option names (as in YAML) to values; an unknown name
        is an error that lists the known ones."""
        if not isinstance(values, dict):
            raise TypeError(f"Invalid config: a {type(values).__name__} (expected a mapping)")
        known = {f.name for f in fields(cls)}
        for key in values:
            if key not in known:
                raise ValueError(
                    f"Invalid option: {key!r} (expected one of {', '.join(sorted(known))})"
                )
        return cls(**values)

    @classmethod
    def from_yaml(cls, path) -> Config:
        """A config from a YAML file of ``option: value`` lines."""
        import yaml  # only needed for a file

        path = Path(path)
        with open(path) as f:
            values = yaml.safe_load(f) or {}
        try:
            return cls.from_dict(values)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{path}: {e}") from None

    def to_dict(self) -> dict:
        """Every option and its value (what a checkpoint records of its run)."""
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        """The config as YAML, in the options' order (``config.yaml`` of a run; a file
        that :meth:`from_yaml` and ``--config`` read back)."""
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def replace(self, **changes) -> Config:
        """A copy with ``changes`` (checked as any config)."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """Every option and its value, one a line (printed at the start of a run)."""
        width = max(len(f.name) for f in fields(self))
        return "\n".join(f"  {f.name:<{width}} {getattr(self, f.name)!r}" for f in fields(self))


def _checked(f: dataclasses.Field, value):
    """``value`` of option ``f`` checked against its type and range."""
    meta, name = f.metadata, f.name
    kind = type(f.default) if f.default is not dataclasses.MISSING else dict
    if kind is bool:
        return check_bool(name, value)
    if kind is int:
        return check_int(name, value, meta.get("low"), meta.get("high"))
    if kind is float:
        if isinstance(value, int) and not isinstance(value, bool):
            value = float(value)  # YAML reads 1 as an int
        low, high = meta.get("low", -math.inf), meta.get("high", math.inf)
        return check_real(name, value, low, high, low_open=meta.get("low_open", False))
    if kind is dict:
        if not isinstance(value, dict):
            raise TypeError(f"Invalid {name}: {value!r} (expected a mapping)")
        return dict(value)
    if not isinstance(value, str):
        raise TypeError(f"Invalid {name}: {value!r} (expected a string)")
    if "choices" in meta:
        check_choice(name, value, meta["choices"])
    return value


def _flag_type(f: dataclasses.Field):
    kind = type(f.default) if f.default is not dataclasses.MISSING else dict
    if kind is dict:
        return json.loads
    return kind


def parser() -> argparse.ArgumentParser:
    """The command line: ``--config FILE`` and one flag per option of :class:`Config`."""
    p = argparse.ArgumentParser(
        prog="python -m lsdl_lab.run",
        description=(
            "Train a model of lsdl_lab with data parallelism (DDP, ZeRO 1-3 or FSDP2), the "
            "same command in one process or under torchrun. Options come from --config "
            "FILE.yaml (names with underscores), then from these flags."
        ),
        argument_default=argparse.SUPPRESS,  # only flags given on the command line override
    )
    p.add_argument("--config", metavar="FILE.yaml", help="YAML file of options")
    for f in fields(Config):
        flag = "--" + f.name.replace("_", "-")
        meta = f.metadata
        text = meta["help"]
        if "choices" in meta:
            text += f" (one of {', '.join(repr(c) for c in meta['choices'])})"
        elif "low" in meta or "high" in meta:
            text += f" (range: {_range_text(meta)})"
        text += f" [default: {f.default if f.default is not dataclasses.MISSING else {}!r}]"
        if type(f.default) is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, help=text)
        else:
            p.add_argument(flag, type=_flag_type(f), metavar=f.name.upper(), help=text)
    return p


def _range_text(meta) -> str:
    low, high = meta.get("low"), meta.get("high")
    left = "(" if meta.get("low_open") else "["
    return f"{left}{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"


def load_config(argv: list[str] | None = None) -> Config:
    """The config of a command line: defaults, then ``--config``'s file, then the flags."""
    args = vars(parser().parse_args(argv))
    path = args.pop("config", None)
    values = Config.from_yaml(path).to_dict() if path is not None else {}
    values.update(args)
    return Config.from_dict(values)
