"""The worlds of Lab 10 (lsdl_lab.book.scaling_lab) report what the lab asserts: our
all-to-all and all-reduces equal the built-ins, send the formulas' bytes in the formulas'
messages, and are timed at every size; the expert-parallel layer equals the one-process
MoE and hands its all-to-alls the formula's bytes; ring attention and Ulysses equal full
causal attention and send the formulas' bytes."""

from __future__ import annotations

import pytest

from lsdl_lab.book import scaling_lab
from lsdl_lab.distributed import spawn

SIZES = [1_200, 12_000, 120_000]  # multiples of 4 p at p = 3


@pytest.fixture(scope="module")
def collectives():
    return spawn(scaling_lab.collective_scaling, 3, SIZES, 2)


def test_collectives_equal_the_built_ins_on_every_rank(collectives):
    for r in collectives:
        assert r["error"]["all-to-all"] == 0
        assert r["error"]["ring"] < 1e-12 and r["error"]["Rabenseifner"] < 1e-12


def test_collectives_send_the_formulas_bytes(collectives):
    p, q = 3, 2
    for r in collectives:
        for i, n in enumerate(SIZES):
            assert r["sent"]["all-to-all (ours)"][i] == (p - 1) * n // p
            assert r["messages"]["all-to-all (ours)"][i] == p - 1
            assert r["sent"]["ring"][i] == 2 * (p - 1) * n // p
            assert r["messages"]["ring"][i] == 2 * (p - 1)
    # Rabenseifner on 3 ranks: rank 0 folds into rank 1 (n), rank 1 halves, doubles and
    # hands the sum back (n/2 + n/2 + n), rank 2 halves and doubles (n)
    for i, n in enumerate(SIZES):
        sent = [r["sent"]["Rabenseifner"][i] for r in collectives]
        assert sent == [n, 2 * (q - 1) * n // q + n, n]
        assert [r["messages"]["Rabenseifner"][i] for r in collectives] == [1, 3, 2]


def test_collectives_are_timed_at_every_size(collectives):
    seconds = collectives[0]["seconds"]
    assert set(seconds) == set(scaling_lab.ALL_TO_ALLS) | set(scaling_lab.ALL_REDUCES)
    for times in seconds.values():
        assert len(times) == len(SIZES) and all(0 < t < 10 for t in times)
    # the slowest rank's time, gathered: the same numbers on every rank
    assert all(r["seconds"] == seconds for r in collectives)


def test_expert_parallel_equals_the_one_process_layer():
    ranks = spawn(scaling_lab.expert_parallel_check, 2, 8, 16, 4, 2, 1.0, 12)
    for r in ranks:
        assert max(r["output_error"], r["input_grad_error"], r["expert_grad_error"]) < 1e-12
        assert tuple(r["bytes"]) == tuple(r["formula"])
        assert r["dropped"] > 0  # factor 1 on a random router: the capacity cut is exercised
    assert ranks[0]["sent"][1] == ranks[1]["received"][0]
    assert ranks[1]["sent"][0] == ranks[0]["received"][1]


def test_context_parallel_equals_full_attention():
    shards = (2, 4)
    ranks = spawn(scaling_lab.context_parallel_check, 2, shards)
    for r in ranks:
        for method in ("ring", "Ulysses"):
            for s in shards:
                assert r["error"][method][s] < 1e-12
                assert tuple(r["bytes"][method][s]) == tuple(r["formula"][method][s])
    # a shard of s positions: batch 1 x heads 4 x s x head_dim 8 float64 = 256 s bytes;
    # ring attention 2(p-1) n forward, Ulysses 4 (p-1)/p n, at p = 2
    assert ranks[0]["bytes"]["ring"][4] == (2 * 1024, 2 * 1024 + 4 * 1024)
    assert ranks[0]["bytes"]["Ulysses"][4] == (2 * 1024, 2 * 1024)
