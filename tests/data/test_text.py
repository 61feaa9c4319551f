"""Tests of lsdl_lab.data.text: the Python-source corpus, Tiny Shakespeare, TextData.

Nothing here touches the network: Tiny Shakespeare is replaced by a small text, described
by a record (RemoteFile) that the test passes to the loader.
"""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lsdl_lab import data as D

# -- the Python-source corpus ------------------------------------------------------------


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
    assert f"Python {'.'.join(map(str, sys.version_info[:3]))}" in source.source


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
def test_encode_decode_round_trip(source, data, device):
    text = "".join(data.draw(st.lists(st.sampled_from(source.vocab), max_size=50)))
    ids = source.encode(text)
    assert ids.dtype == torch.int64 and len(ids) == len(text)
    assert source.decode(ids) == text
    assert source.decode(ids.to(device)) == text  # a model's output, on its device


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


def test_python_source_wrong_types_are_type_errors_naming_the_argument():
    with pytest.raises(TypeError, match="Invalid max_chars: True"):
        D.load_python_source(max_chars=True)
    with pytest.raises(TypeError, match="Invalid val_fraction: '0.1'"):
        D.load_python_source(val_fraction="0.1")


def test_unknown_names_list_valid_ones():
    with pytest.raises(ValueError, match="'python_source', 'tiny_shakespeare'"):
        D.load_text("wikitext")


# -- Tiny Shakespeare, small -------------------------------------------------------------


SONNET = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"
FILENAME = "tiny_shakespeare.txt"


def test_tiny_shakespeare_parses_and_splits(tmp_path, record_of):
    path = tmp_path / FILENAME
    path.write_text(SONNET * 10)
    remote = record_of(path)
    data = D.load_tiny_shakespeare(root=tmp_path, download=False, remote=remote)
    n = len(SONNET) * 10
    assert len(data.train) == int(0.9 * n) and len(data.val) == n - int(0.9 * n)
    assert data.decode(data.train) + data.decode(data.val) == SONNET * 10
    assert data.vocab == tuple(sorted(set(SONNET)))
    again = D.load_text("tiny_shakespeare", root=tmp_path, download=False, remote=remote)
    assert again.vocab == data.vocab and remote.url in data.source


def test_tiny_shakespeare_download_and_corruption(tmp_path, record_of):
    server = tmp_path / "input.txt"
    server.write_text(SONNET * 10)
    remote = record_of(server, filename=FILENAME)
    root = tmp_path / "root"
    short = D.load_tiny_shakespeare(root=root, max_chars=100, remote=remote)
    assert short.decode(short.train) + short.decode(short.val) == (SONNET * 10)[:100]
    assert (root / FILENAME).read_bytes() == server.read_bytes()
    (root / FILENAME).write_text(SONNET * 9 + SONNET.upper())
    with pytest.raises(D.DataIntegrityError, match="Delete"):
        D.load_tiny_shakespeare(root=root, download=False, remote=remote)


def test_tiny_shakespeare_record_comes_from_the_registry(tmp_path, record_of, monkeypatch):
    server = tmp_path / "input.txt"
    server.write_text(SONNET * 3)
    monkeypatch.setitem(D.REMOTE_FILES, "tiny_shakespeare", record_of(server, filename=FILENAME))
    data = D.load_tiny_shakespeare(root=tmp_path / "root")
    assert data.decode(data.train) + data.decode(data.val) == SONNET * 3
    monkeypatch.undo()
    with pytest.raises(FileNotFoundError, match="No Tiny Shakespeare at .*char-rnn"):
        D.load_tiny_shakespeare(root=tmp_path / "empty", download=False)


def test_tiny_shakespeare_not_utf8_is_a_bad_file(tmp_path, record_of):
    path = tmp_path / FILENAME
    path.write_bytes(SONNET.encode() + b"\xff\xfe")
    with pytest.raises(D.DataIntegrityError, match="not UTF-8"):
        D.load_tiny_shakespeare(root=tmp_path, download=False, remote=record_of(path))
