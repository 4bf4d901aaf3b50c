"""Pass 2's checks and sums over a streamed table: every feature value checked as read_table
checks it, naming the same rows, and the training rows' moments merged chunk by chunk."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from trainyard.data.table_chunks import ChunkedTable, Offenders
from trainyard.data.tables import where_in_file
from trainyard.errors import DataError

if TYPE_CHECKING:
    # Imported where used: the split and preflight read tables; workers read the arrays.
    import pandas as pd


class FeatureChecks:
    """tables._check_features, chunk by chunk: per column, whether any chunk held something
    other than numbers, and which rows are missing, NaN or infinite."""

    def __init__(self, columns: list[str]) -> None:
        self.columns = columns
        self.not_numeric = [False] * len(columns)
        self.not_finite = [Offenders() for _ in columns]
        self.failed = False

    def add(self, first: int, frame: pd.DataFrame) -> np.ndarray | None:
        """The chunk's features as float64; None once anything in the file was wrong."""
        numeric = [_is_number(frame[column].dtype) for column in self.columns]
        kept = [j for j, ok in enumerate(numeric) if ok]
        block = frame[[self.columns[j] for j in kept]].to_numpy(dtype=np.float64)
        finite = np.isfinite(block)
        for k in np.flatnonzero(~finite.all(axis=0)):
            self.not_finite[kept[k]].add(first + np.flatnonzero(~finite[:, k]))
        for j, ok in enumerate(numeric):
            self.not_numeric[j] = self.not_numeric[j] or not ok
        self.failed = self.failed or len(kept) < len(numeric) or not finite.all()
        return None if self.failed else block

    def raise_first(self, table: ChunkedTable) -> None:
        if not self.columns:
            raise DataError(f"{table.path}: no feature columns besides the label")
        for j, column in enumerate(self.columns):
            if self.not_numeric[j]:
                raise _not_numeric(table, column)
            if self.not_finite[j]:
                raise DataError(
                    f"{table.path}: feature column '{column}' has missing, NaN or infinite "
                    f"values at {where_in_file(table.path, self.not_finite[j])}"
                )


def _is_number(dtype) -> bool:
    import pandas as pd

    return pd.api.types.is_numeric_dtype(dtype) and not pd.api.types.is_bool_dtype(dtype)


def _not_numeric(table: ChunkedTable, column: str) -> DataError:
    """read_table's message for a column that is not numeric, from one more pass over that
    column alone. A CSV column is re-read as text because its chunks' types are not the
    whole file's: pandas keeps every value of a mixed column as written (so 'True' beside
    numbers is bad), but a column of only true/false words, any case, becomes booleans,
    which read_table names no rows for."""
    import pandas as pd

    bad, only_words = Offenders(), True
    examples: list[object] = []
    for first, frame in table.chunks([column], text=[column]):
        values = frame[column]
        present = values.notna()
        if not table.parquet:
            words = values[present].str.lower().isin(["true", "false"])
            only_words = only_words and bool(words.all())
        rows = np.flatnonzero((pd.to_numeric(values, errors="coerce").isna() & present).to_numpy())
        bad.add(first + rows)
        examples += [values.iloc[r] for r in rows[: 2 - len(examples)]]
    if only_words and not table.parquet:
        bad, examples = Offenders(), []
    shown = ", ".join(repr(v) for v in examples)
    return DataError(
        f"{table.path}: feature column '{column}' is not numeric ({shown} at "
        f"{where_in_file(table.path, bad)}); features must be numbers"
    )


class Moments:
    """Mean and variance per column, merged chunk by chunk (Chan et al.): each chunk's own
    are computed two-pass, so a large mean does not cancel a small variance."""

    def __init__(self, width: int) -> None:
        self.count = 0
        self.mean = np.zeros(width)
        self.m2 = np.zeros(width)

    def add(self, block: np.ndarray) -> None:
        if not len(block):
            return
        mean = block.mean(axis=0)
        m2 = ((block - mean) ** 2).sum(axis=0)
        total = self.count + len(block)
        delta = mean - self.mean
        self.mean += delta * (len(block) / total)
        self.m2 += m2 + delta**2 * (self.count * len(block) / total)
        self.count = total

    def std(self) -> np.ndarray:
        return np.sqrt(self.m2 / max(self.count, 1))
