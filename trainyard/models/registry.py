"""Model registry: `model.name` resolved to a factory, built, checked and described. No
torch.distributed here: wrapping happens in trainyard.parallel.wrap.

A factory takes the data's `DataSpec` and the keyword options from `model.options`. The
built-in ones are trainyard.models.zoo's; users add their own with
`model.name: package.module:factory`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainyard.config import ModelConfig
from trainyard.data_spec import DataSpec
from trainyard.errors import CheckpointError, ConfigError
from trainyard.factories import REGISTERED_MODELS, locate_factory
from trainyard.models.zoo import SPEC_FACTORIES

ModelFactory = Callable[..., nn.Module]


def registry() -> dict[str, ModelFactory]:
    """Built-in factories, each called as factory(spec, **model.options)."""
    assert tuple(SPEC_FACTORIES) == REGISTERED_MODELS, "factories.REGISTERED_MODELS names them"
    return SPEC_FACTORIES


def table_spec(in_features: int, num_outputs: int) -> DataSpec:
    """The description of a table with `in_features` columns and `num_outputs` outputs."""
    return DataSpec("table", (in_features,), num_outputs)


def resolve_factory(name: str) -> ModelFactory:
    if name in REGISTERED_MODELS:
        return registry()[name]
    try:
        locate_factory(name)  # the settings check: a project or installed module defines it
    except ValueError as exc:
        raise ConfigError(f"model.name = {name!r}: {exc}") from None
    module_name, _, attr = name.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"model.name = {name!r}: cannot import ({exc})") from None
    if not callable(factory):
        raise ConfigError(f"model.name = {name!r}: {attr} is not callable")
    return factory


def _call_arguments(factory: ModelFactory, data: DataSpec) -> tuple[tuple, dict[str, Any]]:
    """A factory takes the data's DataSpec first; one written for tables only, with
    `in_features` and `num_classes` keywords, still gets those."""
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return (data,), {}
    if "in_features" in parameters and "num_classes" in parameters:
        return (), {"in_features": data.num_features, "num_classes": data.num_outputs}
    return (data,), {}


def build_model(spec: ModelConfig, data: DataSpec) -> nn.Module:
    factory = resolve_factory(spec.name)
    args, kwargs = _call_arguments(factory, data)
    _check_arguments(factory, spec, args, kwargs)
    try:
        model = factory(*args, **kwargs, **spec.options)
    except Exception as exc:  # the user's code: one line naming it, not a traceback
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ConfigError(
            f"model.name = {spec.name!r}: the factory raised {type(exc).__name__}"
            f"{': ' + reason if reason else ''} (model.options = {spec.options!r})"
        ) from None
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model.name = {spec.name!r}: factory returned {type(model).__name__}, not nn.Module"
        )
    return model


def _check_arguments(
    factory: ModelFactory, spec: ModelConfig, args: tuple, kwargs: dict[str, Any]
) -> None:
    """model.options is to blame only when the factory cannot take them: bind the call's
    arguments to its signature before calling it."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return  # no signature to read (a builtin): the call itself will tell
    try:
        signature.bind(*args, **kwargs, **spec.options)
    except TypeError as exc:
        raise ConfigError(f"model.options = {spec.options!r}: {exc}") from None


def check_model_builds(spec: ModelConfig, data: DataSpec) -> int:
    """Validate name and options before launch without allocating weights (meta device);
    returns the parameter count."""
    with torch.device("meta"):
        model = build_model(spec, data)
    return sum(p.numel() for p in model.parameters())


def describe(spec: ModelConfig, data: DataSpec) -> dict[str, Any]:
    """The architecture a checkpoint was made for, and the data it reads; loading compares
    it and builds the model again from it."""
    return {
        "name": spec.name,
        "options": dict(spec.options),
        "in_features": data.num_features,
        "num_classes": data.num_outputs,
        "data": data.to_dict(),
    }


def model_data_spec(described: dict[str, Any]) -> DataSpec:
    """The DataSpec a `describe` result holds (a table's, for manifests written before)."""
    if "data" in described:
        return DataSpec.from_dict(described["data"])
    return table_spec(described["in_features"], described["num_classes"])


def architecture_differences(saved: dict[str, Any] | None, wanted: dict[str, Any]) -> list[str]:
    """What differs between two `describe` results, as 'field=saved there, wanted here'."""
    saved = saved or {}
    compared = ["name", "options", "in_features", "num_classes"]
    if "data" in saved:  # manifests written before data specs were recorded lack it
        compared.append("data")
    return [
        f"{field}={saved.get(field)!r} there, {wanted.get(field)!r} here"
        for field in compared
        if saved.get(field) != wanted.get(field)
    ]


def check_same_architecture(saved: dict[str, Any], wanted: dict[str, Any], source: str) -> None:
    """Refuse, before any weight is copied, a checkpoint made for another architecture."""
    differences = architecture_differences(saved, wanted)
    if differences:
        raise CheckpointError(
            f"{source} was made for another model ({'; '.join(differences)}); "
            "train from scratch or use a checkpoint of this architecture"
        )
