"""The planner's estimates against the book's memory calculator and Narayanan et al.'s
FLOP count."""

import math

import pytest

from lsdl_lab.memory.calculator import gpt_memory, gpt_param_shapes
from lsdl_lab.plan import ModelShape, Techniques, plan, train_flops_per_token


def test_flops_count_is_narayanan_eq3():
    # Narayanan et al. 2021, Section 5.1, eq. 3 (full recomputation): 96 B s L h^2
    # (1 + s/(6h) + V/(16 L h)).
    model = ModelShape(96, 12288, 96, 2048, 51200, 1536)
    B, s, L, h, V = 1536, 2048, 96, 12288, 51200
    paper = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    assert train_flops_per_token(model, "full") * B * s == pytest.approx(paper, rel=1e-12)
    none = train_flops_per_token(model, "none")
    assert none == pytest.approx(72 * L * h * h * (1 + s / (6 * h)) + 6 * V * h, rel=1e-12)
    assert none < train_flops_per_token(model, "selective") < train_flops_per_token(model, "full")
    with pytest.raises(ValueError, match="recompute"):
        train_flops_per_token(model, "half")


def test_memory_without_pipeline_is_the_calculators(small, small_cluster):
    configs = plan(small, small_cluster, Techniques(pp=(1,), tp=(2,)))
    assert {c.zero_stage for c in configs} == {0, 1, 2, 3}
    for c in configs:
        expected = gpt_memory(
            small.shape(c.micro_batch),
            zero_stage=c.zero_stage,
            dp=c.dp,
            tp=c.tp,
            recompute=c.recompute,
        )
        assert c.bytes_per_device == pytest.approx(expected["total"], rel=1e-12)


def test_pipeline_first_stage_holds_pp_micro_batches(small, small_cluster):
    # 1F1B: the first stage keeps up to pp micro-batches of its layers/pp blocks, so its
    # blocks' activations are the whole model's for one micro-batch (here pp <= m).
    techniques = Techniques(tp=(1,), pp=(4,), zero_stages=(0,), micro_batches=(1,))
    (c,) = [c for c in plan(small, small_cluster, techniques) if c.recompute == "none"]
    assert c.accumulation >= c.pp
    whole = gpt_memory(small.shape(1), recompute="none")["activations"]
    assert c.memory["activations"] == pytest.approx(whole, rel=1e-12)
    stage = sum(math.prod(s) for s in gpt_param_shapes(small.shape(1, 2)))
    assert c.memory["params"] == 2 * stage


def test_communication_follows_the_alpha_beta_model(small, small_cluster):
    from lsdl_lab.distributed.cost import ring_all_reduce_time

    techniques = Techniques(tp=(2,), pp=(2,), micro_batches=(2,), recompute=("none",))
    configs = {c.zero_stage: c for c in plan(small, small_cluster, techniques)}
    c = configs[0]
    assert (c.dp, c.accumulation) == (4, 8)
    h, s, b, m = small.hidden, small.seq_len, 2, 8
    intra = small_cluster.link(True)
    tp = 4 * (small.layers // 2) * m * ring_all_reduce_time(2 * b * s * h, 2, *_ab(intra))
    assert c.communication["tp"] == pytest.approx(tp, rel=1e-12)
    # tp x dp x pp = 16 devices > 8 per node: the stages talk over the network.
    inter = small_cluster.link(False)
    p2p = 2 * (m + 1) * (inter.alpha + 2 * b * s * h / 2 * inter.beta)
    assert c.communication["pp"] == pytest.approx(p2p, rel=1e-12)
    # tp x dp = 8 devices fit in a node: the gradients' ring runs on NVLink.
    psi = c.memory["params"] / 2
    all_reduce = ring_all_reduce_time(2 * psi, 4, *_ab(intra))
    assert c.communication["dp"] == pytest.approx(all_reduce, rel=1e-12)
    assert configs[1].communication["dp"] == pytest.approx(all_reduce, rel=1e-12)
    assert configs[2].communication["dp"] == pytest.approx((m + 1) * all_reduce / 2)
    assert configs[3].communication["dp"] == pytest.approx(3 * m * all_reduce / 2)


def _ab(link):
    return link.alpha, link.beta
