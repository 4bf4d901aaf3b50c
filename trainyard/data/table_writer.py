"""Tables bigger than memory: a streaming train/val/test split into memory-mapped arrays.

`split_table_to_arrays` reads a CSV or Parquet table in chunks, twice. Pass 1 reads only the
label column, kept as one small number per row, and makes the split `prepare_splits` makes
(same stratification, same seed, so the same rows land in train, val and test). Pass 2 reads
the features and appends every row, in file order, to its split's `{split}_x.npy` (float32),
summing the training rows' moments on the way. Beside them go `{split}_y.npy` (int64 class
ids into the sorted classes, or float64 values) and `{split}_order.npy`: row k of a split as
`prepare_splits` orders it is row order[k] of these arrays, so index k reads the same row from
`TableArrays` as from `trainyard.data.tensors.load_split`, and a seeded run sees the same
batches. Memory holds a chunk and a few numbers per row, never the table. Workers read
the arrays with trainyard.datasets.table_arrays.TableArrays.

Every problem is the DataError `read_table`, `check_stratifiable` and preflight's single-class
check raise for the same file, naming the same rows, wherever in the file they sit.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Literal

import numpy as np

from trainyard.config import SplitConfig
from trainyard.data.table_assignment import (
    SPLITS,
    Assignment,
    assign_rows,
    check_classes_stratifiable,
)
from trainyard.data.table_chunks import ChunkedTable, open_table
from trainyard.data.table_features import FeatureChecks, Moments
from trainyard.data.table_labels import Labels, read_labels
from trainyard.errors import DataError


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
    ignored_columns: list[str] = field(default_factory=list)  # data.ignore_columns

    @property
    def num_outputs(self) -> int:
        return len(self.classes) if self.target == "class" else 1


def split_table_to_arrays(
    source: Path,
    label_column: str,
    target: str,
    split: SplitConfig,
    out_dir: Path,
    chunk_rows: int = 65536,
    ignored: Sequence[str] = (),
) -> TableSplit:
    """Split `source` as `prepare_splits` does, into arrays in `out_dir` (see the module
    docstring). Files are written under temporary names and renamed when all are complete;
    a failure removes them. `chunk_rows` rows are parsed at a time (fewer for wide tables);
    `ignored` columns are left out (data.ignore_columns)."""
    _check_target(target)
    table = open_table(Path(source), label_column, chunk_rows, ignored)
    labels = read_labels(table, target)
    try:
        assignment, deferred = assign_rows(table, labels, split, target), None
    except DataError as exc:
        # prepare_splits runs read_table's feature checks before it splits: theirs come first.
        assignment, deferred = None, exc
    writer = _ArrayWriter(Path(out_dir))
    try:
        moments = _stream_features(table, assignment, writer)
        if deferred is not None:
            raise deferred
        assert assignment is not None  # made whenever no error was deferred
        _write_labels(writer, labels, assignment)
        writer.commit()
    finally:
        writer.discard()
    return _describe(table, labels, assignment, moments, target)


def table_summary(
    source: Path,
    label_column: str,
    target: Literal["class", "value"],
    chunk_rows: int = 65536,
    split: SplitConfig | None = None,
    ignored: Sequence[str] = (),
) -> tuple[int, int, int]:
    """(rows, features, what a model predicts: classes or 1) with preflight's checks and
    errors (read_table's, a single class, check_stratifiable's), read in one streaming pass
    over the labels and one over the features."""
    _check_target(target)
    table = open_table(Path(source), label_column, chunk_rows, ignored)
    labels = read_labels(table, target)
    _stream_features(table, None, None)
    outputs = 1
    if target == "class":
        outputs = len(labels.classes)
        if outputs < 2:
            raise DataError(
                f"{table.path}: column '{label_column}' has a single class; need at least 2"
            )
        check_classes_stratifiable(table, labels, split)
    return labels.rows, len(table.features), outputs


def _check_target(target: str) -> None:
    if target not in ("class", "value"):
        raise ValueError(f"target {target!r}: a table's target is 'class' or 'value'")


def _stream_features(
    table: ChunkedTable, assignment: Assignment | None, writer: _ArrayWriter | None
) -> Moments:
    """Check every feature value; with an assignment, also write each row to its split.
    Reading goes on past a bad value: the message counts every offending row."""
    checks, moments = FeatureChecks(table.features), Moments(len(table.features))
    if assignment is not None and writer is not None:
        writer.open_rows(assignment.rows, len(table.features))
    # A CSV is read whole, not by usecols: pandas checks field counts only of a whole read.
    columns = (table.features or [table.label]) if table.parquet else None
    seen = 0
    for first, frame in table.chunks(columns, text=table.ignored):
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
        self.handles[name].write(np.ascontiguousarray(block, dtype=np.float32).data)

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


def _write_labels(writer: _ArrayWriter, labels: Labels, assignment: Assignment) -> None:
    for name in SPLITS:
        picked = assignment.picked[name]
        in_file_order = np.sort(picked)
        if labels.ids is not None:
            writer.save(f"{name}_y", labels.ids[in_file_order].astype(np.int64))
        elif labels.values is not None:
            writer.save(f"{name}_y", labels.values[in_file_order])
        writer.save(f"{name}_order", np.searchsorted(in_file_order, picked))


def _describe(
    table: ChunkedTable, labels: Labels, assignment: Assignment, moments: Moments, target: str
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
        ignored_columns=list(table.ignored),
    )
