"""The run's metrics log: one JSON object per line (JSON Lines), written by rank 0.

Each record is one logging point, ``log_every`` steps apart::

    {"step": 20, "loss": 1.93, "lr": 0.00098, "time_s": 4.1, "step_time_s": 0.2,
     "examples_per_s": 320.5, "world_size": 2, "parallel": "ddp",
     "bytes_sent": [81920, 81920], "bytes_per_step": [4096.0, 4096.0],
     "memory": [{"params": ..., "grads": ..., "optimizer_state": ..., "total": ...}, ...]}

``step`` counts the optimizer steps done; ``loss`` is the mean training loss over the
global batches of the steps since the previous record (with ``log_every: 1``, the loss of
that one step, before its update); ``lr`` the learning rate of the record's last step;
``examples_per_s`` the global examples (tokens for a language model) per second of
compute since the previous record; ``bytes_sent[r]`` the bytes rank r has handed to the
collectives of gradients and parameters since the start of the run (those of a resumed
run start at its checkpoint), ``bytes_per_step`` the same per step since the previous
record; ``memory[r]`` the bytes rank r holds by category
(:func:`lsdl_lab.memory.measure`), with ``cuda_max_allocated`` where there is a GPU;
``loss_scale`` when the loss scaler runs. A run resumed from a checkpoint first drops the
records after the checkpoint's step, so the log reads as one uninterrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path

from .._util import atomic_path

__all__ = ["MetricsLog", "read_metrics"]


def read_metrics(path) -> list[dict]:
    """The records of a metrics log, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class MetricsLog:
    """Appends records to ``path`` (when ``active``: rank 0), after dropping those past
    step ``start``."""

    def __init__(self, path, active: bool, start: int):
        self.path, self.active = Path(path), active
        if not active:
            return
        kept = []
        if start and self.path.exists():
            kept = [r for r in read_metrics(self.path) if r["step"] <= start]
        with atomic_path(self.path) as tmp, open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)

    def write(self, record: dict) -> None:
        """Append ``record`` as one line (rank 0; the other ranks' logs write nothing)."""
        if self.active:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
