"""Bundled example datasets, written from installed packages on first use (no downloads).

One per built-in task: digits as a table, as 1 x 8 x 8 images and as a folder of PNGs,
scikit-learn's diabetes data for regression, and the Python standard library's own source
for language models.
"""

from __future__ import annotations

from pathlib import Path

from trainyard.data.tables import write_diabetes, write_digits
from trainyard.datasets.images import write_digits_images, write_digits_png
from trainyard.datasets.tokens import build_stdlib_corpus

STDLIB_CORPUS_BYTES = 2_000_000  # a few minutes of CPU training sees all of it


def write_stdlib_corpus(path: Path) -> None:
    build_stdlib_corpus(path, STDLIB_CORPUS_BYTES)


BUNDLED = {
    "data/raw/digits.csv": write_digits,
    "data/raw/diabetes.csv": write_diabetes,
    "data/raw/digits.npz": write_digits_images,
    "data/raw/digits-png": write_digits_png,
    "data/raw/stdlib.txt": write_stdlib_corpus,
}
