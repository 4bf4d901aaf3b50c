"""Checks that need the data or the machine, run before any process is launched or
anything is written to the store. Settings alone are validated in trainyard.config."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from trainyard.config import DATA_DIR, TrainyardConfig
from trainyard.data.split import check_stratifiable
from trainyard.data.tables import BUNDLED, read_table
from trainyard.errors import ConfigError, DataError
from trainyard.models import check_model_builds
from trainyard.objectives import Objective, best_by, build_objective, monitored


@dataclass(frozen=True)
class PreflightReport:
    rows: int
    features: int
    classes: int  # what the model predicts: classes, or 1 for a numeric target
    parameters: int


def preflight(config: TrainyardConfig, root: Path) -> PreflightReport:
    dataset = dataset_path(config, root)
    if not dataset.exists() and config.data.path in BUNDLED:
        BUNDLED[config.data.path](dataset)  # bundled examples are materialized on first use
    objective = check_task(config)
    frame = read_table(dataset, config.data.label_column, objective.target_kind)
    rows, features = len(frame), frame.shape[1] - 1
    outputs = 1
    if objective.target_kind == "class":
        outputs = frame[config.data.label_column].nunique()
        if outputs < 2:
            raise DataError(
                f"{dataset}: column '{config.data.label_column}' has a single class; need at least 2"
            )
        check_stratifiable(frame, config.data.label_column, dataset)
    check_devices(config)
    check_batch_fits_shard(config, rows)
    parameters = check_model_builds(config.model, features, outputs)
    return PreflightReport(rows, features, outputs, parameters)


def check_task(config: TrainyardConfig) -> Objective:
    """The task exists and has the metric task.monitor names."""
    try:
        objective = build_objective(config.task.name)
    except (ImportError, AttributeError, TypeError) as exc:
        raise ConfigError(f"task.name = {config.task.name!r}: {exc}") from None
    try:  # the monitored metric and the one retention keeps the best by
        objective.mode(monitored(config.task, objective))
        best_by(config.checkpoint.keep_best_by, config.task, objective)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return objective


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
