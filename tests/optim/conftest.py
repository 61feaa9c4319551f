"""The optimizer tests share optim_helpers.py (this folder), imported as ``optim_helpers``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
