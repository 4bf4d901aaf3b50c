"""How a worker reads rows [first, stop) of a prediction's input, whatever its kind: samples
for the model, the targets a language model scores a window against, and any columns that
name the rows (an image folder's files)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from trainyard.data.prepared import open_user_dataset
from trainyard.data.split import SplitSchema
from trainyard.datasets.base import MapDataset
from trainyard.datasets.tokens import TokenWindows
from trainyard.inference.documents import InputTable
from trainyard.inference.inputs import open_features


@dataclass
class Rows:
    inputs: torch.Tensor  # raw units for an array input; what the model reads otherwise
    targets: torch.Tensor | None = None  # text: each window's next tokens
    named: dict[str, list[str]] = field(default_factory=dict)  # extra output columns


class InputRows(Protocol):
    def __len__(self) -> int: ...

    def read(self, first: int, stop: int) -> Rows: ...


class ArrayRows:
    """The converted float32 array, mapped: a worker reads only its own slice."""

    def __init__(self, features: np.ndarray, names: list[str] | None = None) -> None:
        self.features, self.names = features, names

    def __len__(self) -> int:
        return len(self.features)

    def read(self, first: int, stop: int) -> Rows:
        block = torch.from_numpy(np.array(self.features[first:stop], dtype=np.float32))
        named = {"file": self.names[first:stop]} if self.names is not None else {}
        return Rows(block, named=named)


class DatasetRows:
    """A map-style dataset (token windows, the user's own) read a batch of rows at a time."""

    def __init__(self, dataset: MapDataset, with_targets: bool) -> None:
        self.dataset, self.with_targets = dataset, with_targets

    def __len__(self) -> int:
        return len(self.dataset)

    def read(self, first: int, stop: int) -> Rows:
        inputs, targets = self.dataset.take(torch.arange(first, stop, dtype=torch.int64))
        return Rows(inputs, targets if self.with_targets else None)


def open_rows(root: Path, table: InputTable, schema: SplitSchema) -> InputRows:
    if table.reader == "dataset":  # a language model scores each row against its targets
        assert schema.dataset is not None  # the reader of a model with a data.dataset factory
        dataset = open_user_dataset(schema.dataset, root / table.path)
        return DatasetRows(dataset, with_targets=schema.target == "tokens")
    if table.reader == "tokens":
        tokens = np.memmap(root / table.array, dtype=_token_dtype(schema), mode="r")
        context = table.shape[0]
        return DatasetRows(TokenWindows(tokens, context, schema.vocab_size or 256), True)
    names = json.loads((root / table.names).read_text()) if table.names else None
    return ArrayRows(open_features(root, table), names)


def _token_dtype(schema: SplitSchema) -> np.dtype:
    return np.dtype(np.uint8 if (schema.vocab_size or 256) <= 256 else np.uint16)
