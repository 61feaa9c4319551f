"""Workers for the context-parallel tests (a spawned rank imports its worker by module and
name). Every rank builds the whole sequence's q, k, v and output gradient from one seed,
computes full attention on it as the reference, runs ring attention and Ulysses on its
own shard, and reports the largest errors, the bytes it sent and the largest tensor it
made: small numbers, not tensors, travel back."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from parallel_workers import refusal

from lsdl_lab.distributed.traffic import SentMessages
from lsdl_lab.memory import LargestTensor
from lsdl_lab.parallel import ring_attention, ulysses_attention

B, H, S_SHARD, D = 2, 4, 3, 8
METHODS = {"ring": ring_attention, "ulysses": ulysses_attention}


def _whole(p, s, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, p * s, D, generator=g, dtype=dtype) for _ in range(4)]


def _run(method, rank, p, s, dtype, causal, group=None, seed=0):
    """Errors against full attention (output and the q, k, v gradients of this rank's
    shard) and the bytes sent forward and backward."""
    q, k, v, dy = _whole(p, s, dtype, seed)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    y = F.scaled_dot_product_attention(*full, is_causal=causal)
    y.backward(dy)
    shard = slice(rank * s, (rank + 1) * s)
    mine = [t[:, :, shard].clone().requires_grad_() for t in (q, k, v)]
    with SentMessages(forbid=True) as forward:
        out = METHODS[method](*mine, group=group, causal=causal)
    with SentMessages(forbid=True) as backward:
        out.backward(dy[:, :, shard])
    errors = {"output": (out - y[:, :, shard]).abs().max().item()}
    for name, a, b in zip(("dq", "dk", "dv"), mine, full, strict=True):
        errors[name] = (a.grad - b.grad[:, :, shard]).abs().max().item()
    return {"errors": errors, "bytes": (forward.bytes, backward.bytes), "dtype": str(out.dtype)}


def _largest(method, p, s, group=None):
    """The largest tensor (entries) made in ``method``'s forward and backward, float32,
    causal, shards of s positions (4 features a head, so a block's s x s scores outgrow
    its s x head_dim shards)."""
    q, k, v = (t.requires_grad_() for t in torch.randn(3, B, H, s, 4).unbind())
    with LargestTensor() as seen:
        METHODS[method](q, k, v, group=group).sum().backward()
    return seen.numel


def context_report(rank, p):
    """Every check of one world of p ranks: ``{(method, dtype, causal): run}`` for the
    methods that apply (Ulysses when p divides the heads), bfloat16 ring attention,
    the largest tensors at two shard lengths, the refusals, and at p = 4 both methods on
    the two sub-groups of ranks {0, 1} and {2, 3}."""
    methods = ["ring"] + (["ulysses"] if H % p == 0 else [])
    report = {"runs": {}, "largest": {}}
    for method in methods:
        for dtype in (torch.float64, torch.float32):
            for causal in (True, False):
                run = _run(method, rank, p, S_SHARD, dtype, causal, seed=p)
                report["runs"][method, str(dtype), causal] = run
        for s in (16, 32):
            report["largest"][method, s] = _largest(method, p, s)
    report["bfloat16"] = _run("ring", rank, p, S_SHARD, torch.bfloat16, True)
    x = torch.zeros(B, H, S_SHARD, D)
    report["refusals"] = {
        "q": refusal(ring_attention, x[0], x, x),
        "k": refusal(ulysses_attention, x, x[:, :, :2], x),
        "v": refusal(ring_attention, x, x, x.double()),
        "heads": refusal(ulysses_attention, *(torch.zeros(B, p + 1, 2, D),) * 3),
    }
    if p == 4:
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        group, local = groups[rank // 2], rank % 2
        report["subgroups"] = {
            method: _run(method, local, 2, S_SHARD, torch.float64, True, group, seed=rank // 2)
            for method in METHODS
        }
    return report
