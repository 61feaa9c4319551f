"""The rank-side half of test_diloco.py: one world runs every check. A spawned rank imports
its worker by module name, so it lives in this plain module (pytest's ``pythonpath`` puts
this folder on sys.path, which the ranks inherit)."""

import io

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lsdl_lab.data import load_digits
from lsdl_lab.distributed import CollectiveBytes, all_reduce_gradients
from lsdl_lab.distributed.diloco import DiLoCo
from lsdl_lab.distributed.local_sgd import PeriodicAverager
from lsdl_lab.models import MLP

DIM, BATCH, LR = 5, 4, 0.1
# the hand-computed outer steps: H inner AdamW steps, OUTER outer steps at the paper's
# outer learning rate and momentum
H, OUTER, OUTER_LR, OUTER_MOMENTUM, INNER_LR = 2, 3, 0.7, 0.9, 0.01
# the digits: the MLP's hidden width, examples per rank and step, steps, DiLoCo's period,
# the inner AdamW's learning rate (the outer step is the paper's, DiLoCo's defaults)
HIDDEN, DIGITS_BATCH, DIGITS_STEPS, DIGITS_H, DIGITS_LR = 32, 32, 320, 16, 3e-3


def model():
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(DIM, 7), nn.Tanh(), nn.Linear(7, 1)).double()


def data(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, DIM, generator=g, dtype=torch.float64)
    return x, torch.randn(BATCH, 1, generator=g, dtype=torch.float64)


def flat(params):
    return torch.cat([p.detach().reshape(-1) for p in params])


def inner_step(net, opt, rank, t):
    opt.zero_grad()
    x, y = data(rank, t)
    nn.functional.mse_loss(net(x), y).backward()
    opt.step()


class SignFlipped(DiLoCo):
    """A broken DiLoCo whose outer step goes the wrong way: the check of training must
    catch it."""

    def pseudo_gradient(self):
        return -super().pseudo_gradient()


def equals_ddp(rank, world_size, steps=4):
    """H = 1, outer lr 1, momentum 0, inner plain SGD, against DDP with the same SGD."""
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    diloco = DiLoCo(net.parameters(), 1, outer_lr=1.0, outer_momentum=0.0)
    ref = model()
    ddp = DistributedDataParallel(ref)
    ref_opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    ours, theirs = [], []
    for t in range(steps):
        inner_step(net, opt, rank, t)
        diloco.after_step()
        inner_step(ddp, ref_opt, rank, t)
        ours.append(flat(net.parameters()))
        theirs.append(flat(ref.parameters()))
    return {"diloco": ours, "ddp": theirs, "start": flat(model().parameters())}


def equals_local_sgd(rank, world_size, steps=7):
    """Outer lr 1, momentum 0, period H, inner AdamW, against PeriodicAverager (local
    SGD) with the same period and inner optimizer."""
    nets = [model(), model()]
    opts = [torch.optim.AdamW(n.parameters(), lr=INNER_LR) for n in nets]
    diloco = DiLoCo(nets[0].parameters(), H, outer_lr=1.0, outer_momentum=0.0)
    averager = PeriodicAverager(nets[1].parameters(), H)
    ours, theirs = [], []
    for t in range(steps):
        inner_step(nets[0], opts[0], rank, t)
        diloco.after_step()
        inner_step(nets[1], opts[1], rank, t)
        averager.after_step()
        ours.append(flat(nets[0].parameters()))
        theirs.append(flat(nets[1].parameters()))
    return {"diloco": ours, "local": theirs}


def outer_steps(rank, world_size):
    """The paper's outer step (lr 0.7, Nesterov 0.9) after H inner AdamW steps, OUTER
    times: this rank's parameters before each outer step (theta_w) and after it (theta),
    the bytes handed to the collectives, and, for the same steps, what DDP (the gradient
    all-reduced every step, as DDP does it) hands them."""
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=INNER_LR)
    diloco = DiLoCo(net.parameters(), H, OUTER_LR, OUTER_MOMENTUM)
    before, after = [], []
    with CollectiveBytes() as sent:
        for t in range(H * OUTER):
            inner_step(net, opt, rank, t)
            mine = flat(net.parameters())
            if diloco.after_step():
                before.append(mine)
                after.append(flat(net.parameters()))
    ddp = model()
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=INNER_LR)
    with CollectiveBytes() as ddp_sent:
        for t in range(H * OUTER):
            ddp_opt.zero_grad()
            x, y = data(rank, t)
            nn.functional.mse_loss(ddp(x), y).backward()
            all_reduce_gradients(ddp.parameters())
            ddp_opt.step()
    return {
        "start": flat(model().parameters()),
        "before": before,
        "after": after,
        "outer": flat(diloco.outer),
        "bytes": sent.bytes,
        "rounds": diloco.rounds,
        "ddp_bytes": ddp_sent.bytes,
        "model_bytes": sum(p.numel() * p.element_size() for p in net.parameters()),
    }


def resume(rank, world_size, first=5, then=6):
    """Checkpoint (torch.save of the model, the inner AdamW and DiLoCo) in the middle of a
    period, then go on: uninterrupted, resumed from the checkpoint into fresh objects, and
    resumed without DiLoCo's state."""

    def build(seed):
        torch.manual_seed(seed)
        net = nn.Sequential(nn.Linear(DIM, 7), nn.Tanh(), nn.Linear(7, 1)).double()
        opt = torch.optim.AdamW(net.parameters(), lr=INNER_LR)
        return net, opt, DiLoCo(net.parameters(), H, OUTER_LR, OUTER_MOMENTUM)

    def run(net, opt, diloco, steps, offset):
        for t in range(offset, offset + steps):
            inner_step(net, opt, rank, t)
            diloco.after_step()
        return flat(net.parameters())

    net, opt, diloco = build(0)
    run(net, opt, diloco, first, 0)
    buffer = io.BytesIO()
    torch.save(
        {"model": net.state_dict(), "opt": opt.state_dict(), "diloco": diloco.state_dict()},
        buffer,
    )
    straight = run(net, opt, diloco, then, first)
    out = {"straight": straight}
    for name, with_diloco in (("resumed", True), ("without_diloco_state", False)):
        buffer.seek(0)
        saved = torch.load(buffer)
        net, opt, diloco = build(1)  # other initial weights: the checkpoint must replace them
        net.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        if with_diloco:
            diloco.load_state_dict(saved["diloco"])
        else:  # a run that forgot the outer state: its shared copy is the model as saved
            diloco = DiLoCo(net.parameters(), H, OUTER_LR, OUTER_MOMENTUM)
        out[name] = run(net, opt, diloco, then, first)
    return out


def digits_training(rank, world_size):
    """The digits MLP trained for DIGITS_STEPS inner AdamW steps, DIGITS_BATCH examples per
    rank and step (the same examples for every method): DDP (the gradient all-reduced every
    step), DiLoCo at period DIGITS_H with the paper's outer step, and DiLoCo with its outer
    step's sign flipped. The training loss of the final model (the same on every rank) and
    the bytes handed to the collectives."""
    digits = load_digits()
    x, y = digits.train_x, digits.train_y
    n = len(y)

    def batch(t):
        g = torch.Generator().manual_seed(t)
        idx = torch.randperm(n, generator=g)[rank * DIGITS_BATCH : (rank + 1) * DIGITS_BATCH]
        return x[idx], y[idx]

    out = {}
    for name in ("ddp", "diloco", "sign flipped"):
        torch.manual_seed(0)
        net = MLP(64, 10, hidden=HIDDEN)
        opt = torch.optim.AdamW(net.parameters(), lr=DIGITS_LR)
        outer = {"diloco": DiLoCo, "sign flipped": SignFlipped}.get(name)
        diloco = outer(net.parameters(), DIGITS_H) if outer else None
        with CollectiveBytes() as sent:
            for t in range(DIGITS_STEPS):
                opt.zero_grad()
                xb, yb = batch(t)
                nn.functional.cross_entropy(net(xb), yb).backward()
                if diloco is None:
                    all_reduce_gradients(net.parameters())
                opt.step()
                if diloco is not None:
                    diloco.after_step()
        with torch.no_grad():
            loss = nn.functional.cross_entropy(net(x), y).item()
        losses = torch.tensor([loss], dtype=torch.float64)
        everyone = [torch.empty_like(losses) for _ in range(world_size)]
        dist.all_gather(everyone, losses)
        out[name] = {
            "loss": loss,
            "spread": max(abs(e.item() - loss) for e in everyone),
            "bytes": sent.bytes,
            "model_bytes": sum(p.numel() * p.element_size() for p in net.parameters()),
        }
    return out


def all_checks(rank, world_size):
    torch.set_num_threads(1)
    return {
        "ddp": equals_ddp(rank, world_size),
        "local": equals_local_sgd(rank, world_size),
        "outer": outer_steps(rank, world_size),
        "resume": resume(rank, world_size),
        "digits": digits_training(rank, world_size),
    }
