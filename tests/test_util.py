"""The shared private helpers: one message format for bad arguments, an exception-safe
evaluation mode, flatten/unflatten, atomic files and seeded generators."""

import math
import os
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lsdl_lab import _util as u

# -- argument checks ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "check, args, error",
    [
        (u.check_bool, ("nesterov", "yes"), TypeError),
        (u.check_bool, ("nesterov", 1), TypeError),
        (u.check_int, ("steps", 1.0, 1), TypeError),
        (u.check_int, ("steps", True, 1), TypeError),
        (u.check_int, ("steps", 0, 1), ValueError),
        (u.check_int, ("k", 11, 1, 10), ValueError),
        (u.check_real, ("lr", "0.1", 0.0), TypeError),
        (u.check_real, ("lr", False, 0.0), TypeError),
        (u.check_real, ("lr", math.nan, 0.0), ValueError),
        (u.check_real, ("lr", math.inf, 0.0), ValueError),
        (u.check_real, ("momentum", 1.5, 0.0, 1.0), ValueError),
        (u.check_positive, ("eps", 0.0), ValueError),
        (u.check_nonnegative, ("weight_decay", -1e-9), ValueError),
        (u.check_fraction, ("test_fraction", 1.0), ValueError),
        (u.check_fraction, ("test_fraction", 0.0), ValueError),
        (u.check_choice, ("method", "newton", ("cg", "eigh")), ValueError),
        (u.check_tensor, ("x", [1.0]), TypeError),
        (u.check_tensor, ("x", torch.zeros(2), 2), ValueError),
    ],
)
def test_bad_arguments_raise_the_right_type_naming_the_argument(check, args, error):
    with pytest.raises(error, match=rf"^Invalid {re.escape(args[0])}: .*\(expected .+\)$"):
        check(*args)


def test_good_arguments_are_returned_converted():
    assert u.check_bool("flag", False) is False
    assert u.check_int("k", 3, 1) == 3 and type(u.check_int("k", torch.tensor(3).item())) is int
    assert u.check_real("lr", 1, 0.0) == 1.0 and type(u.check_real("lr", 1, 0.0)) is float
    assert u.check_real("x", math.inf, 0.0, finite=False) == math.inf
    assert u.check_real("momentum", 0.0, 0.0, 1.0, high_open=True) == 0.0
    assert u.check_fraction("p", 1.0, closed=True) == 1.0
    assert u.check_choice("method", "cg", ("cg", "eigh")) == "cg"


def test_messages_state_the_allowed_range():
    with pytest.raises(ValueError, match=r"expected a finite number in \[0, 1\)"):
        u.check_real("momentum", 1.5, 0.0, 1.0, high_open=True)
    with pytest.raises(ValueError, match=r"expected an int in \[1, 10\]"):
        u.check_int("k", 0, 1, 10)
    with pytest.raises(ValueError, match=r"expected a finite number > 0"):
        u.check_positive("eps", -1.0)


# -- evaluation mode ----------------------------------------------------------------------


def _model_with_frozen_submodule():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Dropout(0.5))
    model.train()
    model[1].eval()  # deliberately frozen statistics
    return model


def test_eval_mode_restores_every_submodule_mode():
    model = _model_with_frozen_submodule()
    with u.eval_mode(model):
        assert not any(m.training for m in model.modules())
    assert [m.training for m in model.modules()] == [True, True, False, True]


def test_eval_mode_restores_modes_when_the_block_raises():
    model = _model_with_frozen_submodule()
    with pytest.raises(RuntimeError, match="boom"), u.eval_mode(model):
        raise RuntimeError("boom")
    assert [m.training for m in model.modules()] == [True, True, False, True]


def test_device_of():
    assert u.device_of(nn.Linear(2, 2)) == torch.device("cpu")
    assert u.device_of(nn.ReLU()) == torch.device("cpu")


# -- flatten / unflatten -------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(1, 4), min_size=0, max_size=3), min_size=1, max_size=4))
def test_unflatten_inverts_flatten(shapes):
    tensors = [torch.randn(tuple(s), dtype=torch.float64) for s in shapes]
    vector = u.flatten(tensors)
    assert vector.shape == (sum(t.numel() for t in tensors),)
    back = u.unflatten(vector, tensors)
    assert all(torch.equal(a, b) and a.shape == b.shape for a, b in zip(back, tensors))


def test_unflatten_refuses_a_vector_of_the_wrong_size():
    with pytest.raises(ValueError, match="Invalid vector.*5 entries"):
        u.unflatten(torch.zeros(4), [torch.zeros(2), torch.zeros(3)])


def test_weighted_batches():
    x = torch.zeros(3, 2)
    batches, weights = u.weighted_batches((x, torch.zeros(3)))
    assert len(batches) == 1 and weights == [1.0]
    _, weights = u.weighted_batches([(x, x), (x[:1], x[:1])])
    assert weights == [0.75, 0.25]
    with pytest.raises(ValueError, match="Invalid batches: empty"):
        u.weighted_batches([])


# -- randomness ----------------------------------------------------------------------------


def test_generators_are_reproducible_and_independent_per_use():
    a = torch.rand(5, generator=u.generator("epoch", 0, 1))
    assert torch.equal(a, torch.rand(5, generator=u.generator("epoch", 0, 1)))
    assert not torch.equal(a, torch.rand(5, generator=u.generator("epoch", 0, 2)))
    assert 0 <= u.seed_from("x") < 2**63


# -- atomic files --------------------------------------------------------------------------


def test_atomic_path_moves_the_file_into_place(tmp_path: Path):
    target = tmp_path / "sub" / "file.bin"
    with u.atomic_path(target) as tmp:
        tmp.write_bytes(b"new")
        assert not target.exists()  # readers never see a half-written file
    assert target.read_bytes() == b"new"
    assert list(target.parent.glob("*.part")) == []


def test_atomic_path_leaves_the_old_file_when_the_block_raises(tmp_path: Path):
    target = tmp_path / "file.bin"
    target.write_bytes(b"old")
    with pytest.raises(OSError, match="disk full"), u.atomic_path(target) as tmp:
        tmp.write_bytes(b"half")
        raise OSError("disk full")
    assert target.read_bytes() == b"old"
    assert list(tmp_path.glob("*.part")) == []


def test_atomic_path_fsyncs_before_the_rename(tmp_path: Path, monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append("replace"), real_replace(a, b)))
    with u.atomic_path(tmp_path / "f") as tmp:
        tmp.write_bytes(b"x")
    assert calls[:2] == ["fsync", "replace"]
