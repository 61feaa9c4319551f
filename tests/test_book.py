"""The book builds, with every page and lab executed at the smoke profile, without warnings.

`jupyter-book build -W` turns every Sphinx warning into an error: a cell that raises, a
broken cross-reference, a citation missing from references.bib, a duplicate label.
"""

import os
import re
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


@pytest.mark.notebook
def test_book_builds_without_warnings(tmp_path):
    env = dict(os.environ, LSDL_SCALE="smoke", TQDM_DISABLE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [str(JB), "build", str(ROOT), "--path-output", str(tmp_path), "-W", "--keep-going"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    html = tmp_path / "_build" / "html"
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
