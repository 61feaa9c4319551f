"""The FP8 product benchmark's machinery on the CPU (its timing needs a GPU of compute
capability 8.9 or later: ``make test-gpu`` runs it there). ``torch._scaled_mm`` is private:
these tests call it on the CPU, where torch has a reference kernel, so that a torch that
renames it or changes what its scales mean fails here first."""

import pytest
import torch

from benchmarks import fp8_matmul
from lsdl_lab.memory.fp8 import dequantize_fp8


def test_scaled_mm_multiplies_the_dequantized_operands():
    x = fp8_matmul.operands(32, 64, 48, torch.device("cpu"), seed=1)
    assert x.a8.dtype == x.b8.dtype == torch.float8_e4m3fn
    assert x.b8.stride() == (1, 64)  # column-major, as _scaled_mm wants its second operand
    product = fp8_matmul.fp8_product(x)
    assert product.dtype == torch.bfloat16 and product.shape == (32, 48)
    # the inverse scales turn the FP8 values back into the operands: the product is that of
    # the dequantized matrices, to bf16's rounding of the result
    exact = dequantize_fp8(x.a8, 1 / x.inv_a) @ dequantize_fp8(x.b8.t(), 1 / x.inv_b).t()
    assert torch.allclose(product.float(), exact, rtol=2**-7, atol=1e-2)
    # and it is the bf16 product up to e4m3's rounding of the operands (3 mantissa bits:
    # a few percent), not more and not exactly
    error = fp8_matmul.relative_error(product, fp8_matmul.bf16_product(x))
    assert 1e-3 < error < 0.1, error


def test_a_row_and_its_report(tmp_path):
    row = fp8_matmul.measure(64, torch.device("cpu"), repeats=2)
    assert row.size == 64 and row.bf16_ms > 0 and row.fp8_ms > 0 and 1e-3 < row.error < 0.1
    assert row.speedup == pytest.approx(row.bf16_ms / row.fp8_ms)
    assert row.tflops(1.0) == pytest.approx(2 * 64**3 / 1e-3 / 1e12)
    text = fp8_matmul.report([row], ["- machine: test"], torch.device("cpu"))
    assert "rehearsal without an FP8 GPU" in text and "| 64 |" in text


def test_it_refuses_without_an_fp8_gpu_and_bad_sizes(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        fp8_matmul.main([])
    assert "no FP8 GPU here" in capsys.readouterr().err
    with pytest.raises(ValueError, match="Invalid k: 40"):
        fp8_matmul.operands(32, 40, 32, torch.device("cpu"))
    with pytest.raises(SystemExit):
        fp8_matmul.main(["--allow-cpu", "--sizes", "a,b", "--out", str(tmp_path / "r.md")])
    assert "Invalid --sizes" in capsys.readouterr().err
    assert (
        fp8_matmul.main(
            ["--allow-cpu", "--sizes", "32", "--repeats", "1", "--out", str(tmp_path / "r.md")]
        )
        == 0
    )
    assert "| 32 |" in (tmp_path / "r.md").read_text()
