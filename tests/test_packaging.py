"""lsdl_lab installs with pip without touching an installed torch (Colab keeps its own)."""

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_dependencies_are_ranges_not_pins():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for dep in project["dependencies"]:
        assert "==" not in dep and ">=" in dep, dep
    assert any(d.startswith("torch>=") for d in project["dependencies"])


def pip_dry_run(target: str) -> list[str]:
    # --no-index: nothing may come from a registry; the installed torch must satisfy the range.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--no-index",
            "--no-build-isolation",
            "--quiet",
            "--report",
            "-",
            target,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    return [item["metadata"]["name"].lower() for item in report["install"]]


def test_pip_install_keeps_the_installed_torch():
    assert pip_dry_run(str(ROOT)) == ["lsdl_lab"]


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_pip_install_from_a_git_url():
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    if head.returncode != 0:
        pytest.skip("the checkout has no commit yet")
    # the form of the labs' install cell: pip install git+https://github.com/...
    assert pip_dry_run(f"git+file://{ROOT}") == ["lsdl_lab"]


def source_files() -> list[str]:
    """The checkout's files as git sees them, relative to the root: tracked (as they are in
    the working tree, edits included, deletions left out) and untracked but not ignored (a
    module not yet added); not the ignored ones (a stale ``build/``, caches)."""
    proc = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"git ls-files failed: {proc.stderr.strip()[:200]}")
    return sorted({name for name in proc.stdout.split("\0") if (ROOT / name).is_file()})


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_the_wheel_holds_every_module_and_nothing_else(tmp_path):
    """A regular (non-editable) install, as in Colab, holds exactly the package's modules.
    The wheel is built from a copy of the checkout's files alone: built in the checkout,
    setuptools would also pack whatever an ignored, stale ``build/lib`` holds (modules
    since removed or renamed)."""
    source, out = tmp_path / "source", tmp_path / "wheel"
    for name in source_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "-w",
            str(out),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = out.glob("lsdl_lab-*.whl")
    packed = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("lsdl_lab/")}
    packed = {n for n in packed if n.endswith(".py")}
    tree = {str(p.relative_to(source)) for p in (source / "lsdl_lab").rglob("*.py")}
    assert len(tree) > 50 and "lsdl_lab/optim/adam.py" in tree
    assert packed == tree, (
        f"in the wheel, not in the tree: {sorted(packed - tree)}; "
        f"in the tree, not in the wheel: {sorted(tree - packed)}"
    )


def test_every_module_is_reachable_as_an_attribute():
    import lsdl_lab

    for path in (ROOT / "lsdl_lab").iterdir():
        name = path.stem
        if name.startswith("_") or not (path.suffix == ".py" or (path / "__init__.py").exists()):
            continue
        assert getattr(lsdl_lab, name).__name__ == f"lsdl_lab.{name}"


def test_the_declared_torch_floor_is_the_tested_one():
    """pyproject.toml's ``torch>=X.Y`` is the torch that `make test` runs the library's tests
    and the labs on (tests/floor-requirements.txt pins a release of X.Y)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (floor,) = [d.removeprefix("torch>=") for d in project["dependencies"] if "torch" in d]
    pins = [
        line.split("==")[1].strip()
        for line in (ROOT / "tests" / "floor-requirements.txt").read_text().splitlines()
        if line.startswith("torch==")
    ]
    assert len(pins) == 1 and pins[0].split(".")[:2] == floor.split("."), (floor, pins)
