"""Checks that need the data or the machine, run before any process is launched or
anything is written to the store. Settings alone are validated in trainyard.config."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from trainyard.config import BUNDLED_DIGITS, DATA_DIR, TrainyardConfig
from trainyard.data.split import check_stratifiable
from trainyard.data.tables import read_table, write_digits
from trainyard.errors import ConfigError, DataError
from trainyard.models import check_model_builds


@dataclass(frozen=True)
class PreflightReport:
    rows: int
    features: int
    classes: int
    parameters: int


def preflight(config: TrainyardConfig, root: Path) -> PreflightReport:
    dataset = dataset_path(config, root)
    if not dataset.exists() and config.data.path == BUNDLED_DIGITS:
        write_digits(dataset)  # the bundled default is materialized on first use
    frame = read_table(dataset, config.data.label_column)
    rows, features = len(frame), frame.shape[1] - 1
    classes = frame[config.data.label_column].nunique()
    if classes < 2:
        raise DataError(
            f"{dataset}: column '{config.data.label_column}' has a single class; need at least 2"
        )
    check_stratifiable(frame, config.data.label_column, dataset)
    check_devices(config)
    check_batch_fits_shard(config, rows)
    parameters = check_model_builds(config.model, features, classes)
    return PreflightReport(rows, features, classes, parameters)


def dataset_path(config: TrainyardConfig, root: Path) -> Path:
    """The dataset file, refusing symlinks that lead outside the project's data folder."""
    path = root / config.data.path
    data_dir = (root / DATA_DIR).resolve()
    if path.exists() and not path.resolve().is_relative_to(data_dir):
        raise ConfigError(
            f"data.path = {config.data.path!r}: resolves to {path.resolve()}, outside {data_dir}; "
            "copy the file into the data folder"
        )
    return path


def check_devices(config: TrainyardConfig) -> None:
    train = config.train
    cuda = torch.cuda.is_available()
    if train.device == "cuda" and not cuda:
        raise ConfigError("train.device = 'cuda': no CUDA device is visible; use 'auto' or 'cpu'")
    if (
        train.device == "cuda" or (train.device == "auto" and cuda)
    ) and train.workers > torch.cuda.device_count():
        raise ConfigError(
            f"train.workers = {train.workers}: only {torch.cuda.device_count()} GPU(s) visible and "
            "CUDA runs one worker per GPU; lower train.workers or set train.device: cpu"
        )


def check_batch_fits_shard(config: TrainyardConfig, rows: int) -> None:
    """Each worker's shard of the training split must hold at least one full batch."""
    holdout = config.split.val_fraction + config.split.test_fraction
    train_rows = rows - math.ceil(rows * holdout)
    world = config.train.world_size  # workers x nodes
    shard = train_rows // world
    if shard < 1:
        raise ConfigError(
            f"train.workers = {config.train.workers}: the training split has only {train_rows} rows, "
            f"fewer than the {world} workers; use fewer workers or more data"
        )
    if config.train.batch_size > shard:
        raise ConfigError(
            f"train.batch_size = {config.train.batch_size}: larger than each worker's shard of the training "
            f"split ({train_rows} rows / {world} workers = {shard}); lower it or use fewer workers"
        )
