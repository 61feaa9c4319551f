"""Tensor parallelism at world 2, float64: every piece matches its dense original (outputs,
the input's gradient, and each rank's parameter gradients against the slices of the dense
ones), with the all-reduces Megatron's design promises. One spawn for all the checks."""

import parallel_workers
import pytest

from lsdl_lab.distributed import spawn

FLOAT64 = 1e-12
PIECES = ("column", "row", "mlp", "attention", "block", "gpt")
# (forward, backward) all-reduces: f and g once each per MLP or attention (Shoeybi et al.
# 2019, Figure 4); a lone column layer only reduces its input's gradient, a lone row layer
# only its output; the GPT's two blocks twice each.
ALL_REDUCES = {
    "column": (0, 1),
    "row": (1, 0),
    "mlp": (1, 1),
    "attention": (1, 1),
    "block": (2, 2),
    "gpt": (4, 4),
}


@pytest.fixture(scope="module")
def reports():
    return spawn(parallel_workers.tensor_parallel_report, 2, backend="gloo", timeout=60)


@pytest.mark.parametrize("piece", PIECES)
def test_matches_the_dense_piece(reports, piece):
    for rank, report in enumerate(reports):
        r = report[piece]
        grads = {k: v for k, v in r.items() if k.startswith("grad ")}
        assert grads, f"{piece} has no parameters on rank {rank}"
        for name, error in {"output": r["output"], "input_grad": r["input_grad"], **grads}.items():
            assert error < FLOAT64, f"{piece} {name} on rank {rank}: error {error:.2e}"


@pytest.mark.parametrize("piece", PIECES)
def test_all_reduces_forward_and_backward(reports, piece):
    for report in reports:
        assert report[piece]["all_reduces"] == ALL_REDUCES[piece]


def test_each_rank_holds_half_of_each_split_weight(reports):
    shapes = reports[0]["block"]["shapes"]
    d = parallel_workers.DIM
    assert shapes["attn.qkv.weight"] == (3 * d // 2, d)
    assert shapes["attn.proj.weight"] == (d, d // 2)
    assert shapes["attn.proj.bias"] == (d,)
    assert shapes["mlp.0.weight"] == (2 * d, d)
    assert shapes["mlp.2.weight"] == (d, 2 * d)
    assert shapes["ln1.weight"] == (d,)


def test_bad_shards_are_refused(reports):
    refusals = reports[0]["refusals"]
    assert refusals["shard"][0] == "ValueError" and "multiple of" in refusals["shard"][1]
    assert refusals["heads"] == ("ValueError", "Invalid heads: 1 (expected a multiple of 2 ranks)")
    assert (
        refusals["dropout"][0] == "ValueError" and "Invalid dropout: 0.1" in refusals["dropout"][1]
    )
    assert refusals["mlp"][0] == "TypeError" and refusals["mlp"][1].startswith("Invalid mlp")
