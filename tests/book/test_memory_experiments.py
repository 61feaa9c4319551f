"""The measurements of Chapter 8 and Lab 8 on tiny GPTs: each returns what it claims, and
the claims the lab asserts hold at this size too."""

import math

import pytest
import torch
from torch import nn

from lsdl_lab import optim
from lsdl_lab.book import memory_experiments as experiments
from lsdl_lab.memory import gpt_memory, theoretical_peak, zero_bytes
from lsdl_lab.memory.calculator import GPTShape
from lsdl_lab.models import GPT
from lsdl_lab.train import LossFunction, fit, train_step

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


def test_logged_step_is_fits_default_step_and_keeps_every_loss():
    # fit with the default train_step and fit with a LoggedStep: the same arithmetic, bit
    # for bit, and the step keeps the loss of every step that fit logs
    models, steps = [gpt(), gpt()], [train_step, experiments.LoggedStep()]
    histories = [
        fit(m, optim.Adam(m.parameters(), lr=1e-2), batches, 4, step=s,
            task=LossFunction(experiments.lm_loss), log_every=1, progress=False)
        for m, s in zip(models, steps)
    ]  # fmt: skip
    for a, b in zip(*(m.parameters() for m in models), strict=True):
        assert torch.equal(a, b)
    assert histories[0].series("loss") == histories[1].series("loss")
    assert steps[1].losses == histories[1].series("loss")[1]
    assert len(set(steps[1].losses)) == 4 and steps[1].taken == 4 and not steps[1].skipped


def test_every_training_run_stops_at_the_dry_runs_cap(monkeypatch):
    # lsdl_lab.profiles: a dry run caps every loop at LSDL_MAX_STEPS; fit's step counter
    # does it for each run of this module, the precision runs included
    moments = experiments.moment_block_errors(gpt, batches, 2, block_size=64, min_size=64)
    monkeypatch.setenv("LSDL_MAX_STEPS", "2")
    opts = {"Adam": lambda p: optim.Adam(p, lr=1e-2)}
    assert [len(c) for c in experiments.train_curves(gpt, opts, batches, 7).values()] == [2]
    runs = experiments.precision_curves(gpt, opts["Adam"], batches, 7, modes=("fp32", "bf16"))
    assert [(len(r["losses"]), r["batch"]) for r in runs.values()] == [(2, [0, 1])] * 2
    runs = experiments.fp8_curves(gpt, opts["Adam"], batches, 7, {"fp32": "fp32"})
    assert len(runs["fp32"]["losses"]) == 2
    capped = experiments.moment_block_errors(gpt, batches, 9, block_size=64, min_size=64)
    for name in moments:  # nine steps capped at two are the two steps, bit for bit
        assert torch.equal(capped[name]["error"], moments[name]["error"])
        assert capped[name]["relative"] == moments[name]["relative"]
    # the ranks read the cap from the environment; a dry run's text batch holds one
    # sequence, which each rank then trains on (the same losses), not on an empty half
    three = [batches(t, rows=1) for t in range(3)]
    ranks = experiments.zero_per_rank((VOCAB, BLOCK, LAYERS, HEADS, DIM), three, 2, (1,))
    assert [len(out[1]["losses"]) for out in ranks] == [2, 2]
    assert ranks[0][1]["losses"] == ranks[1][1]["losses"]
    assert all(math.isfinite(loss) for loss in ranks[0][1]["losses"])


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


# -- 8-bit states and FP8 --------------------------------------------------------------------


def test_moment_block_errors_are_within_the_bound_and_v_stays_non_negative():
    blocks = experiments.moment_block_errors(gpt, batches, 5, block_size=64, min_size=64)
    psi = sum(p.numel() for p in gpt().parameters() if p.numel() >= 64)
    for name, b in blocks.items():
        assert len(b["absmax"]) == len(b["error"]) >= psi / 64
        assert b["gap"] == pytest.approx(0.9 / (64 if name == "exp_avg" else 128), rel=1e-4)
        assert torch.all(b["error"] <= b["gap"] / 2 * b["absmax"] * (1 + 1e-4))
        assert torch.any(b["error"] > 0) and 0 < b["relative"] < 0.02
    assert blocks["exp_avg"]["negative"] > 0  # m has both signs
    assert blocks["exp_avg_sq"]["negative"] == 0
    v = blocks["exp_avg_sq"]
    assert v["zeroed_linear"] > v["zeroed"]
    with pytest.raises(ValueError, match="Invalid steps"):
        experiments.moment_block_errors(gpt, batches, 0)


def test_fp8_operands_are_each_linears_three_operands():
    model = gpt()
    ops = experiments.fp8_operands(model, batches(0), skip=("head",))
    linears = [m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "head"]
    assert {k: len(v) for k, v in ops.items()} == {k: len(linears) for k in ops}
    assert [w.shape for w in ops["weight"]] == [m.weight.shape for m in linears]
    for x, m in zip(ops["input"], linears):
        assert x.shape == (4, BLOCK, m.in_features)
    # the backward hooks fire in reverse order
    widths = sorted(m.out_features for m in linears)
    assert sorted(g.shape[-1] for g in ops["grad_output"]) == widths
    assert all(p.grad is None for p in model.parameters())
    assert len(experiments.fp8_operands(model, batches(0))["weight"]) == len(linears) + 1


def test_fp8_cast_errors_count_what_each_cast_loses():
    big = torch.tensor([1000.0, 3.0, 0.01, 1e-4])  # Chapter 8's exercise
    casts = experiments.fp8_cast_errors({"x": [big, big]}, ("e4m3", "e5m2"), ("none", "tensor"))
    assert casts["x", "e4m3", "none"] == pytest.approx(
        {"values": 8, "overflow": 2 / 8, "underflow": 2 / 8, "error": 552 / 1000}, rel=1e-4
    )
    assert casts["x", "e4m3", "tensor"]["overflow"] == 0.0
    assert casts["x", "e4m3", "tensor"]["underflow"] == 2 / 8
    assert casts["x", "e5m2", "tensor"]["underflow"] == 0.0
    ops = experiments.fp8_operands(gpt(), batches(0))
    casts = experiments.fp8_cast_errors(ops)
    assert len(casts) == 3 * 2 * 3
    for op in ops:
        e4, e5 = casts[op, "e4m3", "tensor"]["error"], casts[op, "e5m2", "tensor"]["error"]
        assert 1.5 < e5 / e4 < 2.5 and e4 < 2.0**-4


def test_fp8_curves_train_each_recipe_on_the_same_batches():
    recipes = {"fp32": "fp32", "bf16": "bf16", "tensor": {"scaling": "tensor"},
               "broken": {"scaling": "none", "backward_format": "e4m3"}}  # fmt: skip
    runs = experiments.fp8_curves(gpt, lambda p: torch.optim.AdamW(p, lr=1e-2), batches, 6, recipes)
    assert [len(r["losses"]) for r in runs.values()] == [6] * 4
    assert "counts" not in runs["fp32"] and "counts" not in runs["bf16"]
    fp32, tensor = runs["fp32"]["losses"], runs["tensor"]["losses"]
    assert abs(tensor[0] - fp32[0]) < 0.02 and tensor != fp32
    assert runs["tensor"]["counts"]["grad_output"]["overflows"] == 0
    broken = runs["broken"]["counts"]["grad_output"]
    assert broken["underflows"] > 10 * runs["tensor"]["counts"]["grad_output"]["underflows"]
    linears = [m for n, m in gpt().named_modules() if isinstance(m, nn.Linear) and n != "head"]
    tokens = 6 * 4 * BLOCK  # six steps of four sequences
    assert runs["tensor"]["counts"]["input"]["values"] == tokens * sum(
        m.in_features for m in linears
    )
    with pytest.raises(ValueError, match="Invalid recipe"):
        experiments.fp8_curves(gpt, torch.optim.AdamW, batches, 1, {"x": "fp16"})
