"""Labs read well outside the book: in Colab and Jupyter, MyST roles and directives show as
raw text, so a lab's markdown is plain CommonMark (citations as "(Author et al., Year)" with
a link to the paper, book pages as relative markdown links)."""

import re
from pathlib import Path

import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
LABS = sorted((ROOT / "labs").glob("*.ipynb"))

# {cite}`x`, {cite:p}`x`, {doc}`x`, {ref}`x`, {numref}`x`, {eq}`x`, {math}`x`, ...
ROLE = re.compile(r"(?<!`)\{[a-z][a-z0-9:_-]*\}`")
# ```{note}, ~~~{figure}, :::{admonition}: MyST directive fences
DIRECTIVE = re.compile(r"^\s*(`{3,}|~{3,}|:{3,})\s*\{[a-z]", re.MULTILINE)
# (my-label)= and cross-reference targets
TARGET = re.compile(r"^\s*\([A-Za-z0-9_.:-]+\)=\s*$", re.MULTILINE)
# markdown links to files of the repository: [text](../book/ch04_large_batch.md)
RELATIVE_LINK = re.compile(r"\]\((\.\.?/[^)#\s]+)(?:#[^)]*)?\)")


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
            "[Chapter N](../book/chNN_name.md)"
        )


def book_pages():
    """The pages of the book (_toc.yml), as paths relative to the repository."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]] + [c["file"] for part in toc["parts"] for c in part["chapters"]]
    return {f + ext for f in files for ext in (".md", ".ipynb")}


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_lab_relative_links_point_at_files_of_the_repository(lab):
    nb = nbformat.read(lab, as_version=4)
    pages = book_pages()
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for target in RELATIVE_LINK.findall(cell.source):
                path = (lab.parent / target).resolve()
                assert path.is_file(), f"{lab.name}: {target}"
                # the book resolves a link to a .md or .ipynb as a page of the book (a
                # build warning otherwise): other files of the repository by their GitHub URL
                if path.suffix in (".md", ".ipynb"):
                    relative = str(path.relative_to(ROOT))
                    assert relative in pages, f"{lab.name}: {target} is not a page of the book"


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
    repo_url = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"]
    targets = colab_targets(text)
    assert targets, f"{lab.name} has no Colab link"
    for org, repo, branch, path in targets:
        assert f"https://github.com/{org}/{repo}" == repo_url and branch == "main", path
        assert (ROOT / path).is_file(), f"{lab.name}: Colab link to missing {path}"
    # the book's HTML is served with no network: a remote image (a badge) would not load
    assert not REMOTE_IMAGE.findall(text), f"{lab.name}: remote image"
