"""Typed settings. params.yaml is parsed and validated here, and only here.

Each section is a pydantic model that rejects unknown keys; `load_config` turns the first
validation failure into one ConfigError line naming the key, the value and what is allowed.
"""

from __future__ import annotations

import copy
import difflib
import math
import re
import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from trainyard.data_spec import (
    DATA_SUFFIXES,
    IMAGE_ARRAY_SUFFIXES,
    TABLE_SUFFIXES,
    TEXT_SUFFIXES,
    data_kind,
)
from trainyard.errors import ConfigError
from trainyard.factories import locate_factory

BUILT_IN_TASKS = ("classification", "regression", "language_model")
DATA_DIR = "data"
BUNDLED_DIGITS = "data/raw/digits.csv"
_BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_URL_PASSWORD = re.compile(r"(\w[\w+.-]*://[^/@\s:]*:)[^/@\s]*@")
_VALUE_REPR = 80  # characters of a value shown in an error line
# Bounds of the settings in seconds. 1e308 passes `gt=0` and then overflows timedelta,
# threading's TIMEOUT_MAX (~292 years) and c10d's millisecond timeouts inside the workers,
# after everything has started. A wait or a retry is bounded by a week; a whole job by 30 days.
MAX_WAIT_S = 7 * 24 * 3600
# torchrun's agent gives interrupted workers this long (trainyard.cli.interrupts.SHUTDOWN_S).
MAX_INTERRUPT_GRACE_S = 600
MAX_JOB_S = 30 * 24 * 3600
MAX_EPOCHS = 100_000
MAX_IMAGE_SIDE = 4096  # pixels: a split holds every image at this size, uncompressed
DEFAULT_MODEL = "mlp"
_MLP_OPTIONS = {"hidden_sizes": [128, 64], "dropout": 0.1}


def _all_finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_all_finite(v) for v in value.values())
    if isinstance(value, list | tuple):
        return all(_all_finite(v) for v in value)
    return True


class Section(BaseModel):
    # allow_inf_nan=False: every float setting of every section, today's and tomorrow's, is
    # finite. inf and nan pass range checks such as gt=0 (nan compares false) and only fail
    # after launch.
    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False
    )


class DataConfig(Section):
    dataset: str | None = Field(
        None,
        description="package.module:factory: your own dataset, called as factory(path) to read "
        "data.path (a trainyard.datasets.MapDataset); default: the built-in reader of its kind",
    )
    path: str = Field(
        BUNDLED_DIGITS,
        description="inside data/: a CSV/Parquet table, an .npy/.npz image array, a folder of "
        "images per class (<class>/<image>: PNG, JPEG, BMP, GIF, TIFF, WebP, .npy, .pgm) or a "
        ".txt corpus (the kind follows from the path), or any file data.dataset reads",
    )
    label_column: str = Field("label", min_length=1)
    context: int = Field(64, ge=2, le=65536, description="tokens per window (text corpora)")
    tokenizer: Literal["char", "byte"] = Field("char", description="text corpora: token level")
    image_size: tuple[int, int] | None = Field(
        None,
        description="image folders: [height, width] every image is resized to "
        "(null: the most common size in the folder)",
    )
    channels: Literal[1, 3] | None = Field(
        None,
        description="image folders: 1 (grey) or 3 (RGB) channels every image is converted to "
        "(null: the most common)",
    )
    augment: Literal["none", "flip_crop"] = Field(
        "none",
        description="images: flip_crop pads 4 px, crops back at random and flips horizontally "
        "at random, per training sample, seeded by (train.seed, epoch, row)",
    )

    @field_validator("image_size", mode="before")
    @classmethod
    def _height_and_width(cls, value: Any) -> Any:
        ok = isinstance(value, list | tuple) and len(value) == 2
        if value is not None and not (
            ok and all(type(n) is int and 1 <= n <= MAX_IMAGE_SIDE for n in value)
        ):
            raise ValueError(
                f"must be [height, width] in pixels, each 1 to {MAX_IMAGE_SIDE}, e.g. [32, 32]; "
                "or null for the folder's most common size"
            )
        return value

    @model_validator(mode="after")
    def _image_settings_need_images(self) -> DataConfig:
        given = [
            f"{key} = {list(value) if isinstance(value, tuple) else value!r}"
            for key, default in (("image_size", None), ("channels", None), ("augment", "none"))
            if (value := getattr(self, key)) != default
        ]
        if given and self.kind != "image":  # a section's rule: the line names its keys
            held = "data read by data.dataset" if self.dataset else f"{self.kind} data"
            raise ValueError(
                f"{given[0]} applies to images, but path {self.path!r} holds {held}; "
                "remove it or point data.path at an image folder"
            )
        return self

    @field_validator("dataset")
    @classmethod
    def _dataset_found(cls, value: str | None) -> str | None:
        if value is not None:
            if ":" not in value:
                raise ValueError("must be an import path package.module:factory")
            locate_factory(value)  # statically, as model.name: nothing is imported yet
        return value

    @field_validator("path")
    @classmethod
    def _inside_data_folder(cls, value: str, info: ValidationInfo) -> str:
        parts = Path(value).parts
        if Path(value).is_absolute() or ".." in parts or len(parts) < 2 or parts[0] != DATA_DIR:
            raise ValueError(
                f"must be a path inside the project's {DATA_DIR}/ folder, e.g. {BUNDLED_DIGITS}"
            )
        suffix = Path(value).suffix.lower()
        if suffix and suffix not in DATA_SUFFIXES and not info.data.get("dataset"):
            raise ValueError(
                f"must be a table ({', '.join(TABLE_SUFFIXES)}), an image array "
                f"({', '.join(IMAGE_ARRAY_SUFFIXES)}), a text corpus ({', '.join(TEXT_SUFFIXES)}) "
                "or an image folder"
            )
        return value

    @property
    def kind(self) -> str:
        """How the data is split and read: "custom" (data.dataset) or its DataKind."""
        return "custom" if self.dataset else data_kind(self.path)


class SplitConfig(Section):
    val_fraction: float = Field(0.15, gt=0, lt=1)
    test_fraction: float = Field(0.15, gt=0, lt=1)
    seed: int = 42

    @model_validator(mode="after")
    def _leaves_training_rows(self) -> SplitConfig:
        if self.val_fraction + self.test_fraction >= 0.9:
            raise ValueError(
                f"val_fraction + test_fraction = {self.val_fraction + self.test_fraction:g}; "
                "must be below 0.9 so that training keeps at least 10% of the rows"
            )
        return self


class ModelConfig(Section):
    name: str = Field(
        DEFAULT_MODEL,
        description="a registered model (mlp, linear) or an import path package.module:factory",
    )
    options: dict[str, Any] = Field(
        # The mlp's options are its own: another model named without options gets none.
        default_factory=lambda fields: (
            copy.deepcopy(_MLP_OPTIONS) if fields.get("name") == DEFAULT_MODEL else {}
        ),
        description="keyword arguments for the model factory",
    )

    @field_validator("name")
    @classmethod
    def _known_or_found(cls, value: str) -> str:
        locate_factory(value)  # statically: torch is not imported yet, and nothing else is
        return value

    @field_validator("options")
    @classmethod
    def _finite_numbers(cls, value: dict[str, Any]) -> dict[str, Any]:
        # Free-form, so allow_inf_nan does not reach it: a factory given nan builds a model
        # that trains to nan, or fails inside the workers.
        if not _all_finite(value):
            raise ValueError("holds inf or nan; every number must be finite")
        return value


class TrainConfig(Section):
    workers: int = Field(2, ge=1, le=1024, description="processes per node (one per GPU on CUDA)")
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp", description="ddp: replicated model; fsdp: FSDP2 fully_shard, sharded checkpoints"
    )
    nnodes: int = Field(1, ge=1, le=4096, description="machines the run spans")
    node_rank: int = Field(0, ge=0, description="this machine's index, 0 .. nnodes-1")
    rdzv_endpoint: str | None = Field(
        None, description="host:port of node 0's rendezvous (torchrun c10d); needed when nnodes > 1"
    )
    epochs: int = Field(20, ge=1, le=MAX_EPOCHS)
    batch_size: int = Field(32, ge=1, description="per worker; the global batch is this x workers")
    lr: float = Field(0.05, gt=0, le=10, description="learning rate at lr_reference_batch_size")
    lr_reference_batch_size: int = Field(32, ge=1)
    warmup_epochs: float = Field(1.0, ge=0, le=MAX_EPOCHS)
    optimizer: Literal["sgd", "adamw"] = Field(
        "sgd", description="sgd (Nesterov momentum) or adamw (decoupled weight decay)"
    )
    grad_clip_norm: float | None = Field(
        None, gt=0, description="clip the global gradient norm to this before each update"
    )
    grad_accum_steps: int = Field(
        1,
        ge=1,
        description="micro-batches of batch_size per update; the global batch counts them "
        "(batch_size x workers x grad_accum_steps) and the update is its exact mean gradient",
    )
    compile: bool = Field(False, description="torch.compile the model before wrapping it")
    prefetch: bool = Field(
        True,
        description="read the next steps' batches on a background thread while this step "
        "trains, where a core is free for it (workers x threads_per_worker below the cores); "
        "same batches, same order. false: read on the training thread, e.g. for a data.dataset "
        "whose take() draws from the global RNG or holds thread-bound handles",
    )
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(
        1e-4, ge=0, le=1, description="0 to 1: each update shrinks the weights by lr x this"
    )
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    precision: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="bf16: forward and loss under bfloat16 autocast (weights, gradients and "
        "optimizer stay fp32); the fast path on GPUs with bf16 tensor cores",
    )
    threads_per_worker: int = Field(1, ge=1, le=256)
    gpus: list[int] | None = Field(
        None,
        description="the CUDA devices this run's workers use, one each (CUDA_VISIBLE_DEVICES); "
        "default all; a sweep gives each trial slot its own",
    )
    timeout_s: float = Field(
        3600, gt=0, le=MAX_JOB_S, description="the torchrun job is killed after this"
    )
    max_restarts: int = Field(
        3, ge=0, le=100, description="torchrun restarts all workers this often when one dies"
    )
    hang_timeout_s: float = Field(
        300,
        gt=0,
        le=MAX_WAIT_S,
        description="a worker without progress (or a collective stuck) this long fails the run",
    )

    @field_validator("rdzv_endpoint")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9.\-\[\]:]+:\d{1,5}", value):
            raise ValueError("must be host:port of node 0, e.g. 10.0.0.1:29400")
        return value

    @field_validator("gpus")
    @classmethod
    def _gpu_indices(cls, value: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if value is None:
            return value
        if not value or min(value) < 0 or max(value) > 1023 or len(set(value)) != len(value):
            raise ValueError("must list distinct GPU indices (0, 1, ...), or be null for all")
        workers = info.data.get("workers")
        if workers is not None and len(value) < workers:
            raise ValueError(f"lists {len(value)} GPU(s), fewer than train.workers={workers}")
        return value

    @model_validator(mode="after")
    def _nodes(self) -> TrainConfig:
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be below nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(
                "nnodes > 1 needs rdzv_endpoint: host:port on node 0 that every node can reach"
            )
        return self

    @property
    def world_size(self) -> int:
        return self.workers * self.nnodes


class CheckpointConfig(Section):
    every_n_epochs: int = Field(1, ge=1)
    every_n_steps: int | None = Field(
        None, ge=1, description="also checkpoint mid-epoch every N global steps"
    )
    every_n_minutes: float | None = Field(
        None,
        gt=0,
        le=MAX_WAIT_S / 60,
        description="also checkpoint every N minutes of training (mid-epoch too): long epochs "
        "of any speed lose at most this much work",
    )
    # 0.01, not 0.03: measured on a 2-core machine with a local store, a checkpoint costs
    # training about its absorb time (the store's CPU is the workers'), so the default
    # pays ~1% of training for checkpoints rather than using up a 3% budget on them.
    max_overhead: float | None = Field(
        0.01,
        gt=0,
        lt=1,
        description="skip an every_n_epochs checkpoint while the store cannot take it within "
        "this share of the time (one still uploading, or the last one's serialize + upload "
        "time over this share of the time since it; the first one's, which holds one-time "
        "work, is not counted); the first and the last epoch's are always taken; null: "
        "every every_n_epochs",
    )
    resume: Literal["auto", "never"] = Field(
        "auto",
        description="auto: a run id that already has committed checkpoints continues from its latest",
    )
    on_interrupt: bool = Field(
        True,
        description="SIGINT or SIGTERM (Ctrl-C, a preemption, a cancelled flow run): the "
        "workers stop at the next step, all at the same one, and commit a checkpoint there "
        "before exiting; false: they stop at once and the last committed checkpoint stays",
    )
    # 25 s: a cloud preemption notice is 30 s (GCP, Azure) to 2 minutes (AWS); the agent and
    # the launcher wait this long for the commit, so it must leave them time to exit too.
    interrupt_grace_s: float = Field(
        25,
        gt=0,
        le=MAX_INTERRUPT_GRACE_S,
        description="the longest an interrupted run spends on its last checkpoint; past it "
        "the workers exit and the last committed checkpoint stays",
    )
    keep_last: int = Field(3, description="committed checkpoints kept besides the best and pinned")
    keep_best_by: str = Field(
        "monitor",
        description="also keep the end-of-epoch checkpoint best by this validation metric: "
        "monitor (the task's monitored metric), val_<metric>, or none",
    )
    pinned_steps: list[int] = Field(default_factory=list, description="steps never deleted")
    max_staged: int = Field(
        4, ge=2, description="checkpoints staged locally while uploads lag (or the store is down)"
    )
    upload_backoff_s: float = Field(
        0.5, gt=0, le=MAX_WAIT_S, description="first retry delay; doubles each time"
    )
    upload_backoff_max_s: float = Field(30, gt=0, le=MAX_WAIT_S)
    upload_timeout_s: float = Field(
        600,
        gt=0,
        le=MAX_WAIT_S,
        description="at the end, wait this long for the last uploads, then fail",
    )

    @field_validator("keep_best_by")
    @classmethod
    def _best_by(cls, value: str) -> str:
        if value not in ("monitor", "none") and not re.fullmatch(r"val_\w+", value):
            raise ValueError("must be monitor, none, or a validation metric such as val_loss")
        return value

    @field_validator("keep_last")
    @classmethod
    def _keep_two(cls, value: int) -> int:
        if value < 2:
            raise ValueError(
                "must be at least 2: the newest checkpoint may still be uploading, so the one "
                "before it must stay"
            )
        return value


class StorageConfig(Section):
    endpoint: str = Field(
        "embedded",
        description="'embedded' (local SeaweedFS), 'aws', or an http(s) URL of an S3-compatible store",
    )
    bucket: str = "trainyard"
    prefix: str = ""

    @field_validator("endpoint")
    @classmethod
    def _known_endpoint(cls, value: str) -> str:
        if value not in {"embedded", "aws"} and not re.fullmatch(r"https?://[^\s/]+(/\S*)?", value):
            raise ValueError("must be 'embedded', 'aws' or an http(s):// URL")
        return value

    @field_validator("bucket")
    @classmethod
    def _valid_bucket(cls, value: str) -> str:
        if not _BUCKET_NAME.fullmatch(value):
            raise ValueError(
                "must be an S3 bucket name: 3-63 lowercase letters, digits, '.' or '-'"
            )
        return value

    @field_validator("prefix")
    @classmethod
    def _valid_prefix(cls, value: str) -> str:
        if value.startswith("/") or ".." in value.split("/"):
            raise ValueError("must be a relative key prefix without '..'")
        return value.strip("/")


class TrackingConfig(Section):
    backend: Literal["comet", "none"] = "comet"
    project: str = Field("trainyard", min_length=1)
    workspace: str | None = None
    log_every_n_steps: int = Field(
        20,
        ge=1,
        le=100_000,
        description="one point per rank every N steps (window means); epochs log at their end",
    )
    min_interval_s: float = Field(
        0.5,
        ge=0,
        le=3600,
        description="and at most one per this many seconds, epoch rows too (the last "
        "epoch's always; the run record keeps every epoch): at steps of a millisecond, 20 "
        "steps' points cost the loop 5-10% (Comet writes each metric as a message)",
    )


class StragglersConfig(Section):
    """Flagging a rank whose steps stay slower than the other ranks' (trainyard/stragglers.py)."""

    enabled: bool = Field(
        True, description="compare the ranks' step times each window (one tiny all-reduce)"
    )
    window_steps: int | None = Field(
        None,
        ge=1,
        le=100_000,
        description="steps per window, each rank's median over them compared; "
        "default: tracking.log_every_n_steps",
    )
    windows_in_a_row: int = Field(
        3, ge=1, le=100_000, description="slow windows in a row that make a rank a straggler"
    )
    mad_factor: float = Field(
        3.0,
        gt=0,
        le=100,
        description="slow in a window: its median step more than this many robust standard "
        "deviations (1.4826 x MAD) of the other ranks' medians above their median",
    )
    min_slowdown: float = Field(
        0.2,
        gt=0,
        le=100,
        description="and above it by at least this fraction (0.2: 20% slower), which is what "
        "counts when the other ranks agree closely (a MAD near 0) or are few",
    )
    min_gap_ms: float = Field(
        5.0,
        ge=0,
        le=3_600_000,
        description="and by at least this many milliseconds per step: steps of a few ms on a "
        "busy CPU differ by that much from scheduling alone, which costs a run little",
    )


class TaskConfig(Section):
    name: str = Field(
        "classification",
        description="classification | regression | package.module:factory (an Objective)",
    )
    monitor: str | None = Field(
        None,
        description="the metric retention, pruning and promotion compare (default: the "
        "task's own: accuracy for classification, r2 for regression); its direction follows "
        "the task",
    )

    @field_validator("name")
    @classmethod
    def _known_task(cls, value: str) -> str:
        if value not in BUILT_IN_TASKS and not re.fullmatch(r"[\w.]+:\w+", value):
            raise ValueError(
                f"unknown task; use one of {', '.join(BUILT_IN_TASKS)} or package.module:factory"
            )
        return value


class SearchParam(Section):
    """One dimension of a sweep's search space (Optuna's suggest_float / int / categorical)."""

    type: Literal["float", "int", "categorical"]
    low: float | None = None
    high: float | None = None
    log: bool = Field(False, description="sample on a log scale (low > 0, no step)")
    step: float | None = Field(None, gt=0, description="float/int: values low, low+step, ...")
    choices: list[bool | int | float | str] | None = Field(
        None, min_length=1, description="categorical: the values to choose from"
    )

    @model_validator(mode="after")
    def _well_formed(self) -> SearchParam:
        if self.type == "categorical":
            if not self.choices:
                raise ValueError("a categorical parameter needs choices: [a, b, ...]")
            return self
        if self.low is None or self.high is None or self.low >= self.high:
            raise ValueError(f"a {self.type} parameter needs low < high")
        if self.type == "int" and not (
            float(self.low).is_integer() and float(self.high).is_integer()
        ):
            raise ValueError("an int parameter needs whole-number low and high")
        if self.log and (self.step is not None or self.low <= 0):
            raise ValueError("log: true needs low > 0 and no step")
        return self

    def values_to_check(self) -> list[Any]:
        """The values a trial may get that settle whether the setting accepts them."""
        if self.type == "categorical":
            return list(self.choices or [])
        cast = int if self.type == "int" else float
        return [cast(self.low), cast(self.high)]

    def grid(self) -> list[Any] | None:
        """Every value, for the grid sampler; None when the dimension is continuous."""
        if self.type == "categorical":
            return list(self.choices or [])
        if self.step is None:
            return None if self.type == "float" else list(range(int(self.low), int(self.high) + 1))
        count = int((self.high - self.low) / self.step + 1e-9) + 1
        cast = int if self.type == "int" else float
        return [cast(round(self.low + i * self.step, 12)) for i in range(count)]


def _default_space() -> dict[str, SearchParam]:
    return {
        "train.lr": SearchParam(type="float", low=0.005, high=0.2, log=True),
        "train.batch_size": SearchParam(type="categorical", choices=[16, 32, 64]),
        "model.options.dropout": SearchParam(type="float", low=0.0, high=0.3),
    }


# Settings a trial may not vary: they size the trial (packing) or place the sweep.
_NOT_SEARCHABLE = (
    "sweep.",
    "storage.",
    "train.workers",
    "train.threads_per_worker",
    "train.nnodes",
    "train.node_rank",
    "train.rdzv_endpoint",
    "train.device",
)


class SweepConfig(Section):
    space: dict[str, SearchParam] = Field(
        default_factory=_default_space,
        description="section.key: {type: float|int|categorical, low, high, log, step, choices}",
    )
    sampler: Literal["tpe", "random", "grid", "cmaes"] = "tpe"
    n_trials: int | None = Field(8, ge=1, le=100_000, description="finished trials, all runs")
    timeout_s: float | None = Field(
        None, gt=0, le=MAX_JOB_S, description="start no trial after this many seconds of the sweep"
    )
    pruner: Literal["asha", "median", "hyperband", "none"] = "asha"
    min_epochs: int = Field(
        1, ge=1, description="epochs every trial trains before it may be pruned"
    )
    max_concurrent_trials: int | None = Field(
        None, ge=1, description="default: as many as fit: cores // (workers x threads_per_worker)"
    )
    cores: int | None = Field(None, ge=1, description="cores the sweep may use (default: all)")
    max_failed_trials: int = Field(3, ge=1, description="the sweep stops after this many failures")
    storage: str = Field(
        "",
        description="Optuna storage URL (postgresql://..., mysql://..., grpc://host:port) or a "
        "journal file path; empty: a journal of each sweep's own, .trainyard/sweeps/<id>/",
    )
    seed: int | None = 0

    @field_validator("space")
    @classmethod
    def _searchable(cls, space: dict[str, SearchParam]) -> dict[str, SearchParam]:
        for key in space:
            if key.startswith(_NOT_SEARCHABLE) or key in _NOT_SEARCHABLE:
                raise ValueError(
                    f"{key} cannot be searched: it sizes or places the trials; set it for "
                    "the whole sweep instead"
                )
            if key.count(".") < 1:
                raise ValueError(f"{key}: name a setting as section.key, e.g. train.lr")
        return space

    @field_validator("storage")
    @classmethod
    def _no_password(cls, value: str) -> str:
        if _URL_PASSWORD.match(value):
            raise ValueError(
                "holds a password, which would be written to every run record; leave it out "
                "and set it in the environment (PGPASSWORD for PostgreSQL, a ~/.my.cnf for MySQL)"
            )
        return value

    @model_validator(mode="after")
    def _grid_is_discrete(self) -> SweepConfig:
        if self.sampler == "grid":
            continuous = [key for key, param in self.space.items() if param.grid() is None]
            if continuous:
                raise ValueError(
                    f"sampler grid needs a step for float parameters: {', '.join(continuous)}"
                )
        return self


class RegistryConfig(Section):
    model_name: str = Field(
        "trainyard",
        description="the model `trainyard models` registers into and shows by default",
    )

    @field_validator("model_name")
    @classmethod
    def _identifier(cls, value: str) -> str:
        # A key in the store (registry/<model_name>/...): no '/', no '..', bounded length.
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}", value):
            raise ValueError(
                "must be letters, digits, '-' and '_' (at most 64, starting with a letter or digit)"
            )
        return value


class PromoteConfig(Section):
    """When `retrain` makes its challenger the champion (on the task's monitored test metric)."""

    min_delta: float = Field(
        0.0, ge=0, description="the challenger must beat the champion by more than this"
    )
    min_value: float | None = Field(
        None,
        description="and reach at least this (at most, for a metric minimized); null: no floor",
    )


class RetrainConfig(Section):
    """How `retrain` trains its challenger."""

    init: Literal["scratch", "champion"] = Field(
        "scratch",
        description="scratch: fresh weights; champion: warm-start from the champion's weights "
        "(same model architecture; new optimizer and schedule)",
    )


class InferenceConfig(Section):
    """`trainyard predict` and the `batch_inference` flow: a data-parallel torchrun job."""

    workers: int = Field(
        2, ge=1, le=1024, description="torchrun processes, each a contiguous slice"
    )
    batch_size: int = Field(
        4096,
        ge=1,
        le=1 << 24,
        description="rows per forward pass (text: tokens, so windows of data.context each)",
    )
    shard_rows: int = Field(
        100_000,
        ge=1,
        le=1 << 30,
        description="rows per output Parquet shard; each shard is committed on its own, so a "
        "rerun after a crash redoes at most the shards that were not committed",
    )
    timeout_s: float = Field(
        3600, gt=0, le=MAX_JOB_S, description="the torchrun job is killed after this"
    )
    max_restarts: int = Field(
        3,
        ge=0,
        le=100,
        description="torchrun restarts after a worker dies; committed shards are not redone",
    )


class TrainyardConfig(Section):
    task: TaskConfig = TaskConfig()
    data: DataConfig = DataConfig()
    split: SplitConfig = SplitConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    storage: StorageConfig = StorageConfig()
    tracking: TrackingConfig = TrackingConfig()
    stragglers: StragglersConfig = StragglersConfig()
    sweep: SweepConfig = SweepConfig()
    promote: PromoteConfig = PromoteConfig()
    registry: RegistryConfig = RegistryConfig()
    retrain: RetrainConfig = RetrainConfig()
    inference: InferenceConfig = InferenceConfig()

    @model_validator(mode="after")
    def _space_fits_settings(self) -> TrainyardConfig:
        """Every value a trial may get is a valid setting: checked here, before any trial."""
        base = self.model_dump(mode="json", exclude={"sweep"})
        for key, param in self.sweep.space.items():
            for value in param.values_to_check():
                raw = copy.deepcopy(base)
                set_key(raw, key, value)
                try:
                    TrainyardConfig.model_validate({**raw, "sweep": {"space": {}}})
                except ValidationError as exc:
                    raise ValueError(_unsearchable(key, value, exc.errors()[0])) from None
        return self

    @property
    def global_batch_size(self) -> int:
        return self.train.batch_size * self.train.world_size * self.train.grad_accum_steps

    @property
    def scaled_lr(self) -> float:
        """Linear scaling rule (Goyal et al. 2017): lr grows with the global batch."""
        return self.train.lr * self.global_batch_size / self.train.lr_reference_batch_size


def load_config(params_path: Path, overrides: list[str] | None = None) -> TrainyardConfig:
    """Read params.yaml, apply `key=value` overrides, validate; raise ConfigError on any fault."""
    source = params_path.name
    if not params_path.is_file():
        raise ConfigError(f"{params_path} not found: run trainyard from the project folder")
    try:
        raw = yaml.load(params_path.read_text(), Loader=_PlainLoader) or {}
    except _AliasRefused as exc:
        raise ConfigError(f"{source}: {exc} (line {exc.line}); write the values out") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML ({_first_line(exc)})") from None
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply to be settings") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: must be a mapping of sections (data, train, ...)")
    written_for = _model_name(raw)
    for override in overrides or []:
        apply_override(raw, override)
    left_out = _leave_out_other_models_options(raw, written_for, overrides or [])
    config = config_from_dict(raw, source=source)
    if left_out:
        print(
            f"trainyard: model.name={config.model.name}: {source}'s model.options for "
            f"{written_for} left out ({', '.join(left_out)}); give this model's own with "
            "-S model.options.KEY=VALUE",
            file=sys.stderr,
        )
    return config


def _model_name(raw: dict[str, Any]) -> Any:
    model = raw.get("model") or {}
    return model.get("name", DEFAULT_MODEL) if isinstance(model, dict) else None


def _leave_out_other_models_options(
    raw: dict[str, Any], written_for: Any, overrides: list[str]
) -> list[str]:
    """The file's model.options were written for its model.name: when -S switches the model,
    they are left out (another model's factory refuses them, or reads them otherwise): the
    options given with -S remain, or else the new model's defaults. Returns the names left out."""
    model = raw.get("model")
    options = model.get("options") if isinstance(model, dict) else None
    if not isinstance(options, dict) or _model_name(raw) == written_for:
        return []
    keys = {override.partition("=")[0].strip() for override in overrides}
    if keys & {"model", "model.options"}:
        return []  # the options were all given with -S: validated as they are
    given = {key.split(".")[2] for key in keys if key.startswith("model.options.")}
    model["options"] = {name: value for name, value in options.items() if name in given}
    if not model["options"]:
        del model["options"]  # the new model's default options
    return [str(name) for name in options if name not in given]


class _AliasRefused(yaml.YAMLError):
    def __init__(self, line: int):
        super().__init__("YAML anchors and aliases (&name / *name) are not allowed")
        self.line = line


class _PlainLoader(yaml.SafeLoader):
    """SafeLoader without anchors and aliases: a few hundred bytes of nested aliases
    ("billion laughs") expand to gigabytes, and settings never need them."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise _AliasRefused(event.start_mark.line + 1)
        return super().compose_node(parent, index)


def config_from_dict(raw: dict[str, Any], source: str = "params") -> TrainyardConfig:
    try:
        return TrainyardConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {_describe(exc, raw)}") from None


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Set `section.key=value` (the value read as YAML) in raw settings, in place."""
    key, sep, text = override.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"-S {override!r}: expected section.key=value, e.g. -S train.epochs=5")
    try:
        value = yaml.load(text, Loader=_PlainLoader) if text else ""
    except _AliasRefused as exc:
        raise ConfigError(f"-S {override!r}: {exc}; write the value out") from None
    except (yaml.YAMLError, RecursionError):
        value = text  # not YAML: the text itself, e.g. a name with a ':'
    try:
        set_key(raw, key, value)
    except ValueError as exc:
        raise ConfigError(f"-S {override!r}: {exc}") from None


def set_key(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set `section.key` (any depth) in raw settings, in place."""
    node = raw
    *parents, leaf = key.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"{part} is not a section")
        node = child
    node[leaf] = value


def _describe(exc: ValidationError, raw: dict[str, Any]) -> str:
    errors = exc.errors()
    # A value refused by every member of a union (e.g. inf among `choices`) is reported once
    # per member; the finiteness error is the one that says what is wrong.
    error = next((e for e in errors if e["type"] == "finite_number"), errors[0])
    if error["type"] == "finite_number" and _lookup(raw, error["loc"]) is None:
        error = {**error, "loc": error["loc"][:-1]}  # it ends in a union member's tag, not a key
    key = _shorten(".".join(str(part) for part in error["loc"]))
    if not key:  # a rule over the whole settings names its keys itself
        return error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        return f"unknown key '{key}'{_did_you_mean(error['loc'])}"
    message = error["msg"].removeprefix("Value error, ")
    value = _lookup(raw, error["loc"])
    if "input" in error and error["type"] != "missing" and not isinstance(value, dict):
        # A whole section's rule names its keys itself; a huge value is shown cut short.
        return f"{key} = {_shorten(repr(_masked(value)))}: {message}"
    return f"{key}: {message}"


def _unsearchable(key: str, value: Any, error: Any) -> str:
    if error["type"] == "extra_forbidden":
        return f"sweep.space.{key}: no such setting{_did_you_mean(error['loc'])}"
    message = error["msg"].removeprefix("Value error, ")
    return f"sweep.space.{key}: a trial could get {value!r}, which {key} refuses: {message}"


def _masked(value: Any) -> Any:
    """A URL's password never reaches an error line."""
    return _URL_PASSWORD.sub(r"\1***@", value) if isinstance(value, str) else value


def _shorten(text: str, limit: int = _VALUE_REPR) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _did_you_mean(loc: tuple) -> str:
    model: type[BaseModel] = TrainyardConfig
    for part in loc[:-1]:
        annotation = model.model_fields[str(part)].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return ""
        model = annotation
    allowed = list(model.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"{hint} (allowed: {', '.join(allowed)})"


def _lookup(raw: Any, loc: tuple) -> Any:
    for part in loc:
        if (
            isinstance(raw, dict)
            and part in raw
            or isinstance(raw, list)
            and isinstance(part, int)
            and part < len(raw)
        ):
            raw = raw[part]
        else:
            return None
    return raw


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0]
