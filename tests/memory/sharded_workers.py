"""Workers for the ZeRO tests: one world runs every check (a spawned rank imports its
worker by module and name, so they live here, on ``sys.path``, not in the test file).

Every run trains the same float64 MLP for ``STEPS`` Adam steps on the same global batch of
``GLOBAL_BATCH`` rows, each rank taking its contiguous half, and records the whole
parameters after each step. The runs with accumulation cut each rank's half into
``MICRO_BATCHES`` micro-batches, one backward pass each."""

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from lsdl_lab import optim
from lsdl_lab._util import ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE, all_gather_single
from lsdl_lab.memory import LossScaler, ZeroOptimizer, measure

STEPS = 4
GLOBAL_BATCH = 8
LR = 0.05
MICRO_BATCHES = 2
# Units of 49, 40 and 18 parameters: the first pads to 50 at world 2.
SIZES = ((6, 7), (7, 5), (5, 3))


class Gained(nn.Module):
    """A module with a parameter of its own around a child that has its own: two units,
    the parent's gathered around the child's."""

    def __init__(self, layer: nn.Linear):
        super().__init__()
        self.layer = layer
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, layer.out_features))

    def forward(self, x):
        return self.layer(x) * self.gain


def make_model(nested: bool = False) -> nn.Module:
    """The MLP; ``nested``: the same sizes with a Gained first layer and a LayerNorm."""
    torch.manual_seed(0)
    layers = []
    for fan_in, fan_out in SIZES:
        layers += [nn.Linear(fan_in, fan_out), nn.Tanh()]
    if nested:
        layers[0] = Gained(layers[0])
        layers.insert(2, nn.LayerNorm(SIZES[0][1]))
    return nn.Sequential(*layers[:-1]).double()


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(GLOBAL_BATCH, SIZES[0][0], generator=g, dtype=torch.float64),
            torch.randn(GLOBAL_BATCH, SIZES[-1][1], generator=g, dtype=torch.float64),
        )
        for _ in range(STEPS)
    ]


def local(batch, rank, world_size):
    rows = GLOBAL_BATCH // world_size
    return tuple(t[rank * rows : (rank + 1) * rows] for t in batch)


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def train(model, optimizer, batches, params_of, scaler=None) -> list[torch.Tensor]:
    """``STEPS`` steps; the whole parameters (``params_of()``) after each."""
    trajectory = []
    for x, y in batches:
        optimizer.zero_grad()
        # the output in the target's dtype: FSDP2's bfloat16 output against float64 targets
        # (torch 2.9's mse_loss backward refuses mixed dtypes; newer torch promotes)
        loss = nn.functional.mse_loss(model(x).to(y.dtype), y)
        loss.backward()
        optimizer.step()
        trajectory.append(flat(params_of()))
    return trajectory


def reference(opt_class, nested=False) -> list[torch.Tensor]:
    """One process, the global batch: the oracle."""
    model = make_model(nested)
    opt = opt_class(model.parameters(), lr=LR)
    return train(model, opt, global_batches(), model.parameters)


def ddp(rank, world_size, opt_class):
    model = DistributedDataParallel(make_model())
    opt = opt_class(model.parameters(), lr=LR)
    batches = [local(b, rank, world_size) for b in global_batches()]
    trajectory = train(model, opt, batches, model.parameters)
    return trajectory, measure(model.module, opt)


def zero(rank, world_size, stage, opt_class, nested=False, **options):
    model = make_model(nested)
    opt = ZeroOptimizer(model, opt_class, stage=stage, lr=LR, **options)
    batches = [local(b, rank, world_size) for b in global_batches()]
    trajectory = train(model, opt, batches[:-1], opt.full_parameters)
    # The last step: communication counted, bytes measured before the gradients go.
    x, y = batches[-1]
    opt.zero_grad()
    with count_collectives() as counts:
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    held = opt.held_bytes()
    trajectory.append(flat(opt.full_parameters()))
    with torch.no_grad():  # no backward follows: stage 3 frees each layer after its forward
        prediction = model(x)
    return {
        "prediction": prediction,
        "released": all(p.numel() == 0 for p in model.parameters()),
        "trajectory": trajectory,
        "counts": counts,
        "held": held,
        "measure": measure(model, opt),
        "padded": sum(u.padded for u in opt.units),
        "numel": sum(p.numel() for p in make_model(nested).parameters()),
    }


def zero_redundancy(rank, world_size):
    model = DistributedDataParallel(make_model())
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
    batches = [local(b, rank, world_size) for b in global_batches()]
    return train(model, opt, batches, model.parameters)


def fsdp2_model(world_size, mp_policy=None, offload_policy=None) -> nn.Module:
    """The MLP under FSDP2, each layer sharded (with ``mp_policy``: a float32 model whose
    values are the bfloat16 model's, so both runs start from the same master weights)."""
    model = make_model() if mp_policy is None else make_model().bfloat16().float()
    mesh = init_device_mesh("cpu", (world_size,))
    policies = {
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "offload_policy": offload_policy or OffloadPolicy(),
    }
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, **policies)
    fully_shard(model, mesh=mesh, **policies)
    return model


def fsdp2(rank, world_size, mp_policy=None, offload_policy=None):
    """FSDP2's trajectory on the run of every other worker."""
    model = fsdp2_model(world_size, mp_policy, offload_policy)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    batches = [local(b, rank, world_size) for b in global_batches()]
    trajectory = train(model, opt, batches, lambda: [p.full_tensor() for p in model.parameters()])
    return trajectory


def mixed(rank, world_size, stage):
    """bfloat16 parameters, gradients and communication, float32 master weights and Adam
    moments: the paper's mixed-precision Adam, 2 + 2 + K bytes per parameter, K = 12."""
    model = make_model().bfloat16()
    opt = ZeroOptimizer(model, torch.optim.Adam, stage=stage, master_dtype=torch.float32, lr=LR)
    batches = [local(b, rank, world_size) for b in global_batches()]
    trajectory = []
    for x, y in batches:
        opt.zero_grad()
        # The loss in float32, as under autocast.
        nn.functional.mse_loss(model(x.bfloat16()).float(), y.float()).backward()
        opt.step()
        trajectory.append(flat(opt.full_parameters()))
    masters = []
    for unit in opt.units:
        whole = unit.master.new_empty(unit.padded)
        all_gather_single(whole, unit.master.detach())
        masters.append(whole[: unit.numel])
    return {
        "trajectory": trajectory,
        "masters": torch.cat(masters),
        "held": opt.held_bytes(),
        "padded": sum(u.padded for u in opt.units),
        "units": len(opt.units),
    }


def accumulate(model, optimizer, rank, world_size, whole_gradient, whole_parameters) -> dict:
    """Mixed precision with accumulation: each step, ``MICRO_BATCHES`` backward passes on
    the rank's half (each loss divided by their number, in float32 as under autocast),
    then one step. The whole gradient just before the first step, and the whole
    parameters after each step."""
    gradient, trajectory = None, []
    for batch in global_batches():
        x, y = local(batch, rank, world_size)
        optimizer.zero_grad()
        for part in range(MICRO_BATCHES):
            rows = slice(part * len(x) // MICRO_BATCHES, (part + 1) * len(x) // MICRO_BATCHES)
            out = model(x[rows].bfloat16()).float()
            (nn.functional.mse_loss(out, y[rows].float()) / MICRO_BATCHES).backward()
        if gradient is None:
            gradient = whole_gradient()
        optimizer.step()
        trajectory.append(whole_parameters())
    return {"gradient": gradient, "trajectory": trajectory}


def whole_shards(opt, of) -> torch.Tensor:
    """``of(unit)`` (a float32 shard: the master copy or its gradient) of every unit,
    all-gathered and laid end to end without padding, in ``model.parameters()`` order."""
    pieces = []
    for unit in opt.units:
        shard = of(unit).detach()
        whole = shard.new_empty(unit.padded)
        all_gather_single(whole, shard)
        pieces.append(whole[: unit.numel])
    return torch.cat(pieces)


def mixed_accumulated(rank, world_size, stage):
    """:func:`mixed` with ``MICRO_BATCHES`` backward passes per step: the float32 gradient of
    the master copy before the first step, and the master copy after each step."""
    model = make_model().bfloat16()
    opt = ZeroOptimizer(model, torch.optim.Adam, stage=stage, master_dtype=torch.float32, lr=LR)
    return accumulate(
        model,
        opt,
        rank,
        world_size,
        lambda: whole_shards(opt, lambda unit: unit.master.grad),
        lambda: whole_shards(opt, lambda unit: unit.master),
    )


def fsdp2_accumulated(rank, world_size):
    """FSDP2 in bfloat16 (:func:`fsdp2`'s policy) with ``MICRO_BATCHES`` backward passes per
    step: its float32 sharded gradient before the first step, its parameters after each."""
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    model = fsdp2_model(world_size, bf16)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    return accumulate(
        model,
        opt,
        rank,
        world_size,
        lambda: flat(p.grad.full_tensor() for p in model.parameters()),
        lambda: flat(p.full_tensor() for p in model.parameters()),
    )


@contextlib.contextmanager
def count_collectives():
    """Elements handed to each collective ZeroOptimizer calls, counted the paper's way: the
    whole tensor an all-gather assembles or a reduce-scatter reduces."""
    counts = {"all_gather": 0, "reduce_scatter": 0}
    gather, scatter = getattr(dist, ALL_GATHER_SINGLE), getattr(dist, REDUCE_SCATTER_SINGLE)

    def counted_gather(output, input, *args, **kwargs):
        counts["all_gather"] += output.numel()
        return gather(output, input, *args, **kwargs)

    def counted_scatter(output, input, *args, **kwargs):
        counts["reduce_scatter"] += input.numel()
        return scatter(output, input, *args, **kwargs)

    setattr(dist, ALL_GATHER_SINGLE, counted_gather)
    setattr(dist, REDUCE_SCATTER_SINGLE, counted_scatter)
    try:
        yield counts
    finally:
        setattr(dist, ALL_GATHER_SINGLE, gather)
        setattr(dist, REDUCE_SCATTER_SINGLE, scatter)


def skip_decisions(rank, world_size, stage, share):
    """A LossScaler step with an inf in rank 1's shard of the gradient only: does each rank
    skip, and what is its scale after? ``share``: all-reduce the decision over the world."""
    model = make_model()
    opt = ZeroOptimizer(model, optim.Adam, stage=stage, lr=LR)
    scaler = LossScaler(init_scale=4.0, process_group=dist.group.WORLD if share else None)
    x, y = local(global_batches()[0], rank, world_size)
    before = flat(opt.full_parameters()) if share else None
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    if rank == 1:
        opt.param_groups[0]["params"][0].grad[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    unchanged = torch.equal(before, flat(opt.full_parameters())) if share else None
    return {"skipped": scaler.skipped, "scale": scaler.get_scale(), "unchanged": unchanged}


def run_all(rank, world_size):
    """Every check in one world; the oracle runs on each rank (it is cheap)."""
    out = {"reference": reference(optim.Adam), "reference_torch": reference(torch.optim.Adam)}
    out["ddp"], out["ddp_bytes"] = ddp(rank, world_size, optim.Adam)
    out["reference_nested"] = reference(optim.Adam, nested=True)
    for stage in (1, 2, 3):
        out[f"zero{stage}"] = zero(rank, world_size, stage, optim.Adam)
        out[f"zero{stage}_nested"] = zero(rank, world_size, stage, optim.Adam, nested=True)
        out[f"zero{stage}_torch"] = zero(rank, world_size, stage, torch.optim.Adam)["trajectory"]
    out["zero_redundancy"] = zero_redundancy(rank, world_size)
    out["fsdp2"] = fsdp2(rank, world_size)
    for stage in (1, 2, 3):
        out[f"mixed{stage}"] = mixed(rank, world_size, stage)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    out["fsdp2_mixed"] = fsdp2(rank, world_size, bf16)
    # The same with micro-batches: stages 2 and 3 (stage 1 takes one backward per step).
    for stage in (2, 3):
        out[f"accumulated{stage}"] = mixed_accumulated(rank, world_size, stage)
    out["fsdp2_accumulated"] = fsdp2_accumulated(rank, world_size)
    # Offload: the master copy and Adam's state in CPU memory.
    out["offload1"] = zero(rank, world_size, 1, optim.Adam, offload=True)
    out["offload3_torch"] = zero(rank, world_size, 3, torch.optim.Adam, offload=True)
    out["fsdp2_offload"] = fsdp2(
        rank, world_size, offload_policy=CPUOffloadPolicy(pin_memory=False)
    )
    out["skip_shared"] = [skip_decisions(rank, world_size, s, True) for s in (1, 2, 3)]
    # Unshared, only stage 3 can run: at stages 1 and 2 the rank that steps would wait in
    # the all-gather for the rank that skipped.
    out["skip_unshared"] = skip_decisions(rank, world_size, 3, False)
    return out
