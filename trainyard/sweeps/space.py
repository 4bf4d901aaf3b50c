"""A trial's parameters: sampled from `sweep.space`, applied to the sweep's settings."""

from __future__ import annotations

from typing import Any

import optuna

from trainyard.config import SearchParam, TrainyardConfig, config_from_dict, set_key
from trainyard.runtime.persistent import SHAPE_KEYS


def suggest(trial: optuna.Trial, space: dict[str, SearchParam]) -> dict[str, Any]:
    """Ask the trial for a value of each parameter (the sampler decides which)."""
    params: dict[str, Any] = {}
    for key, param in space.items():
        if param.type == "categorical":
            assert param.choices is not None  # SearchParam requires choices for a categorical
            params[key] = trial.suggest_categorical(key, param.choices)
            continue
        assert param.low is not None and param.high is not None  # required likewise
        if param.type == "int":
            step = int(param.step or 1)
            params[key] = trial.suggest_int(
                key, int(param.low), int(param.high), step=step, log=param.log
            )
        else:
            params[key] = trial.suggest_float(
                key, param.low, param.high, step=param.step, log=param.log
            )
    return params


def trial_config(config: TrainyardConfig, params: dict[str, Any]) -> TrainyardConfig:
    """The sweep's settings with a trial's values in place (validated like any settings)."""
    raw = config.model_dump(mode="json")
    for key, value in params.items():
        set_key(raw, key, value)
    return config_from_dict(raw, source="sweep trial")


def touches_workers(space: dict[str, SearchParam]) -> bool:
    """Whether trials may run on workers of other shapes than the sweep's settings'."""
    return any(key.startswith("train.") and key[len("train.") :] in SHAPE_KEYS for key in space)


def grid_space(space: dict[str, SearchParam]) -> dict[str, list[Any]]:
    return {key: param.grid() or [] for key, param in space.items()}


def extreme_configs(config: TrainyardConfig) -> list[tuple[str, Any, TrainyardConfig]]:
    """(key, value, settings) for each bound and choice of each parameter, the others at
    the sweep's settings: what preflight checks before any trial starts."""
    return [
        (key, value, trial_config(config, {key: value}))
        for key, param in config.sweep.space.items()
        for value in param.values_to_check()
    ]
