"""ZeRO's three stages on a real process group (Rajbhandari et al. 2020).

Data parallelism keeps on each of N ranks a whole copy of the model states: parameters,
gradients and optimizer state. ZeRO-DP cuts each into N shards and keeps only one per rank,
in three cumulative stages (Rajbhandari et al. 2020, Section 5 and Figure 1):

======  ===============================  ====================================  ==========
stage   each rank holds 1/N of           communication per step                elements
======  ===============================  ====================================  ==========
1       optimizer state (P_os)           reduce-scatter grads, all-gather      2 Psi
                                         updated params
2       + gradients (P_os+g)             the same, the other grads freed       2 Psi
3       + parameters (P_os+g+p)          all-gather params before forward      3 Psi
                                         and before backward, reduce-scatter
                                         grads
======  ===============================  ====================================  ==========

Plain data parallelism all-reduces the gradients, a reduce-scatter and an all-gather of
Psi elements each: 2 Psi (Section 7.1). Stages 1 and 2 move the same volume, split
differently; stage 3 adds one all-gather, 1.5 times the volume (Section 7.2). A count here
is the size of the whole (unsharded) tensor a collective assembles or reduces, the paper's
convention; a ring sends (N - 1)/N of it from each rank.

How this implementation partitions (one *unit* per module that owns parameters, as FSDP
wraps one layer at a time): the unit's parameters are laid end to end in one flat vector,
zero-padded to a multiple of N, and rank r owns the r-th of its N equal slices (its
*shard*). Each rank so holds Psi/N elements plus at most N - 1 of padding per unit. The
wrapped optimizer (any ``torch.optim``-style class) steps only the shards, so it must be
elementwise (SGD, Adam, ...); a layer-wise one (LARS, LAMB) would see a shard, not a layer.
Each unit's gradients are reduce-scattered as soon as the backward pass has produced them
all (a hook per parameter), overlapping communication with the rest of the backward pass
as DeepSpeed and FSDP do. The design follows DeepSpeed's stage-3 partitioning and
PyTorch's FSDP (Zhao et al. 2023); ``torch.distributed.optim.ZeroRedundancyOptimizer`` is
stage 1 with whole parameters assigned to ranks instead of flat slices.

Mixed precision (Micikevicius et al. 2018), the paper's setting: a 16-bit model and
``master_dtype=torch.float32``. Parameters, gradients and every collective are 16-bit; the
optimizer steps a float32 master copy of the rank's shard and the result is rounded back
into the 16-bit shard. With Adam the rank holds 2 + 2 + K bytes per parameter, K = 12
(master weight and two moments), partitioned by stage as in
:func:`~lsdl_lab.memory.zero_bytes`. The float32 gradient of the shard (4 Psi/N bytes)
lives only from the reduce-scatter to the end of ``step``. DeepSpeed's estimators count
it: 2 Psi + 18 Psi/N at stage 2 (this count plus 4 Psi/N), and 18 Psi/N at stage 3, where
they count it instead of a 16-bit gradient shard (2 + 4 + 12 bytes per parameter).

Against FSDP2 (``fully_shard``, per-parameter DTensor shards; PyTorch's documentation of
``torch.distributed.fsdp.fully_shard``, Liang et al. 2025) with
``MixedPrecisionPolicy(param_dtype=reduce_dtype=torch.bfloat16)``, on a float32 model
whose values are the bfloat16 model's: with *one backward pass per step*, the two do the
same arithmetic (bfloat16 forward, backward and reduce-scatter; the averaged bfloat16
shard gradient cast to float32; Adam on the float32 master shard; the result rounded to
bfloat16), and the tests find their trajectories equal bit for bit. With *several
backward passes per step* (micro-batches, stages 2 and 3) they are not: here each
reduce-scattered shard gradient is added to the shard's bfloat16 gradient, whereas FSDP2
casts each to float32 before adding it to its float32 shard gradient. The gradient this
implementation steps with is then FSDP2's rounded to bfloat16 (the tests check that
equality on the first step, and that the trajectories part afterwards).

Offload (ZeRO-Offload, Ren et al. 2021): ``offload=True`` keeps the master copy of the
shard and so the whole optimizer state in CPU memory; each unit's reduce-scattered
gradient shard is copied to the CPU, the optimizer steps there, and the updated shard is
copied back to the parameters' device. Accelerator memory then holds no optimizer state,
at the price of two copies of Psi/N elements per step over the host link and an update
at CPU speed. ZeRO-Offload goes further: it keeps the 16-bit gradients in host memory too,
streamed there during the backward pass, so that the device holds only the 16-bit
weights (2 Psi bytes); here the 16-bit gradient shard stays on the device until ``step``.
(On a CPU-only machine the copies stay in memory and the step is the same computation:
the tests check the arithmetic against FSDP2's
``CPUOffloadPolicy(pin_memory=False)``; the time it costs needs an accelerator.)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from .._util import (
    all_gather_single,
    check_bool,
    check_choice,
    check_int,
    flatten,
    reduce_scatter_single,
)
from .measure import measure

__all__ = ["ZeroOptimizer"]


class Piece(NamedTuple):
    """A rank's part of one parameter (:meth:`ZeroOptimizer.pieces`): elements
    ``[start, start + param.numel())`` of the row-major flattening of a parameter of
    ``shape``, and the same elements of each tensor of its optimizer ``state`` (a number or
    0-d tensor of the state, shared by the unit, as it is)."""

    shape: torch.Size
    start: int
    param: torch.Tensor
    state: dict


class _Unit:
    """A module's own parameters as one flat vector padded to a multiple of N, and this
    rank's slice of it."""

    def __init__(self, module: nn.Module, params: list[nn.Parameter], world: int, rank: int):
        self.module, self.params = module, params
        self.shapes = [p.shape for p in params]
        self.numel = sum(p.numel() for p in params)
        self.padded = -(-self.numel // world) * world
        size = self.padded // world
        self.own = slice(rank * size, (rank + 1) * size)
        self.flat: torch.Tensor | None = None  # the whole parameters, while held
        self.shard: nn.Parameter | None = None
        self.master: nn.Parameter | None = None  # the shard's master copy, if any
        self.grad_flat: torch.Tensor | None = None  # stage 1: whole local gradients
        self.waiting = len(params)  # parameters whose gradient this backward has not made
        self.reduced = False  # stage 1: this step's gradients are reduce-scattered

    @property
    def stepped(self) -> nn.Parameter:
        """What the optimizer updates: the master copy of the shard, or the shard."""
        return self.shard if self.master is None else self.master

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The parameters' shapes cut out of a whole flat vector (views)."""
        pieces = flat.split([shape.numel() for shape in self.shapes])
        return [piece.view(shape) for piece, shape in zip(pieces, self.shapes)]

    def hold(self, flat: torch.Tensor) -> None:
        """Point the module's parameters at the whole vector ``flat``."""
        self.flat = flat
        for p, view in zip(self.params, self.views(flat[: self.numel])):
            p.data = view

    def release(self) -> None:
        """Let go of the whole parameters: each becomes an empty tensor (stage 3)."""
        self.flat = None
        for p in self.params:
            p.data = p.data.new_empty(0)


def _check_shardable(model: nn.Module) -> None:
    """Raise unless ``model`` meets :class:`ZeroOptimizer`'s limits."""
    params = list(model.parameters())
    if not params:
        raise ValueError("Invalid model: it has no parameters")
    if any(not p.requires_grad for p in params):
        raise ValueError("Invalid model: every parameter must require a gradient")
    if len({(p.dtype, p.device) for p in params}) > 1:
        raise ValueError("Invalid model: its parameters must share one dtype and device")
    owned = [p for module in model.modules() for p in module.parameters(recurse=False)]
    if len(owned) != len(params):
        raise ValueError(
            "Invalid model: a parameter belongs to two modules (tied weights); each "
            "parameter must be gathered by the one module that uses it"
        )


class ZeroOptimizer(torch.optim.Optimizer):
    """ZeRO-DP stage 1, 2 or 3 (Rajbhandari et al. 2020) around ``optimizer_class``.

    It takes the place of both DDP and the optimizer (``optimizer_kwargs`` go to
    ``optimizer_class``): do not wrap ``model`` in DDP. Each rank
    runs ``model`` on its own micro-batch, calls ``loss.backward()`` and then ``step()``;
    the gradients are averaged over the group, as DDP's. At construction the group's first
    rank's parameters are broadcast (as DDP does) and hooks are put on ``model``.

    * **Stage 1** partitions the optimizer state. Gradients accumulate in one flat buffer
      per unit (``p.grad`` are views of it), which the backward pass reduce-scatters: the
      rank's slice then holds the averaged gradient of its shard, the rest stays (whole
      gradients are held, 2 Psi bytes in 16 bits). ``step`` updates the shard in place
      (it is a view of the parameters) and all-gathers the updated shards: Psi + Psi.
    * **Stage 2** also partitions the gradients: once a unit's gradients are reduce-
      scattered, the whole gradients are freed (``p.grad = None``), only the shard's
      averaged gradient is kept. Same communication, 2 Psi.
    * **Stage 3** also partitions the parameters: between uses each parameter is an empty
      tensor and the rank holds only its shard. A unit's parameters are all-gathered just
      before its forward (forward pre-hook) and freed after it, all-gathered again just
      before its backward (backward pre-hook) and freed once its gradients are
      reduce-scattered. ``step`` updates the shards; nothing is gathered until the next
      forward: Psi + Psi + Psi = 3 Psi.

    ``master_dtype`` (``torch.float32`` for a 16-bit model): the optimizer steps a master
    copy of each shard in that dtype (see the module's docstring); ``None`` steps the
    shards themselves. ``offload=True``: that master copy, and so the optimizer state, is
    kept in CPU memory (see the module's docstring).

    The optimizer's ``param_groups`` and ``state`` are the wrapped optimizer's, over the
    shards (or their master copies), so a :class:`~lsdl_lab.memory.LossScaler` with
    ``process_group`` unscales and checks this rank's shard, and all ranks take the same
    skip decision.
    :meth:`held_bytes` measures what the rank holds; :meth:`full_parameters` assembles the
    whole model; :meth:`pieces` is this rank's part of each parameter and its state (what
    a sharded checkpoint writes, with no collective). :attr:`units` is the partition, one
    unit per module that owns parameters (in ``model.modules()`` order): its ``module``,
    ``params``, ``numel``, ``padded`` (``numel`` rounded up to a multiple of N), ``own``
    (the slice of the padded flat vector this rank holds), ``shard`` and ``master``.

    Limits, for readable code: every parameter requires a gradient and gets one in each
    backward pass; a parameter is used only inside the forward of the module that owns it
    (no weight tying across modules); stage 1 takes one backward pass per step (stages 2
    and 3 accumulate several).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        stage: int = 1,
        process_group=None,
        master_dtype: torch.dtype | None = None,
        offload: bool = False,
        **optimizer_kwargs,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"Invalid model: a {type(model).__name__} (expected an nn.Module)")
        if not (
            isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
        ):
            raise TypeError(
                f"Invalid optimizer_class: {optimizer_class!r} (expected a torch.optim.Optimizer "
                "subclass)"
            )
        self.stage = check_int("stage", stage, 1, 3)
        check_choice("master_dtype", master_dtype, (None, torch.float32, torch.float64))
        check_bool("offload", offload)
        _check_shardable(model)
        self.model, self.group = model, process_group
        self.world = dist.get_world_size(process_group)
        rank = dist.get_rank(process_group)
        self.units = []
        for module in model.modules():
            params = list(module.parameters(recurse=False))
            if params:
                self.units.append(_Unit(module, params, self.world, rank))
        first = dist.get_global_rank(process_group, 0) if process_group else 0
        with torch.no_grad():
            for unit in self.units:
                self._partition(unit, first)
                if master_dtype is not None or offload:
                    master = unit.shard.detach().to(
                        device="cpu" if offload else None, dtype=master_dtype, copy=True
                    )
                    unit.master = nn.Parameter(master)
        stepped = [unit.stepped for unit in self.units]
        self.optimizer = optimizer_class(stepped, **optimizer_kwargs)
        super().__init__(stepped, self.optimizer.defaults)
        self.param_groups, self.state = self.optimizer.param_groups, self.optimizer.state
        self._holder = nn.Module()  # model and shards, so measure() sees both
        shards = nn.ParameterList([unit.shard for unit in self.units])
        self._holder.model, self._holder.shards = model, shards

    def _partition(self, unit: _Unit, first: int) -> None:
        p0 = unit.params[0]
        flat = p0.new_zeros(unit.padded)
        flat[: unit.numel] = flatten(unit.params)
        dist.broadcast(flat, first, group=self.group)
        if self.stage < 3:
            unit.hold(flat)
            unit.shard = nn.Parameter(flat[unit.own])  # a view: updated in place
        else:
            unit.shard = nn.Parameter(flat[unit.own].clone())
            unit.release()
            unit.module.register_forward_pre_hook(lambda m, args, u=unit: self._gather(u))
            unit.module.register_forward_hook(lambda m, args, out, u=unit: u.release())
            unit.module.register_full_backward_pre_hook(lambda m, g, u=unit: self._gather(u))
        if self.stage == 1:
            unit.grad_flat = torch.zeros_like(flat)
            unit.shard.grad = unit.grad_flat[unit.own]
            for p, view in zip(unit.params, unit.views(unit.grad_flat[: unit.numel])):
                p.grad = view  # autograd accumulates into it in place
        for p in unit.params:
            p.register_post_accumulate_grad_hook(lambda p, u=unit: self._grad_ready(u))

    def _all_gathered(self, unit: _Unit) -> torch.Tensor:
        """The unit's whole flat parameters, assembled from every rank's shard."""
        flat = unit.shard.new_empty(unit.padded)
        all_gather_single(flat, unit.shard.detach(), group=self.group)
        return flat

    def _gather(self, unit: _Unit) -> None:
        if unit.flat is None:
            unit.hold(self._all_gathered(unit))

    def _grad_ready(self, unit: _Unit) -> None:
        unit.waiting -= 1
        if unit.waiting == 0:
            unit.waiting = len(unit.params)
            self._reduce_scatter(unit)

    @torch.no_grad()
    def _reduce_scatter(self, unit: _Unit) -> None:
        if self.stage == 1:
            if unit.reduced:
                raise RuntimeError("ZeroOptimizer stage 1 takes one backward pass per step")
            storage = unit.grad_flat.untyped_storage().data_ptr()
            if any(p.grad.untyped_storage().data_ptr() != storage for p in unit.params):
                raise RuntimeError(
                    "ZeroOptimizer stage 1: the gradients were reset outside its zero_grad "
                    "(model.zero_grad() drops the flat buffer they live in)"
                )
            # The averaged shard lands in the rank's own slice of the local gradients.
            reduce_scatter_single(unit.shard.grad, unit.grad_flat, group=self.group)
            unit.shard.grad.div_(self.world)
            unit.reduced = True
        else:
            local = unit.shard.new_zeros(unit.padded)
            local[: unit.numel] = flatten([p.grad for p in unit.params])
            for p in unit.params:
                p.grad = None
            if self.stage == 3:
                unit.release()
            shard = unit.shard.new_empty(unit.padded // self.world)
            reduce_scatter_single(shard, local, group=self.group)
            shard.div_(self.world)
            if unit.shard.grad is None:
                unit.shard.grad = shard
            else:
                unit.shard.grad.add_(shard)
        if unit.master is not None:
            master = unit.master
            master.grad = unit.shard.grad.to(master.device, master.dtype, copy=True)

    def step(self, closure=None):
        """Step the shards with the wrapped optimizer, then (stages 1 and 2) all-gather the
        updated shards into every rank's parameters."""
        unfinished = [u for u in self.units if u.waiting != len(u.params)]
        if unfinished:
            raise RuntimeError(
                "ZeroOptimizer.step: the backward pass left some parameters without a "
                "gradient; every parameter must get one in each backward pass"
            )
        loss = self.optimizer.step(closure)
        with torch.no_grad():
            for unit in self.units:
                unit.reduced = False
                if unit.master is not None:
                    unit.shard.copy_(unit.master)  # rounded to the parameters' dtype, device
                    unit.master.grad = None  # the paper's K counts no float32 gradient
                if self.stage < 3:
                    all_gather_single(unit.flat, unit.shard.detach(), group=self.group)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (stage 1 zeroes its flat buffers, which ``p.grad`` view)."""
        for unit in self.units:
            if unit.master is not None:
                unit.master.grad = None
            if self.stage == 1:
                unit.grad_flat.zero_()
                unit.reduced = False
            elif set_to_none:
                unit.shard.grad = None
            elif unit.shard.grad is not None:
                unit.shard.grad.zero_()

    def full_parameters(self) -> list[torch.Tensor]:
        """Copies of every parameter of the model, whole, in ``model.parameters()`` order
        (to evaluate or save the model; stage 3 all-gathers them, so every rank must call
        it)."""
        out = []
        with torch.no_grad():
            for unit in self.units:
                flat = self._all_gathered(unit) if unit.flat is None else unit.flat
                out.extend(view.clone() for view in unit.views(flat[: unit.numel]))
        return out

    def full_state_dict(self) -> dict:
        """The wrapped optimizer's state as one process's optimizer over
        ``model.parameters()`` would hold it: each unit's state cut back into its
        parameters' shapes (the shards all-gathered: a collective, every rank calls it),
        a number or 0-d tensor repeated for each parameter; one parameter group, indexed
        as ``model.parameters()``. A plain optimizer of the wrapped class loads it, and so
        does :meth:`load_full_state_dict` at any world size and stage."""
        state, index = {}, 0
        for unit in self.units:
            for key, value in self.state.get(unit.stepped, {}).items():
                for i, piece in enumerate(self._whole(unit, key, value)):
                    state.setdefault(index + i, {})[key] = piece
            index += len(unit.params)
        hyper = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        return {"state": state, "param_groups": [hyper | {"params": list(range(index))}]}

    def _whole(self, unit: _Unit, key: str, value) -> list:
        """A unit's state ``value`` for each of its parameters: a shard all-gathered and
        cut into the parameters' shapes; a number or 0-d tensor repeated."""
        if not torch.is_tensor(value) or value.ndim == 0:
            return [value] * len(unit.params)
        if value.shape != unit.stepped.shape:
            raise ValueError(
                f"{type(self.optimizer).__name__}'s state {key!r} is not shaped like its "
                "shard; ZeRO cannot gather it"
            )
        flat = value.new_empty(unit.padded)
        all_gather_single(flat, value.detach().contiguous(), group=self.group)
        return [view.clone() for view in unit.views(flat[: unit.numel])]

    def pieces(self) -> list[Piece]:
        r"""This rank's part of each parameter of the model, in ``model.parameters()``
        order, as views, with no collective (to write a sharded checkpoint,
        :func:`lsdl_lab.run.parallel.sharded_state`). Parameter :math:`i` of a unit lies at
        :math:`[o_i, o_i + n_i)` of the unit's flat vector, and rank :math:`r` owns
        :math:`[rS, (r+1)S)` of it (:math:`S` = ``padded / N``); the rank so holds the
        elements :math:`[\max(o_i, rS), \min(o_i + n_i, (r+1)S)) - o_i` of the
        parameter's flattening (none when the interval is empty), and those same elements
        of each of the optimizer's state tensors, which are shaped like the shard. Over
        the ranks these runs tile every parameter and its state exactly: the padding is
        never part of one."""
        out = []
        for unit in self.units:
            state = self.state.get(unit.stepped, {})
            for key, value in state.items():
                if torch.is_tensor(value) and value.ndim > 0 and value.shape != unit.stepped.shape:
                    raise ValueError(
                        f"{type(self.optimizer).__name__}'s state {key!r} is not shaped like "
                        "its shard; ZeRO cannot cut it into its parameters"
                    )
            own, offset = unit.own, 0
            for shape in unit.shapes:
                n = shape.numel()
                start = min(max(own.start - offset, 0), n)
                stop = min(max(own.stop - offset, 0), n)
                at = offset + start - own.start  # where the run begins in the shard
                held = slice(at, at + stop - start) if stop > start else slice(0, 0)
                cut = {
                    key: value[held] if torch.is_tensor(value) and value.ndim > 0 else value
                    for key, value in state.items()
                }
                out.append(Piece(shape, start, unit.shard.detach()[held], cut))
                offset += n
        return out

    def load_full_state_dict(self, state: dict) -> None:
        """Load a state in the layout of :meth:`full_state_dict` (one process's, indexed
        as ``model.parameters()``): this rank keeps its slice of each unit's state."""
        groups, n = state["param_groups"], sum(len(u.params) for u in self.units)
        if len(groups) != 1 or sorted(groups[0]["params"]) != list(range(n)):
            raise ValueError(
                f"Invalid state: for other parameters (expected one group of this model's "
                f"{n} parameters)"
            )
        self.param_groups[0].update({k: v for k, v in groups[0].items() if k != "params"})
        index = 0
        for unit in self.units:
            per_param = [state["state"].get(index + i, {}) for i in range(len(unit.params))]
            index += len(unit.params)
            keys = set(per_param[0])
            if any(set(s) != keys for s in per_param):
                raise ValueError("Invalid state: its keys differ between a unit's parameters")
            target = self.state[unit.stepped]
            for key in keys:
                first = per_param[0][key]
                if not torch.is_tensor(first) or first.ndim == 0:
                    target[key] = first
                    continue
                flat = torch.zeros(unit.padded, dtype=first.dtype, device=first.device)
                flat[: unit.numel] = torch.cat([s[key].reshape(-1) for s in per_param])
                target[key] = flat[unit.own].to(unit.stepped.device, copy=True)

    def held_bytes(self) -> dict[str, int]:
        """Bytes this rank holds, by :func:`~lsdl_lab.memory.measure` over the model, the
        shards and the wrapped optimizer's state (each storage once; stage 1 and 2 shards
        are views of the parameters), master copies counted as optimizer state. Keys as
        :func:`~lsdl_lab.memory.zero_bytes`."""
        out = measure(self._holder, self)
        masters = sum(
            u.master.untyped_storage().nbytes() for u in self.units if u.master is not None
        )
        out["optimizer_state"] += masters  # master weights are optimizer state (the paper's K)
        out["total"] += masters
        return out
