"""Every lab under nbgrader itself (0.9.6, a test dependency), in a temporary course
directory: ``generate_assignment`` releases it without its solutions and as
``lsdl-student`` writes it; ``autograde`` gives the released version, submitted as is,
zero on every exercise while the rest of the notebook still runs, and the instructor's
version full marks.

Autograding the instructor's version is also the labs' run at ``LSDL_SCALE=smoke`` in the
suite (it replaces nbval over ``labs/``): every code cell of every lab must run without an
error (a failure shows the cell and its traceback), and the lab's kernel must stay within
:data:`SMOKE_BUDGET` seconds of CPU time (its own: the ranks of Labs 7 and 9's process
groups are forked by multiprocessing's forkserver, not by the kernel, and are not counted).
nbgrader's executor (nbclient) starts the kernel with this process's environment, which
:func:`nbgrader` sets: ``LSDL_SCALE=smoke``, one torch thread, no progress bars; the
course's configuration raises the cell timeout to 600 s (nbgrader's default, 30 s, is too
short for a lab's training cells at ``cpu``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

import nbformat
import pytest

from lsdl_lab.student import PLACEHOLDER, find_solutions, make_student_version

ROOT = Path(__file__).resolve().parents[1]
LABS = sorted((ROOT / "labs").glob("*.ipynb"))
# CPU seconds a lab's kernel may spend at smoke (the profile's budget: seconds per lab; the
# longest, Lab 5, took 35 s of wall time on an idle machine). CPU time rather than wall
# time: two test workers and other processes share the cores, which stretches wall time.
SMOKE_BUDGET = 40.0
BIN = Path(sys.executable).parent
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the colours of a traceback
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
        "TQDM_DISABLE": "1",
        # An IPython profile whose startup file records each kernel's CPU time (cpu_seconds).
        "IPYTHONDIR": str(course / "ipython"),
        "LSDL_TEST_CPU_DIR": str(course / "cpu"),
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
    startup = root / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-cpu-time.py").write_text(CPU_RECORDER)
    (root / "cpu").mkdir()
    (root / "nbgrader_config.py").write_text(
        "c = get_config()\n"
        f"c.CourseDirectory.root = {str(root)!r}\n"
        # nbgrader's default is 30 s a cell; a lab's training cells take longer.
        "c.Execute.timeout = 600\n"
    )
    return root, assignment


# Run by each kernel at its start (an IPython startup file): after every cell, the CPU time
# the kernel and the children it waited for (a lab's spawned ranks) have used so far, in a
# file named after the kernel's process, with the kernel's directory (the submission's).
CPU_RECORDER = """\
def _record_cpu_time(result=None):
    import json, os
    t = os.times()
    record = {"cwd": os.getcwd(), "self": t.user + t.system,
              "children": t.children_user + t.children_system}
    path = os.path.join(os.environ["LSDL_TEST_CPU_DIR"], f"{os.getpid()}.json")
    with open(path, "w") as f:
        json.dump(record, f)


get_ipython().events.register("post_run_cell", _record_cpu_time)
del _record_cpu_time
"""


def cpu_seconds(course: Path, student: str) -> dict[str, float] | None:
    """The CPU time of the kernel that ran ``student``'s submission (None if not recorded)."""
    for path in (course / "cpu").glob("*.json"):
        record = json.loads(path.read_text())
        if Path(record["cwd"]).parts[-2:-1] == (student,):
            return record
    return None


def cell_errors(nb: nbformat.NotebookNode) -> list[str]:
    """Each code cell that did not run, or raised: its index, first line and traceback."""
    found = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        first = cell.source.strip().split("\n")[0][:80]
        if cell.execution_count is None:
            found.append(f"cell {index} ({first!r}) never ran")
        for out in cell.outputs:
            if out.output_type == "error":
                trace = ANSI.sub("", "\n".join(out.traceback))
                found.append(f"cell {index} ({first!r}) raised {out.ename}: {out.evalue}\n{trace}")
    return found


def wall_seconds(nb: nbformat.NotebookNode) -> float:
    """From the first cell's start to the last cell's end, as nbclient recorded them."""
    times = [
        datetime.fromisoformat(cell.metadata.execution[key].replace("Z", "+00:00"))
        for cell in nb.cells
        if "execution" in cell.metadata
        for key in ("iopub.execute_input", "shell.execute_reply")
        if key in cell.metadata.execution
    ]
    return (max(times) - min(times)).total_seconds() if times else float("nan")


def submit(course: Path, student: str, assignment: str, notebook: Path) -> None:
    folder = course / "submitted" / student / assignment
    folder.mkdir(parents=True)
    shutil.copy(notebook, folder / notebook.name)


def code_sources(nb: nbformat.NotebookNode) -> list[str]:
    return [cell.source for cell in nb.cells if cell.cell_type == "code"]


def as_lsdl_student(cell: nbformat.NotebookNode) -> str:
    """A cell nbgrader released, with its stubs as lsdl-student writes them: its code stub
    becomes lsdl-student's placeholder; its text stub, in place of a Markdown answer, goes
    (lsdl-student removes the answer and leaves nothing in its place)."""
    if cell.cell_type == "code":
        return NBGRADER_STUB.sub(rf"\1{PLACEHOLDER}", cell.source)
    lines = cell.source.split("\n")
    return "\n".join(line for line in lines if line.strip() != "YOUR ANSWER HERE")


def grades(course: Path, assignment: str, notebook: str, student: str) -> dict[str, float]:
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        graded = gradebook.find_submission_notebook(notebook, assignment, student)
        return {grade.name: (grade.score, grade.max_score) for grade in graded.grades}


class Graded(NamedTuple):
    """One lab through nbgrader: released, then autograded as released and as written."""

    lab: Path
    course: Path
    assignment: str
    source: nbformat.NotebookNode
    checkers: dict[str, float]  # grade id: points, of the code exercises' checker cells
    answers: dict[str, float]  # the same of the Markdown answers, graded by hand

    def autograded(self, student: str) -> nbformat.NotebookNode:
        path = self.course / "autograded" / student / self.assignment / self.lab.name
        return nbformat.read(path, as_version=4)

    def grades(self, student: str) -> dict[str, tuple[float, float]]:
        return grades(self.course, self.assignment, self.lab.stem, student)


def course_fixture(labs: list[Path]):
    """A fixture, one course per lab of ``labs``, for the four tests below: the lab is
    executed twice in all, as released and as written."""

    @pytest.fixture(scope="module", params=labs, ids=lambda p: p.stem)
    def graded(request, tmp_path_factory) -> Graded:
        return grade(request.param, tmp_path_factory)

    return graded


# Labs 1 to 4b here, the later ones in test_nbgrader_later_labs.py: the two halves take about
# four minutes each, and pytest-xdist's --dist loadfile can give them to both workers.
FIRST, LATER = LABS[:5], LABS[5:]
graded = course_fixture(FIRST)


def grade(lab: Path, tmp_path_factory) -> Graded:
    course, assignment = make_course(tmp_path_factory.mktemp(lab.stem) / "course", lab)
    source = nbformat.read(lab, as_version=4)
    points = {
        kind: {
            cell.metadata["nbgrader"]["grade_id"]: cell.metadata["nbgrader"]["points"]
            for cell in source.cells
            if cell.metadata.get("nbgrader", {}).get("grade") and cell.cell_type == kind
        }
        for kind in ("code", "markdown")
    }
    assert points["code"], f"{lab.name} has no autograded cell"
    nbgrader(course, "generate_assignment", assignment)
    submit(course, "blank", assignment, course / "release" / assignment / lab.name)
    submit(course, "solver", assignment, lab)
    nbgrader(course, "autograde", assignment)
    return Graded(lab, course, assignment, source, points["code"], points["markdown"])


def test_released_version_is_lsdl_students(graded, tmp_path):
    # No solution, and what lsdl-student gives, but for the stubs.
    released = nbformat.read(
        graded.course / "release" / graded.assignment / graded.lab.name, as_version=4
    )
    assert find_solutions(released) == []
    assert "SOLUTION" not in "\n".join(code_sources(released))
    make_student_version(graded.lab, tmp_path / graded.lab.name)
    student = nbformat.read(tmp_path / graded.lab.name, as_version=4)
    ours = [(cell.cell_type, cell.source) for cell in student.cells]
    theirs = [(cell.cell_type, as_lsdl_student(cell)) for cell in released.cells]
    assert len(ours) == len(theirs)
    for index, (mine, nbgraders) in enumerate(zip(ours, theirs, strict=True)):
        assert mine == nbgraders, f"cell {index}: lsdl-student and nbgrader disagree"


def test_source_version_scores_full_marks_with_every_cell_run(graded):
    errors = cell_errors(graded.autograded("solver"))
    assert not errors, f"{graded.lab.name} at smoke under nbgrader:\n" + "\n\n".join(errors)
    solver = graded.grades("solver")
    assert {k: solver[k] for k in graded.checkers} == {
        k: (p, p) for k, p in graded.checkers.items()
    }


def test_source_version_within_the_smoke_budget(graded):
    cpu = cpu_seconds(graded.course, "solver")
    assert cpu is not None, "the kernel's CPU time was not recorded"
    print(
        f"{graded.lab.stem}: {wall_seconds(graded.autograded('solver')):.1f} s of wall time, "
        f"{cpu['self']:.1f} s of CPU time in the kernel, {cpu['children']:.1f} s in child "
        "processes it has waited for"
    )
    assert cpu["self"] <= SMOKE_BUDGET, (
        f"{graded.lab.name} took {cpu['self']:.1f} s of CPU time at smoke (budget {SMOKE_BUDGET} s)"
    )


def test_blank_submission_scores_zero_and_the_rest_runs(graded):
    blank = graded.grades("blank")
    checkers, answers = graded.checkers, graded.answers
    assert set(blank) == set(checkers) | set(answers)
    assert {k: blank[k] for k in checkers} == {k: (0.0, points) for k, points in checkers.items()}
    assert {k: blank[k][1] for k in answers} == answers
    # The rest still ran: every code cell executed; nothing failed before the first
    # exercise; and the only cells that failed after it are checkers or cells that call an
    # exercise, on its stub (an exercise's class whose body is the stub is never defined).
    source = graded.source
    solutions = [s.cell for s in find_solutions(source) if source.cells[s.cell].cell_type == "code"]
    names = {
        name
        for index in solutions
        for name in re.findall(r"^(?:def|class)\s+(\w+)", source.cells[index].source, re.M)
    }
    uses_exercise = re.compile(rf"\b({'|'.join(names)})\b")
    for index, cell in enumerate(graded.autograded("blank").cells):
        if cell.cell_type != "code":
            continue
        assert cell.execution_count is not None, f"cell {index} of the released lab never ran"
        errors = [o for o in cell.outputs if o.output_type == "error"]
        if not errors:
            continue
        what = [f"{o.ename}: {o.evalue}" for o in errors]
        assert index >= min(solutions), f"cell {index}, before the first exercise, failed: {what}"
        if not cell.metadata.get("nbgrader", {}).get("grade"):
            assert uses_exercise.search(cell.source), f"cell {index} failed: {what}"
        for error in errors:
            undefined = re.match(r"name '(\w+)' is not defined", error.evalue)
            assert error.ename == "NotImplementedError" or (
                error.ename == "NameError" and undefined and undefined.group(1) in names
            ), f"cell {index} failed otherwise than on an exercise's stub: {what}"
