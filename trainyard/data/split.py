"""The `prepare` stage: a seeded, stratified train/val/test split.

One implementation with two entry points: the dvc.yaml stage calls `trainyard prepare`
(`prepare_splits` into data/processed), and a run's flow calls `prepare_cached_splits`, which
writes the same bytes into a folder of its own, named by what the split depends on, so that
runs started together never read each other's split. That folder is made from the bytes
DVC recorded (trainyard.data.recorded), never from whatever the data file holds by then, and
carries a digest of its files that every reuse checks.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from trainyard.config import DataConfig, SplitConfig
from trainyard.data.prepared import (
    USER_SOURCE,
    prepare_image_split,
    prepare_token_split,
    prepare_user_split,
)
from trainyard.data.recorded import copy_recorded
from trainyard.data.table_writer import split_table_to_arrays
from trainyard.data_spec import DataKind, DataSpec
from trainyard.errors import DataError
from trainyard.project import ProjectPaths
from trainyard.util.files import write_text_atomic
from trainyard.util.hashing import file_digest
from trainyard.util.locks import file_lock

if TYPE_CHECKING:
    import pandas as pd  # imported where used: workers read the schema, never a frame

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
SCHEMA_FILE = "schema.json"
# Bump whenever prepare_splits writes other bytes for the same inputs: cached splits made by
# the old code then get other keys instead of being reused.
SPLIT_FORMAT = 5
DIGEST_FILE = "digest.json"  # sha256 of each file of a cached split, written last


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
    kind: DataKind = "table"  # table | image | tokens
    input_shape: list[int] | None = None  # one sample: (C, H, W) or (context,); tables: None
    vocab_size: int | None = None  # text
    token_level: str | None = None  # text: byte | char
    token_cuts: list[int] | None = None  # text: token offsets of train | val | test
    token_chars: list[str] | None = None  # char-level text: token id -> character
    dataset: str | None = None  # data.dataset: the user's factory that reads `source`
    source: str | None = None  # data.path, relative to the project
    ignored_columns: list[str] = field(default_factory=list)  # a table's data.ignore_columns

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
        fields = prepare_image_split(source, split, out_dir, data)
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
    table = split_table_to_arrays(
        source, data.label_column, target, split, out_dir, ignored=data.ignore_columns
    )
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
        # data.augment changes what a worker does with the split's pixels, not the pixels;
        # no ignore_columns is left out, so that splits made before it keep their keys.
        "data": data.model_dump(mode="json", exclude=_not_in_split_key(data)),
        "split": split.model_dump(mode="json"),
        "target": target,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]


def _not_in_split_key(data: DataConfig) -> set[str]:
    left_out = {"path", "augment"}
    return left_out if data.ignore_columns else left_out | {"ignore_columns"}


def prepare_cached_splits(
    paths: ProjectPaths,
    data: DataConfig,
    split: SplitConfig,
    dataset_md5: str,
    target: str = "class",
) -> CachedSplit:
    """`prepare_splits` of the dataset's recorded bytes (`dataset_md5`, see
    trainyard.data.recorded) into the project's split cache, once per key.

    A cached folder is reused only while every file matches the digest written with it;
    a damaged one is set aside and built again. Building and setting aside happen under a
    lock per key, so a run never removes a folder another run has just rebuilt.
    """
    key = split_key(dataset_md5, data, split, target)
    folder = paths.split_cache(key)
    if _intact(folder):
        return CachedSplit(key, folder, SplitSchema.read(folder))
    with file_lock(paths.state / "split-locks" / key, "waiting for another run's split"):
        if _intact(folder):  # built meanwhile by the run holding the lock
            return CachedSplit(key, folder, SplitSchema.read(folder))
        if folder.exists():
            log.warning("split %s does not match its digest; building it again", key)
            _set_aside(folder)
        schema = _build(paths, data, split, dataset_md5, target, folder)
    return CachedSplit(key, folder, schema)


def _build(
    paths: ProjectPaths,
    data: DataConfig,
    split: SplitConfig,
    dataset_md5: str,
    target: str,
    folder: Path,
) -> SplitSchema:
    """The split built beside its final place from a verified copy of the data, with its
    digest, and renamed into place: it appears complete or not at all. A run that finds the
    folder there when it renames drops its own identical copy."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    key = folder.name
    building = Path(tempfile.mkdtemp(prefix=f".{key}.", suffix=".tmp", dir=folder.parent))
    copied = Path(tempfile.mkdtemp(prefix=f".{key}.", suffix=".data.tmp", dir=folder.parent))
    try:
        source = copy_recorded(paths.root, data.path, dataset_md5, copied)
        try:
            schema = prepare_splits(data, split, source, building, target)
        except DataError as exc:  # named as the user knows the file, not as the copy
            raise DataError(str(exc).replace(str(source), str(paths.root / data.path))) from None
        if data.kind == "custom":  # workers open the user's dataset on these bytes again
            os.rename(copied, building / USER_SOURCE)
        shutil.rmtree(copied, ignore_errors=True)  # other kinds: the split holds what is read
        write_text_atomic(building / DIGEST_FILE, json.dumps(_digest(building), indent=1))
        try:
            os.rename(building, folder)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            if not _intact(folder):
                raise DataError(
                    f"{folder} exists but does not match its {DIGEST_FILE}: not a split "
                    "trainyard wrote; delete that folder and run again"
                ) from None
    finally:
        shutil.rmtree(building, ignore_errors=True)  # gone already when the rename won
        shutil.rmtree(copied, ignore_errors=True)
    return schema


def _digest(folder: Path) -> dict[str, str]:
    """sha256 of every file in a split folder, by its path inside it."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != DIGEST_FILE)
    return {p.relative_to(folder).as_posix(): file_digest(p) for p in files}


def _intact(folder: Path) -> bool:
    """Whether `folder` holds a complete split: its digest lists the schema and every file
    listed is there with the bytes it was written with."""
    try:
        recorded = json.loads((folder / DIGEST_FILE).read_text())
        if not isinstance(recorded, dict) or SCHEMA_FILE not in recorded:
            return False
        return all(file_digest(folder / name) == sha for name, sha in recorded.items())
    except (OSError, ValueError):
        return False


def _set_aside(folder: Path) -> None:
    """Move a damaged split out of the way (a worker of an earlier run may still have its
    files open) and delete it."""
    aside = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".damaged", dir=folder.parent))
    os.rename(folder, aside / folder.name)
    shutil.rmtree(aside, ignore_errors=True)
