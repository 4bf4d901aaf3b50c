"""A trained model's life after training: the `registry`, `promote`, `retrain` and
`inference` sections."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from trainyard.config.base import MAX_JOB_S, Section


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
