"""Listings of the library's code in the chapters: one directive, ``listing``.

A chapter shows the code it explains by the object's import path::

    ```{listing} lsdl_lab.optim.LARS.update
    ```

The directive imports the object (what ``inspect.getsource`` would print, decorators
included; a property is shown by its getter), and renders its source as a Python block
highlighted like every other code block of the book, under a caption that names the
object and links its lines in the repository. Nothing is executed on the page, and the
page is rebuilt when the source file changes.

The library's lines are at most 100 characters; the text column holds fewer: 77 of the
theme's code font (14 px) at the book's width, a 1280-pixel window (tests/test_book.py
measures it in Chromium). So the listing is formatted for the column, at
``lsdl_listing_width`` characters (76; _static/lsdl.css shrinks the listings' font where
the column is narrower), token for token the library's code:

* the source is dedented (a method reads as a function) and ruff formats it at the
  column's width (formatter directives such as ``# fmt: skip`` are dropped first);
* a trailing comment that does not fit moves to its own line above its line (on a
  block's header, ``else:``, to the first line of the block), and a block of comments
  that does not fit is refilled;
* a string that does not fit is cut at a space into adjacent literals (within brackets,
  where Python joins them back into the same string);
* a docstring paragraph that does not fit is refilled; a line of a literal or math
  block that does not fit continues on the next line, indented four more.

The result must parse to the same syntax tree as the source (docstrings compared word
for word), and every line must fit; either failure is a build error naming the object,
so a listing never shows other code than the library's and never scrolls sideways.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import re
import shutil
import subprocess
import sys
import textwrap
import tokenize
from pathlib import Path

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

WIDTH = 76  # the characters a line of a listing holds at the book's width (see above)
HANGING = 4  # the extra indent of a literal or math line continued on the next line

FORMATTER_COMMENT = re.compile(r"#\s*fmt:\s*(skip|off|on)\s*$")
# the starts of reST's blocks: a list item; a directive, a field or a doctest
BULLET = re.compile(r"([-*+]|\d+[.)]|\((\d+|[a-zA-Z]|[ivxIVX]+)\)|#\.)\s+")
BLOCK_START = re.compile(r"\.\. |:[^:`\s][^:`]*:(\s|$)|>>>")
CLOSING_QUOTES = ('"""', "'''")
STRING_START = re.compile(r"([rRbBuUfF]{0,2})('|\")")


class ListingError(ValueError):
    """The source cannot be shown within the width as the library's code."""


def resolve(path: str):
    """The object named by the dotted import path `path` (a module's attribute, a class's
    method, a property's getter); ValueError naming the part that is missing."""
    parts = path.split(".")
    module, i = None, len(parts)
    while i > 0:
        try:
            module = importlib.import_module(".".join(parts[:i]))
            break
        except ModuleNotFoundError as missing:
            if missing.name is None or not ".".join(parts[:i]).startswith(missing.name):
                raise  # a module that the library imports is missing: say which
            i -= 1
    if module is None:
        raise ValueError(f"Invalid path: {path!r} (no module {parts[0]!r})")
    obj = module
    for k, name in enumerate(parts[i:], start=i):
        try:
            obj = getattr(obj, name)
        except AttributeError:
            raise ValueError(
                f"Invalid path: {path!r} ({'.'.join(parts[:k])} has no {name!r})"
            ) from None
    if isinstance(obj, property):
        obj = obj.fget
    return inspect.unwrap(obj) if callable(obj) and not isinstance(obj, type) else obj


def _ruff() -> list[str]:
    found = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if found is None:
        raise ListingError("ruff is missing (pip install -r requirements.txt)")
    return [found]


def ruff_format(text: str, width: int) -> str:
    """`text` formatted by ruff at line length `width`, with ruff's own defaults."""
    command = _ruff() + ["format", "--isolated", f"--line-length={width}", "-"]
    done = subprocess.run(command, input=text, capture_output=True, text=True)
    if done.returncode != 0:
        raise ListingError(f"ruff format failed: {done.stderr.strip()}")
    return done.stdout


def _tokens(text: str) -> list[tokenize.TokenInfo]:
    return list(tokenize.generate_tokens(io.StringIO(text).readline))


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _in_tokens(text: str) -> set[int]:
    """Line numbers (1-based) that begin inside a token of an earlier line (the lines of a
    multi-line string after its first)."""
    inside = set()
    for tok in _tokens(text):
        inside.update(range(tok.start[0] + 1, tok.end[0] + 1))
    return inside


def drop_formatter_comments(text: str) -> str:
    """`text` without ``# fmt: skip`` / ``off`` / ``on`` comments (for the formatter, not
    the reader): a line that holds only one goes, a trailing one is cut."""
    lines = text.splitlines(keepends=True)
    drop, cut = set(), {}
    for tok in _tokens(text):
        if tok.type == tokenize.COMMENT and FORMATTER_COMMENT.fullmatch(tok.string):
            row, col = tok.start
            if lines[row - 1][:col].strip():
                cut[row] = col
            else:
                drop.add(row)
    out = []
    for row, line in enumerate(lines, start=1):
        if row in drop:
            continue
        out.append(line[: cut[row]].rstrip() + "\n" if row in cut else line)
    return "".join(out)


def lift_trailing_comments(text: str, width: int) -> str:
    """Each trailing comment of a line longer than `width` moved to a line of its own:
    above the line, at its indent, or, on a block's header (``else:``), first in the block
    (not where a line continues a backslash or a string)."""
    lines = text.splitlines(keepends=True)
    inside = _in_tokens(text)
    moves = {}
    for tok in _tokens(text):
        row, col = tok.start
        if tok.type != tokenize.COMMENT or row in inside:
            continue
        line = lines[row - 1].rstrip("\n")
        after_backslash = row > 1 and lines[row - 2].rstrip("\n").endswith("\\")
        if line[:col].strip() and len(line) > width and not after_backslash:
            moves[row] = col
    out = []
    for row, line in enumerate(lines, start=1):
        if row not in moves:
            out.append(line)
            continue
        code, comment = line[: moves[row]].rstrip(), line[moves[row] :].strip()
        if code.endswith(":"):  # a block's header: the comment opens the block
            following = next((n for n in lines[row:] if n.strip()), "")
            deeper = len(_indent(following)) > len(_indent(line))
            body = _indent(following) if deeper else _indent(line) + " " * 4
            out += [code + "\n", body + comment + "\n"]
        else:
            out += [_indent(line) + comment + "\n", code + "\n"]
    return "".join(out)


def _fill(words: str, width: int, first: str, rest: str) -> list[str]:
    wrapper = textwrap.TextWrapper(
        width=width,
        initial_indent=first,
        subsequent_indent=rest,
        break_long_words=False,
        break_on_hyphens=False,
    )
    return wrapper.wrap(words) or [first.rstrip()]


def refill_comment_blocks(text: str, width: int) -> str:
    """Each block of full-line comments (consecutive, one indent) with a line longer than
    `width` refilled to `width`; an empty ``#`` line stays a paragraph break."""
    lines = text.splitlines(keepends=True)
    inside = _in_tokens(text)
    comments = {
        tok.start[0]
        for tok in _tokens(text)
        if tok.type == tokenize.COMMENT
        and tok.start[0] not in inside
        and not lines[tok.start[0] - 1][: tok.start[1]].strip()
    }
    out, row = [], 1
    while row <= len(lines):
        if row not in comments:
            out.append(lines[row - 1])
            row += 1
            continue
        indent = _indent(lines[row - 1])
        block = []
        while row in comments and _indent(lines[row - 1]) == indent:
            block.append(lines[row - 1].rstrip("\n"))
            row += 1
        if max(len(line) for line in block) <= width:
            out += [line + "\n" for line in block]
            continue
        paragraph: list[str] = []
        for line in [*block, None]:
            body = None if line is None else line.strip()[1:].strip()
            if body:
                paragraph.append(body)
                continue
            if paragraph:
                out += [w + "\n" for w in _fill(" ".join(paragraph), width, *[indent + "# "] * 2)]
                paragraph = []
            if line is not None:
                out.append(line + "\n")
    return "".join(out)


def _brackets_open(text: str) -> dict[int, int]:
    """Bracket depth at the start of each line (1-based)."""
    depth, row_depth = 0, {}
    last_row = 0
    for tok in _tokens(text):
        for row in range(last_row + 1, tok.start[0] + 1):
            row_depth[row] = depth
        last_row = max(last_row, tok.start[0])
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
    return row_depth


def _split_points(body: str, formatted: bool) -> list[int]:
    """Indices just after each space of a string literal's `body` where it may be cut
    (outside the replacement fields of an f-string, not after a backslash)."""
    points, depth, i = [], 0, 0
    while i < len(body):
        c = body[i]
        if c == "\\":
            i += 2
            continue
        if formatted and c in "{}" and body[i : i + 2] in ("{{", "}}"):
            i += 2
            continue
        if formatted and c == "{":
            depth += 1
        elif formatted and c == "}":
            depth -= 1
        elif c == " " and depth == 0:
            points.append(i + 1)
        i += 1
    return points


def _piece(prefix: str, quote: str, body: str) -> str:
    if "f" in prefix.lower() and not re.search(r"[{}]", body):
        prefix = re.sub("[fF]", "", prefix)  # no field in this piece: a plain string
    return f"{prefix}{quote}{body}{quote}"


def _literal_end(line: str, start: int, prefix: str, quote: str) -> int | None:
    """The index just after the one-line string literal that opens at `start` of `line`."""
    i, depth, formatted = start + len(prefix) + 1, 0, "f" in prefix.lower()
    while i < len(line):
        c = line[i]
        if c == "\\":
            i += 2
            continue
        if formatted and line[i : i + 2] in ("{{", "}}"):
            i += 2
            continue
        if formatted and c in "{}":
            depth += 1 if c == "{" else -1
        elif c == quote and depth == 0:
            return i + 1
        i += 1
    return None


def _one_literal(line: str):
    """(prefix, quote, body, tail) when `line` starts, after its indent, with a one-line
    string literal; else None."""
    indent = _indent(line)
    start = STRING_START.match(line, len(indent))
    if start is None:
        return None
    prefix, quote = start.groups()
    if line.startswith(quote * 3, len(indent) + len(prefix)):
        return None  # a triple-quoted string
    end = _literal_end(line, len(indent), prefix, quote)
    if end is None:
        return None
    return prefix, quote, line[len(indent) + len(prefix) + 1 : end - 1], line[end:]


def parenthesize_long_strings(text: str, width: int) -> str:
    """Each line longer than `width` outside brackets that ends with a one-line string
    literal after ``return``, ``yield`` or an assignment, with the literal put on a line of
    its own between parentheses (the same expression), where it can be cut."""
    lines = text.splitlines(keepends=True)
    depth, inside = _brackets_open(text), _in_tokens(text)
    out = []
    for row, line in enumerate(lines, start=1):
        line = line.rstrip("\n")
        head = re.match(r"(\s*)(return|yield|[\w.\[\], ]+ [-+*/|&%@]?=)\s+", line)
        found = None if head is None else _one_literal(" " * head.end() + line[head.end() :])
        if len(line) <= width or row in inside or depth.get(row) or not found or found[3]:
            out.append(line + "\n")
            continue
        indent = head.group(1)
        out += [line[: head.end()].rstrip() + " (\n", indent + " " * 4 + line[head.end() :] + "\n"]
        out.append(indent + ")\n")
    return "".join(out)


def split_long_strings(text: str, width: int) -> str:
    """Each run of lines that are string literals within brackets (an argument, the pieces
    of an implicit concatenation; one indent, one kind of literal) with a line longer than
    `width`, cut again at spaces into adjacent literals, one a line, each within `width`
    where a space allows."""
    lines = text.splitlines(keepends=True)
    depth, inside = _brackets_open(text), _in_tokens(text)

    def literal(row):
        line = lines[row - 1].rstrip("\n")
        if row in inside or not depth.get(row):
            return None
        found = _one_literal(line)
        return None if found is None else (_indent(line), *found)

    row, out = 1, []
    while row <= len(lines):
        first = literal(row)
        run = [first] if first else []
        while run and not run[-1][4] and (following := literal(row + len(run))):
            same_kind = following[1].lower().replace("f", "") == first[1].lower().replace("f", "")
            if following[0] != first[0] or following[2] != first[2] or not same_kind:
                break
            run.append(following)
        too_long = any(len(lines[row - 1 + k].rstrip("\n")) > width for k in range(len(run)))
        formatted = any("f" in r[1].lower() for r in run)
        plain_braces = any("f" not in r[1].lower() and re.search(r"[{}]", r[3]) for r in run)
        if not run or not too_long or (formatted and plain_braces):
            out.extend(lines[row - 1 : row - 1 + max(len(run), 1)])
            row += max(len(run), 1)
            continue
        indent, prefix, quote = first[:3]
        if formatted and "f" not in prefix.lower():
            prefix += "f"  # each piece gets its f back only where it has a field (_piece)
        body, tail = "".join(r[3] for r in run), run[-1][4]
        room = width - len(indent) - len(prefix) - 2
        pieces, rest = [], body
        while len(rest) + len(tail) > room:
            cuts = [p for p in _split_points(rest, formatted) if p <= room]
            if not cuts:
                break
            pieces.append(rest[: cuts[-1]])
            rest = rest[cuts[-1] :]
        pieces.append(rest)
        new = [indent + _piece(prefix, quote, p) for p in pieces]
        new[-1] += tail
        out.extend(n + "\n" for n in new)
        row += len(run)
    return "".join(out)


def _docstring_nodes(tree: ast.AST) -> list[ast.Constant]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                found.append(first.value)
    return found


def _depths(line: str) -> list[int]:
    """The bracket depth ({[( less )]}; not after a backslash) before each character."""
    depths, depth, escaped = [], 0, False
    for c in line:
        depths.append(depth)
        if not escaped and c in "{[(":
            depth += 1
        elif not escaped and c in ")]}":
            depth -= 1
        escaped = c == "\\" and not escaped
    return depths


def _hang(line: str, width: int, hang: str | None = None) -> list[str]:
    """A literal line longer than `width` cut at spaces (in its second half, at the
    shallowest bracket depth, then as late as can be) and continued at `hang` (default:
    four columns deeper than the line)."""
    hang = _indent(line) + " " * HANGING if hang is None else hang
    out, rest = [], line
    while len(rest) > width:
        # a cut after the hang's width, or the continuation would be no shorter
        first = max(len(_indent(rest)), len(hang)) + 1
        depths = _depths(rest)
        spaces = [i for i in range(max(first, width // 2), width + 1) if rest[i] == " "]
        if not spaces:  # none in the second half: the last one before the width
            spaces = [i for i in range(first, width + 1) if rest[i] == " "][-1:]
        if not spaces:
            break
        cut = min(spaces, key=lambda i: (depths[i], -i))
        out.append(rest[:cut].rstrip())
        rest = hang + rest[cut:].strip()
    return out + [rest]


def refill_docstring(lines: list[str], width: int) -> list[str]:
    """The lines of a docstring (quotes included), each paragraph with a line longer than
    `width` refilled to `width`. reST's blocks are kept: a list item (after a blank line or
    another item) keeps its hanging indent; a directive (``.. math::``) and the lines of a
    literal block after ``::`` are kept line for line, each cut only where it does not fit
    (a directive's own line continues under its content)."""
    out: list[str] = []
    literal_indent: int | None = None  # the indent of the line that opened a literal block
    paragraph: list[str] = []
    rest_indent, in_list = "", False

    def flush():
        nonlocal paragraph
        if paragraph and max(len(p) for p in paragraph) > width:
            words = " ".join(p.strip() for p in paragraph)
            out.extend(_fill(words, width, _indent(paragraph[0]), rest_indent))
        else:
            out.extend(paragraph)
        paragraph = []

    for line in lines:
        stripped, indent = line.strip(), _indent(line)
        if literal_indent is not None and (not stripped or len(indent) > literal_indent):
            out.extend(_hang(line, width) if stripped else [line])
            continue
        literal_indent = None
        if not stripped:
            flush()
            out.append(line)
            in_list = False
            continue
        # a list item starts after a blank line or another item (reST: a list cannot
        # interrupt a paragraph, so "2013) and" within one is text)
        bullet = BULLET.match(stripped) if not paragraph or in_list else None
        directive = BLOCK_START.match(stripped)
        closing = stripped in CLOSING_QUOTES
        continues = paragraph and indent == rest_indent and not (bullet or directive or closing)
        if not continues:
            flush()
        if directive:
            head = re.match(r"\.\. [\w:-]+::\s+", stripped)
            hang = indent + " " * head.end() if head else None
            out.extend(_hang(line, width, hang))
            literal_indent = len(indent)
            continue
        if closing:
            out.append(line)
            continue
        if not continues:
            rest_indent = indent + (" " * bullet.end() if bullet else "")
            in_list = bullet is not None
        paragraph.append(line)
        if stripped.endswith("::"):
            flush()
            literal_indent = len(indent)
    flush()
    return out


def refill_docstrings(text: str, width: int) -> str:
    lines = text.splitlines()
    for node in sorted(_docstring_nodes(ast.parse(text)), key=lambda n: -n.lineno):
        start, end = node.lineno - 1, node.end_lineno
        lines[start:end] = refill_docstring(lines[start:end], width)
    return "\n".join(lines) + "\n"


def _same_code(a: str, b: str) -> bool:
    """Whether `a` and `b` parse to the same tree, docstrings compared word for word."""
    trees = [ast.parse(a), ast.parse(b)]
    for tree in trees:
        for doc in _docstring_nodes(tree):
            doc.value = " ".join(doc.value.split())
    return ast.dump(trees[0]) == ast.dump(trees[1])


def format_listing(source: str, width: int = WIDTH) -> str:
    """`source` (a function, method or class, as ``inspect.getsource`` gives it) formatted
    to lines of at most `width` characters (see the module's docstring); ListingError when
    a line cannot be brought within `width` or the result is not the same code."""
    original = textwrap.dedent(source)
    text = drop_formatter_comments(original)
    for _ in range(3):  # ruff may split a call whose closing line keeps a long comment
        formatted = ruff_format(lift_trailing_comments(text, width), width)
        if formatted == text:
            break
        text = formatted
    text = refill_comment_blocks(text, width)
    text = split_long_strings(parenthesize_long_strings(text, width), width)
    text = refill_docstrings(text, width)
    if not _same_code(original, text):
        raise ListingError("formatting changed the code (a bug of _ext/lsdl_listings.py)")
    long = [(i, line) for i, line in enumerate(text.splitlines(), 1) if len(line) > width]
    if long:
        shown = "; ".join(f"line {i} ({len(line)} characters): {line.strip()}" for i, line in long)
        raise ListingError(f"lines longer than {width} characters: {shown}")
    return text


def repository_link(path: Path, first: int, count: int, srcdir: Path, options: dict):
    """The URL of lines first..first+count-1 of file `path` in the repository of the book at
    `srcdir` (_config.yml's ``repository``, from the theme's options); None when the file
    is not in the book's repository (an installed copy) or the book names none."""
    url = (options or {}).get("repository_url")
    try:
        relative = path.resolve().relative_to(srcdir.resolve())
    except ValueError:
        return None
    if not url:
        return None
    branch = options.get("repository_branch") or "main"
    return f"{url.rstrip('/')}/blob/{branch}/{relative.as_posix()}#L{first}-L{first + count - 1}"


class Listing(SphinxDirective):
    """``listing <import path>``: the source of that object of the library, highlighted
    and formatted for the text column, under a caption naming it."""

    required_arguments = 1
    has_content = False

    def run(self):
        path = self.arguments[0]
        try:
            obj = resolve(path)
            lines, first = inspect.getsourcelines(obj)
            file = Path(inspect.getsourcefile(obj))
            text = format_listing("".join(lines), self.config.lsdl_listing_width)
        except (ImportError, ValueError, TypeError, OSError) as error:
            raise self.error(f"listing {path}: {error}") from None
        self.env.note_dependency(str(file))
        literal = nodes.literal_block(text, text, language="python")
        self.set_source_info(literal)
        name = nodes.literal(path, path)
        url = repository_link(
            file, first, len(lines), Path(self.env.srcdir), self.config.html_theme_options
        )
        caption = nodes.caption(
            path, "", nodes.reference("", "", name, refuri=url) if url else name
        )
        self.set_source_info(caption)
        classes = ["literal-block-wrapper", "lsdl-listing"]
        wrapper = nodes.container("", caption, literal, literal_block=True, classes=classes)
        self.set_source_info(wrapper)
        # its anchor names the object (#listing-lsdl-lab-optim-lars-update): a second listing
        # of it on the page gets a numbered one
        wrapper["names"].append(f"listing-{path}")
        self.state.document.note_implicit_target(wrapper, wrapper)
        return [wrapper]


def setup(app):
    app.add_config_value("lsdl_listing_width", WIDTH, "env", types=[int])
    app.add_directive("listing", Listing)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
