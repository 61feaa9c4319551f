"""Data parallelism for the run: one :class:`Strategy` per way of sharing the work.

* :class:`Local`: one process, the model and the optimizer as they are.
* :class:`DDP`: torch's ``DistributedDataParallel`` (Li et al., 2020), optionally with a
  compressor of :mod:`lsdl_lab.compress` as its communication hook.
* :class:`Zero`: the library's :class:`~lsdl_lab.memory.ZeroOptimizer`, stage 1, 2 or 3
  (Rajbhandari et al., 2020).
* :class:`FSDP2`: torch's ``fully_shard`` (Zhao et al., 2023), one unit per block.

Each gives the loop the same handful of things: the module to run, the optimizer to step,
a context for a micro-batch whose gradients are only accumulated (:meth:`Strategy.accumulating`),
the bytes this rank handed to the collectives of the gradients and parameters
(:meth:`Strategy.bytes_sent`), and the whole state in one format for checkpoints
(:meth:`Strategy.full_state`, :meth:`Strategy.load_optimizer`): the model's state dict and
the optimizer state keyed by parameter name, as a one-process run holds it. A checkpoint
written under one strategy and world size therefore loads under any other (ZeRO's and
FSDP2's shards are cut again for the new world).
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .. import compress
from .._util import ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE, all_gather_single
from ..memory import ZeroOptimizer, measure
from .build import WHOLE_TENSOR, make_optimizer, optimizer_class
from .config import Config

__all__ = ["DDP", "FSDP2", "CollectiveBytes", "Local", "Strategy", "Zero", "make_strategy"]


# -- optimizer state keyed by parameter name ---------------------------------------------


def names_of(model: nn.Module) -> list[str]:
    """The parameters' names in ``model.parameters()`` order (a tied weight once)."""
    return [name for name, _ in model.named_parameters()]


def state_by_name(state: dict, names: list[str]) -> dict:
    """An optimizer ``state_dict`` (keyed by parameter index) keyed by parameter name."""
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
    return {"state": {names[i]: s for i, s in state["state"].items()}, "param_groups": groups}


def state_by_index(state: dict, names: list[str]) -> dict:
    """The inverse of :func:`state_by_name`."""
    index = {name: i for i, name in enumerate(names)}
    missing = [g for g in state["param_groups"] for n in g["params"] if n not in index]
    if missing or len(index) != sum(len(g["params"]) for g in state["param_groups"]):
        raise ValueError(
            "the checkpoint's optimizer state is for other parameters "
            f"(it has {sum(len(g['params']) for g in state['param_groups'])}, this model "
            f"{len(names)})"
        )
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]
    return {"state": {index[n]: s for n, s in state["state"].items()}, "param_groups": groups}


def _cpu(tree):
    if torch.is_tensor(tree):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: _cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_cpu(v) for v in tree)
    return tree


# -- counting the bytes handed to collectives ----------------------------------------------

# collective -> (position, keyword) of the tensor this rank contributes
_INPUTS = {
    "all_reduce": (0, "tensor"),
    "broadcast": (0, "tensor"),
    "all_gather": (1, "tensor"),
    # the flat forms under the name this torch gives them (the other name, where torch has
    # both, is a deprecated alias that calls this one)
    ALL_GATHER_SINGLE: (1, "input_tensor"),
    REDUCE_SCATTER_SINGLE: (1, "input"),
}


class CollectiveBytes(contextlib.AbstractContextManager):
    """Inside the block, every call of ``torch.distributed``'s collectives made through the
    module (``dist.all_reduce(...)``, as DDP's hooks, ZeroOptimizer and FSDP2 call them) adds
    the bytes of the tensor this rank contributes to :attr:`bytes`.

    The count is what is *handed* to the collective (``numel x element_size``), the
    convention of :class:`lsdl_lab.compress.HookState`; what a ring algorithm then puts on
    each link is about twice that for an all-reduce (Chapter 7's cost model).
    """

    def __init__(self):
        self.bytes = 0
        self._saved: dict = {}

    def _wrap(self, name: str, fn):
        position, keyword = _INPUTS[name]

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            tensor = args[position] if len(args) > position else kwargs[keyword]
            self.bytes += tensor.numel() * tensor.element_size()
            return fn(*args, **kwargs)

        return counted

    def __enter__(self):
        for name in _INPUTS:
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()


# -- strategies ----------------------------------------------------------------------------


class Strategy:
    """How the ranks share one step (see the module's docstring)."""

    name = "local"

    def __init__(self, model: nn.Module, config: Config, world: int, blocks: str):
        self.config, self.world = config, world
        self.names = names_of(model)
        self.inner = model  # the model itself, unwrapped
        self.model: nn.Module = model
        self.optimizer: torch.optim.Optimizer

    def accumulating(self) -> contextlib.AbstractContextManager:
        """The context of a micro-batch's backward pass that only accumulates gradients
        (no communication until the last micro-batch)."""
        return contextlib.nullcontext()

    def communicating(self) -> contextlib.AbstractContextManager:
        """The context of a step's forward, backward and update: counts bytes where the
        collectives are called from Python."""
        return contextlib.nullcontext()

    def bytes_sent(self) -> int:
        """Bytes this rank has handed to the collectives of gradients and parameters."""
        return 0

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds by category (:func:`lsdl_lab.memory.measure`)."""
        return measure(self.inner, self.optimizer)

    def full_state(self) -> tuple[dict, dict]:
        """The whole model state dict and the optimizer state keyed by parameter name, as
        CPU tensors (a collective: every rank calls it; rank 0's result is the one saved)."""
        model = {k: v.detach().to("cpu", copy=True) for k, v in self.inner.state_dict().items()}
        return model, _cpu(state_by_name(self.optimizer.state_dict(), self.names))

    def load_optimizer(self, state: dict) -> None:
        """Load an optimizer state written by :meth:`full_state` (of any strategy)."""
        self.optimizer.load_state_dict(state_by_index(state, self.names))


class Local(Strategy):
    """One process: nothing is shared."""

    def __init__(self, model, config, world, blocks):
        super().__init__(model, config, world, blocks)
        self.optimizer = make_optimizer(config, model.parameters())


def _compressor(config: Config):
    c = config
    make = {
        "signsgd": compress.SignSGD,
        "terngrad": compress.TernGrad,
        "qsgd": lambda: compress.QSGD(c.qsgd_levels),
        "topk": lambda: compress.TopK(c.compression_ratio),
        "randomk": lambda: compress.RandomK(c.compression_ratio, seed=c.seed),
        "powersgd": lambda: compress.PowerSGD(c.compression_rank, seed=c.seed),
    }[c.compression]
    if c.error_feedback and c.compression != "powersgd":
        return lambda: compress.ErrorFeedback(make())
    return make


class _CountedAllReduce:
    """The state of :func:`_counted_allreduce_hook`: the bytes handed over so far."""

    def __init__(self):
        self.bytes_sent = 0


# No annotations: DDP checks a hook's annotations against dist.GradBucket, and this
# module's postponed annotations would be strings.
def _counted_allreduce_hook(state, bucket):
    """DDP's own all-reduce of a bucket, its bytes counted."""
    state.bytes_sent += bucket.buffer().numel() * bucket.buffer().element_size()
    return default_hooks.allreduce_hook(None, bucket)


class DDP(Strategy):
    """torch's DistributedDataParallel; with ``compression``, a hook of
    :mod:`lsdl_lab.compress.hooks` in place of its all-reduce."""

    name = "ddp"

    def __init__(self, model, config, world, blocks):
        super().__init__(model, config, world, blocks)
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [model_device(model)] if model_device(model).type == "cuda" else None
        self.model = DistributedDataParallel(model, device_ids=device_ids)
        if config.compression == "none":
            self.hook_state = _CountedAllReduce()
            self.model.register_comm_hook(self.hook_state, _counted_allreduce_hook)
        else:
            self.hook_state = compress.HookState(_compressor(config))
            hook = {
                "powersgd": compress.powersgd_hook,
                "randomk": compress.allreduce_hook,
            }.get(config.compression, compress.allgather_hook)
            self.model.register_comm_hook(self.hook_state, hook)
        self.optimizer = make_optimizer(config, model.parameters())

    def accumulating(self):
        return self.model.no_sync()

    def bytes_sent(self) -> int:
        return self.hook_state.bytes_sent


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


class _Counting(Strategy):
    """A strategy whose collectives are called from Python and counted there."""

    def __init__(self, model, config, world, blocks):
        super().__init__(model, config, world, blocks)
        self.counter = CollectiveBytes()
        self._bytes = 0

    @contextlib.contextmanager
    def communicating(self):
        self.counter.bytes = 0
        with self.counter, warnings.catch_warnings():
            # ZeRO-3 gathers a unit's parameters in a backward pre-hook, which torch warns
            # about for the first layer (its input needs no gradient): expected there
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            yield
        self._bytes += self.counter.bytes

    def bytes_sent(self) -> int:
        return self._bytes


class Zero(_Counting):
    """:class:`lsdl_lab.memory.ZeroOptimizer` at ``stage`` 1, 2 or 3: it is both the data
    parallelism and the optimizer."""

    def __init__(self, model, config, world, blocks, stage: int):
        super().__init__(model, config, world, blocks)
        self.name = f"zero{stage}"
        cls, kwargs = optimizer_class(config)
        with self.communicating():  # the broadcast of rank 0's parameters
            self.optimizer = ZeroOptimizer(model, cls, stage, **kwargs)
        self._bytes = 0  # a step's traffic, not the start's
        self.zero = self.optimizer
        index = {id(p): name for name, p in model.named_parameters()}
        self.unit_names = [[index[id(p)] for p in u.params] for u in self.zero.units]

    def memory(self) -> dict[str, int]:
        return self.zero.held_bytes()

    def full_state(self) -> tuple[dict, dict]:
        params = dict(zip(self.names, self.zero.full_parameters()))
        model = {
            k: (params[k] if k in params else v).detach().to("cpu", copy=True)
            for k, v in self.inner.state_dict().items()
        }
        state, hyper = {}, self.optimizer.state_dict()["param_groups"][0]
        for unit, names in zip(self.zero.units, self.unit_names):
            for key, value in self.optimizer.state.get(unit.stepped, {}).items():
                for name, piece in zip(names, self._whole(unit, key, value)):
                    state.setdefault(name, {})[key] = piece
        groups = [{k: v for k, v in hyper.items() if k != "params"} | {"params": self.names}]
        return model, _cpu({"state": state, "param_groups": groups})

    def _whole(self, unit, key, value) -> list:
        """A unit's state ``value`` for each of its parameters: a shard all-gathered and cut
        into the parameters' shapes; a number or 0-d tensor repeated."""
        if not torch.is_tensor(value) or value.ndim == 0:
            return [value] * len(unit.params)
        if value.shape != unit.stepped.shape:
            raise ValueError(
                f"{self.config.optimizer}'s state {key!r} is not shaped like its shard; "
                "ZeRO cannot gather it"
            )
        flat = value.new_empty(unit.padded)
        all_gather_single(flat, value.detach().contiguous())
        return [view.clone() for view in unit.views(flat[: unit.numel])]

    def load_optimizer(self, state: dict) -> None:
        groups = state["param_groups"]
        if len(groups) != 1 or sorted(groups[0]["params"]) != sorted(self.names):
            raise ValueError("the checkpoint's optimizer state is for other parameters")
        for key, value in groups[0].items():
            if key != "params":
                self.optimizer.param_groups[0][key] = value
        for unit, names in zip(self.zero.units, self.unit_names):
            per_param = [state["state"].get(name, {}) for name in names]
            keys = set(per_param[0])
            if any(set(s) != keys for s in per_param):
                raise ValueError("the checkpoint's optimizer state differs between parameters")
            target = self.optimizer.state[unit.stepped]
            for key in keys:
                first = per_param[0][key]
                if not torch.is_tensor(first) or first.ndim == 0:
                    target[key] = first
                    continue
                flat = torch.zeros(unit.padded, dtype=first.dtype)
                flat[: unit.numel] = torch.cat([s[key].reshape(-1) for s in per_param])
                target[key] = flat[unit.own].to(unit.stepped.device, copy=True)


class FSDP2(_Counting):
    """torch's ``fully_shard``: each block of the model's block sequence is a unit, the
    rest (embeddings, head) the root's unit."""

    name = "fsdp2"

    def __init__(self, model, config, world, blocks):
        super().__init__(model, config, world, blocks)
        from torch.distributed.fsdp import fully_shard

        for block in getattr(model, blocks):
            if any(True for _ in block.parameters()):
                fully_shard(block)
        fully_shard(model)
        self.optimizer = make_optimizer(config, model.parameters())

    def accumulating(self):
        @contextlib.contextmanager
        def no_sync():
            self.model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.model.set_requires_gradient_sync(True)

        return no_sync()

    def memory(self) -> dict[str, int]:
        local = nn.Module()
        local.params = nn.ParameterList(
            [nn.Parameter(p.to_local(), requires_grad=False) for p in self.inner.parameters()]
        )
        out = measure(local)
        grads = [p.grad.to_local() for p in self.inner.parameters() if p.grad is not None]
        states = [
            v.to_local() if hasattr(v, "to_local") else v
            for s in self.optimizer.state.values()
            for v in s.values()
            if torch.is_tensor(v)
        ]
        out["grads"] = sum(g.numel() * g.element_size() for g in grads)
        out["optimizer_state"] = sum(t.numel() * t.element_size() for t in states)
        out["total"] = out["params"] + out["grads"] + out["optimizer_state"]
        return out

    def full_state(self) -> tuple[dict, dict]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model = get_model_state_dict(self.inner, options=options)
        optim = get_optimizer_state_dict(self.inner, self.optimizer, options=options)
        return model, _cpu(optim)

    def load_optimizer(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(self.inner, self.optimizer, state, options=options)


def check_config(config: Config, world: int) -> None:
    """Refuse combinations the strategies cannot run, naming the option."""
    p = config.parallel
    if config.compression != "none" and p != "ddp":
        raise ValueError(
            f"Invalid compression: {config.compression!r} with parallel={p!r} (expected "
            "'none': compression is a DDP communication hook; use parallel='ddp')"
        )
    if p != "ddp" and config.optimizer in WHOLE_TENSOR:
        raise ValueError(
            f"Invalid optimizer: {config.optimizer!r} with parallel={p!r} (expected one whose "
            f"update is elementwise, not one of {', '.join(WHOLE_TENSOR)}: ZeRO and FSDP2 "
            "step shards, and these need each whole tensor for a norm or a factorization; "
            "use parallel='ddp')"
        )
    if p.startswith("zero") and config.model == "gpt":
        raise ValueError(
            f"Invalid parallel: {p!r} with model 'gpt' (expected 'ddp' or 'fsdp2': the GPT "
            "ties its output layer to its token embedding, and ZeroOptimizer gathers each "
            "parameter for the one module that owns it)"
        )
    if p == "fsdp2" and config.precision == "fp16":
        raise ValueError(
            "Invalid precision: 'fp16' with parallel='fsdp2' (expected 'bf16' or 'none': "
            "lsdl_lab's loss scaler checks plain tensors, and FSDP2's gradients are DTensors; "
            "bf16 needs no loss scaling)"
        )
    if (
        p in ("zero3", "fsdp2")
        and config.activation_checkpoint
        and config.checkpoint_impl == "lsdl"
    ):
        raise ValueError(
            f"Invalid checkpoint_impl: 'lsdl' with parallel={p!r} (expected 'torch': "
            "Recompute takes the parameters as inputs of its forward, and ZeRO-3 and FSDP2 "
            "free and re-gather them between uses; with FSDP2 the gradients came out wrong)"
        )


def make_strategy(model: nn.Module, config: Config, world: int, blocks: str) -> Strategy:
    """The strategy of ``config.parallel`` for a world of ``world`` ranks (one process
    with DDP is :class:`Local`)."""
    check_config(config, world)
    p = config.parallel
    if p.startswith("zero"):
        return Zero(model, config, world, blocks, int(p[-1]))
    if p == "fsdp2":
        return FSDP2(model, config, world, blocks)
    if world == 1 and config.compression == "none":
        return Local(model, config, world, blocks)
    return DDP(model, config, world, blocks)
