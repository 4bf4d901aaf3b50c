"""Model registry. No torch.distributed here: wrapping happens in trainyard.parallel.

A factory takes `in_features`, `num_classes` and the keyword options from `model.options`.
Users add their own with `model.name: package.module:factory`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from trainyard.config import ModelConfig
from trainyard.errors import CheckpointError, ConfigError

ModelFactory = Callable[..., nn.Module]


def mlp(
    in_features: int,
    num_classes: int,
    hidden_sizes: Sequence[int] = (128, 64),
    dropout: float = 0.0,
) -> nn.Module:
    layers: list[nn.Module] = []
    width = in_features
    for hidden in hidden_sizes:
        # Identity keeps the layer indices (checkpoint keys) of a model with dropout.
        layers += [
            nn.Linear(width, hidden),
            nn.ReLU(),
            nn.Dropout(dropout) if dropout else nn.Identity(),
        ]
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def linear(in_features: int, num_classes: int) -> nn.Module:
    """Multinomial logistic regression."""
    return nn.Linear(in_features, num_classes)


REGISTRY: dict[str, ModelFactory] = {"mlp": mlp, "linear": linear}


def resolve_factory(name: str) -> ModelFactory:
    if name in REGISTRY:
        return REGISTRY[name]
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"model.name = {name!r}: unknown model; use one of {', '.join(REGISTRY)} "
            "or an import path package.module:factory"
        )
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"model.name = {name!r}: cannot import ({exc})") from None
    if not callable(factory):
        raise ConfigError(f"model.name = {name!r}: {attr} is not callable")
    return factory


def build_model(spec: ModelConfig, in_features: int, num_classes: int) -> nn.Module:
    factory = resolve_factory(spec.name)
    try:
        model = factory(in_features=in_features, num_classes=num_classes, **spec.options)
    except TypeError as exc:
        raise ConfigError(f"model.options = {spec.options!r}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model.name = {spec.name!r}: factory returned {type(model).__name__}, not nn.Module"
        )
    return model


def check_model_builds(spec: ModelConfig, in_features: int, num_classes: int) -> int:
    """Validate name and options before launch without allocating weights (meta device);
    returns the parameter count."""
    with torch.device("meta"):
        model = build_model(spec, in_features, num_classes)
    return sum(p.numel() for p in model.parameters())


def describe(spec: ModelConfig, in_features: int, num_classes: int) -> dict[str, Any]:
    """The architecture a checkpoint was made for; loading compares it."""
    return {
        "name": spec.name,
        "options": dict(spec.options),
        "in_features": in_features,
        "num_classes": num_classes,
    }


def architecture_differences(saved: dict[str, Any] | None, wanted: dict[str, Any]) -> list[str]:
    """What differs between two `describe` results, as 'field=saved there, wanted here'."""
    saved = saved or {}
    return [
        f"{field}={saved.get(field)!r} there, {wanted.get(field)!r} here"
        for field in ("name", "options", "in_features", "num_classes")
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
