"""The memory-efficient optimizers' benchmark (``benchmarks/memory_optimizers.py``): its
``--quick`` run end to end, every row present, and the state bytes it reports (8-bit
moments, schedule-free AdamW's, Muon's and SOAP's beside AdamW's)."""

import runpy
import sys
from pathlib import Path

import pytest

from benchmarks import memory_optimizers
from benchmarks.optimizers import SIZES, pytorch_optimizer

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
    # 8-bit moments: 1 byte each and a float32 scale per block of 2,048 for the tensors of
    # at least 4,096 numbers, float32 moments (8 B) for the smaller ones
    gpt = SIZES["tiny"][1]()
    sizes = [p.numel() for p in gpt.parameters()]
    eight_bit = sum(2 * n + 2 * 4 * -(-n // 2048) for n in sizes if n >= 4096)
    full = sum(8 * n for n in sizes if n < 4096)
    for label in ("lsdl_lab Adam8bit", "lsdl_lab Adam8bit foreach=False", "lsdl_lab AdamW8bit"):
        assert state[label] == pytest.approx((eight_bit + full) / sum(sizes), abs=1e-4), label
    # schedule-free AdamW keeps z and v (x is never stored): AdamW's 8 bytes; Muon's
    # momentum (4 B) on the hidden matrices and AdamW's elsewhere is less; SOAP more
    assert state["lsdl_lab ScheduleFreeAdamW"] == pytest.approx(8.0)
    assert 4.0 < state["lsdl_lab Muon (muon_param_groups)"] < 8.0
    assert state["lsdl_lab SOAP"] > 8.0
    assert state["torch.optim AdamW"] == pytest.approx(8.0, abs=0.01)


def test_muon_is_skipped_on_a_model_without_hidden_matrices():
    muon_row = next(group for group in memory_optimizers.GROUPS if "Muon" in group[0][0])
    with pytest.raises(ValueError, match="no hidden matrix"):
        muon_row[0][1](SIZES["1M"][1]())


def test_bad_sizes_are_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        memory_optimizers.main(["--sizes", "1G"])
    assert "Invalid --sizes '1G'" in capsys.readouterr().err
