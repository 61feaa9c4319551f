"""Workers for the model-parallel tests. A spawned process imports its worker by module and
name, so these live in a module on ``sys.path`` (pytest's ``pythonpath`` adds this
folder). Each rank builds the dense model from the same seed and compares its own shard
with it, so only small reports travel back."""

import copy
import functools
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lsdl_lab.models import GPT, CausalSelfAttention, TransformerBlock
from lsdl_lab.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelAttention,
    TensorParallelBlock,
    TensorParallelMLP,
    pipeline_step,
    shard,
    tensor_parallel_gpt,
    torch_pipeline_step,
)

DIM, HEADS, B, T = 16, 4, 2, 5


@contextmanager
def counting_all_reduces():
    """Count the calls to ``dist.all_reduce`` (what the f and g operators call)."""
    calls, original = [], dist.all_reduce

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_reduce = counted
    try:
        yield calls
    finally:
        dist.all_reduce = original


def refusal(fn, *args, **kwargs):
    """The type and message of the error ``fn`` raises (before any message is sent)."""
    try:
        fn(*args, **kwargs)
    except (TypeError, ValueError) as error:
        return type(error).__name__, str(error)
    return None


def _error(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def _compare(dense, parallel, x, x_parallel, slices):
    """Run both on the same input and output gradient; return the output's, the input
    gradient's and each named parameter gradient's largest error (the dense one cut by
    ``slices[name]``; ``"input"`` and ``"output"`` cut the input and the output), and the
    all-reduces counted forward and backward."""
    dense.zero_grad()  # the pieces share the dense block's parameters
    floating = x.is_floating_point()  # token indices have no gradient
    x, x_parallel = x.clone().requires_grad_(floating), x_parallel.clone().requires_grad_(floating)
    y = dense(x)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    y.backward(dy)
    y, dy = (slices.get("output", lambda g: g)(t) for t in (y, dy))
    with counting_all_reduces() as forward_calls:
        y_parallel = parallel(x_parallel)
    with counting_all_reduces() as backward_calls:
        y_parallel.backward(dy)
    report = {
        "output": _error(y_parallel, y),
        "input_grad": _error(x_parallel.grad, slices.get("input", lambda g: g)(x.grad))
        if floating
        else 0.0,
        "all_reduces": (len(forward_calls), len(backward_calls)),
    }
    dense_params = dict(dense.named_parameters())
    for name, p in parallel.named_parameters():
        cut = slices.get(name, lambda g: g)
        report[f"grad {name}"] = _error(p.grad, cut(dense_params[name].grad))
    report["shapes"] = {name: tuple(p.shape) for name, p in parallel.named_parameters()}
    return report


def _rows(parts=1):
    return lambda g: shard(g, 0, parts=parts)


def _columns(g):
    return shard(g, -1)


def tensor_parallel_report(rank, world_size):
    """Every tensor-parallel piece against its dense original, float64."""
    torch.manual_seed(0)
    block = TransformerBlock(DIM, HEADS, 0.0).double()
    x = torch.randn(B, T, DIM, dtype=torch.float64)
    hidden = torch.randn(B, T, 4 * DIM, dtype=torch.float64)
    mlp_slices = {"0.weight": _rows(), "0.bias": _rows(), "2.weight": _columns}
    attn_slices = {"qkv.weight": _rows(3), "qkv.bias": _rows(3), "proj.weight": _columns}
    block_slices = {f"mlp.{k}": v for k, v in mlp_slices.items()}
    block_slices |= {f"attn.{k}": v for k, v in attn_slices.items()}
    fc, proj = block.mlp[0], block.mlp[2]
    reports = {
        "column": _compare(
            fc,
            ColumnParallelLinear.from_dense(fc),
            x,
            x,
            {"weight": _rows(), "bias": _rows(), "output": _columns},
        ),
        "row": _compare(
            proj,
            RowParallelLinear.from_dense(proj),
            hidden,
            shard(hidden, -1),
            {"weight": _columns, "input": _columns},
        ),
        "mlp": _compare(block.mlp, TensorParallelMLP.from_dense(block.mlp), x, x, mlp_slices),
        "attention": _compare(
            block.attn, TensorParallelAttention.from_dense(block.attn), x, x, attn_slices
        ),
        "block": _compare(block, TensorParallelBlock(block), x, x, block_slices),
    }
    torch.manual_seed(0)
    gpt = GPT(11, block_size=8, layers=2, heads=HEADS, dim=DIM).double()
    idx = torch.randint(0, 11, (B, 8))
    gpt_slices = {f"blocks.{i}.{k}": v for i in range(2) for k, v in block_slices.items()}
    reports["gpt"] = _compare(gpt, tensor_parallel_gpt(gpt), idx, idx, gpt_slices)
    reports["refusals"] = {
        "shard": refusal(shard, torch.ones(3, 4), 0),
        "heads": refusal(TensorParallelAttention.from_dense, CausalSelfAttention(DIM, 1, 0.0)),
        "dropout": refusal(TensorParallelBlock, TransformerBlock(DIM, HEADS, 0.1)),
        "mlp": refusal(TensorParallelMLP.from_dense, nn.Sequential(nn.Linear(2, 2))),
    }
    return reports


# -- pipelines -----------------------------------------------------------------------------

WIDTH, BATCH, MICRO = 8, 8, 4


def dense_model():
    """Four tanh layers, float64, the same on every rank (seeded)."""
    torch.manual_seed(0)
    layers = [nn.Linear(6, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)]
    return nn.Sequential(*layers).double()


def stage_of(model, stage, num_stages):
    """Stage ``stage`` of ``num_stages``: its consecutive layers, sharing ``model``'s."""
    bounds = torch.linspace(0, len(model), num_stages + 1).round().long().tolist()
    return model[bounds[stage] : bounds[stage + 1]]


def summed_mse(output, target):
    return F.mse_loss(output, target, reduction="sum")


def batch():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(BATCH, 6, generator=gen, dtype=torch.float64)
    return x, torch.randn(BATCH, WIDTH, generator=gen, dtype=torch.float64)


def _single_process(rank, world_size):
    """The single process's summed loss over the micro-batches, and this rank's stage of
    the model with its gradients."""
    model, (x, y) = dense_model(), batch()
    loss = sum(summed_mse(model(a), b) for a, b in zip(x.chunk(MICRO), y.chunk(MICRO)))
    loss.backward()
    return loss.item(), stage_of(model, rank, world_size)


def _against(reference, stage):
    grads = dict(reference.named_parameters())
    return {name: _error(p.grad, grads[name].grad) for name, p in stage.named_parameters()}


def _each_schedule(rank, world_size, run):
    """``run(stage, x, y, schedule)`` on a fresh copy of this rank's stage, for both
    schedules: its result with the stage's gradient errors, and the single process's loss
    and stage."""
    loss, reference = _single_process(rank, world_size)
    x, y = batch()
    reports = {"loss": loss}
    for schedule in ("gpipe", "1f1b"):
        stage = copy.deepcopy(reference)
        stage.zero_grad()
        result = run(stage, x, y, schedule)
        reports[schedule] = {"result": result, "grad_errors": _against(reference, stage)}
    return reports, reference


def _our_step(stage, x, y, schedule):
    inputs, targets = x.chunk(MICRO), y.chunk(MICRO)
    shape = (BATCH // MICRO, WIDTH)
    return pipeline_step(stage, MICRO, shape, inputs, targets, summed_mse, schedule)


def _torch_step(stage, x, y, schedule):
    return torch_pipeline_step(stage, MICRO, x, y, summed_mse, schedule)


def pipeline_report(rank, world_size):
    """Both schedules at m = 4 (each stage's report, its gradients against the single
    process's) and the arguments refused."""
    reports, reference = _each_schedule(rank, world_size, _our_step)
    x, y = batch()
    step = functools.partial(pipeline_step, reference, MICRO, loss_fn=summed_mse)
    inputs, targets = x.chunk(MICRO), y.chunk(MICRO)
    reports["refusals"] = {
        "schedule": refusal(step, (2, 8), inputs, targets, schedule="zigzag"),
        "activation_shape": refusal(step, (0, 8), inputs, targets),
        "micro_batches": refusal(step, (2, 8), x.chunk(2), y.chunk(2)),
    }
    return reports


def torch_pipeline_report(rank, world_size):
    """The same with torch.distributed.pipelining: its summed loss (last stage) and the
    stage's gradients against the single process's."""
    return _each_schedule(rank, world_size, _torch_step)[0]


class Sleep(torch.autograd.Function):
    """Stands for a stage's compute with a known time: ``forward_s`` forward,
    ``backward_s`` backward (sleeping leaves the 2 shared cores to the other ranks)."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        time.sleep(ctx.backward_s)
        return dy, None, None


class SleepStage(nn.Module):
    def __init__(self, forward_s, backward_s):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))  # a gradient to compute on every stage
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x):
        return Sleep.apply(self.scale * x, self.forward_s, self.backward_s)


def timed_pipeline(rank, world_size, micro_batches, forward_s, backward_s):
    """Both schedules on stages of known compute time, after an untimed step (the first
    backward in a process imports sympy, 1.5 s): each stage's report."""
    x = torch.ones(micro_batches, 1, 4)

    def step(schedule, stage):
        return pipeline_step(
            stage,
            micro_batches,
            (1, 4),
            inputs=x,
            targets=x,
            loss_fn=lambda out, target: (out * target).sum(),
            schedule=schedule,
        )

    step("gpipe", SleepStage(0.0, 0.0))
    return {s: step(s, SleepStage(forward_s, backward_s)) for s in ("gpipe", "1f1b")}
