"""The checkers of Lab 8 accept right answers, reject the usual wrong ones with a hint that
names the mistake, and pass the exercise stub's NotImplementedError through; their
references are the library (LossScaler, Adafactor, ZeroOptimizer's partition)."""

from __future__ import annotations

import math

import pytest
import torch

from lsdl_lab import check, optim
from lsdl_lab.check import PLACEHOLDER_MESSAGE, CheckFailed
from lsdl_lab.exercises import lab08
from lsdl_lab.memory import LossScaler

# -- the references are the library --------------------------------------------------------


def test_scaler_update_reference_replays_the_library_scaler():
    scaler = LossScaler(2.0**10, growth_interval=3)
    p = torch.zeros(2, requires_grad=True)
    state = (scaler.get_scale(), 0)
    for found_inf in (False, True, False, False, False, True, True, False):
        p.grad = torch.tensor([1.0, math.inf if found_inf else 2.0])
        scaler.unscale_(torch.optim.SGD([p], lr=0.0))
        scaler.update()
        state = lab08.scaler_update(*state, found_inf, 3)
        assert state == (scaler.get_scale(), scaler.state_dict()["_growth_tracker"])
    assert lab08.scaler_update(1.0, 0, True) == (1.0, 0)  # the floor
    assert lab08.scaler_update(2.0**16, 1999, False) == (2.0**17, 0)


def test_factored_second_moment_reference_is_adafactors_first_step():
    torch.manual_seed(0)
    w = torch.randn(5, 3, requires_grad=True)
    g = torch.randn(5, 3)
    opt = optim.Adafactor([w], relative_step=False, scale_parameter=False, lr=1.0, d=math.inf)
    w.grad = g
    opt.step()  # beta2_1 = 1 - 1^-0.8 = 0: the factors are the row and column means of G²
    row, col, v = lab08.factored_second_moment(torch.zeros(5, 1), torch.zeros(1, 3), g, 0.0)
    assert torch.allclose(row, (g**2).mean(1, keepdim=True))
    assert torch.allclose(col, (g**2).mean(0, keepdim=True))
    assert torch.allclose(row, opt.state[w]["row_var"]) and torch.allclose(
        col, opt.state[w]["col_var"]
    )
    assert torch.allclose(v, row @ col / row.mean())
    # rank one: exact for a gradient whose square is an outer product
    a, b = torch.rand(4, 1) + 0.5, torch.rand(1, 6) + 0.5
    _, _, v = lab08.factored_second_moment(
        torch.zeros(4, 1), torch.zeros(1, 6), (a @ b).sqrt(), 0.0
    )
    assert torch.allclose(v, a @ b)


def diag(*values):
    return torch.diag(torch.tensor(values, dtype=torch.float64))


def test_second_moment_gap_reference_is_zero_exactly_when_v_has_rank_one():
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(4, 1, dtype=torch.float64) + 0.5, torch.rand(1, 3, dtype=torch.float64) + 0.5
    signs = [torch.randint(0, 2, (4, 3), generator=g) * 2 - 1 for _ in range(5)]
    # the same outer product every step, or one shared factor: V has rank one
    assert lab08.second_moment_gap([s * (a @ b).sqrt() for s in signs], 0.9) < 1e-14
    shared = [s * (a @ torch.rand(1, 3, dtype=torch.float64)).sqrt() for s in signs]
    assert lab08.second_moment_gap(shared, 0.7) < 1e-14
    # Chapter 8's exercise, by hand: G1² = e1e1ᵀ then G2² = e2e2ᵀ with beta2 = 1/2 give
    # V = diag(1/4, 1/2), R = C = (1/8, 1/4), V̂ = R Cᵀ / (3/16); the largest gap is 1/6,
    # a third of V's largest entry.
    gap = lab08.second_moment_gap([diag(1.0, 0.0), diag(0.0, 1.0)], 0.5)
    assert gap == pytest.approx(1 / 3, rel=1e-12)
    # beta2 = 0: only the last gradient counts, and a rank-one G² is then exact
    assert lab08.second_moment_gap([diag(1.0, 0.0), (a[:2] @ b[:, :2]).sqrt()], 0.0) < 1e-14


def test_zero1_partition_covers_each_unit_once():
    sizes = [3, 64, 5, 1]
    for world in (1, 2, 3, 4, 8):
        owned = [0] * len(sizes)
        for rank in range(world):
            for i, (start, stop) in enumerate(lab08.zero1_partition(sizes, world, rank)):
                assert 0 <= start <= stop <= sizes[i]
                owned[i] += stop - start
        assert owned == sizes
    assert lab08.zero1_partition([7], 2, 1) == [(4, 7)]
    assert lab08.zero1_partition([1, 1], 4, 3) == [(0, 0), (0, 0)]


# -- right answers pass --------------------------------------------------------------------


def right_scaler_update(
    scale, growth_tracker, found_inf, growth_interval=2000, growth_factor=2.0,
    backoff_factor=0.5, min_scale=1.0,
):  # fmt: skip
    if found_inf:
        return max(scale * backoff_factor, min_scale), 0
    growth_tracker += 1
    if growth_tracker == growth_interval:
        grown = float(torch.tensor(scale * growth_factor, dtype=torch.float32))
        return (grown if math.isfinite(grown) else scale), 0
    return scale, growth_tracker


def right_factored_second_moment(row, col, grad, beta2):
    g2 = grad**2
    row = beta2 * row + (1 - beta2) * g2.mean(dim=1, keepdim=True)
    col = beta2 * col + (1 - beta2) * g2.mean(dim=0, keepdim=True)
    return row, col, row @ col / row.mean()


def factored_and_full(grads, beta2):
    """Adafactor's factored estimate and Adam's full second moment after ``grads``."""
    n, m = grads[0].shape
    row, col = torch.zeros(n, 1, dtype=grads[0].dtype), torch.zeros(1, m, dtype=grads[0].dtype)
    v = torch.zeros_like(grads[0])
    for g in grads:
        row, col, v_hat = right_factored_second_moment(row, col, g, beta2)
        v = beta2 * v + (1 - beta2) * g**2
    return v_hat, v


def right_second_moment_gap(grads, beta2):
    v_hat, v = factored_and_full(grads, beta2)
    return ((v_hat - v).abs().max() / v.max()).item()


def right_zero1_partition(sizes, world_size, rank):
    padded = math.ceil(sum(sizes) / world_size) * world_size
    lo, hi = rank * padded // world_size, (rank + 1) * padded // world_size
    out, offset = [], 0
    for n in sizes:
        a, b = max(lo, offset), min(hi, offset + n)
        out.append((a - offset, b - offset) if a < b else (0, 0))
        offset += n
    return out


def test_right_answers_pass(capsys):
    check.checker("lab08.scaler_update")(right_scaler_update)
    check.checker("lab08.factored_second_moment")(right_factored_second_moment)
    check.checker("lab08.second_moment_gap")(right_second_moment_gap)
    check.checker("lab08.zero1_partition")(right_zero1_partition)
    out = capsys.readouterr().out
    assert "✔ scaler_update" in out and "✔ factored_second_moment" in out
    assert "✔ second_moment_gap" in out and "✔ zero1_partition" in out


def test_the_references_pass_their_own_checkers():
    check.checker("lab08.scaler_update")(lab08.scaler_update)
    check.checker("lab08.factored_second_moment")(lab08.factored_second_moment)
    check.checker("lab08.second_moment_gap")(lab08.second_moment_gap)
    check.checker("lab08.zero1_partition")(lab08.zero1_partition)


# -- wrong answers fail, with the hint that names the mistake ------------------------------


def no_floor(scale, growth_tracker, found_inf, growth_interval=2000, growth_factor=2.0,
             backoff_factor=0.5, min_scale=1.0):  # fmt: skip
    if found_inf:
        return scale * backoff_factor, 0
    return right_scaler_update(scale, growth_tracker, False, growth_interval, growth_factor)


def keeps_count(scale, growth_tracker, found_inf, *args, **kwargs):
    if found_inf:
        return scale * 0.5, growth_tracker
    return right_scaler_update(scale, growth_tracker, False, *args, **kwargs)


def sums_not_means(row, col, grad, beta2):
    g2 = grad**2
    row = beta2 * row + (1 - beta2) * g2.sum(dim=1, keepdim=True)
    col = beta2 * col + (1 - beta2) * g2.sum(dim=0, keepdim=True)
    return row, col, row @ col / row.mean()


def no_normalization(row, col, grad, beta2):
    row, col, _ = right_factored_second_moment(row, col, grad, beta2)
    return row, col, row @ col


def unweighted_v(grads, beta2):
    n, m = grads[0].shape
    row, col = torch.zeros(n, 1, dtype=grads[0].dtype), torch.zeros(1, m, dtype=grads[0].dtype)
    v = torch.zeros_like(grads[0])
    for g in grads:
        row, col, v_hat = right_factored_second_moment(row, col, g, beta2)
        v = beta2 * v + g**2  # a sum, not the average R and C are the means of
    return ((v_hat - v).abs().max() / v.max()).item()


def against_last_square(grads, beta2):
    n, m = grads[0].shape
    row, col = torch.zeros(n, 1, dtype=grads[0].dtype), torch.zeros(1, m, dtype=grads[0].dtype)
    for g in grads:
        row, col, v_hat = right_factored_second_moment(row, col, g, beta2)
    v = grads[-1] ** 2
    return ((v_hat - v).abs().max() / v.max()).item()


def absolute_gap(grads, beta2):
    v_hat, v = factored_and_full(grads, beta2)
    return (v_hat - v).abs().max().item()


def always_exact(grads, beta2):
    return 0.0


def unpadded(sizes, world_size, rank):
    # slices of sum(sizes) // world_size: the remainder is lost
    size = sum(sizes) // world_size
    lo, hi = rank * size, (rank + 1) * size
    return [(lo, hi)] if len(sizes) == 1 else right_zero1_partition(sizes, world_size, rank)


def one_range(sizes, world_size, rank):
    size = math.ceil(sum(sizes) / world_size)
    return [(rank * size, min((rank + 1) * size, sum(sizes)))]


@pytest.mark.parametrize(
    "name, fn, hint",
    [
        ("lab08.scaler_update", no_floor, "never goes below min_scale"),
        ("lab08.scaler_update", keeps_count, "restarts the count"),
        ("lab08.factored_second_moment", sums_not_means, "row \\*means\\*"),
        ("lab08.factored_second_moment", no_normalization, "mean of R"),
        ("lab08.second_moment_gap", unweighted_v, "weight 1 - beta2"),
        ("lab08.second_moment_gap", against_last_square, "not with the last G²"),
        ("lab08.second_moment_gap", absolute_gap, "the gap is relative"),
        ("lab08.second_moment_gap", always_exact, "second_moment_gap"),
        ("lab08.zero1_partition", unpadded, "pad the unit"),
        ("lab08.zero1_partition", one_range, "one range per parameter"),
    ],
)
def test_wrong_answers_fail_with_the_hint(name, fn, hint):
    with pytest.raises(CheckFailed, match=hint):
        check.checker(name)(fn)


# -- the exercise stub -------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "lab08.scaler_update",
        "lab08.factored_second_moment",
        "lab08.second_moment_gap",
        "lab08.zero1_partition",
    ],
)
def test_the_stub_asks_for_a_solution(name):
    def stub(*args, **kwargs):
        raise NotImplementedError(PLACEHOLDER_MESSAGE)

    with pytest.raises(NotImplementedError, match="not implemented yet"):
        check.checker(name)(stub)


# -- 8-bit blocks and FP8 casts ------------------------------------------------------------


def test_quantize_block_reference_is_chapter_8s_exercise_by_hand():
    small = torch.tensor([-1.0, -0.5, -0.1, 0.0, 0.1, 0.5, 1.0])
    codes, absmax, decoded = lab08.quantize_block(torch.tensor([0.7, -2.0, 0.03, 1.1]), small)
    assert codes.dtype == torch.uint8 and codes.tolist() == [5, 0, 3, 5]
    assert absmax.ndim == 0 and absmax.item() == 2.0
    assert decoded.tolist() == [1.0, -2.0, 0.0, 1.0]
    codes, absmax, decoded = lab08.quantize_block(torch.tensor([0.7, -20.0, 0.03, 1.1]), small)
    assert codes.tolist() == [3, 0, 3, 4] and decoded.tolist() == [0.0, -20.0, 0.0, 2.0]
    codes, absmax, decoded = lab08.quantize_block(torch.zeros(3), small)
    assert absmax.item() == 0.0 and decoded.tolist() == [0.0] * 3


def test_fp8_cast_reference_is_chapter_8s_exercise_by_hand():
    x = torch.tensor([1000.0, 3.0, 0.01, 1e-4])
    x_hat, scale, over, under = lab08.fp8_cast(x, "e4m3", "none")
    assert x_hat.tolist() == [448.0, 3.0, 5 * 2.0**-9, 0.0] and (over, under) == (1, 1)
    x_hat, scale, over, under = lab08.fp8_cast(x, "e4m3", "tensor")
    assert scale.item() == pytest.approx(0.448) and (over, under) == (0, 1)
    assert lab08.fp8_cast(x, "e5m2", "tensor")[2:] == (0, 0)
    x_hat, scale, over, under = lab08.fp8_cast(x[None], "e4m3", "mx")
    assert scale.tolist() == [[0.5]] and x_hat[0, 0].item() == 896.0 and (over, under) == (1, 1)
    assert lab08.fp8_cast(torch.zeros(3))[1].item() == 1.0
    with pytest.raises(ValueError, match="Invalid scaling"):
        lab08.fp8_cast(x, "e4m3", "delayed")


def right_quantize_block(block, code):
    absmax = block.abs().max()
    scale = absmax if absmax > 0 else torch.ones(())
    distance = (code[None, :] - (block / scale)[:, None]).abs()
    codes = distance.argmin(dim=1).to(torch.uint8)  # the first minimum: the lower on a tie
    return codes, absmax, code[codes.long()] * absmax


FP8 = {"e4m3": (torch.float8_e4m3fn, 448.0, 8), "e5m2": (torch.float8_e5m2, 57344.0, 15)}


def right_fp8_cast(x, format="e4m3", scaling="tensor"):
    dtype, vmax, emax = FP8[format]
    if scaling == "none":
        scale = torch.ones(())
    elif scaling == "tensor":
        amax = x.abs().max()
        scale = vmax / amax if amax > 0 else torch.ones(())
    else:
        n = x.shape[-1]
        blocks = torch.nn.functional.pad(x, (0, -n % 32)).unflatten(-1, (-1, 32))
        exponent = torch.floor(torch.log2(blocks.abs().amax(-1)))
        scale = 2.0 ** (emax - exponent)
    per_value = scale if scaling != "mx" else scale.repeat_interleave(32, -1)[..., :n]
    scaled = x * per_value
    q = scaled.clamp(-vmax, vmax).to(dtype).float()
    over = int((scaled.abs() > vmax).sum())
    under = int(((q == 0) & (x != 0)).sum())
    return q / per_value, scale, over, under


def test_right_8bit_and_fp8_answers_pass(capsys):
    check.checker("lab08.quantize_block")(right_quantize_block)
    check.checker("lab08.fp8_cast")(right_fp8_cast)
    check.checker("lab08.quantize_block")(lab08.quantize_block)
    check.checker("lab08.fp8_cast")(lab08.fp8_cast)
    out = capsys.readouterr().out
    assert "✔ quantize_block" in out and "✔ fp8_cast" in out


def max_not_absmax(block, code):
    codes, _, _ = right_quantize_block(block / block.max() * block.abs().max(), code)
    n = block.max()
    return codes, n, code[codes.long()] * n


def rounds_down(block, code):
    absmax = block.abs().max()
    scale = absmax if absmax > 0 else torch.ones(())
    codes = (torch.searchsorted(code, block / scale, right=True) - 1).clamp(min=0)
    return codes.to(torch.uint8), absmax, code[codes] * absmax


def not_scaled_back(block, code):
    codes, absmax, _ = right_quantize_block(block, code)
    return codes, absmax, code[codes.long()]


def divides_by_zero(block, code):
    absmax = block.abs().max()
    distance = (code[None, :] - (block / absmax)[:, None]).abs()
    codes = distance.nan_to_num(0.0).argmin(dim=1).to(torch.uint8)
    return codes, absmax, code[codes.long()] * absmax * (block / absmax)


def no_saturation(x, format="e4m3", scaling="tensor"):
    x_hat, scale, over, under = right_fp8_cast(x, format, scaling)
    per_value = scale if scaling != "mx" else scale.repeat_interleave(32, -1)[..., : x.shape[-1]]
    return (x * per_value).to(FP8[format][0]).float() / per_value, scale, over, under


def counts_zeros(x, format="e4m3", scaling="tensor"):
    x_hat, scale, over, under = right_fp8_cast(x, format, scaling)
    return x_hat, scale, over, int((x_hat == 0).sum())


def inverted_scale(x, format="e4m3", scaling="tensor"):
    if scaling != "tensor":
        return right_fp8_cast(x, format, scaling)
    dtype, vmax, _ = FP8[format]
    amax = x.abs().max()
    scale = amax / vmax if amax > 0 else torch.ones(())
    q = (x * scale).clamp(-vmax, vmax).to(dtype).float()
    return q / scale, scale, 0, int(((q == 0) & (x != 0)).sum())


def mx_not_a_power_of_two(x, format="e4m3", scaling="tensor"):
    if scaling != "mx":
        return right_fp8_cast(x, format, scaling)
    dtype, vmax, _ = FP8[format]
    n = x.shape[-1]
    blocks = torch.nn.functional.pad(x, (0, -n % 32)).unflatten(-1, (-1, 32))
    scale = vmax / blocks.abs().amax(-1)
    per_value = scale.repeat_interleave(32, -1)[..., :n]
    q = (x * per_value).clamp(-vmax, vmax).to(dtype).float()
    return q / per_value, scale, 0, int(((q == 0) & (x != 0)).sum())


def zeros_scale_inf(x, format="e4m3", scaling="tensor"):
    if scaling != "tensor":
        return right_fp8_cast(x, format, scaling)
    dtype, vmax, _ = FP8[format]
    scale = vmax / x.abs().max()
    q = (x * scale).clamp(-vmax, vmax).to(dtype).float()
    return q / scale, scale, 0, int(((q == 0) & (x != 0)).sum())


@pytest.mark.parametrize(
    "name, fn, hint",
    [
        ("lab08.quantize_block", max_not_absmax, "largest \\|x_i\\|"),
        ("lab08.quantize_block", rounds_down, "nearest value of the map"),
        ("lab08.quantize_block", not_scaled_back, "back by N"),
        ("lab08.quantize_block", divides_by_zero, "block of zeros"),
        ("lab08.fp8_cast", no_saturation, "saturate"),
        ("lab08.fp8_cast", counts_zeros, "only the nonzero values"),
        ("lab08.fp8_cast", inverted_scale, "the scale multiplies x"),
        ("lab08.fp8_cast", mx_not_a_power_of_two, "powers of two"),
        ("lab08.fp8_cast", zeros_scale_inf, "scale 1"),
    ],
)
def test_wrong_8bit_and_fp8_answers_fail_with_the_hint(name, fn, hint):
    with pytest.raises(CheckFailed, match=hint):
        check.checker(name)(fn)


@pytest.mark.parametrize("name", ["lab08.quantize_block", "lab08.fp8_cast"])
def test_the_8bit_and_fp8_stubs_ask_for_a_solution(name):
    def stub(*args, **kwargs):
        raise NotImplementedError(PLACEHOLDER_MESSAGE)

    with pytest.raises(NotImplementedError, match="not implemented yet"):
        check.checker(name)(stub)
