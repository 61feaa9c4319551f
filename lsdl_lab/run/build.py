"""What a :class:`~lsdl_lab.run.config.Config` names, built from the library's own parts:
the model (:mod:`lsdl_lab.models`), the batches (:mod:`lsdl_lab.data`), the optimizer
(:mod:`lsdl_lab.optim`) and the learning-rate schedule (:mod:`lsdl_lab.schedules`).

The batches are a function of the step (a :class:`~lsdl_lab.data.BatchSource` of
``global_batch`` examples): every rank reads the same global batch of step ``t`` and keeps
its own ``1/world`` slice, which its step cuts into micro-batches. A run on one process
and a run on N ranks therefore see the same examples at every step, and a resumed run the
same as an uninterrupted one.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from .. import optim, schedules
from ..data import ImageBatches, TextBatches, load_images, load_text
from ..models import GPT, MLP, ResNet
from ..profiles import Profile, current
from ..train import Classification, LanguageModeling, Task
from .config import Config

__all__ = ["Built", "build", "make_schedule", "optimizer_class"]

TEXT_DATASETS = ("python_source", "tiny_shakespeare")


@dataclass
class Built:
    """The model (on its device, in its dtype), the global batches and the task."""

    model: nn.Module
    batches: ImageBatches | TextBatches
    task: Task
    profile: Profile
    blocks: str  # the attribute of the model holding its sequence of blocks


def _size(value: int, default: int) -> int:
    return value if value > 0 else default


def build(config: Config, device: torch.device) -> Built:
    """The model and the global batches of ``config``; the model is initialized from
    ``config.seed`` alone, so every rank builds the same one."""
    P = current(config.profile or None)
    dtype = getattr(torch, config.dtype)
    text = config.model == "gpt"
    name = config.data or (P.text_dataset if text else P.image_dataset)
    if text != (name in TEXT_DATASETS):
        raise ValueError(
            f"Invalid data: {name!r} (expected {'a text' if text else 'an image'} data set for "
            f"model {config.model!r}: one of "
            f"{', '.join(map(repr, TEXT_DATASETS if text else ('digits', 'cifar10')))})"
        )
    torch.manual_seed(config.seed)
    if text:
        corpus = load_text(name, max_chars=P.max_text_chars)
        block = _size(config.block_size, P.block_size)
        model = GPT(
            corpus.vocab_size,
            block,
            _size(config.depth, P.gpt_layers),
            _size(config.heads, P.gpt_heads),
            _size(config.width, P.gpt_dim),
        )
        batches = TextBatches(corpus.train, block, config.global_batch, seed=config.seed)
        task, blocks = LanguageModeling(), "blocks"
    else:
        data = load_images(name).subset(config.max_examples or P.max_train_examples)
        x = data.train_x.to(dtype)
        if config.model == "mlp":
            hidden, depth = _size(config.width, P.mlp_hidden), _size(config.depth, 2)
            model = MLP(x[0].numel(), data.num_classes, hidden, depth)
            blocks = "net"
        else:
            depth, width = _size(config.depth, P.resnet_depth), _size(config.width, P.resnet_width)
            model = ResNet(depth, width, data.num_classes, data.input_shape[0])
            blocks = "blocks"
        if config.global_batch > len(x):
            raise ValueError(
                f"Invalid global_batch: {config.global_batch} (expected an int in "
                f"[1, {len(x)}], the training examples of {name!r})"
            )
        batches = ImageBatches(x, data.train_y, config.global_batch, seed=config.seed)
        task = Classification()
    return Built(model.to(device=device, dtype=dtype), batches, task, P, blocks)


# Optimizers whose update of a parameter depends on the whole parameter (a norm per layer,
# factored or blocked statistics, Muon's orthogonalized matrix, SOAP's eigenbases, the
# 8-bit states' blocks of each tensor): ZeRO's flat shards would change their mathematics.
WHOLE_TENSOR = ("LARS", "LAMB", "Adafactor", "SM3", "Shampoo", "Muon", "SOAP", "Adam8bit",
                "AdamW8bit")  # fmt: skip


def optimizer_class(config: Config) -> tuple[type[torch.optim.Optimizer], dict]:
    """The optimizer class of ``config`` and its keyword arguments."""
    cls = getattr(optim, config.optimizer)
    kwargs = {"lr": config.lr, **config.optimizer_args}
    if "weight_decay" in inspect.signature(cls).parameters:
        kwargs["weight_decay"] = config.weight_decay
    elif config.weight_decay:
        raise ValueError(
            f"Invalid weight_decay: {config.weight_decay} (expected 0: {config.optimizer} "
            "has no weight decay)"
        )
    return cls, kwargs


def make_schedule(config: Config):
    """``config``'s schedule as a factor of the step: linear warmup, then the decay over
    the remaining steps (:func:`lsdl_lab.schedules.warmup_then`)."""
    if config.warmup_steps >= config.steps:
        raise ValueError(
            f"Invalid warmup_steps: {config.warmup_steps} (expected an int in "
            f"[0, {config.steps - 1}]: the warmup must end before steps={config.steps})"
        )
    rest = config.steps - config.warmup_steps
    decay = {
        "constant": schedules.constant,
        "cosine": lambda: schedules.cosine_decay(rest),
        "linear": lambda: schedules.polynomial_decay(rest),
    }[config.schedule]()
    return schedules.warmup_then(config.warmup_steps, decay)
