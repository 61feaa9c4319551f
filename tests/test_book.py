"""The book builds, with every page and lab executed at the smoke profile, without warnings.

`jupyter-book build -W` turns every Sphinx warning into an error: a cell that raises, a
broken cross-reference, a citation missing from references.bib, a duplicate label.
"""

import ast
import functools
import importlib.util
import inspect
import io
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tokenize
import unicodedata
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import nbformat
import pytest
import yaml
from test_labs_portable import repository

ROOT = Path(__file__).resolve().parents[1]
JB = Path(sys.executable).with_name("jupyter-book")


def toc_files():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc["parts"]:
        files += [c["file"] for c in part["chapters"]]
    return files


def test_every_toc_entry_exists_and_every_page_is_in_the_toc():
    files = toc_files()
    for f in files:
        assert any((ROOT / f"{f}{ext}").exists() for ext in (".md", ".ipynb")), f
    pages = {
        str(p.relative_to(ROOT).with_suffix(""))
        for d in ("book", "labs")
        for p in (ROOT / d).glob("*")
        if p.suffix in (".md", ".ipynb")
    }
    assert pages <= set(files), f"pages missing from _toc.yml: {pages - set(files)}"


def test_every_lab_has_a_colab_launch_button_configured():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert config["launch_buttons"]["colab_url"].startswith("https://colab.research.google.com")
    assert config["repository"]["url"].startswith("https://github.com/")
    labs = [f for f in toc_files() if f.startswith("labs/")]
    assert labs and all((ROOT / f"{f}.ipynb").exists() for f in labs)  # Colab opens .ipynb


WORKFLOWS = ROOT / ".github" / "workflows"


def workflows() -> dict:
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted(WORKFLOWS.glob("*.yml"))}


def triggers(workflow) -> set:
    on = workflow.get("on", workflow.get(True))  # YAML 1.1 reads the key `on` as True
    return {on} if isinstance(on, str) else set(on)


def make_targets() -> set:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))


def commands(workflow) -> list[str]:
    """The shell lines of a workflow's steps, a job's matrix expanded (${{ matrix.x }})."""
    lines = []
    for job in workflow["jobs"].values():
        matrix = job.get("strategy", {}).get("matrix", {})
        for step in job.get("steps", []):
            run = step.get("run", "")
            for key, values in matrix.items():
                ref = "${{ matrix." + key + " }}"
                if ref in run:
                    run = "\n".join(run.replace(ref, v) for v in values)
            lines += run.splitlines()
    return lines


def test_the_workflows_wrap_make_targets_and_need_no_secret_for_pull_requests():
    """Each workflow that builds or tests runs targets of the Makefile (CI: .ci/run, which is
    `make test`), so that what runs on GitHub runs here; none is started by
    pull_request_target, and those a pull request starts, from a fork too, use no secret and
    get a read-only token; each scheduled one can be started by hand and reports a failure."""
    found, targets = workflows(), make_targets()
    assert {"ci.yml", "pages.yml", "preview.yml", "linkcheck.yml", "colab.yml", "latest.yml",
            "release.yml"} <= set(found)  # fmt: skip
    assert re.search(r"^make test$", (ROOT / ".ci" / "run").read_text(), re.MULTILINE)
    made = {}
    for name, workflow in found.items():
        lines = commands(workflow)
        made[name] = {m for line in lines for m in re.findall(r"\bmake\s+([\w-]+)", line)}
        if any("bash .ci/run" in line for line in lines):
            made[name].add("test")
        assert made[name] <= targets, (name, made[name] - targets)
        on = triggers(workflow)
        assert "pull_request_target" not in on, name
        if "pull_request" in on:
            text = (WORKFLOWS / name).read_text()
            assert not re.findall(r"secrets\.(?!GITHUB_TOKEN)", text), name
            permissions = [workflow.get("permissions", {})] + [
                job.get("permissions", {}) for job in workflow["jobs"].values()
            ]
            assert all("write" not in str(p) for p in permissions), name
        if "schedule" in on:
            assert "workflow_dispatch" in on, name
            assert any(
                job.get("uses") == "./.github/workflows/report-failure.yml"
                and "failure()" in job.get("if", "")
                for job in workflow["jobs"].values()
            ), name
    expected = {
        "ci.yml": {"test"},
        "pages.yml": {"book-cached", "pdf"},
        "preview.yml": {"book"},
        "linkcheck.yml": {"linkcheck"},
        "colab.yml": {"test-labs", "test-colab"},
        "latest.yml": {"test-latest", "test-floor"},
        "release.yml": {"release"},
    }
    assert {name: made[name] for name in expected} == expected


def test_the_site_url_is_set_once_and_the_readme_opens_with_it():
    """The site's URL is _config.yml's html.baseurl: GitHub Pages of the repository the config
    names; every other mention of its owner's GitHub Pages in the project is that one (or a
    page of it: a cited author's own pages, such as a blog post, are not the book's); the
    README's first lines give it, with the badges of CI and of each scheduled
    workflow, which exist."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    repo = config["repository"]["url"].rstrip("/")
    owner, name = urlsplit(repo).path.strip("/").split("/")
    site = config["html"]["baseurl"]
    assert site == f"https://{owner}.github.io/{name}/"
    assert config["parse"]["myst_substitutions"]["site"] == site  # {{ site }} in the pages
    skip = {".git", ".venv", "_build", "build", "student", ".hypothesis", ".pytest_cache", ".whl"}
    tops = [t for t in ROOT.iterdir() if t.name not in skip and not t.name.endswith(".egg-info")]
    others = []
    for path in (p for t in tops for p in ([t] if t.is_file() else t.rglob("*"))):
        if path.is_file() and path.suffix in {".md", ".ipynb", ".py", ".yml", ".toml", ".css"}:
            pages = rf"https://{re.escape(owner)}\.github\.io/[^\s\"'<>)\]]*"
            for url in re.findall(pages, path.read_text(), flags=re.I):
                if not url.startswith(site):
                    others.append((str(path.relative_to(ROOT)), url))
    assert not others, others
    head = "\n".join((ROOT / "README.md").read_text().splitlines()[:10])
    assert site in head
    badges = re.findall(
        rf"\[!\[[^\]]+\]\({re.escape(repo)}/actions/workflows/([\w-]+\.yml)/badge\.svg[^)]*\)\]"
        rf"\({re.escape(repo)}/actions/workflows/([\w-]+\.yml)\)",
        head,
    )
    assert all(a == b for a, b in badges), badges
    scheduled = {n for n, w in workflows().items() if "schedule" in triggers(w)}
    assert scheduled and {a for a, _ in badges} == {"ci.yml"} | scheduled


@pytest.fixture(scope="module")
def smoke_book(tmp_path_factory):
    """The whole book built once at smoke, for the build test and the browser test (both in
    this file, so `--dist loadfile` runs them on one worker): (return code, log, html dir)."""
    out = tmp_path_factory.mktemp("book")
    env = dict(os.environ, LSDL_SCALE="smoke", TQDM_DISABLE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [str(JB), "build", str(ROOT), "--path-output", str(out), "-W", "--keep-going"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    return proc.returncode, proc.stdout + proc.stderr, out / "_build" / "html"


@pytest.mark.notebook
def test_book_builds_without_warnings(smoke_book):
    returncode, log, html = smoke_book
    assert returncode == 0, log[-6000:]
    for f in toc_files():
        page = html / f"{f}.html"
        assert page.exists(), f
    # figures in the HTML come from executed cells (myst-nb writes them as images)
    for f in (
        "book/ch01_introduction",
        "book/ch02_preliminaries",
        "labs/lab01_getting_started",
        "labs/lab02_gradient_noise",
        "book/ch05_generalization_gap",
        "labs/lab04a_large_batch",
        "labs/lab04b_lamb_lars",
        "labs/lab05_generalization_gap",
        "book/ch06_second_order",
        "labs/lab06_second_order",
        "book/ch07_communication",
        "labs/lab07_communication",
        "book/ch08_memory",
        "labs/lab08_memory",
        "book/ch09_conclusion",
        "labs/lab09_combined_recipe",
        "book/ch10_communication_at_scale",
        "labs/lab10_communication_at_scale",
    ):
        text = (html / f"{f}.html").read_text()
        assert re.search(r'<img[^>]+src="[^"]*_images/[^"]+\.png"', text), f"no figure in {f}"
    lab = (html / "labs/lab01_getting_started.html").read_text()
    assert "colab.research.google.com" in lab  # the launch button


def small_book(folder, pages, execute=True, sphinx=None, edition=None):
    """Build a book of `pages` ({path: text}, the first the root) in `folder` with the
    project's own _config.yml (execution off unless `execute`; `sphinx`: settings added to
    its Sphinx configuration; as the `edition` vN, as `make release` builds it, if given),
    local extensions and static files; returns the finished `jupyter-book build -W`
    process."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    if edition is not None:
        config = book_config_module().book_config(config, folder, edition=edition)
    if not execute:  # a markdown-only notebook would still start a kernel
        config["execute"]["execute_notebooks"] = "off"
    config["sphinx"]["config"].update(sphinx or {})
    (folder / "_config.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    for sub in ("_ext", "_static"):  # the config's local extension and favicon
        shutil.copytree(ROOT / sub, folder / sub)
    root, *rest = (str(Path(f).with_suffix("")) for f in pages)
    chapters = "".join(f"  - file: {f}\n" for f in rest)
    toc = f"format: jb-book\nroot: {root}\n" + (f"chapters:\n{chapters}" if rest else "")
    (folder / "_toc.yml").write_text(toc)
    (folder / "references.bib").write_text("")
    for name, text in pages.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return subprocess.run(
        [str(JB), "build", str(folder), "-W"], capture_output=True, text=True, timeout=600
    )


@pytest.mark.notebook
def test_a_cell_that_raises_fails_the_build(tmp_path):
    """The project's own _config.yml, on a one-page book whose cell raises."""
    page = (
        "---\njupytext:\n  text_representation:\n    extension: .md\n    format_name: myst\n"
        "kernelspec:\n  display_name: Python 3\n  language: python\n  name: python3\n---\n"
        "# A page\n\n```{code-cell} ipython3\nraise ValueError('this cell fails')\n```\n"
    )
    proc = small_book(tmp_path, {"page.md": page})
    assert proc.returncode != 0
    assert "this cell fails" in proc.stdout + proc.stderr


@functools.cache
def repository_blob():
    """``<repository url>/blob/<branch>/``, from _config.yml: a file of the repository on
    GitHub, where the labs link the book's pages and the benchmarks' results."""
    url, branch = repository()
    return f"{url}/blob/{branch}/"


def ext_module(name):
    """The module _ext/<name>.py (the folder is no package: Sphinx loads it by path)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "_ext" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def book_extension():
    return ext_module("lsdl_book")


def book_config_module():
    return ext_module("book_config")


def test_the_hook_finds_the_page_a_repository_link_names():
    ext = book_extension()
    options = {"repository_url": "https://github.com/o/r/", "repository_branch": "dev"}
    blob = ext.repository_blob_prefix(options)
    assert blob == "https://github.com/o/r/blob/dev/"
    assert ext.repository_blob_prefix({}) is None
    pages = {"book/ch01.md": "book/ch01", "labs/lab01.ipynb": "labs/lab01", "intro.md": "intro"}
    assert ext.book_page_of(f"{blob}book/ch01.md", blob, pages) == ("book/ch01", "")
    assert ext.book_page_of(f"{blob}labs/lab01.ipynb#the-run", blob, pages) == (
        "labs/lab01",
        "the-run",
    )
    for other in (
        f"{blob}benchmarks/results/colab_cost.md",  # not a page: read on GitHub
        f"{blob}book/ch01.ipynb",  # a page's name with another source's suffix
        f"{blob}book/ch01.md?plain=1",  # GitHub's own view asked for
        "https://github.com/o/r/blob/main/book/ch01.md",  # another branch
        "https://github.com/o/other/blob/dev/book/ch01.md",
        "https://arxiv.org/abs/1706.02677",
    ):
        assert ext.book_page_of(other, blob, pages) is None, other
    # a book kept in a folder of its repository (_config.yml's path_to_book)
    assert ext.book_page_of(f"{blob}docs/intro.md", blob, pages, "docs") == ("intro", "")
    assert ext.book_page_of(f"{blob}intro.md", blob, pages, "docs/") is None
    site = "https://example.org/r/"
    docnames = set(pages.values())
    assert ext.site_page_of(f"{site}book/ch01.html#a-b", [site], docnames) == ("book/ch01", "a-b")
    for other in (f"{site}book/ch09.html", f"{site}book/ch01.md", "https://example.org/x.html"):
        assert ext.site_page_of(other, [site], docnames) is None, other
    assert ext.site_page_of(f"{site}book/ch01.html", [None], docnames) is None
    # an edition (kept at <site>v2/): its own pages and the latest site's are its pages, not
    # another edition's
    bases = [f"{site}v2/", site]
    for url in (f"{site}v2/book/ch01.html#a-b", f"{site}book/ch01.html#a-b"):
        assert ext.site_page_of(url, bases, docnames) == ("book/ch01", "a-b"), url
    assert ext.site_page_of(f"{site}v1/book/ch01.html", bases, docnames) is None


def test_an_edition_links_its_tag():
    """In the edition of a tag, links to the repository's files and to Colab opening them
    name the tag instead of the branch the sources name; nothing else changes."""
    ext = book_extension()
    repo = "https://github.com/o/r"
    colab = "https://colab.research.google.com/github/o/r"
    for url, pinned in (
        (f"{repo}/blob/main/labs/lab01.ipynb", f"{repo}/blob/v2/labs/lab01.ipynb"),
        (f"{colab}/blob/main/labs/lab01.ipynb", f"{colab}/blob/v2/labs/lab01.ipynb"),
        (f"{repo}/tree/main/benchmarks#a", f"{repo}/tree/v2/benchmarks#a"),
    ):
        assert ext.edition_link(url, repo, "main", "v2") == pinned
        assert ext.edition_link(url, f"{repo}/", "main", "main") == url  # not an edition
    for other in (
        f"{repo}/blob/mainline/x.md",  # another branch
        f"{repo}/blob/v1/x.md",
        "https://github.com/o/r2/blob/main/x.md",  # another repository
        "https://github.com/other/r/blob/main/x.md",
        f"{repo}/releases",
        "https://arxiv.org/abs/1706.02677",
    ):
        assert ext.edition_link(other, repo, "main", "v2") == other, other
    assert (
        ext.edition_link(f"{repo}/blob/main/x.md", None, "main", "v2") == f"{repo}/blob/main/x.md"
    )


def make_config(target, **variables):
    """Run `make <target>` with these variables alone (its setup prerequisite taken as done,
    the tools of this Python): (the finished process, its output)."""
    proc = subprocess.run(
        ["make", "-s", "-o", ".venv/.installed", f"BIN={Path(sys.executable).parent}", target]
        + [f"{k}={v}" for k, v in variables.items()],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc, proc.stdout + proc.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_the_release_builds_the_edition_of_its_tag(tmp_path):
    """`make release EDITION=vN` builds from the configuration `make edition-config` writes:
    _config.yml with the repository's branch the tag (the Colab buttons open the tag's labs)
    and the site's URL the edition's (<site>vN/: its canonical links and its PDF's), what the
    book's hook needs to keep the labs' links to the latest site's pages within the edition,
    cached execution and the local extensions found from anywhere; nothing else changed. An
    edition not named vN (what release.yml publishes and pages.yml keeps) is refused."""
    original = yaml.safe_load((ROOT / "_config.yml").read_text())
    site = original["html"]["baseurl"]
    out = tmp_path / "config.yml"
    proc, log = make_config("edition-config", EDITION="v7", EDITION_CONFIG=out)
    assert proc.returncode == 0, log
    config = yaml.safe_load(out.read_text())
    assert config["repository"]["branch"] == "v7"
    assert config["html"]["baseurl"] == f"{site}v7/"
    assert config["execute"]["execute_notebooks"] == "cache"
    sphinx = config["sphinx"]
    assert sphinx["config"]["lsdl_latest_site"] == site
    assert sphinx["config"]["lsdl_source_branch"] == original["repository"]["branch"]
    for name, folder in sphinx["local_extensions"].items():
        assert Path(folder).is_absolute() and (Path(folder) / f"{name}.py").is_file(), name
    # the rest as _config.yml has it ({{ site }} in the pages stays the latest site)
    for key, value in (
        (("repository", "branch"), original["repository"]["branch"]),
        (("html", "baseurl"), site),
        (("execute", "execute_notebooks"), original["execute"]["execute_notebooks"]),
        (("sphinx", "local_extensions"), original["sphinx"]["local_extensions"]),
    ):
        config[key[0]][key[1]] = value
    for key in ("lsdl_latest_site", "lsdl_source_branch"):
        del sphinx["config"][key]
    assert config == original
    for bad in ("", "dev", "v1.2", "main"):
        proc, log = make_config("edition-config", EDITION=bad, EDITION_CONFIG=out)
        assert proc.returncode != 0 and f"Invalid edition: {bad!r}" in log, (bad, log)
    # the values the release's student versions are pinned with
    for key, value in (("repository.url", original["repository"]["url"]), ("html.baseurl", site)):
        got = subprocess.run(
            [sys.executable, str(ROOT / "_ext" / "book_config.py"), "--get", key],
            capture_output=True,
            text=True,
            check=True,
        )
        assert got.stdout.strip() == value


class _Links(HTMLParser):
    """Every a[href] of a page, each with whether it is in the page's article."""

    def __init__(self):
        super().__init__()
        self.links, self._depth = [], 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "article":
            self._depth += 1
        elif tag == "a" and attrs.get("href") is not None:
            self.links.append((attrs["href"], self._depth > 0))

    def handle_endtag(self, tag):
        self._depth -= tag == "article"


def page_links(html, page):
    """(absolute href, in the article) of every link of built page `page`, resolved as a
    browser would against the site at http://site/."""
    parser = _Links()
    parser.feed((html / f"{page}.html").read_text())
    return [(urljoin(f"http://site/{page}.html", h), a) for h, a in parser.links]


@functools.cache
def html_ids(path):
    return set(re.findall(r'\sid="([^"]+)"', Path(path).read_text()))


def link_problem(href, base, html, sources):
    """Why link `href` of the site at `base` (built in `html`) opens nothing, or opens a page
    of the book on GitHub instead of the site (None when it is fine). `sources`: the book's
    pages' source files, relative to the repository."""
    blob = repository_blob()
    parts = urlsplit(href)
    url, fragment = unquote(href.split("?")[0].split("#")[0]), unquote(parts.fragment)
    if url.startswith(base):
        path = url[len(base) :]
        target = html / (path + "index.html" if path == "" or path.endswith("/") else path)
        if not target.is_file():
            return f"no file {target.relative_to(html)} in the site"
        if fragment and target.suffix == ".html" and fragment not in html_ids(target):
            return f"no anchor #{fragment} in {target.relative_to(html)}"
    elif url.startswith(blob):
        path = url[len(blob) :]
        if not (ROOT / path).is_file():
            return f"no file {path} in the repository"
        if path in sources and not parts.query:  # ?plain=1 asks for GitHub's view
            return "a page of the book linked on GitHub: the site has it"
    return None


def markdown_lab(text: str) -> nbformat.NotebookNode:
    """A lab of one Markdown cell, ``text``, with a Python kernel (what small_book builds)."""
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    notebook.cells = [nbformat.v4.new_markdown_cell(text)]
    return notebook


@pytest.mark.notebook
def test_links_to_pages_on_github_become_links_to_the_site(tmp_path):
    """The hook on a two-page book: a lab links the chapter by the published site's URL (as
    it must for Colab) and by its GitHub URL, the chapter the lab; all become internal
    links, anchors kept; links to files that are no pages stay on GitHub. (The pages borrow
    real names, so that the GitHub links name files of the repository.)"""
    blob = repository_blob()
    published = yaml.safe_load((ROOT / "_config.yml").read_text())["html"]["baseurl"]
    chapter, lab = "book/ch01_introduction", "labs/lab01_getting_started"
    chapter_text = (
        "# A chapter\n\n## The section\n\n"
        f"The [lab]({blob}{lab}.ipynb), [this section]({blob}{chapter}.md#the-section), "
        f"[results]({blob}benchmarks/results/colab_cost.md).\n"
    )
    notebook = markdown_lab(
        f"# A lab\n\n[Chapter]({blob}{chapter}.md), [its section]"
        f"({blob}{chapter}.md#the-section), [a source]({blob}lsdl_lab/__init__.py), "
        f"[as text]({blob}{chapter}.md?plain=1), [on the site]"
        f"({published}{chapter}.html#the-section)"
    )
    pages = {f"{chapter}.md": chapter_text, f"{lab}.ipynb": nbformat.writes(notebook)}
    proc = small_book(tmp_path, pages, execute=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    html, site = tmp_path / "_build" / "html", "http://site/"
    in_article = {p: [h for h, article in page_links(html, p) if article] for p in (chapter, lab)}
    assert [h for h in in_article[lab] if "/book/" in h or "/lsdl_lab/" in h] == [
        f"{site}{chapter}.html",
        f"{site}{chapter}.html#the-section",
        f"{blob}lsdl_lab/__init__.py",
        f"{blob}{chapter}.md?plain=1",
        f"{site}{chapter}.html#the-section",
    ]
    for href in (f"{site}{lab}.html", f"{site}{chapter}.html#the-section"):
        assert href in in_article[chapter]
    assert f"{blob}benchmarks/results/colab_cost.md" in in_article[chapter]
    # the whole book's check of links (in the browser test) passes every link of these pages
    for page in (chapter, lab):
        for href, _ in page_links(html, page):
            assert link_problem(href, site, html, set(pages)) is None, (page, href)
    for broken in (
        f"{blob}{chapter}.md",  # a page on GitHub
        f"{blob}no/such/file.md",
        f"{site}{chapter}.html#nowhere",
        f"{site}book/missing.html",
    ):
        assert link_problem(broken, site, html, set(pages)), broken


@pytest.mark.notebook
def test_an_edition_is_built_as_that_edition(tmp_path):
    """A two-page book built as `make release` builds the edition v7 (_ext/book_config.py):
    the lab's launch button and its own "Open in Colab" link open the tag's notebook, its
    link to a file of the repository names the tag, its link to the chapter on the latest
    site (as the labs are written) stays within the edition, and the pages' canonical URL
    is the edition's."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    repo, published = config["repository"]["url"].rstrip("/"), config["html"]["baseurl"]
    blob = repository_blob()
    colab = f"https://colab.research.google.com/github/{urlsplit(repo).path.strip('/')}/blob/"
    chapter, lab = "book/ch01_introduction", "labs/lab01_getting_started"
    notebook = markdown_lab(
        f"# A lab\n\n[Open in Colab]({colab}main/{lab}.ipynb), [Chapter 1]"
        f"({published}{chapter}.html#the-section), [results]"
        f"({blob}benchmarks/results/colab_cost.md), [an edition]({published}v1/)"
    )
    pages = {
        f"{chapter}.md": "# A chapter\n\n## The section\n",
        f"{lab}.ipynb": nbformat.writes(notebook),
    }
    proc = small_book(tmp_path, pages, execute=False, edition="v7")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    html, site = tmp_path / "_build" / "html", "http://site/"
    links = page_links(html, lab)
    in_article = [h for h, article in links if article]
    assert in_article[-4:] == [
        f"{colab}v7/{lab}.ipynb",
        f"{site}{chapter}.html#the-section",
        f"{repo}/blob/v7/benchmarks/results/colab_cost.md",
        f"{published}v1/",
    ], in_article
    assert f"{colab}v7/{lab}.ipynb" in [h for h, article in links if not article]  # the button
    assert not [h for h, _ in links if "/blob/main/" in h]
    for page in (chapter, lab):
        text = (html / f"{page}.html").read_text()
        assert f'<link rel="canonical" href="{published}v7/{page}.html"' in text, page


def listings_extension():
    spec = importlib.util.spec_from_file_location(
        "lsdl_listings", ROOT / "_ext" / "lsdl_listings.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LISTING = re.compile(r"^```\{listing\} (\S+)\n```$", re.M)


def chapter_listings():
    """(chapter, import path) of each listing of the library's code in the chapters."""
    chapters = sorted((ROOT / "book").glob("ch[0-9]*.md"))
    return [(f.name, path) for f in chapters for path in LISTING.findall(f.read_text())]


def test_the_chapters_show_the_library_by_one_mechanism():
    """Every listing of the library's code in a chapter is a ``listing`` (highlighted,
    formatted for the column): no chapter prints a source (``inspect.getsource``, a ``show``
    helper) or includes a file's object (``literalinclude``); each names an object of the
    library that the directive formats within the column's width; the stylesheet sizes the
    listings' font for that width."""
    ext = listings_extension()
    listed = chapter_listings()
    # every chapter from Chapter 2 on shows the library's code (the introduction shows none)
    chapters = {f.name for f in (ROOT / "book").glob("ch[0-9]*.md")} - {"ch01_introduction.md"}
    assert {chapter for chapter, _ in listed} == chapters, sorted(listed)
    for f in sorted((ROOT / "book").glob("ch[0-9]*.md")):
        text = f.read_text()
        for other in ("getsource", "literalinclude", "def show("):
            assert other not in text, f"{f.name} shows code with {other}: use a listing"
    for chapter, path in listed:
        assert path.startswith("lsdl_lab."), (chapter, path)
        text = ext.format_listing(inspect.getsource(ext.resolve(path)))
        assert max(map(len, text.splitlines())) <= ext.WIDTH, (chapter, path)
    css = (ROOT / "_static" / "lsdl.css").read_text()
    assert re.findall(r"\((\d+) \* 0\.605\)", css) == [str(ext.WIDTH)]


def code_of(source):
    """The syntax tree of `source` with each docstring's words only (what a listing keeps)."""
    tree = ast.parse(textwrap.dedent(source))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                value.value = " ".join(value.value.split())
    return ast.dump(tree)


def comment_words(source):
    """The words of `source`'s comments, in order."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return [w for t in tokens if t.type == tokenize.COMMENT for w in t.string.lstrip("#").split()]


SAMPLE = r"""
    @staticmethod
    def method(alpha, beta, gamma):
        r'''A docstring whose first paragraph is far longer than the column of the book holds,
        so that it is refilled.

        - an item of a list that goes on and on beyond the column, with its hanging indent kept
        - a second item

        .. math::
            w_t = w_{t-1} - \frac{\eta}{1 - \beta_1^t}\, \frac{m_t}{\sqrt{\hat v_t} + \epsilon}
        '''
        if alpha:  # a trailing comment on a block's header, longer than the column holds it
            total = some_function_with_a_long_name(alpha, beta, keyword=alpha * beta)  # fmt: skip
        # a comment block whose lines are far too long for the column of the book: it is refilled
        # into lines that fit, word for word
        if beta:
            raise ValueError(f"Invalid beta: {beta} (expected a number between zero and one)")
        return f"alpha {alpha}, beta {beta}, gamma {gamma}, and a tail of words past the column"
"""


def test_a_listing_is_the_same_code_within_the_column():
    """The directive's formatter on a method with every kind of long line: each line fits the
    width; the code parses to the same tree (docstrings word for word), the comments keep
    their words, a formatter's directive (fmt: skip) goes; a docstring's list item keeps its
    hanging indent and a math line continues deeper; a line already within the width stays as
    it was. A line that cannot be cut is refused, naming it."""
    ext = listings_extension()
    width = ext.WIDTH
    text = ext.format_listing(SAMPLE, width)
    lines = text.splitlines()
    assert max(map(len, lines)) <= width < max(map(len, SAMPLE.splitlines()))
    assert code_of(text) == code_of(SAMPLE)
    assert comment_words(text) == [w for w in comment_words(SAMPLE) if w not in ("fmt:", "skip")]
    assert "fmt:" not in text
    assert lines[0] == "@staticmethod" and "    - a second item" in lines
    item = next(i for i, line in enumerate(lines) if line.startswith("    - an item"))
    assert lines[item + 1].startswith("      ") and not lines[item + 1].startswith("       ")
    math = next(i for i, line in enumerate(lines) if line.startswith("        w_t ="))
    assert lines[math + 1].startswith("            ")  # four deeper than the math line
    header = lines.index("    if alpha:")  # its comment opens the block
    assert lines[header + 1].startswith("        # a trailing comment")
    with pytest.raises(ext.ListingError, match=r"line 3 \(100 characters\): \"x{90}\""):
        ext.format_listing('def f():\n    return "' + "x" * 90 + '"\n', width)


def test_a_listing_names_its_object_by_import_path():
    ext = listings_extension()
    from lsdl_lab import noise, optim

    assert ext.resolve("lsdl_lab.optim.LARS.update") is optim.LARS.update
    getter = ext.resolve("lsdl_lab.noise.GradientNoise.simple_noise_scale")
    assert getter is noise.GradientNoise.simple_noise_scale.fget  # a property: its getter
    with pytest.raises(ValueError, match="lsdl_lab.optim has no 'Nothing'"):
        ext.resolve("lsdl_lab.optim.Nothing.update")
    with pytest.raises(ValueError, match="lsdl_lab has no 'nothing'"):
        ext.resolve("lsdl_lab.nothing.f")
    site = "https://github.com/o/r"
    options = {"repository_url": site, "repository_branch": "dev"}
    assert (
        ext.repository_link(ROOT / "lsdl_lab" / "noise.py", 10, 5, ROOT, options)
        == f"{site}/blob/dev/lsdl_lab/noise.py#L10-L14"
    )
    assert ext.repository_link(Path("/elsewhere/noise.py"), 10, 5, ROOT, options) is None


# Chapter 7's collectives: lines of up to 99 characters in the library
WIDE = (
    "lsdl_lab.distributed.collectives._post_all_gather",
    "lsdl_lab.distributed.collectives.tree_all_reduce",
)


@pytest.mark.notebook
def test_a_listing_wider_than_the_column_is_seen_scrolling(tmp_path):
    """The browser test's check of code blocks (site_browser.code_blocks) on a small book of
    listings, in Chromium at the book's window size: at the project's width they fit the
    column in the theme's code font; formatted at the library's own line length (100)
    instead, they scroll sideways, and the check sees it."""
    from site_browser import browser_paths, chromium, code_blocks, serve, sideways

    try:
        browser_paths()
    except RuntimeError as missing:  # never a silent skip: say what to install
        pytest.fail(str(missing))
    page = "# Listings\n\n```python\nx = 1\n```\n\n" + "".join(
        f"```{{listing}} {path}\n```\n\n" for path in WIDE
    )
    seen = {}
    for width in (None, 100):
        folder = tmp_path / f"book-{width}"
        folder.mkdir()
        extra = {"lsdl_listing_width": width} if width else None
        proc = small_book(folder, {"page.md": page}, execute=False, sphinx=extra)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        with serve(folder / "_build" / "html") as base, chromium(folder / "profile") as browser:
            browser.get(f"{base}page.html")
            seen[width] = [b for b in code_blocks(browser) if b["listing"]]
    fitted, wide = seen[None], seen[100]
    assert [b["name"] for b in fitted] == list(WIDE) == [b["name"] for b in wide]
    assert not [b for b in fitted if sideways(b)], fitted
    assert all(b["font"] == b["code_font"] for b in fitted), fitted
    assert max(b["longest"] for b in wide) > max(b["longest"] for b in fitted)
    assert [b for b in wide if sideways(b)], wide


ARTIFACTS = ROOT / "_build" / "test-artifacts"
SCREENSHOTS = ("intro", "book/ch05_generalization_gap", "labs/lab03_optimizers")  # both modes
# Dark mode: each figure of these pages is shown as drawn (its pixels within this many 8-bit
# levels of light mode's: no dimming filter, its own white background), so its black text and
# axes keep at least WCAG's AAA contrast, 7:1, on a light card, on a page that is dark.
FIGURE_TOLERANCE = 4
MIN_FIGURE_CONTRAST = 7.0
INK = (0, 0, 0)  # the figures' text and axes (lsdl_lab.plot keeps matplotlib's black)
BODY_BACKGROUND_JS = "return getComputedStyle(document.body).backgroundColor;"
FIRST_FIGURE_JS = """
const figure = [...document.querySelectorAll("article div.cell_output img, article figure img")]
    .find(img => img.checkVisibility());
if (figure) figure.scrollIntoView({block: "center"}); else window.scrollTo(0, 0);
"""
SEARCH_TERM, SEARCH_HIT = "momentum", "ch03_optimizers"  # a page the search must list
MIN_MATH_PAGES = 5  # so that the math checks cannot pass by finding no math
COLAB = re.compile(r"^https://colab\.research\.google\.com/github/([^/]+/[^/]+)/blob/main/(.+)$")

# JavaScript: the output images of every cell that calls a widget explorer (`*_explorer(`)
# JavaScript: every link of the page, as the browser resolves it, and whether it is in the
# page's article (the text; the navigation links every page)
LINKS_JS = (
    "return [...document.querySelectorAll('a[href]')].map(a => [a.href, !!a.closest('article')]);"
)

EXPLORER_FIGURES_JS = """
return [...document.querySelectorAll('.cell')]
    .filter(c => /_explorer\\(/.test((c.querySelector('.cell_input') || {}).textContent || ''))
    .map(c => [...c.querySelectorAll('.cell_output img')].map(i => i.naturalWidth));
"""


@pytest.mark.notebook
def test_site_in_headless_chromium(smoke_book, tmp_path):
    """The smoke build in a real browser, offline: every page loads with no console error,
    its math renders with the site's own MathJax, its images load, its Colab links open
    notebooks of the repository, its links open a page (and anchor) of the site or a file of
    the repository, never a page of the book on GitHub (the labs link chapters by their GitHub
    URL for Colab: the book's hook makes them internal); search finds a term; exercise
    solutions are hidden until clicked; widget explorers show a static figure; the theme's
    switch turns pages dark, and there every figure (a widget explorer's too) reads as in
    light mode, on a light card; in light mode, at the window's size, no block of code or
    output scrolls sideways (hidden cells and solutions opened), and every listing of the
    library's code is shown whole in the theme's code font. Screenshots of some pages in each
    mode go to _build/test-artifacts."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    from site_browser import (
        browser_paths,
        chromium,
        code_blocks,
        console_errors,
        contrast,
        css_rgb,
        figure_colours,
        luminance,
        page_state,
        serve,
        set_theme,
        sideways,
    )

    returncode, log, html = smoke_book
    assert returncode == 0, "the book did not build (see test_book_builds_without_warnings)"
    try:
        browser_paths()
    except RuntimeError as missing:  # never a silent skip: say what to install
        pytest.fail(str(missing))
    repo = repository()[0]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    problems, math_pages, explorers = [], 0, 0
    sources = {
        f + ext for f in toc_files() for ext in (".md", ".ipynb") if (ROOT / (f + ext)).exists()
    }
    labs_to_chapters, labs_from_chapters = set(), set()  # links in the text, between the two
    blocks, listings = 0, []  # code blocks measured; the listings of the library's code
    with serve(html) as base, chromium(tmp_path / "profile") as browser:
        for page in toc_files():
            state = page_state(browser, f"{base}{page}.html")
            problems += [f"{page}: console: {m}" for m in console_errors(browser)]
            problems += [f"{page}: image did not load: {s}" for s in state["broken_images"]]
            if state["math_nodes"]:
                math_pages += 1
                if not (state["mathjax_version"] or "").startswith("3."):
                    problems.append(f"{page}: MathJax 3 not loaded")
                elif not state["rendered_math"] or state["math_errors"]:
                    problems.append(f"{page}: math not rendered ({state})")
            for href in state["colab"]:
                m = COLAB.match(href)
                if not m or f"https://github.com/{m[1]}" != repo or not m[2].endswith(".ipynb"):
                    problems.append(f"{page}: Colab link to a non-notebook {href}")
                elif not (ROOT / m[2]).is_file():
                    problems.append(f"{page}: Colab link to a missing file {m[2]}")
            if page.startswith("labs/") and not any(
                h.endswith(f"/{page}.ipynb") for h in state["colab"]
            ):
                problems.append(f"{page}: no Colab link to itself")
            for href, in_article in browser.execute_script(LINKS_JS):
                if (problem := link_problem(href, base, html, sources)) is not None:
                    problems.append(f"{page}: link {href}: {problem}")
                elif in_article and href.startswith(base):
                    target = href[len(base) :]
                    if page.startswith("labs/") and target.startswith("book/"):
                        labs_to_chapters.add(page)
                    elif not page.startswith("labs/") and target.startswith("labs/"):
                        labs_from_chapters.add(target.split(".")[0])
            for widths in browser.execute_script(EXPLORER_FIGURES_JS):
                explorers += 1
                if not widths or not all(w > 0 for w in widths):
                    problems.append(f"{page}: a widget explorer shows no static figure")
            if page in SCREENSHOTS:
                browser.save_screenshot(str(ARTIFACTS / f"{page.replace('/', '_')}.png"))
            # code as a reader sees it: light mode (nothing chosen yet: the system's, light in
            # headless Chromium), the window's default size
            theme = browser.execute_script("return document.documentElement.dataset.theme;")
            if theme != "light":
                problems.append(f"{page}: code blocks measured in {theme} mode, not light")
            for block in code_blocks(browser):  # opens the page's hidden cells: last
                blocks += 1
                what = f"listing {block['name']}" if block["listing"] else "block"
                if sideways(block):
                    problems.append(
                        f"{page}: {what} scrolls sideways ({block['scroll']} px in "
                        f"{block['client']} px; its longest line, {block['longest']} "
                        f"characters: {block['line']!r})"
                    )
                if block["listing"]:
                    listings.append(block["name"])
                    if block["font"] != block["code_font"]:
                        problems.append(
                            f"{page}: {what} in {block['font']}, not the code font "
                            f"{block['code_font']}: the column is narrower than its lines"
                        )

        # search: Sphinx's own index, filled in by JavaScript
        browser.get(f"{base}search.html?q={SEARCH_TERM}")
        WebDriverWait(browser, 30).until(
            lambda b: b.find_elements(By.CSS_SELECTOR, "#search-results ul.search li")
        )
        hits = browser.find_elements(By.CSS_SELECTOR, "#search-results ul.search li a")
        assert any(SEARCH_HIT in (a.get_attribute("href") or "") for a in hits)
        problems += [f"search: console: {m}" for m in console_errors(browser)]

        # a solution is hidden until its title is clicked
        browser.get(f"{base}book/ch01_introduction.html")
        solution = browser.find_element(By.CSS_SELECTOR, ".solution.dropdown")
        body = solution.find_element(By.CSS_SELECTOR, "section, p:not(.admonition-title)")
        assert not body.is_displayed()
        solution.find_element(By.CSS_SELECTOR, ".toggle-button").click()
        WebDriverWait(browser, 10).until(lambda b: body.is_displayed())

        # until the reader chooses, the site follows the system's colour scheme ("auto")
        mode = browser.execute_script("return document.documentElement.dataset.mode;")
        if mode != "auto":
            problems.append(f"the theme's mode before any choice: {mode} (expected auto)")
        # both colour modes, switched by the theme's own button (the choice is kept for the
        # next pages, so each page is set to light first); a screenshot of each page in dark
        # mode (at its first figure) beside the one in light mode taken above
        dark_figures = []
        for page in SCREENSHOTS:
            page_state(browser, f"{base}{page}.html")
            seen = {}  # mode: (page background, figures)
            for mode in ("light", "dark"):
                if not set_theme(browser, mode):
                    problems.append(f"{page}: the theme's switch did not turn it {mode}")
                    break
                if mode == "dark":  # at its first figure, if it has one
                    browser.execute_script(FIRST_FIGURE_JS)
                    browser.save_screenshot(str(ARTIFACTS / f"{page.replace('/', '_')}_dark.png"))
                seen[mode] = (
                    css_rgb(browser.execute_script(BODY_BACKGROUND_JS)),
                    figure_colours(browser),
                )
            problems += [f"{page} (modes): console: {m}" for m in console_errors(browser)]
            if len(seen) < 2:
                continue
            (light_page, light), (dark_page, dark) = seen["light"], seen["dark"]
            if not luminance(light_page) > 0.9 > 0.05 > luminance(dark_page):
                problems.append(f"{page}: page background {light_page} light, {dark_page} dark")
            for before, after in zip(light, dark, strict=True):
                shift = max(abs(a - b) for a, b in zip(before["figure"], after["figure"]))
                if (
                    shift > FIGURE_TOLERANCE
                    or luminance(after["card"] or after["figure"]) < 0.8
                    or contrast(after["figure"], INK) < MIN_FIGURE_CONTRAST
                ):
                    problems.append(
                        f"{page}: {after['src']} in dark mode: background {after['figure']} "
                        f"(light mode: {before['figure']}), card {after['card']}"
                    )
            dark_figures += dark
    print(f"screenshots of {', '.join(SCREENSHOTS)}, light and dark, in {ARTIFACTS}")
    assert not problems, "\n".join(problems)
    assert math_pages >= MIN_MATH_PAGES and explorers >= 1  # the checks above did run
    # every listing of the chapters was measured, among the pages' other blocks
    assert sorted(listings) == sorted(path for _, path in chapter_listings()), listings
    assert blocks > 2 * len(listings)
    labs = [f for f in toc_files() if f.startswith("labs/")]
    # each lab but Lab 1 opens on its chapter; the chapters, the introduction and the parts'
    # pages link most labs (the links' own checks above ran on these)
    assert len(labs_to_chapters) >= len(labs) - 1, sorted(labs_to_chapters)
    assert len(labs_from_chapters) >= len(labs) // 2, sorted(labs_from_chapters)
    for p in SCREENSHOTS:
        for shot in (f"{p.replace('/', '_')}.png", f"{p.replace('/', '_')}_dark.png"):
            assert (ARTIFACTS / shot).stat().st_size > 0, shot
    # the dark-mode checks ran, on figures, a widget explorer's among them
    assert len(dark_figures) >= 3 and any(f["explorer"] for f in dark_figures)


PDF_PAGES = 2  # the first pages of the book in the PDF test (`make pdf` prints every page;
# the browser test above checks every page's math, figures and links on the site)


def pdf_text(text: str) -> str:
    """Text as the PDF test compares it: ligatures unfolded (ﬁ: fi), no whitespace."""
    return re.sub(r"\s+", "", unicodedata.normalize("NFKC", text))


def book_pdf_module(monkeypatch):
    """_ext/book_pdf.py, loaded by its path (its dataclass looks its module up by name)."""
    spec = importlib.util.spec_from_file_location("book_pdf", ROOT / "_ext" / "book_pdf.py")
    book_pdf = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "book_pdf", book_pdf)
    spec.loader.exec_module(book_pdf)
    return book_pdf


def test_the_pdf_prints_the_pages_of_the_toc_in_order(monkeypatch, tmp_path):
    """The PDF's printer knows _toc.yml's pages in reading order (sections after their
    chapter) and refuses, naming the difference, pages that are not exactly those: one
    missing, one added, two swapped."""
    book_pdf = book_pdf_module(monkeypatch)
    assert book_pdf.toc_pages(ROOT / "_toc.yml") == toc_files()
    nested = tmp_path / "_toc.yml"
    nested.write_text(
        "format: jb-book\nroot: intro\nchapters:\n- file: a.md\n  sections:\n"
        "  - file: a/one\n  - file: a/two\n- file: b\n"
    )
    pages = ["intro", "a", "a/one", "a/two", "b"]
    assert book_pdf.toc_pages(nested) == pages
    book_pdf.check_order(pages, pages)
    book_pdf.check_order(pages[:2], pages[:2])  # `--pages 2`
    for printed, says in (
        (pages[:-1], "missing ['b']"),
        ([*pages, "c"], "unexpected ['c']"),
        (["intro", "a/one", "a", "a/two", "b"], "first difference at page 2"),
    ):
        with pytest.raises(RuntimeError, match=re.escape(says)):
            book_pdf.check_order(printed, pages)
    nested.write_text("format: jb-book\nroot: intro\nchapters:\n- glob: book/*\n")
    with pytest.raises(ValueError, match="glob"):
        book_pdf.toc_pages(nested)


@pytest.mark.notebook
def test_the_book_prints_to_a_pdf(smoke_book, tmp_path, monkeypatch):
    """`make pdf`'s printer (_ext/book_pdf.py) on the smoke build's first pages: they come in
    reading order, each from a new page with its outline entry; the PDF's text holds each
    page's figure captions and citations and, on a page with displayed equations, at least
    one of them as MathJax typeset it (the others differ only in the order in which the
    text of a fraction or a sum is read back); its links to pages of the book lead to the
    published site, none to the local server it was printed from."""
    from pypdf import PdfReader

    returncode, log, html = smoke_book
    assert returncode == 0, "the book did not build (see test_book_builds_without_warnings)"
    book_pdf = book_pdf_module(monkeypatch)
    out = tmp_path / "book.pdf"
    printed = book_pdf.build_pdf(html, out, tmp_path / "profile", limit=PDF_PAGES)
    reader = PdfReader(out)

    pages = toc_files()[:PDF_PAGES]
    assert [urlsplit(p.url).path for p in printed] == [f"/{f}.html" for f in pages]
    assert all(p.count >= 1 for p in printed)
    assert [p.first for p in printed] == [
        sum(q.count for q in printed[:i]) for i in range(len(pages))
    ]
    assert len(reader.pages) == sum(p.count for p in printed)
    outline = [(o.title, reader.get_destination_page_number(o)) for o in reader.outline]
    assert outline == [(p.title, p.first) for p in printed]
    for p in printed:
        text = pdf_text("".join(page.extract_text() for page in reader.pages[p.first :][: p.count]))
        missing = [c for c in p.captions + p.citations if pdf_text(c) not in text]
        assert not missing, f"{p.title}: not in the PDF's text: {missing}"
        if p.equations:
            assert any(pdf_text(e) in text for e in p.equations), (p.title, p.equations)
    shown = {k: sum(len(getattr(p, k)) for p in printed) for k in ("captions", "citations")}
    assert shown["captions"] >= 1 and shown["citations"] >= 1, shown  # the checks above ran
    assert sum(bool(p.equations) for p in printed) >= 1
    # numbered figures: "Fig. N" then the caption, as on the site
    assert all(re.match(r"Fig\.\s*\d+", c) for p in printed for c in p.captions)

    uris = [
        annotation.get_object()["/A"].get("/URI", "")
        for page in reader.pages
        for annotation in page.get("/Annots", [])
        if "/A" in annotation.get_object()
    ]
    site = yaml.safe_load((ROOT / "_config.yml").read_text())["html"]["baseurl"]
    assert not [u for u in uris if u.startswith("http://127.0.0.1")]
    assert any(u.startswith(site) and ".html" in u for u in uris), uris[:20]
