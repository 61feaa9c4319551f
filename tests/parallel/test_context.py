"""Context parallelism: ring attention and DeepSpeed-Ulysses equal full attention on the
gathered sequence, forward and backward, at worlds 2, 3 (ring only: 4 heads do not split
among 3 ranks) and 4; they send the bytes their formulas say; ring attention's largest
tensor is one s x s block of scores. One spawned world per world size runs every check;
the online-softmax block update is checked in one process, under hypothesis."""

import math

import context_workers as cw
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from lsdl_lab.distributed import spawn
from lsdl_lab.parallel import (
    online_softmax_step,
    ring_attention_bytes,
    ulysses_attention_bytes,
)

WORLDS = (2, 3, 4)
TOLERANCE = {"torch.float64": 1e-12, "torch.float32": 1e-5}
BYTES = {"ring": ring_attention_bytes, "ulysses": ulysses_attention_bytes}
SHARD = cw.B * cw.H * cw.S_SHARD * cw.D  # entries of one rank's q (and k, v)
DTYPES = {"torch.float64": torch.float64, "torch.float32": torch.float32}


@pytest.fixture(scope="module")
def reports():
    return {p: spawn(cw.context_report, p, backend="gloo", timeout=60) for p in WORLDS}


def _cases():
    for p in WORLDS:
        for method in ("ring", "ulysses") if cw.H % p == 0 else ("ring",):
            for dtype in TOLERANCE:
                for causal in (True, False):
                    yield p, method, dtype, causal


@pytest.mark.parametrize("p, method, dtype, causal", list(_cases()))
def test_equals_full_attention_forward_and_backward(reports, p, method, dtype, causal):
    for rank, report in enumerate(reports[p]):
        run = report["runs"][method, dtype, causal]
        assert run["dtype"] == dtype
        for name, error in run["errors"].items():
            assert error < TOLERANCE[dtype], f"{name} on rank {rank} of {p}: error {error:.2e}"


@pytest.mark.parametrize("p, method, dtype, causal", list(_cases()))
def test_bytes_sent_equal_the_formula(reports, p, method, dtype, causal):
    expected = BYTES[method](SHARD, p, DTYPES[dtype])
    for report in reports[p]:
        assert report["runs"][method, dtype, causal]["bytes"] == expected


def test_the_formulas():
    n = 4 * SHARD  # float32 shard bytes
    assert ring_attention_bytes(SHARD, 3) == (4 * n, 4 * n + 6 * n)
    assert ring_attention_bytes(SHARD, 1) == (0, 0)
    assert ulysses_attention_bytes(SHARD, 4) == (3 * n, 3 * n)
    # 16-bit inputs: k and v travel in bfloat16, the gradient accumulators in float32
    assert ring_attention_bytes(SHARD, 2, torch.bfloat16) == (n, n + 4 * n)


@pytest.mark.parametrize("p", WORLDS)
def test_ring_attention_in_bfloat16(reports, p):
    for report in reports[p]:
        run = report["bfloat16"]
        assert run["dtype"] == "torch.bfloat16"
        assert max(run["errors"].values()) < 0.05, run["errors"]
        assert run["bytes"] == ring_attention_bytes(SHARD, p, torch.bfloat16)


def test_both_on_sub_groups(reports):
    for report in reports[4]:
        for method, run in report["subgroups"].items():
            assert max(run["errors"].values()) < 1e-12, (method, run["errors"])
            assert run["bytes"] == BYTES[method](SHARD, 2, torch.float64)


@pytest.mark.parametrize("p", WORLDS)
def test_largest_tensor_against_sequence_length(reports, p):
    """Ring attention's largest tensor is one block of scores, batch * heads * s * s:
    doubling the sequence quadruples it (at a fixed p), and it is p^2 times smaller than
    full attention's scores. Ulysses' largest is q, k and v stacked for the all-to-all,
    3 * batch * heads * s * head_dim: linear in the sequence, as the CPU's fused attention
    kernel (which torch picks here) makes no S x S tensor visible to Python."""
    for report in reports[p]:
        largest = report["largest"]
        for s in (16, 32):
            assert largest["ring", s] == cw.B * cw.H * s * s
            assert largest["ring", s] * p**2 == cw.B * cw.H * (p * s) ** 2
        assert largest["ring", 32] == 4 * largest["ring", 16]
        if cw.H % p == 0:
            assert largest["ulysses", 16] == 3 * cw.B * cw.H * 16 * 4
            assert largest["ulysses", 32] == 2 * largest["ulysses", 16]


@pytest.mark.parametrize("p", WORLDS)
def test_bad_shards_are_refused(reports, p):
    refusals = reports[p][0]["refusals"]
    assert refusals["q"][0] == "ValueError" and refusals["q"][1].startswith("Invalid q:")
    assert "expected 4 dimensions" in refusals["q"][1]
    for name in ("k", "v"):
        assert refusals[name][0] == "ValueError" and refusals[name][1].startswith(f"Invalid {name}")
    assert refusals["heads"] == (
        "ValueError",
        f"Invalid heads: {p + 1} (dimension 1 of q, k and v; expected a multiple of the {p} "
        "ranks: each rank attends over whole heads)",
    )


def _reference(q, k, v, mask):
    s = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~mask, -math.inf)
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


@settings(max_examples=40, deadline=None)
@given(
    queries=st.integers(1, 5),
    cuts=st.lists(st.integers(1, 4), min_size=1, max_size=5),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_online_softmax_equals_softmax(queries, cuts, causal, seed):
    """Keys folded in blocks of any sizes, in any order, give softmax attention and its
    log-sum-exp; causal: the queries are the last positions, and a block may hide every
    key from some query (the running state must then stay empty)."""
    g = torch.Generator().manual_seed(seed)
    n = sum(cuts)
    queries = min(queries, n)  # each query sees at least the first key
    q = torch.randn(2, queries, 3, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, n, 3, generator=g, dtype=torch.float64) for _ in range(2))
    positions = torch.arange(n - queries, n).unsqueeze(-1) if causal else n
    mask = torch.arange(n) <= positions  # (queries, n), or all True
    mask = mask.expand(queries, n)
    y, lse = _reference(q, k, v, mask)
    acc, m, l = torch.zeros_like(q), q.new_full((2, queries), -math.inf), q.new_zeros(2, queries)
    blocks = list(zip(k.split(cuts, 1), v.split(cuts, 1), mask.split(cuts, 1), strict=True))
    for i in torch.randperm(len(blocks), generator=g).tolist():
        acc, m, l = online_softmax_step(acc, m, l, q, *blocks[i])
    assert torch.allclose(acc / l.unsqueeze(-1), y, rtol=0, atol=1e-12)
    assert torch.allclose(m + torch.log(l), lse, rtol=0, atol=1e-12)


def test_online_softmax_matches_sdpa_in_one_block():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 4, generator=g) for _ in range(3))
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    acc, m, l = online_softmax_step(
        torch.zeros_like(q),
        q.new_full(q.shape[:-1], -math.inf),
        q.new_zeros(q.shape[:-1]),
        q,
        k,
        v,
        causal,
    )
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(acc / l.unsqueeze(-1), expected, rtol=0, atol=1e-6)
