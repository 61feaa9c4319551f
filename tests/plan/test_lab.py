"""The planner at lab scale, on a given alpha-beta."""

import math

import pytest

from lsdl_lab.dist.cost import AlphaBeta, ring_all_reduce_time
from lsdl_lab.memory.calculator import gpt_param_shapes
from lsdl_lab.plan import Model, lab_cluster, plan_lab

LAB = Model(layers=2, hidden=64, heads=4, seq_len=64, vocab=256, global_batch=8)


def test_lab_plan_uses_the_measured_link():
    # Given alpha and beta (as fit_alpha_beta would give from gloo at world 2); the check
    # against a measured world-2 run is for Chapter 9, not done here.
    link = AlphaBeta(alpha=50e-6, beta=1e-9)
    configs = plan_lab(LAB, link, memory=1e9, peak_flops=1e10)
    assert {(c.dp, c.tp, c.pp) for c in configs} == {(2, 1, 1), (1, 2, 1), (1, 1, 2)}
    (dp,) = [c for c in configs if c.dp == 2 and c.zero_stage == 0][:1]
    psi = sum(math.prod(s) for s in gpt_param_shapes(LAB.shape(1)))
    assert dp.communication["dp"] == pytest.approx(
        ring_all_reduce_time(4 * psi, 2, link.alpha, link.beta), rel=1e-12
    )
    # A fast link: data parallelism (no bubble, one all-reduce) is first; a link a
    # million times slower per byte makes communication dominate and changes the order.
    assert (configs[0].dp, configs[0].tp, configs[0].pp) == (2, 1, 1)
    slow = plan_lab(LAB, AlphaBeta(alpha=50e-6, beta=1e-3), memory=1e9, peak_flops=1e10)
    assert (slow[0].dp, slow[0].tp, slow[0].pp) == (1, 1, 2)  # b s h per message < Psi
    assert lab_cluster(link, memory=1e9, peak_flops=1e10).link(False) == link
