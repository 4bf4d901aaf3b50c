"""Checks that need the data or the machine, run before any process is launched or
anything is written to the store. Settings alone are validated in trainyard.config."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

import torch
from torch import nn

from trainyard.config import TrainyardConfig
from trainyard.data.bundled import BUNDLED
from trainyard.data.prepared import image_classes, open_image_source, open_user_dataset
from trainyard.data.split import check_target_fits
from trainyard.data.table_writer import table_summary
from trainyard.data_spec import DataSpec
from trainyard.datasets.tokens import count_chars
from trainyard.errors import ConfigError, DataError
from trainyard.models.registry import build_model, check_model_builds
from trainyard.objectives import Objective, best_by, build_objective, monitored
from trainyard.parallel.pipeline import pipeline_pieces, stage_ranges
from trainyard.runs.data_path import dataset_path


@dataclass(frozen=True)
class PreflightReport:
    rows: int  # samples: table rows, images, or token windows
    spec: DataSpec  # what the model is told about the data
    parameters: int

    @property
    def features(self) -> int:
        return self.spec.num_features

    @property
    def classes(self) -> int:
        """What the model predicts: classes, 1 for a numeric target, or the vocabulary."""
        return self.spec.num_outputs


def preflight(config: TrainyardConfig, root: Path) -> PreflightReport:
    """The checks, run each time they are called: `trainyard.runs.plan.plan_run` calls
    them once per run and hands its plan to the flow."""
    dataset = dataset_path(config, root)
    if not dataset.exists() and config.data.path in BUNDLED:
        BUNDLED[config.data.path](dataset)  # bundled examples are materialized on first use
    return _check(config, dataset)


def _check(config: TrainyardConfig, dataset: Path) -> PreflightReport:
    objective = check_task(config)
    try:
        check_target_fits(config.data, objective.target_kind)
    except DataError as exc:
        raise ConfigError(str(exc)) from None
    rows, spec = DATA_CHECKS[config.data.kind](config, dataset, objective.target_kind)
    if objective.target_kind == "class" and config.data.kind in ("table", "image"):
        check_classes_fit_split(config, rows, spec.num_outputs, dataset)
    check_devices(config)
    check_batch_fits_shard(config, rows)
    parameters = check_model_builds(config.model, spec)
    check_layout(config, spec)
    return PreflightReport(rows, spec, parameters)


def check_layout(config: TrainyardConfig, spec: DataSpec) -> None:
    """The model can be cut as train.parallel says (its divisibility by the world size is
    a settings check, in trainyard.config)."""
    parallel = config.train.parallel
    if parallel.pipeline == 1 and parallel.tensor == 1:
        return
    with torch.device("meta"):
        model = build_model(config.model, spec)
    if parallel.pipeline > 1:
        check_pipeline(config, model)
    if parallel.tensor == 1:
        return
    # Imported here: DTensor's modules take about a second, which only a split model pays.
    from trainyard.parallel.tensor import tensor_plan

    try:
        tensor_plan(model, parallel.tensor)
    except ValueError as exc:
        raise ConfigError(f"train.parallel.tensor {parallel.tensor}: {exc}") from None


def check_pipeline(config: TrainyardConfig, model: nn.Module) -> None:
    """The model declares enough pieces for the stages, and the pipeline is not compiled
    (not yet supported)."""
    cfg = config.train
    stages = cfg.parallel.pipeline
    if cfg.compile:
        raise ConfigError(
            f"train.parallel.pipeline {stages} with train.compile true: a pipeline's stages "
            "run uncompiled, not yet compiled; set one of them back"
        )
    per_worker = 2 if cfg.pipeline_schedule == "interleaved_1f1b" else 1
    try:
        stage_ranges(len(pipeline_pieces(model)), stages * per_worker)
    except ValueError as exc:
        named = f"train.parallel.pipeline {stages} with model.name {config.model.name!r}"
        raise ConfigError(f"{named}: {exc}") from None


def check_table(config: TrainyardConfig, dataset: Path, target: str) -> tuple[int, DataSpec]:
    """The table's checks, streamed: the CLI never holds the table either."""
    # check_target_fits has refused a language model's "tokens" for a table by now.
    kind = cast(Literal["class", "value"], target)
    label = config.data.label_column
    ignored = config.data.ignore_columns
    rows, features, outputs = table_summary(
        dataset, label, kind, split=config.split, ignored=ignored
    )
    return rows, DataSpec("table", (features,), outputs)


def check_images(config: TrainyardConfig, dataset: Path, target: str) -> tuple[int, DataSpec]:
    """An array file or a folder of images per class (DVC versions it as a directory); only
    the labels are read, and the images' headers for the shape."""
    images = open_image_source(dataset, config.data)
    classes, _ = image_classes(images.labels, dataset, config.split)
    return len(images.labels), DataSpec("image", images.image_shape, len(classes))


def check_text(config: TrainyardConfig, dataset: Path, target: str) -> tuple[int, DataSpec]:
    """Windows and vocabulary of the corpus, counted in one streaming pass."""
    if not dataset.is_file():
        raise DataError(f"{dataset}: text corpus not found; set data.path in params.yaml")
    if config.data.tokenizer == "byte":
        (tokens, vocab), unit = (dataset.stat().st_size, 256), "bytes"
    else:
        (tokens, vocab), unit = count_chars(dataset), "characters"
    context = config.data.context
    if tokens <= context:  # no window at all (an empty file: no vocabulary either)
        raise DataError(
            f"{dataset}: the corpus holds {tokens} {unit}, less than one window of "
            f"data.context = {context} + 1; use a larger corpus or a smaller data.context"
        )
    return (tokens - 1) // context, DataSpec("tokens", (context,), vocab, vocab, context)


def check_user_dataset(config: TrainyardConfig, dataset: Path, target: str) -> tuple[int, DataSpec]:
    """The user's dataset opens on its file and describes itself."""
    assert config.data.dataset, "data.kind is 'custom' only when data.dataset names a reader"
    data = open_user_dataset(config.data.dataset, dataset)
    return len(data), data.spec


DATA_CHECKS = {
    "table": check_table,
    "image": check_images,
    "tokens": check_text,
    "custom": check_user_dataset,
}


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


def check_devices(config: TrainyardConfig) -> None:
    train = config.train
    cuda = torch.cuda.is_available()
    if train.device == "cuda" and not cuda:
        raise ConfigError("train.device = 'cuda': no CUDA device is visible; use 'auto' or 'cpu'")
    if not (train.device == "cuda" or (train.device == "auto" and cuda)):
        return
    visible = torch.cuda.device_count()
    if train.gpus is not None and max(train.gpus) >= visible:
        raise ConfigError(
            f"train.gpus = {train.gpus}: only {visible} GPU(s) visible (0 to {visible - 1}); "
            "list those, or null for all"
        )
    if train.workers > visible:
        raise ConfigError(
            f"train.workers = {train.workers}: only {visible} GPU(s) visible and "
            "CUDA runs one worker per GPU; lower train.workers or set train.device: cpu"
        )


def check_classes_fit_split(config: TrainyardConfig, rows: int, classes: int, source: Path) -> None:
    """The stratified split puts every class into train, val and test, so each needs at least
    one row per class. The sizes are those of the split's two train_test_split calls
    (sklearn takes the ceiling of each held-out share), which refuse otherwise, after launch."""
    split = config.split
    holdout = split.val_fraction + split.test_fraction
    rest = math.ceil(rows * holdout)
    test = math.ceil(rest * (split.test_fraction / holdout))
    sizes = {"train": rows - rest, "val": rest - test, "test": test}
    name = min(sizes, key=sizes.__getitem__)
    if sizes[name] < classes:
        fix = f"raise split.{name}_fraction"
        if name == "train":
            fix = "lower split.val_fraction and split.test_fraction"
        raise DataError(
            f"{source}: {classes} classes, but the {name} split gets {sizes[name]} of the "
            f"{rows} rows, and a stratified split needs one per class in each; {fix}, or use "
            "more rows per class"
        )


def check_batch_fits_shard(config: TrainyardConfig, rows: int) -> None:
    """Each worker's shard of the training split must hold at least one full batch."""
    holdout = config.split.val_fraction + config.split.test_fraction
    train_rows = rows - math.ceil(rows * holdout)
    # workers x nodes, of which each model-parallel group reads one shard
    world = config.train.data_workers
    unit = "workers" if config.train.parallel.model_workers == 1 else "model replicas"
    shard = train_rows // world
    if shard < 1:
        raise ConfigError(
            f"train.workers = {config.train.workers}: the training split has only {train_rows} rows, "
            f"fewer than the {world} {unit}; use fewer workers or more data"
        )
    if config.train.batch_size > shard:
        raise ConfigError(
            f"train.batch_size = {config.train.batch_size}: larger than each worker's shard of the training "
            f"split ({train_rows} rows / {world} {unit} = {shard}); lower it or use fewer workers"
        )
