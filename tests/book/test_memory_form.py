"""The calculator's table and form: the numbers are gpt_memory's, every control redraws,
and a bad combination shows its error in place of the table."""

import re

import pytest

from lsdl_lab.book.memory_form import COLUMNS, calculator_form, memory_table, trade_offs
from lsdl_lab.memory import GPTShape, gpt_memory, zero_bytes

SHAPE = GPTShape(4, 64, 4, 32, 2, 100)


def cells(table: str) -> list[float]:
    return [float(v.replace(",", "")) for v in re.findall(r"<td[^>]*>([\d,.]+)</td>", table)]


def test_memory_table_shows_each_category_in_gib_or_gb():
    row = {"params": 2**30, "grads": 2**31, "optimizer_state": 3 * 2**30, "total": 6 * 2**30}
    table = memory_table({"a <b>": row})
    assert cells(table) == [1.0, 2.0, 3.0, 6.0]
    assert "a &lt;b&gt;" in table and "activations" not in table
    assert cells(memory_table({"x": {"total": 1e9}}, unit="GB")) == [1.0]
    paper = memory_table({s: zero_bytes(7.5e9, s, 64) for s in range(4)}, unit="GB")
    assert [round(v, 1) for v in cells(paper)[3::4]] == [120.0, 31.4, 16.6, 1.9]
    with pytest.raises(ValueError, match="Invalid unit"):
        memory_table({"x": row}, unit="MB")
    with pytest.raises(ValueError, match="Invalid rows"):
        memory_table({})


def test_trade_offs_cover_every_stage_and_policy():
    rows = trade_offs(SHAPE, dp=4, precision="bf16")
    assert len(rows) == 12
    assert rows["ZeRO-3, recompute full"] == gpt_memory(SHAPE, zero_stage=3, dp=4, recompute="full")


def test_form_redraws_on_every_control():
    pytest.importorskip("ipywidgets")
    form = calculator_form(SHAPE, dp=4)

    def shown():
        return form.output.outputs[0]["data"]["text/html"]

    expected = gpt_memory(SHAPE, dp=4)
    assert cells(shown())[-1] == pytest.approx(expected["total"] / 2**30, abs=0.01)
    form.controls["zero_stage"].value = 3
    assert cells(shown())[0] == pytest.approx(
        gpt_memory(SHAPE, dp=4, zero_stage=3)["params"] / 2**30, abs=0.01
    )
    form.controls["heads"].value = 3
    assert "Invalid heads" in shown()
    form.controls["heads"].value = 4
    assert "<table>" in shown()
    form.controls["optimizer"].value = "adam8bit"
    form.controls["fp8"].value = True
    new = gpt_memory(SHAPE, dp=4, zero_stage=3, optimizer="adam8bit", fp8=True)
    assert cells(shown()) == pytest.approx([new[c] / 2**30 for c in COLUMNS], abs=0.01)
    assert set(form.controls) == {
        "layers", "hidden", "heads", "seq_len", "micro_batch", "vocab", "dp",
        "precision", "optimizer", "zero_stage", "recompute", "fp8",
    }  # fmt: skip
