"""Pass 1 of a streamed table: the label column alone, kept as one small number per row (a
class id into the sorted classes, or a value), with read_table's checks and words."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from trainyard.data.table_chunks import ChunkedTable, Offenders, no_rows
from trainyard.data.tables import _names, _number, _refuse_continuous, where_in_file
from trainyard.errors import DataError

if TYPE_CHECKING:
    # Imported where used: the split and preflight read tables; workers read the arrays.
    import pandas as pd


@dataclass(frozen=True)
class Labels:
    rows: int
    classes: list[str]  # sorted canonical labels; empty for values
    ids: np.ndarray | None  # int32 per row: index into classes
    values: np.ndarray | None  # float64 per row: a numeric target


def read_labels(table: ChunkedTable, target: str) -> Labels:
    try:
        return _label_pass(table, target)
    except DataError:
        # read_table parses the whole file before it looks at a column: a malformed line
        # anywhere, or a file without rows, is what it reports.
        if table.scan() == 0:
            raise no_rows(table.path) from None
        raise


def _label_pass(table: ChunkedTable, target: str) -> Labels:
    if table.label not in table.columns:
        close = difflib.get_close_matches(table.label, [str(c) for c in table.columns], n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise DataError(
            f"{table.path}: no label column '{table.label}'{hint} "
            f"(columns: {_names(table.columns)}); set data.label_column in params.yaml"
        )
    reader = _ClassReader() if target == "class" else _ValueReader()
    missing, rows = Offenders(), 0
    for first, frame in table.chunks([table.label]):
        labels = frame[table.label]
        missing.add(first + np.flatnonzero(labels.isna().to_numpy()))
        reader.add(first, labels)
        rows = first + len(labels)
    if rows == 0:
        raise no_rows(table.path)
    if missing:
        raise DataError(
            f"{table.path}: column '{table.label}' has empty labels at "
            f"{where_in_file(table.path, missing)}"
        )
    return reader.finish(table, rows)


class _ClassReader:
    """Labels as codes of their distinct spellings, in order of first appearance (the order
    tables.class_labels sees them in)."""

    def __init__(self) -> None:
        self.spellings: dict[str, int] = {}
        self.codes: list[np.ndarray] = []

    def add(self, first: int, labels: pd.Series) -> None:
        import pandas as pd

        codes, uniques = pd.factorize(labels.astype(str))
        known = [self.spellings.setdefault(text, len(self.spellings)) for text in uniques]
        lookup = np.array([*known, -1], dtype=np.int32)  # code -1 (a missing label) stays -1
        self.codes.append(lookup[codes])

    def finish(self, table: ChunkedTable, rows: int) -> Labels:
        """tables.class_labels, applied to the distinct spellings instead of every row."""
        spelled = {text: _number(text) for text in self.spellings}
        numbers = {text: number for text, number in spelled.items() if number is not None}
        if len(numbers) < len(spelled):
            canonical = {text: text for text in spelled}
        elif all(number.is_integer() and abs(number) < 2**53 for number in numbers.values()):
            canonical = {text: str(int(number)) for text, number in numbers.items()}
        else:
            canonical = {text: repr(number) for text, number in numbers.items()}
            _refuse_continuous(table.path, table.label, canonical, numbers, rows)
        classes = sorted(set(canonical.values()))
        position = {label: i for i, label in enumerate(classes)}
        lookup = np.array([position[canonical[text]] for text in spelled], dtype=np.int32)
        return Labels(rows, classes, lookup[np.concatenate(self.codes)], None)


class _ValueReader:
    """tables.numeric_target, chunk by chunk."""

    def __init__(self) -> None:
        self.values: list[np.ndarray] = []
        self.bad = Offenders()
        self.example: object = None  # the first bad label as written

    def add(self, first: int, labels: pd.Series) -> None:
        import pandas as pd

        numbers = pd.to_numeric(labels, errors="coerce")
        values = numbers.to_numpy(dtype="float64", na_value=np.nan)
        bad = np.flatnonzero(~np.isfinite(values))
        if len(bad) and not self.bad:
            self.example = labels.iloc[bad[0]]
        self.bad.add(first + bad)
        self.values.append(values)

    def finish(self, table: ChunkedTable, rows: int) -> Labels:
        if self.bad:
            raise DataError(
                f"{table.path}: the regression target '{table.label}' is not a finite number at "
                f"{where_in_file(table.path, self.bad)} (e.g. {self.example!r}); fix those rows"
            )
        return Labels(rows, [], None, np.concatenate(self.values))
