"""Tests of lsdl_lab.moe: top-k routing with capacity (GShard's choice-major queue), dropped
tokens, the load-balancing loss against its formula on hand-made cases, gradients to the
router, the layer against a token-by-token reference, the GPT option, bad input."""

import math

import pytest
import torch

from lsdl_lab.models import GPT, MoE
from lsdl_lab.moe import capacity, route


def _logits(probs) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log()


def test_capacity_is_the_ceiling_of_the_formula():
    assert capacity(10, 4, 2, 1.25) == math.ceil(1.25 * 10 * 2 / 4) == 7
    assert capacity(8, 4, 1, 1.0) == 2
    assert capacity(3, 3, 2, 0.75) == 2


def test_top1_keeps_the_first_tokens_and_drops_the_rest():
    # four tokens all prefer expert 0; C = ceil(1.0 * 4 * 1 / 2) = 2
    r = route(_logits([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.6, 0.4]]), 1, 1.0)
    assert r.capacity == 2
    assert r.token.tolist() == [0, 1]
    assert r.counts.tolist() == [2, 0] and r.routed.tolist() == [4, 0] and r.dropped == 2
    assert torch.allclose(r.gate, torch.tensor([0.9, 0.8], dtype=torch.float64))  # Switch: p


def test_first_choices_queue_before_second_choices():
    # token 0: experts 0 then 1; token 1: experts 1 then 2; C = ceil(0.75 * 2 * 2 / 3) = 1.
    # Token 1's first choice takes expert 1's one place before token 0's second choice
    # (GShard); a token-by-token queue would keep token 0's second choice instead.
    r = route(_logits([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]]), 2, 0.75)
    assert r.capacity == 1
    assert r.counts.tolist() == [1, 1, 1] and r.dropped == 1
    # grouped by expert: expert 0 <- token 0, expert 1 <- token 1, expert 2 <- token 1
    assert r.token.tolist() == [0, 1, 1]
    # GShard's gates: the top two renormalized to add up to 1
    expected = [0.5 / 0.8, 0.6 / 0.9, 0.3 / 0.9]
    assert torch.allclose(r.gate, torch.tensor(expected, dtype=torch.float64))


def test_aux_loss_equals_the_formula_on_a_hand_made_case():
    # both tokens pick expert 0: f = (1, 0), P = (0.7, 0.3); E sum_i f_i P_i = 2 * 0.7
    r = route(_logits([[0.8, 0.2], [0.6, 0.4]]), 1, 2.0)
    assert r.aux_loss.item() == pytest.approx(1.4, abs=1e-12)
    # top-2 of three experts: assignments (0, 1) and (1, 2): f = (1, 2, 1) / 4,
    # P = (0.3, 0.45, 0.25); E sum f P = 3 * (0.3 + 0.9 + 0.25) / 4
    r = route(_logits([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]]), 2, 2.0)
    assert r.aux_loss.item() == pytest.approx(3 * (0.3 + 0.9 + 0.25) / 4, abs=1e-12)


def test_aux_loss_is_one_when_uniform_and_near_experts_when_collapsed():
    uniform = route(torch.zeros(16, 4), 2, 1.0).aux_loss.item()
    assert uniform == pytest.approx(1.0, abs=1e-6)
    collapsed = torch.tensor([[20.0, 0.0, 0.0, 0.0]]).expand(16, 4)
    assert route(collapsed, 1, 1.0).aux_loss.item() == pytest.approx(4.0, abs=1e-6)


def _reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer token by token: queue the assignments choice by choice, keep the first C
    of each expert, sum gate * expert(x) over a token's kept assignments."""
    probs = moe.router(x).softmax(-1)
    gate, expert = probs.topk(moe.top_k, dim=-1)
    if moe.top_k > 1:
        gate = gate / gate.sum(-1, keepdim=True)
    C = capacity(len(x), moe.num_experts, moe.top_k, moe.capacity_factor)
    taken, out = [0] * moe.num_experts, torch.zeros_like(x)
    for j in range(moe.top_k):
        for t in range(len(x)):
            e = expert[t, j].item()
            if taken[e] < C:
                taken[e] += 1
                out[t] += gate[t, j] * moe.experts[e](x[t])
    return out


@pytest.mark.parametrize("top_k, capacity_factor", [(1, 1.0), (2, 1.0), (2, 0.5), (3, 2.0)])
def test_layer_equals_the_token_by_token_reference(top_k, capacity_factor, device):
    moe = MoE(6, 12, 4, top_k, capacity_factor).double().to(device)
    x = torch.randn(3, 7, 6, dtype=torch.float64, device=device)
    y = moe(x)
    assert y.shape == x.shape and y.device == x.device
    assert torch.allclose(y.view(-1, 6), _reference(moe, x.view(-1, 6)), atol=1e-12)
    kept = moe.tokens_per_expert.clamp(max=moe.capacity)
    assert moe.dropped == moe.tokens_per_expert.sum().item() - kept.sum().item()
    assert moe.tokens_per_expert.sum().item() == 21 * top_k


def test_a_token_whose_assignments_are_all_dropped_comes_out_zero():
    moe = MoE(4, 8, 2, top_k=2, capacity_factor=2 / 3).double()
    torch.nn.init.zeros_(moe.router.weight)  # equal logits: every token picks the same two
    x = torch.randn(3, 4, dtype=torch.float64)
    y = moe(x)
    assert moe.capacity == 2 and moe.dropped == 2 and moe.tokens_per_expert.tolist() == [3, 3]
    assert y[2].abs().max().item() == 0.0  # the third token lost both places
    assert y[:2].abs().min().item() > 0


def test_gradients_reach_the_router_through_the_gates_and_the_aux_loss(device):
    for top_k in (1, 2):
        moe = MoE(8, 16, 4, top_k).to(device)
        moe(torch.randn(32, 8, device=device)).square().sum().backward()
        through_gates = moe.router.weight.grad.clone()
        assert through_gates.abs().sum() > 0
        moe.zero_grad()
        moe(torch.randn(32, 8, device=device))
        moe.aux_loss.backward()
        assert moe.router.weight.grad.abs().sum() > 0
        assert all(p.grad is None for p in moe.experts.parameters())  # aux: the router alone


def test_active_parameters_count_the_router_and_top_k_experts():
    moe = MoE(8, 32, 6, top_k=2)
    one = 8 * 32 + 32 + 32 * 8 + 8
    assert moe.active_parameters() == 8 * 6 + 2 * one
    assert sum(p.numel() for p in moe.parameters()) == 8 * 6 + 6 * one


def test_gpt_option_keeps_the_dense_gpt_and_swaps_in_moe_layers():
    dense = GPT(11, 8, layers=2, heads=2, dim=8)
    assert dense(torch.randint(0, 11, (2, 8))).shape == (2, 8, 11)
    assert dense.aux_loss.item() == 0.0
    moe = GPT(11, 8, layers=2, heads=2, dim=8, moe_experts=4, moe_top_k=1)
    assert all(isinstance(b.mlp, MoE) and b.mlp.top_k == 1 for b in moe.blocks)
    with pytest.raises(RuntimeError, match="no forward yet"):
        _ = moe.aux_loss
    logits = moe(torch.randint(0, 11, (2, 8)))
    assert logits.shape == (2, 8, 11)
    total = sum(b.mlp.aux_loss for b in moe.blocks)
    assert moe.aux_loss.item() == pytest.approx(total.item()) and moe.aux_loss.requires_grad
    # GPT-2's scaled init reaches each expert's output layer
    assert moe.blocks[0].mlp.experts[3][2].weight.std().item() < 0.02 / math.sqrt(2) * 1.3


def test_moe_gpt_trains_on_random_tokens(device):
    torch.manual_seed(0)
    gpt = GPT(16, 16, layers=2, heads=2, dim=16, moe_experts=4).to(device)
    idx = torch.randint(0, 16, (8, 17), device=device)
    opt = torch.optim.Adam(gpt.parameters(), lr=1e-2)
    losses = []
    for _ in range(40):
        logits = gpt(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 16), idx[:, 1:].reshape(-1))
        opt.zero_grad()
        (loss + 0.01 * gpt.aux_loss).backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 0.9 * math.log(16)  # starts near chance
    assert losses[-1] < 0.5 * losses[0], losses  # memorizes the batch
    assert all(b.mlp.router.weight.grad.abs().sum() > 0 for b in gpt.blocks)


def test_bad_arguments_name_the_argument_and_the_range():
    with pytest.raises(ValueError, match=r"Invalid dim: 0 \(expected an int >= 1\)"):
        MoE(0, 8, 4)
    with pytest.raises(ValueError, match=r"Invalid experts: 0 \(expected an int >= 1\)"):
        MoE(8, 8, 0)
    with pytest.raises(ValueError, match=r"Invalid top_k: 5 \(expected an int in \[1, 4\]\)"):
        MoE(8, 8, 4, top_k=5)
    with pytest.raises(ValueError, match=r"Invalid capacity_factor: 0 \(expected a finite"):
        MoE(8, 8, 4, capacity_factor=0)
    with pytest.raises(TypeError, match="Invalid hidden"):
        MoE(8, 8.0, 4)
    moe = MoE(8, 8, 4)
    with pytest.raises(ValueError, match=r"Invalid x: shape \(2, 7\) \(expected a last dim"):
        moe(torch.randn(2, 7))
    with pytest.raises(TypeError, match="Invalid x"):
        moe([1.0] * 8)
    with pytest.raises(ValueError, match=r"Invalid moe_experts: -1 \(expected an int >= 0\)"):
        GPT(11, moe_experts=-1)
    with pytest.raises(ValueError, match="Invalid top_k: 3"):
        GPT(11, moe_experts=2, moe_top_k=3)
