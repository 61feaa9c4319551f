"""Tests of lsdl_lab.student: the student version of a synthetic notebook and of every
real lab, its malformed markers, the command line, and running the result."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import nbformat
import pytest
import yaml
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from lsdl_lab.student import (
    PLACEHOLDER,
    Edition,
    Solution,
    find_hidden_tests,
    find_solutions,
    main,
    make_student_version,
    nbgrader_metadata,
    pin_edition,
    pin_notebook,
    write_nbgrader_metadata,
)

ROOT = Path(__file__).resolve().parents[1]
LABS = sorted((ROOT / "labs").glob("*.ipynb"))

SETUP = 'import math\nsetup_value = math.sqrt(16)\nprint("setup ran")'

TOP_LEVEL_EXERCISE = """\
values = [1, 2, 3]
### BEGIN SOLUTION
total = sum(values)  # SECRET-1
### END SOLUTION
print("after", total)"""

FUNCTION_EXERCISES = '''\
def momentum_step(w, g, v, lr, beta):
    """One step of heavy-ball momentum."""
    ### BEGIN SOLUTION
    v = beta * v + g  # SECRET-2
    return w - lr * v, v
    ### END SOLUTION


def scaled(x):
    if x > 0:
        ### BEGIN SOLUTION
        return 2 * x  # SECRET-3
        ### END SOLUTION
    return 0
'''

FUNCTION_EXERCISES_STUDENT = f'''\
def momentum_step(w, g, v, lr, beta):
    """One step of heavy-ball momentum."""
    {PLACEHOLDER}


def scaled(x):
    if x > 0:
        {PLACEHOLDER}
    return 0
'''

CHECKER = """\
import torch
from lsdl_lab import check

def reference(w, g, v, lr, beta):
    v = beta * v + g
    return w - lr * v, v

case = (torch.ones(3), torch.ones(3), torch.zeros(3), 0.1, 0.9)
check.check_function(momentum_step, reference, [case])
assert scaled(3) == 6 and scaled(-1) == 0"""

MARKDOWN = """\
# A lab
Why does momentum help?
<!-- BEGIN SOLUTION -->
It averages out the SECRET-4 oscillations.
<!-- END SOLUTION -->
Solutions in code are marked `### BEGIN SOLUTION`, as nbgrader marks them."""


def synthetic_notebook() -> nbformat.NotebookNode:
    setup = new_code_cell(SETUP, execution_count=1)
    setup.outputs = [new_output("stream", name="stdout", text="setup ran\n")]
    nb = new_notebook(
        cells=[
            new_markdown_cell(MARKDOWN),
            setup,
            new_code_cell(TOP_LEVEL_EXERCISE, execution_count=2),
            new_code_cell(FUNCTION_EXERCISES),
            new_code_cell(CHECKER),
        ],
        metadata={
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
            "lsdl": {"chapter": 3},
        },
    )
    nb.cells[1].metadata["tags"] = ["setup"]
    return nb


@pytest.fixture
def lab(tmp_path) -> Path:
    path = tmp_path / "lab.ipynb"
    nbformat.write(synthetic_notebook(), path)
    return path


def student_of(path: Path, tmp_path: Path) -> nbformat.NotebookNode:
    dst = tmp_path / "student" / path.name
    make_student_version(path, dst)
    return nbformat.read(dst, as_version=nbformat.NO_CONVERT)


def execute(nb: nbformat.NotebookNode, cwd: Path, timeout: int) -> tuple[int, str, str] | None:
    """Run ``nb`` in place until its first error; return that cell's index, the error's
    name and its value, or None when every cell ran."""
    paths = [str(ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "LSDL_SCALE": "smoke",
        "OMP_NUM_THREADS": "1",
    }
    client = NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
    )
    try:
        client.execute(env=env)
    except CellExecutionError:
        pass
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            if output.output_type == "error":
                return index, output.ename, output.evalue
    return None


# --- the student version ------------------------------------------------------------------


def test_find_solutions(lab):
    expected = [Solution(0, 3, 5), Solution(2, 2, 4), Solution(3, 3, 6), Solution(3, 11, 13)]
    assert find_solutions(lab) == expected
    assert find_solutions(nbformat.read(lab, as_version=4)) == expected
    assert find_solutions(new_notebook(cells=[new_code_cell("x = 1")])) == []


def test_code_solutions_replaced_with_the_stub(lab, tmp_path):
    removed = make_student_version(lab, tmp_path / "out" / "lab.ipynb")
    assert removed == 4
    nb = nbformat.read(tmp_path / "out" / "lab.ipynb", as_version=4)
    assert nb.cells[1].source == SETUP
    assert nb.cells[2].source == (f'values = [1, 2, 3]\n{PLACEHOLDER}\nprint("after", total)')
    assert nb.cells[3].source == FUNCTION_EXERCISES_STUDENT
    assert nb.cells[4].source == CHECKER
    text = "\n".join(cell.source for cell in nb.cells)
    assert "SECRET" not in text
    assert "### END SOLUTION" not in text
    assert "<!-- BEGIN SOLUTION" not in text and "<!-- END SOLUTION" not in text


def test_markdown_solution_removed(lab, tmp_path):
    nb = student_of(lab, tmp_path)
    assert nb.cells[0].source == (
        "# A lab\nWhy does momentum help?\n"
        "Solutions in code are marked `### BEGIN SOLUTION`, as nbgrader marks them."
    )


def test_outputs_cleared_and_metadata_kept(lab, tmp_path):
    original = nbformat.read(lab, as_version=nbformat.NO_CONVERT)
    nb = student_of(lab, tmp_path)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None
    assert nb.metadata == original.metadata
    assert (nb.nbformat, nb.nbformat_minor) == (original.nbformat, original.nbformat_minor)
    assert [cell.get("id") for cell in nb.cells] == [cell.get("id") for cell in original.cells]
    assert nb.cells[1].metadata["tags"] == ["setup"]


def test_student_version_raises_not_implemented_in_the_first_exercise(lab, tmp_path):
    nb = student_of(lab, tmp_path)
    error = execute(nb, tmp_path, timeout=120)
    assert error is not None
    cell, ename, evalue = error
    assert (cell, ename) == (2, "NotImplementedError"), evalue
    assert "Exercise: write your solution here" in evalue
    assert "setup ran" in nb.cells[1].outputs[0].text


def test_solution_version_runs_to_the_end(lab, tmp_path):
    nb = nbformat.read(lab, as_version=4)
    assert execute(nb, tmp_path, timeout=120) is None
    assert "✔ momentum_step" in nb.cells[4].outputs[0].text


# --- malformed markers ------------------------------------------------------------------------


BEGIN, END = "'### BEGIN SOLUTION'", "'### END SOLUTION'"
MD_BEGIN, MD_END = "'<!-- BEGIN SOLUTION -->'", "'<!-- END SOLUTION -->'"


@pytest.mark.parametrize(
    ("cell", "message"),
    [
        (new_code_cell("x = 1\n### BEGIN SOLUTION\ny = 2"), f"line 2: {BEGIN} without {END}"),
        (
            new_code_cell("### BEGIN SOLUTION\n  ### BEGIN SOLUTION\n### END SOLUTION"),
            f"line 2: {BEGIN} inside the solution opened on line 1",
        ),
        (new_code_cell("x = 1\ny = 2\n### END SOLUTION"), f"line 3: {END} without {BEGIN}"),
        (
            new_code_cell("x = 1  ### BEGIN SOLUTION\n### END SOLUTION"),
            "line 1: a solution marker must be alone on its line",
        ),
        (
            new_code_cell("# BEGIN SOLUTION\nx = 1\n# END SOLUTION"),
            "line 1: a solution marker must be alone on its line",
        ),
        (
            new_markdown_cell("text\n<!-- BEGIN SOLUTION -->\nanswer"),
            f"line 2: {MD_BEGIN} without {MD_END}",
        ),
        (new_markdown_cell("<!-- END SOLUTION -->"), f"line 1: {MD_END} without {MD_BEGIN}"),
    ],
)
def test_malformed_markers(tmp_path, cell, message):
    src = tmp_path / "bad.ipynb"
    nbformat.write(new_notebook(cells=[new_code_cell("ok = 1"), cell]), src)
    dst = tmp_path / "out" / "bad.ipynb"
    with pytest.raises(ValueError) as info:
        make_student_version(src, dst)
    assert str(info.value).startswith(f"{src}, cell 1, {message}")
    assert not dst.exists()
    with pytest.raises(ValueError, match="cell 1, line"):
        find_solutions(src)


def test_refuses_to_overwrite_the_solutions(lab):
    with pytest.raises(ValueError, match="dst_path"):
        make_student_version(lab, lab)
    assert find_solutions(lab)  # still there


# --- pinned to an edition -------------------------------------------------------------------


REPO = "https://github.com/owner/book"
SITE = "https://owner.github.io/book/"
COLAB = "https://colab.research.google.com/github/owner/book/blob"
INSTALL = (
    "try:\n    import lsdl_lab\nexcept ImportError:\n    import subprocess, sys\n\n"
    '    subprocess.check_call([sys.executable, "-m", "pip", "install", "git+{repo}"])'
)
LINKS = (
    f"# Lab 3\n[Open in Colab]({COLAB}/main/labs/lab03.ipynb), [Chapter 3]"
    f"({SITE}book/ch03.html#adam), [the book]({SITE}), [results]({REPO}/blob/main/b/r.md), "
    f"[an edition]({SITE}v1/book/ch03.html), [the repository]({REPO}), "
    f"[a branch]({REPO}/blob/mainline/x.md), [elsewhere](https://github.com/owner/other/blob/main/x.md)"
)
PINNED = (
    f"# Lab 3\n[Open in Colab]({COLAB}/v4/labs/lab03.ipynb), [Chapter 3]"
    f"({SITE}v4/book/ch03.html#adam), [the book]({SITE}v4/), [results]({REPO}/blob/v4/b/r.md), "
    f"[an edition]({SITE}v1/book/ch03.html), [the repository]({REPO}), "
    f"[a branch]({REPO}/blob/mainline/x.md), [elsewhere](https://github.com/owner/other/blob/main/x.md)"
)


def edition_notebook(path: Path) -> Path:
    """A lab of the repository REPO: links of every kind, its install cell, an exercise."""
    nb = new_notebook(
        cells=[
            new_markdown_cell(LINKS),
            new_code_cell(INSTALL.format(repo=REPO)),
            new_code_cell(TOP_LEVEL_EXERCISE),
        ]
    )
    nbformat.write(nb, path)
    return path


def test_pin_edition_rewrites_each_kind_of_link():
    edition = Edition("v4", REPO, SITE)
    text, counts = pin_edition(LINKS, edition)
    assert text == PINNED
    assert counts == Counter(repository=2, site=2, install=0)
    for install, pinned in (
        (f"pip install git+{REPO}", f"pip install git+{REPO}@v4"),
        (f'"git+{REPO}.git"', f'"git+{REPO}@v4"'),
        (f"git+{REPO}@v1", f"git+{REPO}@v1"),  # pinned already
        (f"git+{REPO}-fork", f"git+{REPO}-fork"),  # another repository
    ):
        assert pin_edition(install, edition)[0] == pinned, install
    # without a site, the book's links stay as they are
    text, counts = pin_edition(LINKS, Edition("v4", REPO))
    assert f"({SITE}book/ch03.html#adam)" in text and f"{COLAB}/v4/" in text
    assert counts["site"] == 0
    assert pin_edition(PINNED, edition) == (PINNED, Counter(repository=0, site=0, install=0))


def test_student_version_pinned_to_an_edition(tmp_path):
    lab = edition_notebook(tmp_path / "lab.ipynb")
    out = tmp_path / "student" / "lab.ipynb"
    assert make_student_version(lab, out, edition="v4", repository=REPO, site=SITE) == 1
    nb = nbformat.read(out, as_version=4)
    assert nb.cells[0].source == PINNED
    assert nb.cells[1].source == INSTALL.format(repo=f"{REPO}@v4")
    assert PLACEHOLDER in nb.cells[2].source and "total = sum" not in nb.cells[2].source
    # without an edition, the links are the lab's
    make_student_version(lab, out)
    nb = nbformat.read(out, as_version=4)
    assert nb.cells[0].source == LINKS and nb.cells[1].source == INSTALL.format(repo=REPO)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"edition": "v4"}, "needs the repository"),
        ({"repository": REPO}, "give the edition's tag"),
        ({"edition": "v4 main", "repository": REPO}, "Invalid edition: 'v4 main'"),
        ({"edition": "v4", "repository": "github.com/owner/book"}, "Invalid repository"),
        ({"edition": "v4", "repository": REPO, "site": "owner.github.io"}, "Invalid site"),
        ({"edition": "v4", "repository": f"{REPO}-fork"}, "installs nothing from"),
    ],
)
def test_pinning_refuses(tmp_path, kwargs, message):
    lab = edition_notebook(tmp_path / "lab.ipynb")
    out = tmp_path / "student" / "lab.ipynb"
    with pytest.raises(ValueError, match=re.escape(message)):
        make_student_version(lab, out, **kwargs)
    assert not out.exists()


def test_cli_pins_an_edition(tmp_path, capsys):
    lab = edition_notebook(tmp_path / "lab.ipynb")
    out = tmp_path / "student"
    pin = ["--edition", "v4", "--repository", REPO, "--site", SITE]
    assert main([str(lab), "-o", str(out), *pin]) == 0
    assert "1 solution(s) removed, pinned to v4" in capsys.readouterr().out
    assert nbformat.read(out / "lab.ipynb", as_version=4).cells[0].source == PINNED
    for args, says in (
        ([str(lab), "-o", str(out), "--edition", "v4"], "needs both --edition and --repository"),
        (["--check", str(lab), *pin], "apply to the student versions"),
        ([str(lab), "-o", str(out), "--edition", "v 4", "--repository", REPO], "Invalid edition"),
    ):
        with pytest.raises(SystemExit) as info:
            main(args)
        assert info.value.code == 2 and says in capsys.readouterr().err, args


def test_a_lab_pinned_in_place_keeps_its_solutions_and_installs_the_tag(tmp_path):
    """What `make pin-labs EDITION=v4` does to the labs before the tag is made: the
    notebook itself pinned (solutions and all), which `make check-edition` then accepts."""
    lab = edition_notebook(tmp_path / "lab.ipynb")
    before = lab.read_bytes()
    assert pin_notebook(lab, "v4", REPO, SITE, check=True) == 5  # 4 links, 1 install
    assert lab.read_bytes() == before  # a check writes nothing
    assert pin_notebook(lab, "v4", REPO, SITE) == 5
    nb = nbformat.read(lab, as_version=4)
    assert nb.cells[0].source == PINNED
    assert nb.cells[1].source == INSTALL.format(repo=f"{REPO}@v4")
    assert nb.cells[2].source == TOP_LEVEL_EXERCISE  # the solution is still there
    assert pin_notebook(lab, "v4", REPO, SITE, check=True) == 0  # pinned: nothing to do
    # the student version of a pinned lab is pinned to the same tag
    out = tmp_path / "student" / "lab.ipynb"
    assert make_student_version(lab, out, edition="v4", repository=REPO, site=SITE) == 1
    assert nbformat.read(out, as_version=4).cells[1].source == INSTALL.format(repo=f"{REPO}@v4")
    # a lab pinned to another edition is refused, not counted as pinned
    with pytest.raises(ValueError, match=re.escape(f"installs nothing from {REPO}@v5")):
        pin_notebook(lab, "v5", REPO, SITE, check=True)


def test_cli_pins_labs_in_place_and_checks_them(tmp_path, capsys):
    lab = edition_notebook(tmp_path / "lab.ipynb")
    pin = ["--pin", "--edition", "v4", "--repository", REPO, "--site", SITE]
    assert main([str(lab), *pin, "--check"]) == 1
    assert "5 link(s) not pinned to v4; run make pin-labs" in capsys.readouterr().err
    assert main([str(lab), *pin]) == 0
    assert "5 link(s) pinned to v4" in capsys.readouterr().out
    assert main([str(lab), *pin, "--check"]) == 0
    assert main([str(lab), *pin[:2], "v5", *pin[3:], "--check"]) == 1
    assert "installs nothing from" in capsys.readouterr().err
    for args in ([str(lab), "--pin"], [str(lab), *pin, "-o", str(tmp_path / "o")]):
        with pytest.raises(SystemExit) as info:
            main(args)
        assert info.value.code == 2 and "--pin edits the notebooks in place" in (
            capsys.readouterr().err
        ), args


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.name)
def test_lab_pinned_to_an_edition_names_only_the_tag(path, tmp_path):
    """What `make release EDITION=v4` hands out, from _config.yml's repository and site: the
    lab's Colab link opens the tag's notebook, its install cell installs the tag, its links
    to the repository's files and the book's pages open the tag's and the edition's."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    repo, site = config["repository"]["url"].rstrip("/"), config["html"]["baseurl"]
    out = tmp_path / path.name
    make_student_version(path, out, edition="v4", repository=repo, site=site)
    text = "\n".join(cell.source for cell in nbformat.read(out, as_version=4).cells)
    assert f"git+{repo}@v4" in text
    assert f"{COLAB.replace('owner/book', repo.removeprefix('https://github.com/'))}/v4/" in text
    assert not re.findall(rf"git\+{re.escape(repo)}(?!@v4)", text)
    slug = re.escape(repo.removeprefix("https://github.com/"))
    assert not re.findall(rf"github\.com/{slug}/(?:blob|tree)/main/", text)
    assert not re.findall(rf"{re.escape(site)}(?!v4/)", text)


# --- the command line --------------------------------------------------------------------------


def test_cli_writes_student_versions(lab, tmp_path, capsys):
    other = tmp_path / "other.ipynb"
    nbformat.write(new_notebook(cells=[new_code_cell(TOP_LEVEL_EXERCISE)]), other)
    out = tmp_path / "student"
    assert main([str(lab), str(other), "-o", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["lab.ipynb", "other.ipynb"]
    assert nbformat.read(out / "lab.ipynb", as_version=4).cells[3].source == (
        FUNCTION_EXERCISES_STUDENT
    )
    assert "4 solution(s) removed" in capsys.readouterr().out


def test_cli_check(lab, tmp_path, capsys):
    bad = tmp_path / "bad.ipynb"
    nbformat.write(new_notebook(cells=[new_code_cell("### BEGIN SOLUTION")]), bad)
    assert main(["--check", str(lab)]) == 0
    assert main(["--check", str(lab), str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}, cell 0, line 1" in err and str(lab) not in err


def test_cli_errors(lab, tmp_path, capsys):
    assert main([str(tmp_path / "missing.ipynb"), "-o", str(tmp_path / "out")]) == 1
    assert "missing.ipynb" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main([str(lab)])
    assert info.value.code == 2
    assert "-o" in capsys.readouterr().err


def test_runs_as_a_module(lab, tmp_path):
    bad = tmp_path / "bad.ipynb"
    nbformat.write(new_notebook(cells=[new_code_cell("### END SOLUTION")]), bad)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "lsdl_lab.student", "--check"]
    assert subprocess.run([*command, str(lab)], env=env, capture_output=True).returncode == 0
    result = subprocess.run([*command, str(bad)], env=env, capture_output=True, text=True)
    assert result.returncode == 1 and "without" in result.stderr


# --- every real lab -------------------------------------------------------------------------------


def solution_lines(path: Path) -> tuple[Counter, Counter]:
    """The stripped lines inside solution blocks, and those outside them (hidden tests, which
    the student version also loses, counted in neither)."""
    nb = nbformat.read(path, as_version=4)
    inside: Counter = Counter()
    outside: Counter = Counter()
    blocks = find_solutions(nb)
    hidden = find_hidden_tests(nb)
    for index, cell in enumerate(nb.cells):
        spans = [(s.start_line, s.end_line) for s in blocks if s.cell == index]
        gone = [(s.start_line, s.end_line) for s in hidden if s.cell == index]
        for number, line in enumerate(cell.source.split("\n"), start=1):
            if any(start <= number <= end for start, end in gone):
                continue
            inside_block = any(start < number < end for start, end in spans)
            if line.strip() and not any(number in (start, end) for start, end in spans):
                (inside if inside_block else outside)[line.strip()] += 1
    return inside, outside


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.name)
def test_lab_student_version_has_no_solutions(path, tmp_path):
    assert find_solutions(path), f"{path.name} has no exercise with a marked solution"
    student = student_of(path, tmp_path)
    lines = Counter(
        line.strip() for cell in student.cells for line in cell.source.split("\n") if line.strip()
    )
    assert "### BEGIN SOLUTION" not in lines and "### END SOLUTION" not in lines
    inside, outside = solution_lines(path)
    for line in inside:
        # A solution line may also occur outside the solutions; only those may remain.
        assert lines[line] == outside[line], f"solution line survives: {line!r}"


# That the student version of every lab runs up to its first exercise, and after it fails
# only on the exercises' stubs, is tested under nbgrader (tests/test_nbgrader.py), whose
# released version is this one cell for cell.


# --- nbgrader's cell metadata -------------------------------------------------------------------


def graded_notebook() -> nbformat.NotebookNode:
    """A lab as nbgrader wants it: each code exercise followed by its checker cell."""
    nb = new_notebook(
        cells=[
            new_markdown_cell(MARKDOWN),
            new_code_cell(SETUP),
            new_code_cell(FUNCTION_EXERCISES),
            new_code_cell(CHECKER),
            new_code_cell("print('after')"),
        ]
    )
    nb.cells[0].id = "intro"  # a Markdown answer is named by its cell id
    nb.cells[1].metadata["tags"] = ["setup"]
    nb.cells[4].metadata["nbgrader"] = {"grade": True}  # stale: no exercise before it
    return nb


SOLUTION_META = {"schema_version": 3, "locked": False, "solution": True}


def test_nbgrader_metadata():
    wanted = nbgrader_metadata(graded_notebook(), lab="lab09")
    assert wanted == [
        {**SOLUTION_META, "grade": True, "grade_id": "lab09-answer-intro", "points": 1},
        None,
        {**SOLUTION_META, "grade": False, "grade_id": "lab09-momentum_step"},
        {
            "schema_version": 3,
            "locked": True,
            "solution": False,
            "grade": True,
            "grade_id": "lab09-momentum_step-check",
            "points": 1,
        },
        None,
    ]


def test_write_nbgrader_metadata_touches_only_that(tmp_path):
    path = tmp_path / "lab09_demo.ipynb"
    nb = graded_notebook()
    nb.cells[3].metadata["nbgrader"] = {"points": 5}  # an instructor's weight is kept
    nbformat.write(nb, path)
    assert write_nbgrader_metadata(path, check=True)
    assert nbformat.read(path, as_version=4) == nb  # check writes nothing
    assert write_nbgrader_metadata(path)
    written = nbformat.read(path, as_version=4)
    assert [c.metadata.get("nbgrader") for c in written.cells] == nbgrader_metadata(path)
    assert written.cells[2].metadata["nbgrader"]["grade_id"] == "lab09-momentum_step"
    assert written.cells[3].metadata["nbgrader"]["points"] == 5
    assert "nbgrader" not in written.cells[4].metadata
    assert written.cells[1].metadata["tags"] == ["setup"]
    for before, after in zip(nb.cells, written.cells, strict=True):
        assert (before.source, before.get("id")) == (after.source, after.get("id"))
    text = path.read_text()
    assert not write_nbgrader_metadata(path) and path.read_text() == text


@pytest.mark.parametrize(
    ("cells", "message"),
    [
        ([new_code_cell(FUNCTION_EXERCISES)], "'momentum_step' needs its checker"),
        (
            [new_code_cell(FUNCTION_EXERCISES), new_markdown_cell("Now check it.")],
            "'momentum_step' needs its checker",
        ),
        (
            [new_code_cell(FUNCTION_EXERCISES), new_code_cell(FUNCTION_EXERCISES)],
            "'momentum_step' needs its checker",
        ),
        ([new_code_cell(TOP_LEVEL_EXERCISE), new_code_cell(CHECKER)], "defines no function"),
        (
            [new_code_cell(source) for source in [FUNCTION_EXERCISES, CHECKER] * 2],
            "share the grade id(s) ['lab09-momentum_step', 'lab09-momentum_step-check']",
        ),
    ],
)
def test_nbgrader_metadata_errors(tmp_path, cells, message):
    path = tmp_path / "lab09_bad.ipynb"
    nbformat.write(new_notebook(cells=cells), path)
    with pytest.raises(ValueError, match=re.escape(message)):
        write_nbgrader_metadata(path)
    with pytest.raises(ValueError, match="lab is required"):
        nbgrader_metadata(new_notebook(cells=cells))


def test_cli_nbgrader(tmp_path, capsys):
    path = tmp_path / "lab09_demo.ipynb"
    nbformat.write(graded_notebook(), path)
    assert main(["--nbgrader", "--check", str(path)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert main(["--nbgrader", str(path)]) == 0
    assert main(["--nbgrader", "--check", str(path)]) == 0
    with pytest.raises(SystemExit):
        main(["--nbgrader", str(path), "-o", str(tmp_path / "out")])
    assert "takes no -o" in capsys.readouterr().err


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.name)
def test_lab_nbgrader_metadata_matches_its_markers(path):
    # A new exercise without metadata, or metadata left on a cell that lost its markers,
    # fails here; `lsdl-student --nbgrader labs/*.ipynb` fixes it.
    assert not write_nbgrader_metadata(path, check=True), (
        f"{path.name}: run lsdl-student --nbgrader {path.relative_to(ROOT)}"
    )
    nb = nbformat.read(path, as_version=4)
    graded = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")]
    # A Markdown model answer is a manually graded solution; every other graded cell checks
    # a code exercise.
    answers = [c for c in graded if c.cell_type == "markdown"]
    assert all(c.metadata["nbgrader"]["solution"] for c in answers)
    checkers = [c for c in graded if c.cell_type == "code"]
    exercises = {s.cell for s in find_solutions(nb) if nb.cells[s.cell].cell_type == "code"}
    assert len(checkers) == len(exercises)
    assert all(c.source.startswith("check.checker(") for c in checkers)
    # nbgrader rejects a solution region in a cell it does not know as a solution cell.
    for index, cell in enumerate(nb.cells):
        if "BEGIN SOLUTION" in cell.source or "END SOLUTION" in cell.source:
            assert cell.metadata.get("nbgrader", {}).get("solution"), f"cell {index}"


HIDDEN_CHECKER = """\
print("visible check")
### BEGIN HIDDEN TESTS
assert momentum_step(1.0, 1.0, 0.0, 0.5, 0.9)[0] == 0.5  # HIDDEN-1
### END HIDDEN TESTS
print("after the hidden tests")"""


def test_hidden_tests_removed_like_nbgrader_and_only_in_checker_cells(tmp_path):
    from lsdl_lab.student import find_hidden_tests

    nb = new_notebook(cells=[new_code_cell(FUNCTION_EXERCISES), new_code_cell(HIDDEN_CHECKER)])
    src = tmp_path / "lab09_hidden.ipynb"
    nbformat.write(nb, src)
    assert find_hidden_tests(src) == [Solution(1, 2, 4)]
    assert nbgrader_metadata(src)[1]["grade"] is True  # a checker cell: allowed there
    assert make_student_version(src, tmp_path / "out.ipynb") == 2
    checker = nbformat.read(tmp_path / "out.ipynb", as_version=4).cells[1].source
    assert checker == 'print("visible check")\nprint("after the hidden tests")'
    assert main(["--check", str(src)]) == 0

    # hidden tests outside a checker cell would be lost from the autograded version
    for cells in ([new_code_cell(HIDDEN_CHECKER)], [new_code_cell(SETUP + "\n" + HIDDEN_CHECKER)]):
        nbformat.write(new_notebook(cells=cells), src)
        with pytest.raises(ValueError, match="hidden tests must be in an exercise's checker"):
            nbgrader_metadata(src)
    unclosed = HIDDEN_CHECKER.replace("### END HIDDEN TESTS\n", "")
    nbformat.write(new_notebook(cells=[new_code_cell(unclosed)]), src)
    with pytest.raises(ValueError, match="without '### END HIDDEN TESTS'"):
        find_hidden_tests(src)
    inline = HIDDEN_CHECKER.replace("### END HIDDEN TESTS", "x = 1  # END HIDDEN TESTS")
    nbformat.write(new_notebook(cells=[new_code_cell(inline)]), src)
    with pytest.raises(ValueError, match="a hidden-test marker must be alone"):
        find_hidden_tests(src)


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.name)
def test_lab_hidden_tests_are_well_placed_and_hidden_from_students(path, tmp_path):
    from lsdl_lab.student import find_hidden_tests

    hidden = find_hidden_tests(path)
    nbgrader_metadata(path)  # raises if one is outside a checker cell
    make_student_version(path, tmp_path / path.name)
    student = nbformat.read(tmp_path / path.name, as_version=4)
    assert "HIDDEN TESTS" not in "\n".join(c.source for c in student.cells)
    source = nbformat.read(path, as_version=4)
    for block in hidden:
        lines = source.cells[block.cell].source.split("\n")
        tests = lines[block.start_line : block.end_line - 1]
        assert any("assert" in line for line in tests), f"cell {block.cell}: no hidden assert"
        del lines[block.start_line - 1 : block.end_line]
        assert student.cells[block.cell].source == "\n".join(lines)  # all of it, and only it
