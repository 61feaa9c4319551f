"""lsdl_lab installs with pip without touching an installed torch (Colab keeps its own)."""

import json
import subprocess
import sys
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


def test_the_wheel_holds_every_module(tmp_path):
    """A regular (non-editable) install, as in Colab, must include every subpackage."""
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
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("lsdl_lab-*.whl")
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    for path in (ROOT / "lsdl_lab").rglob("*.py"):
        assert str(path.relative_to(ROOT)) in names, path


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
