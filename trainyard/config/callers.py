"""Settings for a flow run that anyone with Prefect API access may start: params.yaml with
the run's `overrides`, minus what only the project's owner may choose.

params.yaml is the project owner's file; a deployment run's `overrides` come from whoever
can call Prefect's API. So overrides may tune a run (epochs, workers, batch size, a
registered model, a sweep's trial budget) but not name code to import (`data.dataset`,
`model.name` / `task.name` as package.module:factory, a sweep space over those) nor say
where the project's credentials are sent (`storage.*`, `sweep.storage`): those stay in
params.yaml. Each refusal is one ConfigError line naming the override.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from trainyard.config.loading import load_config
from trainyard.config.model import BUILT_IN_TASKS
from trainyard.config.overrides import PlainLoader
from trainyard.config.settings import TrainyardConfig
from trainyard.errors import ConfigError
from trainyard.factories import REGISTERED_MODELS

# Keys whose value names code that trainyard imports (trainyard.factories resolves them).
CODE_KEYS = ("data.dataset", "model.name", "task.name")
# Keys that say where the project's credentials go (the store's keys, the study database).
DESTINATION_KEYS = ("storage", "sweep.storage")
_HARMLESS = {"model.name": REGISTERED_MODELS, "task.name": BUILT_IN_TASKS}


def load_caller_config(params_path: Path, overrides: list[str]) -> TrainyardConfig:
    """params.yaml with `overrides` applied (validated as `-S` is), refused in one line when
    an override chooses code to import or where credentials go."""
    for override in overrides:
        _refuse_owner_key(override)
    base = load_config(params_path)
    config = load_config(params_path, overrides) if overrides else base
    # An override of a whole section (`model={name: ...}`) reaches the same keys.
    for key in (*CODE_KEYS, "storage.endpoint", "storage.bucket", "storage.prefix"):
        if _value(config, key) != _value(base, key) and _names_owner_choice(key, config):
            raise ConfigError(_refusal(key, f"sets {key}={_value(config, key)}"))
    if config.sweep.storage != base.sweep.storage:
        raise ConfigError(_refusal("sweep.storage", "sets sweep.storage"))
    for key in {*config.sweep.space, *base.sweep.space}:
        owner_key = _owner_key(key)
        if owner_key and config.sweep.space.get(key) != base.sweep.space.get(key):
            raise ConfigError(_refusal(owner_key, f"changes the sweep space over {key}"))
    return config


def _owner_key(key: str) -> str | None:
    """The owner's key that `key` is or lies under, if any."""
    for owner_key in (*CODE_KEYS, *DESTINATION_KEYS):
        if key == owner_key or key.startswith(owner_key + "."):
            return owner_key
    return None


def _refuse_owner_key(override: str) -> None:
    key, _, value = override.partition("=")
    key = key.strip()
    owner_key = _owner_key(key)
    if owner_key is not None:
        if _as_read(value) in _HARMLESS.get(key, ()):
            return  # a registered model or a built-in task names no code of the caller's
        raise ConfigError(_refusal(owner_key, repr(override)))
    swept = _owner_key(key.removeprefix("sweep.space.")) if key.startswith("sweep.space.") else None
    if swept is not None:
        raise ConfigError(_refusal(swept, repr(override)))


def _as_read(value: str) -> Any:
    """The value as settings read it (YAML): node 0 hands its settings to the other nodes
    JSON-quoted (`model.name="linear"`), the same value as `model.name=linear`."""
    try:
        read = yaml.load(value, Loader=PlainLoader)
    except (yaml.YAMLError, RecursionError):
        return value.strip()  # not YAML: the text itself, as an override reads it
    return read if isinstance(read, str) else None


def _names_owner_choice(key: str, config: TrainyardConfig) -> bool:
    return key.startswith("storage.") or _value(config, key) not in (*_HARMLESS.get(key, ()), None)


def _value(config: TrainyardConfig, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


def _refusal(key: str, what: str) -> str:
    why = "code to import" if key in CODE_KEYS else "where the project's credentials go"
    return (
        f"overrides: {what}: {key} chooses {why}, which a flow run's overrides may not; "
        "put it in the project's params.yaml"
    )
