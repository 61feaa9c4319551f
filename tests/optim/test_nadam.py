"""Tests of lsdl_lab.optim.nadam: the one documented difference from torch.optim.NAdam,
under a float32 default dtype (bit for bit otherwise, coupled and decoupled weight decay,
momentum warm-up: test_common.py)."""

from __future__ import annotations

import torch
from optim_helpers import (
    FULL,
    ours,
    run,
    torchs,
)


def test_nadam_under_float32_default():
    # With float32 as the default dtype, torch.optim keeps NAdam's running product of mu_t
    # in float32 even for float64 parameters (until a load_state_dict casts it to float64);
    # ours keeps it in the parameter's dtype, so float64 results differ by that rounding only.
    a, _ = run(ours("NAdam", **FULL["NAdam"]), dtype=torch.float64, scalar_dtype=torch.float32)
    b, opt = run(torchs("NAdam", **FULL["NAdam"]), dtype=torch.float64, scalar_dtype=torch.float32)
    assert opt.state[next(b.parameters())]["mu_product"].dtype == torch.float32
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-8)
