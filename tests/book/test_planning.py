"""The planner at lab scale: on a given alpha-beta, and against a measured world-2 run of
the entry point (one spawned world: the link's fit, then a DDP and an FSDP2 run)."""

import functools
import math
import statistics

import pytest

from lsdl_lab.book.planning import (
    by_context_degree,
    lab_cluster,
    measure_link,
    plan_lab,
    planned_run,
    run_model,
    step_flop_rate,
)
from lsdl_lab.distributed import call_each, spawn
from lsdl_lab.distributed.cost import AlphaBeta, ring_all_reduce_time
from lsdl_lab.memory.calculator import gpt_param_shapes
from lsdl_lab.plan import Cluster, ModelShape, Techniques
from lsdl_lab.run import Config, run_rank, train

LAB = ModelShape(layers=2, hidden=64, heads=4, seq_len=64, vocab=256, global_batch=8)


def test_context_parallelism_lets_the_sequence_grow():
    # 16 GPUs of 12 GB (A100 links): a 128K sequence fits no layout without context
    # parallelism, whatever tensor parallelism and ZeRO do; with 2, 4 or 8 ranks to a
    # sequence it does (3 divides neither the sequence nor the devices).
    cluster = Cluster(16, 8, 12e9, 300e9, 5e-6, 25e9, 10e-6, 312e12)
    model = ModelShape(8, 1024, 16, 131072, 32768, 16)
    techniques = Techniques(pp=(1,), micro_batches=(1,), recompute=("selective",),
                            attention="fused", dropout=False)  # fmt: skip
    best = by_context_degree(model, cluster, techniques, (1, 2, 4, 8, 3))
    assert best[1] is None and best[3] is None
    for c in (2, 4, 8):
        assert best[c].cp == c and best[c].bytes_per_device <= cluster.usable
    with pytest.raises(ValueError, match="Invalid techniques"):
        by_context_degree(model, cluster, Techniques())
    with pytest.raises(ValueError, match="Invalid degrees"):
        by_context_degree(model, cluster, techniques, (0,))


def test_lab_plan_uses_the_measured_link():
    # Given alpha and beta (as fit_alpha_beta would give from gloo at world 2); the check
    # against a measured world-2 run is for Chapter 9, not done here.
    link = AlphaBeta(alpha=50e-6, beta=1e-9)
    configs = plan_lab(LAB, link, memory=1e9, peak_flops=1e10)
    assert {(c.dp, c.tp, c.pp) for c in configs} == {(2, 1, 1), (1, 2, 1), (1, 1, 2)}
    (dp,) = [c for c in configs if c.dp == 2 and c.zero_stage == 0][:1]
    psi = sum(math.prod(s) for s in gpt_param_shapes(LAB.shape(1)))
    assert dp.communication["dp"] == pytest.approx(
        ring_all_reduce_time(4 * psi, 2, link.alpha, link.beta), rel=1e-12
    )
    # A fast link: data parallelism (no bubble, one all-reduce) is first; a link a
    # million times slower per byte makes communication dominate and changes the order.
    assert (configs[0].dp, configs[0].tp, configs[0].pp) == (2, 1, 1)
    slow = plan_lab(LAB, AlphaBeta(alpha=50e-6, beta=1e-3), memory=1e9, peak_flops=1e10)
    assert (slow[0].dp, slow[0].tp, slow[0].pp) == (1, 1, 2)  # b s h per message < Psi
    assert lab_cluster(link, memory=1e9, peak_flops=1e10).link(False) == link


# The model states (parameters, gradients, Adam's two moments) are counted exactly by the
# calculator; FSDP2 pads each flat shard to equal sizes (measured: 128 bytes more on rank
# 0). The run's records do not count activations, so neither does the comparison.
MEMORY_FACTOR = 1.05
# The step time: compute at the FLOP rate one process achieved on the same step (all its
# overheads included), halved over two ranks, plus the ring all-reduce on the fitted
# link, nothing overlapped. What it cannot see: two ranks on a shared 2-core machine
# do not halve the time (per-operation overheads stay, the ranks compete with each other
# and other work for the cores), and a collective under load costs more than the fit,
# made from the fastest calls. So the estimate is a lower bound (load only slows the run;
# 0.7 for the noise of the one-process rate) and no better than a factor of 30 above:
# measured on the loaded development machine, 1.5-6.3x (DDP) and 3.4-13.4x (FSDP2, a
# dozen small collectives a step) over four sessions.
TIME_LOW, TIME_HIGH = 0.7, 30.0


def test_lab_plan_against_a_measured_world_of_two(tmp_path):
    base = Config(model="gpt", profile="smoke", width=64, depth=2, heads=4, block_size=32,
                  steps=6, global_batch=16, progress=False, timeout=60.0)  # fmt: skip
    model = run_model(base)
    assert (model.layers, model.hidden, model.heads, model.seq_len) == (2, 64, 4, 32)
    one = train(base.replace(out_dir=str(tmp_path / "one")))
    assert one[-1]["memory"][0]["params"] == 4 * model.params  # the planner's GPT is the run's
    runs = {p: base.replace(parallel=p, out_dir=str(tmp_path / p)) for p in ("ddp", "fsdp2")}
    workers = [functools.partial(measure_link, nbytes=(4096, 1 << 18, 1 << 20), repeats=3)]
    workers += [functools.partial(run_rank, config=c) for c in runs.values()]
    link, *records = spawn(call_each, 2, workers, timeout=120)[0]
    # the one-process rate, measured before and after the world, the faster kept: another
    # test's work on the shared cores during one measurement only slows it (load made the
    # world's DDP step 0.58 of an estimate from a slowed rate once, in a CI run)
    again = train(base.replace(out_dir=str(tmp_path / "again")))
    rate = max(step_flop_rate(model, one), step_flop_rate(model, again))
    # loopback: under 0.1 s a message, faster than 1 MB/s (a fit may put one at 0)
    assert 0 <= link.alpha < 0.1 and 0 <= link.beta < 1e-6
    for parallel, measured in zip(runs, records, strict=True):
        planned = planned_run(model, link, rate, parallel=parallel)
        assert (planned.dp, planned.zero_stage) == (2, 0 if parallel == "ddp" else 3)
        states = planned.memory["total"] - planned.memory["activations"]
        held = measured[-1]["memory"][0]["total"]
        assert 1 / MEMORY_FACTOR < held / states < MEMORY_FACTOR, (parallel, held, states)
        step = statistics.median(r["step_time_s"] for r in measured[1:])
        assert TIME_LOW < step / planned.step_time < TIME_HIGH, (parallel, step, planned)
    with pytest.raises(ValueError, match="Invalid parallel"):
        planned_run(model, link, rate, parallel="tp")
    with pytest.raises(ValueError, match="Invalid micro_batch"):
        planned_run(model, link, rate, micro_batch=3)
    with pytest.raises(ValueError, match="Invalid config"):
        run_model(base.replace(model="mlp"))
