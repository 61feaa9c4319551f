"""Side-by-side benchmarks of lsdl_lab against the references; see README.md."""

from pathlib import Path

# The repository's root: results, labs and the book are found from it.
ROOT = Path(__file__).resolve().parents[1]
