"""The GPU check's machinery, on the CPU: its entry-point run and the checks of its first
line and metrics, its reading of pytest's output, and its report (the check itself needs a
GPU: `make test-gpu`)."""

import pytest
import torch

from benchmarks import gpu_check


def test_it_refuses_a_machine_without_cuda_unless_rehearsing(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        gpu_check.main(["--parts", "entry"])
    assert "no CUDA GPU here" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_check.main(["--parts", "entry,lint", "--allow-cpu"])
    assert "Invalid --parts 'entry,lint'" in capsys.readouterr().err


def test_an_entry_point_run_is_checked_for_its_placement_and_its_loss(tmp_path):
    name, options = gpu_check.entry_runs(1)[0]
    assert name == "ddp, mlp" and [n for n, _ in gpu_check.entry_runs(2)] == [
        f"{mode}, mlp" for mode in gpu_check.MODES
    ]
    out = tmp_path / "run"
    command = gpu_check.entry_command(1, options, out)
    outcome = gpu_check.run("entry", name, command, timeout=300)
    gpu_check.check_entry(outcome, 1, out)
    assert outcome.passed, (outcome.problems, outcome.output[-2000:])
    assert outcome.summary.startswith("cpu (gloo); loss ") and "ms/step" in outcome.summary
    (out / "metrics.jsonl").write_text('{"loss": NaN, "step_time_s": 0.1}\n')
    gpu_check.check_entry(outcome, 1, out)
    assert not outcome.passed and "no finite loss" in outcome.problems[0]
    torchrun = gpu_check.entry_command(2, options, out)
    assert torchrun[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def test_pytest_output_and_junit_reports_are_read(tmp_path):
    output = "....\n===== 12 passed, 2 skipped in 30.12s =====\n"
    assert gpu_check.pytest_summary(output) == "12 passed, 2 skipped in 30.12s"
    junit = tmp_path / "t.xml"
    junit.write_text(
        '<testsuites><testsuite><testcase name="test_a[cpu]"/><testcase name="test_a[cuda]"/>'
        '<testcase name="test_b[cuda-Adam]"/><testcase name="test_c[cudable]"/>'
        "</testsuite></testsuites>"
    )
    assert gpu_check.cuda_cases(junit) == 2


def test_the_report_lists_every_command_and_shows_what_failed():
    ok = gpu_check.Outcome("entry", "1 rank(s): ddp, mlp", ["python"], 3.2, 0, "", summary="a|b")
    bad = gpu_check.Outcome("tests", "the tests", ["pytest", "tests"], 9.0, 1, "line 1\nboom")
    late = gpu_check.Outcome("bench", "bench", ["python"], 99.0, -9, "")
    text = gpu_check.report([ok, bad, late], ["- date: today"], 120.0)
    assert "| entry | 1 rank(s): ddp, mlp | passed | 3 | a/b |" in text
    assert "| tests | the tests | failed (1) | 9 |" in text and "| timed out |" in text
    assert "1 of 3 passed." in text and "## tests: the tests: failed (1)" in text
    assert "`pytest tests`" in text and "boom" in text and "- run time: 2.0 min" in text
