"""Data parallelism for the run, as torchtitan's ``parallelize_*`` do it: the model is
wrapped first, and only the model; the optimizer is built once, after it.

* :func:`parallelize` wraps the model for ``config.parallel``: DDP
  (``DistributedDataParallel``, Li et al., 2020), with a compressor of
  :mod:`lsdl_lab.compress` as its communication hook or with torch's own all-reduce hook;
  FSDP2 (``fully_shard`` of each block, then of the root); the model as it is for ZeRO and
  for one process.
* :func:`build_optimizer` builds ``config``'s optimizer over the wrapped model's
  parameters; for ``zero1`` to ``zero3`` the library's
  :class:`~lsdl_lab.memory.ZeroOptimizer` wraps it (Rajbhandari et al., 2020). ZeRO-3 is
  the one mode whose model changes after :func:`parallelize`: the ZeroOptimizer, which
  owns the shards it steps, installs the hooks that gather and free each unit's
  parameters (FSDP2 is the same stage 3 done on the model's side).
* :func:`model_states` (bytes held by category), :func:`full_state` and
  :func:`load_full_optimizer_state`: the whole model state dict and the optimizer state
  keyed by parameter *name*, as one process holds them, whatever the mode. A checkpoint
  written under one mode and world size therefore loads under any other (ZeRO's and
  FSDP2's shards are cut again for the new world).
* :func:`sharded_state`, :func:`load_sharded_state` and :func:`whole_state`: the same
  state as a flat dict of named tensors for a sharded checkpoint
  (:func:`lsdl_lab.checkpoint.save_sharded`, PyTorch's DCP): DDP's and FSDP2's from
  ``get_state_dict`` (FSDP2's as DTensors, each rank its shards, which DCP reshards on
  load), ZeRO's as each rank's own elements of each parameter and its state
  (:meth:`~lsdl_lab.memory.ZeroOptimizer.pieces`, no collective: ZeRO no longer gathers
  the whole state to save), which :class:`lsdl_lab.checkpoint.PieceSavePlanner` writes as
  DCP chunks of the whole tensors. The names are the same in every mode, so any mode
  resumes any other's (ZeRO reads the whole state on resume, :func:`whole_state`).
* :class:`~lsdl_lab.distributed.CollectiveBytes` (from :mod:`lsdl_lab.distributed.traffic`,
  the one byte counter of the book) counts what a rank hands to collectives in every mode:
  DDP's all-reduces and compression hooks, ZeRO's and FSDP2's gathers and reduce-scatters
  all call ``torch.distributed``'s functions from Python (DDP through torch's all-reduce
  hook, registered by :func:`parallelize`, not its C++ reducer).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .. import compress, optim
from ..memory import ZeroOptimizer, measure
from .build import WHOLE_TENSOR, optimizer_class
from .config import Config

__all__ = [
    "build_optimizer",
    "check_config",
    "full_state",
    "load_full_optimizer_state",
    "load_sharded_state",
    "sharded_state",
    "whole_state",
    "model_states",
    "parallelize",
]


# -- the model ------------------------------------------------------------------------------


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


def parallelize(model: nn.Module, config: Config, world: int, blocks: str) -> nn.Module:
    """``model`` wrapped for ``config.parallel`` in a world of ``world`` ranks (see the
    module's docstring); ``blocks`` names the model's sequence of blocks (FSDP2's units)."""
    check_config(config, world)
    p = config.parallel
    if p == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in getattr(model, blocks):
            if any(True for _ in block.parameters()):
                fully_shard(block)
        fully_shard(model)
        return model
    if p != "ddp" or (world == 1 and config.compression == "none"):
        return model
    from torch.nn.parallel import DistributedDataParallel

    device = next(model.parameters()).device
    ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    if config.compression == "none":
        # torch's own all-reduce of each bucket, called from Python, where the byte
        # counter sees it (DDP's built-in reducer calls the backend from C++)
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    else:
        hook = {"powersgd": compress.powersgd_hook, "randomk": compress.allreduce_hook}.get(
            config.compression, compress.allgather_hook
        )
        ddp.register_comm_hook(compress.HookState(_compressor(config)), hook)
    return ddp


def unwrapped(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (FSDP2 shards the model in place: itself)."""
    return model.module if hasattr(model, "no_sync") and hasattr(model, "module") else model


# -- the optimizer ----------------------------------------------------------------------


def build_optimizer(model: nn.Module, config: Config) -> torch.optim.Optimizer:
    """``config``'s optimizer over ``model``'s parameters, once; for ZeRO stages wrapped
    by :class:`~lsdl_lab.memory.ZeroOptimizer` (which broadcasts rank 0's parameters)."""
    cls, kwargs = optimizer_class(config)
    if config.parallel.startswith("zero"):
        return ZeroOptimizer(unwrapped(model), cls, int(config.parallel[-1]), **kwargs)
    if cls is optim.Muon:  # the hidden matrices to Muon, the rest to its AdamW groups
        return cls(optim.muon_param_groups(unwrapped(model)), **kwargs)
    return cls(model.parameters(), **kwargs)


# -- what a rank holds, and the whole state ---------------------------------------------


def _is_fsdp(model: nn.Module) -> bool:
    return hasattr(model, "set_requires_gradient_sync")


def model_states(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds by category (:func:`lsdl_lab.memory.measure`): ZeRO's own
    count of its shards, FSDP2's local shards, else the model and the optimizer."""
    if isinstance(optimizer, ZeroOptimizer):
        return optimizer.held_bytes()
    if not _is_fsdp(model):
        return measure(unwrapped(model), optimizer)
    local = nn.Module()
    local.params = nn.ParameterList(
        [nn.Parameter(p.to_local(), requires_grad=False) for p in model.parameters()]
    )
    out = measure(local)
    grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
    states = [
        v.to_local() if hasattr(v, "to_local") else v
        for s in optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    ]
    out["grads"] = sum(g.numel() * g.element_size() for g in grads)
    out["optimizer_state"] = sum(t.numel() * t.element_size() for t in states)
    out["total"] = out["params"] + out["grads"] + out["optimizer_state"]
    return out


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


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The whole model state dict and the optimizer state keyed by parameter name, as CPU
    tensors (a collective under ZeRO and FSDP2: every rank calls it, rank 0's result is
    the one saved)."""
    inner = unwrapped(model)
    names = names_of(inner)
    if _is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return (
            get_model_state_dict(model, options=options),
            _cpu(get_optimizer_state_dict(model, optimizer, options=options)),
        )
    tensors = inner.state_dict()
    if isinstance(optimizer, ZeroOptimizer):
        tensors.update(zip(names, optimizer.full_parameters()))
        opt_state = optimizer.full_state_dict()
    else:
        opt_state = optimizer.state_dict()
    return _cpu(tensors), _cpu(state_by_name(opt_state, names))


def load_full_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict
) -> None:
    """Load an optimizer state written by :func:`full_state` (under any mode)."""
    if _is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(model, optimizer, state, options=options)
        return
    by_index = state_by_index(state, names_of(unwrapped(model)))
    if isinstance(optimizer, ZeroOptimizer):
        optimizer.load_full_state_dict(by_index)
    else:
        optimizer.load_state_dict(by_index)


# -- the same state, flat, for a sharded checkpoint -----------------------------------------


def _flat(tree: dict, prefix: str) -> dict:
    """A nested dict as one level of dotted names (the names DCP gives nested dicts)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _flat_optimizer(state: dict) -> dict:
    """An optimizer state keyed by parameter name (:func:`state_by_name`) flattened as
    ``torch.distributed.checkpoint.state_dict`` flattens one: ``state.<name>.<key>`` and
    ``param_groups.<name>.<hyperparameter>``."""
    out = {f"state.{n}.{k}": v for n, s in state["state"].items() for k, v in s.items()}
    for group in state["param_groups"]:
        hyper = {k: v for k, v in group.items() if k != "params"}
        out.update({f"param_groups.{n}.{k}": v for n in group["params"] for k, v in hyper.items()})
    return out


def _is_run(value) -> bool:
    """Whether a value of the state is a tensor of one dimension or more (DCP writes it)."""
    return torch.is_tensor(value) and value.ndim > 0


def _split(flat: dict) -> tuple[dict, dict]:
    """(the tensors that are not 0-d, the rest): what DCP writes, what ``state.pt`` holds."""
    tensors = {k: v for k, v in flat.items() if _is_run(v)}
    return tensors, {k: v for k, v in flat.items() if k not in tensors}


def _dsd_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict, dict]:
    """(this rank's tensors, the numbers and 0-d tensors as copies, the runs) of the model
    and optimizer, by the names ``model.<parameter>``, ``optimizer.state.<parameter>.<key>``
    and ``optimizer.param_groups.<parameter>.<key>``, for
    :func:`lsdl_lab.checkpoint.save_sharded` (PyTorch's DCP, 2024). DDP and FSDP2: from
    ``get_state_dict`` (FSDP2's as DTensors, a fresh optimizer's state made by a step of
    zero gradients at learning rate 0), no runs. ZeRO: with no collective, rank
    :math:`r`'s tensor of each parameter and of each of its state tensors is its own
    run of elements :math:`[a_r, b_r)` of the row-major flattening
    (:meth:`~lsdl_lab.memory.ZeroOptimizer.pieces`), and the runs map its name to
    ``(shape, a_r)``; every element is written once, by the rank that steps it, and the
    checkpoint loads under any mode and world size unchanged."""
    runs = {}
    if isinstance(optimizer, ZeroOptimizer):
        model_state, optimizer_state, runs = _zero_runs(model, optimizer)
    else:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(model, optimizer, options=_dsd_options())
    tensors, others = _split(_flat({"model": model_state, "optimizer": optimizer_state}, ""))
    # copies: an asynchronous save writes these after training has stepped on (Adam's step)
    return tensors, _cpu(others), runs


def _zero_runs(model: nn.Module, optimizer: ZeroOptimizer) -> tuple[dict, dict, dict]:
    """ZeRO's model state dict, its flat optimizer state (:func:`_flat_optimizer`) and the
    runs of :func:`sharded_state`: each parameter and state tensor this rank's elements
    (an empty parameter whole, as DDP writes it; the buffers whole, each written once)."""
    inner = unwrapped(model)
    names = names_of(inner)
    pieces = optimizer.pieces()
    if any(len(piece.shape) == 0 for piece in pieces):
        # a 0-d parameter and its state go to state.pt, which rank 0 alone writes, and
        # rank 0 may not hold them: the whole state is gathered (a collective), as before
        model_state, optimizer_state = full_state(model, optimizer)
        return model_state, _flat_optimizer(optimizer_state), {}
    parameters = set(names)
    model_state = {k: v for k, v in inner.state_dict().items() if k not in parameters}
    state, runs = {}, {}
    for name, piece in zip(names, pieces, strict=True):
        whole = piece.shape.numel() == 0
        model_state[name] = piece.param.view(piece.shape) if whole else piece.param
        state[name] = {
            key: value.view(piece.shape) if whole and _is_run(value) else value
            for key, value in piece.state.items()
        }
        if not whole:
            runs[f"model.{name}"] = (piece.shape, piece.start)
            for key, value in piece.state.items():
                if _is_run(value):
                    runs[f"optimizer.state.{name}.{key}"] = (piece.shape, piece.start)
    hyper = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    optimizer_state = {"state": state, "param_groups": [hyper | {"params": names}]}
    return model_state, _flat_optimizer(optimizer_state), runs


def load_sharded_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, tensors: dict, others: dict
) -> None:
    """Load what :func:`lsdl_lab.checkpoint.load_sharded` read into the template of
    :func:`sharded_state` (``tensors``) and the numbers of ``state.pt`` (``others``) into
    a DDP or FSDP2 model and its optimizer (``set_state_dict``, PyTorch, 2024)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    flat = {**tensors, **others}
    model_state = {k[6:]: v for k, v in flat.items() if k.startswith("model.")}
    optimizer_state = {k[10:]: v for k, v in flat.items() if k.startswith("optimizer.")}
    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=optimizer_state,
        options=_dsd_options(),
    )


def whole_state(flat: dict, names: list[str]) -> tuple[dict, dict]:
    """The model's state dict and the optimizer state keyed by parameter name
    (:func:`full_state`'s pair, what ZeRO resumes from) out of a flat sharded state read
    whole; the parameters ``names`` (in the model's order) with equal hyperparameters
    side by side form one group."""
    model_state = {k[6:]: v for k, v in flat.items() if k.startswith("model.")}
    state, hyper = {}, {}
    for key, value in flat.items():
        kind, _, rest = key.partition(".")
        if kind != "optimizer":
            continue
        section, _, rest = rest.partition(".")
        name, _, field = rest.rpartition(".")
        (state if section == "state" else hyper).setdefault(name, {})[field] = value
    groups = []
    for name in names:
        if name not in hyper:
            continue
        if groups and groups[-1][0] == hyper[name]:
            groups[-1][1].append(name)
        else:
            groups.append((hyper[name], [name]))
    param_groups = [{**h, "params": params} for h, params in groups]
    return model_state, {"state": state, "param_groups": param_groups}


# -- what the modes cannot do --------------------------------------------------------------


def check_config(config: Config, world: int) -> None:
    """Refuse combinations the modes cannot run, naming the option."""
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
