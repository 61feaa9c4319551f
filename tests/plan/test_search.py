"""The planner's search: its bookkeeping, and the planner held to every published run we
can source: Megatron-LM's Table 1 and its GPT-3 175B rows of Table 2 (Narayanan et al.
2021), MT-NLG 530B (Smith et al. 2022), BLOOM-176B (Le Scao et al. 2022 and its training
notes), OPT-175B (Zhang et al. 2022 and its logbook's notes), Llama 3 405B (Dubey et al.
2024).

Each paper's numbers are recorded here beside their table or section, and checked
against the runs Chapter 9 tabulates (:func:`lsdl_lab.book.planning.published_runs`).
The rule: what the paper fixes, we fix (its framework's choices: ZeRO stage, recomputation,
precision, attention, ...); the planner chooses what it leaves open (the micro-batch, the
interleaved schedule's chunks where unstated) and ranks the published degrees ``(dp, tp,
pp)`` among its own. Every GPU runs at one stated efficiency, half of its peak
(:data:`~lsdl_lab.book.planning.EFFICIENCY`), chosen before the comparison and never
fitted per run. Published throughputs are per GPU, counted by each paper's own formula; the
estimate is converted with the same count (:meth:`Layout.flops_per_device`). The
assertions are what Chapter 9 says of the table it prints.
"""

import dataclasses
import math

import pytest

from lsdl_lab.book.planning import EFFICIENCY, held_to, published_runs
from lsdl_lab.memory.calculator import activation_parts, gpt_param_shapes
from lsdl_lab.memory.zero import zero_bytes
from lsdl_lab.plan import Cluster, ModelShape, in_flight, plan, train_flops_per_token

# -- the papers' numbers ------------------------------------------------------------------

# Narayanan et al. 2021, Table 1 (vocabulary 51,200, sequence 2048; Selene's DGX A100 80 GB
# nodes, Section 5): billions of parameters, attention heads, hidden size, layers, tensor-
# and pipeline-parallel size, GPUs, batch size, achieved TFLOP/s per GPU. Checked with the
# search tool against two independent transcriptions of the table.
NARAYANAN_TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
# Narayanan et al. 2021, Table 2, the 174.6B (GPT-3) rows, batch 1536: scheme,
# model-parallel size, GPUs, micro-batch, TFLOP/s per GPU. PTD-P's model-parallel size 96
# is t = 8 in a node times p = 12 (our reading: Table 2 gives the product).
NARAYANAN_TABLE2 = [
    ("ZeRO-3", 1, 384, 4, 144),
    ("ZeRO-3", 1, 768, 2, 88),
    ("ZeRO-3", 1, 1536, 1, 44),
    ("PTD-P", 96, 384, 1, 153),
    ("PTD-P", 96, 768, 1, 149),
    ("PTD-P", 96, 1536, 1, 141),
]
# Smith et al. 2022 (MT-NLG), Sections 2.3-2.4 and 3: 105 layers, hidden 20480, 128 heads,
# sequence 2048, batch 1920; 8-way tensor, 35-way pipeline parallelism; DGX A100 servers,
# seconds an iteration, TFLOP/s per GPU.
SMITH_2022 = [(280, 60.1, 126), (350, 50.2, 121), (420, 44.4, 113)]
# BLOOM-176B: the training README (bigscience-workshop/bigscience, train/tr11-176B-ml):
# NLAYERS=70, NHIDDEN=14336, NHEADS=112, SEQ_LEN=2048, --pad-vocab-size-to 250880,
# GLOBAL_BATCH_SIZE=2048, TP=4, PP=12, DP=8, MBS=2, 384 A100 80GB (48 nodes), ZeRO stage 1
# (the BF16_Optimizer's), --checkpoint-activations, "~150 TFLOPs per GPU" (149.77 logged at
# the end of the first epoch). Its chronicles-prequel.md measured 59 GB on the busiest GPU
# for this very shape and layout ("Rebalancing layers", NHIDDEN=14336, NLAYERS=70, 112
# heads: 59GB, 104.50 s/it, 150.05 TFLOPs).
BLOOM = dict(layers=70, hidden=14336, heads=112, vocab=250880, batch=2048, gpus=384,
             layout=(8, 4, 12), micro_batch=2, tflops=150, measured_bytes=59e9)  # fmt: skip
# Zhang et al. 2022 (OPT), Table 1 and Section 2.4: 96 layers, 96 heads, hidden 12288,
# 992 A100 80 GB, FSDP with Megatron-LM tensor parallelism, "up to 147 TFLOP/s per GPU";
# the logbook's 10% note: "8x Tensor Parallelism"; the released checkpoint: 124 shards of
# each of the 8 model parts (projects/OPT/assets/opt175b_md5sum_shards.csv), dp = 124.
OPT = dict(layers=96, hidden=12288, heads=96, gpus=992, layout=(124, 8, 1), tflops=147)
# Dubey et al. 2024 (Llama 3), Table 3 (405B: 126 layers, model dimension 16,384, FFN
# 53,248, 128 attention heads, 8 key/value heads, vocabulary 128,000) and Table 4: GPUs,
# TP, CP, PP, DP, sequence length, batch size per DP group, TFLOP/s per GPU, BF16 MFU.
LLAMA3_TABLE4 = [
    (8192, 8, 1, 16, 64, 8192, 32, 430, 0.43),
    (16384, 8, 1, 16, 128, 8192, 16, 400, 0.41),
]

RUNS = published_runs()
HELD = {id(r): held_to(r) for r in RUNS}


def _runs(prefix):
    return [r for r in RUNS if r.name.startswith(prefix)]


def test_the_book_tabulates_the_papers_numbers():
    megatron = _runs("Megatron-LM")
    assert len(megatron) == len(NARAYANAN_TABLE1)
    for run, (params, heads, hidden, layers, tp, pp, gpus, batch, tflops) in zip(
        megatron, NARAYANAN_TABLE1, strict=True
    ):
        m = run.model
        assert (m.heads, m.hidden, m.layers, m.seq_len, m.vocab) == (
            heads,
            hidden,
            layers,
            2048,
            51200,
        )
        assert (m.global_batch, run.cluster.devices, run.tflops) == (batch, gpus, tflops)
        assert run.layout == (gpus // (tp * pp), tp, pp) and run.count == "full"
        assert round(m.params / 1e9, 1) == params  # the paper's eq. 2, to its one decimal
    table2 = _runs("GPT-3 175B, ZeRO-3") + _runs("GPT-3 175B, PTD-P")
    for run, (scheme, mp, gpus, b, tflops) in zip(table2, NARAYANAN_TABLE2, strict=True):
        assert run.name.endswith(scheme) and run.model.params / 1e9 == pytest.approx(
            174.6, rel=2e-3
        )
        assert (run.cluster.devices, run.techniques.micro_batches, run.tflops) == (
            gpus,
            (b,),
            tflops,
        )
        assert run.layout[1] * run.layout[2] == mp and run.model.global_batch == 1536
    for run, (nodes, seconds, tflops) in zip(_runs("MT-NLG"), SMITH_2022, strict=True):
        m = run.model
        assert (m.layers, m.hidden, m.heads, m.global_batch) == (105, 20480, 128, 1920)
        assert run.layout == (nodes // 35, 8, 35) and run.tflops == tflops
        # the paper's TFLOP/s are eq. 3's FLOPs (with the recomputation) over its times
        flops = train_flops_per_token(m, "full") * 1920 * 2048
        assert flops / seconds / (8 * nodes) / 1e12 == pytest.approx(tflops, rel=0.01)
    (bloom,) = _runs("BLOOM")
    m = bloom.model
    assert (m.layers, m.hidden, m.heads, m.vocab, m.global_batch) == tuple(
        BLOOM[k] for k in ("layers", "hidden", "heads", "vocab", "batch")
    )
    assert (bloom.cluster.devices, bloom.layout, bloom.tflops) == (
        BLOOM["gpus"],
        BLOOM["layout"],
        BLOOM["tflops"],
    )
    assert bloom.techniques.micro_batches == (BLOOM["micro_batch"],)
    # the paper's 176,247M parameters: ours less the learned positions BLOOM (ALiBi) has not
    assert (m.params - 2048 * 14336) / 1e6 == pytest.approx(176_247, abs=1)
    (opt,) = _runs("OPT")
    assert (opt.model.layers, opt.model.hidden, opt.model.heads) == (96, 12288, 96)
    assert (opt.cluster.devices, opt.layout, opt.tflops) == (
        OPT["gpus"],
        OPT["layout"],
        OPT["tflops"],
    )
    llama = _runs("Llama 3")
    for run, (gpus, tp, cp, pp, dp, seq, per_dp, tflops, mfu) in zip(
        llama, LLAMA3_TABLE4, strict=True
    ):
        m = run.model
        assert (m.layers, m.hidden, m.heads, m.kv_heads, m.ffn, m.vocab) == (
            126, 16384, 128, 8, 53248, 128000)  # fmt: skip
        assert cp == 1 and (m.seq_len, m.global_batch) == (seq, dp * per_dp)
        assert run.cluster.devices == gpus == dp * tp * pp
        assert run.layout == (dp, tp, pp) and run.tflops == tflops and run.count == "none"
        assert tflops / 989 == pytest.approx(mfu, abs=0.006)  # MFU of the H100's 989
        assert m.params / 1e9 == pytest.approx(405, rel=0.005)
    # one efficiency for every GPU and every run, not fitted per run
    assert {r.cluster.efficiency for r in RUNS} == {EFFICIENCY} == {0.5}


def test_memory_fits_every_published_layout_but_llama3s():
    # Chapter 9: every published layout fits the planner's 72 of 80 GB, except Llama 3's:
    # 75 GB at 16K GPUs (over the planner's 72, within the device's 80) and 82 GB at 8K
    # (over the device), counted with Megatron-LM's interleaved warm-up.
    for run in RUNS:
        held = HELD[id(run)]
        assert held["fits"] == (not run.name.startswith("Llama 3")), run.name
    eight, sixteen = (HELD[id(r)] for r in _runs("Llama 3"))
    assert 72e9 < sixteen["bytes"] < 80e9 < eight["bytes"] < 85e9
    # the second stage: eight one-layer chunks; Megatron-LM's warm-up keeps all 16
    # micro-batches of them at 16K GPUs (1F1B: 15), 141 chunks at 8K (m = 32)
    assert sixteen["layout"].stage == eight["layout"].stage == 1
    assert sum(in_flight(16, 8, 16, 1)) == 16 * 8 and in_flight(16, 1, 16, 1) == (15,)
    assert sum(in_flight(16, 8, 32, 1)) == 141
    # No layout at all of Llama 3's techniques (no recomputation, v = 8) fits in 72 GB.
    for run in _runs("Llama 3"):
        assert not plan(run.model, run.cluster, run.techniques)


def test_llama3s_old_miss_was_memory_not_interleaving():
    # The planner before it knew fused attention, sequence parallelism and Llama's blocks
    # put the published layout at 919 GB a GPU: ceil(126/16) = 8 blocks on its first stage,
    # 16 micro-batches of them in flight, each layer's s x s scores, dropout masks and whole
    # LayerNorm inputs on every tensor-parallel rank, and ZeRO-2's model states. The same
    # count with fused attention and sequence parallelism (the calculator's switches): 81 GB.
    # With them and the rest of Llama 3's run, the planner now counts 75 GB (above).
    run = _runs("Llama 3")[1]
    gpt = ModelShape(126, 16384, 128, 8192, 128000, 2048)
    shape = gpt.shape(1, layers=8)
    states = zero_bytes(sum(math.prod(x) for x in gpt_param_shapes(shape, 8)), 2, 128)["total"]
    parts = activation_parts(gpt.shape(1), tp=8)
    one = activation_parts(gpt.shape(1), tp=8, attention="fused", sequence_parallel=True)
    legacy = states + 16 * 8 * parts["layer"] + parts["embedding"] + parts["output"]
    both = states + 16 * 8 * one["layer"] + one["embedding"] + one["output"]
    assert legacy / 1e9 == pytest.approx(919, abs=1) and both / 1e9 == pytest.approx(81, abs=1)
    assert HELD[id(run)]["bytes"] < both


def test_the_published_degrees_are_among_the_planners_first():
    # Chapter 9: among the layouts that fit, the published degrees rank at most 7th (first
    # for 10 of the 21 runs that fit), and the planner estimates their step within 5% of
    # its best, except ZeRO-3 on 1,536 GPUs (18%: the comparison Narayanan et al. made to
    # show ZeRO-3's cost). By time alone, memory aside, they rank as far as 27th: memory is
    # what singles them out.
    fitting = [r for r in RUNS if HELD[id(r)]["fits"]]
    ranks = [HELD[id(r)]["rank"] for r in fitting]
    assert len(fitting) == 21 and max(ranks) == 7 and ranks.count(1) == 10
    for run in fitting:
        held = HELD[id(run)]
        assert held["rank"] <= held["rank_by_time"], run.name
        if run.name == "GPT-3 175B, ZeRO-3" and run.cluster.devices == 1536:
            assert 0.15 < held["gap"] < 0.2
        else:
            assert held["gap"] < 0.05, run.name
    assert max(HELD[id(r)]["rank_by_time"] for r in fitting) == 27
    # Llama 3: the time model agrees (its degrees first or second); memory rejects them.
    assert [HELD[id(r)]["rank_by_time"] for r in _runs("Llama 3")] == [2, 1]


def test_estimated_throughput_against_the_published():
    # Chapter 9: within 20% of the published throughput (0.81-1.08) for every run but
    # ZeRO-3 on 768 and 1,536 GPUs, which the planner overestimates 1.6x: it lets ZeRO-3's
    # collectives run under the compute, and the published times show they did not.
    for run in RUNS:
        ratio = HELD[id(run)]["ratio"]
        if run.name == "GPT-3 175B, ZeRO-3" and run.cluster.devices > 384:
            assert 1.5 < ratio < 1.7, run.name
        else:
            assert 0.8 <= ratio <= 1.1, (run.name, ratio)
    # The largest Megatron-LM models are underestimated most (0.81); Llama 3's layout, as
    # it ran, whatever the planner's memory says, 0.89 and 0.90.
    lowest = sorted(RUNS, key=lambda r: HELD[id(r)]["ratio"])[:2]
    assert {r.name for r in lowest} == {"Megatron-LM 529.6B", "Megatron-LM 1008B"}
    for run in _runs("Llama 3"):
        assert 0.88 < HELD[id(run)]["ratio"] < 0.91
    # Without the overlap, the planner's estimate is the other bound: the published
    # throughput lies between the two at 384 and 768 GPUs, and at 1,536 below both,
    # within 10% of the no-overlap bound.
    for run in _runs("GPT-3 175B, ZeRO-3"):
        apart = dataclasses.replace(run.techniques, overlap=False)
        dp, tp, pp = run.layout
        (layout,) = plan(
            run.model, run.cluster, dataclasses.replace(apart, dp=(dp,), tp=(tp,), pp=(pp,))
        )
        low = layout.flops_per_device(run.model, "full") / 1e12
        high = HELD[id(run)]["estimate"]
        if run.cluster.devices < 1536:
            assert low < run.tflops < high, run.cluster.devices
        else:
            assert run.tflops < low < 1.1 * run.tflops


def test_the_efficiency_scales_the_estimates_not_the_ranks():
    # Chapter 9: between 40% and 60% of peak, every ratio moves within 4% of in proportion
    # to the efficiency, but those of the runs bound by communication (ZeRO-3 on 768 and
    # 1,536 GPUs, Llama 3), and no rank moves by more than two.
    for efficiency in (0.4, 0.6):
        for run in RUNS:
            cluster = dataclasses.replace(run.cluster, efficiency=efficiency)
            held, base = held_to(dataclasses.replace(run, cluster=cluster)), HELD[id(run)]
            scale = held["ratio"] / base["ratio"] / (efficiency / EFFICIENCY)
            bound = run.name.startswith("Llama 3") or (
                run.name.endswith("ZeRO-3") and run.cluster.devices > 384
            )
            if bound:
                assert abs(scale - 1) > 0.04, run.name  # communication does not scale
            else:
                assert abs(scale - 1) < 0.04, (run.name, efficiency, scale)
            if base["rank"] is not None:
                assert abs(held["rank"] - base["rank"]) <= 2, run.name


def test_bloom_memory_against_its_measurement():
    # Chapter 9: the planner counts 46 GB on BLOOM's busiest GPU, with the float32 gradient
    # buffer of DeepSpeed's BF16_Optimizer (6 bytes a parameter with the bf16 gradients);
    # the team measured 59 GB (nvidia-smi): 13 GB the calculator does not count (a layer's
    # activations rebuilt in the backward pass, the CUDA context, the allocator's cache).
    (bloom,) = _runs("BLOOM")
    held = HELD[id(bloom)]
    assert 45e9 < held["bytes"] < 47e9 and held["layout"].memory["grads"] > 6 * 3.6e9
    gap = BLOOM["measured_bytes"] - held["bytes"]
    assert 12e9 < gap < 14e9 and gap > bloom.cluster.memory - bloom.cluster.usable
    rebuilt = activation_parts(bloom.model.shape(2), tp=4)["layer"]  # a recomputed layer's
    assert rebuilt / 1e9 == pytest.approx(2.1, abs=0.05)
    # 4 of the 6 bytes a parameter are the float32 buffer, kept whole under ZeRO-1
    as_16_bit = dataclasses.replace(bloom.techniques, grad_bytes=None)
    dp, tp, pp = bloom.layout
    one = dataclasses.replace(as_16_bit, dp=(dp,), tp=(tp,), pp=(pp,))
    (old,) = plan(bloom.model, bloom.cluster, one)
    grads = held["layout"].memory["grads"]
    assert grads == pytest.approx(3 * old.memory["grads"], rel=1e-12)
    assert held["bytes"] - old.bytes_per_device == pytest.approx(grads * 4 / 6, rel=1e-9)
    assert grads * 4 / 6 / 1e9 == pytest.approx(16, abs=0.1)


def test_every_config_is_consistent_and_sorted(small, small_cluster):
    configs = plan(small, small_cluster)
    assert configs
    usable = small_cluster.memory * (1 - small_cluster.reserve)
    for c in configs:
        assert c.dp * c.tp * c.pp == small_cluster.devices
        assert c.dp * c.micro_batch * c.accumulation == small.global_batch
        assert c.tp <= small_cluster.devices_per_node
        assert c.bytes_per_device <= usable
        assert c.bubble == (c.pp - 1) / (c.virtual_stages * c.accumulation)
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
