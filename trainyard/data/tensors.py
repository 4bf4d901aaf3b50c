"""Split files -> what workers read, a batch at a time: tables, images and text.

`TensorSplit` is a split already in memory (a test's, or a benchmark's on a GPU)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from trainyard.data.prepared import open_image_split, open_token_split, open_user_split
from trainyard.data.split import SplitSchema
from trainyard.datasets.base import MapDataset
from trainyard.datasets.table_arrays import TableArrays


@dataclass(frozen=True)
class TensorSplit:
    features: torch.Tensor  # float32, standardized with the training split's statistics
    labels: torch.Tensor  # int64 class indices into schema.classes, or float32 values

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # index_select, not features[indices]: advanced indexing takes a general path that
        # measured 2-3x slower per batch. It also refuses negative rows instead of wrapping.
        indices = _on_device(indices, self.features.device)
        return self.features.index_select(0, indices), self.labels.index_select(0, indices)

    def to(self, device: torch.device) -> TensorSplit:
        """On a GPU the whole split lives in its memory: a batch is then a gather on the
        device, with no host-to-device copy per step."""
        if self.features.device == device:
            return self
        return TensorSplit(self.features.to(device), self.labels.to(device))


def _on_device(indices: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The batch's row numbers where the split is. To a GPU through page-locked memory: a
    copy from pageable memory waits for the device to finish all the work queued so far,
    once per step, so the training thread could never run ahead of the GPU."""
    if indices.device == device:
        return indices
    if device.type == "cuda" and indices.device.type == "cpu":
        return indices.pin_memory().to(device, non_blocking=True)
    return indices.to(device)


def load_split(folder: Path, name: str, schema: SplitSchema) -> TableArrays:
    """A table's split, read a batch at a time from its arrays (never loaded whole)."""
    return TableArrays(
        folder,
        name,
        schema.feature_mean,
        schema.feature_std,
        schema.target_mean if schema.target == "value" else None,
        schema.target_std if schema.target == "value" else None,
        num_classes=schema.num_outputs,
    )


def open_split(folder: Path, name: str, schema: SplitSchema, root: Path) -> MapDataset:
    """A prepared split as a worker reads it: a batch at a time, whatever its kind (a user
    dataset reads its file from the project `root`)."""
    if schema.dataset is not None:
        return open_user_split(folder, name, schema, root)
    if schema.kind == "image":
        return open_image_split(folder, name, schema)
    if schema.kind == "tokens":
        return open_token_split(folder, name, schema)
    return load_split(folder, name, schema)


GPU_RESIDENT_BYTES = 1 << 30  # a table split up to this size is copied into GPU memory whole
# On the host, a table split up to this size (~65k rows of 64 features) is standardized once
# and held whole by each worker: reading a batch from the arrays (index, gather, standardize)
# took ~80 us of a 0.7 ms digits step, from memory it is one index_select. Small, so that a
# worker's memory stays flat as tables grow past what fits.
HOST_RESIDENT_BYTES = 16 << 20


def resident(split: MapDataset | TensorSplit, device: torch.device) -> MapDataset | TensorSplit:
    """A small table's split, whole in the memory of the device that trains: on a GPU a
    batch is then a gather there, with no host-to-device copy per step, and on the host one
    index_select. Larger tables, images and text stay where they are, read a batch at a time."""
    on_gpu = device.type == "cuda"
    if isinstance(split, TensorSplit):
        return split.to(device) if on_gpu else split
    limit = GPU_RESIDENT_BYTES if on_gpu else HOST_RESIDENT_BYTES
    if not isinstance(split, TableArrays) or split.nbytes > limit:
        return split
    return TensorSplit(*split.take(torch.arange(len(split)))).to(device)
