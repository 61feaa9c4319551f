"""Make the student version of a lab: the solutions taken out, the exercises left.

Solutions are marked as nbgrader marks them, so an instructor can also use nbgrader
itself. In a code cell, the lines from ``### BEGIN SOLUTION`` to ``### END SOLUTION``
(markers included) become one line, indented like the ``BEGIN`` marker::

    raise NotImplementedError("Exercise: write your solution here")

In a Markdown cell, the lines from ``<!-- BEGIN SOLUTION -->`` to ``<!-- END SOLUTION -->``
are removed. In an exercise's checker cell, the lines from ``### BEGIN HIDDEN TESTS`` to
``### END HIDDEN TESTS`` (nbgrader's hidden tests: checks a student does not see, where the
visible checker's message would give the answer away) are removed, as nbgrader removes them;
``nbgrader autograde`` puts them back and runs them. Outputs and execution counts are
cleared; everything else (cell ids and metadata, the notebook's metadata and nbformat
version) is kept.

From the command line::

    lsdl-student labs/*.ipynb -o student/     # write student/<same name>.ipynb
    lsdl-student labs/*.ipynb -o student/ --edition v3 \
        --repository https://github.com/lsdl-book/lsdl --site https://lsdl-book.github.io/lsdl/
                                              # the same, pinned to the tag v3 (below)
    lsdl-student labs/*.ipynb --pin --edition v3 --repository ... --site ...
                                              # the labs themselves pinned, in place
    lsdl-student labs/*.ipynb --pin --check --edition v3 --repository ... --site ...
                                              # exit 1 if one is not pinned to v3
    lsdl-student --check labs/*.ipynb         # exit 1 if a marker is malformed
    lsdl-student --nbgrader labs/*.ipynb      # write nbgrader's cell metadata in place
    lsdl-student --nbgrader --check labs/*.ipynb  # exit 1 if that metadata is out of date
    python -m lsdl_lab.student ...            # the same, without the console script

nbgrader (https://nbgrader.readthedocs.io) needs more than the markers: each cell holding a
solution is a *solution cell*, and the cell right after a code exercise, which calls its
checker, is an autograded *test cell* worth points. :func:`nbgrader_metadata` derives that
metadata from the markers, with a grade id made of the lab's and the exercise's names
(``lab03-momentum_step``, ``lab03-momentum_step-check``) so it survives edits elsewhere in
the notebook; ``--nbgrader`` writes it, and changes nothing but cells' ``nbgrader``
metadata. A Markdown solution becomes a manually graded answer, as nbgrader requires.

A course pins an *edition*, a tag of the labs' repository (``--edition``, as
:func:`pin_edition` does; ``make release`` does it for the tag it publishes): the student
version's links to the repository's files and to Colab opening them name the tag instead of
``main``, its install cell installs the library from the tag (``git+<repository>@<tag>``),
and, with ``--site``, its links to the book's pages open the edition's (``<site><tag>/``).

Unlike nbgrader, a marker must stand alone on its line, and any other line that
mentions one (``# BEGIN SOLUTION``, ``x = 1  ### END SOLUTION``) is an error rather
than a solution silently left in the student version.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit

import nbformat

__all__ = [
    "Edition",
    "Solution",
    "find_hidden_tests",
    "find_solutions",
    "main",
    "make_student_version",
    "nbgrader_metadata",
    "pin_edition",
    "pin_notebook",
    "write_nbgrader_metadata",
]

PLACEHOLDER = 'raise NotImplementedError("Exercise: write your solution here")'

# Per cell type: the begin marker, the end marker, and what any line that mentions a
# marker looks like (prose may quote the code markers, so Markdown only watches its own).
_MARKERS = {
    "code": ("### BEGIN SOLUTION", "### END SOLUTION", re.compile(r"(BEGIN|END) SOLUTION")),
    "markdown": (
        "<!-- BEGIN SOLUTION -->",
        "<!-- END SOLUTION -->",
        re.compile(r"<!--\s*(BEGIN|END)\s+SOLUTION"),
    ),
}


# nbgrader's hidden tests, in code cells only
_HIDDEN = (
    "### BEGIN HIDDEN TESTS",
    "### END HIDDEN TESTS",
    re.compile(r"(BEGIN|END) HIDDEN TESTS"),
)


class Solution(NamedTuple):
    """One solution block: its cell's index and its marker lines (1-based, inclusive)."""

    cell: int
    start_line: int
    end_line: int


def find_solutions(nb: nbformat.NotebookNode | str | Path) -> list[Solution]:
    """Every solution block of a notebook (or of the notebook file at that path), in
    order; raises ValueError naming the notebook, cell and line of a malformed marker."""
    nb, where = _notebook(nb)
    return [
        Solution(index, start, end)
        for index, cell in enumerate(nb.cells)
        for start, end in _blocks(cell, f"{where}, cell {index}")
    ]


def find_hidden_tests(nb: nbformat.NotebookNode | str | Path) -> list[Solution]:
    """Every hidden-test block of a notebook (or of the notebook file at that path), as
    :class:`Solution` tuples, in order; raises ValueError naming the notebook, cell and
    line of a malformed marker."""
    nb, where = _notebook(nb)
    return [
        Solution(index, start, end)
        for index, cell in enumerate(nb.cells)
        if cell.cell_type == "code"
        for start, end in _blocks(cell, f"{where}, cell {index}", _HIDDEN)
    ]


class Edition(NamedTuple):
    """What a student version is pinned to: the ``tag`` of the labs' ``repository``
    (``https://github.com/<owner>/<name>``), and the book's ``site`` (its URL, ending in
    ``/``; None: its links left as they are), which keeps the tag's edition at
    ``<site><tag>/``; ``branch`` is what the labs' links name now."""

    tag: str
    repository: str
    site: str | None = None
    branch: str = "main"


def pin_edition(text: str, edition: Edition) -> tuple[str, Counter]:
    """``text`` (a cell's source) pinned to ``edition``, and how many of each kind of link
    changed (``install``, ``repository``, ``site``):

    * ``git+<repository>`` (pip's install from the repository) becomes
      ``git+<repository>@<tag>``; one already pinned (``@...``) is left as it is;
    * ``<repository>/blob/<branch>/...`` and Colab's
      ``https://colab.research.google.com/github/<owner>/<name>/blob/<branch>/...`` name the
      tag instead of the branch;
    * ``<site><page>`` becomes ``<site><tag>/<page>`` (the site's root, ``<site><tag>/``),
      unless it is an edition's already (``<site>vN/...``)."""
    repo, tag = edition.repository.rstrip("/"), edition.tag
    slug = re.escape(urlsplit(repo).path.strip("/"))
    hosts = r"https://(?:github\.com|colab\.research\.google\.com/github)/"
    # kind: (the pattern, whose group 1 is kept, and what follows it in the pinned link)
    patterns = {
        "install": (rf"(git\+{re.escape(repo)})(?:\.git)?(?![\w@./-])", f"@{tag}"),
        "repository": (rf"({hosts}{slug}/(?:blob|tree)/){re.escape(edition.branch)}(?=/)", tag),
    }
    if edition.site:
        patterns["site"] = (rf"({re.escape(edition.site)})(?!v\d+/)", f"{tag}/")
    counts = Counter()
    for kind, (pattern, pinned) in patterns.items():
        text, counts[kind] = re.subn(pattern, lambda m, pinned=pinned: m[1] + pinned, text)
    return text, counts


def _edition(tag: str, repository: str, site: str | None = None) -> Edition:
    """The :class:`Edition` of these arguments, checked."""
    if not isinstance(tag, str) or not re.fullmatch(r"[A-Za-z0-9][\w.-]*", tag):
        raise ValueError(
            f"Invalid edition: {tag!r} (expected a tag of the repository, such as v3: "
            "letters, digits, '.', '_' and '-')"
        )
    if not isinstance(repository, str) or not re.fullmatch(
        r"https://github\.com/[\w.-]+/[\w.-]+/?", repository
    ):
        raise ValueError(
            f"Invalid repository: {repository!r} (expected https://github.com/<owner>/<name>)"
        )
    if site is not None and not (
        isinstance(site, str) and re.match(r"https?://", site) and site.endswith("/")
    ):
        raise ValueError(f"Invalid site: {site!r} (expected the book's URL, ending in '/')")
    return Edition(tag, repository.rstrip("/"), site)


def make_student_version(
    src_path: str | Path,
    dst_path: str | Path,
    *,
    edition: str | None = None,
    repository: str | None = None,
    site: str | None = None,
) -> int:
    """Write the student version of notebook ``src_path`` to ``dst_path``; return how many
    solutions were removed. Nothing is written when a marker is malformed.

    With ``edition`` (a tag of ``repository``, which is then required), the version is
    pinned to that edition (:func:`pin_edition`; ``site``: the book's URL, to link the
    edition's pages); a notebook that installs nothing from ``repository`` is refused, as
    its students would run another edition's library."""
    src_path, dst_path = Path(src_path), Path(dst_path)
    if dst_path.exists() and dst_path.resolve() == src_path.resolve():
        raise ValueError(f"dst_path {dst_path} is src_path: that would erase the solutions")
    if edition is None and (repository is not None or site is not None):
        raise ValueError("repository and site pin an edition: give the edition's tag too")
    if edition is not None and repository is None:
        raise ValueError(f"edition {edition!r} needs the repository it is a tag of")
    pin = None if edition is None else _edition(edition, repository, site)
    nb = _read(src_path)
    pinned: Counter = Counter()
    removed = 0
    for index, cell in enumerate(nb.cells):
        blocks = _blocks(cell, f"{src_path}, cell {index}")
        removed += len(blocks)
        hidden = _blocks(cell, f"{src_path}, cell {index}", _HIDDEN)
        if blocks and hidden:
            raise ValueError(f"{src_path}, cell {index}: hidden tests in a solution cell")
        lines = cell.source.split("\n")
        for start, end in reversed(hidden):  # removed with their markers, as nbgrader does
            del lines[start - 1 : end]
        # From the last block up, so earlier line numbers stay valid.
        for start, end in reversed(blocks):
            if cell.cell_type == "code":
                indent = re.match(r"\s*", lines[start - 1]).group(0)
                lines[start - 1 : end] = [indent + PLACEHOLDER]
            else:
                del lines[start - 1 : end]
        cell.source = "\n".join(lines)
        if pin is not None:
            cell.source, counts = pin_edition(cell.source, pin)
            pinned += counts
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    if pin is not None and not (pinned["install"] or _installs_from(nb, pin)):
        raise ValueError(
            f"{src_path}: installs nothing from {pin.repository} (no git+{pin.repository}), "
            f"so its library cannot be pinned to {pin.tag}: is that the labs' repository?"
        )
    dst_path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, dst_path)
    return removed


def nbgrader_metadata(
    nb: nbformat.NotebookNode | str | Path, lab: str | None = None
) -> list[dict | None]:
    """The ``nbgrader`` metadata each cell of a notebook should carry (None: none at all).

    ``lab`` names the grade ids; by default the ``labNN`` that begins the file's name (or
    the whole stem). Points already on a checker cell are kept (an instructor may weigh
    exercises), else it is worth 1. Raises ValueError, naming the cell, for a code exercise
    with no checker cell right after it, one that defines no function or class to name it
    by, or two exercises of the same name."""
    if lab is None and isinstance(nb, (str, Path)):
        stem = Path(nb).stem
        found = re.match(r"lab\d+[a-z]?(?=_|$)", stem)
        lab = found.group(0) if found else stem
    nb, where = _notebook(nb)
    if lab is None:
        raise ValueError("lab is required when nb is a notebook rather than a path")
    solution_cells = {s.cell for s in find_solutions(nb)}
    wanted: list[dict | None] = [None] * len(nb.cells)
    for index in sorted(solution_cells):
        cell = nb.cells[index]
        base = {"schema_version": 3, "locked": False, "solution": True}
        if cell.cell_type == "markdown":
            name = f"{lab}-answer-{cell.get('id') or index}"
            points = cell.metadata.get("nbgrader", {}).get("points", 1)
            wanted[index] = {**base, "grade": True, "grade_id": name, "points": points}
            continue
        named = re.search(r"^(?:async\s+)?(?:def|class)\s+(\w+)", cell.source, re.MULTILINE)
        if named is None:
            raise ValueError(
                f"{where}, cell {index}: the exercise defines no function or class, so it "
                "has no name for its grade id"
            )
        name = f"{lab}-{named.group(1)}"
        following = index + 1
        if (
            following >= len(nb.cells)
            or nb.cells[following].cell_type != "code"
            or following in solution_cells
        ):
            raise ValueError(
                f"{where}, cell {index}: exercise {named.group(1)!r} needs its checker in "
                "the code cell right after it (an autograded test cell for nbgrader)"
            )
        points = nb.cells[following].metadata.get("nbgrader", {}).get("points", 1)
        wanted[index] = {**base, "grade": False, "grade_id": name}
        wanted[following] = {
            "schema_version": 3,
            "locked": True,
            "solution": False,
            "grade": True,
            "grade_id": f"{name}-check",
            "points": points,
        }
    for hidden in find_hidden_tests(nb):
        meta = wanted[hidden.cell]
        if meta is None or meta["solution"] or not meta["grade"]:
            raise ValueError(
                f"{where}, cell {hidden.cell}: hidden tests must be in an exercise's checker "
                "cell (the code cell right after its solution), which nbgrader grades"
            )
    ids = [meta["grade_id"] for meta in wanted if meta is not None]
    repeated = sorted({grade_id for grade_id in ids if ids.count(grade_id) > 1})
    if repeated:
        raise ValueError(f"{where}: two exercises share the grade id(s) {repeated}")
    return wanted


def write_nbgrader_metadata(path: str | Path, *, check: bool = False) -> bool:
    """Give every cell of the notebook at ``path`` the metadata :func:`nbgrader_metadata`
    asks for, in one read and one write, touching nothing else; return whether it was
    out of date. With ``check``, only say so and write nothing."""
    nb = _read(path)
    wanted = nbgrader_metadata(path)
    stale = False
    for cell, meta in zip(nb.cells, wanted, strict=True):
        if cell.metadata.get("nbgrader") != meta:
            stale = True
            if meta is None:
                del cell.metadata["nbgrader"]
            else:
                cell.metadata["nbgrader"] = meta
    if stale and not check:
        nbformat.write(nb, path)
    return stale


def _read(path: str | Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=nbformat.NO_CONVERT)


def _notebook(nb: nbformat.NotebookNode | str | Path) -> tuple[nbformat.NotebookNode, str]:
    """The notebook (read when ``nb`` is a path) and how an error message names it."""
    if isinstance(nb, (str, Path)):
        return _read(nb), str(nb)
    return nb, "notebook"


def _blocks(
    cell: nbformat.NotebookNode, where: str, markers: tuple | None = None
) -> list[tuple[int, int]]:
    """The (start, end) marker lines, 1-based, of each solution block in one cell (or of
    each block between other ``markers``: begin, end, and the pattern of a mention)."""
    if markers is None:
        if cell.cell_type not in _MARKERS:
            return []
        markers = _MARKERS[cell.cell_type]
    begin, end, mention = markers
    kind = "solution" if "SOLUTION" in begin else "hidden-test"
    blocks, start = [], None
    for number, line in enumerate(cell.source.split("\n"), start=1):
        marker = line.strip()
        if marker == begin:
            if start is not None:
                raise ValueError(
                    f"{where}, line {number}: {begin!r} inside the solution opened on "
                    f"line {start} (blocks cannot nest)"
                )
            start = number
        elif marker == end:
            if start is None:
                raise ValueError(f"{where}, line {number}: {end!r} without {begin!r}")
            blocks.append((start, number))
            start = None
        elif mention.search(line):
            raise ValueError(
                f"{where}, line {number}: a {kind} marker must be alone on its line, "
                f"exactly {begin!r} or {end!r}; found {line.strip()!r}"
            )
    if start is not None:
        raise ValueError(f"{where}, line {start}: {begin!r} without {end!r}")
    return blocks


def _installs_from(nb: nbformat.NotebookNode, edition: Edition) -> bool:
    """Whether a cell of ``nb`` installs the library from ``edition``'s tag."""
    pinned = f"git+{edition.repository}@{edition.tag}"
    return any(pinned in cell.source for cell in nb.cells)


def pin_notebook(
    path: str | Path,
    edition: str,
    repository: str,
    site: str | None = None,
    *,
    check: bool = False,
) -> int:
    """Pin the notebook at ``path`` itself, solutions and all, to ``edition`` (a tag of
    ``repository``; :func:`pin_edition`), and return how many links changed; with
    ``check``, write nothing and return how many would change.

    This is what a tag's own labs need: Colab opens a lab from the tag (an edition's launch
    buttons, its student versions' links), and what it runs is that file's install cell,
    so the file at the tag must install the tag's library. ``make pin-labs EDITION=vN``
    pins every lab before the tag is made, and ``make release`` refuses a tag whose labs
    are not pinned to it (``make check-edition``). A notebook that would still install
    another library than the tag's after pinning is refused."""
    pin = _edition(edition, repository, site)
    nb = _read(path)
    changed: Counter = Counter()
    for cell in nb.cells:
        cell.source, counts = pin_edition(cell.source, pin)
        changed += counts
    if not _installs_from(nb, pin):
        raise ValueError(
            f"{path}: installs nothing from {pin.repository}@{pin.tag} (its install cell "
            f"names another edition, or another repository)"
        )
    if changed.total() and not check:
        nbformat.write(nb, path)
    return changed.total()


def main(argv: Sequence[str] | None = None) -> int:
    """The ``lsdl-student`` command; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="lsdl-student",
        description="Write the student version of lab notebooks: each solution between "
        "nbgrader's '### BEGIN SOLUTION' and '### END SOLUTION' markers becomes "
        "'raise NotImplementedError', outputs are cleared.",
    )
    parser.add_argument("notebooks", nargs="+", type=Path, help="lab notebooks (.ipynb)")
    parser.add_argument("-o", "--output-dir", type=Path, help="where to write them")
    parser.add_argument(
        "--check",
        action="store_true",
        help="only check the markers (and with --nbgrader, the metadata); exit 1 if not right",
    )
    parser.add_argument(
        "--nbgrader",
        action="store_true",
        help="write nbgrader's cell metadata into the notebooks themselves, from the markers",
    )
    parser.add_argument(
        "--edition",
        metavar="TAG",
        help="pin the student versions to this tag of --repository: its links, Colab's and "
        "the library's install name the tag",
    )
    parser.add_argument(
        "--repository", metavar="URL", help="the labs' repository, https://github.com/OWNER/NAME"
    )
    parser.add_argument(
        "--site", metavar="URL", help="the book's site: links to its pages open the edition's"
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="pin the notebooks themselves (solutions kept) to --edition, in place; with "
        "--check, exit 1 if one is not pinned to it",
    )
    args = parser.parse_args(argv)
    if args.nbgrader and args.output_dir is not None:
        parser.error("--nbgrader edits the notebooks in place; it takes no -o")
    pinning = [args.edition, args.repository, args.site] != [None] * 3
    if args.pin and (args.output_dir is not None or args.nbgrader or not pinning):
        parser.error("--pin edits the notebooks in place: give --edition and --repository, no -o")
    if pinning and not args.pin and (args.check or args.nbgrader):
        parser.error("--edition, --repository and --site apply to the student versions (-o)")
    if pinning and (args.edition is None or args.repository is None):
        parser.error("pinning an edition needs both --edition and --repository")
    if pinning:
        try:
            _edition(args.edition, args.repository, args.site)
        except ValueError as exc:
            parser.error(str(exc))
    if not args.check and not args.nbgrader and not args.pin:
        if args.output_dir is None:
            parser.error("the output directory (-o) is required unless --check is given")
        names = [path.name for path in args.notebooks]
        clashes = sorted({name for name in names if names.count(name) > 1})
        if clashes:
            parser.error(f"notebooks with the same name would overwrite each other: {clashes}")

    failed = 0
    for path in args.notebooks:
        try:
            if args.pin:
                failed += _pin_command(path, args)
            elif args.nbgrader:
                failed += _nbgrader_command(path, args.check)
            elif args.check:
                solutions, hidden = len(find_solutions(path)), len(find_hidden_tests(path))
                print(f"{path}: {solutions} solution(s), {hidden} hidden test(s), well formed")
            else:
                dst = args.output_dir / path.name
                hidden = len(find_hidden_tests(path))
                removed = make_student_version(
                    path, dst, edition=args.edition, repository=args.repository, site=args.site
                )
                also = f", {hidden} hidden test(s)" if hidden else ""
                also += f", pinned to {args.edition}" if args.edition else ""
                print(f"{path} -> {dst}: {removed} solution(s) removed{also}")
        except (OSError, ValueError) as exc:  # nbformat's NotJSONError is a ValueError
            print(f"lsdl-student: error: {exc}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


def _pin_command(path: Path, args: argparse.Namespace) -> int:
    """Pin one notebook in place (or with ``--check``, check it is); 1 if it failed."""
    changes = pin_notebook(path, args.edition, args.repository, args.site, check=args.check)
    if args.check and changes:
        print(
            f"lsdl-student: error: {path}: {changes} link(s) not pinned to {args.edition}; "
            f"run make pin-labs EDITION={args.edition} before tagging",
            file=sys.stderr,
        )
        return 1
    state = "pinned" if args.check else f"{changes} link(s) pinned"
    print(f"{path}: {state} to {args.edition}")
    return 0


def _nbgrader_command(path: Path, check: bool) -> int:
    """Write (or with ``check``, check) one notebook's nbgrader metadata; 1 if it failed."""
    stale = write_nbgrader_metadata(path, check=check)
    if check and stale:
        print(
            f"lsdl-student: error: {path}: nbgrader metadata out of date with the markers; "
            "run lsdl-student --nbgrader on it",
            file=sys.stderr,
        )
        return 1
    state = "up to date" if check else "updated" if stale else "already up to date"
    print(f"{path}: nbgrader metadata {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
