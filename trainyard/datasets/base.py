"""The dataset seam: a map from row index to sample, read a batch at a time.

A dataset answers three questions: how many rows it has (`len`), what a batch of rows holds
(`take`, one vectorized read per batch, which is what keeps loading fast), and what a model
needs to know about it (`spec`, a `trainyard.data_spec.DataSpec`). Which rows a worker reads, and in which order, is the
sampler's business (`trainyard.data.sharding.ShardedBatches`), so sharding and exact resume
hold for every kind of data without the dataset knowing about ranks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import torch

from trainyard.data_spec import DataSpec


class MapDataset(ABC, torch.utils.data.Dataset):
    """Rows 0..len-1; `take` returns (inputs, targets) for a batch of rows, in their order."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def take(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    @property
    @abstractmethod
    def spec(self) -> DataSpec: ...

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sample, for code written against torch's Dataset; batches should use take."""
        inputs, targets = self.take(torch.tensor([index], dtype=torch.int64))
        return inputs[0], targets[0]


class Subset(MapDataset):
    """Rows `indices` of `base`, renumbered 0..len-1 (a split of a file-backed dataset)."""

    def __init__(self, base: MapDataset, indices: np.ndarray | torch.Tensor | list[int]) -> None:
        self.base = base
        self.indices = as_rows(indices, len(base))

    def __len__(self) -> int:
        return len(self.indices)

    def take(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.base.take(torch.from_numpy(self.indices[as_rows(indices, len(self))]))

    @property
    def spec(self) -> DataSpec:
        return self.base.spec


def as_rows(indices: np.ndarray | torch.Tensor | Sequence[int], num_rows: int) -> np.ndarray:
    """Row indices as a 1-D int64 array, each in [0, num_rows) (negative ones are refused,
    not wrapped: a sampler bug must not silently read the end of the file)."""
    if isinstance(indices, torch.Tensor):
        indices = indices.detach().cpu().numpy()
    rows = np.asarray(indices)
    if rows.ndim != 1 or (rows.size and not np.issubdtype(rows.dtype, np.integer)):
        raise IndexError(
            f"expected a 1-D tensor of integer row indices, got {rows.dtype} {rows.shape}"
        )
    rows = rows.astype(np.int64, copy=False)
    if rows.size and (rows.min() < 0 or rows.max() >= num_rows):
        bad = rows[(rows < 0) | (rows >= num_rows)][0]
        raise IndexError(f"row {bad} is out of range for a dataset of {num_rows} rows")
    return rows
