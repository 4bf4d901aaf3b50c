"""What a torchrun job hands back to the flow, through the store, as typed models: a renamed
or missing field fails at the boundary, not as a KeyError later. Fields are only added."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from trainyard.runs import ExperimentInfo


class Contract(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TrainingResult(Contract):
    """`runs/<id>/training.json`, written by rank 0 when training ends."""

    world_size: int
    device: str
    backend: str
    steps: int  # the global step reached
    # One row per epoch, restored ones included; counts (epoch, rows) stay integers.
    history: list[dict[str, int | float]]
    checkpoints: list[str]  # retained committed checkpoints, ascending
    final_checkpoint: str | None
    experiments: list[ExperimentInfo]  # one per rank
    samples_per_s_per_rank: list[float]
    first_step_at: float | None
    seconds: float
    restarts: int  # torchrun restarts of the worker group
    resumed_from: str | None
    warm_start: bool
    resumes: list[dict[str, Any]] = Field(default_factory=list)
    steps_redone: int = 0
    peak_rss_mb_per_rank: list[float] = Field(default_factory=list)  # each worker's high-water


class EvaluationResult(Contract):
    """`runs/<id>/evaluation.json`: a checkpoint scored on one split, exactly."""

    split: str
    checkpoint: str
    rows: int
    metrics: dict[str, float]  # the task's metrics, by name
