"""benchmarks/zero.py: a quick run in a world of two (a tiny GPT) whose table shows each
stage's partition of the bytes held per rank (counted by lsdl_lab.memory.measure, tested in
tests/memory/test_measure.py, or ZeroOptimizer.held_bytes)."""

import pytest

from benchmarks import __main__ as run_all
from benchmarks import zero


def columns(text: str, name: str) -> list[str]:
    (line,) = [row for row in text.splitlines() if row.startswith(f"| {name} |")]
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_quick_run_partitions_as_each_stage_says(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(zero, "DEFAULT_OUT", tmp_path / "zero.md")
    text = zero.main(["--quick"])
    assert not (tmp_path / "zero.md").exists()
    state, total = {}, {}
    for name in zero.SETUPS:
        cells = columns(text, name)
        state[name], total[name] = float(cells[-2]), float(cells[-1])
    assert total["DDP"] == pytest.approx(16.0, abs=0.1)  # params, grads, two moments: 4 each
    for name in zero.SETUPS[1:]:  # every other set-up halves Adam's state on 2 ranks
        # ZeRO-3 offload also keeps a float32 master copy of its shard in CPU memory (the
        # parameters the device holds are its working copy): 4 more bytes over 2 ranks
        master = 2.0 if name == "ZeRO-3 offload" else 0.0
        assert state[name] == pytest.approx(4.0 + master, abs=0.1), name
    assert total["ZeRO-1"] == pytest.approx(12.0, abs=0.1)  # whole params and grads
    assert total["ZeRO-2"] == pytest.approx(10.0, abs=0.1)  # half the grads too
    assert total["ZeRO-3"] == pytest.approx(8.0, abs=0.1)  # everything halved
    assert total["torch FSDP2"] == pytest.approx(8.0, abs=0.1)
    assert total["torch FSDP2 offload"] == pytest.approx(8.0, abs=0.1)


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--warmup", "-1"], ["--device", "cuda"]])
def test_bad_options(argv, capsys):
    with pytest.raises(SystemExit):
        zero.parse_args(argv)


def test_the_full_run_options_are_accepted():
    _, args = zero.parse_args(run_all.FULL["zero"])
    assert not args.quick and args.out is None
