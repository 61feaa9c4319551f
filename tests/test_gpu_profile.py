"""The ``gpu`` profile, proven on a CPU: a dry run of every lab at its ``gpu`` settings.

Colab's default profile is ``gpu``; a crash, a shape error or an unbounded loop there must
fail here, not in a student's session. Each lab is executed (nbclient) with
``LSDL_SCALE=gpu`` on this CPU: the ``gpu`` profile's models (ResNet-20 of width 16, the
six-layer GPT of width 384 and context 256), its data sets and its code paths. Two caps,
read by :mod:`lsdl_lab.profiles`, make it affordable: ``LSDL_MAX_STEPS`` bounds every loop
(training steps, races, sweeps, the labs' own loops) and ``LSDL_MAX_EXAMPLES`` every batch
and measured subset. Nothing else changes.

The data are CIFAR-10 and Tiny Shakespeare as files in their official formats (the
python-version tar.gz of pickled batches, 50,000 + 10,000 images of 3x32x32 in
``cifar-10-batches-py/``; a UTF-8 ``input.txt`` of plays), made synthetic here and
registered as the records of ``lsdl_lab.data.REMOTE_FILES`` with their own size and
checksums, under a data root of their own (``LSDL_DATA``): verification passes for these
files only, and a record's URL that cannot be fetched makes any download attempt fail, so
nothing is downloaded. They are registered in every Python process of the dry run, by a
``sitecustomize`` module on its ``PYTHONPATH``: the kernel, and the ranks that Labs 7 and
9 start (forked from a fresh server by :func:`lsdl_lab.distributed.spawn`, or new Pythons under
``torchrun``), which load their data themselves. The caps reach those ranks through the
environment, as the rest of it does.

A lab's own ``assert`` statements check effects (the large batch is sharper, an optimizer
wins) that need the uncapped steps. In the dry run every notebook ``assert`` is rewritten
(an IPython AST transformer, notebook code only, never the library's) to evaluate its
condition, so an error computing it (a shape mismatch, a missing key) still fails, and to
record a false one instead of raising; the recorded ones are printed. Every other error
fails the test, and so does a cell that runs past its time limit.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import tarfile
import time
from pathlib import Path

import nbformat
import numpy as np
import pytest
import torch
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError

ROOT = Path(__file__).resolve().parents[1]
LABS = sorted((ROOT / "labs").glob("lab*.ipynb"))
CHAPTERS = sorted((ROOT / "book").glob("ch*.md"))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where a lab's setup() puts it
# Two steps (a loop whose first step is special still runs an ordinary one); 16 images; a
# text window of 256 tokens counts 256 examples (tokens), so texts get one.
MAX_STEPS, MAX_EXAMPLES = 2, 16
# Seconds a cell may take. A capped cell takes seconds on a quiet machine and minutes on a
# busy one; a loop the caps do not bound runs for hours at gpu sizes, past this, and fails.
CELL_TIMEOUT = 600
# The classes in the order of the official batches.meta.
CLASSES = "airplane automobile bird cat deer dog frog horse ship truck".split()


# --- the synthetic data sets, in the official formats ---------------------------------------


def _batch_pickle(obj) -> bytes:
    # Protocol 2 with the numpy module name of numpy 1, as in the official Python 2 pickles.
    return pickle.dumps(obj, protocol=2).replace(
        b"numpy._core.multiarray", b"numpy.core.multiarray"
    )


def _images(n: int, rng: np.random.Generator) -> tuple[np.ndarray, list[int]]:
    """``n`` rows of 3072 uint8 (1024 red, 1024 green, 1024 blue, each row-major) and labels:
    a class-coloured gradient with noise in the low bits, so the archive compresses fast."""
    labels = rng.integers(0, 10, size=n)
    ramp = np.arange(1024, dtype=np.int64) // 32 * 4  # rows get brighter: 0..124
    base = (labels[:, None, None] * 13 + np.array([0, 40, 80])[None, :, None]) % 128
    pixels = base + ramp[None, None, :] + rng.integers(0, 4, size=(n, 1, 1))
    return pixels.reshape(n, 3072).astype(np.uint8), [int(c) for c in labels]


def write_cifar10(path: Path, per_batch: int = 2_000, seed: int = 0) -> None:
    """CIFAR-10's python-version archive: five training batches and a test batch of
    ``per_batch`` images each and ``batches.meta``, pickled dicts with bytes keys, in
    ``cifar-10-batches-py/``. The real batches hold 10,000 images; 2,000 keep the archive
    quick to write and load while the training set (10,000) still holds the largest batch
    of any lab (8,192, Lab 4a)."""
    rng = np.random.default_rng(seed)
    members = {}
    for name in [f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]:
        data, labels = _images(per_batch, rng)
        members[name] = {
            b"batch_label": name.encode(),
            b"labels": labels,
            b"data": data,
            b"filenames": [b"synthetic_%05d.png" % i for i in range(len(labels))],
        }
    members["batches.meta"] = {
        b"label_names": [c.encode() for c in CLASSES],
        b"num_cases_per_batch": per_batch,
        b"num_vis": 3072,
    }
    with tarfile.open(path, "w:gz", compresslevel=1) as tar:
        for name, obj in members.items():
            payload = _batch_pickle(obj)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))


def write_tiny_shakespeare(path: Path, chars: int = 1_115_394, seed: int = 0) -> None:
    """A play's text as Karpathy's ``input.txt`` lays it out (a speaker's name and colon on
    a line, lines of speech, a blank line), of Tiny Shakespeare's length, in its alphabet."""
    rng = np.random.default_rng(seed)
    names = ["First Citizen", "MENENIUS", "CORIOLANUS", "ROMEO", "JULIET", "KING RICHARD III"]
    words = (
        "the and to of I you my a that in is not it with me be your his for this but he "
        "have as thou so will what her thy all no by shall do lord if are good O come "
        "Let's we'll nay; sir, well! why? now: there - here & more... Zounds, quoth-jest"
    ).split()
    speeches = [f"{names[i]}:\n" for i in range(len(names))]
    # Lines of 4 to 11 words; every 1 to 4 lines a speech ends and a name begins the next.
    n_words = chars // 4
    text = np.array(words, dtype=object)[rng.integers(0, len(words), n_words)]
    ends = np.cumsum(rng.integers(4, 12, size=n_words // 4))
    ends = ends[ends < n_words]
    text[ends] = text[ends] + np.where(
        rng.random(len(ends)) < 0.3,
        [f".\n\n{speeches[k]}" for k in rng.integers(0, len(names), len(ends))],
        ",\n",
    )
    body = (speeches[0] + " ".join(text.tolist())).replace("\n ", "\n")
    path.write_text(body[:chars], encoding="utf-8")


def _record(title: str, path: Path) -> dict:
    data = path.read_bytes()
    return {
        "title": title,
        # Unfetchable: a download attempt (a failed verification) errors out, offline.
        "url": f"file:///nonexistent/lsdl-dry-run/{path.name}",
        "filename": path.name,
        "size": len(data),
        "md5": hashlib.md5(data).hexdigest(),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


@pytest.fixture(scope="module")
def gpu_data(tmp_path_factory) -> tuple[Path, dict]:
    """The data root and the records (RemoteFile arguments) of the two synthetic files."""
    root = tmp_path_factory.mktemp("lsdl_data")
    write_cifar10(root / "cifar-10-python.tar.gz")
    write_tiny_shakespeare(root / "tiny_shakespeare.txt")
    records = {
        "cifar10": _record("synthetic CIFAR-10 archive", root / "cifar-10-python.tar.gz"),
        "tiny_shakespeare": _record("synthetic Tiny Shakespeare", root / "tiny_shakespeare.txt"),
    }
    site = root / "site"  # see the module's docstring
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(records=records))
    return root, records


# --- the dry run ---------------------------------------------------------------------------

SITECUSTOMIZE = """\
# The dry run's synthetic data sets, registered in each of its Python processes.
from lsdl_lab.data import REMOTE_FILES, RemoteFile

for name, record in {records!r}.items():
    REMOTE_FILES[name] = RemoteFile(**record)
"""

SETUP = """\
import ast as _ast

from lsdl_lab.data import REMOTE_FILES as _REMOTE_FILES

# registered by the dry run's sitecustomize
assert _REMOTE_FILES["cifar10"].url.startswith("file:///nonexistent/lsdl-dry-run/")

_dry_run_false_asserts = []


class _RecordFalseAsserts(_ast.NodeTransformer):
    # `assert test, msg` -> `if not (test): _dry_run_false_asserts.append(<source of test>)`
    def visit_Assert(self, node):
        record = _ast.parse(
            f"_dry_run_false_asserts.append({_ast.unparse(node.test)!r})"
        ).body[0]
        new = _ast.If(test=_ast.UnaryOp(_ast.Not(), node.test), body=[record], orelse=[])
        return _ast.copy_location(new, node)


get_ipython().ast_transformers.append(_RecordFalseAsserts())
"""

REPORT = "import json as _json\nprint('DRY-RUN-ASSERTS', _json.dumps(_dry_run_false_asserts))"


def dry_run_env(root: Path) -> dict:
    paths = [str(root / "site"), str(ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "LSDL_SCALE": "gpu",
        "LSDL_MAX_STEPS": str(MAX_STEPS),
        "LSDL_MAX_EXAMPLES": str(MAX_EXAMPLES),
        "LSDL_DATA": str(root),
        "OMP_NUM_THREADS": "1",
        "TQDM_DISABLE": "1",
        "MPLBACKEND": "Agg",
    }


def first_error(nb) -> str | None:
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            if output.output_type == "error":
                trace = "\n".join(output.get("traceback", [])[-6:])
                return f"cell {index}: {output.ename}: {output.evalue}\n{trace}"
    return None


def dry_run(nb, source: Path, root: Path, setup_at: int, capsys) -> str:
    """Execute ``nb`` (of the file ``source``) at ``gpu`` with the caps, the dry run's
    setup inserted at cell ``setup_at`` and the report of false assertions appended: no
    cell may fail or run past its time; the false assertions are printed. Returns what
    the notebook printed."""
    nb.cells.insert(setup_at, nbformat.v4.new_code_cell(SETUP))
    nb.cells.append(nbformat.v4.new_code_cell(REPORT))
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT,
        kernel_name="python3",
        resources={"metadata": {"path": str(source.parent)}},
    )
    start = time.perf_counter()
    try:
        client.execute(env=dry_run_env(root))
    except CellTimeoutError as err:
        pytest.fail(f"{source.name} at gpu: a cell ran past {CELL_TIMEOUT} s ({err})")
    except CellExecutionError:
        pass
    seconds = time.perf_counter() - start
    error = first_error(nb)
    assert error is None, f"{source.name} at gpu (dry run): {error}"
    # A stream may arrive in pieces: join them before reading the line.
    printed_last = "".join(output.get("text", "") for output in nb.cells[-1].outputs)
    report = [line for line in printed_last.splitlines() if line.startswith("DRY-RUN-ASSERTS ")]
    assert len(report) == 1, nb.cells[-1].outputs
    false_asserts = json.loads(report[0].removeprefix("DRY-RUN-ASSERTS "))
    with capsys.disabled():
        print(
            f"\n{source.stem}: dry run at gpu in {seconds:.1f} s; {len(false_asserts)} effect "
            f"assertion(s) false under the caps: {false_asserts}"
        )
    return "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))


@pytest.mark.parametrize("lab", LABS, ids=[lab.stem for lab in LABS])
def test_lab_runs_at_the_gpu_profile(lab, gpu_data, capsys):
    nb = nbformat.read(lab, as_version=4)
    # After the install cell (the first code cell), before the lab's imports.
    first = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
    printed = dry_run(nb, lab, gpu_data[0], first + 1, capsys)
    assert f"lsdl_lab: profile 'gpu' on {DEVICE}" in printed


# --- the chapters, on a GPU machine ---------------------------------------------------------


def chapter_notebook(path: Path) -> nbformat.NotebookNode:
    """A chapter's code cells as a notebook, as myst-nb reads them (checked against its
    reader below): each ```{code-cell} block's body without its options, a YAML block
    between ``---`` lines or ``:key: value`` lines at its top. (The GPU check's machine
    need not have the book's toolchain.)"""
    cells = []
    blocks = re.finditer(
        r"^```\{code-cell\}[^\n]*\n(.*?)^```[ \t]*$", path.read_text(), re.S | re.M
    )
    for block in blocks:
        lines = block.group(1).splitlines()
        if lines and lines[0].strip() == "---":
            lines = lines[[line.strip() for line in lines].index("---", 1) + 1 :]
        while lines and re.match(r":[\w-]+:", lines[0]):
            lines = lines[1:]
        cells.append(nbformat.v4.new_code_cell("\n".join(lines).strip("\n")))
    return nbformat.v4.new_notebook(cells=cells)


def test_chapters_are_read_as_myst_nb_reads_them():
    myst_nb = pytest.importorskip("myst_nb.core.read", reason="the book's toolchain")
    for chapter in CHAPTERS:
        theirs = myst_nb.read_myst_markdown_notebook(chapter.read_text())
        code = [c.source.strip("\n") for c in theirs.cells if c.cell_type == "code"]
        assert [c.source for c in chapter_notebook(chapter).cells] == code, chapter.name


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="a chapter's own loops are not capped: at gpu sizes it needs a GPU (make test-gpu)",
)
@pytest.mark.parametrize("chapter", CHAPTERS, ids=[c.stem for c in CHAPTERS])
def test_chapter_runs_at_the_gpu_profile(chapter, gpu_data, capsys):
    """Each chapter's code at ``gpu`` on CUDA, with the caps the library's loops read: no
    cell may fail (its assertions record instead of raising, as in the labs)."""
    dry_run(chapter_notebook(chapter), chapter, gpu_data[0], 0, capsys)


# --- the machinery, checked on its own --------------------------------------------------------


def test_synthetic_files_verify_only_under_their_own_records(gpu_data):
    from lsdl_lab.data import (
        REMOTE_FILES,
        DataIntegrityError,
        RemoteFile,
        files,
        load_cifar10,
        load_tiny_shakespeare,
    )

    root, records = gpu_data
    for name, record in records.items():
        real = REMOTE_FILES[name]
        with pytest.raises(DataIntegrityError):  # the published checksums reject them
            files.fetch(real, root, download=False)
        files.fetch(RemoteFile(**record), root, download=False)
    images = load_cifar10(root, download=False, remote=RemoteFile(**records["cifar10"]))
    assert images.train_x.shape == (10_000, 3, 32, 32) and images.test_x.shape[1:] == (3, 32, 32)
    assert images.classes == tuple(CLASSES)
    text = load_tiny_shakespeare(
        root, download=False, remote=RemoteFile(**records["tiny_shakespeare"])
    )
    assert len(text.train) + len(text.val) == 1_115_394 and 40 < text.vocab_size < 80


def test_the_dry_run_records_false_asserts_and_fails_on_errors(gpu_data, tmp_path):
    root, _ = gpu_data
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(SETUP),
        nbformat.v4.new_code_cell("import torch\nassert 1 + 1 == 3, 'an effect'\nx = 1"),
        nbformat.v4.new_code_cell(REPORT),
        nbformat.v4.new_code_cell("torch.zeros(2, 3) @ torch.zeros(2, 3)  # a shape error"),
    ]
    client = NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3")
    with pytest.raises(CellExecutionError):
        client.execute(env=dry_run_env(root))
    assert "DRY-RUN-ASSERTS " + json.dumps(["1 + 1 == 3"]) in nb.cells[2].outputs[0]["text"]
    error = first_error(nb)
    assert error is not None and error.startswith("cell 3: RuntimeError")
