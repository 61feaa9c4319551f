"""lsdl_lab.checkpoint: sharded checkpoints of torch.distributed.checkpoint (a step
directory complete once its state.pt is written, an asynchronous save that copies first and
blocks training less than a synchronous one, a checkpoint of other tensors named with what
differs, a run of a tensor's elements tiled by boxes, in order, each contiguous, at most
2k - 1 of them) and how often to checkpoint (Young's and Daly's intervals, Daly's complete model of
the waste). The worlds of ranks are in tests/run/test_checkpoint.py."""

import itertools
import math
import statistics

import numpy as np
import pytest
import torch

from lsdl_lab.checkpoint import (
    CheckpointError,
    boxes,
    daly_interval,
    expected_waste,
    latest_sharded,
    load,
    load_sharded,
    read_sharded,
    save_sharded,
    young_interval,
)

FORMAT = "test/1"
MINUTE, HOUR = 60.0, 3600.0


# -- how often ---------------------------------------------------------------------------


def test_daly_interval_gives_the_papers_own_optima():
    # Daly (2006), Figs. 3-5: delta = 5 min, M = 24 h, 6 h and 15 min give 117, 57 and 9.1
    # minutes (the figures' digits)
    for mtbf, expected, digits in ((24 * HOUR, 117, 0), (6 * HOUR, 57, 0), (15 * MINUTE, 9.1, 1)):
        assert round(daly_interval(5 * MINUTE, mtbf) / MINUTE, digits) == expected
    # a checkpoint that takes longer than 2 M: checkpoint every M
    assert daly_interval(3.0, 1.0) == 1.0 and daly_interval(2.0, 1.0) == 1.0


def _best_interval(delta, mtbf, restart=0.0) -> float:
    """The interval that minimizes Daly's complete model, by a fine grid around Young's."""
    young = young_interval(delta, mtbf)
    grid = np.geomspace(young / 20, min(20 * young, 50 * mtbf), 20001)
    waste = [expected_waste(t, delta, mtbf, restart) for t in grid]
    return float(grid[int(np.argmin(waste))])


@pytest.mark.parametrize("ratio", [1e-4, 1e-3, 1e-2, 0.1, 0.5])
def test_daly_interval_is_the_optimum_of_his_model_and_wastes_less_than_youngs(ratio):
    mtbf = 3 * HOUR
    delta = ratio * mtbf
    best = _best_interval(delta, mtbf, restart=10 * MINUTE)
    daly, young = daly_interval(delta, mtbf), young_interval(delta, mtbf)
    # the perturbation series is within 1% of the optimum up to delta = M / 2
    assert daly == pytest.approx(best, rel=0.01)
    assert abs(daly - best) < abs(young - best)
    assert expected_waste(daly, delta, mtbf, 600.0) <= expected_waste(young, delta, mtbf, 600.0)


def test_daly_is_youngs_less_two_thirds_of_the_checkpoint_for_a_small_one():
    mtbf = 3 * HOUR
    for ratio in (1e-6, 1e-5):
        delta = ratio * mtbf
        gap = young_interval(delta, mtbf) - daly_interval(delta, mtbf)
        # sqrt(2dM)(1 + sqrt(d/2M)/3 + ...) - d = sqrt(2dM) + d/3 - d + O(d^1.5 / sqrt(M))
        assert gap / delta == pytest.approx(2 / 3, abs=0.01)
    # the two agree to first order: relative to the interval the gap vanishes
    assert (young_interval(1.0, 1e6) - daly_interval(1.0, 1e6)) / young_interval(1.0, 1e6) < 1e-3


def test_the_complete_model_reduces_to_youngs_first_order_waste():
    # delta / tau + (tau / 2 + R) / M when every time is small against M
    delta, mtbf, restart = 10.0, 100 * HOUR, 60.0
    tau = young_interval(delta, mtbf)
    first_order = delta / tau + (tau / 2 + restart) / mtbf
    assert expected_waste(tau, delta, mtbf, restart) == pytest.approx(first_order, rel=0.01)
    assert expected_waste(tau, 0.0, mtbf) < expected_waste(tau, delta, mtbf)


def test_bad_arguments_are_named():
    for call, message in [
        (lambda: young_interval(0.0, 1.0), "Invalid delta: 0.0"),
        (lambda: daly_interval(1.0, -1.0), "Invalid mtbf: -1.0"),
        (lambda: expected_waste(0.0, 1.0, 1.0), "Invalid tau: 0.0"),
        (lambda: expected_waste(1.0, 1.0, 1.0, -2.0), "Invalid restart: -2.0"),
    ]:
        with pytest.raises(ValueError, match=message):
            call()


# -- sharded checkpoints in one process --------------------------------------------------


def _state(scale: float = 1.0, n: int = 1000) -> dict:
    return {f"model.w{i}": torch.full((n,), float(scale * (i + 1))) for i in range(4)}


def test_a_sharded_save_round_trips_and_completes_only_when_its_state_is_written(tmp_path):
    root = tmp_path / "ckpt"
    for step in (1, 2):
        pending = save_sharded(root, step, _state(step), FORMAT, step=step, lr=0.1)
        assert pending.blocked > 0
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002"]  # the older removed
    latest = latest_sharded(root)
    assert latest == root / "step-00000002"
    into = _state(0.0)
    state = load_sharded(latest, into, FORMAT)
    assert state["step"] == 2 and state["lr"] == 0.1 and state["format"] == FORMAT
    for name, t in _state(2).items():
        assert torch.equal(into[name], t)
    whole, _ = read_sharded(latest, FORMAT)
    assert set(whole) == set(into) and torch.equal(whole["model.w3"], into["model.w3"])
    # an asynchronous save not yet waited for is not a checkpoint: no state.pt
    pending = save_sharded(root, 3, _state(3), FORMAT, asynchronous=True, step=3)
    getattr(pending.future, "upload_completion", pending.future).result()  # DCP's files written
    assert latest_sharded(root) == root / "step-00000002"
    pending.wait()
    assert latest_sharded(root) == root / "step-00000003"
    assert load(root / "step-00000003" / "state.pt", FORMAT)["step"] == 3


def test_an_async_save_writes_the_state_of_its_call_not_what_training_made_of_it(tmp_path):
    state = _state(1.0, n=200_000)
    pending = save_sharded(tmp_path, 1, state, FORMAT, asynchronous=True, step=1)
    for t in state.values():  # training goes on and updates the tensors in place
        t.mul_(-3.0)
    pending.wait()
    into = _state(0.0, n=200_000)
    load_sharded(latest_sharded(tmp_path), into, FORMAT)
    for name, t in _state(1.0, n=200_000).items():
        assert torch.equal(into[name], t), name


def test_tensors_of_another_model_are_refused_naming_what_differs(tmp_path):
    save_sharded(tmp_path, 1, _state(), FORMAT, step=1)
    latest = latest_sharded(tmp_path)
    other = {**_state(), "model.w9": torch.zeros(3)}
    other["model.w1"] = torch.zeros(7)
    del other["model.w0"]
    other["model.w2"] = torch.zeros(1000, dtype=torch.float64)
    with pytest.raises(CheckpointError) as caught:
        load_sharded(latest, other, FORMAT)
    message = str(caught.value)
    assert message.startswith(f"checkpoint {latest} was written by another model")
    assert "it lacks: model.w9" in message
    assert "it has tensors this run does not: model.w0" in message
    assert "model.w1 (1000,) torch.float32 (this run: (7,) torch.float32)" in message
    assert "model.w2 (1000,) torch.float32 (this run: (1000,) torch.float64)" in message
    with pytest.raises(CheckpointError, match=r"model\.w1 \(1000,\) torch\.float32 \(this run"):
        read_sharded(latest, FORMAT, {"model.w1": (torch.Size([7]), torch.float32)})
    with pytest.raises(CheckpointError, match="is not a other checkpoint"):
        load_sharded(latest, _state(), "other/1")


def test_an_async_save_blocks_training_for_less_time_than_a_sync_save(tmp_path):
    """The stall of a save: the time the caller waits before it can train again. A
    synchronous save serializes and writes 32 MB (8 tensors of 1M float32) and fsyncs each
    file; an asynchronous one copies them to host memory and returns, a thread writing.
    Measured on 2 idle cores: 120-200 ms against 10-60 ms (torch 2.13 and 2.9); the
    asynchronous total (copy and background write) is no shorter than the synchronous save:
    only the stall is. Medians of 5, each save waited for before the next, so neither
    competes with the other's thread; the margin (0.6) leaves room for a loaded machine."""
    state = {f"model.w{i}": torch.randn(1_000_000) for i in range(8)}
    blocked = {False: [], True: []}
    for k in range(6):
        for asynchronous in (False, True):
            pending = save_sharded(tmp_path / str(asynchronous), k, state, FORMAT,
                                   asynchronous=asynchronous, step=k)  # fmt: skip
            pending.wait()
            if k:  # the first of each: thread pools and files created
                blocked[asynchronous].append(pending.blocked)
    sync, background = statistics.median(blocked[False]), statistics.median(blocked[True])
    assert background < 0.6 * sync, (blocked, background / sync)
    assert math.isfinite(sync) and sync > 0


# -- a run of elements as boxes (what a ZeRO rank writes) -----------------------------------


def _elements(shape, offsets, sizes) -> list[int]:
    """The row-major flat indices of a box, in the order a row-major copy of it reads them."""
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    ranges = [range(o, o + n) for o, n in zip(offsets, sizes)]
    return [sum(i * s for i, s in zip(index, strides)) for index in itertools.product(*ranges)]


def test_the_boxes_of_a_run_tile_it_in_order_each_contiguous_at_most_2k_minus_1():
    # every shape of 1 to 3 dimensions of sizes 1 to 3, two of 4 dimensions, and every run
    # [start, stop) of each
    shapes = [s for k in (1, 2, 3) for s in itertools.product(range(1, 4), repeat=k)]
    shapes += [(3, 2, 2, 2), (2, 1, 3, 2)]
    longest = 0
    for shape in shapes:
        n = math.prod(shape)
        for start, stop in itertools.combinations_with_replacement(range(n + 1), 2):
            found, at = boxes(shape, start, stop), start
            for offsets, sizes in found:
                assert len(offsets) == len(sizes) == len(shape)
                assert all(0 <= o and o + m <= d for o, m, d in zip(offsets, sizes, shape))
                assert all(m > 0 for m in sizes), (shape, start, stop, found)
                # contiguous, and next in order: a row-major copy of it is the next elements
                count = math.prod(sizes)
                assert _elements(shape, offsets, sizes) == list(range(at, at + count))
                at += count
            assert at == stop, (shape, start, stop, found)
            assert len(found) <= 2 * len(shape) - 1, (shape, start, stop, found)
            longest = max(longest, len(found))
    assert longest == 2 * 4 - 1  # the bound is reached: the property is not vacuous
