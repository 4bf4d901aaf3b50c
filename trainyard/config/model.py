"""What is learned and how it is judged: the `task` and `model` sections."""

from __future__ import annotations

import copy
import math
import re
from typing import Any

from pydantic import Field, field_validator

from trainyard.config.base import Section
from trainyard.factories import locate_factory

BUILT_IN_TASKS = ("classification", "regression", "language_model")
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
