"""The book's wing (lsdl_lab.book) is imported by the pages, the labs, the benchmarks and
the tests, never by the library: no module of lsdl_lab outside lsdl_lab/book/ imports it,
absolutely (``lsdl_lab.book``) or relatively (``.book``, ``..book``, ``from .. import
book``), at the top of the file or inside a function."""

import ast
from pathlib import Path

import lsdl_lab

PACKAGE = Path(lsdl_lab.__file__).resolve().parent
WING = PACKAGE / "book"


def library_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if WING not in p.parents)


def absolute(module: str | None, level: int, path: Path) -> str:
    """The absolute name that ``from <level dots><module> import ...`` in ``path`` names."""
    if level == 0:
        return module or ""
    # the package the file belongs to (its own name for an __init__.py), then up level - 1
    package = ["lsdl_lab", *path.relative_to(PACKAGE).parent.parts]
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports_of(path: Path) -> list[tuple[int, str]]:
    """Every module name an import statement of ``path`` names, with its line, absolute:
    for ``from X import a, b`` both ``X`` and ``X.a``, ``X.b`` (a name may be a module)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = absolute(node.module, node.level, path)
            names.append((node.lineno, base))
            names += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return names


def is_wing(name: str) -> bool:
    return name == "lsdl_lab.book" or name.startswith("lsdl_lab.book.")


def test_the_library_never_imports_the_wing():
    modules = library_modules()
    assert len(modules) > 50 and PACKAGE / "__init__.py" in modules
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {name}"
        for path in modules
        for line, name in imports_of(path)
        if is_wing(name)
    ]
    assert not offenders, "the library imports the book's wing:\n" + "\n".join(offenders)


def test_the_check_sees_every_form_of_import(tmp_path):
    # resolved as they would be in lsdl_lab/memory/zero.py and lsdl_lab/plan/__init__.py
    zero, plan = PACKAGE / "memory" / "zero.py", PACKAGE / "plan" / "__init__.py"
    assert absolute("book.races", 2, zero) == "lsdl_lab.book.races"
    assert absolute(None, 2, zero) == "lsdl_lab"
    assert absolute("book", 2, plan) == "lsdl_lab.book"
    assert absolute("lab", 1, plan) == "lsdl_lab.plan.lab"
    assert absolute("book", 1, PACKAGE / "scale.py") == "lsdl_lab.book"
    source = tmp_path / "probe.py"
    for text in (
        "import lsdl_lab.book.races",
        "from lsdl_lab.book import problems",
        "from lsdl_lab import book",
        "def f():\n    from lsdl_lab.book.widgets import draw",
    ):
        source.write_text(text)
        assert any(is_wing(name) for _, name in imports_of(source)), text
    source.write_text("import lsdl_lab.memory\nfrom lsdl_lab import bookkeeping")
    assert not any(is_wing(name) for _, name in imports_of(source))
