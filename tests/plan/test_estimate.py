"""The planner's estimates against the book's memory calculator, Narayanan et al.'s FLOP
count, the pipeline schedules' arithmetic and the alpha-beta model."""

import dataclasses
import math

import pytest

from lsdl_lab.memory.calculator import (
    activation_parts,
    gpt_memory,
    gpt_param_parts,
    layer_traffic,
)
from lsdl_lab.memory.zero import zero_bytes
from lsdl_lab.plan import (
    ModelShape,
    Techniques,
    block_flops_per_token,
    evaluate,
    in_flight,
    partition,
    plan,
    train_flops_per_token,
)


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


def test_flops_of_a_gated_gqa_block_by_hand():
    # Llama 3 405B's block (Dubey et al. 2024, Table 3): h 16384, 128 heads of 128, 8 KV
    # heads, SwiGLU FFN 53248. Per token, forward: 2 x (h (h + 2 x 1024) + h^2 + 3 h ffn)
    # multiply-adds of the matrices, 4 s h of the scores and values; three forwards.
    model = ModelShape(126, 16384, 128, 8192, 128000, 2048, kv_heads=8, ffn=53248, gated=True)
    h, s, f = 16384, 8192, 53248
    forward = 2 * (h * (h + 2048) + h * h + 3 * h * f) + 4 * s * h
    assert block_flops_per_token(model) == 3 * forward
    assert block_flops_per_token(model, "full") == 4 * forward
    # 6 x parameters per token for the matrices, within 1% of the model's 405B
    assert 3 * 2 * (h * (h + 2048) + h * h + 3 * h * f) * 126 / 6 / 1e9 == pytest.approx(
        405, rel=0.01
    )


def test_partition_spreads_blocks_and_counts_the_embedding_as_a_slot():
    assert partition(8, 4) == ((2,), (2,), (2,), (2,))
    assert sum(b for (b,) in partition(126, 16)) == 126
    # BLOOM's "type:transformer|embedding": 70 blocks and 2 slots over 12 stages of 6,
    # the first and the last with 5 blocks (its README: "pp rank 0: [embed | 5 blocks]").
    bloom = partition(70, 12, 1, True)
    assert bloom[0] == (5,) and bloom[-1] == (5,) and set(bloom[1:-1]) == {(6,)}
    # Llama 3: 126 blocks and 2 slots in 16 x 8 chunks of one: the first chunk of the
    # first stage is the embedding alone, the last of the last stage the output alone.
    llama = partition(126, 16, 8, True)
    assert llama[0] == (0, 1, 1, 1, 1, 1, 1, 1) and llama[-1] == (1,) * 7 + (0,)
    assert sum(map(sum, llama)) == 126
    assert partition(4, 4, 2) is None  # 8 chunks for 4 blocks


def test_in_flight_is_1f1b_and_the_interleaved_warm_up():
    # 1F1B: rank r holds pp - r micro-batches (at most m) of its blocks.
    assert [in_flight(4, 1, 8, r) for r in range(4)] == [(4,), (3,), (2,), (1,)]
    assert in_flight(4, 1, 2, 0) == (2,)
    # Interleaved (v chunks): rank 0 holds v p + p - 1 chunk-micro-batches, Korthikanti
    # et al.'s 1 + (p - 1)/(p v) times 1F1B's p micro-batches of all its blocks.
    p, v, m = 16, 8, 32
    assert sum(in_flight(p, v, m, 0)) == v * p + p - 1
    assert sum(in_flight(p, v, m, 0)) / (v * p) == pytest.approx(1 + (p - 1) / (p * v))
    assert in_flight(p, v, m, 0) == (2 * p - 1,) + (p,) * (v - 1)  # chunk 0 of a 2nd group
    assert sum(in_flight(p, v, 16, 1)) == v * 16  # capped by the v m chunks there are


def test_a_pipeline_rank_holds_its_chunks_micro_batches(small, small_cluster):
    # 1F1B on 4 stages of 2 blocks: the first rank holds 4 micro-batches of its 2 blocks and
    # of the embedding's dropout mask, the last one of its blocks, the logits and a copy of
    # the tied embedding. The busiest is the first.
    techniques = Techniques(tp=(1,), pp=(4,), zero_stages=(0,), micro_batches=(1,))
    (c,) = [c for c in plan(small, small_cluster, techniques) if c.recompute == "none"]
    assert c.accumulation >= c.pp and c.stage == 0
    act = activation_parts(small.shape(1), "bf16", "none")
    assert c.memory["activations"] == pytest.approx(4 * (2 * act["layer"] + act["embedding"]))
    parts = gpt_param_parts(small.shape(1))
    first = sum(math.prod(s) for s in parts["embedding"] + 2 * parts["block"])
    assert c.memory["params"] == 2 * first
    # the last rank's parameters set the data-parallel time: its blocks, the final
    # LayerNorm and the tied embedding's copy
    last = sum(math.prod(s) for s in 2 * parts["block"] + parts["head"]) + math.prod(
        parts["embedding"][0]
    )
    two = evaluate(small, small_cluster, techniques, dp=4, tp=1, pp=4, zero_stage=0,
                   micro_batch=1, recompute="none")  # fmt: skip
    link = small_cluster.link(True)  # dp x tp = 4 devices in a node
    from lsdl_lab.distributed.cost import ring_all_reduce_time

    assert two.communication["dp"] == pytest.approx(
        ring_all_reduce_time(2 * max(first, last), 4, link.alpha, link.beta), rel=1e-12
    )


def test_the_frameworks_choices_reach_the_calculator(small, small_cluster):
    # Fused attention, sequence parallelism and no dropout reach the calculator; float32
    # gradients and a float32 reduction change the gradients' bytes and their all-reduce.
    fused = Techniques(tp=(2,), pp=(1,), zero_stages=(0, 2), recompute=("none",),
                       micro_batches=(1,), attention="fused", sequence_parallel=True,
                       dropout=False, grad_bytes=4, reduce_bytes=4)  # fmt: skip
    configs = {c.zero_stage: c for c in plan(small, small_cluster, fused)}
    c = configs[0]
    options = dict(attention="fused", sequence_parallel=True, dropout=False)
    expected = gpt_memory(small.shape(1), tp=2, dp=8, **options)
    assert c.memory["activations"] == pytest.approx(expected["activations"], rel=1e-12)
    psi = expected["params"] / 2
    assert c.memory["grads"] == 4 * psi  # float32 gradients, whole under ZeRO-0
    assert configs[2].memory["grads"] == pytest.approx(4 * psi / 8)  # partitioned at 2
    assert c.memory == pytest.approx({**zero_bytes(psi, 0, 8, 12, grad_bytes=4),
                                      "activations": expected["activations"]}
                                     | {"total": c.bytes_per_device})  # fmt: skip
    plain = dataclasses.replace(fused, grad_bytes=None, reduce_bytes=None)
    (p16,) = [c for c in plan(small, small_cluster, plain) if c.zero_stage == 0]
    assert c.communication["dp"] > 1.9 * p16.communication["dp"]  # twice the bytes, + alpha
    # the materialized s x s scores and their softmax, 2 p a s^2 b / t bytes a layer, in
    # place of the float32 log-sum-exp, 4 a s b / t
    materialized = plan(small, small_cluster, dataclasses.replace(fused, attention="materialized"))
    a, s, t = small.heads, small.seq_len, 2
    scores = small.layers * (4 * a * s * s - 4 * a * s) / t
    assert materialized[0].memory["activations"] - c.memory["activations"] == scores


def test_overlap_hides_the_data_parallel_time_under_the_passes(small, small_cluster):
    # ZeRO-3 gathers and reduces under all the compute; ZeRO-2 reduce-scatters each
    # micro-batch's gradients under its backward pass (2/3 of the compute without
    # recomputation); ZeRO-0 and 1 reduce once, under the last micro-batch's backward pass.
    # At 50 GB/s between nodes each hides part of its data-parallel time, not all.
    cluster = dataclasses.replace(small_cluster, inter_bandwidth=50e9)
    base = Techniques(tp=(1,), pp=(1,), recompute=("none",), micro_batches=(1,))
    apart = {c.zero_stage: c for c in plan(small, cluster, base)}
    together = {
        c.zero_stage: c for c in plan(small, cluster, dataclasses.replace(base, overlap=True))
    }
    for zero, c in together.items():
        m, compute, dp = c.accumulation, c.compute_time, c.communication["dp"]
        window = {0: 2 / 3 * compute / m, 1: 2 / 3 * compute / m, 2: 2 / 3 * compute}.get(
            zero, compute
        )
        assert 0 < window < dp
        assert c.step_time == pytest.approx(compute + dp - window, rel=1e-12)
        assert apart[zero].step_time == pytest.approx(compute + dp, rel=1e-12)


def test_communication_follows_the_alpha_beta_model(small, small_cluster):
    from lsdl_lab.distributed.cost import ring_all_reduce_time

    techniques = Techniques(tp=(2,), pp=(2,), micro_batches=(2,), recompute=("none",),
                            virtual_stages=(1, 2))  # fmt: skip
    configs = {(c.zero_stage, c.virtual_stages): c for c in plan(small, small_cluster, techniques)}
    c = configs[0, 1]
    assert (c.dp, c.accumulation) == (4, 8)
    h, s, b, m = small.hidden, small.seq_len, 2, 8
    intra = small_cluster.link(True)
    tp = 4 * (small.layers // 2) * m * ring_all_reduce_time(2 * b * s * h, 2, *_ab(intra))
    assert c.communication["tp"] == pytest.approx(tp, rel=1e-12)
    # tp x dp x pp = 16 devices > 8 per node: the stages talk over the network, 2 (m + p - 1)
    # messages, and 2 (v m + p - 1) in the interleaved schedule, whose bubble is v times
    # smaller.
    inter = small_cluster.link(False)
    message = inter.alpha + 2 * b * s * h / 2 * inter.beta
    assert c.communication["pp"] == pytest.approx(2 * (m + 1) * message, rel=1e-12)
    assert configs[0, 2].communication["pp"] == pytest.approx(2 * (2 * m + 1) * message)
    assert configs[0, 2].bubble == pytest.approx(c.bubble / 2) == pytest.approx(1 / 16)
    # tp x dp = 8 devices fit in a node: the gradients' ring runs on NVLink, for the rank
    # with the most parameters (the first holds the positions, the last the final LayerNorm;
    # both the token embedding, the last a tied copy of it).
    parts = gpt_param_parts(small.shape(1), 2)
    first = parts["embedding"] + 4 * parts["block"]  # tokens, positions, 4 blocks
    last = 4 * parts["block"] + parts["head"] + parts["embedding"][:1]  # the tied copy
    psi = max(sum(math.prod(x) for x in rank) for rank in (first, last))
    all_reduce = ring_all_reduce_time(2 * psi, 4, *_ab(intra))
    assert c.communication["dp"] == pytest.approx(all_reduce, rel=1e-12)
    assert configs[1, 1].communication["dp"] == pytest.approx(all_reduce, rel=1e-12)
    assert configs[2, 1].communication["dp"] == pytest.approx((m + 1) * all_reduce / 2)
    assert configs[3, 1].communication["dp"] == pytest.approx(3 * m * all_reduce / 2)


def test_compute_is_the_slowest_stage(small, small_cluster):
    # Every stage runs its blocks; the last also the logits, so it sets the pace.
    techniques = Techniques(tp=(1,), pp=(4,), zero_stages=(0,), micro_batches=(1,),
                            recompute=("none",))  # fmt: skip
    (c,) = plan(small, small_cluster, techniques)
    per_token = 2 * block_flops_per_token(small) + 6 * small.vocab * small.hidden
    rate = small_cluster.peak_flops * small_cluster.efficiency
    tokens = small.global_batch * small.seq_len
    assert c.compute_time == pytest.approx(tokens / c.dp * per_token / rate, rel=1e-12)
    assert train_flops_per_token(small) == 8 * block_flops_per_token(small) + 6 * 32768 * 1024


def test_evaluate_names_what_cannot_be_laid_out(small, small_cluster):
    layout = dict(dp=4, tp=2, pp=2, zero_stage=0, micro_batch=1, recompute="none")
    one = Techniques(dp=(4,), tp=(2,), pp=(2,), zero_stages=(0,), micro_batches=(1,),
                     recompute=("none",))  # fmt: skip
    assert evaluate(small, small_cluster, None, **layout) == plan(small, small_cluster, one)[0]
    for change, name in [
        (dict(dp=2), "dp"),  # 2 x 2 x 2 is not 16 devices
        (dict(tp=16, dp=1, pp=1), "tp"),  # more than a node
        (dict(micro_batch=3), "micro_batch"),  # 4 x 3 does not divide 64
        (dict(pp=1, dp=8, virtual_stages=2), "virtual_stages"),  # no pipeline to interleave
        (dict(virtual_stages=8), "virtual_stages"),  # 2 x 8 chunks for 8 blocks
    ]:
        with pytest.raises(ValueError, match=name):
            evaluate(small, small_cluster, None, **(layout | change))
    tight = dataclasses.replace(small_cluster, memory=1e6)
    assert evaluate(small, tight, None, **layout).bytes_per_device > tight.usable
    assert plan(small, tight, fit=False) and not plan(small, tight)


def test_context_parallelism_fits_a_long_sequence(small, small_cluster):
    # A 128K sequence: one sequence's activations overfill a device (32 GB against 10.8),
    # whatever ZeRO does; 4 context-parallel ranks hold 32K positions each (8.8 GB).
    long = dataclasses.replace(small, seq_len=131072, global_batch=16)
    base = Techniques(tp=(2,), pp=(1,), zero_stages=(1,), micro_batches=(1,),
                      recompute=("selective",), attention="fused", dropout=False)  # fmt: skip
    assert not plan(long, small_cluster, base)
    assert all(c.cp == 1 for c in plan(long, small_cluster, base, fit=False))
    layouts = plan(long, small_cluster, dataclasses.replace(base, cp=(1, 2, 4, 8)))
    assert layouts and {c.cp for c in layouts} <= {4, 8}
    c = next(c for c in layouts if c.cp == 4)
    assert (c.dp, c.tp, c.pp, c.accumulation) == (2, 2, 1, 8)
    # the calculator's bytes at s/cp, the model states partitioned over dp x cp = 8 ranks
    options = dict(attention="fused", dropout=False, recompute="selective")
    expected = gpt_memory(long.shape(1), zero_stage=1, dp=8, tp=2, cp=4, **options)
    assert c.bytes_per_device == pytest.approx(expected["total"], rel=1e-12)
    assert (
        expected["activations"]
        == gpt_memory(
            dataclasses.replace(long, seq_len=32768).shape(1), zero_stage=1, dp=8, tp=2, **options
        )["activations"]
    )
    # per block and micro-batch: ring attention's bytes (2 cp - 1 hops) on NVLink (tp cp = 8
    # devices, one node); the tensor-parallel all-reduces of 32K positions
    from lsdl_lab.distributed.cost import ring_all_reduce_time

    link = small_cluster.link(True)
    sent = layer_traffic(long.shape(1), tp=2, cp=4)["cp"]
    per_micro_batch = long.layers * (7 * link.alpha + sent * link.beta)
    assert c.communication["cp"] == pytest.approx(8 * per_micro_batch, rel=1e-12)
    one = ring_all_reduce_time(2 * 32768 * long.hidden, 2, *_ab(link))
    assert c.communication["tp"] == pytest.approx(4 * long.layers * 8 * one, rel=1e-12)
    # the compute split over tp x cp = 8 devices; the step adds the context's seconds
    rate = small_cluster.peak_flops * small_cluster.efficiency
    tokens = long.global_batch * long.seq_len
    flops = train_flops_per_token(long, "selective")
    assert c.compute_time == pytest.approx(tokens / 2 * flops / (2 * 4 * rate), rel=1e-12)
    comm = c.communication
    assert c.step_time == pytest.approx(c.compute_time + sum(comm.values()), rel=1e-12)
    ulysses = evaluate(
        long,
        small_cluster,
        dataclasses.replace(base, context="ulysses"),
        dp=2,
        tp=2,
        pp=1,
        cp=4,
        zero_stage=1,
        micro_batch=1,
        recompute="selective",
    )
    assert ulysses.communication["cp"] < c.communication["cp"]  # 8 (c-1)/c Q's, not 6 K's
    layout = dict(dp=2, tp=2, pp=1, zero_stage=1, micro_batch=1, recompute="selective")
    for change, techniques in [
        (dict(cp=3, dp=2), base),  # 2 x 2 x 3 is not 16 devices
        (dict(cp=4), dataclasses.replace(base, attention="materialized")),
    ]:
        with pytest.raises(ValueError, match="Invalid (cp|dp)"):
            evaluate(long, small_cluster, techniques, **(layout | change))


def test_fp8_and_8bit_adam_reach_the_calculator(small, small_cluster):
    techniques = Techniques(tp=(2,), pp=(1,), zero_stages=(0,), recompute=("none",),
                            micro_batches=(4,), fp8=True, optimizer="adam8bit")  # fmt: skip
    (c,) = plan(small, small_cluster, techniques)
    expected = gpt_memory(small.shape(4), tp=2, dp=8, fp8=True, optimizer="adam8bit")
    assert c.memory == pytest.approx(expected | {"total": c.bytes_per_device}, rel=1e-12)
    plain = gpt_memory(small.shape(4), tp=2, dp=8)
    assert expected["activations"] < plain["activations"]
    assert expected["optimizer_state"] < 0.6 * plain["optimizer_state"]  # 6 of 12 bytes
    # At one sequence of 1024 tokens the FP8 weights a layer keeps (12 h^2 / t bytes) outweigh
    # the bytes its inputs save (2 sbh + 5 sbh / t): FP8 saves activations at larger b s.
    one = gpt_memory(small.shape(1), tp=2, dp=8, fp8=True)["activations"]
    assert one > gpt_memory(small.shape(1), tp=2, dp=8)["activations"]


def _ab(link):
    return link.alpha, link.beta
