"""Sequence parallelism (Korthikanti et al. 2022, Section 4.2.2) at worlds 2 and 4, float64:
the block with its LayerNorms and dropouts on this rank's positions equals tensor
parallelism alone and the one-process block, forward and backward; its all-gathers and
reduce-scatters move through a ring what tensor parallelism's all-reduces move; the
LayerNorms' inputs and the dropout masks it holds are 1/p of the whole sequence's. One
spawned world per world size runs every check.

The LayerNorms' and the row-parallel biases' gradients: each rank's holds its positions'
share only; the test checks that it differs from the whole gradient before
``all_reduce_sequence_parallel_grads`` (Megatron's ``_allreduce_layernorm_grads``) and
equals it, on every rank, after."""

from fractions import Fraction

import pytest
import sequence_workers as sw

from lsdl_lab.distributed import spawn

WORLDS = (2, 4)
FLOAT64 = 1e-12
N = sw.B * sw.T * sw.DIM  # entries of the block's whole (B, T, d) activation
BYTES = 8  # float64


@pytest.fixture(scope="module")
def reports():
    return {p: spawn(sw.sequence_parallel_report, p, backend="gloo", timeout=60) for p in WORLDS}


def _kind(name: str) -> str:
    """``all_gather`` or ``reduce_scatter`` for the flat forms under either torch's name."""
    for suffix in ("_single", "_into_tensor", "_tensor"):
        name = name.removesuffix(suffix)
    return name


def _ring(name: str, handed: int, p: int) -> Fraction:
    """Bytes through one rank's link of a ring collective handed ``handed`` bytes (Chapter
    7's cost model): all-reduce 2 (p-1)/p n, all-gather of an n/p shard (p-1) n/p,
    reduce-scatter of n (p-1)/p n."""
    factor = {"all_reduce": Fraction(2 * (p - 1), p), "reduce_scatter": Fraction(p - 1, p)}
    factor["all_gather"] = Fraction(p - 1)
    return factor[_kind(name)] * handed


@pytest.mark.parametrize("p", WORLDS)
@pytest.mark.parametrize("parallelism", ["tp", "sp"])
def test_equals_the_one_process_block_and_tensor_parallelism(reports, p, parallelism):
    for rank, report in enumerate(reports[p]):
        errors = report["errors"][parallelism]
        assert len(errors) > 10
        for name, error in errors.items():
            assert error < FLOAT64, f"{parallelism} {name}, rank {rank} of {p}: error {error:.2e}"


@pytest.mark.parametrize("p", WORLDS)
def test_layernorm_and_row_bias_gradients_are_partial_until_summed(reports, p):
    for report in reports[p]:
        partial = report["partial"]
        assert partial["names"] == sorted(
            ["ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "attn.proj.bias", "mlp.2.bias"]
        )
        for name, error in partial["error before the sum"].items():
            assert error > 1e-3, f"{name}'s gradient is whole before the sum ({error:.1e})"
        assert partial["entries"] == 6 * sw.DIM
        assert [name for name, _ in partial["calls"]] == ["all_reduce"]
        assert partial["bytes"] == 6 * sw.DIM * BYTES


@pytest.mark.parametrize("p", WORLDS)
def test_collectives_and_bytes_per_step(reports, p):
    for report in reports[p]:
        for phase in ("forward", "backward"):
            tp, sp = report["calls"]["tp"][phase], report["calls"]["sp"][phase]
            # tensor parallelism: two all-reduces of the whole activation per pass
            assert tp == [("all_reduce", N * BYTES)] * 2
            # sequence parallelism: no all-reduce; per pass two all-gathers of a rank's
            # positions and two reduce-scatters of the whole activation
            names = sorted(_kind(name) for name, _ in sp)
            assert names == ["all_gather"] * 2 + ["reduce_scatter"] * 2, sp
            handed = sorted(nbytes for _, nbytes in sp)
            assert handed == [N * BYTES // p] * 2 + [N * BYTES] * 2
            # CollectiveBytes counts what is handed: 2 n for TP, 2 (n/p + n) for SP
            assert report["bytes"]["tp"][phase] == 2 * N * BYTES
            assert report["bytes"]["sp"][phase] == 2 * (N // p + N) * BYTES
            # through a ring, an all-gather and a reduce-scatter move what an all-reduce does
            ring_tp = sum(_ring(name, nbytes, p) for name, nbytes in tp)
            ring_sp = sum(_ring(name, nbytes, p) for name, nbytes in sp)
            assert ring_sp == ring_tp == 2 * Fraction(2 * (p - 1), p) * N * BYTES


@pytest.mark.parametrize("p", WORLDS)
def test_layernorm_inputs_held_are_one_over_p(reports, p):
    # each of the two LayerNorms saves its input (n entries) and a mean and a reciprocal
    # standard deviation per position (2 B T): all of them on tensor parallelism's ranks,
    # 1/p of them on sequence parallelism's; everything else saved is the same
    layernorms = 2 * (N + 2 * sw.B * sw.T) * BYTES
    for report in reports[p]:
        memory = report["memory"]
        assert memory["tp"] - memory["sp"] == layernorms - layernorms // p, memory


@pytest.mark.parametrize("p", WORLDS)
def test_dropout_on_each_ranks_positions(reports, p):
    for rank, report in enumerate(reports[p]):
        dropout = report["dropout"]
        for name, error in dropout["errors"].items():
            assert error < FLOAT64, f"dropout {name}, rank {rank} of {p}: error {error:.2e}"
        assert 0.1 < dropout["dropped fraction"] < 0.4  # DROPOUT = 0.25 drew zeros
        assert dropout["effect"] > 1e-2  # and they changed the output
        held = dropout["masks held"]
        # two masks of the rank's B (T/p) d positions, 1/p of the one-process block's two
        assert held["dense"] > 0 and held["dense"] % (2 * N) == 0
        assert held["sp"] * p == held["dense"], held


def test_each_rank_holds_its_share(reports):
    for p in WORLDS:
        shapes, d = reports[p][0]["shapes"], sw.DIM
        assert shapes["attn.qkv.weight"] == (3 * d // p, d)
        assert shapes["mlp.2.weight"] == (d, 4 * d // p)
        assert shapes["ln1.weight"] == (d,)


def test_bad_input_is_refused(reports):
    refusals = reports[2][0]["refusals"]
    assert refusals["sequence"] == (
        "ValueError",
        f"Invalid x: shape ({sw.B}, {sw.T + 1}, {sw.DIM}) (expected a sequence length, dim 1, "
        "that is a multiple of the world size 2)",
    )
    assert refusals["flag"][0] == "TypeError" and "sequence_parallel" in refusals["flag"][1]
    assert refusals["tp dropout"][0] == "ValueError"
    assert "Invalid dropout: 0.25" in refusals["tp dropout"][1]
    assert refusals["attention dropout"][0] == "ValueError"
    assert "Invalid dropout: 0.25" in refusals["attention dropout"][1]
