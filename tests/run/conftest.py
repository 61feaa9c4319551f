"""One spawned world of 2 runs every world-2 configuration of run_workers.WORLD2 once per
test session; the tests read its records and checkpoints."""

import sys
from pathlib import Path

import pytest

# The spawned ranks import the worker by module name from this folder.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_workers import run_all  # noqa: E402

from lsdl_lab.distributed import spawn  # noqa: E402


@pytest.fixture(scope="session")
def world2(tmp_path_factory):
    root = tmp_path_factory.mktemp("world2")
    results = spawn(run_all, 2, str(root), timeout=60)
    return root, results
