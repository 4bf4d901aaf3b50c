"""Tasks: what the targets are, the loss, the metrics, and the monitored metric.

The engine speaks only through an `Objective`: the loop asks it for a batch's loss, the
evaluation for per-batch sums it all-reduces and then turns into metrics, and retention,
the record and the CLI read `monitor` / `mode`. Nothing else names a task's metrics.

(Named `objectives` so it is never confused with the Prefect tasks in the top-level
`tasks/` package; users still write `task.name`.)
"""

from __future__ import annotations

from trainyard.config import TaskConfig
from trainyard.data.split import SplitSchema
from trainyard.objectives.base import Objective, TargetStats
from trainyard.objectives.classification import Classification
from trainyard.objectives.language_model import LanguageModel
from trainyard.objectives.regression import Regression

BUILT_IN = {
    "classification": Classification,
    "regression": Regression,
    "language_model": LanguageModel,
}

__all__ = [
    "BUILT_IN",
    "Classification",
    "LanguageModel",
    "Objective",
    "Regression",
    "TargetStats",
    "build_objective",
]


def build_objective(name: str, stats: TargetStats | None = None) -> Objective:
    """The task `name` (built in, or `package.module:factory`) for data with `stats`."""
    if name in BUILT_IN:
        return BUILT_IN[name](stats)
    import importlib

    module, _, attr = name.partition(":")
    objective = getattr(importlib.import_module(module), attr)(stats)
    if not isinstance(objective, Objective):
        raise TypeError(f"task.name = {name!r}: factory returned {type(objective).__name__}")
    return objective


def target_kind(name: str) -> str:
    """What the task's targets are ("class", "value" or next "tokens"): how its data is read
    and split."""
    return build_objective(name).target_kind


def objective_for(task: TaskConfig, schema: SplitSchema) -> Objective:
    """The run's task, knowing its targets from the training split's schema."""
    stats = TargetStats(
        num_classes=schema.num_outputs if schema.target != "value" else None,
        mean=schema.target_mean,
        std=schema.target_std,
    )
    objective = build_objective(task.name, stats)
    objective.mode(monitored(task, objective))  # a misspelt task.monitor fails here
    return objective


def monitored(task: TaskConfig, objective: Objective) -> str:
    return task.monitor or objective.default_monitor


def best_by(keep_best_by: str, task: TaskConfig, objective: Objective) -> tuple[str, str] | None:
    """checkpoint.keep_best_by as (validation metric, direction), or None."""
    if keep_best_by == "none":
        return None
    metric = monitored(task, objective) if keep_best_by == "monitor" else keep_best_by[4:]
    if keep_best_by != "monitor" and metric not in objective.metrics:
        raise ValueError(
            f"checkpoint.keep_best_by = {keep_best_by!r}: the {objective.name} task has no such "
            f"metric; use monitor, none or val_ + one of {', '.join(objective.metrics)}"
        )
    return f"val_{metric}", objective.mode(metric)
