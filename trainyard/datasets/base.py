"""The dataset seam: a map from row index to sample, read a batch at a time.

A dataset answers three questions: how many rows it has (`len`), what a batch of rows holds
(`take`, one vectorized read per batch, which is what keeps loading fast), and what a model
needs to know about it (`spec`). Which rows a worker reads, and in which order, is the
sampler's business (`trainyard.data.sharding.ShardedBatches`), so sharding and exact resume
hold for every kind of data without the dataset knowing about ranks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class DataShape:
    """What a model needs to know about the data (to be unified with trainyard.data_spec)."""

    input_shape: tuple[int, ...]  # one sample's input: (features,), (C, H, W) or (context,)
    num_outputs: int  # classes of a classifier, targets of a regressor, vocab of a LM
    vocab_size: int | None = None  # token datasets only
    context: int | None = None  # token datasets only: tokens per sample

    def __post_init__(self) -> None:
        if not self.input_shape or any(int(d) <= 0 for d in self.input_shape):
            raise ValueError(f"input_shape {self.input_shape} must be non-empty and positive")
        if self.num_outputs <= 0:
            raise ValueError(f"num_outputs must be positive, got {self.num_outputs}")
        if self.vocab_size is not None and self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")
        if self.context is not None and self.context <= 0:
            raise ValueError(f"context must be positive, got {self.context}")


class MapDataset(ABC, torch.utils.data.Dataset):
    """Rows 0..len-1; `take` returns (inputs, targets) for a batch of rows, in their order."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def take(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    @property
    @abstractmethod
    def spec(self) -> DataShape: ...

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
    def spec(self) -> DataShape:
        return self.base.spec


def as_rows(indices: np.ndarray | torch.Tensor | list[int], num_rows: int) -> np.ndarray:
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
