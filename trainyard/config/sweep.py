"""A hyperparameter search: the `sweep` section and one dimension of its space."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from trainyard.config.base import MAX_JOB_S, URL_PASSWORD, Section


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
        low, high = self.bounds()
        cast = int if self.type == "int" else float
        return [cast(low), cast(high)]

    def grid(self) -> list[Any] | None:
        """Every value, for the grid sampler; None when the dimension is continuous."""
        if self.type == "categorical":
            return list(self.choices or [])
        low, high = self.bounds()
        if self.step is None:
            return None if self.type == "float" else list(range(int(low), int(high) + 1))
        count = int((high - low) / self.step + 1e-9) + 1
        cast = int if self.type == "int" else float
        return [cast(round(low + i * self.step, 12)) for i in range(count)]

    def bounds(self) -> tuple[float, float]:
        """(low, high) of a float or int parameter, which `_well_formed` requires."""
        if self.low is None or self.high is None:
            raise ValueError(f"a {self.type} parameter needs low < high")
        return self.low, self.high


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
    heartbeat_s: int = Field(
        15,
        ge=1,
        le=3600,
        description="database storages (PostgreSQL, MySQL): each running trial is marked alive "
        "this often; one unmarked for twice as long (its host died) is failed and retried by "
        "another sweep process of the study, from its last checkpoint",
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
        if URL_PASSWORD.match(value):
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
