"""ZeRO's per-rank bytes (Rajbhandari et al. 2020): the formulas and the paper's Figure 1."""

import pytest

from lsdl_lab.memory.zero import zero_bytes


def test_headline_figure_recomputed():
    # Figure 1: a 7.5B-parameter model with Adam (K = 12) on 64 devices.
    gb = [round(zero_bytes(7.5e9, stage, 64)["total"] / 1e9, 1) for stage in range(4)]
    assert gb == [120.0, 31.4, 16.6, 1.9]


@pytest.mark.parametrize("psi, n, k", [(1000, 4, 12), (12345, 7, 8), (10**6, 1, 12)])
def test_each_stage_partitions_one_more_category(psi, n, k):
    s0, s1, s2, s3 = (zero_bytes(psi, stage, n, k) for stage in range(4))
    assert s0 == {"params": 2 * psi, "grads": 2 * psi, "optimizer_state": k * psi,
                  "total": (4 + k) * psi}  # fmt: skip
    assert s1["total"] == pytest.approx(2 * psi + 2 * psi + k * psi / n)
    assert s2["total"] == pytest.approx(2 * psi + (2 + k) * psi / n)
    assert s3["total"] == pytest.approx((2 + 2 + k) * psi / n)
    for report in (s0, s1, s2, s3):
        assert report["total"] == sum(v for key, v in report.items() if key != "total")


def test_float32_training_and_one_rank():
    fp32 = zero_bytes(100, 3, 4, k=8, param_bytes=4, grad_bytes=4)
    assert fp32 == {"params": 100.0, "grads": 100.0, "optimizer_state": 200.0, "total": 400.0}
    assert all(zero_bytes(100, s, 1) == zero_bytes(100, 0, 1) for s in range(4))


@pytest.mark.parametrize(
    "args, kwargs, name, error",
    [
        ((0, 1, 2), {}, "num_params", ValueError),
        (("7B", 1, 2), {}, "num_params", TypeError),
        ((10, 4, 2), {}, "stage", ValueError),
        ((10, -1, 2), {}, "stage", ValueError),
        ((10, 1.0, 2), {}, "stage", TypeError),
        ((10, 1, 0), {}, "world_size", ValueError),
        ((10, 1, 2), {"k": -1}, "k", ValueError),
        ((10, 1, 2), {"param_bytes": -2}, "param_bytes", ValueError),
    ],
)
def test_bad_arguments(args, kwargs, name, error):
    with pytest.raises(error, match=f"Invalid {name}"):
        zero_bytes(*args, **kwargs)
