"""The memory-efficient optimizers' benchmark (``benchmarks/memory_optimizers.py``): its
``--quick`` run end to end, every row present, and the state bytes it reports."""

import runpy
import sys
from pathlib import Path

import pytest

from benchmarks import memory_optimizers
from benchmarks.optimizers import pytorch_optimizer

ROOT = Path(__file__).resolve().parents[1]


def state_per_param(text: str) -> dict[str, float]:
    """The last column (state bytes per parameter) of each row of the table."""
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| ")]
    return {cells[1].strip(): float(cells[-2]) for cells in rows if cells[-2].strip()[:1].isdigit()}


def test_quick_run_writes_a_table_with_every_row(tmp_path, monkeypatch, capsys):
    # the command ``python -m benchmarks.memory_optimizers --quick``, run in this process
    out = tmp_path / "results" / "memory_optimizers.md"
    script = ROOT / "benchmarks" / "memory_optimizers.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--quick", "--out", str(out)])
    runpy.run_path(str(script), run_name="__main__")
    text = out.read_text()
    assert capsys.readouterr().out == text
    assert "torch threads 1, device cpu" in text and "15,328 parameters in 16 tensors" in text
    labels = [label for group in memory_optimizers.GROUPS for label, _ in group]
    if pytorch_optimizer() is None:
        assert text.count("skipped, pytorch_optimizer is not installed") == 3
        labels = [label for label in labels if not label.startswith("pytorch-optimizer")]
    for label in labels:
        assert f"| {label} |" in text, label
    assert "| nan" not in text
    state = state_per_param(text)
    # Adam: 8 bytes per parameter; the factored ones: the tiny GPT's vectors (unfactored)
    # and n + m per n x m matrix, under 0.3 bytes per parameter
    assert state["lsdl_lab Adam"] == pytest.approx(8.0)
    for label in ("lsdl_lab Adafactor", "lsdl_lab SM3"):
        assert state[label] < 0.3, label
    # a first moment or momentum costs 4 bytes per parameter
    assert state["lsdl_lab Adafactor beta1=0.9"] == pytest.approx(state["lsdl_lab Adafactor"] + 4)
    assert state["lsdl_lab SM3 momentum=0.9"] == pytest.approx(state["lsdl_lab SM3"] + 4)


def test_bad_sizes_are_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        memory_optimizers.main(["--sizes", "1G"])
    assert "Invalid --sizes '1G'" in capsys.readouterr().err
