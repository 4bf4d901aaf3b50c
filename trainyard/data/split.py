"""The `prepare` stage: a seeded, stratified train/val/test split.

One implementation with two entry points: the dvc.yaml stage calls `trainyard prepare`
(`prepare_splits` into data/processed), and a run's flow calls `prepare_cached_splits`, which
writes the same bytes into a folder of its own, named by what the split depends on, so that
runs started together never read each other's split.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from trainyard.config import DataConfig, SplitConfig
from trainyard.data.prepared import prepare_image_split, prepare_token_split, prepare_user_split
from trainyard.data.table_arrays import split_table_to_arrays
from trainyard.data_spec import DataSpec
from trainyard.errors import DataError
from trainyard.files import write_text_atomic
from trainyard.project import ProjectPaths

if TYPE_CHECKING:
    import pandas as pd  # imported where used: workers read the schema, never a frame

SPLITS = ("train", "val", "test")
SCHEMA_FILE = "schema.json"
# Bump whenever prepare_splits writes other bytes for the same inputs: cached splits made by
# the old code then get other keys instead of being reused.
SPLIT_FORMAT = 4


@dataclass(frozen=True)
class SplitSchema:
    """What a worker needs to turn split files into tensors, identically on every rank."""

    label_column: str
    feature_columns: list[str]  # a table's; empty for images and text
    classes: list[str]  # empty for a numeric target and for text
    feature_mean: list[float]  # per feature of a table, per channel of images
    feature_std: list[float]
    rows: dict[str, int]  # samples per split (windows, for text)
    target: str = "class"  # "class" labels, a numeric "value" (regression), or next "tokens"
    target_mean: float | None = None  # of a numeric target over the training split
    target_std: float | None = None
    kind: str = "table"  # table | image | tokens (trainyard.data_spec.DataKind)
    input_shape: list[int] | None = None  # one sample: (C, H, W) or (context,); tables: None
    vocab_size: int | None = None  # text
    token_level: str | None = None  # text: byte | char
    token_cuts: list[int] | None = None  # text: token offsets of train | val | test
    token_chars: list[str] | None = None  # char-level text: token id -> character
    dataset: str | None = None  # data.dataset: the user's factory that reads `source`
    source: str | None = None  # data.path, relative to the project

    @property
    def num_outputs(self) -> int:
        """What a model for this data predicts: one logit per class or token, or one value."""
        if self.target == "tokens":
            return int(self.vocab_size or 0)
        return len(self.classes) if self.target == "class" else 1

    @property
    def spec(self) -> DataSpec:
        """What a model factory is told about this data."""
        shape = self.input_shape or [len(self.feature_columns)]
        context = shape[0] if self.kind == "tokens" else None
        return DataSpec(self.kind, tuple(shape), self.num_outputs, self.vocab_size, context)

    @classmethod
    def read(cls, folder: Path) -> SplitSchema:
        return cls(**json.loads((folder / SCHEMA_FILE).read_text()))


def prepare_splits(
    data: DataConfig, split: SplitConfig, source: Path, out_dir: Path, target: str = "class"
) -> SplitSchema:
    """Split `source` by its kind (table, images or text) into `out_dir`."""
    check_target_fits(data, target)
    if data.kind == "table":
        return prepare_table_splits(data, split, source, out_dir, target)
    out_dir.mkdir(parents=True, exist_ok=True)
    if data.kind == "custom":
        fields = prepare_user_split(data, split, source, out_dir, target)
    elif data.kind == "image":
        fields = prepare_image_split(source, split, out_dir)
    else:
        fields = prepare_token_split(data, split, source, out_dir)
    schema = SplitSchema(label_column=data.label_column, **fields)
    write_text_atomic(out_dir / SCHEMA_FILE, json.dumps(asdict(schema), indent=2) + "\n")
    return schema


# What each kind of data can train: the targets it has, and the task to name for them.
FITTING_TASKS = {
    "table": (("class", "value"), "classification or regression"),
    "image": (("class",), "classification"),
    "tokens": (("tokens",), "language_model"),
    "custom": (("class", "tokens"), "classification or language_model"),  # targets as given
}


def check_target_fits(data: DataConfig, target: str) -> None:
    """Text trains a language model, and only text does; images are classified."""
    targets, tasks = FITTING_TASKS[data.kind]
    if target not in targets:
        raise DataError(
            f"data.path = {data.path!r} holds {data.kind} data, which a task with {target} "
            f"targets cannot train on; use task.name: {tasks}, or point data.path at matching data"
        )


def prepare_table_splits(
    data: DataConfig, split: SplitConfig, source: Path, out_dir: Path, target: str = "class"
) -> SplitSchema:
    """A table, streamed (never held whole) into each split's feature and label arrays.
    `target`: "class" labels (stratified by class) or a numeric "value" (stratified by
    quantile bins of the target, so every split covers its range)."""
    table = split_table_to_arrays(source, data.label_column, target, split, out_dir)
    schema = SplitSchema(**asdict(table))
    write_text_atomic(out_dir / SCHEMA_FILE, json.dumps(asdict(schema), indent=2) + "\n")
    return schema


def read_split_frame(folder: Path, name: str, schema: SplitSchema) -> pd.DataFrame:
    """One prepared split of a table as a DataFrame in its original units (features and the
    label column), rows in the split's order: for a look in a notebook, or a test."""
    import pandas as pd

    order = np.load(folder / f"{name}_order.npy")
    features = np.load(folder / f"{name}_x.npy", mmap_mode="r")[order]
    frame = pd.DataFrame(features, columns=schema.feature_columns)
    labels = np.load(folder / f"{name}_y.npy")[order]
    if schema.target == "class":
        labels = np.asarray(schema.classes, dtype=object)[labels]
    frame[schema.label_column] = labels
    return frame


@dataclass(frozen=True)
class CachedSplit:
    key: str  # split_key(...): what the split files depend on
    folder: Path
    schema: SplitSchema


def split_key(dataset_md5: str, data: DataConfig, split: SplitConfig, target: str = "class") -> str:
    """The content address of a split: the dataset's bytes (its DVC md5), the label column,
    the split settings and the split code's format. Equal keys mean byte-identical files."""
    identity = {
        "format": SPLIT_FORMAT,
        "dataset_md5": dataset_md5,
        "data": data.model_dump(mode="json", exclude={"path"}),
        "split": split.model_dump(mode="json"),
        "target": target,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]


def prepare_cached_splits(
    paths: ProjectPaths,
    data: DataConfig,
    split: SplitConfig,
    dataset_md5: str,
    target: str = "class",
) -> CachedSplit:
    """`prepare_splits` into the project's split cache, once per key; read-only afterwards.

    The folder is built beside its final place and renamed into it, so it appears complete
    or not at all. Runs that build the same key at once both succeed: the first rename
    wins, the others find the folder there and drop their own identical copy.
    """
    key = split_key(dataset_md5, data, split, target)
    folder = paths.split_cache(key)
    if (folder / SCHEMA_FILE).is_file():
        return CachedSplit(key, folder, SplitSchema.read(folder))
    folder.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{key}.", suffix=".tmp", dir=folder.parent))
    try:
        schema = prepare_splits(data, split, paths.root / data.path, building, target)
        try:
            os.rename(building, folder)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            if not (folder / SCHEMA_FILE).is_file():
                raise DataError(
                    f"{folder} exists but holds no {SCHEMA_FILE}: not a split trainyard "
                    "wrote; delete that folder and run again"
                ) from None
    finally:
        shutil.rmtree(building, ignore_errors=True)  # gone already when the rename won
    return CachedSplit(key, folder, schema)
