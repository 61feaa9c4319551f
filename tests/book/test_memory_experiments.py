"""The measurements of Chapter 8 and Lab 8 on tiny GPTs: each returns what it claims, and
the claims the lab asserts hold at this size too."""

import math

import pytest
import torch

from lsdl_lab import optim
from lsdl_lab.book import memory_experiments as experiments
from lsdl_lab.memory import gpt_memory, theoretical_peak, zero_bytes
from lsdl_lab.memory.calculator import GPTShape
from lsdl_lab.models import GPT

VOCAB, BLOCK, LAYERS, HEADS, DIM = 16, 8, 2, 2, 16


def gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(VOCAB, BLOCK, LAYERS, HEADS, DIM)


def batches(step, rows=4):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(VOCAB, (rows, BLOCK), generator=g)
    return x, torch.roll(x, -1, dims=1)


def test_untied_gpt_is_the_same_function_with_its_own_output_weight():
    tied, untied = gpt(), experiments.untied_gpt(VOCAB, BLOCK, LAYERS, HEADS, DIM)
    assert untied.head.weight is not untied.tok.weight
    assert untied.num_parameters() == tied.num_parameters() + VOCAB * DIM
    x, _ = batches(0)
    assert torch.equal(tied(x), untied(x))


def test_zero_per_rank_holds_the_formula_and_the_same_losses():
    ranks = experiments.zero_per_rank((VOCAB, BLOCK, LAYERS, HEADS, DIM), [batches(0)], 2)
    assert len(ranks) == 2
    for rank, out in enumerate(ranks):
        for stage in (1, 2, 3):
            run = out[stage]
            expected = zero_bytes(run["padded"], stage, 2)
            steps = 4 * len(run["units"])  # torch's Adam: a float32 step per shard
            expected["optimizer_state"] += steps
            expected["total"] += steps
            assert run["held"] == expected
            assert sum(u["numel"] for u in run["units"]) == run["numel"]
            for u in run["units"]:
                size = u["padded"] // 2
                assert u["own"] == (rank * size, (rank + 1) * size)
                assert sum(u["sizes"]) == u["numel"]
        assert out[1]["losses"] == out[2]["losses"] == out[3]["losses"]
    with pytest.raises(ValueError, match="Invalid stage"):
        experiments.zero_per_rank((VOCAB, BLOCK, LAYERS, HEADS, DIM), [batches(0)], 2, (0,))


def test_optimizer_state_and_curves():
    opts = {"Adam": lambda p: optim.Adam(p, lr=1e-2), "Adafactor": lambda p: optim.Adafactor(p)}
    state = experiments.optimizer_state(gpt, opts, batches(0))
    psi = gpt().num_parameters()
    assert state["Adam"]["optimizer_state"] == 8 * psi
    assert state["Adafactor"]["optimizer_state"] < state["Adam"]["optimizer_state"] / 4
    curves = experiments.train_curves(gpt, opts, batches, 5)
    assert [len(c) for c in curves.values()] == [5, 5]
    assert curves["Adam"][0] == curves["Adafactor"][0]  # the same model and first batch


def test_gradient_underflow_is_lost_without_scaling_and_kept_with_it():
    u = experiments.gradient_underflow(gpt(), batches(0), loss_factor=2.0**-14)
    assert u["zero_float32"] == 0.0
    assert u["zero_fp16"] > 10 * u["zero_fp16_scaled"]
    assert u["relative_error_fp16_scaled"] < 0.01 < u["relative_error_fp16"]
    with pytest.raises(ValueError, match="Invalid loss_factor"):
        experiments.gradient_underflow(gpt(), batches(0), loss_factor=0.0)


def test_precision_curves_retry_a_skipped_step_on_the_same_batch():
    runs = experiments.precision_curves(
        gpt, lambda p: optim.Adam(p, lr=1e-2), batches, 8,
        modes=("fp32", "fp16 + scaler"), init_scale=2.0**40, growth_interval=100,
    )  # fmt: skip
    scaled = runs["fp16 + scaler"]
    assert scaled["skipped"] and scaled["skipped"][0] == 0
    assert all(b == 0 for b in scaled["batch"][: len(scaled["skipped"])])
    assert scaled["scales"][0] == 2.0**40
    fp32 = runs["fp32"]["losses"]
    for loss, b in zip(scaled["losses"], scaled["batch"]):
        assert math.isclose(loss, fp32[b], rel_tol=0.02)
    with pytest.raises(ValueError, match="Invalid mode"):
        experiments.precision_curves(gpt, optim.Adam, batches, 1, modes=("fp8",))


def test_segment_peak_and_the_sweeps():
    assert experiments.segment_peak(16, None, 1, 3) == 48
    assert experiments.segment_peak(16, 4, 1, 1) == theoretical_peak(16, 4) - 1
    assert experiments.segment_peak(16, 1, 2, 30) == 15 * 2 + 30
    rows = experiments.gpt_checkpoint_sweep(GPT(VOCAB, BLOCK, 4, HEADS, DIM), batches(0)[0])
    i, a = rows[0]["input_bytes"], rows[0]["unit_bytes"]
    assert i == 4 * BLOCK * DIM * 4
    for r in rows[1:]:
        assert r["peak_bytes"] == pytest.approx(
            experiments.segment_peak(4, r["every"], i, a), rel=0.03
        )
    chain = experiments.tanh_chain(4, 8)
    assert [type(m).__name__ for m in chain[0]] == ["Linear", "Tanh"]


def test_measure_gpt_against_the_calculator():
    m = experiments.measure_gpt(gpt(), batches(0), lambda p: torch.optim.Adam(p))
    calc = gpt_memory(GPTShape(LAYERS, DIM, HEADS, BLOCK, 4, VOCAB), precision="fp32",
                      dropout=False, attention="fused")  # fmt: skip
    assert m["params"] == calc["params"] and m["grads"] == calc["grads"]
    assert abs(m["activations"] / calc["activations"] - 1) < 0.25
    assert m["total"] == sum(m[k] for k in ("params", "grads", "optimizer_state", "activations"))
