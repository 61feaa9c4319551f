"""The bandwidth, Hessian and project-cost benchmarks: their byte counts, traffic counter,
timing helpers, table writers and options, on tiny sizes (no notebook is executed)."""

import sys
import time

import pytest
import torch

import lsdl_lab.optim
from benchmarks import __main__ as run_all
from benchmarks import bandwidth, optimizers, project_cost
from benchmarks import hessian as hessian_bench
from benchmarks.timing import device_timer, load_average, machine_lines

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"  # inside torch.func.jvp
)

# --- the minimum traffic of each step ------------------------------------------------------


@pytest.mark.parametrize(
    "name,kwargs,reads,writes",
    [
        ("SGD", {}, 2, 1),  # p g -> p
        ("SGD", {"momentum": 0.9}, 3, 2),  # p g b -> p b
        ("SGD", {"momentum": 0.9, "nesterov": True}, 3, 2),
        ("Adagrad", {}, 3, 2),
        ("RMSprop", {}, 3, 2),
        ("RMSprop", {"centered": True, "momentum": 0.9}, 5, 4),
        ("Adadelta", {}, 4, 3),
        ("Adam", {}, 4, 3),  # p g m v -> p m v
        ("Adam", {"weight_decay": 0.01}, 4, 3),  # decay reads p, already read
        ("Adam", {"amsgrad": True}, 5, 4),
        ("AdamW", {}, 4, 3),
        ("Adamax", {}, 4, 3),
        ("NAdam", {}, 4, 3),
        ("LARS", {"momentum": 0.9}, 5, 2),  # norms of p, g; then p g b -> p b
        ("LARS", {"momentum": 0.0}, 4, 1),
        ("LAMB", {}, 7, 3),  # p g m v -> m v (and norms); then p m v -> p
    ],
)
def test_minimum_traffic(name, kwargs, reads, writes):
    assert bandwidth.minimum_traffic(name, kwargs) == (reads, writes)
    assert bandwidth.minimum_bytes_per_param(name, kwargs) == 4 * (reads + writes)
    assert bandwidth.minimum_bytes_per_param(name, kwargs, itemsize=8) == 8 * (reads + writes)


def test_adam_moves_at_least_28_bytes_per_fp32_parameter():
    assert bandwidth.minimum_bytes_per_param("Adam") == 28
    assert bandwidth.minimum_bytes_per_param("Adam", itemsize=2) == 14  # bf16


def test_every_benchmarked_optimizer_has_a_count_and_others_are_refused():
    for _, name, kwargs in bandwidth.rows_to_run():
        reads, writes = bandwidth.minimum_traffic(name, kwargs)
        assert reads > writes >= 1
    assert {n for _, n, _ in bandwidth.rows_to_run()} >= {"SGD", "Adam", "LARS", "LAMB"}
    with pytest.raises(ValueError, match="Invalid optimizer: 'Lion'"):
        bandwidth.minimum_traffic("Lion")


# --- the traffic an implementation moves ---------------------------------------------------

N = 1000  # float32 numbers per array: 4,000 bytes


def traffic(fn):
    with bandwidth.TrafficCounter() as c:
        fn()
    return c.read, c.written


def test_traffic_of_single_operations():
    a, b, c = torch.rand(N), torch.rand(N), torch.rand(N)
    assert traffic(lambda: b.copy_(a)) == (4 * N, 4 * N)  # the destination is not read
    assert traffic(lambda: b.add_(a)) == (8 * N, 4 * N)
    assert traffic(lambda: a + b) == (8 * N, 4 * N)  # a new tensor is written
    assert traffic(lambda: c.addcmul_(a, a)) == (8 * N, 4 * N)  # a is read once
    assert traffic(lambda: a.view(10, 100)) == (0, 0)  # a view moves nothing
    assert traffic(lambda: b.zero_()) == (0, 4 * N)


def test_traffic_of_foreach_operations():
    xs = [torch.rand(N) for _ in range(3)]
    ys = [torch.rand(N) for _ in range(3)]
    assert traffic(lambda: torch._foreach_add_(xs, ys, alpha=2.0)) == (24 * N, 12 * N)
    assert traffic(lambda: torch._foreach_sqrt(xs)) == (12 * N, 12 * N)
    read, written = traffic(lambda: torch._foreach_norm(xs))
    assert read == 12 * N and written == 3 * 4  # three 0-d results


def steady(opt, params):
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    opt.step()  # the state exists: what follows is a steady step
    return opt


def test_implemented_traffic_of_real_steps():
    torch.manual_seed(0)
    params = [torch.randn(50, 20), torch.randn(20)]
    n = sum(p.numel() for p in params)
    sgd = steady(lsdl_lab.optim.SGD(params, lr=0.1), params)
    # one _foreach_add_: read p and g, write p
    assert bandwidth.implemented_bytes_per_param(sgd.step, n) == 12
    momentum = steady(lsdl_lab.optim.SGD(params, lr=0.1, momentum=0.9), params)
    # b *= mu (8), b += g (12), p -= lr b (12): 32 against the fused minimum of 20
    assert bandwidth.implemented_bytes_per_param(momentum.step, n) == 32
    adam = steady(lsdl_lab.optim.Adam(params), params)
    assert bandwidth.implemented_bytes_per_param(adam.step, n) >= 28
    try:
        fused = steady(torch.optim.Adam(params, fused=True), params)
    except (TypeError, RuntimeError) as e:  # torch without a fused CPU Adam
        pytest.skip(f"no fused Adam here: {e}")
    # one kernel moves exactly the minimum, plus the 0-d float32 step counter of each tensor:
    # incremented (read and written) and read by the kernel, 12 bytes per tensor
    fused_bytes = bandwidth.implemented_bytes_per_param(fused.step, n)
    assert fused_bytes == pytest.approx((28 * n + 12 * len(params)) / n)


# --- timing.py additions --------------------------------------------------------------------


def test_device_timer_and_machine_description():
    assert device_timer("cpu") is time.perf_counter
    assert device_timer(torch.device("cpu"), "wall") is time.perf_counter
    assert device_timer("cpu", "thread") is time.thread_time
    with pytest.raises(ValueError, match="Invalid clock: 'gpu'"):
        device_timer("cpu", "gpu")
    with pytest.raises(ValueError, match="Invalid clock: 'thread' times CPU work only"):
        device_timer("cuda", "thread")  # no CUDA needed: refused before any use
    if torch.cuda.is_available():
        t0 = device_timer("cuda")()
        assert device_timer("cuda")() >= t0
    load = load_average()
    assert load == "unknown" or len(load.split(", ")) == 3
    lines = machine_lines("cpu")
    text = "\n".join(lines)
    assert all(line.startswith("- ") for line in lines)
    assert f"torch {torch.__version__}" in text and "load average at start" in text
    assert "GPU" not in text


# --- the bandwidth benchmark end to end -----------------------------------------------------


def test_bandwidth_quick_run(capsys):
    text = bandwidth.main(["--quick", "--only", "SGD", "--stream-mb", "0.25"])
    assert capsys.readouterr().out == text
    assert "## Streaming bandwidth" in text and "**B\\*, the limit each row" in text
    for kernel in ("copy_", "add_", "_foreach_add_"):
        assert f"`{kernel}:" in text
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| SGD")]
    assert [r[0] for r in rows] == ["| SGD", "| SGD momentum=0.9", "| SGD nesterov †"]
    assert all(float(r[1]) > 0 and r[2] == "lsdl_lab" for r in rows)  # B* of the row
    assert "| torch.optim foreach |" in text and "| torch.optim fused |" in text
    assert "| Adam " not in text and "nan" not in text
    assert "load average at end" in text and "clock: CPU time of the benchmark's thread" in text


def test_bandwidth_rejects_bad_options():
    for argv in (
        ["--sizes", "2M"],
        ["--only", "Lion"],
        ["--rounds", "0"],
        ["--stream-mb", "0"],
        ["--device", "cuda", "--clock", "thread"],
    ):
        with pytest.raises(SystemExit):
            bandwidth.main(argv)


# --- the Hessian benchmark ------------------------------------------------------------------


def number(answer: str) -> float:
    return float(answer.split("= ")[1].split(" ")[0])


def test_hessian_benchmark_does_equal_work_on_both_sides():
    pytest.importorskip("pyhessian")
    settings = hessian_bench.Settings(
        examples=32, iters=3, probes=4, lanczos=3, hvp_repeats=1, probe_repeats=1
    )
    _, n, rows = hessian_bench.benchmark_case(
        "tiny", settings, "cpu", time.perf_counter, lambda *a: None
    )
    assert n == 64 * 8 + 8 + 8 * 10 + 10
    hvp, top, trace, density = rows
    # the same vector and Hessian: the same v^T H v; each call made one product
    assert number(hvp.answer["lsdl_lab"]) == pytest.approx(number(hvp.answer["PyHessian"]))
    assert hvp.hvps == {"lsdl_lab": 1, "PyHessian": 1}
    assert top.hvps["lsdl_lab"] <= 3 and top.hvps["PyHessian"] <= 3
    # Rademacher probes on CPU: both draw the same signs from the same seeded generator
    assert number(trace.answer["lsdl_lab"]) == pytest.approx(number(trace.answer["PyHessian"]))
    assert trace.hvps == {"lsdl_lab": 4, "PyHessian": 4}
    # PyHessian's density spends its products, then fails on current torch
    assert density.answer["PyHessian"].startswith("fails: RuntimeError")
    assert density.hvps == {"lsdl_lab": 3, "PyHessian": 3}
    assert density.answer["lsdl_lab"].startswith("Ritz values in [")
    for row in rows:
        assert all(ms[0] <= ms[1] <= ms[2] for ms in row.ms.values())
        assert row.speedup[0] <= row.speedup[1] <= row.speedup[2]


def test_hessian_quick_run_and_options(capsys):
    pytest.importorskip("pyhessian")
    text = hessian_bench.main(["--quick"])
    assert capsys.readouterr().out == text
    for probe in ("Hessian-vector product", "top eigenvalue", "trace", "density"):
        assert f"| {probe}" in text
    assert "fails: RuntimeError" in text and "load average at end" in text
    for argv in (["--cases", "vgg"], ["--probes", "1"], ["--iters", "0"], ["--budget", "-1"]):
        with pytest.raises(SystemExit):
            hessian_bench.main(argv)


def test_cheap_probes_get_more_pairs_up_to_the_cap():
    calls = {"lsdl_lab": 0, "PyHessian": 0}

    def fn(name):
        def call():
            calls[name] += 1

        return call

    clock = iter(range(10_000))  # each reading 1 s later: a round of two calls "takes" 1 s
    fns = {who: fn(who) for who in calls}
    row = hessian_bench.Row("probe")
    counts = {"lsdl_lab": lambda: 0, "PyHessian": lambda: 0}
    hessian_bench.timed(row, fns, counts, 3, lambda: next(clock), 6.0)
    # one untimed round, then 6 pairs
    assert row.pairs == 6 and calls == {"lsdl_lab": 7, "PyHessian": 7}
    row = hessian_bench.Row("probe")
    hessian_bench.timed(row, fns, counts, 3, lambda: next(clock), 1e6)
    assert row.pairs == hessian_bench.MAX_PAIRS
    row = hessian_bench.Row("probe")
    hessian_bench.timed(row, fns, counts, 3, lambda: next(clock), 0.5)
    assert row.pairs == 3  # never fewer than asked


# --- the project-cost script (no notebook is run) -------------------------------------------


def test_project_cost_options():
    args = project_cost.parse_args([])
    assert args.parts == list(project_cost.PARTS) and args.lab_filters == []
    args = project_cost.parse_args(["--only", "labs-smoke, book", "--labs", "lab01,lab03"])
    assert args.parts == ["labs-smoke", "book"] and args.lab_filters == ["lab01", "lab03"]
    for argv in (["--only", "docs"], ["--only", ""], ["--timeout", "0"]):
        with pytest.raises(SystemExit):
            project_cost.parse_args(argv)


def test_project_cost_commands(tmp_path):
    for name in ("lab02_b.ipynb", "lab01_a.ipynb", "notes.md"):
        (tmp_path / "labs").mkdir(exist_ok=True)
        (tmp_path / "labs" / name).write_text("{}")
    labs = project_cost.select_labs([], root=tmp_path)
    assert [p.name for p in labs] == ["lab01_a.ipynb", "lab02_b.ipynb"]
    assert project_cost.select_labs(["02"], root=tmp_path) == labs[1:]
    out = project_cost.commands(list(project_cost.PARTS), labs, tmp_path / "out")
    assert [(part, item) for part, item, _, _ in out] == [
        ("labs-smoke", "lab01_a"),
        ("labs-smoke", "lab02_b"),
        ("labs-cpu", "lab01_a"),
        ("labs-cpu", "lab02_b"),
        ("tests", "make test (without lint)"),
        ("book", "jupyter-book build"),
    ]
    envs = [env["LSDL_SCALE"] for _, _, _, env in out]
    assert envs == ["smoke", "smoke", "cpu", "cpu", "smoke", "cpu"]
    assert out[2][2][1:] == ["execute", "--timeout=-1", str(labs[0])]
    assert out[4][2][1:] == [
        "-m", "pytest", "-n", "2", "--dist", "loadfile", "tests",
    ]  # fmt: skip
    book = out[5][2]
    assert book[1:5] == ["build", ".", "-W", "--keep-going"]
    assert book[book.index("--path-output") + 1] == str(tmp_path / "out" / "book")


def test_project_cost_runs_a_command_with_one_thread_and_reports_failures():
    ok = project_cost.run_timed(
        "tests",
        "env",
        [sys.executable, "-c", "import os; assert os.environ['OMP_NUM_THREADS'] == '1'"],
        {"LSDL_SCALE": "smoke"},
        timeout=60,
    )
    assert ok.returncode == 0 and ok.status == "passed" and ok.seconds > 0 and ok.tail == ""
    assert ok.command.startswith("LSDL_SCALE=smoke python")
    bad = project_cost.run_timed(
        "labs-smoke", "x", [sys.executable, "-c", "raise SystemExit('broken lab')"], {}, 60
    )
    assert bad.status == "failed (1)" and "broken lab" in bad.tail
    slow = project_cost.run_timed(
        "book", "y", [sys.executable, "-c", "import time; time.sleep(5)"], {}, 0.2
    )
    assert slow.status == "timed out"


def test_project_cost_table():
    rows = [
        project_cost.Timing("labs-smoke", "lab01", "cmd a", 12.34, 0, "1.00, 0.5, 0.2", "1.50"),
        project_cost.Timing("labs-smoke", "lab02", "cmd b", 20.0, 1, "1.50", "2.00", "Error!"),
        project_cost.Timing("book", "jupyter-book build", "cmd c", 300.0, 0, "0.10", "0.90"),
    ]
    text = project_cost.table(rows, ["- machine line"])
    assert text.startswith("# What the project costs to run\n\n- machine line\n")
    assert "| labs-smoke | lab01 | 12.3 | passed | 1.00 → 1.50 |" in text
    assert "| labs-smoke | lab02 | 20.0 | failed (1) | 1.50 → 2.00 |" in text
    assert "| labs-smoke | 32.3 | 2 | 1 |" in text and "| book | 300.0 | 1 | 0 |" in text
    assert "- `cmd c`" in text and "Error!" in text


# --- python -m benchmarks --------------------------------------------------------------------


def test_run_all_options():
    assert run_all.parse_args([]).names == [
        "bandwidth",
        "hessian",
        "optimizers",
        "communication",
        "zero",
        "second-order",
    ]
    assert run_all.parse_args(["--only", "hessian"]).names == ["hessian"]
    for argv in (["--only", "gpu"], ["--quick", "--only", "project-cost"]):
        with pytest.raises(SystemExit):
            run_all.parse_args(argv)


def test_full_hands_each_benchmark_its_larger_settings(monkeypatch, capsys):
    calls = []
    from benchmarks import communication, second_order, zero

    every = (
        ("bandwidth", bandwidth),
        ("hessian", hessian_bench),
        ("optimizers", optimizers),
        ("communication", communication),
        ("zero", zero),
        ("second-order", second_order),
    )
    for name, module in every:
        monkeypatch.setattr(module, "main", lambda argv, name=name: calls.append((name, argv)))
    run_all.main(["--full"])
    assert calls == [(name, run_all.FULL[name]) for name, _ in every]
    calls.clear()
    run_all.main(["--only", "optimizers"])
    assert calls == [("optimizers", [])]
    # the values name real sizes and cases
    options = {name: dict(zip(argv[::2], argv[1::2])) for name, argv in run_all.FULL.items()}
    assert set(options["bandwidth"]["--sizes"].split(",")) <= set(optimizers.SIZES)
    assert set(options["hessian"]["--cases"].split(",")) <= set(hessian_bench.CASES)
    assert float(options["optimizers"]["--budget"]) > 1.5
    with pytest.raises(SystemExit):
        run_all.parse_args(["--quick", "--full"])


def test_a_gpu_run_writes_beside_not_over_the_cpu_tables(tmp_path):
    from benchmarks.timing import results_path

    default = tmp_path / "results" / "optimizers.md"
    assert results_path(default, "cpu") == default
    assert results_path(default, "cuda") == tmp_path / "results" / "cuda" / "optimizers.md"
    assert results_path(default, torch.device("cuda", 1)).parent.name == "cuda"
