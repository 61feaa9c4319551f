"""benchmarks/compiled.py: its rows cover every optimizer of lsdl_lab.optim, SM3's minimum
bytes, the labs' runs as the notebooks build them, the verdict of the labs' table, and a
quick run (one compiled optimizer on a tiny model) end to end."""

import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks import compiled
from benchmarks.bandwidth import minimum_bytes_per_param
from lsdl_lab import optim
from lsdl_lab.profiles import PROFILES
from lsdl_lab.run import Config

ROOT = Path(__file__).resolve().parents[1]


def test_rows_cover_every_optimizer_of_the_package():
    entries = compiled.book_rows()
    exported = {
        name
        for name in optim.__all__
        if isinstance(getattr(optim, name), type)
        and issubclass(getattr(optim, name), torch.optim.Optimizer)
        and getattr(optim, name) is not optim.Optimizer
    }
    assert {e.name for e in entries} == exported
    listed = {e.name: e.reason for e in entries if e.reason}
    assert listed["Shampoo"] == "falls back to eager: " + optim.Shampoo.not_compilable
    assert set(listed) == {"SAM", "KFAC", "Shampoo", "Newton", "HessianFree", "SOAP",
                           "ScheduleFreeAdamW", "Adam8bit", "AdamW8bit"}  # fmt: skip
    labels = [e.label for e in entries if not e.reason]
    for label in (*compiled.GOAL_ROWS, "SGD nesterov", "Adam amsgrad", "LAMB", "SM3"):
        assert label in labels
    params = compiled.model_params("tiny", "cpu")
    for e in entries:  # every timed row has a byte count and builds every implementation
        if not e.reason:
            assert compiled.minimum_bytes(e.name, e.options, params) > 0, e.label
            built = compiled.candidates(e, params)
            assert [name for name, _ in built][:2] == ["eager foreach", "compiled"], e.label
            assert all(isinstance(opt, torch.optim.Optimizer) for _, opt in built), e.label


def test_sm3_moves_what_sgd_moves_on_matrices_and_adagrad_on_vectors():
    matrix, vector = torch.zeros(10, 10), torch.zeros(50)
    assert compiled.minimum_bytes("SM3", {}, [matrix]) == 12
    assert compiled.minimum_bytes("SM3", {}, [vector]) == minimum_bytes_per_param("Adagrad")
    assert compiled.minimum_bytes("SM3", {}, [matrix, vector]) == pytest.approx(
        (100 * 12 + 50 * 20) / 150
    )
    assert compiled.minimum_bytes("SM3", {"momentum": 0.9}, [matrix]) == 20
    assert compiled.minimum_bytes("Adam", {}, [matrix]) == 28


def code_of(lab: str) -> str:
    (path,) = (ROOT / "labs").glob(f"lab{lab}_*.ipynb")
    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


def test_lab_runs_use_the_optimizers_their_notebooks_use():
    P = PROFILES["smoke"]
    d = compiled.profile_data(P)
    assert d[0] == P.max_train_examples and d[1] == (1, 8, 8) and d[2] > 50
    for lab, model, (name, options), steps in compiled.LAB_RUNS:
        number = lab.split(",")[0].split()[1]
        if number == "9":  # Lab 9's runs take Config's default optimizer
            assert Config().optimizer == name
        else:
            assert f"optim.{name}(" in code_of("0" + number), lab
        for profile in PROFILES.values():
            assert steps(profile, compiled.GPU_DATA) > 0
        net = model(P, d)
        getattr(optim, name)(net.parameters(), **options)  # the options are valid


def lab_row(steps, eager_ms, compiled_ms, compile_s):
    return compiled.LabRow("Lab 0, a run", "cpu", 1000, 2, "Adam", steps, eager_ms, compiled_ms,
                           compile_s, "cold")  # fmt: skip


def test_lab_table_says_a_run_pays_only_past_its_break_even():
    slower = lab_row(1000, 1.0, 1.5, 10.0)
    faster = lab_row(1000, 2.0, 1.0, 10.0)  # saves 1 ms a step: 10,000 steps to repay
    assert slower.break_even == math.inf and faster.break_even == pytest.approx(10_000)
    assert faster.saved_s == pytest.approx(-9.0)
    text = "\n".join(compiled.lab_table([slower, faster]))
    assert text.count("| no |") == 2
    assert "No lab's run gains: the compiled step was slower than the eager one in 1 of the 2" in (
        text
    )
    text = "\n".join(compiled.lab_table([faster]))
    assert "No lab's run gains: the compiled step was faster than the eager one in all 1 " in text
    long_run = lab_row(20_000, 2.0, 1.0, 10.0)
    text = "\n".join(compiled.lab_table([slower, long_run]))
    assert "| yes |" in text and "Runs that gain: Lab 0, a run at cpu." in text


def test_an_uncompiled_run_is_decided_by_the_fastest_compile():
    short = lab_row(100, 0.1, float("nan"), float("nan"))  # 10 ms of eager steps in all
    short.floor = 5.0
    assert short.eager_run_s == pytest.approx(0.01) and short.verdict == "no (bound)"
    short.floor = 0.001  # a compile faster than the whole run: the bound cannot say
    assert short.verdict == "unknown"
    assert "Undecided (not compiled" in "\n".join(compiled.lab_table([short]))


def test_quick_run_times_every_implementation_and_states_the_goals(monkeypatch, tmp_path):
    # dynamo's trace run by its "eager" backend: the benchmark's whole path in seconds, where
    # TorchInductor's code generation and C++ compiler take 20-80 s here (tested in
    # tests/optim/test_compiled.py); `python -m benchmarks.compiled --quick` compiles for real
    monkeypatch.setattr(optim.compiled.CompiledUpdate, "backend_name", "eager")
    monkeypatch.setattr(compiled, "DEFAULT_OUT", tmp_path / "compiled.md")
    text = compiled.main(["--quick"])
    assert not (tmp_path / "compiled.md").exists()
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    impls = [cells.split("|")[3].strip() for cells in rows[1:]]
    assert impls == ["eager foreach", "compiled", compiled.PUBLIC, "torch fused"]
    compiled_cells = [c.strip() for c in rows[2].strip("|").split("|")]
    assert float(compiled_cells[3].split()[0]) > 0  # its median step time
    seconds, how = compiled_cells[-1].split()
    assert float(seconds) > 0 and how in ("(cold)", "(cache)")
    (goal,) = [line for line in text.splitlines() if line.startswith("- SGD momentum=0.9:")]
    assert "of B\\*" in goal and "torch fused (goal ≤ 1.1" in goal
    if "goal met); " not in goal or "(goal ≤ 1.1: met)" not in goal:  # a missed goal's reason
        assert "kernels for 16 tensors" in goal
    assert "- Shampoo: falls back to eager: " in text
