"""A table split into arrays (trainyard.data.table_writer), read by a worker: one split's
features, labels and row order, memory-mapped when small, read by rows when large."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, cast

import numpy as np
import torch

from trainyard.data_spec import DataSpec
from trainyard.datasets.base import MapDataset, as_rows
from trainyard.errors import DataError

# A split whose features take at most this is memory-mapped; a larger one is read by rows.
MAP_BYTES = 64 << 20


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
        # np.load maps an .npy given mmap_mode: nothing is read yet.
        features = cast(np.memmap, self._load("x", mmap_mode="r"))
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
        self._file = None if self._x is not None else open(cast(str, features.filename), "rb")  # noqa: SIM115

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
        assert self._file is not None  # opened whenever the features are not mapped
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
