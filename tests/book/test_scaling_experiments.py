"""Chapter 10's workers at toy sizes, in one world of 2 and one of 3, every worker of
lsdl_lab.book.scaling_experiments run in each: the all-to-all equals torch's on uneven
splits, every all-reduce equals dist.all_reduce and its busiest rank sends the bytes of its
formula; the expert-parallel MoE equals the one-process layer with its bytes; sequence
parallelism equals tensor parallelism with the same ring bytes and fewer saved
activations; ring attention and Ulysses equal full attention and send their formulas'
bytes; DiLoCo and local SGD hand the collectives 1/H of DDP's bytes. The one-process MoE
against dense run is checked on a tiny corpus."""

import functools
import math

import pytest
import torch

from lsdl_lab.book import scaling_experiments as E
from lsdl_lab.data.text import TextData
from lsdl_lab.distributed import call_each, spawn
from lsdl_lab.distributed.traffic import Call

NBYTES = [1_200, 48_000]  # multiples of 4 p bytes at p = 2, 3 (and 4): even float chunks
SHARDS = [12, 24]  # at least 2 head_dim (4): a block of scores outgrows k and v
STEPS, PERIOD = 32, 8


@pytest.fixture(scope="module", params=[2, 3], ids=lambda p: f"world{p}")
def world(request):
    p = request.param
    runs = [
        functools.partial(E.collectives_report, nbytes=NBYTES, repeats=1, local_size=None),
        functools.partial(E.moe_report, capacity_factors=(1.0, 2.0 * p), experts=2 * p, tokens=24),
        functools.partial(E.long_sequence_report, shard_lengths=SHARDS, dim=24, heads=6, seq=12),
        functools.partial(E.diloco_report, steps=STEPS, period=PERIOD, hidden=8, batch=8, evals=4),
    ]
    return p, spawn(call_each, p, runs, timeout=180)


def test_all_to_all_equals_torchs_on_uneven_splits(world):
    p, ranks = world
    for rank, (coll, *_) in enumerate(ranks):
        a2a = coll["all_to_all"]
        assert a2a["equal"]
        assert a2a["send_splits"] == E._uneven_splits(p, rank)
        assert a2a["send_splits"] != [a2a["send_splits"][0]] * p  # uneven indeed
        # p - 1 messages (its own block stays), the bytes of every other rank's block
        assert a2a["messages"] == p - 1
        assert a2a["sent_bytes"] == a2a["bytes_for_others"] > 0
    # the even all-to-all: (p - 1)/p of a rank's input leaves it
    n = NBYTES[-1] - NBYTES[-1] % (4 * p)
    assert ranks[0][0]["sent"]["all-to-all"] == [(p - 1) * n // p]


def test_all_reduces_equal_the_builtin_and_send_their_formulas_bytes(world):
    p, ranks = world
    coll = ranks[0][0]
    assert set(coll["errors"]) == {"ring", "recursive doubling", "Rabenseifner", "binary tree"}
    assert all(e < 1e-12 for e in coll["errors"].values()), coll["errors"]
    q = 1 << (p.bit_length() - 1)
    fold = p != q
    sent = coll["sent"]
    assert sent["ring"] == [2 * (p - 1) * n // p for n in NBYTES]
    assert sent["recursive doubling"] == [(int(math.log2(q)) + fold) * n for n in NBYTES]
    assert sent["Rabenseifner"] == [2 * (q - 1) * n // q + fold * n for n in NBYTES]
    assert sent["binary tree"] == [(p - 1).bit_length() * n for n in NBYTES]
    assert all(r[0]["sent"] == sent for r in ranks)  # the busiest rank's, on every rank
    for name, secs in coll["seconds"].items():
        assert len(secs) == len(NBYTES) and all(s > 0 for s in secs), name


def test_hierarchical_all_reduce_at_world_four():
    nbytes = [4_800]
    report = spawn(E.collectives_report, 4, nbytes, 1, 2, timeout=180)[0]
    assert report["errors"]["hierarchical"] < 1e-12
    # within a node of 2: n/2 out, n/2 back; across the 2 nodes: a ring of n/2 (n/2 out)
    assert report["sent"]["hierarchical"] == [3 * nbytes[0] // 2]
    assert report["sent"]["Rabenseifner"] == report["sent"]["ring"] == [3 * nbytes[0] // 2]


def test_expert_parallel_moe_equals_the_one_process_layer(world):
    p, ranks = world
    for _, moe, *_ in ranks:
        tight, loose = moe[1.0], moe[2.0 * p]
        for run in (tight, loose):
            assert run["output_error"] < 1e-12 and run["input_grad_error"] < 1e-12, run
            assert run["expert_grad_error"] < 1e-12, run
            assert run["bytes_forward"] == run["bytes_forward_formula"]
            assert run["bytes_backward"] == run["bytes_backward_formula"]
            assert run["wire_bytes"] == run["wire_formula"]
            assert sum(run["routed"]) == run["assignments"] == 24
            assert run["dropped"] == sum(run["routed"]) - sum(run["kept"])
            assert len(run["sent_rows"]) == p
            assert sum(run["sent_rows"]) == sum(run["kept"])
        # a factor of E (every token fits any expert) drops nothing; 1.0 drops some here
        assert loose["dropped"] == 0 and loose["capacity"] == 24
        assert tight["capacity"] == math.ceil(24 / (2 * p))
        assert tight["dropped"] == sum(max(0, n - tight["capacity"]) for n in tight["routed"])


def test_sequence_parallelism_and_context_parallelism(world):
    p, ranks = world
    for _, _, seq, _ in ranks:
        tp, sp = seq["sequence"]["tensor"], seq["sequence"]["sequence"]
        for run in (tp, sp):
            assert max(run[k] for k in run if k.endswith("error")) < 1e-12, run
        assert tp["calls"] == ["all_reduce"]
        assert all(c.startswith(("all_gather", "reduce_scatter")) for c in sp["calls"])
        assert len(sp["calls"]) == 2
        # two all-reduces of the (B, T, d) activations a pass, 2 (p-1)/p of each on a ring;
        # the all-gathers and reduce-scatters of sequence parallelism add up to the same
        activations = 2 * 12 * 24 * 8
        assert tp["ring_bytes"] == (2 * 2 * (p - 1) / p * activations,) * 2
        assert sp["ring_bytes"] == tp["ring_bytes"]
        # two LayerNorms' inputs (B, T, d) and their (B, T) mean and rstd, cut to 1/p
        replicated = 2 * (2 * 12 * 24 + 2 * 2 * 12) * 8
        assert (tp["saved_bytes"] - sp["saved_bytes"]) * p == (p - 1) * replicated
        for method, run in seq["context"].items():
            assert max(run["errors"].values()) < 1e-12, (method, run)
        assert set(seq["context"]) == {"ring", "ulysses"}  # 6 heads divide among 2 and 3
        for key, sent in seq["bytes"].items():
            assert sent == seq["formula"][key], key
        for s in SHARDS:
            assert seq["largest"]["ring", s] == 2 * 6 * s * s
            assert seq["largest"]["full", s] == 2 * 6 * (p * s) ** 2


def test_ring_traffic_is_computed_from_the_counters_record():
    # per byte handed at p = 4: all-reduce 2 (p-1)/p, all-gather (handed a shard) p - 1,
    # reduce-scatter (p-1)/p, broadcast 1; the flat forms by either name
    calls = [
        Call("all_reduce", 400, 4),
        Call("all_gather_into_tensor", 100, 4),
        Call("all_gather", 100, 2),
        Call("reduce_scatter_tensor", 400, 4),
        Call("broadcast", 40, 4),
    ]
    assert E.ring_traffic(calls) == 600 + 300 + 100 + 300 + 40
    assert E.ring_traffic([]) == 0
    with pytest.raises(ValueError, match="a call of all_to_all_single"):
        E.ring_traffic([Call("all_to_all_single", 400, 4)])


def test_diloco_and_local_sgd_send_one_hth_of_ddps_bytes(world):
    p, ranks = world
    runs = ranks[0][3]
    model_bytes = runs["DDP"]["model_bytes"]
    assert runs["DDP"]["bytes"] == STEPS * model_bytes
    for name in ("local SGD", "DiLoCo"):
        assert runs[name]["bytes"] == STEPS // PERIOD * model_bytes
        assert runs[name]["bytes"] * PERIOD == runs["DDP"]["bytes"]
    for r in runs.values():
        assert r["loss"] < math.log(10) and 0 <= r["accuracy"] <= 1
        assert len(r["curve"]) == 4 and r["curve"][-1][0] == r["bytes"]
    state = runs["DiLoCo"]["state"]
    assert state["keys"] == ["optimizer", "outer", "period", "rounds", "step_count"]
    assert state["bytes"] == 2 * model_bytes  # the shared copy and the outer momentum
    assert state["rounds"] == STEPS // PERIOD
    for _, _, _, other in ranks[1:]:  # every rank evaluates the same (averaged) model
        assert other["DiLoCo"]["loss"] == runs["DiLoCo"]["loss"]


def test_moe_against_dense_on_a_tiny_corpus():
    text = "the quick brown fox jumps over the lazy dog. " * 40
    vocab = tuple(sorted(set(text)))
    ids = torch.tensor([vocab.index(c) for c in text])
    data = TextData("tiny", ids[:1600], ids[1600:], vocab)
    out = E.moe_against_dense(data, 16, 1, 2, 16, 4, steps=40, batch_size=8, eval_batches=2)
    dense, moe = out["dense"], out["MoE"]
    for run in (dense, moe):
        assert run["loss"][-1] < run["loss"][0] - 0.5, run["loss"]
        assert math.isfinite(run["eval_loss"])
    router = 16 * 4
    assert moe["ffn_parameters"] == 4 * dense["ffn_parameters"] + router
    assert moe["ffn_active"] == dense["ffn_active"] + router
    assert moe["parameters"] - dense["parameters"] == 3 * dense["ffn_parameters"] + router
    assert sum(moe["tokens_per_expert"]) == 8 * 16 * 1  # one expert per token
    assert moe["dropped"] >= 0
