"""Tests of lsdl_lab.data.images: the digits, CIFAR-10 in its official format, subsets.

Nothing here touches the network: CIFAR-10 is replaced by a small archive in the official
format, described by a record (RemoteFile) that the test passes to the loader.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lsdl_lab import data as D
from lsdl_lab.data import images

# -- digits ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits():
    return D.load_digits(seed=0)


def test_digits_shapes_dtypes_and_split_sizes(digits):
    assert digits.train_x.dtype == torch.float32 and digits.test_x.dtype == torch.float32
    assert digits.train_y.dtype == torch.int64 and digits.test_y.dtype == torch.int64
    assert digits.input_shape == (1, 8, 8) and digits.num_classes == 10
    assert digits.classes == tuple(str(i) for i in range(10))
    assert len(digits.train_x) + len(digits.test_x) == 1797
    assert len(digits.test_x) == 450  # ceil(0.25 * 1797), as scikit-learn rounds
    assert len(digits.train_x) == len(digits.train_y) and len(digits.test_x) == len(digits.test_y)


def test_digits_normalized_with_train_statistics(digits):
    mean = digits.train_x.mean(dim=(0, 2, 3))
    std = digits.train_x.std(dim=(0, 2, 3))
    assert mean.abs().max().item() < 1e-5, mean
    assert (std - 1).abs().max().item() < 1e-4, std
    # The test set went through the same map, not its own statistics.
    assert abs(digits.test_x.mean().item()) > 1e-4
    raw = digits.train_x * digits.std[0] + digits.mean[0]
    assert raw.min().item() == pytest.approx(0, abs=1e-5)
    assert raw.max().item() == pytest.approx(1, abs=1e-5)


def test_digits_split_is_stratified(digits):
    train = torch.bincount(digits.train_y, minlength=10).float()
    test = torch.bincount(digits.test_y, minlength=10).float()
    share = test / (train + test)
    assert torch.all((share - 0.25).abs() < 0.02), share


def test_digits_no_image_in_both_splits(digits):
    def rows(x):
        return {tuple(r) for r in x.flatten(1).numpy().round(5).tolist()}

    train, test = rows(digits.train_x), rows(digits.test_x)
    assert len(train) == len(digits.train_x) and len(test) == len(digits.test_x)
    assert not train & test


def test_digits_deterministic_in_seed(digits):
    again = D.load_digits(seed=0)
    other = D.load_digits(seed=1)
    assert torch.equal(again.train_x, digits.train_x) and torch.equal(again.test_y, digits.test_y)
    assert not torch.equal(other.train_y, digits.train_y)


@pytest.mark.parametrize("kwargs", [{"test_fraction": 0.0}, {"test_fraction": 1.5}, {"seed": -1}])
def test_digits_bad_arguments(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        D.load_digits(**kwargs)


@settings(max_examples=25, deadline=None)
@given(max_train=st.integers(10, 1346), seed=st.integers(0, 2**31))
def test_subset_is_stratified_and_deterministic(digits, max_train, seed):
    sub = digits.subset(max_train, seed=seed)
    assert len(sub.train_x) == len(sub.train_y) == max_train
    full = torch.bincount(digits.train_y, minlength=10).double()
    got = torch.bincount(sub.train_y, minlength=10).double()
    assert torch.all((got - full * max_train / full.sum()).abs() <= 1.0 + 1e-9), got
    assert torch.equal(digits.subset(max_train, seed=seed).train_x, sub.train_x)
    assert sub.test_x is digits.test_x and sub.mean == digits.mean


def test_subset_of_data_on_a_device_stays_there(digits, device):
    on_device = dataclasses.replace(
        digits, train_x=digits.train_x.to(device), train_y=digits.train_y.to(device)
    )
    sub, expected = on_device.subset(100, seed=3), digits.subset(100, seed=3)
    assert sub.train_x.device.type == sub.train_y.device.type == device.type
    assert torch.equal(sub.train_x.cpu(), expected.train_x)  # the same examples as on the CPU
    assert torch.equal(sub.train_y.cpu(), expected.train_y)


def test_subset_edge_cases(digits):
    assert digits.subset(None) is digits
    assert digits.subset(10_000) is digits
    a, b = digits.subset(100, seed=0), digits.subset(100, seed=1)
    assert not torch.equal(a.train_y, b.train_y) or not torch.equal(a.train_x, b.train_x)
    with pytest.raises(ValueError, match="max_train"):
        digits.subset(0)
    with pytest.raises(TypeError, match="max_train"):
        digits.subset(10.5)


def test_unknown_names_list_valid_ones():
    with pytest.raises(ValueError, match="Invalid name: 'mnist' .*'digits', 'cifar10'"):
        D.load_images("mnist")
    assert D.load_images("digits", seed=3).name == "digits"


@pytest.mark.parametrize(
    "kwargs", [{"seed": True}, {"seed": 1.0}, {"test_fraction": "0.2"}, {"test_fraction": True}]
)
def test_digits_wrong_types_are_type_errors_naming_the_argument(kwargs):
    with pytest.raises(TypeError, match=f"Invalid {next(iter(kwargs))}: "):
        D.load_digits(**kwargs)


def test_subset_seed_must_be_an_int(digits):
    with pytest.raises(TypeError, match="Invalid seed: True"):
        digits.subset(100, seed=True)


def test_digits_read_from_the_shipped_file_equal_scikit_learns():
    from sklearn.datasets import load_digits as sklearn_digits

    pixels, labels = images._digits_arrays()
    ref = sklearn_digits()
    assert np.array_equal(pixels, ref.images.astype(np.uint8))
    assert np.array_equal(labels, ref.target)


# -- CIFAR-10 in its official format, small ----------------------------------------------


def _cifar_pickle(obj) -> bytes:
    # Protocol 2 as in the official (Python 2) files, whose numpy globals name numpy.core.
    return pickle.dumps(obj, protocol=2).replace(
        b"numpy._core.multiarray", b"numpy.core.multiarray"
    )


def _cifar_archive(path: Path, n_train=4, n_test=3, seed=0, override=None) -> dict:
    """Write a CIFAR-10-format tar.gz; return the raw arrays it holds."""
    rng = np.random.default_rng(seed)
    classes = [b"airplane", b"automobile", b"bird", b"cat", b"deer"]
    classes += [b"dog", b"frog", b"horse", b"ship", b"truck"]
    members, raw = {}, {"x": [], "y": []}
    for i, name in enumerate([f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]):
        n = n_test if name == "test_batch" else n_train
        x = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        y = [int(v) for v in rng.integers(0, 10, size=n)]
        if i == 0:
            x[0, 1 * 1024 + 5 * 32 + 7] = 200  # green channel, row 5, column 7
        raw["x"].append(x)
        raw["y"].append(y)
        members[name] = {b"batch_label": name.encode(), b"labels": y, b"data": x}
        members[name][b"filenames"] = [b"img_%d.png" % j for j in range(n)]
    members["batches.meta"] = {
        b"label_names": classes,
        b"num_cases_per_batch": n_train,
        b"num_vis": 3072,
    }
    members.update(override or {})
    with tarfile.open(path, "w:gz") as tar:
        for name, obj in members.items():
            payload = obj if isinstance(obj, bytes) else _cifar_pickle(obj)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return raw


ARCHIVE = "cifar-10-python.tar.gz"


def _record(record_of, archive: Path, **changes):
    """The record of the archive the test wrote (its url, size and checksums)."""
    return record_of(archive, filename=ARCHIVE, **changes)


def test_cifar10_parses_official_format(tmp_path, record_of):
    archive = tmp_path / ARCHIVE
    raw = _cifar_archive(archive)
    remote = _record(record_of, archive)
    data = D.load_cifar10(root=tmp_path, download=False, remote=remote)
    assert data.train_x.shape == (20, 3, 32, 32) and data.test_x.shape == (3, 3, 32, 32)
    assert data.classes[:2] == ("airplane", "automobile") and data.num_classes == 10
    assert data.train_y.tolist() == sum(raw["y"][:5], [])
    assert data.test_y.tolist() == raw["y"][5]
    mean, std = torch.tensor(data.mean).view(3, 1, 1), torch.tensor(data.std).view(3, 1, 1)
    pixels = (data.train_x * std + mean) * 255
    assert pixels[0, 1, 5, 7].item() == pytest.approx(200, abs=1e-3)
    expected = np.concatenate(raw["x"][:5]).reshape(20, 3, 32, 32)
    assert (pixels - torch.from_numpy(expected).float()).abs().max().item() < 2e-3
    # Later loads read the cache: the archive is no longer needed.
    assert (tmp_path / "cifar-10-python.npz").is_file()
    archive.unlink()
    again = D.load_cifar10(root=tmp_path, download=False, remote=remote)
    assert torch.equal(again.train_x, data.train_x) and again.classes == data.classes
    assert not list(tmp_path.glob("*.part"))
    # A cache built from another archive (another checksum) is not used.
    other = tmp_path / "other.bin"
    other.write_bytes(b"another archive")
    with pytest.raises(FileNotFoundError, match="No test file other.bin at"):
        D.load_cifar10(root=tmp_path, download=False, remote=_record(record_of, other))


def test_cifar10_downloads_through_url(tmp_path, record_of):
    source = tmp_path / "server" / ARCHIVE
    source.parent.mkdir()
    _cifar_archive(source)
    root = tmp_path / "root"
    remote = _record(record_of, source)
    assert len(D.load_images("cifar10", root=root, remote=remote).train_y) == 20
    assert (root / ARCHIVE).read_bytes() == source.read_bytes()


def test_cifar10_record_comes_from_the_registry(tmp_path, record_of, monkeypatch):
    source = tmp_path / "server" / ARCHIVE
    source.parent.mkdir()
    _cifar_archive(source)
    monkeypatch.setitem(D.REMOTE_FILES, "cifar10", _record(record_of, source))
    assert len(D.load_cifar10(root=tmp_path / "root").test_y) == 3
    # The real record: no archive under this root, and the message names the real URL.
    monkeypatch.undo()
    with pytest.raises(FileNotFoundError, match=re.escape(D.REMOTE_FILES["cifar10"].url)):
        D.load_cifar10(root=tmp_path / "empty", download=False)


def test_cifar10_record_with_a_wrong_checksum_fails_verification(tmp_path, record_of):
    archive = tmp_path / ARCHIVE
    _cifar_archive(archive)
    wrong = _record(record_of, archive, md5="0" * 32)
    with pytest.raises(D.DataIntegrityError, match="md5 .*expected 0{32}"):
        D.load_cifar10(root=tmp_path, download=False, remote=wrong)
    assert not (tmp_path / "cifar-10-python.npz").exists()


@pytest.mark.parametrize("damage", ["half", "garbage"])
def test_cifar10_damaged_archive_names_file_to_delete(tmp_path, record_of, damage):
    archive = tmp_path / ARCHIVE
    _cifar_archive(archive)
    intact = _record(record_of, archive)  # the checksum of the intact archive
    payload = archive.read_bytes()
    archive.write_bytes(
        payload[: len(payload) // 2] if damage == "half" else os.urandom(len(payload))
    )
    with pytest.raises(D.DataIntegrityError, match=f"Delete {re.escape(str(archive))}"):
        D.load_cifar10(root=tmp_path, download=False, remote=intact)
    # With the checksum of the damaged bytes, verification passes and parsing must catch it.
    damaged = _record(record_of, archive)
    with pytest.raises(D.DataIntegrityError, match=f"Delete {re.escape(str(archive))}"):
        D.load_cifar10(root=tmp_path, download=False, remote=damaged)
    assert not (tmp_path / "cifar-10-python.npz").exists()


class _Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


@pytest.mark.parametrize(
    "override, match",
    [
        ({"test_batch": {b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}}, "3072"),
        ({"data_batch_2": {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}}, "labels"),
        ({"data_batch_3": {b"data": _Evil(), b"labels": []}}, "forbidden global .*print"),
        ({"batches.meta": b"not a pickle"}, "batches.meta"),
    ],
)
def test_cifar10_bad_members(tmp_path, record_of, capsys, override, match):
    archive = tmp_path / ARCHIVE
    _cifar_archive(archive, override=override)
    with pytest.raises(D.DataIntegrityError, match=match) as err:
        D.load_cifar10(root=tmp_path, download=False, remote=_record(record_of, archive))
    assert f"Delete {archive}" in str(err.value)
    assert "never run" not in capsys.readouterr().out


def test_cifar10_missing_member_and_missing_archive(tmp_path, record_of):
    archive = tmp_path / ARCHIVE
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo("cifar-10-batches-py/data_batch_1")
        payload = _cifar_pickle({b"data": np.zeros((1, 3072), np.uint8), b"labels": [0]})
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    remote = _record(record_of, archive)
    with pytest.raises(D.DataIntegrityError, match="lacks .*data_batch_2"):
        D.load_cifar10(root=tmp_path, download=False, remote=remote)
    with pytest.raises(FileNotFoundError, match="download=False"):
        D.load_cifar10(root=tmp_path / "elsewhere", download=False, remote=remote)
