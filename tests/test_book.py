"""The book builds, with every page and lab executed at the smoke profile, without warnings.

`jupyter-book build -W` turns every Sphinx warning into an error: a cell that raises, a
broken cross-reference, a citation missing from references.bib, a duplicate label.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

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
    ):
        text = (html / f"{f}.html").read_text()
        assert re.search(r'<img[^>]+src="[^"]*_images/[^"]+\.png"', text), f"no figure in {f}"
    lab = (html / "labs/lab01_getting_started.html").read_text()
    assert "colab.research.google.com" in lab  # the launch button


@pytest.mark.notebook
def test_a_cell_that_raises_fails_the_build(tmp_path):
    """The project's own _config.yml, on a one-page book whose cell raises."""
    (tmp_path / "_config.yml").write_text((ROOT / "_config.yml").read_text())
    for folder in ("_ext", "_static"):  # the config's local extension and favicon
        shutil.copytree(ROOT / folder, tmp_path / folder)
    (tmp_path / "_toc.yml").write_text("format: jb-book\nroot: page\n")
    (tmp_path / "references.bib").write_text("")
    (tmp_path / "page.md").write_text(
        "---\njupytext:\n  text_representation:\n    extension: .md\n    format_name: myst\n"
        "kernelspec:\n  display_name: Python 3\n  language: python\n  name: python3\n---\n"
        "# A page\n\n```{code-cell} ipython3\nraise ValueError('this cell fails')\n```\n"
    )
    proc = subprocess.run(
        [str(JB), "build", str(tmp_path), "-W"], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode != 0
    assert "this cell fails" in proc.stdout + proc.stderr


ARTIFACTS = ROOT / "_build" / "test-artifacts"
SCREENSHOTS = ("intro", "book/ch05_generalization_gap", "labs/lab03_optimizers")
SEARCH_TERM, SEARCH_HIT = "momentum", "ch03_optimizers"  # a page the search must list
MIN_MATH_PAGES = 5  # so that the math checks cannot pass by finding no math
COLAB = re.compile(r"^https://colab\.research\.google\.com/github/([^/]+/[^/]+)/blob/main/(.+)$")

# JavaScript: the output images of every cell that calls a widget explorer (`*_explorer(`)
EXPLORER_FIGURES_JS = """
return [...document.querySelectorAll('.cell')]
    .filter(c => /_explorer\\(/.test((c.querySelector('.cell_input') || {}).textContent || ''))
    .map(c => [...c.querySelectorAll('.cell_output img')].map(i => i.naturalWidth));
"""


@pytest.mark.notebook
def test_site_in_headless_chromium(smoke_book, tmp_path):
    """The smoke build in a real browser, offline: every page loads with no console error,
    its math renders with the site's own MathJax, its images load, its Colab links open
    notebooks of the repository; search finds a term; exercise solutions are hidden until
    clicked; widget explorers show a static figure. Screenshots go to _build/test-artifacts."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    from site_browser import browser_paths, chromium, console_errors, page_state, serve

    returncode, log, html = smoke_book
    assert returncode == 0, "the book did not build (see test_book_builds_without_warnings)"
    try:
        browser_paths()
    except RuntimeError as missing:  # never a silent skip: say what to install
        pytest.fail(str(missing))
    repo = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    problems, math_pages, explorers = [], 0, 0
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
            for widths in browser.execute_script(EXPLORER_FIGURES_JS):
                explorers += 1
                if not widths or not all(w > 0 for w in widths):
                    problems.append(f"{page}: a widget explorer shows no static figure")
            if page in SCREENSHOTS:
                browser.save_screenshot(str(ARTIFACTS / f"{page.replace('/', '_')}.png"))

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
    print(f"screenshots of {', '.join(SCREENSHOTS)} in {ARTIFACTS}")
    assert not problems, "\n".join(problems)
    assert math_pages >= MIN_MATH_PAGES and explorers >= 1  # the checks above did run
    assert all((ARTIFACTS / f"{p.replace('/', '_')}.png").stat().st_size > 0 for p in SCREENSHOTS)
