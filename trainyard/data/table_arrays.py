"""Tables bigger than memory: a streaming train/val/test split into memory-mapped arrays.

`split_table_to_arrays` reads a CSV or Parquet table in chunks, twice. Pass 1 reads only the
label column, kept as one small number per row, and makes the split `prepare_splits` makes
(same stratification, same seed, so the same rows land in train, val and test). Pass 2 reads
the features and appends every row, in file order, to its split's `{split}_x.npy` (float32),
summing the training rows' moments on the way. Beside them go `{split}_y.npy` (int64 class
ids into the sorted classes, or float64 values) and `{split}_order.npy`: row k of a split as
`prepare_splits` orders it is row order[k] of these arrays, so index k reads the same row from
`TableArrays` as from `trainyard.data.tensors.load_split`, and a seeded run sees the same
batches. Memory holds a chunk and a few numbers per row, never the table.

Every problem is the DataError `read_table`, `check_stratifiable` and preflight's single-class
check raise for the same file, naming the same rows, wherever in the file they sit.
"""

from __future__ import annotations

import difflib
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Literal

import numpy as np
import torch

from trainyard.config import SplitConfig
from trainyard.data.tables import (
    SHOWN,
    _check_csv_header,
    _names,
    _number,
    _refuse_continuous,
    check_line_lengths,
    where_in_file,
)
from trainyard.data_spec import DataSpec
from trainyard.datasets.base import MapDataset, as_rows
from trainyard.errors import DataError

if TYPE_CHECKING:
    # Imported where used: the split and preflight read tables; workers read the arrays.
    import pandas as pd

SPLITS = ("train", "val", "test")
CHUNK_BYTES = 16 << 20  # a chunk parsed to float64 stays near this, however wide the table
# A split whose features take at most this is memory-mapped; a larger one is read by rows.
MAP_BYTES = 64 << 20


@dataclass(frozen=True)
class TableSplit:
    """What the split learned. The field names are SplitSchema's, so
    `SplitSchema(**asdict(table_split))` describes the same split."""

    label_column: str
    feature_columns: list[str]
    classes: list[str]  # sorted; empty for a numeric target
    feature_mean: list[float]  # of the training rows
    feature_std: list[float]  # 1.0 for constant columns
    rows: dict[str, int]
    target: str = "class"
    target_mean: float | None = None  # of a numeric target over the training rows
    target_std: float | None = None

    @property
    def num_outputs(self) -> int:
        return len(self.classes) if self.target == "class" else 1


def split_table_to_arrays(
    source: Path,
    label_column: str,
    target: Literal["class", "value"],
    split: SplitConfig,
    out_dir: Path,
    chunk_rows: int = 65536,
) -> TableSplit:
    """Split `source` as `prepare_splits` does, into arrays in `out_dir` (see the module
    docstring). Files are written under temporary names and renamed when all are complete;
    a failure removes them. `chunk_rows` rows are parsed at a time (fewer for wide tables)."""
    _check_target(target)
    table = _open_table(Path(source), label_column, chunk_rows)
    labels = _read_labels(table, target)
    try:
        assignment, deferred = _assign(table, labels, split, target), None
    except DataError as exc:
        # prepare_splits runs read_table's feature checks before it splits: theirs come first.
        assignment, deferred = None, exc
    writer = _ArrayWriter(Path(out_dir))
    try:
        moments = _stream_features(table, assignment, writer)
        if deferred is not None:
            raise deferred
        _write_labels(writer, labels, assignment)
        writer.commit()
    finally:
        writer.discard()
    return _describe(table, labels, assignment, moments, target)


def table_summary(
    source: Path, label_column: str, target: Literal["class", "value"], chunk_rows: int = 65536
) -> tuple[int, int, int]:
    """(rows, features, what a model predicts: classes or 1) with preflight's checks and
    errors (read_table's, a single class, check_stratifiable's), read in one streaming pass
    over the labels and one over the features."""
    _check_target(target)
    table = _open_table(Path(source), label_column, chunk_rows)
    labels = _read_labels(table, target)
    _stream_features(table, None, None)
    outputs = 1
    if target == "class":
        outputs = len(labels.classes)
        if outputs < 2:
            raise DataError(
                f"{table.path}: column '{label_column}' has a single class; need at least 2"
            )
        _check_stratifiable(table, labels)
    return labels.rows, len(table.features), outputs


def _check_target(target: str) -> None:
    if target not in ("class", "value"):
        raise ValueError(f"target {target!r}: a table's target is 'class' or 'value'")


# --- reading the table in chunks ---------------------------------------------------------


@dataclass(frozen=True)
class _Table:
    path: Path
    label: str
    columns: list[str]  # as read_table's frame has them (Parquet: without pandas' index)
    chunk_rows: int
    num_rows: int | None  # Parquet's, from its footer; a CSV is counted by reading it

    @property
    def parquet(self) -> bool:
        return self.path.suffix.lower() == ".parquet"

    @property
    def features(self) -> list[str]:
        return [str(c) for c in self.columns if c != self.label]

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


def _open_table(path: Path, label: str, chunk_rows: int) -> _Table:
    """read_table's checks that need no rows, in its order."""
    if not path.is_file():
        raise DataError(f"{path}: dataset file not found; set data.path in params.yaml")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: the file is empty; expected a header and rows")
    if path.suffix.lower() == ".parquet":
        columns, rows = _parquet_columns(path)
    else:
        check_line_lengths(path)  # before any parser holds a line
        _check_csv_header(path)
        columns, rows = _csv_columns(path, label), None
    duplicated = [name for name, n in Counter(map(str, columns)).items() if n > 1]
    if duplicated:
        raise DataError(f"{path}: column name {duplicated[0]!r} appears more than once; rename one")
    chunk = max(1, min(chunk_rows, CHUNK_BYTES // (8 * max(1, len(columns)))))
    return _Table(path, label, columns, chunk, rows)


def _csv_columns(path: Path, label: str) -> list[str]:
    import pandas as pd

    try:
        return list(pd.read_csv(path, nrows=0, dtype={label: str}, keep_default_na=True).columns)
    except Exception as exc:  # as in _Table.chunks
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


def _no_rows(path: Path) -> DataError:
    return DataError(f"{path}: has a header but no rows")


class _Offenders:
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


# --- pass 1: labels ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Labels:
    rows: int
    classes: list[str]  # sorted canonical labels; empty for values
    ids: np.ndarray | None  # int32 per row: index into classes
    values: np.ndarray | None  # float64 per row: a numeric target


def _read_labels(table: _Table, target: str) -> _Labels:
    try:
        return _label_pass(table, target)
    except DataError:
        # read_table parses the whole file before it looks at a column: a malformed line
        # anywhere, or a file without rows, is what it reports.
        if table.scan() == 0:
            raise _no_rows(table.path) from None
        raise


def _label_pass(table: _Table, target: str) -> _Labels:
    if table.label not in table.columns:
        close = difflib.get_close_matches(table.label, [str(c) for c in table.columns], n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise DataError(
            f"{table.path}: no label column '{table.label}'{hint} "
            f"(columns: {_names(table.columns)}); set data.label_column in params.yaml"
        )
    reader = _ClassReader() if target == "class" else _ValueReader()
    missing, rows = _Offenders(), 0
    for first, frame in table.chunks([table.label]):
        labels = frame[table.label]
        missing.add(first + np.flatnonzero(labels.isna().to_numpy()))
        reader.add(first, labels)
        rows = first + len(labels)
    if rows == 0:
        raise _no_rows(table.path)
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

    def finish(self, table: _Table, rows: int) -> _Labels:
        """tables.class_labels, applied to the distinct spellings instead of every row."""
        spelled = {text: _number(text) for text in self.spellings}
        if any(number is None for number in spelled.values()):
            canonical = {text: text for text in spelled}
        elif all(number.is_integer() and abs(number) < 2**53 for number in spelled.values()):
            canonical = {text: str(int(number)) for text, number in spelled.items()}
        else:
            canonical = {text: repr(number) for text, number in spelled.items()}
            _refuse_continuous(table.path, table.label, canonical, spelled, rows)
        classes = sorted(set(canonical.values()))
        position = {label: i for i, label in enumerate(classes)}
        lookup = np.array([position[canonical[text]] for text in spelled], dtype=np.int32)
        return _Labels(rows, classes, lookup[np.concatenate(self.codes)], None)


class _ValueReader:
    """tables.numeric_target, chunk by chunk."""

    def __init__(self) -> None:
        self.values: list[np.ndarray] = []
        self.bad = _Offenders()
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

    def finish(self, table: _Table, rows: int) -> _Labels:
        if self.bad:
            raise DataError(
                f"{table.path}: the regression target '{table.label}' is not a finite number at "
                f"{where_in_file(table.path, self.bad)} (e.g. {self.example!r}); fix those rows"
            )
        return _Labels(rows, [], None, np.concatenate(self.values))


# --- the split ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Assignment:
    part: np.ndarray  # int8 per row of the file: its split's position in SPLITS
    picked: dict[str, np.ndarray]  # per split, its rows of the file in prepare_splits' order

    @property
    def rows(self) -> dict[str, int]:
        return {name: len(self.picked[name]) for name in SPLITS}


def _check_stratifiable(table: _Table, labels: _Labels) -> None:
    """split.check_stratifiable on the class ids. value_counts orders tied counts by where
    its (unstable) sort leaves them; counting ids in file order hands it the same counts in
    the same order as counting the labels, so the same class is named."""
    import pandas as pd

    counts = pd.Series(labels.ids).value_counts()
    too_small = counts[counts < 3]
    if not too_small.empty:
        class_id = too_small.index[0]
        rows = np.flatnonzero(labels.ids == class_id)
        raise DataError(
            f"{table.path}: class {labels.classes[class_id]!r} in column '{table.label}' has "
            f"{too_small.iloc[0]} row(s) ({where_in_file(table.path, rows)}); "
            f"a stratified train/val/test split needs at least 3 per class{_regression_hint(table, labels, len(too_small))}"
        )


def _regression_hint(table: _Table, labels: _Labels, rare_classes: int) -> str:
    """A hint when the classes look like measurements rather than categories: every label is
    a number and most classes are too rare to split (a quantity read as one class per value)."""
    try:
        [float(label) for label in labels.classes]
    except (TypeError, ValueError):
        return ""
    if rare_classes * 2 < len(labels.classes):
        return ""
    return (
        f"; column '{table.label}' holds {len(labels.classes)} distinct numbers: if it is a "
        "quantity, use -S task.name=regression"
    )


def _assign(table: _Table, labels: _Labels, split: SplitConfig, target: str) -> _Assignment:
    """prepare_splits' split of the row numbers: it depends only on the row count, the
    strata and the seed. Class ids stratify like the labels because they number the classes
    in sorted order, as np.unique inside sklearn does."""
    import pandas as pd

    if target == "class":
        _check_stratifiable(table, labels)
        strata = labels.ids
    else:
        values = pd.Series(labels.values)
        bins = max(2, min(10, len(values) // 30))
        strata = pd.qcut(values, q=bins, labels=False, duplicates="drop").to_numpy()
    try:
        picked = _split_rows(labels.rows, strata, split)
    except ValueError as exc:
        reason = str(exc)
        if target == "class":  # sklearn's message names classes: ask again with their names
            try:
                _split_rows(labels.rows, np.asarray(labels.classes, object)[labels.ids], split)
            except ValueError as named:
                reason = str(named)
        raise DataError(f"{table.path}: cannot split with these fractions ({reason})") from None
    part = np.empty(labels.rows, dtype=np.int8)
    for code, rows in enumerate(picked):
        part[rows] = code
    return _Assignment(part, dict(zip(SPLITS, picked, strict=True)))


def _split_rows(count: int, strata: np.ndarray, split: SplitConfig) -> tuple[np.ndarray, ...]:
    """prepare_splits' two train_test_split calls, on row numbers instead of the frame."""
    from sklearn.model_selection import train_test_split  # a worker never needs it

    holdout = split.val_fraction + split.test_fraction
    train, rest = train_test_split(
        np.arange(count), test_size=holdout, stratify=strata, random_state=split.seed
    )
    val, test = train_test_split(
        rest,
        test_size=split.test_fraction / holdout,
        stratify=strata[rest],
        random_state=split.seed,
    )
    return train, val, test


# --- pass 2: features --------------------------------------------------------------------


class _FeatureChecks:
    """tables._check_features, chunk by chunk: per column, whether any chunk held something
    other than numbers, and which rows are missing, NaN or infinite."""

    def __init__(self, columns: list[str]) -> None:
        self.columns = columns
        self.not_numeric = [False] * len(columns)
        self.not_finite = [_Offenders() for _ in columns]
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

    def raise_first(self, table: _Table) -> None:
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


def _not_numeric(table: _Table, column: str) -> DataError:
    """read_table's message for a column that is not numeric, from one more pass over that
    column alone. A CSV column is re-read as text because its chunks' types are not the
    whole file's: pandas keeps every value of a mixed column as written (so 'True' beside
    numbers is bad), but a column of only true/false words, any case, becomes booleans,
    which read_table names no rows for."""
    import pandas as pd

    bad, examples, only_words = _Offenders(), [], True
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
        bad, examples = _Offenders(), []
    shown = ", ".join(repr(v) for v in examples)
    return DataError(
        f"{table.path}: feature column '{column}' is not numeric ({shown} at "
        f"{where_in_file(table.path, bad)}); features must be numbers"
    )


class _Moments:
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


def _stream_features(
    table: _Table, assignment: _Assignment | None, writer: _ArrayWriter | None
) -> _Moments:
    """Check every feature value; with an assignment, also write each row to its split.
    Reading goes on past a bad value: the message counts every offending row."""
    checks, moments = _FeatureChecks(table.features), _Moments(len(table.features))
    if assignment is not None and writer is not None:
        writer.open_rows(assignment.rows, len(table.features))
    # A CSV is read whole, not by usecols: pandas checks field counts only of a whole read.
    columns = (table.features or [table.label]) if table.parquet else None
    seen = 0
    for first, frame in table.chunks(columns):
        block = checks.add(first, frame)
        seen = first + len(frame)
        if block is None or assignment is None or writer is None:
            continue
        part = assignment.part[first:seen]
        if len(part) != len(block):
            raise _changed(table.path)
        moments.add(block[part == 0])
        for code, name in enumerate(SPLITS):
            writer.append(name, block[part == code])
    checks.raise_first(table)
    if assignment is not None and seen != len(assignment.part):
        raise _changed(table.path)
    return moments


def _changed(path: Path) -> DataError:
    return DataError(f"{path}: the file changed while it was being split; run again")


# --- writing -----------------------------------------------------------------------------


class _ArrayWriter:
    """A split's .npy files under temporary names, renamed to their own by `commit`; the
    folder never shows a final name over partial data."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.pending: dict[str, Path] = {}  # final name -> temporary file
        self.handles: dict[str, BinaryIO] = {}  # split -> its open x file

    def _start(self, name: str) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.pending[f"{name}.npy"] = path = self.folder / f"{name}.npy.tmp"
        return path

    def open_rows(self, rows: dict[str, int], width: int) -> None:
        # Appended through a file rather than written through open_memmap: pages dirtied
        # through a mapping count in the process's resident memory until unmapped.
        header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.float32))}
        for name in SPLITS:
            handle = open(self._start(f"{name}_x"), "wb")  # noqa: SIM115 (closed by _close)
            self.handles[name] = handle
            shape = {"fortran_order": False, "shape": (rows[name], width)}
            np.lib.format.write_array_header_1_0(handle, header | shape)

    def append(self, name: str, block: np.ndarray) -> None:
        self.handles[name].write(np.ascontiguousarray(block, dtype=np.float32))

    def save(self, name: str, array: np.ndarray) -> None:
        with open(self._start(name), "wb") as handle:
            np.save(handle, array)

    def commit(self) -> None:
        self._close()
        for final, temporary in self.pending.items():
            os.replace(temporary, self.folder / final)
        self.pending.clear()

    def discard(self) -> None:
        self._close()
        for temporary in self.pending.values():
            temporary.unlink(missing_ok=True)
        self.pending.clear()

    def _close(self) -> None:
        for handle in self.handles.values():
            handle.close()
        self.handles.clear()


def _write_labels(writer: _ArrayWriter, labels: _Labels, assignment: _Assignment) -> None:
    for name in SPLITS:
        picked = assignment.picked[name]
        in_file_order = np.sort(picked)
        if labels.ids is not None:
            writer.save(f"{name}_y", labels.ids[in_file_order].astype(np.int64))
        else:
            writer.save(f"{name}_y", labels.values[in_file_order])
        writer.save(f"{name}_order", np.searchsorted(in_file_order, picked))


def _describe(
    table: _Table, labels: _Labels, assignment: _Assignment, moments: _Moments, target: str
) -> TableSplit:
    """split._schema's numbers. The target's are taken in prepare_splits' row order, so
    numpy sums them in the same order and gets the same bits."""
    std = moments.std()
    values = None if labels.values is None else labels.values[assignment.picked["train"]]
    return TableSplit(
        label_column=table.label,
        feature_columns=table.features,
        classes=labels.classes,
        feature_mean=moments.mean.round(8).tolist(),
        feature_std=np.where(std > 1e-12, std, 1.0).round(8).tolist(),
        rows=assignment.rows,
        target=target,
        target_mean=None if values is None else round(float(values.mean()), 8),
        target_std=None if values is None else round(float(max(values.std(), 1e-12)), 8),
    )


# --- reading a split in a worker ---------------------------------------------------------


class TableArrays(MapDataset):
    """One split written by `split_table_to_arrays`, as a worker reads it. `take` returns
    what TensorSplit.take returns for the same indices: float32 features standardized with
    the given statistics, and int64 class ids or (with target_mean/target_std) float32
    standardized values.

    Labels and the row order are loaded (16 bytes a row); the features are not. A split of
    at most `map_bytes` of features is memory-mapped and gathered in one indexing per batch.
    A larger one is read row by row with pread: mapped pages a worker has read stay in its
    resident memory, and on Linux with large page-cache folios one random row maps up to
    2 MB, so a batch of random rows maps the whole file, and releasing pages between batches
    (madvise) cannot bound that. pread leaves the data in the page cache only.

    Pickling sends the paths and statistics; the copy opens the files again. `spec` counts
    classes as `num_classes`, or, if not given, as the highest class id in the split plus one
    (a stratified split has every class in every split)."""

    def __init__(
        self,
        folder: str | Path,
        split_name: str,
        feature_mean: Sequence[float],
        feature_std: Sequence[float],
        target_mean: float | None = None,
        target_std: float | None = None,
        *,
        num_classes: int | None = None,
        map_bytes: int = MAP_BYTES,
    ) -> None:
        self.folder, self.split_name = Path(folder), split_name
        self.mean = torch.tensor(list(feature_mean), dtype=torch.float32)
        self.std = torch.tensor(list(feature_std), dtype=torch.float32)
        self.target_mean, self.target_std = target_mean, target_std
        self.num_classes, self.map_bytes = num_classes, map_bytes
        self._open()

    def _open(self) -> None:
        self._y, self._order = self._load("y"), self._load("order")
        features = self._load("x", mmap_mode="r")  # only maps: nothing is read yet
        if (
            features.ndim != 2
            or features.shape[1] != len(self.mean)
            or not len(features) == len(self._y) == len(self._order)
        ):
            raise DataError(
                f"{self.folder}: {self.split_name}_x.npy {features.shape}, "
                f"{self.split_name}_y.npy ({len(self._y)}) and {self.split_name}_order.npy "
                f"({len(self._order)}) do not fit together or the {len(self.mean)} feature "
                "statistics; prepare the split again"
            )
        self._width, self._offset = features.shape[1], features.offset
        self._x = features if features.nbytes <= self.map_bytes else None
        self._file = None if self._x is not None else open(features.filename, "rb")  # noqa: SIM115

    def _load(self, name: str, mmap_mode: Literal["r"] | None = None) -> np.ndarray:
        path = self.folder / f"{self.split_name}_{name}.npy"
        try:
            return np.load(path, mmap_mode=mmap_mode, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise DataError(
                f"{path}: cannot read this split array ({exc}); prepare the split again"
            ) from None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for key in ("_x", "_y", "_order", "_file"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()

    def __len__(self) -> int:
        return len(self._order)

    @property
    def nbytes(self) -> int:
        """Bytes of the split's features (float32)."""
        return len(self._order) * self._width * 4

    def take(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._order[as_rows(indices, len(self))]
        # np.take, not self._x[rows]: a 2-D fancy index measured twice as slow
        block = np.take(self._x, rows, axis=0) if self._x is not None else self._read(rows)
        features = (torch.from_numpy(block) - self.mean) / self.std
        labels = self._y[rows]
        if self.target_mean is None or self.target_std is None:
            return features, torch.from_numpy(labels.astype(np.int64, copy=False))
        values = (labels - self.target_mean) / self.target_std  # in float64, as tensors.py
        return features, torch.from_numpy(values.astype(np.float32))

    def _read(self, rows: np.ndarray) -> np.ndarray:
        fd, size = self._file.fileno(), self._width * 4
        ascending = np.argsort(rows, kind="stable")  # in file order: the kernel reads ahead
        data = b"".join(
            [os.pread(fd, size, self._offset + r * size) for r in rows[ascending].tolist()]
        )
        block = np.empty((len(rows), self._width), dtype=np.float32)
        block[ascending] = np.frombuffer(data, dtype=np.float32).reshape(len(rows), self._width)
        return block

    @property
    def spec(self) -> DataSpec:
        if self.target_mean is not None:
            outputs = 1
        elif self.num_classes is not None:
            outputs = self.num_classes
        else:
            outputs = int(self._y.max()) + 1 if len(self._y) else 1
        return DataSpec("table", (self._width,), outputs)
