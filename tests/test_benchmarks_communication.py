"""benchmarks/communication.py: the codecs' bytes and answers against torch's hooks, the
interleaved timing in a world, and a quick run of the tables (small sizes)."""

import itertools

import pytest
import torch

from benchmarks import __main__ as run_all
from benchmarks import communication

SIDE = 32


def test_bytes_per_entry_are_each_formats():
    g = torch.randn(SIDE, SIDE)
    n, r = g.numel(), communication.RANK
    per_entry = {}
    for name, (encode, _, nbytes) in communication.codecs(SIDE).items():
        per_entry[name] = nbytes(encode(g)) / n
    assert per_entry["torch fp16 hook"] == 2.0
    lowrank = 2 * SIDE * r * 4 / n  # P and Q, float32
    assert per_entry[f"torch PowerSGD hook r={r}"] == lowrank
    assert per_entry[f"PowerSGD r={r}"] == lowrank
    assert 1 / 8 <= per_entry["SignSGD"] < 1 / 8 + 0.01  # a bit each, and a scale
    k = round(communication.RATIO * n)
    assert per_entry[f"TopK {communication.RATIO:g}"] == pytest.approx(8 * k / n, abs=1e-3)


def test_both_powersgds_reproduce_a_low_rank_matrix_and_fp16_round_trips():
    torch.manual_seed(0)
    r = communication.RANK
    m = torch.randn(SIDE, r) @ torch.randn(r, SIDE)
    specs = communication.codecs(SIDE)
    for name in (f"PowerSGD r={r}", f"torch PowerSGD hook r={r}"):
        encode, decode, _ = specs[name]
        assert torch.allclose(decode(encode(m)).reshape(m.shape), m, atol=1e-3), name
    encode, decode, _ = specs["torch fp16 hook"]
    back = decode(encode(m)).reshape(m.shape) * communication.WORLD  # the hook divides by N
    assert torch.allclose(back, m, rtol=1e-3, atol=1e-3)


def test_compression_rows_time_every_codec_against_its_reference():
    ticks = itertools.count()  # a clock on which every call takes one tick
    rows = communication.compression_rows(SIDE, repeats=2, warmup=1, timer=lambda: next(ticks))
    names = {row.name: row for row in rows}
    assert set(names) == set(communication.codecs(SIDE))
    assert names[f"PowerSGD r={communication.RANK}"].against.startswith("torch PowerSGD")
    assert names["SignSGD"].against == "torch fp16 hook"
    assert names["torch fp16 hook"].max_error < 1e-3
    assert all(row.ratio == (1.0, 1.0, 1.0) and row.encode_ms == 1e3 for row in rows)


def test_quick_run_times_the_three_all_reduces_in_a_world_of_two(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(communication, "DEFAULT_OUT", tmp_path / "communication.md")
    text = communication.main(["--quick", "--note", "the machine was shared"])
    assert not (tmp_path / "communication.md").exists()  # --quick writes no file
    assert "\n- note: the machine was shared\n" in text
    assert "| 1e+03 |" in text and "| 1e+05 |" in text
    assert "ring × built-in" in text and "| SignSGD |" in text and "| torch fp16 hook |" in text
    # the other collectives: a row for each at both worlds and sizes, hierarchical at 4 only
    for world in communication.WORLDS:
        for n in ("1e+03", "1e+05"):
            for name in ("all_to_all", "rabenseifner", "binary tree"):
                assert f"| {world} | {n} | {name} |" in text, (world, n, name)
    assert text.count("| hierarchical (2 nodes of 2) |") == 2
    assert "| 4 | 1e+05 | hierarchical (2 nodes of 2) | " in text
    assert "| 2 | 1e+03 | hierarchical" not in text


def test_the_other_collectives_are_checked_against_their_references():
    fns = communication.collectives(4)
    assert {ref for ref, _ in fns.values()} == {"built-in all_to_all_single", "built-in all_reduce"}
    assert fns["all_to_all"][0] == "built-in all_to_all_single"
    assert fns["hierarchical (2 nodes of 2)"][0] == "built-in all_reduce"
    assert not any(name.startswith("hierarchical") for name in communication.collectives(2))


@pytest.mark.parametrize(
    "argv",
    [
        ["--sizes", "1"],
        ["--sizes", "3"],  # fewer floats than the world of 4
        ["--sizes", "x"],
        ["--repeats", "0"],
        ["--world-repeats", "0"],
        ["--side", "4"],
    ],
)
def test_bad_options(argv, capsys):
    with pytest.raises(SystemExit):
        communication.parse_args(argv)


def test_the_full_run_options_are_accepted():
    _, args = communication.parse_args(run_all.FULL["communication"])
    assert not args.quick and args.out is None
