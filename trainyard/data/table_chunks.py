"""A CSV or Parquet table read a chunk at a time, with read_table's checks and words: what
the streaming split (trainyard.data.table_writer), preflight's summary and batch inference
read tables through. Memory holds one chunk, never the table."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from trainyard.data.tables import SHOWN, _check_csv_header, _names, check_line_lengths
from trainyard.errors import DataError

if TYPE_CHECKING:
    # Imported where used: the split and preflight read tables; workers read the arrays.
    import pandas as pd

CHUNK_BYTES = 16 << 20  # a chunk parsed to float64 stays near this, however wide the table


@dataclass(frozen=True)
class ChunkedTable:
    path: Path
    label: str
    columns: list[str]  # as read_table's frame has them (Parquet: without pandas' index)
    chunk_rows: int
    num_rows: int | None  # Parquet's, from its footer; a CSV is counted by reading it
    sep: str = ","  # a CSV's separator, as its header line is written (tables.csv_separator)
    ignored: tuple[str, ...] = ()  # data.ignore_columns: neither features nor the label

    @property
    def parquet(self) -> bool:
        return self.path.suffix.lower() == ".parquet"

    @property
    def features(self) -> list[str]:
        return [str(c) for c in self.columns if c != self.label and str(c) not in self.ignored]

    def chunks(
        self, columns: list[str] | None = None, text: Sequence[str] = ()
    ) -> Iterator[tuple[int, pd.DataFrame]]:
        """(first row, frame) per chunk; `text` columns are read as written, not parsed."""
        frames = self._parquet(columns) if self.parquet else self._csv(columns, text)
        first = 0
        while True:
            try:
                frame = next(frames)
            except StopIteration:
                return
            except Exception as exc:  # pandas and pyarrow raise many types for unreadable files
                raise _unreadable(self.path, exc) from None
            yield first, frame
            first += len(frame)

    def _csv(self, columns: list[str] | None, text: Sequence[str]) -> Iterator[pd.DataFrame]:
        import pandas as pd

        dtype = dict.fromkeys([self.label, *text], str)  # read_table reads labels as text
        with pd.read_csv(
            self.path,
            sep=self.sep,
            chunksize=self.chunk_rows,
            dtype=dtype,
            keep_default_na=True,
            usecols=columns,
        ) as reader:
            yield from reader

    def _parquet(self, columns: list[str] | None) -> Iterator[pd.DataFrame]:
        import pyarrow.parquet as pq  # only Parquet tables pay for importing it

        with pq.ParquetFile(self.path) as parquet:
            for batch in parquet.iter_batches(self.chunk_rows, columns=columns or self.columns):
                yield batch.to_pandas()

    def scan(self) -> int:
        """The rows, after parsing every line of a CSV as read_table does, so that a malformed
        line raises here (reading some columns only, pandas does not count a line's fields)."""
        if self.num_rows is not None:
            return self.num_rows
        rows = 0
        for first, frame in self.chunks():
            rows = first + len(frame)
        return rows


def open_table(
    path: Path, label: str, chunk_rows: int, ignored: Sequence[str] = ()
) -> ChunkedTable:
    """read_table's checks that need no rows, in its order; `ignored` columns (which must be
    there) are neither features nor the label."""
    if not path.is_file():
        raise DataError(f"{path}: dataset file not found; set data.path in params.yaml")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: the file is empty; expected a header and rows")
    sep = ","
    if path.suffix.lower() == ".parquet":
        columns, rows = _parquet_columns(path)
    else:
        check_line_lengths(path)  # before any parser holds a line
        sep = _check_csv_header(path)
        columns, rows = _csv_columns(path, label, sep), None
    duplicated = [name for name, n in Counter(map(str, columns)).items() if n > 1]
    if duplicated:
        raise DataError(f"{path}: column name {duplicated[0]!r} appears more than once; rename one")
    absent = [name for name in ignored if name not in map(str, columns)]
    if absent:
        raise DataError(
            f"{path}: no column {absent[0]!r} to ignore (columns: {_names(columns)}); fix "
            "data.ignore_columns"
        )
    chunk = max(1, min(chunk_rows, CHUNK_BYTES // (8 * max(1, len(columns)))))
    return ChunkedTable(path, label, columns, chunk, rows, sep, tuple(ignored))


def _csv_columns(path: Path, label: str, sep: str) -> list[str]:
    import pandas as pd

    try:
        header = pd.read_csv(path, sep=sep, nrows=0, dtype={label: str}, keep_default_na=True)
        return list(header.columns)
    except Exception as exc:  # as in ChunkedTable.chunks
        raise _unreadable(path, exc) from None


def _parquet_columns(path: Path) -> tuple[list[str], int]:
    import pyarrow.parquet as pq

    try:
        with pq.ParquetFile(path) as parquet:
            schema, rows = parquet.schema_arrow, parquet.metadata.num_rows
    except Exception:
        raise _parquet_open_error(path) from None
    # pandas turns its stored index back into the frame's index, not into a column.
    index = (schema.pandas_metadata or {}).get("index_columns", [])
    hidden = {name for name in index if isinstance(name, str)}
    return [name for name in schema.names if name not in hidden], rows


def _parquet_open_error(path: Path) -> DataError:
    """read_table's words: pandas names the source in its message. A file whose footer
    cannot be read fails before any data is read, so this costs no memory."""
    import pandas as pd

    try:
        pd.read_parquet(path)
    except Exception as exc:
        return _unreadable(path, exc)
    return DataError(f"{path}: cannot read as Parquet")


def _unreadable(path: Path, exc: Exception) -> DataError:
    kind = "Parquet" if path.suffix.lower() == ".parquet" else "CSV"
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return DataError(f"{path}: cannot read as {kind} ({reason})")


def no_rows(path: Path) -> DataError:
    return DataError(f"{path}: has a header but no rows")


class Offenders:
    """The first rows with a problem and how many there are: all a message names. It serves
    as the `index` of tables.where_in_file, which reads index[:SHOWN] and len(index)."""

    def __init__(self) -> None:
        self.first: list[int] = []
        self.count = 0

    def add(self, rows: np.ndarray) -> None:
        self.count += len(rows)
        self.first.extend(int(r) for r in rows[: SHOWN - len(self.first)])

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, key):
        return self.first[key]
