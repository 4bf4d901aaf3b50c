"""Reading the user's table (CSV or Parquet) and writing the bundled default dataset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from trainyard.errors import DataError


def read_table(path: Path, label_column: str) -> pd.DataFrame:
    """Load a table of numeric feature columns plus one label column (read as text)."""
    if not path.is_file():
        raise DataError(f"{path}: dataset file not found; set data.path in params.yaml")
    try:
        if path.suffix.lower() == ".parquet":
            frame = pd.read_parquet(path)
            if label_column in frame.columns:
                frame[label_column] = frame[label_column].astype(str)
        else:
            frame = pd.read_csv(path, dtype={label_column: str})
    except Exception as exc:  # pandas and pyarrow raise many types for unreadable files
        raise DataError(f"{path}: cannot read as {path.suffix[1:]} ({exc})") from None
    if label_column not in frame.columns:
        raise DataError(
            f"{path}: no label column '{label_column}' (columns: {', '.join(map(str, frame.columns[:10]))}); "
            "set data.label_column in params.yaml"
        )
    features = frame.drop(columns=[label_column])
    non_numeric = [
        str(c) for c in features.columns if not pd.api.types.is_numeric_dtype(features[c])
    ]
    if non_numeric:
        raise DataError(f"{path}: feature columns must be numeric, not {', '.join(non_numeric)}")
    return frame


def write_digits(path: Path) -> None:
    """scikit-learn's bundled handwritten digits (1,797 8x8 images) as a CSV, byte-stable."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    header = ",".join([f"pixel_{i}" for i in range(digits.data.shape[1])] + ["label"])
    table = np.column_stack([digits.data.astype(np.int64), digits.target.astype(np.int64)])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    np.savetxt(tmp, table, fmt="%d", delimiter=",", header=header, comments="")
    tmp.replace(path)
