"""A Parquet table bigger than memory, read by row group.

`take` maps each index to its row group (from the file's metadata), reads only the row groups
a batch touches (`ParquetFile.read_row_group`, feature and label columns only) and keeps a few
decoded ones in an LRU cache. The whole file is never read. A uniformly shuffled epoch touches
many row groups per batch, so row groups of a few thousand rows read fastest.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from trainyard.data_spec import DataSpec
from trainyard.datasets.base import MapDataset, as_rows
from trainyard.errors import DataError


class ParquetRows(MapDataset):
    """Rows of a Parquet file: inputs float32 (feature columns, optionally standardized),
    targets int64 class ids from the caller's `classes` mapping (label value -> id 0..K-1)."""

    def __init__(
        self,
        path: str | Path,
        feature_columns: Sequence[str],
        label_column: str,
        classes: Mapping[Any, int],
        *,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        cache_row_groups: int = 4,
    ) -> None:
        self.path = Path(path)
        self.feature_columns, self.label_column = list(feature_columns), label_column
        self.cache_row_groups = max(1, cache_row_groups)
        self._file = self._open()
        metadata = self._file.metadata
        sizes = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        if self.starts[-1] == 0:
            raise DataError(f"{self.path}: the table has no rows")
        names = self._file.schema_arrow.names
        for column in [*self.feature_columns, label_column]:
            if column not in names:
                raise DataError(f"{self.path}: no column '{column}' (columns: {names})")
        ids = sorted(set(classes.values()))
        if ids != list(range(len(ids))) or not ids:
            raise ValueError(f"class ids {ids} must be exactly 0..K-1")
        self.classes = dict(classes)
        self._keys = self._typed_keys(names)
        self._ids = np.array(list(self.classes.values()), dtype=np.int64)
        self.mean = None if mean is None else np.asarray(mean, dtype=np.float32)
        self.std = None if std is None else np.asarray(std, dtype=np.float32)
        self._cache: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self.row_groups_read = 0  # decoded from disk, cache misses

    def _open(self) -> pq.ParquetFile:
        try:
            return pq.ParquetFile(self.path)
        except (OSError, pa.ArrowException) as exc:
            raise DataError(f"{self.path}: cannot read as Parquet ({exc})") from None

    def _typed_keys(self, names: list[str]) -> pa.Array:
        label_type = self._file.schema_arrow.field(self.label_column).type
        try:
            return pc.cast(pa.array(list(self.classes)), label_type)
        except (pa.ArrowException, TypeError) as exc:
            raise DataError(
                f"{self.path}: class labels {list(self.classes)[:5]} do not match column "
                f"'{self.label_column}' of type {label_type} ({exc})"
            ) from None

    def __getstate__(self) -> dict:  # a DataLoader worker reopens the file, cache empty
        state = dict(self.__dict__)
        state["_file"], state["_cache"] = None, OrderedDict()
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._file = self._open()

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def num_row_groups(self) -> int:
        return len(self.starts) - 1

    def take(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = as_rows(indices, len(self))
        groups = np.searchsorted(self.starts, rows, side="right") - 1
        inputs = np.empty((rows.size, len(self.feature_columns)), dtype=np.float32)
        targets = np.empty(rows.size, dtype=np.int64)
        for group in np.unique(groups):
            where = groups == group
            features, labels = self._row_group(int(group))
            local = rows[where] - self.starts[group]
            inputs[where], targets[where] = features[local], labels[local]
        if self.mean is not None:
            inputs = (inputs - self.mean) / (self.std if self.std is not None else 1.0)
        return torch.from_numpy(inputs), torch.from_numpy(targets)

    def _row_group(self, group: int) -> tuple[np.ndarray, np.ndarray]:
        if group in self._cache:
            self._cache.move_to_end(group)
            return self._cache[group]
        table = self._file.read_row_group(group, columns=[*self.feature_columns, self.label_column])
        self.row_groups_read += 1
        decoded = self._features(table, group), self._labels(table, group)
        self._cache[group] = decoded
        if len(self._cache) > self.cache_row_groups:
            self._cache.popitem(last=False)
        return decoded

    def _features(self, table: pa.Table, group: int) -> np.ndarray:
        columns = []
        for name in self.feature_columns:
            column = table.column(name)
            if column.null_count:
                raise DataError(
                    f"{self.path}: column '{name}' has missing values in row group {group}; "
                    "fill or drop them"
                )
            try:
                columns.append(column.to_numpy().astype(np.float32))
            except (ValueError, TypeError, pa.ArrowException):
                raise DataError(
                    f"{self.path}: column '{name}' is not numeric ({column.type})"
                ) from None
        return np.column_stack(columns) if columns else np.empty((table.num_rows, 0), np.float32)

    def _labels(self, table: pa.Table, group: int) -> np.ndarray:
        column = table.column(self.label_column)
        positions = pc.index_in(column, value_set=self._keys)
        if positions.null_count:
            first = int(np.flatnonzero(positions.is_null().to_numpy(zero_copy_only=False))[0])
            raise DataError(
                f"{self.path}: label {column[first].as_py()!r} in column '{self.label_column}' "
                f"(row {int(self.starts[group]) + first + 1}) is not among the "
                f"{len(self.classes)} classes; pass a class mapping that has it"
            )
        return self._ids[positions.to_numpy()]

    @property
    def spec(self) -> DataSpec:
        return DataSpec("table", (len(self.feature_columns),), len(set(self.classes.values())))
