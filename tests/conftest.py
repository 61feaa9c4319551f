"""Shared test setup: one torch thread per worker, the smoke profile, no progress bars."""

import os

os.environ.setdefault("LSDL_SCALE", "smoke")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


import pytest
import torch

# On a shared 2-core machine a small model's step is ~100x slower with 2 intra-op
# threads while another worker runs (FACTS.md); every test worker uses one.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _uncapped(monkeypatch):
    """No test inherits the dry run's caps (lsdl_lab.profiles) from the shell: a test that
    needs every step it asks for would stop short (on a GPU machine where LSDL_MAX_STEPS=2
    was still exported, Landscape's sign ascent stopped two steps in, short of the box's
    corner, and its test failed). A test of the caps sets them itself."""
    monkeypatch.delenv("LSDL_MAX_STEPS", raising=False)
    monkeypatch.delenv("LSDL_MAX_EXAMPLES", raising=False)


# Every device this machine has: the CPU, and CUDA where present. A test that touches
# tensors takes the `device` fixture and makes its tensors and models there, so on a GPU
# machine its CUDA half runs with no change (the CPU-only CI runs the CPU half). The
# library must make its own tensors on the device of the data they meet; a CPU tensor
# meeting a CUDA one fails the CUDA half.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES, scope="session")
def device(request) -> torch.device:
    """The device of this run of the test: ``cpu``, then ``cuda`` where present (session
    scope: hypothesis refuses function-scoped fixtures, and a device never changes)."""
    return torch.device(request.param)
