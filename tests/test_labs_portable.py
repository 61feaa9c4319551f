"""Labs read well outside the book: in Colab and Jupyter, MyST roles and directives show as
raw text, so a lab's markdown is plain CommonMark (citations as "(Author et al., Year)" with
a link to the paper). Colab shows a notebook alone, where a relative link opens nothing, so
every link is absolute: a book page or another file by its URL on GitHub (the repository of
_config.yml, which Colab opens the lab from; the book's HTML turns a link to one of its own
pages into an internal link, tested in tests/test_book.py)."""

import functools
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

import nbformat
import pytest
import yaml
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[1]
LABS = sorted((ROOT / "labs").glob("*.ipynb"))

# {cite}`x`, {cite:p}`x`, {doc}`x`, {ref}`x`, {numref}`x`, {eq}`x`, {math}`x`, ...
ROLE = re.compile(r"(?<!`)\{[a-z][a-z0-9:_-]*\}`")
# ```{note}, ~~~{figure}, :::{admonition}: MyST directive fences
DIRECTIVE = re.compile(r"^\s*(`{3,}|~{3,}|:{3,})\s*\{[a-z]", re.MULTILINE)
# (my-label)= and cross-reference targets
TARGET = re.compile(r"^\s*\([A-Za-z0-9_.:-]+\)=\s*$", re.MULTILINE)


def myst_syntax(text):
    """Every MyST role, directive fence and target in `text`, as found."""
    return ROLE.findall(text) + DIRECTIVE.findall(text) + TARGET.findall(text)


def test_the_detector_finds_each_kind_of_myst_syntax():
    assert myst_syntax("ResNet {cite}`he2016deep` and {cite:p}`a,b`") == ["{cite}`", "{cite:p}`"]
    assert myst_syntax("see {doc}`Chapter 4 <../book/ch04>` and {ref}`x`") == ["{doc}`", "{ref}`"]
    assert len(myst_syntax("```{note}\nhi\n```")) == 1
    assert len(myst_syntax(":::{admonition} Title\nhi\n:::")) == 1
    assert len(myst_syntax("(sec-intro)=\n# Intro")) == 1
    # plain markdown passes: a fenced code block, a link, a dict in inline code, math
    plain = "```python\nx = {'a': 1}\n```\n[He et al., 2016](https://doi.org/x) `{a}` $\\{x\\}$"
    assert myst_syntax(plain) == []


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_lab_markdown_has_no_myst_roles_or_directives(lab):
    nb = nbformat.read(lab, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            continue
        found = myst_syntax(cell.source)
        assert not found, (
            f"{lab.name} cell {i}: MyST syntax {found} shows as raw text in Colab/Jupyter; "
            "write citations as ([Author et al., Year](paper URL)) and book pages as "
            "[Chapter N](<repository URL>/blob/main/book/chNN_name.md)"
        )


# Jupyter, Colab and GitHub all read CommonMark; its parser (markdown-it, MyST's own) finds
# links as a reader's renderer does: inline and by reference, and none inside code
COMMONMARK = MarkdownIt("commonmark")
HTML_TARGET = re.compile(r"""\b(?:href|src)\s*=\s*["']([^"']*)["']""", re.IGNORECASE)
LINK_SCHEMES = {"http", "https", "mailto"}
IMAGE_SCHEMES = {"attachment", "data"}  # carried in the notebook itself


def link_targets(markdown):
    """(kind, target) of every link and image in `markdown`, as written: kind is "link" or
    "image"; a raw HTML tag's href and src count as links."""
    found = []

    def walk(tokens):
        for token in tokens:
            if token.type == "link_open":
                found.append(("link", token.attrGet("href")))
            elif token.type == "image":
                found.append(("image", token.attrGet("src")))
            elif token.type in ("html_inline", "html_block"):
                found.extend(("link", t) for t in HTML_TARGET.findall(token.content))
            walk(token.children or [])

    walk(COMMONMARK.parse(markdown))
    return found


def opens_outside_the_book(kind, target):
    """Whether a link or image of a lab opens in Colab, where the notebook is alone: an
    absolute URL (a relative path or a bare #anchor resolves against nothing there)."""
    allowed = LINK_SCHEMES | (IMAGE_SCHEMES if kind == "image" else set())
    return urlsplit(target).scheme in allowed


@functools.cache
def repository():
    """(URL, branch) of the book's repository, from _config.yml (tests/test_book.py uses it
    too)."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]
    return config["url"].rstrip("/"), config.get("branch", "main")


def site():
    """The published site's URL, from _config.yml (html.baseurl)."""
    return yaml.safe_load((ROOT / "_config.yml").read_text())["html"]["baseurl"]


def site_link_problem(url, site_url):
    """Why a link to the published site names no page of this book (None when it does, or
    when it is no link to the site): a page is ``<site><source without suffix>.html``."""
    if not url.startswith(site_url):
        return None
    path = urlsplit(url[len(site_url) :]).path
    if not path.endswith(".html"):
        return f"{path} is not a page of the site (<page>.html)"
    stem = ROOT / path.removesuffix(".html")
    if not any(stem.with_suffix(suffix).is_file() for suffix in (".md", ".ipynb")):
        return f"no page {path}: no {stem.relative_to(ROOT)}.md or .ipynb in the repository"
    return None


def repository_target(url, repo_url):
    """(view, branch, path, fragment) when `url` names a file or folder of the repository at
    `repo_url` (view: blob, tree or raw), else None."""
    m = re.match(
        re.escape(repo_url) + r"/(blob|tree|raw)/([^/?#]+)/([^?#]*)(?:\?[^#]*)?(?:#(.*))?$", url
    )
    return None if m is None else (m[1], m[2], unquote(m[3]), unquote(m[4] or ""))


def github_slug(heading):
    """The anchor GitHub gives a heading of rendered markdown: lower case, punctuation
    dropped, spaces to hyphens (github-slugger)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def heading_anchors(markdown):
    """GitHub's anchors of the headings of `markdown` (a repeat gets -1, -2, ...) and the
    ids of its raw HTML anchors."""
    markdown = re.sub(r"\A---\n.*?\n---\n", "", markdown, flags=re.DOTALL)  # front matter
    tokens = COMMONMARK.parse(markdown)
    anchors, seen = set(), {}
    for token, inline in zip(tokens, tokens[1:]):
        if token.type == "heading_open":
            text = "".join(c.content for c in inline.children if c.type in ("text", "code_inline"))
            slug = github_slug(text)
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
        if token.type in ("html_block", "inline"):  # raw HTML anchors, in blocks or text
            anchors.update(re.findall(r"""<a\s[^>]*\b(?:id|name)=["']([^"']+)""", token.content))
    return anchors


def anchor_problem(path, fragment):
    """Why `fragment` is no anchor of the repository's file `path` (None when it is): a
    heading of a .md or of a notebook's markdown, or lines #L<n>[-L<m>] of another file."""
    if path.suffix in (".md", ".ipynb"):
        if path.suffix == ".md":
            text = path.read_text()
        else:
            nb = nbformat.read(path, as_version=4)
            text = "\n\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
        return None if fragment in heading_anchors(text) else f"no heading with anchor #{fragment}"
    lines = re.fullmatch(r"L(\d+)(?:-L(\d+))?", fragment)
    if lines is None:
        return f"#{fragment} cannot be checked (a heading of .md/.ipynb or #L<n> lines)"
    count = len(path.read_text().splitlines())
    last = int(lines[2] or lines[1])
    return None if 1 <= int(lines[1]) <= last <= count else f"#{fragment}: {count} lines"


def repository_link_problem(url, repo_url, branch):
    """Why a link into the repository would open nothing on GitHub (None when it opens)."""
    found = repository_target(url, repo_url)
    if found is None:
        return None
    view, at, relative, fragment = found
    if at != branch:
        return f"branch {at}, not {branch} (_config.yml's repository.branch)"
    path = ROOT / relative
    if not (path.is_dir() if view == "tree" else path.is_file()):
        return f"{relative} is not a {'folder' if view == 'tree' else 'file'} of the repository"
    return anchor_problem(path, fragment) if fragment else None


def test_the_link_checks_find_each_kind_of_link():
    md = (
        "# Lab `x`\n[a](../book/ch01.md) [b][r] <a href='./c.md'>c</a> ![d](d.png) [e](#x)\n"
        "![f](attachment:f.png) [g](https://arxiv.org/abs/1) `[h](../h.md)`\n\n"
        "```\n[i](../i.md)\n```\n\n[r]: book/b.md\n"
    )
    found = link_targets(md)
    assert [t for _, t in found] == [
        "../book/ch01.md", "book/b.md", "./c.md", "d.png", "#x", "attachment:f.png",
        "https://arxiv.org/abs/1",
    ]  # fmt: skip
    assert [opens_outside_the_book(k, t) for k, t in found] == [False] * 5 + [True] * 2
    assert not opens_outside_the_book("link", "attachment:f.png")

    repo, branch = "https://github.com/o/r", "main"
    assert repository_target(f"{repo}/blob/main/book/a.md#s-1", repo) == (
        "blob", "main", "book/a.md", "s-1",
    )  # fmt: skip
    assert repository_target("https://github.com/o/other/blob/main/a.md", repo) is None
    problem = repository_link_problem(f"{repo}/blob/dev/README.md", repo, branch)
    assert "branch dev" in problem
    assert "not a file" in repository_link_problem(f"{repo}/blob/main/no/such.md", repo, branch)
    assert repository_link_problem(f"{repo}/tree/main/labs", repo, branch) is None
    assert repository_link_problem(f"{repo}/blob/main/README.md", repo, branch) is None
    page = "https://example.org/r/"
    assert site_link_problem(f"{page}book/ch01_introduction.html", page) is None
    assert "no page book/ch99.html" in site_link_problem(f"{page}book/ch99.html", page)
    assert "not a page" in site_link_problem(f"{page}book/ch01_introduction.md", page)
    assert site_link_problem("https://arxiv.org/abs/1", page) is None
    assert repository_link_problem(f"{repo}/blob/main/_config.yml#L2-L3", repo, branch) is None
    assert "lines" in repository_link_problem(
        f"{repo}/blob/main/_config.yml#L1-L9999", repo, branch
    )

    assert github_slug("9.3 The recipe: ZeRO-2, `torchrun`!") == "93-the-recipe-zero-2-torchrun"
    assert heading_anchors("---\na: b\n---\n# A b\n## A b\n<a id='here'></a>\n") == {
        "a-b", "a-b-1", "here",
    }  # fmt: skip


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_every_link_of_a_lab_opens_in_colab(lab):
    """No relative link (Colab resolves it against nothing); every link into the repository
    names a file (and heading) that exists in the checkout at _config.yml's branch."""
    repo_url, branch = repository()
    nb = nbformat.read(lab, as_version=4)
    problems = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            continue
        for kind, target in link_targets(cell.source):
            if not opens_outside_the_book(kind, target):
                problems.append(
                    f"cell {i}: {kind} {target!r} opens nothing in Colab; link a file of the "
                    f"repository as {repo_url}/blob/{branch}/<path>"
                )
            elif (problem := repository_link_problem(target, repo_url, branch)) is not None:
                problems.append(f"cell {i}: {target}: {problem}")
            elif (problem := site_link_problem(target, site())) is not None:
                problems.append(f"cell {i}: {target}: {problem}")
    assert not problems, f"{lab.name}:\n" + "\n".join(problems)


def test_labs_link_their_chapters_by_the_site_url():
    """So that the check above has links to check: most labs open on their chapter, on the
    published site (Colab shows the lab alone; GitHub would show the chapter's raw MyST)."""
    chapter = re.compile(re.escape(f"{site()}book/") + r"ch\d\d_\w+\.html")
    linked = [
        lab.name
        for lab in LABS
        if any(
            chapter.fullmatch(t)
            for c in nbformat.read(lab, as_version=4).cells
            if c.cell_type == "markdown"
            for _, t in link_targets(c.source)
        )
    ]
    assert len(linked) >= len(LABS) - 1, linked  # Lab 1 comes before the chapters' subject


COLAB = re.compile(
    r"https://colab\.research\.google\.com/github/([^/]+)/([^/]+)/blob/([^/]+)/([^)\s\"]+)"
)
REMOTE_IMAGE = re.compile(r"!\[[^\]]*\]\((https?://[^)]+)\)|<img[^>]+src=[\"'](https?://[^\"']+)")


def colab_targets(text):
    """(org, repo, branch, path) of every Colab link in `text`."""
    return COLAB.findall(text)


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_lab_opens_itself_in_colab_and_loads_no_remote_image(lab):
    nb = nbformat.read(lab, as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    repo_url = repository()[0]
    targets = colab_targets(text)
    assert targets, f"{lab.name} has no Colab link"
    for org, repo, branch, path in targets:
        assert f"https://github.com/{org}/{repo}" == repo_url and branch == "main", path
        assert (ROOT / path).is_file(), f"{lab.name}: Colab link to missing {path}"
    # the book's HTML is served with no network: a remote image (a badge) would not load
    assert not REMOTE_IMAGE.findall(text), f"{lab.name}: remote image"
