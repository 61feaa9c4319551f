"""Every lab under nbgrader itself (0.9.6, a test dependency), in a temporary course
directory: ``generate_assignment`` releases it without its solutions and as
``lsdl-student`` writes it; ``autograde`` gives the released version, submitted as is,
zero on every exercise while the rest of the notebook still runs, and the instructor's
version full marks.

Autograding executes a whole lab per submission (at ``LSDL_SCALE=smoke``, 10 to 40 s),
so to keep ``make test`` within its budget the source version is graded on
``SOURCE_LABS`` only; the labs' own run (nbval over labs/) already shows every solution
passes its checker.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from lsdl_lab.student import PLACEHOLDER, find_solutions, make_student_version

ROOT = Path(__file__).resolve().parents[1]
LABS = sorted((ROOT / "labs").glob("*.ipynb"))
# The cheapest lab, and one with three exercises (Lab 3, the longest at smoke, is left out).
SOURCE_LABS = ("lab01_getting_started", "lab08_memory")
BIN = Path(sys.executable).parent
# nbgrader's code stub (ClearSolutions.code_stub), each line indented like the marker.
NBGRADER_STUB = re.compile(r"^([ \t]*)# YOUR CODE HERE\n\1raise NotImplementedError\(\)$", re.M)

pytestmark = pytest.mark.notebook


def nbgrader(course: Path, *args: str) -> str:
    """Run one nbgrader command in ``course``; its output, or a failure showing it."""
    if not (BIN / "nbgrader").exists():
        pytest.fail(f"nbgrader is not installed in {BIN}: pip install -r requirements.txt")
    env = {
        **os.environ,
        # nbgrader runs alembic, which must be on PATH, to make its gradebook.
        "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")]),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "LSDL_SCALE": "smoke",
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run(
        [str(BIN / "nbgrader"), *args, "--force"],
        cwd=course,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{output[-4000:]}"
    return output


def make_course(root: Path, lab: Path) -> tuple[Path, str]:
    """A course directory whose one assignment, named after the lab, is the lab."""
    assignment = lab.stem.split("_")[0]
    (root / "source" / assignment).mkdir(parents=True)
    shutil.copy(lab, root / "source" / assignment / lab.name)
    (root / "nbgrader_config.py").write_text(
        "c = get_config()\n"
        f"c.CourseDirectory.root = {str(root)!r}\n"
        # nbgrader's default is 30 s a cell; a lab's training cells take longer.
        "c.Execute.timeout = 600\n"
    )
    return root, assignment


def submit(course: Path, student: str, assignment: str, notebook: Path) -> None:
    folder = course / "submitted" / student / assignment
    folder.mkdir(parents=True)
    shutil.copy(notebook, folder / notebook.name)


def code_sources(nb: nbformat.NotebookNode) -> list[str]:
    return [cell.source for cell in nb.cells if cell.cell_type == "code"]


def grades(course: Path, assignment: str, notebook: str, student: str) -> dict[str, float]:
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        graded = gradebook.find_submission_notebook(notebook, assignment, student)
        return {grade.name: (grade.score, grade.max_score) for grade in graded.grades}


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_lab_under_nbgrader(lab, tmp_path):
    course, assignment = make_course(tmp_path / "course", lab)
    source = nbformat.read(lab, as_version=4)
    graded_cells = [cell for cell in source.cells if cell.metadata.get("nbgrader", {}).get("grade")]
    checkers = {
        cell.metadata["nbgrader"]["grade_id"]: cell.metadata["nbgrader"]["points"]
        for cell in graded_cells
        if cell.cell_type == "code"
    }
    # Markdown model answers are manually graded: nbgrader keeps their points for a person.
    answers = {
        cell.metadata["nbgrader"]["grade_id"]: cell.metadata["nbgrader"]["points"]
        for cell in graded_cells
        if cell.cell_type == "markdown"
    }
    assert checkers, f"{lab.name} has no autograded cell"

    # The released version: no solution, and what lsdl-student gives, but for the stub.
    nbgrader(course, "generate_assignment", assignment)
    released_path = course / "release" / assignment / lab.name
    released = nbformat.read(released_path, as_version=4)
    assert find_solutions(released) == []
    assert "SOLUTION" not in "\n".join(code_sources(released))
    make_student_version(lab, tmp_path / "student" / lab.name)
    student = nbformat.read(tmp_path / "student" / lab.name, as_version=4)
    ours = code_sources(student)
    theirs = [NBGRADER_STUB.sub(rf"\1{PLACEHOLDER}", text) for text in code_sources(released)]
    assert len(ours) == len(theirs)
    for index, (mine, nbgraders) in enumerate(zip(ours, theirs, strict=True)):
        assert mine == nbgraders, f"code cell {index}: lsdl-student and nbgrader disagree"

    submit(course, "blank", assignment, released_path)
    graded_source = lab.stem in SOURCE_LABS
    if graded_source:
        submit(course, "solver", assignment, lab)
    nbgrader(course, "autograde", assignment)

    blank = grades(course, assignment, lab.stem, "blank")
    assert set(blank) == set(checkers) | set(answers)
    assert {k: blank[k] for k in checkers} == {k: (0.0, points) for k, points in checkers.items()}
    assert {k: blank[k][1] for k in answers} == answers
    # The rest still ran: every code cell executed, and the only cells that failed are
    # checkers or cells that call an exercise's function.
    ran = nbformat.read(course / "autograded" / "blank" / assignment / lab.name, as_version=4)
    names = {
        name
        for s in find_solutions(source)
        for name in re.findall(r"^(?:def|class)\s+(\w+)", source.cells[s.cell].source, re.M)
    }
    uses_exercise = re.compile(rf"\b({'|'.join(names)})\b")
    for index, cell in enumerate(ran.cells):
        if cell.cell_type != "code":
            continue
        assert cell.execution_count is not None, f"cell {index} of the released lab never ran"
        errors = [f"{o.ename}: {o.evalue}" for o in cell.outputs if o.output_type == "error"]
        if errors and not cell.metadata.get("nbgrader", {}).get("grade"):
            assert uses_exercise.search(cell.source), f"cell {index} failed: {errors}"
    if graded_source:
        solver = grades(course, assignment, lab.stem, "solver")
        assert {k: solver[k] for k in checkers} == {k: (p, p) for k, p in checkers.items()}
