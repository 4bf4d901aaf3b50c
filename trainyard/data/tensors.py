"""Split files -> what workers read: tables as in-memory tensors (batches are index gathers),
images and text as memory-mapped datasets."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from trainyard.data.prepared import open_image_split, open_token_split
from trainyard.data.split import SplitSchema
from trainyard.data.tables import where_in_file
from trainyard.datasets.base import MapDataset
from trainyard.errors import DataError


@dataclass(frozen=True)
class TensorSplit:
    features: torch.Tensor  # float32, standardized with the training split's statistics
    labels: torch.Tensor  # int64 class indices into schema.classes, or float32 values

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.features[indices], self.labels[indices]

    def to(self, device: torch.device) -> TensorSplit:
        """On a GPU the whole split lives in its memory: a batch is then a gather on the
        device, with no host-to-device copy per step."""
        if self.features.device == device:
            return self
        return TensorSplit(self.features.to(device), self.labels.to(device))


def load_split(folder: Path, name: str, schema: SplitSchema) -> TensorSplit:
    frame = pd.read_csv(folder / f"{name}.csv", dtype={schema.label_column: str})
    features = torch.tensor(frame[schema.feature_columns].to_numpy(dtype="float32"))
    mean = torch.tensor(schema.feature_mean, dtype=torch.float32)
    std = torch.tensor(schema.feature_std, dtype=torch.float32)
    if schema.target == "value":  # trained standardized; the task reports original units
        values = frame[schema.label_column].to_numpy(dtype="float64")
        target = (values - schema.target_mean) / schema.target_std
        return TensorSplit((features - mean) / std, torch.tensor(target, dtype=torch.float32))
    index = {label: i for i, label in enumerate(schema.classes)}
    unknown = ~frame[schema.label_column].isin(index)
    if unknown.any():
        path = folder / f"{name}.csv"
        raise DataError(
            f"{path}: label {frame[schema.label_column][unknown].iloc[0]!r} in column '{schema.label_column}' "
            f"({where_in_file(path, frame.index[unknown])}) is not among the {len(schema.classes)} classes "
            "the model was built for; train a model on data that has it"
        )
    labels = torch.tensor([index[v] for v in frame[schema.label_column]], dtype=torch.int64)
    return TensorSplit(features=(features - mean) / std, labels=labels)


def open_split(folder: Path, name: str, schema: SplitSchema) -> TensorSplit | MapDataset:
    """A prepared split as a worker reads it: a table in memory, images and text mapped."""
    if schema.kind == "image":
        return open_image_split(folder, name, schema)
    if schema.kind == "tokens":
        return open_token_split(folder, name, schema)
    return load_split(folder, name, schema)
