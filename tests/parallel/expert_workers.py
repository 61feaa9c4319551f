"""Workers for the expert-parallel tests (spawned ranks import them by module and name).

Every rank builds the one-process MoE from the same seed and can make every rank's tokens,
so it computes the reference itself: the one-process layer on each rank's tokens alone
(capacity, routing and aux loss are per batch, so per rank). Only small reports travel back.
"""

import torch
import torch.distributed as dist
from parallel_workers import refusal

from lsdl_lab.distributed.traffic import BuiltInCollective, SentMessages
from lsdl_lab.models import GPT, MoE
from lsdl_lab.parallel import ExpertParallelMoE, expert_parallel_gpt

DIM, HIDDEN, ALPHA = 8, 16, 0.1
# name -> (experts, top_k, capacity_factor, router zeroed): top-2 with drops, Switch's
# top-1, and a router with equal logits that sends every token to the first experts
# (empty splits, most assignments dropped)
CASES = {
    "top2": (4, 2, 1.0, False),
    "top1": (8, 1, 1.25, False),
    "skewed": (4, 2, 1.5, True),
}


def tokens_of(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens (a different number on each rank) and the gradient of the
    output it is given, float64."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2, 5 + 2 * rank, DIM, generator=g, dtype=torch.float64)
    return x, torch.randn(x.shape, generator=g, dtype=torch.float64)


def _error(a, b) -> float:
    a = torch.zeros_like(b) if a is None else a
    b = torch.zeros_like(a) if b is None else b
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def _step(layer, x, dy):
    """Forward and backward of ``(y * dy).sum() + ALPHA * aux_loss``: the output, the input's
    gradient and the layer's statistics."""
    x = x.clone().requires_grad_(True)
    y = layer(x)
    ((y * dy).sum() + ALPHA * layer.aux_loss).backward()
    return {
        "y": y.detach(),
        "dx": x.grad,
        "aux": layer.aux_loss.item(),
        "routed": layer.tokens_per_expert.tolist(),
        "dropped": layer.dropped,
        "capacity": layer.capacity,
    }


def _case(rank, p, experts, top_k, capacity_factor, zero_router):
    torch.manual_seed(0)
    moe = MoE(DIM, HIDDEN, experts, top_k, capacity_factor).double()
    if zero_router:
        torch.nn.init.zeros_(moe.router.weight)
    ep = ExpertParallelMoE.from_dense(moe, None)
    x, dy = tokens_of(rank)

    # the reference: every rank's tokens through the one-process layer; the experts'
    # gradients summed over ranks (each expert saw them all), the router's from mine alone
    refs, kept = [], []
    for s in range(p):
        moe.zero_grad()
        refs.append(_step(moe, *tokens_of(s)))
        kept.append([min(n, refs[s]["capacity"]) for n in refs[s]["routed"]])
        if s == rank:
            router_grad = moe.router.weight.grad.clone()
    moe.zero_grad()
    for s in range(p):
        _step(moe, *tokens_of(s))
    ref = refs[rank]

    with SentMessages(forbid=True) as messages:
        got = _step(ep, x, dy)
    local = experts // p
    report = {
        "output": _error(got["y"], ref["y"]),
        "input_grad": _error(got["dx"], ref["dx"]),
        "aux": abs(got["aux"] - ref["aux"]),
        "router_grad": _error(ep.router.weight.grad, router_grad),
        "same_stats": all(got[k] == ref[k] for k in ("routed", "dropped", "capacity")),
        "dropped": got["dropped"],
        "local_experts": len(ep.experts),
    }
    for i, expert in enumerate(ep.experts):
        dense = moe.experts[rank * local + i]
        for (name, param), ref_param in zip(
            expert.named_parameters(), dense.parameters(), strict=True
        ):
            report[f"expert {rank * local + i} {name}"] = _error(param.grad, ref_param.grad)

    # the rows each rank sends to each rank, from the reference's routing counts alone
    rows = [[sum(kept[s][j * local : (j + 1) * local]) for j in range(p)] for s in range(p)]
    sent = rows[rank]
    received = [rows[s][rank] for s in range(p)]
    off = [j for j in range(p) if j != rank]
    b = 8  # float64
    report.update(
        sent=ep.sent,
        received=ep.received,
        sent_expected=sent,
        received_expected=received,
        bytes_forward=ep.bytes.forward,
        bytes_backward=ep.bytes.backward,
        # counted from the tensors handed to the all-to-alls: the E int64 counts, then the
        # dispatch (S rows) and combine (R rows) forward, the two reverses backward
        bytes_forward_formula=8 * experts + (sum(sent) + sum(received)) * DIM * b,
        bytes_backward_formula=(sum(sent) + sum(received)) * DIM * b,
        # what point-to-point actually carried off this rank (SentMessages): the blocks for
        # the other ranks, forward and backward
        wire_bytes=messages.bytes,
        wire_formula=8 * (experts - local) + 2 * sum(sent[j] + received[j] for j in off) * DIM * b,
    )
    return report


def _gpt(rank, p):
    """The MoE GPT split by expert_parallel_gpt against the one-process GPT."""
    torch.manual_seed(0)
    gpt = GPT(13, 8, layers=2, heads=2, dim=DIM, moe_experts=4, moe_capacity_factor=1.0)
    gpt = gpt.double()
    ep = expert_parallel_gpt(gpt)

    def idx_of(s):
        return torch.randint(0, 13, (2, 8), generator=torch.Generator().manual_seed(7 + s))

    def loss_of(model, idx):
        logits = model(idx)
        return logits, logits.square().mean() + ALPHA * model.aux_loss

    gpt.zero_grad()
    for s in range(p):  # the experts' gradients: every rank's tokens
        loss_of(gpt, idx_of(s))[1].backward()
    expert_grad = gpt.blocks[1].mlp.experts[rank * (4 // p)][0].weight.grad.clone()
    gpt.zero_grad()
    logits, loss = loss_of(gpt, idx_of(rank))
    loss.backward()
    ep_logits, ep_loss = loss_of(ep, idx_of(rank))
    ep_loss.backward()
    return {
        "logits": _error(ep_logits.detach(), logits.detach()),
        "aux": abs(ep.aux_loss.item() - gpt.aux_loss.item()),
        "embedding_grad": _error(ep.tok.weight.grad, gpt.tok.weight.grad),
        "expert_grad": _error(ep.blocks[1].mlp.experts[0][0].weight.grad, expert_grad),
    }


def _forbidden_inside_sent_messages():
    """SentMessages(forbid=True) does raise on a built-in collective (so the MoE's step
    inside such a block used none)."""
    try:
        with SentMessages(forbid=True):
            dist.all_reduce(torch.zeros(1))
    except BuiltInCollective:
        return True
    return False


def expert_parallel_report(rank, world_size):
    """Every check of one world: each case against the one-process MoE, the GPT, refusals."""
    report = {name: _case(rank, world_size, *case) for name, case in CASES.items()}
    report["gpt"] = _gpt(rank, world_size)
    report["forbid_works"] = _forbidden_inside_sent_messages()
    report["refusals"] = {
        "experts": refusal(ExpertParallelMoE.from_dense, MoE(DIM, HIDDEN, 5, 1)),
        "moe": refusal(ExpertParallelMoE.from_dense, torch.nn.Linear(2, 2)),
        "dense": refusal(expert_parallel_gpt, GPT(13, 8, layers=1, heads=2, dim=DIM)),
    }
    return report
