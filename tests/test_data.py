"""Tests of lsdl_lab.data: loaders, verified downloads, and step-determined batches.

Nothing here touches the network: downloads use file:// URLs or a patched urlopen, and
CIFAR-10 and Tiny Shakespeare are replaced by small files in their official formats.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import re
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lsdl_lab import data as D

# ---------------------------------------------------------------------------------------
# digits


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
    with pytest.raises(ValueError, match="'digits', 'cifar10'"):
        D.load_images("mnist")
    with pytest.raises(ValueError, match="'python_source', 'tiny_shakespeare'"):
        D.load_text("wikitext")
    assert D.load_images("digits", seed=3).name == "digits"


# ---------------------------------------------------------------------------------------
# the Python-source corpus


@pytest.fixture(scope="module")
def source():
    return D.load_python_source(max_chars=60_000)


def test_python_source_deterministic_and_sized(source):
    again = D.load_python_source(max_chars=60_000)
    assert torch.equal(again.train, source.train) and torch.equal(again.val, source.val)
    assert again.vocab == source.vocab and again.source == source.source
    assert len(source.train) + len(source.val) == 60_000
    assert len(source.train) == 54_000
    assert source.train.dtype == torch.int64 and source.train.ndim == 1
    assert f"Python {'.'.join(map(str, __import__('sys').version_info[:3]))}" in source.source


def test_python_source_split_is_contiguous(source):
    longer = D.load_python_source(max_chars=120_000)
    whole = source.decode(source.train) + source.decode(source.val)
    assert longer.decode(longer.train)[:60_000] == whole
    assert whole.startswith("# ==== ")
    assert set(whole) == set(source.vocab)  # the vocabulary covers both splits, nothing more


def test_python_source_files_are_sorted_and_not_tests():
    files = D.python_source_files()
    assert len(files) > 50
    assert [p.name for p in files] == sorted(p.name for p in files)
    assert all(p.suffix == ".py" and not p.stem.startswith("test") for p in files)
    assert "os.py" in {p.name for p in files}


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_encode_decode_round_trip(source, data):
    text = "".join(data.draw(st.lists(st.sampled_from(source.vocab), max_size=50)))
    ids = source.encode(text)
    assert ids.dtype == torch.int64 and len(ids) == len(text)
    assert source.decode(ids) == text


def test_encode_and_decode_reject_unknown(source):
    with pytest.raises(ValueError, match="'☃'"):
        source.encode("x☃y")
    with pytest.raises(ValueError, match="ids"):
        source.decode([source.vocab_size])


@pytest.mark.parametrize(
    "kwargs, match",
    [({"max_chars": 0}, "max_chars"), ({"val_fraction": 1.0}, "val_fraction")],
)
def test_python_source_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        D.load_python_source(**kwargs)


# ---------------------------------------------------------------------------------------
# download and verify


def _digests(payload: bytes) -> dict:
    return {
        "md5": hashlib.md5(payload).hexdigest(),
        "sha256": hashlib.sha256(payload).hexdigest(),
        "size": len(payload),
    }


@pytest.fixture
def remote(tmp_path):
    """A file served through a file:// URL, and the digests it must match."""
    payload = os.urandom(3 << 20)  # several chunks of the 1 MiB read size
    src = tmp_path / "remote" / "blob.bin"
    src.parent.mkdir()
    src.write_bytes(payload)
    return src.as_uri(), payload


def _parts(directory: Path) -> list[Path]:
    return list(directory.glob("*.part"))


def test_download_writes_verified_file(tmp_path, remote):
    url, payload = remote
    dest = tmp_path / "cache" / "blob.bin"
    assert D.download(url, dest, **_digests(payload), progress=False) == dest
    assert dest.read_bytes() == payload
    assert not _parts(dest.parent)


def test_download_wrong_checksum_leaves_nothing(tmp_path, remote):
    url, payload = remote
    dest = tmp_path / "blob.bin"
    wrong = "0" * 64
    with pytest.raises(D.DataIntegrityError) as err:
        D.download(url, dest, sha256=wrong, progress=False)
    message = str(err.value)
    assert url in message and wrong in message and hashlib.sha256(payload).hexdigest() in message
    assert str(dest) in message
    assert not dest.exists() and not _parts(tmp_path)


def test_download_wrong_size_leaves_nothing(tmp_path, remote):
    url, payload = remote
    dest = tmp_path / "blob.bin"
    with pytest.raises(D.DataIntegrityError, match=f"size {len(payload)} bytes"):
        D.download(url, dest, size=len(payload) + 1, progress=False)
    assert not dest.exists()


def _fail_urlopen(*args, **kwargs):
    raise urllib.error.URLError("no network in this test")


def test_existing_valid_file_is_not_downloaded(tmp_path, remote, monkeypatch):
    url, payload = remote
    dest = tmp_path / "blob.bin"
    dest.write_bytes(payload)
    monkeypatch.setattr(urllib.request, "urlopen", _fail_urlopen)
    assert D.download(url, dest, **_digests(payload), progress=False) == dest


def test_existing_bad_file_is_replaced(tmp_path, remote):
    url, payload = remote
    dest = tmp_path / "blob.bin"
    dest.write_bytes(payload[:100])
    with pytest.warns(UserWarning, match="fails verification"):
        D.download(url, dest, **_digests(payload), progress=False)
    assert dest.read_bytes() == payload


def test_download_failure_says_where_to_put_the_file(tmp_path):
    dest = tmp_path / "blob.bin"
    missing = (tmp_path / "nowhere.bin").as_uri()
    with pytest.raises(RuntimeError, match="place it at") as err:
        D.download(missing, dest, md5="0" * 32, progress=False)
    assert str(dest) in str(err.value) and not dest.exists()


class _BrokenStream(io.BytesIO):
    """A response that delivers some bytes, then loses the connection."""

    headers: dict = {}

    def read(self, n=-1):
        if self.tell() >= 1 << 20:
            raise ConnectionResetError("connection lost")
        return super().read(n)


def test_download_killed_midway_leaves_no_file(tmp_path, remote, monkeypatch):
    url, payload = remote
    dest = tmp_path / "blob.bin"
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: _BrokenStream(payload))
    with pytest.raises(RuntimeError, match="connection lost"):
        D.download(url, dest, **_digests(payload), progress=False)
    assert not dest.exists() and not _parts(tmp_path)


def test_stale_part_is_never_loaded_and_is_cleaned(tmp_path, remote, monkeypatch):
    url, payload = remote
    dest = tmp_path / "blob.bin"
    stale = tmp_path / "blob.bin.killed.part"
    stale.write_bytes(payload)  # even complete, a part file is not the file
    fresh = tmp_path / "blob.bin.running.part"  # another process, still downloading
    fresh.write_bytes(b"")
    old = time.time() - 2 * D.STALE_PART_SECONDS
    os.utime(stale, (old, old))
    with monkeypatch.context() as m:
        m.setattr(urllib.request, "urlopen", _fail_urlopen)
        with pytest.raises(RuntimeError):
            D.download(url, dest, **_digests(payload), progress=False)
    assert not dest.exists()
    D.download(url, dest, **_digests(payload), progress=False)
    assert not stale.exists() and fresh.exists()


def test_verify(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"abc")
    D.verify(path, **_digests(b"abc"))
    with pytest.raises(D.DataIntegrityError, match=f"Delete {re.escape(str(path))}"):
        D.verify(path, md5=hashlib.md5(b"abd").hexdigest())
    with pytest.raises(FileNotFoundError):
        D.verify(tmp_path / "missing")


# ---------------------------------------------------------------------------------------
# CIFAR-10 in its official format, small


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


def _expect_archive(monkeypatch, path: Path):
    digests = _digests(path.read_bytes())
    monkeypatch.setattr(D, "CIFAR10_MD5", digests["md5"])
    monkeypatch.setattr(D, "CIFAR10_SIZE", digests["size"])


def test_cifar10_parses_official_format(tmp_path, monkeypatch):
    archive = tmp_path / D.CIFAR10_FILENAME
    raw = _cifar_archive(archive)
    _expect_archive(monkeypatch, archive)
    data = D.load_cifar10(root=tmp_path, download=False)
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
    again = D.load_cifar10(root=tmp_path, download=False)
    assert torch.equal(again.train_x, data.train_x) and again.classes == data.classes
    assert not _parts(tmp_path)


def test_cifar10_downloads_through_url(tmp_path, monkeypatch):
    source = tmp_path / "server" / D.CIFAR10_FILENAME
    source.parent.mkdir()
    _cifar_archive(source)
    _expect_archive(monkeypatch, source)
    monkeypatch.setattr(D, "CIFAR10_URL", source.as_uri())
    root = tmp_path / "root"
    assert len(D.load_images("cifar10", root=root).train_y) == 20
    assert (root / D.CIFAR10_FILENAME).read_bytes() == source.read_bytes()


@pytest.mark.parametrize("damage", ["half", "garbage"])
def test_cifar10_damaged_archive_names_file_to_delete(tmp_path, monkeypatch, damage):
    archive = tmp_path / D.CIFAR10_FILENAME
    _cifar_archive(archive)
    _expect_archive(monkeypatch, archive)  # the checksum of the intact archive
    payload = archive.read_bytes()
    archive.write_bytes(
        payload[: len(payload) // 2] if damage == "half" else os.urandom(len(payload))
    )
    with pytest.raises(D.DataIntegrityError, match=f"Delete {re.escape(str(archive))}"):
        D.load_cifar10(root=tmp_path, download=False)
    # With the checksum of the damaged bytes, verification passes and parsing must catch it.
    _expect_archive(monkeypatch, archive)
    with pytest.raises(D.DataIntegrityError, match=f"Delete {re.escape(str(archive))}"):
        D.load_cifar10(root=tmp_path, download=False)
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
def test_cifar10_bad_members(tmp_path, monkeypatch, capsys, override, match):
    archive = tmp_path / D.CIFAR10_FILENAME
    _cifar_archive(archive, override=override)
    _expect_archive(monkeypatch, archive)
    with pytest.raises(D.DataIntegrityError, match=match) as err:
        D.load_cifar10(root=tmp_path, download=False)
    assert f"Delete {archive}" in str(err.value)
    assert "never run" not in capsys.readouterr().out


def test_cifar10_missing_member_and_missing_archive(tmp_path, monkeypatch):
    archive = tmp_path / D.CIFAR10_FILENAME
    with pytest.raises(FileNotFoundError, match="download=False"):
        D.load_cifar10(root=tmp_path, download=False)
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo("cifar-10-batches-py/data_batch_1")
        payload = _cifar_pickle({b"data": np.zeros((1, 3072), np.uint8), b"labels": [0]})
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    _expect_archive(monkeypatch, archive)
    with pytest.raises(D.DataIntegrityError, match="lacks .*data_batch_2"):
        D.load_cifar10(root=tmp_path, download=False)


def test_cifar10_constants_are_the_published_ones():
    assert D.CIFAR10_MD5 == "c58f30108f718f92721af3b95e74349a"
    assert D.CIFAR10_SIZE == 170_498_071
    assert D.TINY_SHAKESPEARE_SIZE == 1_115_394 and len(D.TINY_SHAKESPEARE_SHA256) == 64


# ---------------------------------------------------------------------------------------
# Tiny Shakespeare, small


SONNET = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"


def _expect_text(monkeypatch, path: Path):
    digests = _digests(path.read_bytes())
    monkeypatch.setattr(D, "TINY_SHAKESPEARE_SHA256", digests["sha256"])
    monkeypatch.setattr(D, "TINY_SHAKESPEARE_SIZE", digests["size"])


def test_tiny_shakespeare_parses_and_splits(tmp_path, monkeypatch):
    path = tmp_path / D.TINY_SHAKESPEARE_FILENAME
    path.write_text(SONNET * 10)
    _expect_text(monkeypatch, path)
    data = D.load_tiny_shakespeare(root=tmp_path, download=False)
    n = len(SONNET) * 10
    assert len(data.train) == int(0.9 * n) and len(data.val) == n - int(0.9 * n)
    assert data.decode(data.train) + data.decode(data.val) == SONNET * 10
    assert data.vocab == tuple(sorted(set(SONNET)))
    assert D.load_text("tiny_shakespeare", root=tmp_path, download=False).vocab == data.vocab


def test_tiny_shakespeare_download_and_corruption(tmp_path, monkeypatch):
    server = tmp_path / "input.txt"
    server.write_text(SONNET * 10)
    _expect_text(monkeypatch, server)
    monkeypatch.setattr(D, "TINY_SHAKESPEARE_URL", server.as_uri())
    root = tmp_path / "root"
    short = D.load_tiny_shakespeare(root=root, max_chars=100)
    assert short.decode(short.train) + short.decode(short.val) == (SONNET * 10)[:100]
    assert (root / D.TINY_SHAKESPEARE_FILENAME).read_bytes() == server.read_bytes()
    (root / D.TINY_SHAKESPEARE_FILENAME).write_text(SONNET * 9 + SONNET.upper())
    with pytest.raises(D.DataIntegrityError, match="Delete"):
        D.load_tiny_shakespeare(root=root, download=False)


# ---------------------------------------------------------------------------------------
# image batches


def _indexed(n: int, hw: int = 4):
    """Examples whose pixels and labels are their own index, so batches reveal the order."""
    x = torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1).expand(n, 2, hw, hw).clone()
    return x, torch.arange(n)


def test_image_batches_are_a_function_of_the_step():
    x, y = _indexed(50)
    a = D.ImageBatches(x, y, 8, seed=1, augment=True)
    first = a(7)
    for step in (30, 0, 13, 7):
        a(step)
    b = D.ImageBatches(x, y, 8, seed=1, augment=True)
    for got in (a(7), b(7)):
        assert torch.equal(got[0], first[0]) and torch.equal(got[1], first[1])


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 60), data=st.data(), seed=st.integers(0, 2**40), drop_last=st.booleans())
def test_each_epoch_reads_each_example_once(n, data, seed, drop_last):
    bs = data.draw(st.integers(1, n))
    x, y = _indexed(n)
    batches = D.ImageBatches(x, y, bs, seed=seed, drop_last=drop_last)
    assert len(batches) == (n // bs if drop_last else -(-n // bs))
    for epoch in (0, 3):
        seen = torch.cat([batches(epoch * len(batches) + i)[1] for i in range(len(batches))])
        assert len(set(seen.tolist())) == len(seen)
        assert len(seen) == (len(batches) * bs if drop_last else n)
        xb, yb = batches(epoch * len(batches))
        assert torch.equal(xb[:, 0, 0, 0].long(), yb)  # images travel with their labels


def test_epochs_and_seeds_differ_and_shuffle_off_is_in_order():
    x, y = _indexed(64)
    a = D.ImageBatches(x, y, 64, seed=0)
    assert not torch.equal(a(0)[1], a(1)[1])  # epoch 0 against epoch 1
    assert sorted(a(0)[1].tolist()) == list(range(64))
    assert not torch.equal(a(0)[1], D.ImageBatches(x, y, 64, seed=1)(0)[1])
    ordered = D.ImageBatches(x, y, 16, shuffle=False)
    assert torch.equal(torch.cat([ordered(i)[1] for i in range(4)]), y)


def test_augmentation_is_crop_and_flip_per_step():
    x = torch.randn(32, 3, 8, 8)
    y = torch.zeros(32, dtype=torch.long)
    batches = D.ImageBatches(x, y, 32, shuffle=False, augment=True, seed=5)
    xb, _ = batches(0)
    assert xb.shape == x.shape and torch.equal(xb, batches(0)[0])
    assert not torch.equal(xb, batches(1)[0])  # same examples, other step, other crops
    # Against a per-example reference that draws the same random numbers.
    g = torch.Generator().manual_seed(123)
    got = D.random_crop_flip(x, torch.Generator().manual_seed(123))
    offsets = torch.randint(0, 9, (2, 32), generator=g)
    flip = torch.rand(32, generator=g) < 0.5
    padded = torch.nn.functional.pad(x, (4, 4, 4, 4))
    for i in range(32):
        dy, dx = offsets[:, i].tolist()
        crop = padded[i, :, dy : dy + 8, dx : dx + 8]
        assert torch.equal(got[i], crop.flip(-1) if flip[i] else crop)
    assert 0 < flip.sum() < 32


@pytest.mark.parametrize("bad, error", [(0, ValueError), (11, ValueError), (2.0, TypeError)])
def test_image_batches_bad_batch_size(bad, error):
    x, y = _indexed(10)
    with pytest.raises(error, match=r"batch_size: .*\[1, 10\]"):
        D.ImageBatches(x, y, bad)
    with pytest.raises(ValueError, match="step"):
        D.ImageBatches(x, y, 2)(-1)
    with pytest.raises(ValueError, match="x, y"):
        D.ImageBatches(x, y[:5], 2)


def test_eval_batches_in_order_keep_last():
    x, y = _indexed(10)
    batches = D.eval_batches(x, y, 4)
    assert [len(b[1]) for b in batches] == [4, 4, 2]
    assert torch.equal(torch.cat([b[1] for b in batches]), y)
    assert len(D.eval_batches(x, y, 4, max_batches=2)) == 2
    with pytest.raises(ValueError, match="max_batches"):
        D.eval_batches(x, y, 4, max_batches=0)


# ---------------------------------------------------------------------------------------
# text batches


def test_text_batches_targets_are_next_tokens():
    tokens = torch.arange(1000) * 7 % 101
    batches = D.TextBatches(tokens, block_size=16, batch_size=5, seed=2)
    x, y = batches(3)
    assert x.shape == y.shape == (5, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:])
    ramp = D.TextBatches(torch.arange(1000), 16, 5, seed=2)
    rx, ry = ramp(3)
    assert torch.equal(ry, rx + 1)
    assert torch.equal(rx, ramp(3)[0]) and not torch.equal(rx, ramp(4)[0])
    assert not torch.equal(rx, D.TextBatches(torch.arange(1000), 16, 5, seed=3)(3)[0])


def test_text_batches_bad_block_size():
    tokens = torch.arange(20)
    for bad in (0, 20):
        with pytest.raises(ValueError, match=r"block_size: .*\[1, 19\]"):
            D.TextBatches(tokens, bad, 2)
    x, y = D.TextBatches(tokens, 19, 2)(0)  # the longest block: one possible window
    assert torch.equal(x[0], tokens[:19]) and torch.equal(y[0], tokens[1:])


def test_text_eval_batches_are_contiguous():
    tokens = torch.arange(103)
    batches = D.text_eval_batches(tokens, block_size=10, batch_size=4)
    assert [len(x) for x, _ in batches] == [4, 4, 2]
    xs = torch.cat([x for x, _ in batches]).flatten()
    assert torch.equal(xs, tokens[:100])
    assert all(torch.equal(y, x + 1) for x, y in batches)
    assert len(D.text_eval_batches(tokens, 10, 4, max_batches=1)) == 1


def test_digits_read_from_the_shipped_file_equal_scikit_learns():
    from sklearn.datasets import load_digits as sklearn_digits

    images, labels = D._digits_arrays()
    ref = sklearn_digits()
    assert np.array_equal(images, ref.images.astype(np.uint8))
    assert np.array_equal(labels, ref.target)
