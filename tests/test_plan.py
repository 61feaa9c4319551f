"""The planner: its bookkeeping, its agreement with the book's memory and cost models, and
its validation on paper against published layouts and throughputs.

Validation rule: search only the space the published run leaves open (what the paper
fixes, we fix: Megatron-LM 2021 had no ZeRO and ran full recomputation, as its FLOP count
eq. 3 with its factor 96 says; BLOOM fixes ZeRO 1 and micro-batch 2), then require the
published layout ``(dp, tp, pp)`` among the planner's three best layouts and its estimated
throughput within 2x of the published one. The efficiency of every A100 is the same stated
0.5 of the 312 TFLOP/s bf16 peak (H100: 0.5 of 989), never fitted per run.
Published throughputs are in TFLOP/s per GPU counted by each paper's own formula; we
convert the estimate with the same count (:meth:`Config.flops_per_device`).

Hardware assumed (vendor figures): an A100 node (DGX A100, Selene) has NVSwitch, 300 GB/s
per GPU and direction, and one 200 Gb/s HDR InfiniBand adapter per GPU (25 GB/s); NVLink
latency 5 us, network 10 us (typical NCCL small-message latencies, an assumption).
"""

import math

import pytest

from lsdl_lab.dist.cost import AlphaBeta, ring_all_reduce_time
from lsdl_lab.memory.calculator import gpt_memory, gpt_param_shapes
from lsdl_lab.plan import (
    Cluster,
    Model,
    Techniques,
    lab_cluster,
    layout_rank,
    plan,
    plan_lab,
    train_flops_per_token,
)

A100 = dict(
    devices_per_node=8,
    memory=80e9,
    intra_bandwidth=300e9,
    intra_latency=5e-6,
    inter_bandwidth=25e9,
    inter_latency=10e-6,
    peak_flops=312e12,
    efficiency=0.5,
)
MEGATRON_2021 = Techniques(zero_stages=(0,), recompute=("full",))


def _validate(model, cluster, techniques, published, tflops, count="full"):
    configs = plan(model, cluster, techniques)
    rank = layout_rank(configs, *published)
    best = next(c for c in configs if (c.dp, c.tp, c.pp) == published)
    estimate = best.flops_per_device(model, count) / 1e12
    return rank, estimate / tflops, configs


# Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
# Using Megatron-LM" (SC21, arXiv 2104.04473), Table 1: GPT models, vocabulary 51,200,
# sequence 2048, tensor parallelism 8 inside DGX A100 nodes. Rows: (params, heads, hidden,
# layers, pp, GPUs, batch, TFLOP/s per GPU). Checked with the search tool: vocabulary,
# sequence length and up to 3072 A100s (Megatron-LM README, e.g.
# https://github.com/huggingface/Megatron-LM), 1T parameters at 502 petaFLOP/s on 3072 GPUs
# = 163 TFLOP/s per GPU (https://redlib.fmhy.net/r/mlscaling, the paper's abstract); the
# other rows' figures are the paper's table as we read it (the table is an image in the
# pages the search reached).
MEGATRON_ROWS = [
    (145.6, 96, 12288, 80, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 64, 3072, 3072, 163),
]


@pytest.mark.parametrize("row", MEGATRON_ROWS, ids=lambda r: f"{r[0]}B")
def test_megatron_table1(row):
    params, heads, hidden, layers, pp, gpus, batch, tflops = row
    model = Model(layers, hidden, heads, 2048, 51200, batch)
    assert model.params / 1e9 == pytest.approx(params, rel=2e-3)
    published = (gpus // (8 * pp), 8, pp)
    rank, ratio, _ = _validate(
        model, Cluster(devices=gpus, **A100), MEGATRON_2021, published, tflops
    )
    # Ranks found: 2, 1, 2, 1; the top layouts differ by < 1% of step time in this model
    # (bubble (pp-1)/m is about devices/(tp x batch) whatever pp), so the rank among them
    # is a tie broken by the small communication terms.
    assert rank <= 3
    # Estimates 132-133 TFLOP/s: 0.81-0.89 of the published figures (efficiency 0.5 is a
    # little low for these large GEMMs; the runs reached 44-52% of peak end to end).
    assert 0.5 <= ratio <= 2


def test_bloom_176b():
    # BLOOM-176B (BigScience 2022; Le Scao et al. 2022, arXiv 2211.05100): 70 layers,
    # hidden 14336, 112 heads, sequence 2048, vocabulary 250,680 (padded to 250,880 in
    # Megatron-DeepSpeed, a multiple of tp x 128), global batch 2048; 384 A100 80GB in 48
    # nodes; one replica on 48 GPUs (tp 4 x pp 12, so dp 8), ZeRO stage 1, "about 150
    # TFLOPs" per GPU. Checked: https://bigscience.notion.site/BigScience-176B-Model-
    # ad073ca07cdf479398d5f95d88e218c4 (384 GPUs, 48 per replica, 150 TFLOPs) and
    # https://ai-papers.xuzou.cn/papers/bloom_2022 (48 nodes of 8, "four NVLink GPU-to-GPU
    # interconnects", four 100 Gbps Omni-Path links per node). Micro-batch 2 and full
    # recomputation are the training script's (tr11-176B-ml, as we read it, not rechecked).
    # Links: 4 NVLink3 links x 25 GB/s = 100 GB/s per GPU and direction inside a node, 4 x
    # 100 Gbps / 8 GPUs = 6.25 GB/s per GPU between nodes.
    model = Model(70, 14336, 112, 2048, 250880, 2048)
    cluster = Cluster(devices=384, **dict(A100, intra_bandwidth=100e9, inter_bandwidth=6.25e9))
    techniques = Techniques(zero_stages=(1,), micro_batches=(2,), recompute=("full",))
    rank, ratio, configs = _validate(model, cluster, techniques, (8, 4, 12), 150)
    assert rank == 1  # found: 1, estimate 126 TFLOP/s, 0.84 of the published
    assert 0.5 <= ratio <= 2
    # The choice hinges on the intra-node link: with a DGX's NVSwitch (300 GB/s) tp = 8
    # would be cheaper, and the planner's first layout would then have tp = 8.
    dgx = Cluster(devices=384, **dict(A100, inter_bandwidth=6.25e9))
    assert plan(model, dgx, techniques, top=1)[0].tp == 8


def test_llama3_405b_expected_miss():
    # Llama 3 405B (Dubey et al. 2024, "The Llama 3 Herd of Models", arXiv 2407.21783,
    # Section 3.3.2, Table 4): 126 layers, hidden 16384, 128 heads, vocabulary 128,000,
    # sequence 8192, 16M tokens per batch (2048 sequences); on 16,384 H100 80GB (8 per
    # server, NVLink inside, 400 Gbps per GPU between: 50 GB/s) tp 8, cp 1, pp 16, dp 128
    # at 400 TFLOP/s per GPU (41% BF16 MFU). Checked: https://ai-papers.xuzou.cn/papers/
    # llama3_2024 (16K H100, 8 per server, NVLink, 400 Gbps). Our GPT (4h MLP, all heads
    # keyed) has 408B parameters for this shape: within 1% of its 405B (SwiGLU, GQA).
    model = Model(126, 16384, 128, 8192, 128000, 2048)
    assert model.params / 1e9 == pytest.approx(405, rel=0.01)
    h100 = dict(A100, intra_bandwidth=450e9, inter_bandwidth=50e9, peak_flops=989e12)
    techniques = Techniques(micro_batches=(1,))
    rank, ratio, _ = _validate(
        model, Cluster(devices=16384, **h100), techniques, (128, 8, 16), 400, count="none"
    )
    assert rank <= 3  # found: 3
    # Expected deviation: the estimate, 174 TFLOP/s (model FLOPs), is 0.44 of the
    # published 400, outside 2x. With m = 16 micro-batches and pp = 16, the 1F1B bubble
    # (pp-1)/m is 0.94 in this model; Llama 3 runs an interleaved schedule (Narayanan et
    # al. 2021, Section 2.2.2) whose v virtual stages divide the bubble by v, which the
    # planner does not model. Should the planner learn it, this test must be revisited.
    assert 1 / 3 < ratio < 1 / 2


def test_flops_count_is_narayanan_eq3():
    model = Model(96, 12288, 96, 2048, 51200, 1536)
    B, s, L, h, V = 1536, 2048, 96, 12288, 51200
    paper = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    assert train_flops_per_token(model, "full") * B * s == pytest.approx(paper, rel=1e-12)
    none = train_flops_per_token(model, "none")
    assert none == pytest.approx(72 * L * h * h * (1 + s / (6 * h)) + 6 * V * h, rel=1e-12)
    assert none < train_flops_per_token(model, "selective") < train_flops_per_token(model, "full")


SMALL = Model(layers=8, hidden=1024, heads=16, seq_len=1024, vocab=32768, global_batch=64)
SMALL_CLUSTER = Cluster(devices=16, memory=12e9, **{k: v for k, v in A100.items() if k != "memory"})


def test_every_config_is_consistent_and_sorted():
    configs = plan(SMALL, SMALL_CLUSTER)
    assert configs
    usable = SMALL_CLUSTER.memory * (1 - SMALL_CLUSTER.reserve)
    for c in configs:
        assert c.dp * c.tp * c.pp == SMALL_CLUSTER.devices
        assert c.dp * c.micro_batch * c.accumulation == SMALL.global_batch
        assert c.tp <= SMALL_CLUSTER.devices_per_node
        assert c.bytes_per_device <= usable
        assert c.bubble == (c.pp - 1) / c.accumulation
        total = c.compute_time * (1 + c.bubble) + sum(c.communication.values())
        assert c.step_time == pytest.approx(total, rel=1e-12)
        assert c.tokens_per_second == pytest.approx(
            SMALL.global_batch * SMALL.seq_len / c.step_time
        )
    times = [c.step_time for c in configs]
    assert times == sorted(times)
    assert plan(SMALL, SMALL_CLUSTER, top=3) == configs[:3]


def test_memory_without_pipeline_is_the_calculators():
    techniques = Techniques(pp=(1,), tp=(2,))
    for c in plan(SMALL, SMALL_CLUSTER, techniques):
        expected = gpt_memory(
            SMALL.shape(c.micro_batch),
            zero_stage=c.zero_stage,
            dp=c.dp,
            tp=c.tp,
            recompute=c.recompute,
        )
        assert c.bytes_per_device == pytest.approx(expected["total"], rel=1e-12)


def test_pipeline_first_stage_holds_pp_micro_batches():
    # 1F1B: the first stage keeps up to pp micro-batches of its layers/pp blocks, so the
    # activations of the blocks are the whole model's for one micro-batch (pp <= m).
    techniques = Techniques(tp=(1,), pp=(4,), zero_stages=(0,), micro_batches=(1,))
    (c,) = [c for c in plan(SMALL, SMALL_CLUSTER, techniques) if c.recompute == "none"]
    whole = gpt_memory(SMALL.shape(1), recompute="none")["activations"]
    assert c.memory["activations"] == pytest.approx(whole, rel=1e-12)
    assert c.memory["params"] == pytest.approx(
        2 * sum(math.prod(s) for s in gpt_param_shapes(SMALL.shape(1, 2))), rel=1e-12
    )


def test_nothing_fits_gives_an_empty_plan():
    tiny = Cluster(devices=2, memory=1e6, **{k: v for k, v in A100.items() if k != "memory"})
    assert plan(SMALL, tiny) == []


def test_bad_inputs_are_named():
    with pytest.raises(TypeError, match="model"):
        plan("gpt", SMALL_CLUSTER)
    with pytest.raises(TypeError, match="cluster"):
        plan(SMALL, None)
    with pytest.raises(ValueError, match="global_batch"):
        Model(2, 64, 4, 16, 100, 0)
    with pytest.raises(ValueError, match="efficiency"):
        Cluster(devices=8, **dict(A100, efficiency=1.5))
    with pytest.raises(ValueError, match="devices"):
        Cluster(devices=12, **A100)
    with pytest.raises(ValueError, match="recompute"):
        Techniques(recompute=("some",))
    with pytest.raises(ValueError, match="zero_stages"):
        Techniques(zero_stages=(4,))
    with pytest.raises(ValueError, match="top"):
        plan(SMALL, SMALL_CLUSTER, top=0)


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
