"""The benchmark's timing helper, its state-size count, and the optimizer benchmark's
``--quick`` run end to end."""

import runpy
import sys
import time
from pathlib import Path

import pytest
import torch

import lsdl_lab.optim
from benchmarks import optimizers
from benchmarks.timing import compare, quartiles, state_bytes_per_param

ROOT = Path(__file__).resolve().parents[1]


class FakeClock:
    """A timer that only moves when a function under test says it took time."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def costs(self, seconds, log=None, name=None):
        def fn():
            if log is not None:
                log.append(name)
            self.now += seconds

        return fn


def test_ratio_of_known_costs_is_exact_with_a_fake_clock():
    clock = FakeClock()
    r = compare({"a": clock.costs(3.0), "b": clock.costs(1.0)}, 7, warmup=2, timer=clock)
    assert r.median("a") == 3.0 and r.median("b") == 1.0
    assert r.ratio("a", "b") == 3.0
    assert r.ratios("a", "b") == [3.0] * 7
    assert r.ratio_iqr("a", "b") == (3.0, 3.0)


def test_calls_alternate_and_warmup_is_not_timed():
    clock, log = FakeClock(), []
    fns = {name: clock.costs(1.0, log, name) for name in "ab"}
    r = compare(fns, repeats=4, warmup=3, timer=clock)
    # every round calls each function once; the first function alternates
    assert log == list("abbaabbaabbaab")
    assert r.order == [tuple("ba"), tuple("ab"), tuple("ba"), tuple("ab")]
    assert {name: len(t) for name, t in r.times.items()} == {"a": 4, "b": 4}


def test_three_functions_take_turns_going_first():
    clock, log = FakeClock(), []
    fns = {name: clock.costs(1.0, log, name) for name in "abc"}
    r = compare(fns, repeats=3, warmup=0, timer=clock)
    assert r.order == [tuple("abc"), tuple("bca"), tuple("cab")]
    assert log == list("abcbcacab")


def test_slow_warmup_and_setup_do_not_count():
    clock, calls = FakeClock(), {"a": 0, "setup": 0}

    def a():  # the first two calls are slow (state creation, caches)
        calls["a"] += 1
        clock.now += 100.0 if calls["a"] <= 2 else 2.0

    def setup():
        calls["setup"] += 1
        clock.now += 50.0

    r = compare({"a": a, "b": clock.costs(1.0)}, 5, warmup=2, setup=setup, timer=clock)
    assert calls == {"a": 7, "setup": 14}
    assert r.times["a"] == [2.0] * 5 and r.ratio("a", "b") == 2.0


def busy(cpu_seconds):
    def fn():
        end = time.thread_time() + cpu_seconds
        while time.thread_time() < end:
            pass

    return fn


def test_ratio_of_busy_loops_with_a_real_clock():
    # CPU time of this thread, so that other processes on a shared machine cannot skew it
    r = compare({"slow": busy(3e-3), "fast": busy(1e-3)}, 9, warmup=1, timer=time.thread_time)
    assert r.ratio("slow", "fast") == pytest.approx(3.0, rel=0.1)
    q1, q3 = r.ratio_iqr("slow", "fast")
    assert 2.5 < q1 <= q3 < 3.5


def test_quartiles():
    assert quartiles([5.0]) == (5.0, 5.0, 5.0)
    assert quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 3.0, 4.0)


@pytest.mark.parametrize("repeats,warmup", [(0, 1), (3, -1)])
def test_compare_rejects_bad_counts(repeats, warmup):
    with pytest.raises(ValueError, match="repeats"):
        compare({"a": lambda: None}, repeats, warmup)


def test_compare_needs_a_function():
    with pytest.raises(ValueError, match="at least one"):
        compare({}, 3)


def stepped(cls, params, **kwargs):
    opt = cls(params, **kwargs)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return opt


def model_params(dtype=torch.float32):
    torch.manual_seed(0)
    return [torch.randn(30, 20, dtype=dtype), torch.randn(20, dtype=dtype)]  # 620 numbers


# State bytes count every tensor: lsdl_lab keeps ``step`` as a Python int (0 bytes);
# torch.optim keeps it as a 0-d float32 tensor: 4 bytes per parameter *tensor*.
@pytest.mark.parametrize(
    "name,kwargs,per_param",
    [
        ("SGD", {}, 0.0),
        ("SGD", {"momentum": 0.9}, 4.0),
        ("Adam", {}, 8.0),
        ("AdamW", {}, 8.0),
        ("Adam", {"amsgrad": True}, 12.0),
    ],
)
def test_state_bytes_per_param(name, kwargs, per_param):
    params = model_params()
    n_tensors, n = len(params), sum(p.numel() for p in params)
    ours = stepped(getattr(lsdl_lab.optim, name), params, **kwargs)
    assert state_bytes_per_param(ours) == per_param
    theirs = stepped(getattr(torch.optim, name), params, foreach=True, **kwargs)
    steps = 4 * n_tensors / n if name.startswith("Adam") else 0.0
    assert state_bytes_per_param(theirs) == pytest.approx(per_param + steps)


def test_state_bytes_follow_dtype_and_count_tied_weights_once():
    assert state_bytes_per_param(stepped(lsdl_lab.optim.Adam, model_params(torch.float64))) == 16
    gpt = optimizers.SIZES["tiny"][1]()  # its output layer is its token embedding
    params = list(gpt.parameters())
    assert gpt.head.weight is gpt.tok.weight and gpt.head.weight in params
    assert state_bytes_per_param(stepped(lsdl_lab.optim.Adam, params)) == 8.0
    assert state_bytes_per_param(lsdl_lab.optim.Adam(params)) == 0.0  # no step yet


def test_every_shared_optimizer_is_benchmarked(monkeypatch):
    names = optimizers.optimizer_names()
    assert "Optimizer" not in names
    assert {"SGD", "Adam", "AdamW"} <= set(names)
    # an optimizer added later joins by itself when torch.optim has it, and not otherwise
    monkeypatch.setattr(lsdl_lab.optim, "RAdam", torch.optim.RAdam, raising=False)
    monkeypatch.setattr(lsdl_lab.optim, "LAMB", torch.optim.Adam, raising=False)
    monkeypatch.setattr(lsdl_lab.optim, "__all__", [*lsdl_lab.optim.__all__, "RAdam", "LAMB"])
    assert optimizers.optimizer_names() == [*names, "RAdam"]
    labels = [label for label, _, _ in optimizers.configurations()]
    assert {"SGD nesterov", "Adam amsgrad", "RAdam"} <= set(labels)


def test_quick_run_writes_a_table_with_every_optimizer(tmp_path, monkeypatch, capsys):
    # the command ``python -m benchmarks.optimizers --quick``, run in this process
    out = tmp_path / "results" / "optimizers.md"
    script = ROOT / "benchmarks" / "optimizers.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--quick", "--out", str(out)])
    t0 = time.perf_counter()
    runpy.run_path(str(script), run_name="__main__")
    assert time.perf_counter() - t0 < 60  # about a second on an idle machine
    text = out.read_text()
    assert capsys.readouterr().out == text
    assert "torch threads 1, device cpu" in text and "15,328 parameters in 16 tensors" in text
    assert "clock: CPU time of the benchmark's thread" in text and "lsdl_lab 0." in text
    for label, _, _ in optimizers.configurations():
        assert f"| {label} " in text, label
    for name in optimizers.optimizer_names():
        assert f"| {name} " in text
    # LARS and LAMB, which torch.optim lacks: against torch.optim and pytorch-optimizer
    for label, reference, _ in optimizers.layerwise_configurations():
        assert f"| {label} " in text and f"| {reference} |" in text, reference
    assert "| nan" not in text
    if optimizers.pytorch_optimizer() is None:
        assert text.count("skipped: pytorch_optimizer is not installed") == 2
    else:
        assert "skipped" not in text
    # the optimizers torch.optim lacks, against the step they replace, with their state
    beyond = beyond_rows(text)
    assert set(beyond) == {label for label, *_ in optimizers.beyond_configurations()}
    for label, reference, period, _ in optimizers.beyond_configurations():
        row = beyond[label]
        assert row["reference"] == reference
        assert row["pairs"] % period == 0 and row["pairs"] >= 5, label
        assert row["ratio"] > 0 and row["ratio of means"] > 0
    gpt = optimizers.SIZES["tiny"][1]()
    groups = lsdl_lab.optim.muon_param_groups(gpt)
    n = sum(p.numel() for p in gpt.parameters())
    # Muon: a momentum (4 B) per hidden-matrix number, AdamW's two moments (8 B) elsewhere
    muon_bytes = sum(  # the groups hold (name, parameter) pairs
        (4 if g["use_muon"] else 8) * p.numel() for g in groups for _, p in g["params"]
    )
    assert beyond["Muon (muon_param_groups)"]["B/param lsdl_lab"] == pytest.approx(
        muon_bytes / n, abs=1e-3
    )
    assert beyond["ScheduleFreeAdamW"]["B/param lsdl_lab"] == 8.0  # z and v, no x
    assert beyond["SOAP"]["B/param lsdl_lab"] > 8.0  # Adam's moments and the factors
    for label in ("Adam8bit", "AdamW8bit"):  # 2 B + scales on large tensors, 8 B on small
        assert 2.0 < beyond[label]["B/param lsdl_lab"] < 8.0, label
    for row in beyond.values():  # torch.optim's AdamW and Adam, with their step tensors
        assert row["B/param reference"] == pytest.approx(8.0, abs=0.01)


def beyond_rows(text: str) -> dict[str, dict]:
    """The rows of the table of optimizers torch.optim lacks, by label: reference, ratio,
    ratio of means, pairs and state bytes per parameter (both sides)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "| ratio of means |" in line)
    names = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("| "):
            break
        cells = dict(zip(names, (c.strip() for c in line.strip("|").split("|")), strict=True))
        rows[cells["optimizer"]] = {
            k: v if k in ("optimizer", "reference", "pair ratios: median [IQR]") else float(v)
            for k, v in cells.items()
        }
    return rows


def test_muon_needs_a_model_with_hidden_matrices():
    # the ResNet's kernels are 4-D and its one matrix is the output layer: AdamW's alone
    resnet = optimizers.SIZES["1M"][1]()
    make = {label: m for label, _, _, m in optimizers.beyond_configurations()}
    with pytest.raises(ValueError, match="no hidden matrix"):
        make["Muon (muon_param_groups)"](resnet, list(resnet.parameters()))


def test_only_times_the_named_optimizers(capsys):
    text = optimizers.main(["--quick", "--only", "LARS,LAMB", "--repeats", "2"])
    assert "| LARS " in text and "| LAMB " in text
    assert "| SGD " not in text and "| Adam " not in text and "## Summary" not in text
    text = optimizers.main(["--quick", "--only", "SOAP,Muon", "--repeats", "3"])
    assert set(beyond_rows(text)) == {"SOAP", "Muon (muon_param_groups)"}
    assert beyond_rows(text)["SOAP"]["pairs"] == optimizers.SOAP_PERIOD  # 3, rounded up
    assert "| Muon |" in text  # and the row against torch.optim.Muon, on the matrices
    with pytest.raises(SystemExit):
        optimizers.main(["--quick", "--only", "LION"])


def test_wall_clock_and_bad_device_options(capsys):
    text = optimizers.main(["--quick", "--only", "SGD", "--repeats", "2", "--clock", "wall"])
    assert "clock: wall-clock time" in text and "| SGD momentum=0.9 " in text
    for argv in (["--device", "cuda", "--clock", "thread"], ["--clock", "gpu"]):
        with pytest.raises(SystemExit):
            optimizers.main(["--quick", *argv])


def test_a_loaded_machine_is_noted_in_the_header(monkeypatch):
    monkeypatch.setattr(optimizers.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(optimizers.os, "getloadavg", lambda: (9.0, 8.0, 7.5))
    (line,) = optimizers.load_note()
    assert "loaded machine" in line and "7.5 on 2 usable cores" in line
    monkeypatch.setattr(optimizers.os, "getloadavg", lambda: (3.0, 2.5, 1.5))
    assert optimizers.load_note() == []  # a busy minute, an idle quarter of an hour
