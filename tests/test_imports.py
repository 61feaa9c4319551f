"""The parts of lsdl_lab import each other without a cycle: in the graph whose nodes are
lsdl_lab's top-level subpackages and modules (``lsdl_lab.optim``, ``lsdl_lab.memory``,
``lsdl_lab.train``, ...) and whose edges are the import statements of their files, at the top
of a file or inside a function, absolute or relative, there is no cycle. An import written
inside a function hides a cycle from Python, not from a reader: each part reads, and is
tested, on the parts below it alone. And the book's wing (``lsdl_lab.book``) is imported by
the pages, the labs, the benchmarks and the tests, never by the library: no module outside
``lsdl_lab/book/`` imports it, in any form, ``lsdl_lab/__init__.py`` included."""

import ast
from pathlib import Path

import lsdl_lab

PACKAGE = Path(lsdl_lab.__file__).resolve().parent


def module_name(path: Path) -> str:
    """``lsdl_lab/optim/adam.py`` -> ``lsdl_lab.optim.adam``; a package is its folder's name."""
    parts = ["lsdl_lab", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    """Whether ``name`` (absolute) is a module or package of lsdl_lab, found on disk."""
    parts = name.split(".")
    if parts[0] != "lsdl_lab":
        return False
    where = PACKAGE.joinpath(*parts[1:])
    return (where / "__init__.py").exists() or where.with_suffix(".py").exists()


def imported_modules(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """The lsdl_lab module each import statement of ``path`` (or of ``source`` read as if it
    were there) loads, with its line, absolute: ``from X import a`` loads ``X.a`` where that
    is a module (``from .. import memory``), ``X`` otherwise."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    source = path.read_text() if source is None else source
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            base = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                name = f"{base}.{alias.name}"
                found.append((node.lineno, name if is_module(name) else base))
    return [(line, name) for line, name in found if name.startswith("lsdl_lab.")]


def part(name: str) -> str:
    """The top-level subpackage or module a module belongs to: ``lsdl_lab.optim.adam`` ->
    ``lsdl_lab.optim``."""
    return ".".join(name.split(".")[:2])


def import_graph() -> dict[str, dict[str, str]]:
    """For each part, the parts it imports, each with the first place that imports it
    (``file:line``). ``lsdl_lab/__init__.py`` is left out: Python runs it before any module
    of the package, so it is below every part by construction (it imports ``profiles`` alone,
    and the rest lazily, on attribute access)."""
    graph: dict[str, dict[str, str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "__init__.py":
            continue
        source = part(module_name(path))
        edges = graph.setdefault(source, {})
        for line, name in imported_modules(path):
            if part(name) != source:
                edges.setdefault(part(name), f"{path.relative_to(PACKAGE.parent)}:{line}")
    return graph


def find_cycle(graph: dict[str, dict[str, str]]) -> list[str] | None:
    """One cycle of ``graph`` as the list of its nodes, the first repeated at the end, or
    None (a depth-first search: a cycle is an edge back to a node on the current path)."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node) :] + [node]
        if node in done:
            return None
        for target in sorted(graph.get(node, {})):
            cycle = visit(target, path + [node])
            if cycle:
                return cycle
        done.add(node)
        return None

    for node in sorted(graph):
        cycle = visit(node, [])
        if cycle:
            return cycle
    return None


def describe(cycle: list[str], graph: dict[str, dict[str, str]]) -> str:
    return "\n".join(f"{a} -> {b}  ({graph[a][b]})" for a, b in zip(cycle, cycle[1:]))


def test_the_parts_of_lsdl_lab_import_each_other_without_a_cycle():
    graph = import_graph()
    assert {"lsdl_lab.optim", "lsdl_lab.memory", "lsdl_lab.parallel", "lsdl_lab.book"} <= set(graph)
    assert "lsdl_lab.memory" in graph["lsdl_lab.optim"]  # Adam8bit's quantization
    cycle = find_cycle(graph)
    assert cycle is None, "lsdl_lab's parts import each other in a cycle:\n" + describe(
        cycle, graph
    )


def test_the_library_never_imports_the_wing():
    wing = PACKAGE / "book"
    modules = [path for path in sorted(PACKAGE.rglob("*.py")) if wing not in path.parents]
    assert len(modules) > 50 and PACKAGE / "__init__.py" in modules
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {name}"
        for path in modules
        for line, name in imported_modules(path)
        if part(name) == "lsdl_lab.book"
    ]
    assert not offenders, "the library imports the book's wing:\n" + "\n".join(offenders)


def test_the_graph_sees_every_form_of_import():
    # read as if in lsdl_lab/memory/calculator.py, so that relative imports resolve there
    probe = PACKAGE / "memory" / "calculator.py"
    for source, imported in (
        ("import lsdl_lab.optim.adam8bit", "lsdl_lab.optim.adam8bit"),
        ("from lsdl_lab.optim import adam8bit", "lsdl_lab.optim.adam8bit"),
        ("from ..optim.adam8bit import MIN_8BIT_SIZE", "lsdl_lab.optim.adam8bit"),
        ("from .. import optim", "lsdl_lab.optim"),
        ("from ..optim import Adam", "lsdl_lab.optim"),
        ("from .quantize import BLOCK_SIZE", "lsdl_lab.memory.quantize"),
        ("def f():\n    if True:\n        from ..optim import adam8bit", "lsdl_lab.optim.adam8bit"),
    ):
        assert [name for _, name in imported_modules(probe, source)] == [imported], source
    assert imported_modules(probe, "import torch\nfrom collections import abc") == []
    # the wing, in every form (a name beginning like it is not it)
    for source in (
        "import lsdl_lab.book.races",
        "from lsdl_lab.book import problems",
        "from lsdl_lab import book",
        "from ..book.widgets import optimizer_explorer",
        "def f():\n    from .. import book",
    ):
        assert [part(name) for _, name in imported_modules(probe, source)] == ["lsdl_lab.book"], (
            source
        )
    assert imported_modules(probe, "from lsdl_lab import bookkeeping") == []  # the package
    package = PACKAGE / "plan" / "__init__.py"  # in a package's __init__, "." is the package
    assert imported_modules(package, "from .lab import x") == [(1, "lsdl_lab.plan.lab")]


def test_a_cycle_is_found_and_named():
    graph = {
        "lsdl_lab.optim": {"lsdl_lab.memory": "lsdl_lab/optim/adam8bit.py:50"},
        "lsdl_lab.memory": {"lsdl_lab.parallel": "lsdl_lab/memory/calculator.py:300"},
        "lsdl_lab.parallel": {"lsdl_lab.optim": "lsdl_lab/parallel/context.py:52"},
        "lsdl_lab.train": {"lsdl_lab.optim": "lsdl_lab/train.py:10"},
    }
    cycle = find_cycle(graph)
    assert cycle == ["lsdl_lab.memory", "lsdl_lab.parallel", "lsdl_lab.optim", "lsdl_lab.memory"]
    assert "lsdl_lab/parallel/context.py:52" in describe(cycle, graph)
    del graph["lsdl_lab.parallel"]["lsdl_lab.optim"]
    assert find_cycle(graph) is None
