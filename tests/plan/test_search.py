"""The planner's search: its bookkeeping, and its validation on paper against published
layouts and throughputs.

Validation rule: search only the space the published run leaves open (what the paper
fixes, we fix: Megatron-LM 2021 had no ZeRO and ran full recomputation, as its FLOP count
eq. 3 with its factor 96 says; BLOOM fixes ZeRO 1 and micro-batch 2), then require the
published layout ``(dp, tp, pp)`` among the planner's three best layouts and its estimated
throughput within 2x of the published one. Every GPU runs at the same stated efficiency
(conftest.py: 0.5 of peak), never fitted per run. Published throughputs are in TFLOP/s
per GPU counted by each paper's own formula; we convert the estimate with the same count
(:meth:`Config.flops_per_device`).
"""

import pytest

from lsdl_lab.plan import Cluster, ModelShape, Techniques, layout_rank, plan

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
# https://github.com/huggingface/Megatron-LM); the heads, hidden sizes and layers of each
# row (public Megatron-LM tutorials tabulate them; the parameter counts they give match the
# table's to 0.2%, asserted below); 1T parameters at 502 petaFLOP/s on 3072 GPUs = 163
# TFLOP/s per GPU (the paper's abstract, https://huggingface.co/papers/2104.04473). The other
# rows' pp, GPUs, batch and TFLOP/s are the paper's Table 1 as we read it, not re-checked
# (the table is an image in the pages the search reached).
MEGATRON_ROWS = [
    (145.6, 96, 12288, 80, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 64, 3072, 3072, 163),
]


@pytest.mark.parametrize("row", MEGATRON_ROWS, ids=lambda r: f"{r[0]}B")
def test_megatron_table1(row, a100):
    params, heads, hidden, layers, pp, gpus, batch, tflops = row
    model = ModelShape(layers, hidden, heads, 2048, 51200, batch)
    assert model.params / 1e9 == pytest.approx(params, rel=2e-3)
    published = (gpus // (8 * pp), 8, pp)
    rank, ratio, _ = _validate(
        model, Cluster(devices=gpus, **a100), MEGATRON_2021, published, tflops
    )
    # Ranks found: 2, 1, 2, 1; the top layouts differ by < 1% of step time in this model
    # (bubble (pp-1)/m is about devices/(tp x batch) whatever pp), so the rank among them
    # is a tie broken by the small communication terms.
    assert rank <= 3
    # Estimates 132-133 TFLOP/s: 0.81-0.89 of the published figures (efficiency 0.5 is a
    # little low for these large GEMMs; the runs reached 44-52% of peak end to end).
    assert 0.5 <= ratio <= 2


def test_bloom_176b(a100):
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
    model = ModelShape(70, 14336, 112, 2048, 250880, 2048)
    cluster = Cluster(devices=384, **dict(a100, intra_bandwidth=100e9, inter_bandwidth=6.25e9))
    techniques = Techniques(zero_stages=(1,), micro_batches=(2,), recompute=("full",))
    rank, ratio, configs = _validate(model, cluster, techniques, (8, 4, 12), 150)
    assert rank == 1  # found: 1, estimate 126 TFLOP/s, 0.84 of the published
    assert 0.5 <= ratio <= 2
    # The choice hinges on the intra-node link: with a DGX's NVSwitch (300 GB/s) tp = 8
    # would be cheaper, and the planner's first layout would then have tp = 8.
    dgx = Cluster(devices=384, **dict(a100, inter_bandwidth=6.25e9))
    assert plan(model, dgx, techniques, top=1)[0].tp == 8


def test_llama3_405b_expected_miss(a100):
    # Llama 3 405B (Dubey et al. 2024, "The Llama 3 Herd of Models", arXiv 2407.21783,
    # Section 3.3.2, Table 4): 126 layers, hidden 16384, 128 heads, vocabulary 128,000,
    # sequence 8192, 16M tokens per batch (2048 sequences); on 16,384 H100 80GB (8 per
    # server, NVLink inside, 400 Gbps per GPU between: 50 GB/s) tp 8, cp 1, pp 16, dp 128
    # at 400 TFLOP/s per GPU (41% BF16 MFU). Checked: https://ai-papers.xuzou.cn/papers/
    # llama3_2024 (16K H100, 8 per server, NVLink, 400 Gbps). Our GPT (4h MLP, all heads
    # keyed) has 408B parameters for this shape: within 1% of its 405B (SwiGLU, GQA).
    model = ModelShape(126, 16384, 128, 8192, 128000, 2048)
    assert model.params / 1e9 == pytest.approx(405, rel=0.01)
    h100 = dict(a100, intra_bandwidth=450e9, inter_bandwidth=50e9, peak_flops=989e12)
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


def test_every_config_is_consistent_and_sorted(small, small_cluster):
    configs = plan(small, small_cluster)
    assert configs
    usable = small_cluster.memory * (1 - small_cluster.reserve)
    for c in configs:
        assert c.dp * c.tp * c.pp == small_cluster.devices
        assert c.dp * c.micro_batch * c.accumulation == small.global_batch
        assert c.tp <= small_cluster.devices_per_node
        assert c.bytes_per_device <= usable
        assert c.bubble == (c.pp - 1) / c.accumulation
        total = c.compute_time * (1 + c.bubble) + sum(c.communication.values())
        assert c.step_time == pytest.approx(total, rel=1e-12)
        assert c.tokens_per_second == pytest.approx(
            small.global_batch * small.seq_len / c.step_time
        )
    times = [c.step_time for c in configs]
    assert times == sorted(times)
    assert plan(small, small_cluster, top=3) == configs[:3]


def test_nothing_fits_gives_an_empty_plan(small, a100):
    tiny = Cluster(devices=2, **dict(a100, memory=1e6))
    assert plan(small, tiny) == []


def test_plan_refuses_what_is_not_its_input(small, small_cluster):
    with pytest.raises(TypeError, match="model"):
        plan("gpt", small_cluster)
    with pytest.raises(TypeError, match="cluster"):
        plan(small, None)
    with pytest.raises(TypeError, match="techniques"):
        plan(small, small_cluster, "zero")
    with pytest.raises(ValueError, match="top"):
        plan(small, small_cluster, top=0)
